"""What this process asked of the file system and of MPI's one-sided operations, counted
so that summary.json (`control_plane`) and benchmarks/bench_control_plane.py can show how
the control plane's cost grows with the rank count (docs/performance.md, "The control
plane as the ranks grow").

One tally per process, written by the layers that do the work (heartbeat files, RMA
windows, checkpoint parts) and read once at the end. The names are the keys of
summary.json's entries; a counter never written reads as 0. Counting is an integer add
under a lock (a streaming reader's thread counts too): cheap beside the file or MPI call
it counts.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

NAMES = (
    "heartbeat_writes",   # its node's file written as the node's writer (open, write, close)
    "heartbeat_reads",    # other nodes' files opened and read, as its node's reader
    "checkpoint_files",   # checkpoint parts and manifests written (each fsynced, renamed)
    "rma_atomics",        # count-1 int64 Fetch_and_op, Compare_and_swap, Accumulate
    "rma_gets",           # Get (published buffers, headers)
    "rma_puts",           # Put (pushed gradients)
    "rma_flushes",        # Flush (completions: each drives the target's progress)
    "rma_claim_retries",  # a push's claim turns past the first (a shard's slots all busy)
    "rma_fold_polls",     # a client's polls of FOLDED_HINT while it waits for a fold
    "data_bytes_read",    # rows and labels read from the dataset file (data.hdf5)
    "dataset_opens",      # the dataset file opened and described (data.hdf5.open_dataset)
    "checkpoint_parts_hashed",  # checkpoint parts whose sha256 was checked (verifying)
)

_counts: Counter[str] = Counter()
_lock = threading.Lock()
_started = time.monotonic()


def add(name: str, n: int = 1) -> None:
    with _lock:
        _counts[name] += n


def count(name: str) -> int:
    """One counter's value now."""
    with _lock:
        return _counts[name]


def seconds() -> float:
    """Seconds since this process started counting (when this module was imported)."""
    return time.monotonic() - _started


def snapshot() -> dict[str, int]:
    """Every counter in NAMES, and any other written, with the seconds they cover."""
    with _lock:
        counts = dict(_counts)
    return {**{name: 0 for name in NAMES}, **counts, "seconds": round(seconds(), 3)}


def reset() -> None:
    """Start afresh (tests)."""
    global _started
    with _lock:
        _counts.clear()
    _started = time.monotonic()
