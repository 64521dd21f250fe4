"""Heartbeats through the file system: how a rank learns that a rank on another node died.

MPI cannot tell (liveness.py), a dead peer's RMA target never answers, and /proc shows only
this node's processes. What every node of a training job does share is the run folder (the
shards write their parts of every checkpoint there), so each node has one small file
there, rewritten every beat by one rank of the node with the node's live ranks, and a
watcher on another node takes a rank for dead once no new version of that file has listed
it for `timeout_s` (`Heartbeats`). The design and what it costs the file system:
docs/checkpoints-and-reliability.md, "Heartbeats across nodes".
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from distbelief.runtime import counters

FOLDER = ".heartbeats"
"""Under run.out_dir: one folder per job, named by its token."""
READS_PER_S = 10.0
"""The most heartbeat files one node reads a second: 100 nodes then ask a shared file
system for about 1,100 operations a second, a hundredth of what one Lustre metadata
server serves (issue 32)."""
WATCHED_WINDOW_S = 10.0
"""A node counts as watched for this long after a rank of it was last asked about."""
FRESH_INTERVALS = 2.0
"""A rank whose stamp is older than this many beat intervals is not listed (and cannot
write): its heartbeat thread did not run."""


def interval_for(timeout_s: float) -> float:
    """How often to beat for a watcher's `timeout_s`: ten beats per timeout, at most one a
    second, at least one per 50 ms."""
    return min(1.0, max(0.05, timeout_s / 10))


class NodeTable:
    """float64 slots shared by the ranks of one node: a file mapped by each (under
    /dev/shm: node-local memory, unlinked as soon as they all have), or private memory
    when `path` is None:
    - every rank's heartbeat thread stamps its own slot each interval, so a live rank whose
      process is frozen (or whose thread is starved) goes stale there, as its own file did;
    - the writer is the node's lowest rank whose process lives (/proc) and whose stamp is
      fresh; it lists the ranks that are both. A writer that freezes is replaced by the
      next rank within two intervals, so it does not take its node down with it;
    - the writer is also the node's only reader of the other nodes' files: it reads those
      the node's ranks asked about lately, and keeps the watch (when each rank was last
      listed, the node's last two answered readings) in the table, where every rank looks
      it up.

    Indexed by world rank (`stamp`, `listed`) and by node (`answered_old`,
    `answered_new`, `asked`); times are time.monotonic(), which every process of a
    machine shares; 0.0 is never."""

    def __init__(self, path: Path | None, ranks: int, nodes: int):
        size = 8 * (2 * ranks + 3 * nodes)
        if path is None:
            memory: bytearray | mmap.mmap = bytearray(size)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size < size:
                    os.ftruncate(fd, size)
                memory = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        slots = np.frombuffer(memory, dtype=np.float64)
        self.stamp = slots[:ranks]
        self.listed = slots[ranks:2 * ranks]
        self.answered_old, self.answered_new, self.asked = (
            slots[2 * ranks + i * nodes:2 * ranks + (i + 1) * nodes] for i in range(3))


class Heartbeats:
    """This node's heartbeat file and its watch over the other nodes' files, as one rank
    of the node takes part in them. `node_of[r]`: rank r's node. `table`: the file through
    which the node's ranks share their NodeTable (None: private, for a rank alone on its
    node).

    The file, `node-<k>`, holds a counter and the node's live ranks, rewritten every
    `interval_s` by the node's *writer* (NodeTable says which rank). A watcher on another
    node takes a rank for dead once no new version of its node's file has listed it for
    `timeout_s`, by the watcher's own clock (so the nodes' clocks and the file server's need
    not agree). The file is opened, written and closed each time, so NFS's close-to-open
    consistency makes it visible to a reader that opens it afresh.

    A thread, not the main loop, beats and reads, so a rank busy for a long time (an
    evaluation, a long step, a checkpoint) still beats; one that is frozen or swapped out
    for longer than the timeout does not. The folder is per job (a token rank 0 draws), so
    two jobs never read each other's beats; a node's last rank to stop removes its file,
    and the last node the folder. A rank whose node's file a watcher has never read (a
    folder that is not shared) is never taken for dead by it: no news is not bad news
    there. Once it has, a rank of that node never listed since counts as listed at that
    first reading (every rank lived when the job started), so a rank that died before it
    is found too.

    What the file system is asked, per node and not per rank: one write per beat interval,
    and at most READS_PER_S reads a second, whatever the ranks per node or in the job: each
    node's file at most once per `read_period()`, the beat interval, or longer when the
    node watches more nodes than READS_PER_S x interval. The price: a death among many
    watched nodes is found later, within `detection_s()`. A death takes two readings that
    the file system answered, both after the timeout and a read period apart, that show no
    new listing (a missing file is an answer). A read that fails (EIO, ESTALE, a metadata
    server failing over) is no reading at all, so a file server that stops answering for
    longer than the timeout writes nobody off: once it answers again, a live rank's next
    listing comes within an interval, before the second stale reading."""

    def __init__(self, folder: Path, rank: int, timeout_s: float, node_of: Sequence[int],
                 reads_per_s: float = READS_PER_S, table: Path | None = None):
        self.folder, self.rank, self.timeout_s = folder, rank, timeout_s
        self.node_of = tuple(node_of)
        self.node = self.node_of[rank]
        self.ranks_on: dict[int, list[int]] = {}  # node -> its ranks
        for r, n in enumerate(self.node_of):
            self.ranks_on.setdefault(n, []).append(r)
        self.mates = self.ranks_on[self.node]
        if table is None and len(self.mates) > 1:
            # Each rank would take itself for the writer, listing only itself.
            raise ValueError("the ranks of a node must share their table")
        self.table = NodeTable(table, len(self.node_of), max(self.node_of) + 1)
        # Whether a rank of this node has ended (/proc: liveness.Peers sets it once every
        # rank's process is known).
        self.local_gone: Callable[[int], bool] = lambda r: False
        self.interval_s = interval_for(timeout_s)
        self.reads_per_s = reads_per_s
        self._count = 0
        self._content: dict[int, bytes] = {}  # node -> its file as this rank last read it
        self._read_at: dict[int, float] = {}  # node -> when this rank last read its file
        # How many nodes were asked about lately, counted at most once per interval.
        self._watched, self._counted_at = 0, -float("inf")
        # A token bucket of reads (READS_PER_S, a second's worth at most): the first
        # look at every node, at set-up, is spread out too, not one burst of reads.
        self._tokens, self._filled_at = reads_per_s, time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def path(self, node: int) -> Path:
        return self.folder / f"node-{node}"

    # -- beating and reading (the heartbeat thread)

    def start(self) -> OSError | None:
        """Stamp and beat now (so a node's file exists once the caller's next collective
        has completed), then from a thread, which stamps and tries again every beat
        whatever this first write did; returns the error if it failed (a rank that
        stopped stamping would be taken for dead once another rank of its node writes)."""
        failed = None
        try:
            self._tick(time.monotonic())  # stamps before anything that can fail
        except OSError as exc:
            failed = exc
        self._thread = threading.Thread(target=self._run, name="distbelief-heartbeat",
                                        daemon=True)
        self._thread.start()
        return failed

    def _fresh(self, rank: int, now: float) -> bool:
        return now - self.table.stamp[rank] < FRESH_INTERVALS * self.interval_s

    def writes(self, now: float | None = None) -> bool:
        """Whether this rank is its node's writer (and reader): no lower rank of the node
        lives with a fresh stamp."""
        now = time.monotonic() if now is None else now
        return not any(r < self.rank and not self.local_gone(r) and self._fresh(r, now)
                       for r in self.mates)

    def _tick(self, now: float) -> None:
        self.table.stamp[self.rank] = now
        if not self.writes(now):
            return
        self._count += 1
        alive = [r for r in self.mates
                 if r == self.rank or (not self.local_gone(r) and self._fresh(r, now))]
        counters.add("heartbeat_writes")
        text = f"{self.rank} {self._count}\n{' '.join(map(str, alive))}\n"
        try:
            self.path(self.node).write_text(text)
        except FileNotFoundError:  # the folder is not there (yet): once more after mkdir
            self.folder.mkdir(parents=True, exist_ok=True)
            self.path(self.node).write_text(text)
        self._read_due(now)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._tick(time.monotonic())
            except OSError:
                pass  # a full or flaky file system: the next beat tries again

    def _read_due(self, now: float) -> None:
        """Read the files of the nodes asked about lately that are due, within the budget,
        least recently read first."""
        period = self.read_period(now)
        asked = self.table.asked
        recent = [n for n in range(len(asked))
                  if asked[n] and now - asked[n] < WATCHED_WINDOW_S and n != self.node]
        recent.sort(key=lambda n: self._read_at.get(n, -float("inf")))
        for node in recent:
            if now - self._read_at.get(node, -float("inf")) >= period and self._take_token(now):
                self._read(node, now)

    def _read(self, node: int, now: float) -> None:
        counters.add("heartbeat_reads")
        self._read_at[node] = now
        try:
            content = self.path(node).read_bytes()
        except FileNotFoundError:
            content = b""  # the file system answered: there is no beat
        except OSError:
            return  # no answer: no reading
        table = self.table
        table.answered_old[node] = table.answered_new[node]
        table.answered_new[node] = now
        if content and content != self._content.get(node):
            if node not in self._content:
                # The node's ranks all lived when the job started (its file is there):
                # one that was never listed is as if listed now, so that a rank that
                # died before its node was first read is found too.
                for rank in self.ranks_on[node]:
                    table.listed[rank] = table.listed[rank] or now
            self._content[node] = content
            for listed in _listed_ranks(content):
                if listed < len(table.listed):
                    table.listed[listed] = now

    def stop(self) -> None:
        """Stop beating; the node's last rank removes its file; remove the files of the
        nodes seen silent (they cannot), then the job's folder once empty."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        now = time.monotonic()
        self.table.stamp[self.rank] = 0.0  # the next rank writes at once
        removals = [self.path(node).unlink for node in self._content
                    if self._node_silent(node, now)]
        if not any(self._fresh(r, now) and not self.local_gone(r)
                   for r in self.mates if r != self.rank):
            removals.insert(0, self.path(self.node).unlink)
        for remove in (*removals, self.folder.rmdir, self.folder.parent.rmdir):
            try:
                remove()
            except OSError:
                pass  # another node's file is still there: the last one removes the folder

    def _node_silent(self, node: int, now: float) -> bool:
        """No rank of `node` was listed anew for the timeout."""
        listed = [self.table.listed[r] for r in self.ranks_on[node] if self.table.listed[r]]
        return not listed or now - max(listed) > self.timeout_s

    # -- watching (any thread)

    def read_period(self, now: float | None = None) -> float:
        """How long the node's reader leaves between two reads of one node's file: the
        beat interval, or the time READS_PER_S reads take to go round every node asked
        about in the last WATCHED_WINDOW_S."""
        now = time.monotonic() if now is None else now
        if now - self._counted_at >= self.interval_s:
            asked = self.table.asked
            self._watched = int(np.count_nonzero((asked > 0) & (now - asked < WATCHED_WINDOW_S)))
            self._counted_at = now
        return max(self.interval_s, self._watched / self.reads_per_s)

    def _take_token(self, now: float) -> bool:
        """Whether the read budget allows a read now (and spend it)."""
        self._tokens = min(self.reads_per_s,
                           self._tokens + (now - self._filled_at) * self.reads_per_s)
        self._filled_at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def detection_s(self, watched: int) -> float:
        """The longest a death among `watched` ranks can go unnoticed: the timeout, then
        two stale readings a read period apart, each up to a beat late (the reader reads
        as it beats), and one period to the first of them. The files read are the nodes':
        at most one per other node."""
        watched = min(watched, len(set(self.node_of)) - 1)
        return self.timeout_s + 4 * max(self.interval_s, watched / self.reads_per_s)

    def silent_for(self, rank: int, now: float | None = None) -> float:
        """Seconds since `rank` was last listed in a new version of its node's file, as
        this node's reader saw it (0.0 if never). Marks its node as watched."""
        now = time.monotonic() if now is None else now
        self.table.asked[self.node_of[rank]] = now
        listed_at = self.table.listed[rank]
        return 0.0 if not listed_at else now - listed_at

    def stopped(self, rank: int) -> bool:
        """`rank` has not been listed anew for timeout_s (it died or froze, or its node is
        gone), in two readings the file system answered, a read period apart."""
        silent = self.silent_for(rank)
        listed_at = self.table.listed[rank]
        older = self.table.answered_old[self.node_of[rank]]
        return bool(listed_at and silent > self.timeout_s and older - listed_at > self.timeout_s)


def _listed_ranks(content: bytes) -> list[int]:
    """The ranks a node's file lists alive (its second line); a torn read lists fewer."""
    lines = content.split(b"\n")
    if len(lines) < 3:  # the second line's newline not written yet: torn
        return []
    return [int(word) for word in lines[1].split() if word.isdigit()]
