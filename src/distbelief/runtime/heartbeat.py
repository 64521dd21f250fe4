"""Heartbeats through the file system: how a rank learns that a rank on another node died.

MPI cannot tell (liveness.py), and a dead peer's RMA target never answers: measured with
MPICH through its network module (fake hosts), a replica's epoch on a killed shard waited
until the stall watchdog aborted the job. /proc shows only this node's processes. What
every node of a training job does share is the run folder: the shards write their parts
of every checkpoint there. So each node has one small file there (`node-<k>`), which one
rank of the node, its *writer*, rewrites every `interval_s`: a counter, and the node's
ranks whose processes it sees alive in /proc (exact on its own node). The writer is the
node's lowest rank whose process lives: when it dies, the next one sees that in /proc and
takes over within an interval. A watcher on another node takes a rank for dead once it
has not been listed in a new version of its node's file for `timeout_s`, by the watcher's
own clock (so the nodes' clocks and the file server's need not agree): a dead writer's
node goes silent as a whole, a dead rank drops out of its writer's list. The file is
opened, written and closed each time, so NFS's close-to-open consistency makes it visible
to a reader that opens it afresh.

A thread, not the main loop, beats, so a rank busy for a long time (an evaluation, a long
step, a checkpoint) still beats; one that is frozen or swapped out for longer than the
timeout does not. The folder is per job (a token rank 0 draws), so two jobs never read
each other's beats; a node's writer removes its file at a clean end (the next writer
writes it again if the node's other ranks still run), and the last one the folder. A rank
whose node's file a watcher has never seen listing it (a folder that is not shared) is
never taken for dead by it: no news is not bad news there.

What the file system is asked, per node and not per rank: one node writes one small file
per beat interval, and a watcher reads at most READS_PER_S files a second, whatever the
rank count: each node's file at most once per `read_period()`, the beat interval, or
longer when more nodes are watched than READS_PER_S x interval. So a rank asks the file
system for at most READS_PER_S operations a second, plus its node's one write per interval
if it is the writer (benchmarks/bench_control_plane.py). The price: a death among many
watched nodes is found later, within `detection_s()`. A death takes two readings that the
file system answered, both after the timeout and a read period apart, that show no new
listing (a missing file is an answer). A read that fails (EIO, ESTALE, a metadata server
failing over) is no reading at all, so a file server that stops answering for longer than
the timeout writes nobody off: once it answers again, a live rank's next listing comes
within an interval, before the second stale reading.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
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
    """This node's heartbeat file (written by one rank of it) and this rank's watch over the
    other nodes' files. `node_of[r]`: rank r's node (None: every rank a node of its own)."""

    def __init__(self, folder: Path, rank: int, timeout_s: float,
                 node_of: Sequence[int] | None = None, reads_per_s: float = READS_PER_S):
        self.folder, self.rank, self.timeout_s = folder, rank, timeout_s
        self.node_of = tuple(node_of) if node_of is not None else None
        self.node = self.node_for(rank)
        self.mates = ([r for r, n in enumerate(self.node_of) if n == self.node]
                      if self.node_of is not None else [rank])
        # Whether a rank of this node has ended (/proc: liveness.Peers sets it once every
        # rank's process is known; until then the node's lowest rank writes).
        self.local_gone: Callable[[int], bool] = lambda r: False
        self.interval_s = interval_for(timeout_s)
        self.reads_per_s = reads_per_s
        self._count = 0
        self._content: dict[int, bytes] = {}  # node -> its file as last read
        self._listed: dict[int, float] = {}  # rank -> when a new version of its file listed it
        self._answered: dict[int, tuple[float, float]] = {}  # node -> its last two answers
        self._read_at: dict[int, float] = {}  # node -> when its file was last read
        self._asked: dict[int, float] = {}  # node -> when a rank of it was last asked about
        # How many nodes were asked about lately, counted at most once per interval (a
        # sweep asks about every rank: counting on every ask would cost O(R) each time).
        self._watched, self._counted_at = 0, -float("inf")
        # A token bucket of reads (READS_PER_S, a second's worth at most): the first
        # look at every node, at set-up, is spread out too, not one burst of reads.
        self._tokens, self._filled_at = reads_per_s, time.monotonic()
        self._lock = threading.Lock()  # the watch is read by the main and watchdog threads
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def node_for(self, rank: int) -> int:
        return self.node_of[rank] if self.node_of is not None else rank

    def path(self, node: int) -> Path:
        return self.folder / f"node-{node}"

    # -- beating

    def start(self) -> None:
        """Write the first beat now if this rank is its node's writer (so it exists once
        the caller's next collective has completed), then beat from a thread. OSError if
        the folder cannot be written."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self._beat()
        self._thread = threading.Thread(target=self._run, name="distbelief-heartbeat",
                                        daemon=True)
        self._thread.start()

    def writes(self) -> bool:
        """Whether this rank is its node's writer: no lower rank of the node lives."""
        return not any(r < self.rank and not self.local_gone(r) for r in self.mates)

    def _beat(self) -> None:
        if not self.writes():
            return
        self._count += 1
        alive = [r for r in self.mates if r == self.rank or not self.local_gone(r)]
        counters.add("heartbeat_writes")
        with open(self.path(self.node), "w") as f:
            f.write(f"{self.rank} {self._count}\n{' '.join(map(str, alive))}\n")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except OSError:
                pass  # a full or flaky file system: the next beat tries again

    def stop(self) -> None:
        """Stop beating; as the node's writer, remove its file; remove the files of the
        nodes this rank saw go silent (they cannot), then the job's folder once empty."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            watched = list(self._content)
        now = time.monotonic()
        silent = [node for node in watched if self._node_silent(node, now)]
        removals = [self.path(node).unlink for node in silent]
        if self.writes():
            removals.insert(0, self.path(self.node).unlink)
        for remove in (*removals, self.folder.rmdir, self.folder.parent.rmdir):
            try:
                remove()
            except OSError:
                pass  # another node's file is still there: the last one removes the folder

    def _node_silent(self, node: int, now: float) -> bool:
        """No rank of `node` was listed anew for the timeout (read afresh: a node not
        looked at for a while has beaten since, if it lives)."""
        try:
            if self.path(node).read_bytes() != self._content.get(node):
                return False
        except OSError:
            pass
        with self._lock:
            listed = [t for r, t in self._listed.items() if self.node_for(r) == node]
        return not listed or now - max(listed) > self.timeout_s

    # -- watching

    def read_period(self, now: float | None = None) -> float:
        """How long this watcher leaves between two reads of one node's file: the beat
        interval, or the time READS_PER_S reads take to go round every node asked about
        in the last WATCHED_WINDOW_S."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if now - self._counted_at >= self.interval_s:
                self._asked = {n: t for n, t in self._asked.items()
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
        two stale readings a read period apart, and one period to the first of them. The
        files read are the nodes': at most one per other node."""
        if self.node_of is not None:
            watched = min(watched, len(set(self.node_of)) - 1)
        return self.timeout_s + 3 * max(self.interval_s, watched / self.reads_per_s)

    def silent_for(self, rank: int, now: float | None = None) -> float:
        """Seconds since `rank` was last listed in a new version of its node's file, as
        this rank saw it (0.0 if never). Reads the file at most once per read_period()."""
        now = time.monotonic() if now is None else now
        node = self.node_for(rank)
        with self._lock:
            self._asked[node] = now
        period = self.read_period(now)
        with self._lock:
            due = (now - self._read_at.get(node, -float("inf")) >= period
                   and self._take_token(now))
        content, answered = None, False
        if due:
            counters.add("heartbeat_reads")
            try:
                content, answered = self.path(node).read_bytes(), True
            except FileNotFoundError:
                answered = True  # the file system answered: there is no beat
            except OSError:
                pass  # no answer: no reading
        with self._lock:
            if due:
                self._read_at[node] = now
            if answered:
                self._answered[node] = (self._answered.get(node, (-float("inf"),) * 2)[1],
                                        now)
                if content and content != self._content.get(node):
                    self._content[node] = content
                    for listed in _listed_ranks(content):
                        self._listed[listed] = now
            listed_at = self._listed.get(rank)
            return 0.0 if listed_at is None else now - listed_at

    def stopped(self, rank: int) -> bool:
        """`rank` has not been listed anew for timeout_s (it died, its node's writer froze,
        or the node is gone), in two readings the file system answered, a read period
        apart."""
        silent = self.silent_for(rank)
        with self._lock:
            listed_at = self._listed.get(rank)
            older = self._answered.get(self.node_for(rank), (-float("inf"),) * 2)[0]
        return (listed_at is not None and silent > self.timeout_s
                and older - listed_at > self.timeout_s)


def _listed_ranks(content: bytes) -> list[int]:
    """The ranks a node's file lists alive (its second line); a torn read lists fewer."""
    lines = content.split(b"\n")
    if len(lines) < 3:  # the second line's newline not written yet: torn
        return []
    return [int(word) for word in lines[1].split() if word.isdigit()]
