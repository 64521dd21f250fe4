"""One Sandblaster gradient evaluation at the initial parameters, then the shards' gradient
slices gathered to rank 0 (test-only: in a run, vectors never leave the shards) and saved
with the rows of batch 0, for tests/test_sandblaster.py to compare with the single-process
gradient.

    mpiexec -n N python sandblaster_gradient.py CONFIG OUT.npz [BATCH_INDEX]
"""

import sys

import numpy as np
from mpi4py import MPI

from distbelief import sandblaster
from distbelief.config import load_config


def one_gradient(batch: int):
    def method(coordinator):
        loss, _ = coordinator.evaluate(0.0, batch)
        coordinator.take_gradient()
        coordinator.last_loss = loss
        return "max_steps"
    return method


def main() -> None:
    config = load_config(sys.argv[1])
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    comm = MPI.COMM_WORLD
    role = sandblaster.start(config, comm, stream=None)
    if isinstance(role, sandblaster.Coordinator):
        role.method = one_gradient(batch)
    role.run()
    mine = (role.store.start, role.store.g) if isinstance(role, sandblaster.ShardServer) else None
    parts = comm.gather(mine, root=0)
    sandblaster.finish(comm, role)
    if comm.Get_rank() == 0:
        parts = sorted(p for p in parts if p is not None)
        np.savez(sys.argv[2], gradient=np.concatenate([g for _, g in parts]))


if __name__ == "__main__":
    main()
