"""Passive-target progress: does a one-sided epoch on a rank's window complete while that
rank is outside MPI? (benchmarks/RMA_NOTES.md section 9: MPICH against Open MPI.)

    mpiexec -n 2 python benchmarks/bench_progress.py                # MPICH
    mpiexec --oversubscribe -n 2 python benchmarks/bench_progress.py # Open MPI
    mpiexec --oversubscribe --mca osc rdma -n 2 python benchmarks/bench_progress.py

Rank 1 runs Lock(SHARED) + Accumulate(SUM) + Unlock back to back on rank 0's window
(Win.Allocate, as the parameter server's RMA transport) for `--seconds`; rank 0 makes one
cheap MPI call (Iprobe) and then sleeps `--sleep` seconds, in a loop. Printed: epochs/s
for 16 floats and for 2.7 MB (the reference MLP's gradient), per sleep, and the MPI library.
If epochs need the target's progress engine, their rate follows rank 0's MPI calls (at
most a few per call); if the transfer is done by the origin alone (shared-memory
components, RDMA hardware), it does not depend on the sleep at all.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI


def measure(comm: MPI.Comm, count: int, sleep: float, seconds: float) -> float:
    """Epochs per second that rank 1 completed on rank 0's window. Collective."""
    rank = comm.Get_rank()
    win = MPI.Win.Allocate(count * 4 if rank == 0 else 0, 4, comm=comm)
    data = np.ones(count, dtype=np.float32)
    comm.Barrier()
    start = time.monotonic()
    deadline = start + seconds
    epochs = 0
    if rank == 1:
        while time.monotonic() < deadline:
            win.Lock(0, MPI.LOCK_SHARED)
            win.Accumulate(data, 0, op=MPI.SUM)
            win.Unlock(0)
            epochs += 1
    elif rank == 0:
        while time.monotonic() < deadline:
            comm.Iprobe()
            time.sleep(sleep)
    elapsed = time.monotonic() - start
    comm.Barrier()  # rank 0 inside MPI again: a pending epoch completes here
    win.Free()
    return epochs / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--sleeps", default="0,0.001,0.2", help="rank 0's sleeps, seconds")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        raise SystemExit("bench_progress.py: run it on 2 ranks (mpiexec -n 2)")
    rows = []
    for sleep in map(float, args.sleeps.split(",")):
        rates = [measure(comm, count, sleep, args.seconds) for count in (16, 669_706)]
        rows.append((sleep, *rates))
    if comm.Get_rank() == 1:
        print(MPI.Get_library_version().splitlines()[0])
        print("| target's sleep between MPI calls | epochs/s, 16 floats | epochs/s, 2.7 MB |")
        print("|---|---:|---:|")
        for sleep, small, large in rows:
            print(f"| {sleep * 1000:g} ms | {small:,.0f} | {large:,.0f} |")


if __name__ == "__main__":
    main()
