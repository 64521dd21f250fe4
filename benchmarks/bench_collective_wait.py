"""How long a polled wait on a lockstep collective takes: sync SGD's step, a 2.7 MB
Iallreduce(SUM) of the reference MLP's gradient and loss plus a small Iallreduce(MAX),
waited on three ways in the same run:

    sleeps      Testall, then sleeps of 20 us doubling to 1 ms (wait_all before YIELD_S)
    wait_all    model.partitioned_network.wait_all: Testall, yields for up to YIELD_S, sleeps
    blocking    a blocking Allreduce (MPICH busy-polls in it: the floor, at a core's cost)

    mpiexec -n 2 python benchmarks/bench_collective_wait.py [--repeats 100] [--rounds 2]

Prints wall and CPU milliseconds per collective on rank 0, and wait_all's time over the
blocking one's.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from distbelief.model.partitioned_network import wait_all
from distbelief.runtime.backoff import Backoff

GRADIENT = 669_706 + 1  # the reference MLP's parameters, and the loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    send, total = np.ones(GRADIENT, np.float32), np.empty(GRADIENT, np.float32)
    flags, decided = np.zeros(4, np.int64), np.empty(4, np.int64)

    def start() -> list[MPI.Request]:
        return [comm.Iallreduce(send, total, op=MPI.SUM),
                comm.Iallreduce(flags, decided, op=MPI.MAX)]

    def sleeps() -> None:
        requests = start()
        backoff = Backoff(min_sleep_s=20e-6, max_sleep_s=1e-3)
        while not MPI.Request.Testall(requests):
            backoff.wait()

    ways = {"sleeps": sleeps, "wait_all": lambda: wait_all(start()),
            "blocking": lambda: comm.Allreduce(send, total, op=MPI.SUM)}
    for round_ in range(args.rounds):
        times = {}
        for name, way in ways.items():
            comm.Barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(args.repeats):
                way()
            times[name] = ((time.perf_counter() - wall) / args.repeats,
                           (time.process_time() - cpu) / args.repeats)
        if comm.Get_rank() == 0:
            cells = "  ".join(f"{name} {w * 1e3:.2f} ms (cpu {c * 1e3:.2f})"
                              for name, (w, c) in times.items())
            ratio = times["wait_all"][0] / times["blocking"][0]
            print(f"round {round_}: {cells}  wait_all/blocking {ratio:.2f}x", flush=True)


if __name__ == "__main__":
    main()
