"""One Sandblaster gradient evaluation at the initial parameters, then the shards' gradient
slices gathered to rank 0 (test-only: in a run, vectors never leave the shards) and saved,
for tests/test_sandblaster.py to compare with the single-process gradient. With IDLE > 0,
the coordinator then waits IDLE seconds with nothing for anyone to do, and every rank's
CPU seconds during its role are saved too (idle ranks must sleep, not spin). SPLITS, a
JSON list (per layer, the P+1 block boundaries), gives partitioned replicas unequal blocks
("null": balanced, as the command line has them).

    mpiexec -n N python sandblaster_gradient.py CONFIG OUT.npz [IDLE [SPLITS]]
"""

import json
import sys
import time

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.sandblaster import roles as sandblaster
from distbelief.config import load_config


def one_gradient(idle: float):
    def method(coordinator):
        loss, _ = coordinator.evaluate(0.0, 0)
        coordinator.take_gradient()
        coordinator.last_loss = loss
        until = time.monotonic() + idle
        coordinator._serve_until(lambda: time.monotonic() >= until)
        return "max_steps"
    return method


def main() -> None:
    config = load_config(sys.argv[1])
    idle = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    splits = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
    comm = MPI.COMM_WORLD
    role = sandblaster.start(config, comm, stream=None, splits=splits)
    if isinstance(role, sandblaster.Coordinator):
        role.method = one_gradient(idle)
    cpu, wall = time.process_time(), time.monotonic()
    role.run()
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    mine = (role.store.start, role.store.g) if isinstance(role, sandblaster.ShardServer) else None
    parts = comm.gather(mine, root=0)
    usage = comm.gather((cpu, wall), root=0)
    sandblaster.finish(comm, role)
    if comm.Get_rank() == 0:
        parts = sorted(p for p in parts if p is not None)
        np.savez(sys.argv[2], gradient=np.concatenate([g for _, g in parts]),
                 cpu_seconds=[c for c, _ in usage], wall_seconds=[w for _, w in usage])


if __name__ == "__main__":
    main()
