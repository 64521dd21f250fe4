"""MPICH's `disable_shm_accumulate` window hint (issue 28): does MPICH take it, and what
does it do to the count-1 int64 atomics the RMA transport makes?

    mpiexec -n 3 python -m mpi4py benchmarks/probe_shm_accumulate.py

Rank 0 holds a window made with the transport's own info (ps/rma_windows.window_info)
and polls it as a shard does (a Flush on itself, then a 0.1 ms sleep); the other ranks
do Fetch_and_op(SUM) + Flush on it for 2 s. Once without the hint, once with
`disable_shm_accumulate = true`; prints the window's info as MPI reports it and the
atomics per second, all origins together.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from distbelief.ps.rma_windows import window_info

SECONDS = 2.0


def main() -> None:
    comm = MPI.COMM_WORLD
    for hint in (None, "true"):
        info = window_info()
        if hint is not None:
            info.Set("disable_shm_accumulate", hint)
        win = MPI.Win.Allocate(4096 if comm.rank == 0 else 0, 1, info, comm)
        info.Free()
        got = win.Get_info()
        reported = got.Get("disable_shm_accumulate")
        got.Free()
        win.Lock_all(MPI.MODE_NOCHECK)
        one, result = np.ones(1, np.int64), np.zeros(1, np.int64)
        comm.Barrier()
        t0, count = time.perf_counter(), 0
        while time.perf_counter() - t0 < SECONDS:
            if comm.rank == 0:
                win.Flush(0)
                time.sleep(1e-4)
            else:
                win.Fetch_and_op([one, MPI.INT64_T], [result, MPI.INT64_T], 0, 0, MPI.SUM)
                win.Flush(0)
                count += 1
        total = comm.reduce(count, root=0)
        if comm.rank == 0:
            print(f"disable_shm_accumulate given {hint}, reported {reported}: "
                  f"{total / SECONDS:,.0f} Fetch_and_op+Flush per s ({comm.size - 1} origins)",
                  flush=True)
        comm.Barrier()
        win.Unlock_all()
        win.Free()


if __name__ == "__main__":
    main()
