"""distbelief.runtime.communicators.agreement.Rounds under MPI: ranks poll at different
paces (random sleeps), rank RAISER raises a flag at its local poll number AT, and every rank
says done after a number of polls that differs by rank. Each rank prints, as one JSON line,
the round at which it saw the flag, the flag's value, how many rounds it completed and
whether the last one said that everyone was done. The test checks that these agree on every
rank.

    mpiexec -n N python tests/mpi_programs/agreement_rounds.py RAISER AT
"""

import json
import sys
import time

import numpy as np
from mpi4py import MPI

from distbelief.runtime.communicators.agreement import Rounds, wait_for_everyone


def main() -> None:
    raiser, at = int(sys.argv[1]), int(sys.argv[2])
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    rng = np.random.default_rng(rank)
    rounds = Rounds(comm, 2, interval_s=1e-3)
    polls, seen_at, flag, done_after = 0, None, 0, 40 + 25 * rank
    while True:
        polls += 1
        flags = [7 if rank == raiser and polls >= at else 0, int(polls < done_after)]
        result = rounds.poll(lambda flags=flags: flags)
        if result is not None:
            if result[0] and seen_at is None:
                seen_at, flag = rounds.completed, int(result[0])
            if result[1] == 0:
                break
        time.sleep(float(rng.uniform(0, 2e-3)))
    wait_for_everyone(comm)
    print(json.dumps({"rank": rank, "seen_at": seen_at, "flag": flag,
                      "rounds": rounds.completed, "in_flight": rounds.in_flight}), flush=True)
    comm.Free()


if __name__ == "__main__":
    main()
