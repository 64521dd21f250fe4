"""Heartbeats through the file system: how a rank learns that a rank on another node died.

MPI cannot tell (liveness.py), and a dead peer's RMA target never answers: measured with
MPICH through its network module (fake hosts), a replica's epoch on a killed shard waited
until the stall watchdog aborted the job. /proc shows only this node's processes. What
every node of a training job does share is the run folder: the shards write their parts
of every checkpoint there. So each rank runs a thread that rewrites a small file there
every `interval_s` (`rank-<r>`: a counter), and a watcher takes a rank for dead once its
counter has not changed for `timeout_s`, by the watcher's own clock (so the nodes' clocks
and the file server's need not agree). The file is opened, written and closed each time,
so NFS's close-to-open consistency makes it visible to a reader that opens it afresh.

A thread, not the main loop, beats, so a rank busy for a long time (an evaluation, a long
step, a checkpoint) still beats; one that is frozen or swapped out for longer than the
timeout does not. The folder is per job (a token rank 0 draws), so two jobs never read
each other's beats; each rank removes its file at a clean end, and the last one the folder.
A rank whose file a watcher has never seen (a folder that is not shared) is never taken
for dead by it: no news is not bad news there.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

FOLDER = ".heartbeats"
"""Under run.out_dir: one folder per job, named by its token."""


def interval_for(timeout_s: float) -> float:
    """How often to beat for a watcher's `timeout_s`: ten beats per timeout, at most one a
    second, at least one per 50 ms."""
    return min(1.0, max(0.05, timeout_s / 10))


class Heartbeats:
    """This rank's heartbeat thread and its watch over the other ranks' beats."""

    def __init__(self, folder: Path, rank: int, timeout_s: float):
        self.folder, self.rank, self.timeout_s = folder, rank, timeout_s
        self.interval_s = interval_for(timeout_s)
        self._count = 0
        self._seen: dict[int, tuple[bytes, float]] = {}  # rank -> (last beat, when it changed)
        self._lock = threading.Lock()  # the watch is read by the main and watchdog threads
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def path(self, rank: int) -> Path:
        return self.folder / f"rank-{rank}"

    # -- beating

    def start(self) -> None:
        """Write the first beat now (so it exists once the caller's next collective has
        completed), then beat from a thread. OSError if the folder cannot be written."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self._beat()
        self._thread = threading.Thread(target=self._run, name="distbelief-heartbeat",
                                        daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._count += 1
        with open(self.path(self.rank), "w") as f:
            f.write(f"{self._count}\n")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except OSError:
                pass  # a full or flaky file system: the next beat tries again

    def stop(self) -> None:
        """Stop beating and remove this rank's file and those of the ranks this rank saw
        stop (they cannot), then the job's folder once empty."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            watched = list(self._seen)
        # Read afresh: a rank not looked at for a while has beaten since, if it lives.
        dead = [rank for rank in watched if self.silent_for(rank) > self.timeout_s]
        removals = [self.path(rank).unlink for rank in [self.rank, *dead]]
        for remove in (*removals, self.folder.rmdir, self.folder.parent.rmdir):
            try:
                remove()
            except OSError:
                pass  # another rank's file is still there: the last one removes the folder

    # -- watching

    def silent_for(self, rank: int, now: float | None = None) -> float:
        """Seconds since `rank`'s beat last changed, as this rank saw it (0.0 if its file
        has never been seen here). Local: one small file read."""
        now = time.monotonic() if now is None else now
        try:
            beat = self.path(rank).read_bytes()
        except OSError:
            beat = None
        with self._lock:
            seen = self._seen.get(rank)
            if beat and (seen is None or seen[0] != beat):
                self._seen[rank] = (beat, now)
                return 0.0
            return 0.0 if seen is None else now - seen[1]

    def stopped(self, rank: int) -> bool:
        """`rank`'s heartbeat has not changed for timeout_s (it died, or froze)."""
        return self.silent_for(rank) > self.timeout_s
