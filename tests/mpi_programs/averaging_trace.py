"""The real command line (distbelief.cli.main) for algorithm = "averaging" without
elastic_alpha, recording on every rank the parameters right after each average, so a test
can check that the replicas agree after every average and match a reference computation.

    mpiexec -n R python tests/mpi_programs/averaging_trace.py TRACE_DIR train CONFIG ...

Writes TRACE_DIR/rank-<r>.npy: one row per average (float32).
"""

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.averaging import collective
from distbelief.cli import main

if __name__ == "__main__":
    trace_dir, args = Path(sys.argv[1]), sys.argv[2:]
    rows: list[np.ndarray] = []
    average = collective.Replica.average

    def recording(self, losses, flags):  # test-only: the parameters after each average
        average(self, losses, flags)
        rows.append(self.params.copy())

    collective.Replica.average = recording
    status = main(args)
    np.save(trace_dir / f"rank-{MPI.COMM_WORLD.Get_rank()}.npy", np.array(rows))
    sys.exit(status)
