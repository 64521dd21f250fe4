"""Sharded parameter server for Downpour SGD: MPI one-sided communication (RMA) between
nodes, MPI shared-memory windows within one.

The flat float32 parameter vector of `size` elements is split into S contiguous balanced
ranges (`distbelief.model.layout.balanced_ranges`); shard s (world rank s, see topology.py) owns
range s. Two transports, chosen once by `open_parameter_server` for the whole job (every
rank agrees; `requested_transport` for how to force one):

- "shared", when every rank of the job is on one node (SHARED MEMORY below): a client
  folds its own gradient into the shard's parameters with the shard's optimizer, and
  copies parameters out, directly in the shard's shared segment under a kernel
  reader-writer lock. No shard is on the critical path of a step.
- "rma" otherwise: replicas push gradients and pull parameters with passive-target RMA;
  the shard folds the pushed gradients into its parameters with its optimizer (Adagrad or
  SGD). The rest of this section up to SHARED MEMORY describes it.

Why both: with MPICH on one node every RMA round needs a pass through the target's
progress engine, and the read-your-writes fetch puts the shard's fold on the critical
path too; a 2 ms step paid ~1.25 ms of RMA with a shard that sleeps between polls
(benchmarks/RMA_NOTES.md sections 6-8). In shared memory the same step pays a lock (a few
microseconds), the optimizer step it would pay anyway, and one 2.7 MB copy (~0.1 ms).
Mixing the two in one job (node-local clients on shared memory, the others on RMA) is
not done: Downpour's run control needs one atomic location for the step claims that every
client can reach, and a window that both RMA and plain loads and stores update would need
the shard's progress engine for every lock again.

Windows (per shard; size 0 on every other rank), allocated with Win.Allocate over a
private duplicate of the world communicator, displacement unit 1 byte:

    ACCUM  [0:8) TICKET | [16:24) DONE | [24:40) COMPLETED[0..1] | [64:64+c) run control
           block | PENDING[C] (one per client) | accumulator 0 f32 | accumulator 1 f32
    PARAMS [0:8) PUBLISHED | [8:16) BEGUN | [16:24) PULLS | [24:40) HOLDS_ASKED,
           HOLDS_RELEASED | buffer 0 | buffer 1, each
           [0:8) VERSION [8:16) APPLIED, then the slice f32       (counters: int64;
           c = run_control.block_bytes(R), used on shard 0 only; every part 64-byte aligned)

    TICKET    = phase * PHASE + pushes started (clients +1, the shard +PHASE to flip)
    COMPLETED = pushes completed into accumulator b (clients +1 once their data is in)
    PENDING   = 1 while that client has a push in flight (+1 as it starts, -1 when done)
    DONE      = clients (replicas and coordinator) that called finish()
    PUBLISHED / BEGUN = publishes of the parameters finished / started (the shard +1)
    PULLS     = pulls served (so that the shard sees pull traffic and polls fast)
    HOLDS_ASKED / HOLDS_RELEASED = readers' requests to hold publishes, and their ends
    VERSION   = updates applied to the parameters in that buffer (folds finished)
    APPLIED   = pushes contained in them

The run control block (distbelief.ps.run_control: step claims, reports, commands, each
replica's slots) rides on the pushes a replica makes anyway (`ControlExchange`, issued
with a push's data on shard 0), so it costs no extra round. Its access rules are in
run_control's docstring: every access is an accumulate (SUM by the writer of a slot,
NO_OP by its readers).

RMA SCHEME (issue 17: a client may die at ANY instant, in the middle of a push included,
and nobody may wait for it for ever). Every rank opens one passive-target epoch on both
windows at creation, `Lock_all(MODE_NOCHECK)`, and keeps it until `free()`: nobody ever
calls Lock or Unlock, so no rank can die holding a lock, and operations complete by
`Win.Flush(target)`. NOCHECK is legal because no rank ever requests a conflicting (an
exclusive) lock. Every access to window memory after the set-up is an accumulate
operation, so none conflicts with another and no lock is needed to keep them apart:

| location           | access                                              |
|--------------------|-----------------------------------------------------|
| accumulator b      | client: Accumulate(SUM) f32                         |
|                    | owner: Get_accumulate(NO_OP) read, then Accumulate  |
|                    |   (SUM) of the negation of what it read (to zero)   |
| TICKET             | client: Fetch_and_op(SUM, 1); owner: Fetch_and_op   |
|                    |   (SUM, PHASE) to flip; owner reads: NO_OP          |
| COMPLETED, PENDING,| client: Accumulate(SUM, +-1) int64                  |
| DONE, PULLS,       | owner: Get_accumulate / Fetch_and_op(NO_OP)         |
| HOLDS_*            |                                                     |
| PUBLISHED, BEGUN   | owner: Accumulate(SUM, 1); readers: Fetch_and_op    |
|                    |   (NO_OP)                                           |
| buffer b           | owner: Accumulate(REPLACE) of VERSION, APPLIED and  |
|                    |   the slice; readers (clients, shard 0's snapshot): |
|                    |   Get_accumulate(NO_OP)                             |
| run control block  | see run_control (SUM writers, NO_OP readers)        |

Why it is legal (MPI-4.1, one-sided chapter: conflicting accesses, the semantics section,
window info `accumulate_ops`): accumulate operations on one location with the same basic
datatype do not conflict, and `accumulate_ops=same_op_no_op` (the default, set
explicitly) asks only that concurrent ones use the same op or NO_OP: every location above
has one writing op (SUM, or REPLACE for the buffers, whose only writer is the owner) and
NO_OP readers. Atomicity is per element; whole-vector consistency comes from the
protocols below. The owner's plain stores happen only at creation, before the barrier
that precedes any client access (Win.Sync makes them visible). Visibility: the unified
memory model (checked at creation); Flush completes an operation at the target.

Pushes: double-buffered accumulators, closed by phases. A push is three rounds, each
completed by Flush on every shard: (1) take a ticket (Fetch_and_op SUM 1 on TICKET: it
counts the push as started and returns the phase f) and PENDING += 1; (2) Accumulate the
gradient into accumulator f % 2 (with the control operations); (3) COMPLETED[f % 2] += 1,
PENDING -= 1. The shard, when tickets were taken since its last flip, flips (Fetch_and_op
SUM PHASE on TICKET, which returns the pushes started before it, atomically: so exactly
those went to the closed accumulator) and, on later polls, once COMPLETED of the closed
accumulator counts all of them, takes it: reads it, subtracts what it read, applies it as
update f + 1 and publishes. No new push adds to it meanwhile (they are in phase f + 1),
so a take holds whole pushes: exact push counts, and a pull never sees part of a push.
A client that dies between (1) and (3) never completes: the shard writes its push off
once it sees the process gone (`watch_clients`, GONE_CHECK_S) or after a give-up bound
(GIVE_UP_S; Downpour passes its heartbeat timeout, below which a live rank always shows a
sign of life, so a replica that is merely descheduled on a loaded node is waited for), and
folds without it; if its data ever lands it is folded with a later take (SUM keeps it;
subtraction, not zeroing, keeps that legal). Staleness is exact: a push of phase f is
applied by update f + 1, so staleness = f - (version pulled).

Pulls: double-buffered, checked parameters (a seqlock made of accumulates). Publish k
(the owner): BEGUN += 1, Flush; REPLACE buffer k % 2 (VERSION, APPLIED, slice), Flush;
PUBLISHED += 1, Flush. A read: PUBLISHED -> p, Flush; read buffer p % 2, Flush; BEGUN ->
b, Flush; keep it if b <= p + 1 (the next write into that buffer, publish p + 2, had not
begun before the read completed), else read again (two publishes during one read).
push_pull runs the two in the same three rounds. A reader slower than two publishes (a
descheduled rank on a loaded node, a slow network) would read again for as long as the
shard publishes that often: after TORN_READS_BEFORE_HOLD torn reads it asks the shard to
hold (HOLDS_ASKED += 1), and releases it after its read (HOLDS_RELEASED += 1). While a
hold is on, for HOLD_MAX_S at most, the shard folds but defers its publish, so the next
read succeeds (CI saw one pull take over 10 s through MPICH's network module before).

Failure: a dead client holds nothing (no lock); its last push is written off as above;
its pulls are reads. A dead shard is found by the other ranks' liveness checks
(Downpour), as before.

PROGRESS. With MPICH on shared memory an RMA operation completes only while the target
is inside MPI (DESIGN.md). The shard therefore polls: `serve_once()` reads its counters
(accumulates on itself and a Flush, which drive MPI progress) and advances the fold;
`serve()` loops over it, sleeping between polls with `Backoff`: 50 us after traffic,
doubling to 0.5 ms while idle. MPICH's async progress thread is not used: it spins in
every rank. Downpour's shards use `PacedBackoff`, which learns the pace of the pushes and
polls every 20 us around the time the next one is due (benchmarks/RMA_NOTES.md).

READ-YOUR-WRITES. `catch_up()` pulls again until the pulled versions include the update
that holds the client's last push (phase f: version f + 1), waiting only for the shard.

SHUTDOWN. A client's `finish()` adds 1 to `done` on every shard, one-sided, after its
last push has completed; a shard's `serve()` returns once done counts every client and it
has folded every push started before that. `free()` is the same on every rank: one
Ibarrier polled with back-off sleeps, then Unlock_all and the windows freed in one fixed
order.

SHARED MEMORY (transport "shared"; SharedMemoryShard, SharedMemoryClient). One window from
Win.Allocate_shared over the node communicator (= the world), a segment per shard (size 0
on other ranks); every rank maps every segment (Win.Shared_query). Shard s's segment:

    [0:64) header, int64 slots: VERSION 0 | APPLIED 1 | SERVING 2 (1 once the shard polls)
    [64:..) per client c (non-shard world rank S + c): PULLED, FINISHED (int64; pulls
           made so far, published with each push and at finish)
    then, each 64-byte aligned: the run control block (distbelief.ps.run_control; used on
           shard 0), the parameters f32, each optimizer state array f32 (for Adagrad, its
           sum of squared gradients), by name

The parameters and the optimizer state are the shard's own (its optimizer object works
on the segment's arrays; every client holds a copy of the optimizer pointed at the same
arrays). Segment s is guarded by a reader-writer lock: a POSIX record lock (fcntl) on
byte s of one lock file that all ranks opened (and that is unlinked at once). The kernel
grants it: no MPI progress is needed from anybody, a waiter sleeps, a dead process's
locks are released. MPI's own Win_lock on a shared window was measured to wait for the
target's progress (0.5 s behind a sleeping target), so it is not used.

| location            | access                                          | lock      |
|---------------------|-------------------------------------------------|-----------|
| params, state,      | client push: optimizer step with its gradient,  | exclusive |
| VERSION, APPLIED    |   VERSION += 1, APPLIED += 1 (load/store)       |           |
|                     | shard: set_parameters, initialisation (store)   | exclusive |
|                     | client pull, shard snapshot/parameters/         | shared    |
|                     |   checkpoint_state/version (load)               |           |
| run control block   | client, with a push or exchange: read, add      | exclusive |
| (shard 0)           | shard 0: read_run_control (load)                | shared    |
|                     | shard 0: add_run_control (load, store)          | exclusive |
| SERVING             | shard: first serve_once (store 1)               | exclusive |
|                     | client, before its first access (load)          | shared    |
| PULLED[c],          | client c only, with a push and at finish: store | exclusive |
| FINISHED[c]         | shard: serve_once, read_counters (load)         | shared    |

Why it is correct: load/store accesses to a shared window are ordinary memory accesses of
the processes (MPI-4.1, shared memory windows), so they need what any shared-memory
program needs: no location is written while another process accesses it. Every write
above is under the exclusive lock, every other access under the shared or the exclusive
one. (A pull therefore does not count itself in the segment; the client publishes its
count later, under the exclusive lock it takes anyway.) So a pull never sees half a fold
(no torn reads), a fold's read-modify-write of the parameters, the state and the counters
is never interleaved with another (no lost or doubled update), and step claims are atomic
(max_steps stays exact). Memory ordering: Win.Sync after taking a lock and before
releasing it (the memory barrier the standard asks for between processes' load/store
accesses to a shared window; legal because Lock_all(MODE_NOCHECK) keeps a passive-target
epoch open for the window's life, without lock traffic); the lock calls are system calls,
which order memory as well.

Semantics against "rma": a client's first access waits (sleeping) until every shard it
touches has polled once (SERVING), as its first RMA epoch would: a caller that sets up
after open_parameter_server (Downpour's shard 0 starts its clock, its rounds) finds no
work done before it serves. A push returns once the gradient is applied (it is one fold:
version and applied pushes advance together, and staleness counts the updates applied
after the pull, exactly as there), a fetch after it always contains it (catch_up never
pulls again), push_pull's fetch always contains its push. The shard only polls, sparsely
(SHARED_POLL_S), for `finish()` and statistics, and shard 0 runs its duties between polls
as before. A checkpoint taken while clients may push uses `checkpoint_state()` (one
shared lock for parameters and state together); where no client pushes (Downpour's
checkpoint rounds) `parameters()` and `optimizer.state()` agree as on "rma".
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

from distbelief.model.layout import DTYPE, balanced_ranges
from distbelief.ps import run_control as rc
from distbelief.ps.run_control import ControlExchange, ControlView
from distbelief.runtime import watchdog
from distbelief.runtime.backoff import Backoff
from distbelief.runtime.topology import Topology

HEADER_BYTES = 64  # counters at the head of each window; data starts cache-line aligned
FLOAT_BYTES = DTYPE().itemsize
COUNTER_BYTES = 8
HEADER_SLOTS = HEADER_BYTES // COUNTER_BYTES
# int64 slots in the ACCUM header: TICKET (phase * PHASE + pushes started), DONE, and
# COMPLETED + b: pushes completed into accumulator b (slot 1 unused)
TICKET, DONE, COMPLETED = 0, 2, 3
ACCUM_SLOTS = COMPLETED + 2
PHASE = 1 << 40  # TICKET's unit of phases; pushes started are counted below it
GIVE_UP_S = 2.0
"""How long a shard waits for a push that started (took its ticket) to complete before it
folds the accumulator without it: that replica died or froze in the middle of its push.
(A healthy push completes in milliseconds; its data, if it ever lands, is folded later.)
A client whose process is seen gone (`ParameterServerShard.watch_clients`) is given up on
after GONE_CHECK_S instead. The default for a shard told nothing else: `watch_clients` sets
the bound of a job (Downpour: run.heartbeat_timeout_seconds, if longer)."""
GONE_CHECK_S = 0.02
CONTROL_SHARD = 0  # holds Downpour's run control block (distbelief.ps.run_control)
# int64 slots of a published parameter buffer's header (RMA) and of a shared segment's
VERSION, APPLIED = 0, 1
# int64 slots in the PARAMS window header (RMA): publishes finished, started; pulls
# served; holds asked and released by readers that tore too often (below)
PUBLISHED, BEGUN, PULLS, HOLDS_ASKED, HOLDS_RELEASED = 0, 1, 2, 3, 4
PARAMS_SLOTS = HOLDS_RELEASED + 1
TORN_READS_BEFORE_HOLD = 2
"""Torn reads in a row after which a reader asks the shard to hold its publishes (a
reader slower than two publishes, e.g. descheduled on a loaded node, would otherwise
retry for as long as the shard keeps publishing)."""
HOLD_MAX_S = 0.5
"""The longest a shard holds its publishes for one reader's request: a reader that died
after asking costs at most this much freshness, once."""
STALENESS_BINS = 64  # histogram bins 0..62, and the last for 63 or more


class Optimizer(Protocol):
    """What a shard needs from distbelief.model.optimizers (make_optimizer's Adagrad or SGD): an
    in-place update of its slice, and its state for checkpoints."""

    def step(self, params: np.ndarray, grad: np.ndarray,
             copy: np.ndarray | None = None) -> None: ...

    def state(self) -> dict[str, np.ndarray]: ...


OptimizerFactory = Callable[[int], Optimizer]  # slice length -> optimizer for that slice


def _complete(win: MPI.Win, ranks: Sequence[int]) -> None:
    """Complete every operation this rank issued on `win` to `ranks`, at the origin and at
    the targets (Win.Flush inside the Lock_all epoch every rank holds for the windows'
    life). Declared to the stall watchdog: a flush that never returns means a target is
    not polling (gone, stalled); no other client can make it wait, since nobody locks."""
    with watchdog.current().waiting(f"RMA operations on rank(s) {list(ranks)}' window "
                                    "to complete", tuple(ranks)):
        for rank in ranks:
            win.Flush(rank)


def _int64(buf: np.ndarray) -> list:
    """An mpi4py buffer spec that names the MPI datatype, so every accumulate on a counter
    uses the same basic datatype (atomicity holds per datatype)."""
    return [buf, MPI.INT64_T]


def _float64(buf: np.ndarray) -> list:
    """The same for the float64 loss slot."""
    return [buf, MPI.DOUBLE]


# Origin buffers of Get_accumulate(NO_OP) reads: MPI ignores them.
_NO_INT64 = [None, 0, MPI.INT64_T]
_NO_DOUBLE = [None, 0, MPI.DOUBLE]
_NO_FLOAT = [None, 0, MPI.FLOAT]


def _window_info() -> MPI.Info:
    info = MPI.Info.Create()
    # The default, stated so that the scheme above does not depend on it silently.
    info.Set("accumulate_ops", "same_op_no_op")
    info.Set("same_disp_unit", "true")
    return info


def _buffer_stride(count: int) -> int:
    return HEADER_BYTES + _aligned(count * FLOAT_BYTES)


class _ShardWindows:
    """The two windows of every shard, allocated and freed collectively in one order.
    ACCUM holds the run control block (`control_bytes`, Downpour's, used on shard 0) between
    its header and the gradient accumulator, which starts at `accum_data`."""

    def __init__(self, comm: MPI.Comm, local_count: int, control_bytes: int = 0,
                 clients: int = 0):
        self.control_bytes = control_bytes
        # One PENDING slot per client (int64, +1 as a push starts, -1 once it completed).
        self.pending = HEADER_BYTES + _aligned(control_bytes)
        self.clients = clients
        self.accum_data = self.pending + _aligned(clients * COUNTER_BYTES)
        data = local_count * DTYPE().itemsize
        # PARAMS holds two published buffers, each a header (VERSION, APPLIED) + the slice.
        info = _window_info()
        try:
            self.accum = MPI.Win.Allocate(
                self.accum_data + 2 * _aligned(data) if local_count else 0, 1, info, comm)
            self.params = MPI.Win.Allocate(
                HEADER_BYTES + 2 * _buffer_stride(local_count) if local_count else 0, 1, info,
                comm)
        finally:
            info.Free()
        for win in (self.accum, self.params):
            if win.model != MPI.WIN_UNIFIED:
                # The visibility argument in the module docstring assumes the unified model
                # (MPICH and Open MPI on cache-coherent machines always give it).
                raise RuntimeError("RMA window is not in the unified memory model")
            # One passive-target epoch on every rank's part for the windows' whole life:
            # nobody ever takes a lock (NOCHECK: no conflicting lock exists), so a rank
            # that dies holds nothing anybody waits for. Operations complete by Flush.
            win.Lock_all(MPI.MODE_NOCHECK)

    def accumulator(self, phase: int, count: int) -> int:
        """Byte offset of the ACCUM accumulator that pushes of phase `phase` add to, on a
        shard that holds `count` parameters."""
        return self.accum_data + (phase % 2) * _aligned(count * FLOAT_BYTES)

    @staticmethod
    def buffer(publish: int, count: int) -> int:
        """Byte offset of the PARAMS buffer that publish number `publish` writes, on a
        shard that holds `count` parameters."""
        return HEADER_BYTES + (publish % 2) * _buffer_stride(count)

    def free(self) -> None:
        """Collective over the window communicator, same order on every rank."""
        for win in (self.params, self.accum):
            win.Unlock_all()
        self.params.Free()
        self.accum.Free()


def _views(win: MPI.Win, count: int, data_offset: int) -> tuple[np.ndarray, np.ndarray]:
    """(int64 header, all its slots; float32 data from `data_offset`) views of this rank's
    part of `win`; no copy."""
    raw = np.frombuffer(win.tomemory(), dtype=np.uint8)
    header = raw[:HEADER_BYTES].view(np.int64)
    data = raw[data_offset : data_offset + count * DTYPE().itemsize].view(DTYPE)
    return header, data


def _issue_reads_of(win: MPI.Win, shards: Sequence[int], slot: int,
                    into: np.ndarray) -> None:
    """Fetch_and_op(NO_OP) of int64 header slot `slot` of every shard's PARAMS window into
    into[shard] (legal against the owner's SUMs)."""
    for shard in shards:
        win.Fetch_and_op(_int64(into[shard]), _int64(into[shard]), shard,
                         slot * COUNTER_BYTES, MPI.NO_OP)


def _issue_buffer_reads(windows: _ShardWindows, shards: Sequence[int],
                        segments: dict[int, list[tuple[int, int]]] | Sequence,
                        ranges: Sequence[tuple[int, int]], out: np.ndarray,
                        headers: np.ndarray, published: np.ndarray,
                        count_pull: np.ndarray | None) -> None:
    """Get_accumulate(NO_OP) of the buffer that publish published[shard] wrote: its header
    (VERSION, APPLIED) into headers[shard] and `segments[shard]` of the vector into `out`;
    with `count_pull` (int64 [1]), Accumulate(SUM) of it into the shard's pull counter."""
    win = windows.params
    for shard in shards:
        low, high = ranges[shard]
        where = windows.buffer(int(published[shard, 0]), high - low)
        win.Get_accumulate(_NO_INT64, _int64(headers[shard]), shard, (where, 2, MPI.INT64_T),
                           MPI.NO_OP)
        for start, stop in segments[shard]:
            win.Get_accumulate(_NO_FLOAT, [out[start:stop], MPI.FLOAT], shard,
                               (where + HEADER_BYTES + (start - low) * FLOAT_BYTES,
                                stop - start, MPI.FLOAT), MPI.NO_OP)
        if count_pull is not None:
            win.Accumulate(_int64(count_pull), shard, (PULLS * COUNTER_BYTES, 1, MPI.INT64_T),
                           MPI.SUM)


def _torn(shards: Sequence[int], published: np.ndarray, begun: np.ndarray) -> list[int]:
    """The shards whose buffer, read after seeing `published`, was being rewritten: the
    next write into buffer p % 2 is publish p + 2, and it had begun."""
    return [s for s in shards if begun[s, 0] > published[s, 0] + 1]


def _add_to_slot(win: MPI.Win, shards: Sequence[int], slot: int) -> None:
    """Accumulate(SUM) of 1 into int64 header slot `slot` of every shard's PARAMS window,
    completed."""
    one = np.ones(1, dtype=np.int64)
    for shard in shards:
        win.Accumulate(_int64(one), shard, (slot * COUNTER_BYTES, 1, MPI.INT64_T), MPI.SUM)
    _complete(win, shards)


def _read_published(windows: _ShardWindows, shards: Sequence[int],
                    segments: dict[int, list[tuple[int, int]]] | Sequence,
                    ranges: Sequence[tuple[int, int]], out: np.ndarray, headers: np.ndarray,
                    count_pull: np.ndarray | None = None) -> int:
    """Read the latest published parameters of `shards` (their `segments` into `out`,
    each buffer's VERSION and APPLIED into `headers`), in three rounds each completed by
    Flush: PUBLISHED, the buffer, BEGUN; again if a shard rewrote the buffer meanwhile
    (two publishes during one read). After TORN_READS_BEFORE_HOLD torn reads of a shard
    in a row, asks it to hold its publishes (HOLDS_ASKED += 1) and releases it once the
    read succeeded (HOLDS_RELEASED += 1). Returns the rounds of three made (1 usually).
    One-sided, to `shards`; accumulate operations only (NO_OP reads, SUMs)."""
    win = windows.params
    n = len(ranges)
    published = np.zeros((n, 1), dtype=np.int64)
    begun = np.zeros((n, 1), dtype=np.int64)
    torn_in_a_row = np.zeros(n, dtype=np.int64)
    held: list[int] = []
    tries = 0
    while True:
        tries += 1
        _issue_reads_of(win, shards, PUBLISHED, published)
        _complete(win, shards)
        _issue_buffer_reads(windows, shards, segments, ranges, out, headers, published,
                            count_pull if tries == 1 else None)
        _complete(win, shards)
        _issue_reads_of(win, shards, BEGUN, begun)
        _complete(win, shards)
        torn = _torn(shards, published, begun)
        if not torn:
            if held:
                _add_to_slot(win, held, HOLDS_RELEASED)
            return tries
        torn_in_a_row[torn] += 1
        ask = [s for s in torn
               if torn_in_a_row[s] >= TORN_READS_BEFORE_HOLD and s not in held]
        if ask:
            _add_to_slot(win, ask, HOLDS_ASKED)
            held.extend(ask)


class _Endpoint:
    """What shards and clients share: topology, ranges, windows and the collective free."""

    def __init__(self, comm: MPI.Comm, windows: _ShardWindows, topology: Topology,
                 size: int):
        self.topology = topology
        self.size = size
        self.ranges = balanced_ranges(size, topology.ps_shards)
        self._comm: MPI.Comm | None = comm
        self._windows: _ShardWindows | None = windows

    def _live(self) -> _ShardWindows:
        if self._windows is None:
            raise RuntimeError("parameter server already freed")
        return self._windows

    def _free_all(self, backoff: Backoff) -> None:
        """Collective over the world communicator, the same on every rank: wait for every
        rank (Ibarrier polled with back-off sleeps), free the windows, then the private
        communicator."""
        windows = self._live()
        request = self._comm.Ibarrier()
        guard = watchdog.current()
        others = [r for r in range(self._comm.Get_size()) if r != self._comm.Get_rank()]
        with guard.waiting("every rank, to free the parameter server's windows", others):
            while not request.Test():
                guard.check(request.Test)
                backoff.wait()
        windows.free()
        self._windows = None
        self._comm.Free()
        self._comm = None


def _waiting_backoff() -> Backoff:
    """For ranks with nothing to serve: back off up to 10 ms."""
    return Backoff(max_sleep_s=10e-3)


class ParameterServerShard(_Endpoint):
    """One shard: owns parameters [start, stop) and folds pushed gradients into them.

    Created by `open_parameter_server` on shard ranks. Its methods communicate only with
    its own windows (one-sided, target itself), except `free()`, which is collective.
    """

    def __init__(self, comm: MPI.Comm, windows: _ShardWindows, topology: Topology,
                 size: int, optimizer: Optimizer, initial: np.ndarray | None):
        super().__init__(comm, windows, topology, size)
        self.rank = topology.world_rank
        self.start, self.stop = self.ranges[self.rank]
        self.num_clients = topology.world_size - topology.ps_shards
        count = self.stop - self.start
        windows = self._live()
        raw = np.frombuffer(windows.accum.tomemory(), dtype=np.uint8)
        self._control = raw[HEADER_BYTES : HEADER_BYTES + windows.control_bytes].view(np.int64)
        self._optimizer = optimizer
        self._master = np.zeros(count, dtype=DTYPE)  # the parameters; private to this rank
        self._grad = np.zeros(count, dtype=DTYPE)  # the gradient batch being applied
        self._negated = np.zeros(count, dtype=DTYPE)  # -grad, subtracted from the accumulator
        self._counters = np.zeros(ACCUM_SLOTS, dtype=np.int64)  # ACCUM header as last read
        self._params_header = np.zeros(PARAMS_SLOTS, dtype=np.int64)  # as last read
        self._holds_seen = 0  # HOLDS_ASKED when the current hold began
        self._hold_since: float | None = None  # when it began
        self._unpublished = False  # a publish waits for a hold to end
        self._one = np.ones(1, dtype=np.int64)
        self._phase_unit = np.array([PHASE], dtype=np.int64)
        self._ticket = np.zeros(1, dtype=np.int64)
        self._phase = 0  # pushes that take a ticket now add to accumulator phase % 2
        self._started = 0  # pushes started (tickets taken) before the last flip
        self._expected = [0, 0]  # pushes into each accumulator its takes wait for, so far
        self._flipped_at: float | None = None  # set while the last phase awaits its take
        self._pending = np.zeros(windows.clients, dtype=np.int64)  # PENDING as last read
        self._client_gone: Callable[[int], bool] | None = None
        self._give_up_s = GIVE_UP_S  # a push in flight longer than this is written off
        self._given_up: set[int] = set()  # gone clients whose push in flight is written off
        self._written_off = 0  # pushes of gone clients the pending take no longer waits for
        self._buffer_header = np.zeros(2, dtype=np.int64)  # VERSION, APPLIED of a publish
        self._taken = 0
        self._pushes_taken = 0
        self._publishes = 0
        self._finished = False
        self.stats = ShardStats()
        if initial is not None:
            self._master[:] = initial[self.start : self.stop]
        # Window memory comes uninitialised: zero all of it with plain stores before any
        # client can access it (open_parameter_server's barrier follows), and Win.Sync so
        # that later RMA sees them.
        for win in (windows.accum, windows.params):
            np.frombuffer(win.tomemory(), dtype=np.uint8).fill(0)
            win.Sync()
        self._publish()

    @property
    def version(self) -> int:
        """Updates applied to this shard's parameters so far."""
        return self._taken

    @property
    def finished(self) -> bool:
        """True once every client has called finish() and every push is folded."""
        return self._finished

    @property
    def optimizer(self) -> Optimizer:
        """The optimizer of this shard's slice (its state goes into checkpoints)."""
        return self._optimizer

    def parameters(self) -> np.ndarray:
        """A copy of this shard's current parameters (for checkpoints). Local."""
        return self._master.copy()

    def checkpoint_state(self) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
        """Copies of the parameters and of the optimizer state, and the version, taken
        together: what a checkpoint writes. Local. (Here only the shard itself changes
        them; on the shared transport clients do, and this takes the segment's lock.)"""
        state = {name: value.copy() for name, value in self._optimizer.state().items()}
        return self._master.copy(), state, self._taken

    def set_parameters(self, values: np.ndarray) -> None:
        """Overwrite this shard's parameters (initial values, restores, tests).

        One-sided on its own PARAMS window: written as a new publish (double-buffered), so
        a concurrent pull sees either the old or the new slice, never a mix. Counters are
        unchanged.
        """
        self._live()
        if values.shape != self._master.shape:
            raise ValueError(f"shard {self.rank} holds {self._master.size} parameters, "
                             f"got shape {values.shape}")
        self._master[:] = values
        self._publish()

    def read_counters(self) -> tuple[int, int, int]:
        """(pushes completed, clients finished, pulls served), each read atomically.

        One-sided on its own windows: Get_accumulate(NO_OP) of the ACCUM header and
        of the PARAMS header, legal against the clients' concurrent SUMs,
        completed by Flush (which also drives MPI progress).
        """
        windows = self._live()
        windows.accum.Get_accumulate(_NO_INT64, _int64(self._counters), self.rank,
                                     (0, ACCUM_SLOTS, MPI.INT64_T), MPI.NO_OP)
        self._read_params_header()
        windows.accum.Flush(self.rank)
        completed = self._counters[COMPLETED] + self._counters[COMPLETED + 1]
        return int(completed), int(self._counters[DONE]), int(self._params_header[PULLS])

    def _read_params_header(self) -> None:
        """The PARAMS header (publishes, pulls, holds) into _params_header: one
        Get_accumulate(NO_OP) on its own window, completed."""
        win = self._live().params
        win.Get_accumulate(_NO_INT64, _int64(self._params_header), self.rank,
                           (0, PARAMS_SLOTS, MPI.INT64_T), MPI.NO_OP)
        win.Flush(self.rank)

    def watch_clients(self, gone: Callable[[int], bool],
                      give_up_s: float = GIVE_UP_S) -> None:
        """Let the fold ask whether a client (world rank) is gone (e.g. liveness.Peers.gone)
        when a push it started does not complete: a gone client's push is written off
        after GONE_CHECK_S; any other after `give_up_s` (frozen, or a node whose liveness
        is unknown here). Local."""
        if give_up_s < GONE_CHECK_S:
            raise ValueError(f"give_up_s must be at least {GONE_CHECK_S} s, got {give_up_s}")
        self._client_gone = gone
        self._give_up_s = give_up_s

    def read_run_control(self) -> ControlView:
        """Downpour's run control block (distbelief.ps.run_control) as it stands on this shard
        (shard 0 holds the one in use).

        One-sided on its own ACCUM window: Get_accumulate(NO_OP) reads with each slot's
        datatype, legal against the clients' concurrent SUMs.
        """
        win = self._live().accum
        n = self._control.size
        ints = np.zeros(n, dtype=np.int64)
        loss = np.zeros(1, dtype=np.float64)
        parts = [(0, rc.LOSS), (rc.LOSS + 1, n)]  # int64 slots around the float64 LOSS
        for a, b in parts:
            win.Get_accumulate(_NO_INT64, _int64(ints[a:b]), self.rank,
                               (HEADER_BYTES + a * COUNTER_BYTES, b - a, MPI.INT64_T),
                               MPI.NO_OP)
        win.Get_accumulate(_NO_DOUBLE, _float64(loss), self.rank,
                           (HEADER_BYTES + rc.LOSS * COUNTER_BYTES, 1, MPI.DOUBLE),
                           MPI.NO_OP)
        _complete(win, (self.rank,))
        return rc.ControlView.from_block(ints, float(loss[0]))

    def add_run_control(self, slot: int, value: int) -> None:
        """Add `value` to slot `slot` of this shard's run control block (shard 0's commands:
        STOP, CHECKPOINT, RELEASE, TEARDOWN, a replica's LOST).

        One-sided on its own ACCUM window: Accumulate(SUM), the same op the clients use,
        completed by Flush; no lock (a client that died mid-exchange cannot block it).
        """
        win = self._live().accum
        # Named: an origin buffer must live until the Flush completes the operation (a
        # temporary is freed when Accumulate returns; model/partitioned_network.py _softmax).
        addend = np.array([value], dtype=np.int64)
        win.Accumulate(_int64(addend), self.rank,
                       (HEADER_BYTES + slot * COUNTER_BYTES, 1, MPI.INT64_T), MPI.SUM)
        _complete(win, (self.rank,))

    def snapshot(self, out: np.ndarray) -> np.ndarray:
        """The whole current parameter vector into `out` (float32, the full size): this
        shard's master copy, and every other shard's published slice; returns the version
        of each slice (int64, one per shard). Used by shard 0 to evaluate while it serves.

        One-sided: reads every other shard's published buffer as a client's pull does,
        without the pull counter. Waits only for the other shards' own polling, never for
        a replica.
        """
        self._live()
        if out.dtype != DTYPE or out.shape != (self.size,) or not out.flags.c_contiguous:
            raise ValueError(f"snapshot buffer must be a contiguous float32 vector of "
                             f"{self.size} elements, got {out.dtype} {out.shape}")
        headers = np.zeros((self.topology.ps_shards, 2), dtype=np.int64)
        others = [s for s in self.topology.shard_ranks if s != self.rank]
        if others:
            _read_published(self._live(), others,
                            {s: [self.ranges[s]] for s in others}, self.ranges, out,
                            headers)
        out[self.start : self.stop] = self._master
        headers[self.rank, VERSION] = self._taken
        return headers[:, VERSION].copy()

    def _self_ops(self, win: MPI.Win) -> None:
        """Complete this rank's operations on its own part of `win`."""
        win.Flush(self.rank)

    def fold(self) -> int:
        """Fold every push started so far into the parameters, waiting (polling) for them
        to complete; returns the number of pushes folded (0: none, version unchanged).
        Local loop over serve_once's steps, for tests and callers outside serve()."""
        self.read_counters()
        if self._flipped_at is None and not self._flip():
            return 0
        backoff = Backoff(min_sleep_s=20e-6, max_sleep_s=0.5e-3)
        while True:
            self.read_counters()
            folded = self._advance()
            if self._flipped_at is None:
                return folded
            backoff.wait()

    def _flip(self) -> bool:
        """Close the current phase if a push started in it: Fetch_and_op(SUM, PHASE) on
        TICKET (the same op the clients use) returns the pushes started before; from now
        on pushes go to the other accumulator. Returns whether it flipped."""
        started = int(self._counters[TICKET]) % PHASE
        if started == self._started:
            return False
        win = self._live().accum
        win.Fetch_and_op(_int64(self._phase_unit), _int64(self._ticket), self.rank,
                         TICKET * COUNTER_BYTES, MPI.SUM)
        self._self_ops(win)
        started = int(self._ticket[0]) % PHASE
        self._expected[self._phase % 2] += started - self._started
        self._started = started
        self._phase += 1
        self._flipped_at = time.perf_counter()
        return True

    def _advance(self) -> int:
        """One step of the fold cycle, from the counters as last read: flip when pushes
        are pending, take the closed phase's accumulator once every push of it has
        completed (or after the give-up bound). Returns the pushes folded (0: none now)."""
        if self._flipped_at is None:
            if not self._flip():
                return 0
            # Usually every push of the closed phase has completed already: look now
            # rather than a poll later (a read-your-writes client waits for this take).
            self.read_counters()
        closed = (self._phase - 1) % 2
        completed = int(self._counters[COMPLETED + closed])
        if completed < self._expected[closed]:
            waited = time.perf_counter() - self._flipped_at
            if waited < GONE_CHECK_S:
                return 0
            if waited < self._give_up_s:
                self._written_off += self._gone_pending()
                if completed + self._written_off < self._expected[closed]:
                    return 0
            missing = self._expected[closed] - completed
            print(f"distbelief: shard {self.rank}: {missing} push(es) started {waited:.2f} s "
                  "ago never completed (a replica died or froze in the middle of a push); "
                  "folding without them", file=sys.stderr, flush=True)
            self._expected[closed] = completed
        return self._take(closed)

    def _gone_pending(self) -> int:
        """How many clients with a push in flight (PENDING) are gone; each is written off
        once (a gone client's PENDING stays 1 for ever)."""
        if self._client_gone is None or not self._pending.size:
            return 0
        win = self._live().accum
        win.Get_accumulate(_NO_INT64, _int64(self._pending), self.rank,
                           (self._live().pending, self._pending.size, MPI.INT64_T), MPI.NO_OP)
        self._self_ops(win)
        shards = self.topology.ps_shards
        gone = [c for c in np.flatnonzero(self._pending > 0)
                if int(c) not in self._given_up and self._client_gone(shards + int(c))]
        self._given_up.update(int(c) for c in gone)
        return len(gone)

    def _take(self, closed: int) -> int:
        """Take accumulator `closed` (every push of its phase completed, none will add to
        it before the next flip): read it (Get_accumulate NO_OP), subtract what was read
        (Accumulate SUM of the negation: exactly zero, and legal against a late SUM);
        apply it with the optimizer on the private master copy; publish."""
        windows = self._live()
        win, count = windows.accum, self.stop - self.start
        t0 = time.perf_counter()
        data = (windows.accumulator(closed, count), count, MPI.FLOAT)
        win.Get_accumulate(_NO_FLOAT, [self._grad, MPI.FLOAT], self.rank, data, MPI.NO_OP)
        self._self_ops(win)
        np.negative(self._grad, out=self._negated)
        win.Accumulate([self._negated, MPI.FLOAT], self.rank, data, MPI.SUM)
        self._self_ops(win)
        self._taken += 1
        self.stats.exclusive(wait=t0 - self._flipped_at, hold=time.perf_counter() - t0)
        self._flipped_at = None
        self._written_off = 0
        pushes = sum(self._expected)
        new = pushes - self._pushes_taken
        self._pushes_taken = pushes
        self._optimizer.step(self._master, self._grad)
        self._publish()
        self.stats.folds += 1
        self.stats.pushes += new
        return new

    def _publish(self) -> None:
        """Publish the master parameters, unless a reader asked for a hold (below): then
        the publish waits, and serve_once makes it once the hold is over. The parameters
        only become fresher meanwhile; every take still folds."""
        if self._holding():
            self._unpublished = True
            return
        self._unpublished = False
        self._write_publish()

    def _holding(self) -> bool:
        """Whether a reader's hold is on: it asked (HOLDS_ASKED rose) after tearing
        TORN_READS_BEFORE_HOLD reads in a row, has not released it yet (HOLDS_RELEASED
        behind), and the hold began less than HOLD_MAX_S ago (a dead reader never
        releases). One-sided on its own PARAMS window."""
        self._read_params_header()
        asked = int(self._params_header[HOLDS_ASKED])
        if asked > self._holds_seen:
            self._holds_seen, self._hold_since = asked, time.perf_counter()
            self.stats.holds += 1
        if int(self._params_header[HOLDS_RELEASED]) >= asked or self._hold_since is None:
            return False
        return time.perf_counter() - self._hold_since < HOLD_MAX_S

    def _write_publish(self) -> None:
        """Write the master parameters, version and applied count into the next PARAMS
        buffer: BEGUN += 1, the buffer (Accumulate REPLACE), PUBLISHED += 1, each round
        completed by Flush. A reader that saw PUBLISHED = p reads buffer p % 2 and keeps
        what it read only if BEGUN <= p + 1 after its read (the write of p + 2, the next
        into that buffer, had not begun)."""
        windows = self._live()
        win, count = windows.params, self.stop - self.start
        t0 = time.perf_counter()
        publish = self._publishes + 1
        win.Accumulate(_int64(self._one), self.rank, (BEGUN * COUNTER_BYTES, 1, MPI.INT64_T),
                       MPI.SUM)
        self._self_ops(win)
        where = windows.buffer(publish, count)
        self._buffer_header[:] = (self._taken, self._pushes_taken)
        win.Accumulate(_int64(self._buffer_header), self.rank, (where, 2, MPI.INT64_T),
                       MPI.REPLACE)
        win.Accumulate([self._master, MPI.FLOAT], self.rank,
                       (where + HEADER_BYTES, count, MPI.FLOAT), MPI.REPLACE)
        self._self_ops(win)
        win.Accumulate(_int64(self._one), self.rank,
                       (PUBLISHED * COUNTER_BYTES, 1, MPI.INT64_T), MPI.SUM)
        self._self_ops(win)
        self._publishes = publish
        self.stats.exclusive(wait=0.0, hold=time.perf_counter() - t0)

    def serve_once(self) -> bool:
        """One poll: read the counters (which drives MPI progress, letting the clients'
        pending locks, accumulates and gets complete) and fold if pushes are pending.
        Returns True if there was traffic (a fold, or pulls since the last poll), telling
        the caller to keep polling fast. One-sided on its own windows.
        """
        self.stats.polls += 1
        _, done, pulls = self.read_counters()
        phase = self._phase
        folded = self._advance() > 0
        if self._unpublished:
            self._publish()
        # Clients finish only after their last push completed, so once every client is
        # done, the tickets are final, and a fold of all of them leaves nothing behind
        # (and nothing unpublished: shard 0's last snapshot reads the published slices).
        if (done == self.num_clients and self._flipped_at is None
                and int(self._counters[TICKET]) % PHASE == self._started
                and not self._unpublished):
            self._finished = True
        pulled, self.stats.pulls = pulls > self.stats.pulls, pulls
        return folded or pulled or self._phase != phase or self._unpublished

    def serve(self, backoff: Backoff | None = None,
              between: Callable[[], bool] | None = None,
              until: Callable[[], bool] | None = None) -> ShardStats:
        """Serve pushes and pulls until every client has called finish() (or, if given,
        until `until()` is true); returns stats.

        Polls with `serve_once`, sleeping between polls under `backoff` (shortest sleep
        after traffic, longer while idle). `between()`, if given, runs after every poll
        (Downpour's shard 0 evaluates, logs and applies the stop rules there; it must be
        short, since the clients' operations wait while it runs); True counts as traffic.
        One-sided on its own windows, plus whatever `between` does.
        """
        backoff = backoff or Backoff()
        c0, t0 = time.process_time(), time.perf_counter()
        while not (until() if until is not None else self._finished):
            traffic = self.serve_once()
            if between is not None:
                traffic = between() or traffic
            if traffic:
                backoff.reset()
            else:
                backoff.wait()
        self.stats.cpu_s += time.process_time() - c0
        self.stats.wall_s += time.perf_counter() - t0
        return self.stats

    def free(self) -> None:
        """Serve until every client has finished, then free the windows.

        Collective over the world communicator (with every client's free()).
        """
        self.serve()
        self._free_all(_waiting_backoff())


@dataclass
class ShardStats:
    """What a shard did: folds, pushes folded, pulls served (as of the last poll), polls,
    its fold sections (on "rma", each take and each publish counts one: `hold` is its own
    time, `wait` the time a take waited after its flip for the closed phase's pushes to
    complete; the names are from the lock-based scheme before issue 17), CPU and wall
    time served, and the transport ("rma" or "shared"). On the shared transport the
    clients fold, and folds/pushes/pulls are read from the segment."""

    folds: int = 0
    pushes: int = 0
    pulls: int = 0
    polls: int = 0
    exclusive_sections: int = 0
    holds: int = 0  # readers' requests to hold publishes (RMA; see _read_published)
    hold_max_s: float = 0.0
    hold_total_s: float = 0.0
    wait_max_s: float = 0.0
    wait_total_s: float = 0.0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    transport: str = "rma"

    def exclusive(self, wait: float, hold: float) -> None:
        self.exclusive_sections += 1
        self.hold_max_s = max(self.hold_max_s, hold)
        self.hold_total_s += hold
        self.wait_max_s = max(self.wait_max_s, wait)
        self.wait_total_s += wait


@dataclass
class StalenessStats:
    """Staleness of pushed gradients, one sample per (push, shard): the number of updates
    the shard applied after the version the gradient was computed from, before it.

    `histogram[k]` counts samples of staleness k, the last bin those of STALENESS_BINS - 1
    or more."""

    samples: int = 0
    total: int = 0
    max: int = 0
    histogram: np.ndarray = field(
        default_factory=lambda: np.zeros(STALENESS_BINS, dtype=np.int64), repr=False)

    @property
    def mean(self) -> float:
        return self.total / self.samples if self.samples else 0.0

    def add(self, staleness: np.ndarray) -> None:
        self.samples += int(staleness.size)
        self.total += int(staleness.sum())
        self.max = max(self.max, int(staleness.max(initial=0)))
        self.histogram += np.bincount(np.minimum(staleness, STALENESS_BINS - 1),
                                      minlength=STALENESS_BINS)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: samples, mean, max, and the histogram with its trailing zeros cut."""
        used = int(np.flatnonzero(self.histogram)[-1]) + 1 if self.samples else 0
        return {"samples": self.samples, "mean": self.mean, "max": self.max,
                "histogram": [int(c) for c in self.histogram[:used]],
                "histogram_cap": STALENESS_BINS - 1}


class ParameterClient(_Endpoint):
    """A replica's (or the coordinator's) handle on all shards: pull, push, finish.

    Created by `open_parameter_server` on every non-shard rank. pull, push and finish are
    one-sided, targeting every shard (each round issued to all shards before one Flush
    per shard, so transfers to several shards overlap); free is collective over the
    world communicator.
    """

    def __init__(self, comm: MPI.Comm, windows: _ShardWindows, topology: Topology,
                 size: int):
        super().__init__(comm, windows, topology, size)
        shards = topology.ps_shards
        self.pulled_versions = np.zeros(shards, dtype=np.int64)
        self.applied_pushes = np.zeros(shards, dtype=np.int64)
        self.staleness = StalenessStats()
        self._finished = False
        self._headers = np.zeros((shards, 2), dtype=np.int64)
        self._one = np.ones(1, dtype=np.int64)
        self._taken = np.zeros((shards, 1), dtype=np.int64)  # phase of the last push
        self._tickets = np.zeros((shards, 1), dtype=np.int64)
        self._minus_one = -self._one
        self._client = topology.world_rank - shards  # its PENDING slot
        self._push_versions = np.zeros(shards, dtype=np.int64)  # versions holding last push
        self._published = np.zeros((shards, 1), dtype=np.int64)  # PUBLISHED as last read
        self._begun = np.zeros((shards, 1), dtype=np.int64)  # BEGUN as last read
        # What this client transfers, per shard: all of its range unless restrict_to.
        self._segments = [[r] for r in self.ranges]
        self._touched = np.ones(shards, dtype=bool)
        self._hang: Any = None  # test-only: what to do in the next push (Faults.hang or .kill)
        self._linger_s = 0.0  # test-only: seconds to hold each exchange's epoch open

    def hang_in_next_push(self, faults: Any) -> None:
        """TEST-ONLY (distbelief.runtime.faults "hang"): the next push stops responding for ever
        while it holds its locks on the shards, as a replica that froze mid-push."""
        self._hang = faults.hang

    def kill_in_next_push(self, faults: Any) -> None:
        """TEST-ONLY (distbelief.runtime.faults "killpush"): the next push kills its process
        (SIGKILL) once its operations are issued, before they complete, as a replica whose
        node crashed mid-push."""
        self._hang = faults.kill

    def linger_in_exchanges(self, seconds: float) -> None:
        """TEST-ONLY (distbelief.runtime.faults "linger"): from now on every exchange flushes
        its operations to shard 0 (they are applied there) and holds its epoch open
        `seconds` longer before the Unlock, as a rank descheduled just before it."""
        self._linger_s = seconds

    def _maybe_hang(self, shard: int) -> None:
        if self._hang is not None:
            self._hang(f"in a push, holding the lock on shard {shard}")

    def restrict_to(self, pieces: Sequence[tuple[int, int]]) -> None:
        """From now on pull and push only `pieces`, [start, stop) ranges of the vector (a
        model partition's own parameters, the paper's Figure 2). Shards holding none of
        them are not touched: no transfer, no pull or push counted there, no staleness
        sample (epochs are still opened on every shard, so a control exchange with shard
        0 stays legal). Local; call it before the first pull."""
        segments: list[list[tuple[int, int]]] = [[] for _ in self.ranges]
        for shard, (low, high) in enumerate(self.ranges):
            for start, stop in sorted(pieces):
                start, stop = max(start, low), min(stop, high)
                if start < stop:
                    segments[shard].append((start, stop))
        self._segments = segments
        self._touched = np.array([bool(s) for s in segments])

    def _check_vector(self, vector: np.ndarray, what: str) -> None:
        if vector.dtype != DTYPE or vector.shape != (self.size,) or not vector.flags.c_contiguous:
            raise ValueError(f"{what} must be a contiguous float32 vector of {self.size} "
                             f"elements, got {vector.dtype} {vector.shape}")

    def _check_open(self) -> _ShardWindows:
        windows = self._live()
        if self._finished:
            raise RuntimeError("this client already called finish()")
        return windows

    def _pulled_shards(self) -> list[int]:
        return [s for s in self.topology.shard_ranks if self._touched[s]]

    def _issue_push_ticket(self, win: MPI.Win) -> None:
        """A push's first round: take a ticket on each shard it touches (Fetch_and_op SUM
        of 1 on TICKET): it counts the push as started and names its phase."""
        pending = self._live().pending + self._client * COUNTER_BYTES
        for shard in self._pulled_shards():
            win.Fetch_and_op(_int64(self._one), _int64(self._tickets[shard]), shard,
                             TICKET * COUNTER_BYTES, MPI.SUM)
            win.Accumulate(_int64(self._one), shard, (pending, 1, MPI.INT64_T), MPI.SUM)

    def _issue_push_data(self, win: MPI.Win, grad: np.ndarray,
                         control: ControlExchange | None) -> None:
        """A push's second round: Accumulate(SUM) of the gradient into the accumulator of
        its phase on each shard, and the control operations on shard 0."""
        windows = self._live()
        self._taken[:, 0] = self._tickets[:, 0] // PHASE
        for shard in self._pulled_shards():
            low, high = self.ranges[shard]
            base = windows.accumulator(int(self._taken[shard, 0]), high - low)
            for start, stop in self._segments[shard]:
                win.Accumulate([grad[start:stop], MPI.FLOAT], shard,
                               (base + (start - low) * FLOAT_BYTES, stop - start,
                                MPI.FLOAT), MPI.SUM)
        if control is not None:
            control.issue(win, CONTROL_SHARD, HEADER_BYTES)
        self._maybe_hang(CONTROL_SHARD)

    def _issue_push_done(self, win: MPI.Win) -> None:
        """A push's third round, once its gradient has completed at every shard:
        Accumulate(SUM) of 1 into the COMPLETED counter of its accumulator, which the
        shard waits for before it takes that accumulator."""
        pending = self._live().pending + self._client * COUNTER_BYTES
        for shard in self._pulled_shards():
            slot = COMPLETED + int(self._taken[shard, 0]) % 2
            win.Accumulate(_int64(self._one), shard, (slot * COUNTER_BYTES, 1, MPI.INT64_T),
                           MPI.SUM)
            win.Accumulate(_int64(self._minus_one), shard, (pending, 1, MPI.INT64_T), MPI.SUM)

    def _pulled(self) -> np.ndarray:
        self.pulled_versions[:] = self._headers[:, VERSION]
        self.applied_pushes[:] = self._headers[:, APPLIED]
        return self.pulled_versions.copy()

    def _pushed(self) -> np.ndarray:
        # The push took its ticket in phase t on each shard: the take of phase t, version
        # t + 1, applies it; the shard applied t - p updates after the pull of version p.
        touched = self._touched
        self._push_versions[touched] = self._taken[touched, 0] + 1
        staleness = self._taken[:, 0] - self.pulled_versions
        self.staleness.add(staleness[touched])
        return staleness

    def pull(self, out: np.ndarray) -> np.ndarray:
        """Fetch all parameters into `out`; returns each shard's version (int64, one per
        shard). One-sided: reads each shard's latest published buffer (Get_accumulate
        NO_OP, checked untorn; see _read_published), plus an Accumulate(SUM) of 1 into its
        pull counter."""
        self._check_vector(out, "pull buffer")
        windows = self._check_open()
        _read_published(windows, self._pulled_shards(), self._segments, self.ranges, out,
                        self._headers, self._one)
        return self._pulled()

    def push(self, grad: np.ndarray, control: ControlExchange | None = None) -> np.ndarray:
        """Add `grad` to every shard's accumulator; returns the staleness per shard
        (updates the shard applied after the version of the last pull, before the push
        completed).

        One-sided, two rounds each completed by Flush: Accumulate(SUM) of each shard's
        slice (with `control`, its operations on shard 0 too); then Accumulate(SUM) of 1
        into each push counter and Fetch_and_op(NO_OP) on taken.
        """
        self._check_vector(grad, "gradient")
        win = self._check_open().accum
        shards = self.topology.shard_ranks
        self._issue_push_ticket(win)
        _complete(win, shards)
        self._issue_push_data(win, grad, control)
        _complete(win, shards)
        self._issue_push_done(win)
        _complete(win, shards)
        return self._pushed()

    def push_pull(self, grad: np.ndarray, out: np.ndarray,
                  control: ControlExchange | None = None) -> tuple[np.ndarray, np.ndarray]:
        """push(grad, control) and pull(out) with their rounds overlapped; returns
        (staleness, versions) as push and pull do.

        One-sided, to every shard: the same operations as push and pull, in three rounds
        instead of five. The parameters fetched may or may not contain this gradient yet
        (usually not).
        """
        self._check_vector(grad, "gradient")
        self._check_vector(out, "pull buffer")
        windows = self._check_open()
        accum, params = windows.accum, windows.params
        shards, pulled = self.topology.shard_ranks, self._pulled_shards()
        self._issue_push_ticket(accum)
        _issue_reads_of(params, pulled, PUBLISHED, self._published)
        _complete(accum, shards)
        _complete(params, pulled)
        self._issue_push_data(accum, grad, control)
        _issue_buffer_reads(windows, pulled, self._segments, self.ranges, out, self._headers,
                            self._published, self._one)
        _complete(accum, shards)
        _complete(params, pulled)
        self._issue_push_done(accum)
        _issue_reads_of(params, pulled, BEGUN, self._begun)
        _complete(accum, shards)
        _complete(params, pulled)
        if _torn(pulled, self._published, self._begun):
            _read_published(windows, pulled, self._segments, self.ranges, out, self._headers)
        return self._pushed(), self._pulled()

    def catch_up(self, out: np.ndarray, backoff: Backoff | None = None) -> int:
        """Make the last pull contain this client's last push (read-your-writes): pull
        again, sleeping under `backoff` between pulls, until every shard's pulled version
        includes the take that held that push. Returns the number of extra pulls (0 when
        the last pull had it already).

        One-sided, to every shard (pulls). It waits only for the shards to fold, never
        for another client; with one replica, push_pull + catch_up is exactly sequential
        SGD (the DistBelief server answers a replica's fetch after applying its push).
        """
        backoff = backoff or Backoff(min_sleep_s=20e-6, max_sleep_s=0.2e-3)
        extra = 0
        guard = watchdog.current()
        with guard.waiting("the shards to apply this client's push",
                           self.topology.shard_ranks):
            while (self.pulled_versions < self._push_versions).any():
                if extra:
                    guard.check()
                    backoff.wait()
                self.pull(out)
                extra += 1
        return extra

    def exchange(self, control: ControlExchange) -> None:
        """Only the control operations, without a gradient (a replica's first claim, its
        warm-start polls). One-sided: a SHARED epoch on shard 0's ACCUM window."""
        win = self._check_open().accum
        control.issue(win, CONTROL_SHARD, HEADER_BYTES)
        _complete(win, (CONTROL_SHARD,))
        if self._linger_s:
            time.sleep(self._linger_s)

    def finish(self) -> None:
        """Tell every shard that this rank will push no more. One-sided: Accumulate(SUM) of
        1 into each shard's done counter. Call it after the last push; idempotent."""
        if self._finished:
            return
        win = self._check_open().accum
        for shard in self.topology.shard_ranks:
            win.Accumulate(_int64(self._one), shard, (DONE * COUNTER_BYTES, 1, MPI.INT64_T),
                           MPI.SUM)
        _complete(win, self.topology.shard_ranks)
        self._finished = True

    def free(self) -> None:
        """finish() if not yet done, wait for every rank (polling with back-off sleeps,
        not spinning) and free the windows. Collective over the world communicator (with
        every shard's free())."""
        self.finish()
        self._free_all(_waiting_backoff())


# ------------------------------------------------------------------------------------------
# Shared by the transports (shared_memory.py, transport.py)

TRANSPORT_ENV = "DISTBELIEF_PS_TRANSPORT"
"""Environment variable naming the transport when open_parameter_server is not told:
"auto" (the default: shared memory when every rank is on one node, else RMA), "shared"
(shared memory or a ConfigError), "rma" (always RMA, e.g. to test the multi-node path)."""
TRANSPORTS = ("auto", "shared", "rma")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // HEADER_BYTES) * HEADER_BYTES
