"""Where a resumed Downpour run starts: set the run up as `train` does (downpour.open_run,
resume required), then every replica pulls the parameters and every shard reports its
optimizer state; all of it is saved as .npy files for the test to compare with the
checkpoint, byte for byte.

    mpiexec -n N python tests/mpi_programs/downpour_start.py CONFIG DUMP_DIR [--set ...]

Files: replica-R.npy (the full vector replica R pulled), shard-S-accum.npy (shard S's
Adagrad accumulator), shard-S-range.npy ([start, stop)), steps.txt from rank 0 (the
step the run resumes at).
"""

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.common import StopSignals
from distbelief.algorithms.downpour import open_run
from distbelief.config import load_config
from distbelief.ps.endpoint import ParameterClient
from distbelief.ps.run_control import TEARDOWN_FREE


def main() -> None:
    config_path, dump = sys.argv[1], Path(sys.argv[2])
    overrides = [arg for arg in sys.argv[3:] if arg != "--set"]
    comm = MPI.COMM_WORLD
    run = open_run(load_config(config_path, overrides), comm, "require", None, StopSignals())
    endpoint = run.endpoint
    if isinstance(endpoint, ParameterClient):
        params = np.zeros(endpoint.size, dtype=np.float32)
        endpoint.pull(params)
        np.save(dump / f"replica-{run.plan.topology.replica_index}.npy", params)
    else:
        np.save(dump / f"shard-{endpoint.rank}-accum.npy", endpoint.optimizer.state()["accum"])
        np.save(dump / f"shard-{endpoint.rank}-range.npy", np.array([endpoint.start,
                                                                     endpoint.stop]))
        if endpoint.rank == 0:
            (dump / "steps.txt").write_text(str(run.start.base))
    run.close(TEARDOWN_FREE)


if __name__ == "__main__":
    main()
