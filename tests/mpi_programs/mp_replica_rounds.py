"""ReplicaRounds hands a round's result on at the same poll on every partition, although
the result arrives at different polls on each (rank r sees it at poll 2r + 1).

Run: mpiexec -n P python -m mpi4py tests/mpi_programs/mp_replica_rounds.py
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from distbelief.partitioned_training import ReplicaRounds


class LateRounds:
    """A stand-in for agreement.Rounds whose one result arrives at poll `arrives_at`."""

    def __init__(self, arrives_at: int):
        self.arrives_at, self.polls, self.completed = arrives_at, 0, 0

    def poll(self, contribute):
        self.polls += 1
        if self.polls == self.arrives_at:
            self.completed += 1
            return np.array([7, int(contribute()[0])], dtype=np.int64)
        return None


def main() -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    rounds = ReplicaRounds(LateRounds(2 * rank + 1), comm)
    handed = [i for i in range(2 * size + 2) if rounds.poll(lambda: [rank]) is not None]
    everyone = comm.allgather(handed)
    if any(h != [2 * size - 2] for h in everyone):
        raise RuntimeError(f"rank {rank}: CHECK FAILED: results handed on at {everyone}")
    if rounds.completed != 1:  # attribute lookups reach the wrapped rounds
        raise RuntimeError(f"rank {rank}: CHECK FAILED: completed {rounds.completed}")
    if rank == 0:
        print("OK handed on together at poll", handed[0], flush=True)


if __name__ == "__main__":
    main()
