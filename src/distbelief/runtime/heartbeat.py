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

What the file system is asked: a rank writes one small file per beat interval, and a
watcher reads at most READS_PER_S files a second, whatever the rank count: each rank's
file at most once per `read_period()`, the beat interval, or longer when more ranks are
watched than READS_PER_S x interval (the sweeps of shard 0 and of the Sandblaster
coordinator watch every replica; the waits of set-up and teardown every rank). So a rank
asks the file system for at most 1 / interval + READS_PER_S operations a second, and a
node for that times its ranks, at 4 ranks as at 1,000 (benchmarks/bench_control_plane.py).
The price: a death among many watched ranks is found later, within `detection_s()`. A
death takes two readings that the file system answered, both after the timeout and a
read period apart, that show no new beat (a missing file is an answer: the rank ended). A read that fails
(EIO, ESTALE, a metadata server failing over) is no reading at all, so a file server that
stops answering for longer than the timeout writes nobody off: once it answers again, a
live rank's next beat comes within an interval, before the second stale reading.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from distbelief.runtime import counters

FOLDER = ".heartbeats"
"""Under run.out_dir: one folder per job, named by its token."""
READS_PER_S = 10.0
"""The most heartbeat files one rank reads a second: 1,000 ranks then ask a shared file
system for about 11,000 operations a second, a tenth of what one Lustre metadata server
serves (issue 32)."""
WATCHED_WINDOW_S = 10.0
"""A rank counts as watched for this long after it was last asked about."""


def interval_for(timeout_s: float) -> float:
    """How often to beat for a watcher's `timeout_s`: ten beats per timeout, at most one a
    second, at least one per 50 ms."""
    return min(1.0, max(0.05, timeout_s / 10))


class Heartbeats:
    """This rank's heartbeat thread and its watch over the other ranks' beats."""

    def __init__(self, folder: Path, rank: int, timeout_s: float,
                 reads_per_s: float = READS_PER_S):
        self.folder, self.rank, self.timeout_s = folder, rank, timeout_s
        self.interval_s = interval_for(timeout_s)
        self.reads_per_s = reads_per_s
        self._count = 0
        self._seen: dict[int, tuple[bytes, float]] = {}  # rank -> (last beat, when it changed)
        self._read_at: dict[int, float] = {}  # rank -> when its file was last read
        self._asked: dict[int, float] = {}  # rank -> when it was last asked about
        # How many ranks were asked about lately, counted at most once per interval (a
        # sweep asks about every rank: counting on every ask would cost O(R) each time).
        self._watched, self._counted_at = 0, -float("inf")
        # A token bucket of reads (READS_PER_S, a second's worth at most): the first
        # look at every rank, at set-up, is spread out too, not one burst of R reads.
        self._tokens, self._filled_at = reads_per_s, time.monotonic()
        self._stale: dict[int, tuple[int, float]] = {}  # rank -> (stale readings, last one)
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
        counters.add("heartbeat_writes")
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

    def read_period(self, now: float | None = None) -> float:
        """How long this watcher leaves between two reads of one rank's file: the beat
        interval, or the time READS_PER_S reads take to go round every rank asked about
        in the last WATCHED_WINDOW_S."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if now - self._counted_at >= self.interval_s:
                self._asked = {r: t for r, t in self._asked.items()
                               if now - t < WATCHED_WINDOW_S}
                self._watched, self._counted_at = len(self._asked), now
            return max(self.interval_s, self._watched / self.reads_per_s)

    def _take_token(self, now: float) -> bool:
        """Whether the read budget allows a read now (and spend it). Under the lock."""
        self._tokens = min(self.reads_per_s,
                           self._tokens + (now - self._filled_at) * self.reads_per_s)
        self._filled_at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def detection_s(self, watched: int) -> float:
        """The longest a death among `watched` ranks can go unnoticed: the timeout, then
        two stale readings a read period apart, and one period to the first of them."""
        return self.timeout_s + 3 * max(self.interval_s, watched / self.reads_per_s)

    def silent_for(self, rank: int, now: float | None = None) -> float:
        """Seconds since `rank`'s beat last changed, as this rank saw it (0.0 if its file
        has never been seen here). Reads the file at most once per read_period()."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._asked[rank] = now
        period = self.read_period(now)
        with self._lock:
            due = (now - self._read_at.get(rank, -float("inf")) >= period
                   and self._take_token(now))
        beat, answered = None, False
        if due:
            counters.add("heartbeat_reads")
            try:
                beat, answered = self.path(rank).read_bytes(), True
            except FileNotFoundError:
                answered = True  # the file system answered: there is no beat
            except OSError:
                pass  # no answer: no reading
        with self._lock:
            if due:
                self._read_at[rank] = now
            seen = self._seen.get(rank)
            if beat and (seen is None or seen[0] != beat):
                self._seen[rank] = (beat, now)
                self._stale.pop(rank, None)
                return 0.0
            if seen is None:
                return 0.0
            silent = now - seen[1]
            count, last = self._stale.get(rank, (0, -float("inf")))
            if answered and silent > self.timeout_s and now - last >= period:
                self._stale[rank] = (count + 1, now)
            return silent

    def stopped(self, rank: int) -> bool:
        """`rank`'s heartbeat has not changed for timeout_s (it died, or froze), in two
        readings the file system answered, a read period apart."""
        silent = self.silent_for(rank)
        with self._lock:
            return silent > self.timeout_s and self._stale.get(rank, (0, 0.0))[0] >= 2
