"""The RMA transport's windows: their layout, the operations allowed on each location,
and the registered read of published parameters that clients and shard 0's snapshots
use. rma_shard.py and rma_client.py build on it. Why every access is legal, from the
MPI-4.1 one-sided chapter, and why no rank can die holding anything another waits for:
docs/rma-protocol.md.

The rule (issue 28): float data moves only by Put and Get; every counter, claim and
registration is a count-1 int64 Fetch_and_op, Compare_and_swap or Accumulate, which a
network card does by itself (with `acc_single_intrinsic`, Open MPI's osc/ucx runs them
as UCX atomics and takes no accumulate lock; MPICH is told which ops to expect).

Windows (per shard; size 0 on every other rank), allocated with Win.Allocate over a
private duplicate of the world communicator, displacement unit 1 byte, int64 slots:

    ACCUM  [0:64) DONE, VERSION_NOW | run control block (shard 0's is used) |
           SLOT[K] states | K push slots of the slice (float32, or bfloat16 bits with
           optimizer.push_dtype = "bfloat16": PUSH_BYTES)
    PARAMS [0:64) NEWEST, PULLS | READING[world size] | FOLDED_HINT[clients] |
           BUFFERS published buffers, each [VERSION, APPLIED, FOLDED[clients]] + slice

    DONE        clients that called finish()             clients SUM, shard NO_OP
    VERSION_NOW updates the shard has applied            shard REPLACE, clients NO_OP
    SLOT[k]     0 free; c + 1 claimed by client c;       CAS by everyone, NO_OP reads
                FULL(c, fetched) once its data is in;
                QUARANTINED: a gone client's claim
    push slot k written by its claimant's Put, read by the shard's loads once FULL
    NEWEST      publish << 8 | buffer it wrote, or       shard REPLACE, readers NO_OP
                CLOSED while it rewrites that in place
    PULLS       pulls served                             clients SUM, shard NO_OP
    READING[r]  buffer + 1 rank r reads, 0 none          r REPLACE; shard REPLACE 0 for a
                                                           gone r; shard NO_OP reads
    FOLDED_HINT[c] pushes of c folded and published      shard REPLACE, client NO_OP
    buffer b    written by the shard's stores only while no reader is registered on it
                and NEWEST does not name it; read by registered readers' Get

Every rank opens one passive-target epoch on both windows at creation,
`Lock_all(MODE_NOCHECK)`, and keeps it until `free()`: nobody calls Lock or Unlock.

Why it is legal, in short (the argument in full: docs/rma-protocol.md): int64 atomics on
one location never conflict, and each location sees one op besides NO_OP (CAS on SLOT,
REPLACE on READING, NEWEST, VERSION_NOW and FOLDED_HINT, SUM elsewhere), as
`accumulate_ops = same_op_no_op` asks; every Put, Get and owner's load or store is kept
apart from any conflicting access by the claim/FULL protocol (slots) and the
registration protocol (buffers), each step completed by Flush or ordered by Win.Sync, in
the unified memory model.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from distbelief.model.layout import DTYPE
from distbelief.ps.endpoint import COUNTER_BYTES, HEADER_BYTES, PieceMap, aligned
from distbelief.runtime import counters
from distbelief.runtime.backoff import Backoff
from distbelief.runtime.health import watchdog

FLOAT_BYTES = DTYPE().itemsize
PUSH_BYTES = {"float32": FLOAT_BYTES, "bfloat16": 2}
"""Bytes per element of a push slot, by optimizer.push_dtype: a bfloat16 push is the
upper half of each float32 (distbelief.model.kernels.bf16_narrow), Put as MPI.UINT16_T."""
# int64 slots of the ACCUM header and of the PARAMS header
DONE, VERSION_NOW = 0, 1
NEWEST, PULLS = 0, 1
BUFFERS = 2
"""Published buffers per shard: the newest, and one the shard writes once every reader
registered on it has left. A reader registers only on the newest, so the other holds only
readers that began before the last publish: a publish waits at most for their Gets (an
overlapped pull's, a step); the shard folds on into its private parameters meanwhile and
publishes them all at once (RmaShard._publish). More buffers only shorten that wait, at a
slice each (docs/performance.md, "Memory per rank")."""
PUSH_SLOTS_ANY_SIZE = 8
"""Push slots a shard may have however large its slice (two per client up to this)."""
PUSH_SLOT_MEMORY = 64 << 20
"""More slots while they fit in this many bytes: replicas that outnumber the slots wait
for one at every push (claim retries; docs/performance.md, the control plane)."""
MAX_PUSH_SLOTS = 64
"""Never more: a shard reads every slot's state at each poll."""
CLIENT_BITS = 20
CLIENT_MASK = (1 << CLIENT_BITS) - 1
QUARANTINED = -1
"""A gone client's claim: its Put may still be in the network; the slot is reused only
after QUARANTINE_S (rma_shard)."""
BUFFER_BITS = 8
CLOSED = (1 << BUFFER_BITS) - 1
"""NEWEST's buffer while the shard rewrites its newest buffer in place (RmaShard._publish,
when a reader stuck on the other one holds publishes back): readers wait for it to name
a buffer again before they register."""
SLOT_HEADER_BYTES = 64
"""Before each push slot's data when clients push pieces (ServerSpec.pieces): int64
[P, T]: the push holds T values and then P (start, stop) int64 ranges of the slice
(relative to it), or P = -1: the values lie at their places in the slot (a push too
large for that form). A free slot's data is all zero, in both forms."""


def push_slots(clients: int, slot_bytes: int) -> int:
    """K: two per client (an overlapped push is in flight while the next one claims), at
    most PUSH_SLOTS_ANY_SIZE or as many slots of `slot_bytes` (a shard's slice as pushed)
    as PUSH_SLOT_MEMORY holds, and never more than MAX_PUSH_SLOTS; clients beyond that
    share them (a claim retries)."""
    fit = PUSH_SLOT_MEMORY // slot_bytes if slot_bytes > 0 else MAX_PUSH_SLOTS
    return max(1, min(2 * clients, MAX_PUSH_SLOTS, max(PUSH_SLOTS_ANY_SIZE, fit)))


def full_state(client: int, fetched: int) -> int:
    """SLOT value of client `client`'s completed push computed on version `fetched`."""
    return ((fetched + 1) << CLIENT_BITS) | (client + 1)


def slot_client(state: int) -> int:
    """The client a claimed or full SLOT value names (-1 for free or quarantined)."""
    return (state & CLIENT_MASK) - 1 if state > 0 else -1


def slot_is_full(state: int) -> bool:
    return state >> CLIENT_BITS > 0


def slot_fetched(state: int) -> int:
    return (state >> CLIENT_BITS) - 1


def newest_buffer(newest: int) -> int:
    return newest & ((1 << BUFFER_BITS) - 1)


def complete(win: MPI.Win, ranks: Sequence[int]) -> None:
    """Complete every operation this rank issued on `win` to `ranks`, at the origin and at
    the targets (Win.Flush inside the Lock_all epoch every rank holds for the windows'
    life). Declared to the stall watchdog: a flush that never returns means a target is
    not polling (gone, stalled); no other client can make it wait, since nobody locks."""
    with watchdog.current().waiting(f"RMA operations on rank(s) {list(ranks)}' window "
                                    "to complete", tuple(ranks)):
        for rank in ranks:
            win.Flush(rank)


def _int64(buf: np.ndarray) -> list:
    """An mpi4py buffer spec that names the MPI datatype, so every atomic on a counter
    uses the same basic datatype (atomicity holds per datatype)."""
    return [buf, MPI.INT64_T]


_NO_ORIGIN = np.zeros(1, dtype=np.int64)  # never written: NO_OP ignores it


def fetch_op(win: MPI.Win, value: np.ndarray | None, result: np.ndarray, target: int,
             slot_bytes: int, op: MPI.Op) -> None:
    """A count-1 int64 Fetch_and_op (NO_OP, SUM or REPLACE) on the int64 at byte
    `slot_bytes` of `target`'s part of `win`; result[0] gets what it held."""
    # MPI wants origin and result disjoint, even for NO_OP, which ignores the origin.
    origin = _int64(value if value is not None else _NO_ORIGIN)
    win.Fetch_and_op(origin, _int64(result), target, slot_bytes, op)


def add(win: MPI.Win, value: np.ndarray, target: int, slot_bytes: int) -> None:
    """A count-1 int64 Accumulate(SUM) of value[0]."""
    win.Accumulate(_int64(value), target, (slot_bytes, 1, MPI.INT64_T), MPI.SUM)


def compare_and_swap(win: MPI.Win, new: np.ndarray, compare: np.ndarray,
                     result: np.ndarray, target: int, slot_bytes: int) -> None:
    """A count-1 int64 Compare_and_swap: new[0] if it held compare[0]; result[0] gets what
    it held."""
    win.Compare_and_swap(_int64(new), _int64(compare), _int64(result), target, slot_bytes)


def window_info() -> MPI.Info:
    """What each MPI needs to do the atomics as network atomics (docs/rma-protocol.md):
    Open MPI's osc/ucx takes no accumulate lock for count-1 atomics of one predefined
    type with `acc_single_intrinsic`; MPICH is told the only ops used and that no
    ordering between accumulates is needed (every dependent one waits for a Flush).
    MPICH's `disable_shm_accumulate` stays unset (false): set, every atomic on one node
    waits for the target's progress engine, 80-90x fewer per second against a polling
    shard (benchmarks/RMA_NOTES.md section 13)."""
    info = MPI.Info.Create()
    info.Set("accumulate_ops", "same_op_no_op")
    info.Set("accumulate_ordering", "none")
    info.Set("which_accumulate_ops", "sum,replace,no_op,cswap")
    info.Set("acc_single_intrinsic", "true")
    info.Set("same_disp_unit", "true")
    return info


class CountedWindow:
    """An MPI.Win that counts its one-sided operations in runtime.counters (summary.json's
    `control_plane`); every other attribute is the window's own."""

    __slots__ = ("win",)

    def __init__(self, win: MPI.Win):
        self.win = win

    def __getattr__(self, name: str):
        return getattr(self.win, name)

    def Fetch_and_op(self, *args) -> None:
        counters.add("rma_atomics")
        self._watched(self.win.Fetch_and_op, "Fetch_and_op on a shard's window", args)

    def Compare_and_swap(self, *args) -> None:
        counters.add("rma_atomics")
        self._watched(self.win.Compare_and_swap, "Compare_and_swap on a shard's window", args)

    def Accumulate(self, *args) -> None:
        counters.add("rma_atomics")
        self._watched(self.win.Accumulate, "Accumulate on a shard's window", args)

    def Get(self, *args) -> None:
        counters.add("rma_gets")
        self.win.Get(*args)

    def Put(self, *args) -> None:
        counters.add("rma_puts")
        self.win.Put(*args)

    def Flush(self, rank: int) -> None:
        counters.add("rma_flushes")
        self._watched(self.win.Flush, "Flush on a shard's window", (rank,))

    @staticmethod
    def _watched(call, name: str, args: tuple) -> None:
        """`call(*args)` with the watchdog told it is inside MPI: an atomic that never
        returns (a lock a killed rank left held, docs/rma-protocol.md) is named and, after
        run.stall_abort_seconds, ends the job instead of hanging it."""
        dog = watchdog.current()
        dog.call_began(name)
        try:
            call(*args)
        finally:
            dog.call_ended()


class ShardWindows:
    """The two windows of every shard, allocated and freed collectively in one order."""

    def __init__(self, comm: MPI.Comm, local_count: int, control_bytes: int = 0,
                 clients: int = 0, push_dtype: str = "float32", largest_count: int = 0,
                 pieces: bool = False, slots: int | None = None):
        """`largest_count`: the largest shard's slice, which sets every shard's slot count
        (all ranks must agree on it). `slots`: that count forced (a test-only `slots`
        fault, ServerSpec.push_slots); None: push_slots's."""
        self.control_bytes = control_bytes
        self.push_dtype = push_dtype
        self.push_bytes = PUSH_BYTES[push_dtype]
        self.clients = clients
        self.slot_header = SLOT_HEADER_BYTES if pieces else 0
        self.readers = comm.Get_size()
        self.slots = slots or push_slots(clients, largest_count * self.push_bytes)
        self.slot_states = HEADER_BYTES + aligned(control_bytes)
        self.slot_data = self.slot_states + aligned(self.slots * COUNTER_BYTES)
        self.reading = HEADER_BYTES
        self.folded_hint = self.reading + aligned(self.readers * COUNTER_BYTES)
        self.buffer_header_bytes = aligned((2 + clients) * COUNTER_BYTES)
        self.buffers = self.folded_hint + aligned(clients * COUNTER_BYTES)
        info = window_info()
        try:
            self.accum = CountedWindow(MPI.Win.Allocate(
                self.slot_offset(self.slots, local_count) if local_count else 0, 1,
                info, comm))
            self.params = CountedWindow(MPI.Win.Allocate(
                self.buffer(BUFFERS, local_count) if local_count else 0, 1, info,
                comm))
        finally:
            info.Free()
        for win in (self.accum, self.params):
            if win.model != MPI.WIN_UNIFIED:
                # docs/rma-protocol.md's visibility argument assumes the unified model.
                raise RuntimeError("RMA window is not in the unified memory model")
            # One passive-target epoch on every rank's part for the windows' whole life:
            # nobody ever takes a lock, so a rank that dies holds nothing anybody waits
            # for. Operations complete by Flush.
            win.Lock_all(MPI.MODE_NOCHECK)

    def slot(self, k: int) -> int:
        """Byte offset of push slot k's state (int64)."""
        return self.slot_states + k * COUNTER_BYTES

    def slot_offset(self, k: int, count: int) -> int:
        """Byte offset of push slot k's data (push_bytes per element) on a shard of
        `count` parameters (windows are the same size on every rank but a shard's: 0)."""
        return (self.slot_data + k * (aligned(count * self.push_bytes) + self.slot_header)
                + self.slot_header)

    def reader(self, rank: int) -> int:
        """Byte offset of READING[rank]."""
        return self.reading + rank * COUNTER_BYTES

    def hint(self, client: int) -> int:
        """Byte offset of FOLDED_HINT[client]."""
        return self.folded_hint + client * COUNTER_BYTES

    def buffer(self, b: int, count: int) -> int:
        """Byte offset of published buffer b's header on a shard of `count` parameters;
        its slice follows the header."""
        return self.buffers + b * (self.buffer_header_bytes + aligned(count * FLOAT_BYTES))

    def free(self) -> None:
        """Collective over the window communicator, same order on every rank."""
        for win in (self.accum, self.params):
            win.Unlock_all()
        self.params.Free()
        self.accum.Free()


class PublishedReader:
    """One rank's registered reads of shards' published buffers (a client's pulls, shard
    0's snapshots): NEWEST, register on its buffer (READING[me] = b + 1), NEWEST again,
    until both name the same buffer; then Get the buffer's header and slice, and
    deregister. The shard writes a buffer only when it is not NEWEST and nobody is
    registered on it, so what a Get reads is one whole publish (docs/rma-protocol.md).
    One-sided, to the shards read; count-1 int64 atomics and Gets only."""

    def __init__(self, windows: ShardWindows, rank: int, shards: int, client: int | None):
        self.windows = windows
        self.rank = rank
        self.client = client  # its FOLDED slot in a buffer header, if it pushes
        self.newest = np.zeros((shards, 1), dtype=np.int64)
        self.checked = np.zeros((shards, 1), dtype=np.int64)
        self.registration = np.zeros((shards, 1), dtype=np.int64)
        self.previous = np.zeros((shards, 1), dtype=np.int64)
        self.registered: list[int] = []  # shards where READING[me] may be set
        self.bytes_received = 0  # parameter data Got so far (headers not counted)
        self._one = np.ones(1, dtype=np.int64)
        self._zero = np.zeros(1, dtype=np.int64)

    def issue_newest(self, shards: Sequence[int], count_pull: bool) -> None:
        """First round: read NEWEST of `shards` (and count a pull there)."""
        win = self.windows.params
        for s in shards:
            fetch_op(win, None, self.newest[s], s, NEWEST * COUNTER_BYTES, MPI.NO_OP)
            if count_pull:
                add(win, self._one, s, PULLS * COUNTER_BYTES)

    def register(self, shards: Sequence[int]) -> None:
        """Register on the buffer NEWEST named and read NEWEST again, one round each;
        again where it moved on meanwhile. Where NEWEST names no buffer (CLOSED: the shard
        is rewriting its newest in place, for the time of one store of its slice), read it
        again after a short sleep first. Returns once every shard's registration holds."""
        win = self.windows.params
        pending = list(shards)
        while pending:
            closed = [s for s in pending if newest_buffer(int(self.newest[s, 0])) == CLOSED]
            if closed:
                self._wait_open(closed)
                continue
            for s in pending:
                self.registration[s, 0] = newest_buffer(int(self.newest[s, 0])) + 1
                fetch_op(win, self.registration[s], self.previous[s], s,
                         self.windows.reader(self.rank), MPI.REPLACE)
                if s not in self.registered:
                    self.registered.append(s)
            complete(win, pending)
            for s in pending:
                fetch_op(win, None, self.checked[s], s, NEWEST * COUNTER_BYTES, MPI.NO_OP)
            complete(win, pending)
            moved = [s for s in pending if newest_buffer(int(self.checked[s, 0]))
                     != newest_buffer(int(self.newest[s, 0]))]
            for s in moved:
                self.newest[s] = self.checked[s]
            pending = moved

    def _wait_open(self, closed: Sequence[int]) -> None:
        """Read NEWEST of `closed` shards again, sleeping between reads, until each names a
        buffer (rma_shard: a store of the slice, or the shard's give-up, reopens it)."""
        win, guard = self.windows.params, watchdog.current()
        backoff = Backoff(min_sleep_s=20e-6, max_sleep_s=1e-3)
        with guard.waiting("a shard to reopen its newest buffer", tuple(closed)):
            while closed:
                guard.check()
                backoff.wait()
                for s in closed:
                    fetch_op(win, None, self.newest[s], s, NEWEST * COUNTER_BYTES, MPI.NO_OP)
                complete(win, closed)
                closed = [s for s in closed
                          if newest_buffer(int(self.newest[s, 0])) == CLOSED]

    def issue_get(self, shards: Sequence[int], segments, ranges: Sequence[tuple[int, int]],
                  out: np.ndarray, headers: np.ndarray, folded: np.ndarray | None,
                  pieces: PieceMap | None = None) -> None:
        """Get each registered buffer's VERSION, APPLIED into headers[s], this client's
        FOLDED into folded[s] and `segments[s]` of the slice into `out` (completed by the
        caller); with `pieces` (endpoint.PieceMap), its pieces of each shard into their
        part of the compact `out`, one Get of an indexed datatype per shard."""
        win = self.windows.params
        for s in shards:
            low, high = ranges[s]
            where = self.windows.buffer(newest_buffer(int(self.newest[s, 0])), high - low)
            win.Get(_int64(headers[s, :2]), s, (where, 2, MPI.INT64_T))
            if folded is not None:
                win.Get(_int64(folded[s]), s,
                        (where + (2 + self.client) * COUNTER_BYTES, 1, MPI.INT64_T))
            data = where + self.windows.buffer_header_bytes
            if pieces is not None:
                local = pieces.local[s]
                if not len(local):
                    continue
                kind = MPI.FLOAT.Create_indexed((local[:, 1] - local[:, 0]).tolist(),
                                                local[:, 0].tolist()).Commit()
                win.Get([pieces.part(out, s), MPI.FLOAT], s, (data, 1, kind))
                kind.Free()  # the Get keeps what it needs (MPI-4.1, 5.1.9)
                self.bytes_received += int(pieces.count[s]) * FLOAT_BYTES
                continue
            for start, stop in segments[s]:
                win.Get([out[start:stop], MPI.FLOAT], s,
                        (data + (start - low) * FLOAT_BYTES, stop - start, MPI.FLOAT))
                self.bytes_received += (stop - start) * FLOAT_BYTES

    def issue_deregister(self) -> None:
        """READING[me] = 0 on every shard registered on (once its Gets completed)."""
        win = self.windows.params
        for s in self.registered:
            fetch_op(win, self._zero, self.previous[s], s, self.windows.reader(self.rank),
                     MPI.REPLACE)

    def deregistered(self) -> None:
        self.registered = []

    def read(self, shards: Sequence[int], segments, ranges: Sequence[tuple[int, int]],
             out: np.ndarray, headers: np.ndarray, folded: np.ndarray | None,
             count_pull: bool, pieces: PieceMap | None = None) -> None:
        """A whole registered read of `shards`: five rounds, each completed by Flush."""
        win = self.windows.params
        self.issue_newest(shards, count_pull)
        complete(win, shards)
        self.register(shards)
        self.issue_get(shards, segments, ranges, out, headers, folded, pieces)
        complete(win, shards)
        registered = list(self.registered)
        self.issue_deregister()
        complete(win, registered)
        self.deregistered()
