"""The RMA transport's windows: their layout, the access rules that make every access
legal without locks, and the checked (seqlock) read of published parameters that clients
and shard 0's snapshots use. rma_shard.py and rma_client.py build on it.

Windows (per shard; size 0 on every other rank), allocated with Win.Allocate over a
private duplicate of the world communicator, displacement unit 1 byte:

    ACCUM  [0:8) TICKET | [16:24) DONE | [24:40) COMPLETED[0..1] | [40:56) FETCHED[0..1] |
           [64:64+c) run control
           block | PENDING[C] (two per client) | accumulator 0 f32 | accumulator 1 f32
    PARAMS [0:8) PUBLISHED | [8:16) BEGUN | [16:24) PULLS | [24:40) HOLDS_ASKED,
           HOLDS_RELEASED | buffer 0 | buffer 1, each
           [0:8) VERSION [8:16) APPLIED, then the slice f32       (counters: int64;
           c = run_control.block_bytes(R), used on shard 0 only; every part 64-byte aligned)

    TICKET    = phase * PHASE + pushes started (clients +1, the shard +PHASE to flip)
    COMPLETED = pushes completed into accumulator b (clients +1 once their data is in)
    FETCHED   = sum of the versions those pushes were computed on (clients + their pulled
                version, with the data; only where the shard's optimizer revises for
                delay, AdaRevision: the shard's take derives the fetch version from it)
    PENDING   = per client: 1 while it has a push in flight (+1 as it starts, -1 when
                done), and that push's phase + 1 once its data round went out (0
                before): the shard writes off a gone client's push for its phase only
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
| COMPLETED, PENDING,| client: Accumulate(SUM, +-1) int64 (FETCHED: + its |
| FETCHED,           |   pulled version; PENDING's phase slot: +-(f + 1))  |
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
protocols: pulls below, pushes in rma_shard.py. The owner's plain stores happen only at
creation, before the barrier that precedes any client access (Win.Sync makes them
visible). Visibility: the unified memory model (checked at creation); Flush completes an
operation at the target.

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
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from distbelief.model.layout import DTYPE
from distbelief.ps.endpoint import COUNTER_BYTES, HEADER_BYTES, _aligned
from distbelief.runtime import watchdog

FLOAT_BYTES = DTYPE().itemsize
# int64 slots in the ACCUM header: TICKET (phase * PHASE + pushes started), DONE, and
# COMPLETED + b: pushes completed into accumulator b (slot 1 unused), FETCHED + b: the sum
# of the versions those pushes had pulled (AdaRevision)
TICKET, DONE, COMPLETED, FETCHED = 0, 2, 3, 5
ACCUM_SLOTS = FETCHED + 2
PHASE = 1 << 40  # TICKET's unit of phases; pushes started are counted below it
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
        # Two PENDING slots per client (int64): a push in flight, and its phase + 1.
        self.pending = HEADER_BYTES + _aligned(control_bytes)
        self.clients = clients
        self.accum_data = self.pending + _aligned(2 * clients * COUNTER_BYTES)
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
