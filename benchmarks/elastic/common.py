"""Shared bits of the elastic lab programs (issue 46 items 3 and 4)."""
import os
import time

import numpy as np
from mpi4py import MPI


def window_info() -> MPI.Info:
    """The project's window info (src/distbelief/ps/rma_windows.py window_info)."""
    info = MPI.Info.Create()
    info.Set("accumulate_ops", "same_op_no_op")
    info.Set("accumulate_ordering", "none")
    info.Set("which_accumulate_ops", "sum,replace,no_op,cswap")
    info.Set("acc_single_intrinsic", "true")
    info.Set("same_disp_unit", "true")
    return info


def allocate(nbytes: int, comm: MPI.Comm):
    """Win.Allocate(disp unit 1) + Lock_all(MODE_NOCHECK), as the project does; returns
    (win, int64 view of the local memory)."""
    info = window_info()
    win = MPI.Win.Allocate(nbytes, 1, info, comm)
    info.Free()
    win.Lock_all(MPI.MODE_NOCHECK)
    mem = np.frombuffer(win.tomemory(), dtype=np.int64) if nbytes else np.zeros(0, np.int64)
    return win, mem


def fao(win, target: int, slot: int, value: int, op=MPI.SUM) -> int:
    """count-1 int64 Fetch_and_op + Flush; returns the old value."""
    src = np.array([value], np.int64)
    old = np.zeros(1, np.int64)
    win.Fetch_and_op(src, old, target, slot * 8, op)
    win.Flush(target)
    return int(old[0])


def log(tag: str, *parts) -> None:
    print(f"[{tag} {time.strftime('%H:%M:%S')}] " + " ".join(str(p) for p in parts),
          flush=True)


def mpi_name() -> str:
    v = MPI.Get_library_version()
    return "openmpi" if "Open MPI" in v else ("mpich" if "MPICH" in v else v[:30])


def wait_file(path: str, timeout: float = 40.0, step: float = 0.01) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if os.path.exists(path):
            with open(path) as f:
                text = f.read().strip()
            if text:
                return text
        time.sleep(step)
    raise TimeoutError(f"no {path} after {timeout}s")


def write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
