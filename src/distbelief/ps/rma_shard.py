"""A parameter-server shard on the RMA transport (between nodes): it folds pushed
gradients into its slice with its optimizer and publishes the result. The windows and
the operations allowed on each location are in rma_windows.py; why each is legal, and
what a dying client can and cannot hold, in docs/rma-protocol.md.

Pushes: a pool of K push slots (rma_windows.push_slots). A client claims a free slot
(Compare_and_swap 0 -> its id), Puts its gradient there, completes it (Flush) and marks
the slot FULL (Compare_and_swap id -> FULL with the version it pulled). On every poll the
shard reads the slot states, sums every FULL slot into one update (plain loads: nobody
writes a FULL slot), frees them, applies the sum with its optimizer and publishes. No
push waits for another, so a slow or dead replica delays nobody: its claim only holds
its slot. Slots of bfloat16 pushes (optimizer.push_dtype) are widened to float32 as they
are summed (distbelief.model.kernels.bf16_widen), so the optimizer sees float32 as ever. Each push is folded exactly once (FULL is set once, freed once). A gone
client's unfilled claim is written off and its slot quarantined (QUARANTINE_S), through
`watch_clients`. Staleness: the client reads VERSION_NOW with its claim; staleness =
updates applied before its push - the version it pulled.

Pulls: BUFFERS (2) published buffers; a publish writes, by plain stores, the buffer that
is not NEWEST once no reader is registered on it, then sets NEWEST (rma_windows.PublishedReader
has the reader's side). Until then the shard folds on into its private parameters, and the
publish that follows holds every fold since (a reader of the old buffer delays publishes,
never folds or pushes). After STUCK_S it rewrites the newest buffer in place instead, if
nobody reads that one, with NEWEST CLOSED meanwhile, so that a reader stuck on the older
buffer holds back nobody (docs/performance.md, "Two publish buffers"). Each buffer's
header holds, per client, how many of its pushes it contains, so read-your-writes knows
which pull holds its push.

PROGRESS. With MPICH on shared memory an RMA operation completes only while the target
is inside MPI (DESIGN.md). The shard therefore polls: `serve_once()` reads its counters
(atomics on itself and a Flush, which drive MPI progress) and folds; `serve()` loops over
it, sleeping between polls with `Backoff`. Downpour's shards use `PacedBackoff`
(benchmarks/RMA_NOTES.md).

SHUTDOWN. A client's `finish()` adds 1 to DONE on every shard after its last push is
FULL; a shard's `serve()` returns once DONE counts every client and no slot is full.
`free()` is the same on every rank: one Ibarrier polled with back-off sleeps, then
Unlock_all and the windows freed in one fixed order.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from distbelief.model import kernels
from distbelief.model.layout import DTYPE, balanced_ranges
from distbelief.model.optimizers import ShardRule, StepInfo
from distbelief.ps import run_control as rc
from distbelief.ps.endpoint import (
    APPLIED,
    COUNTER_BYTES,
    GIVE_UP_S,
    HEADER_BYTES,
    VERSION,
    OpenWindows,
    ParameterServerShard,
    PieceMap,
    aligned,
    own_slice,
    piece_positions,
    saved_state,
    serve_polls,
    waiting_backoff,
)
from distbelief.ps.rma_windows import (
    BUFFER_BITS,
    BUFFERS,
    CLOSED,
    DONE,
    FLOAT_BYTES,
    NEWEST,
    PULLS,
    QUARANTINED,
    VERSION_NOW,
    PublishedReader,
    ShardWindows,
    add,
    compare_and_swap,
    complete,
    fetch_op,
    newest_buffer,
    slot_client,
    slot_fetched,
    slot_is_full,
)
from distbelief.ps.run_control import ControlView
from distbelief.ps.stats import ShardStats
from distbelief.runtime.backoff import Backoff
from distbelief.runtime.communicators.topology import Topology

# GIVE_UP_S (endpoint): since issue 28 no fold waits for any push, so on this transport
# the bound only validates `watch_clients`' argument; a gone client's claim is
# quarantined after GONE_CHECK_S.
GONE_CHECK_S = 0.02
"""How long a push slot must stay claimed, or a buffer registered, before the shard asks
whether its client is gone (a healthy push or read takes milliseconds)."""
QUARANTINE_S = 5.0
"""How long a gone client's claimed slot stays out of use: a Put it issued before dying
may still be in the network (or, through MPICH's active messages, in the target's queue),
and must land in a slot nobody else writes."""
STUCK_S = 0.001
"""How long a publish waits for the readers of the older buffer (a healthy Get of a slice
takes about a millisecond) before it tries to rewrite the newest buffer in place."""
UNPROVEN_QUARANTINE_S = 600.0
"""The same when the client is only taken for gone, not known to have ended (on another
node its heartbeat stopped, which a stopped or swapping process also does): its slot is
reused only after this long, so a process that wakes with a Put still in flight finds the
slot nobody's, and the pool loses at most two slots per such client for that time."""


class RmaShard(ParameterServerShard):
    """One shard on the RMA transport: owns parameters [start, stop) and folds pushed
    gradients into them.

    Created by rma.open_rma on shard ranks. Its methods communicate only with its own
    windows (one-sided, target itself), except `snapshot()` (reads the other shards'
    published buffers) and `free()`, which is collective.
    """

    def __init__(self, comm: MPI.Comm, windows: ShardWindows, topology: Topology,
                 size: int, optimizer: ShardRule, initial: np.ndarray | None,
                 gradients_before: int = 0):
        self.topology, self.size = topology, size
        self.ranges = balanced_ranges(size, topology.ps_shards)
        self._open = OpenWindows(comm, windows)
        self.rank = topology.world_rank
        self.start, self.stop = self.ranges[self.rank]
        self.num_clients = topology.world_size - topology.ps_shards
        count = self.stop - self.start
        windows = self._live()
        accum = np.frombuffer(windows.accum.tomemory(), dtype=np.uint8)
        params = np.frombuffer(windows.params.tomemory(), dtype=np.uint8)
        self._control = accum[HEADER_BYTES : HEADER_BYTES + windows.control_bytes].view(np.int64)
        # Views for the shard's own loads and stores (legal only where the protocol says
        # no RMA access can be concurrent: a FULL slot, an unregistered old buffer).
        self._narrowed = windows.push_dtype == "bfloat16"
        slot_dtype = np.uint16 if self._narrowed else DTYPE
        self._slots = [accum[o : o + count * windows.push_bytes].view(slot_dtype)
                       for o in (windows.slot_offset(k, count) for k in range(windows.slots))]
        # Pieces pushes (ServerSpec.pieces): each slot's header [P, T] and its raw bytes.
        self._pieces = windows.slot_header > 0
        self._slot_raw = [accum[o : o + aligned(count * windows.push_bytes)]
                          for o in (windows.slot_offset(k, count) for k in range(windows.slots))]
        self._slot_heads = [accum[o - windows.slot_header : o - windows.slot_header + 16]
                            .view(np.int64) for o in (windows.slot_offset(k, count)
                                                      for k in range(windows.slots))]
        self._buffers = []
        for b in range(BUFFERS):
            head = windows.buffer(b, count)
            self._buffers.append((
                params[head : head + windows.buffer_header_bytes].view(np.int64),
                params[head + windows.buffer_header_bytes :][: count * FLOAT_BYTES].view(DTYPE)))
        self._optimizer = optimizer
        self._master = np.zeros(count, dtype=DTYPE)  # the parameters; private to this rank
        # The gradient batch being applied: summed in place in the first FULL slot taken
        # (float32 slots), or widened from bfloat16 slots into its own buffer.
        self._grad = np.zeros(count if self._narrowed else 0, dtype=DTYPE)
        self._reader = PublishedReader(windows, self.rank, topology.ps_shards, None)
        self._states = np.zeros((windows.slots, 1), dtype=np.int64)  # SLOT as last read
        self._claimed_since: dict[int, tuple[int, float]] = {}  # slot: (state, first seen)
        self._quarantined: dict[int, tuple[float, float]] = {}  # slot: (since, how long)
        self._readings = np.zeros((windows.readers, 1), dtype=np.int64)  # READING as read
        self._registered_since: dict[int, tuple[int, float]] = {}  # rank: (value, seen)
        self._done = np.zeros(1, dtype=np.int64)
        self._pulls = np.zeros(1, dtype=np.int64)
        self._scratch = np.zeros(1, dtype=np.int64)
        self._value = np.zeros(1, dtype=np.int64)
        self._zero = np.zeros(1, dtype=np.int64)
        self._folded = np.zeros(max(self.num_clients, 1), dtype=np.int64)  # per client
        self._hinted = np.zeros_like(self._folded)  # FOLDED_HINT as last written
        self._client_gone: Callable[[int], bool] | None = None
        self._client_ended: Callable[[int], bool] = lambda rank: False
        self._give_up_s = GIVE_UP_S
        self._newest = 0  # NEWEST as last written
        self._fetched_sum = 0  # the versions the pushes of the current take had pulled
        self._taken = 0
        self._pushes_taken = 0
        self._gradients_before = gradients_before  # applied in earlier jobs (checkpoint)
        self._publishes = 0
        self._unpublished = False  # a publish waits for a free buffer
        self._held_at = 0.0  # since when
        self._in_place = False  # the last publish was into the newest buffer
        self._finished = False
        self.stats = ShardStats()
        if initial is not None:
            self._master[:] = own_slice(initial, self.start, self.stop)
        # Window memory comes uninitialised: zero all of it with plain stores before any
        # client can access it (open_parameter_server's barrier follows), write the first
        # publish into buffer 0, and Win.Sync so that later RMA sees them.
        for win in (windows.accum, windows.params):
            np.frombuffer(win.tomemory(), dtype=np.uint8).fill(0)
        self._store_buffer(0)
        self._publishes = 1
        self._newest = (1 << BUFFER_BITS) | 0
        params[:HEADER_BYTES].view(np.int64)[NEWEST] = self._newest
        for win in (windows.accum, windows.params):
            win.Sync()

    def _live(self) -> ShardWindows:
        return self._open.live()

    @property
    def version(self) -> int:
        """Updates applied to this shard's parameters so far."""
        return self._taken

    @property
    def gradients_applied(self) -> int:
        """Gradients (pushes) this slice has applied over the whole run, earlier jobs
        included: the position of the learning-rate schedule, kept in checkpoints."""
        return self._gradients_before + self._pushes_taken

    @property
    def finished(self) -> bool:
        """True once every client has called finish() and every push is folded."""
        return self._finished

    @property
    def optimizer(self) -> ShardRule:
        """The update rule of this shard's slice (its state goes into checkpoints)."""
        return self._optimizer

    def parameters(self, copy: bool = True) -> np.ndarray:
        """A copy of this shard's current parameters (for checkpoints). Local. With
        `copy=False`, the parameters themselves, read-only, valid until this shard serves
        again (a checkpoint written between two polls needs no second slice)."""
        if copy:
            return self._master.copy()
        view = self._master.view()
        view.flags.writeable = False
        return view

    def checkpoint_state(self) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
        """Copies of the parameters and of the optimizer state, and the version, taken
        together: what a checkpoint writes. Local."""
        state = {name: value.copy() for name, value in saved_state(self._optimizer).items()}
        return self._master.copy(), state, self._taken

    def set_parameters(self, values: np.ndarray) -> None:
        """Overwrite this shard's parameters (initial values, restores, tests).

        One-sided on its own PARAMS window: written as a new publish into a buffer nobody
        reads, so a concurrent pull sees either the old or the new slice, never a mix.
        """
        self._live()
        if values.shape != self._master.shape:
            raise ValueError(f"shard {self.rank} holds {self._master.size} parameters, "
                             f"got shape {values.shape}")
        self._master[:] = values
        self._publish()

    def read_counters(self) -> tuple[int, int, int]:
        """(pushes completed: folded, or full and waiting; clients finished; pulls
        served). One-sided on its own windows: count-1 Fetch_and_op(NO_OP) of DONE,
        PULLS and every SLOT, completed by Flush (which also drives MPI progress). DONE
        is read and flushed before the slots: a client marks its last slot FULL before it
        counts itself done, so a DONE that says every client finished guarantees that the
        slot reads after it see those marks (atomics are unordered without the flush)."""
        windows = self._live()
        accum, params = windows.accum, windows.params
        fetch_op(accum, None, self._done, self.rank, DONE * COUNTER_BYTES, MPI.NO_OP)
        accum.Flush(self.rank)
        for k in range(windows.slots):
            fetch_op(accum, None, self._states[k], self.rank, windows.slot(k), MPI.NO_OP)
        fetch_op(params, None, self._pulls, self.rank, PULLS * COUNTER_BYTES, MPI.NO_OP)
        accum.Flush(self.rank)
        params.Flush(self.rank)
        full = sum(slot_is_full(int(s)) for s in self._states[:, 0])
        return self.stats.pushes + full, int(self._done[0]), int(self._pulls[0])

    def watch_clients(self, gone: Callable[[int], bool],
                      give_up_s: float = GIVE_UP_S,
                      ended: Callable[[int], bool] | None = None) -> None:
        """Let the shard ask whether a client (world rank) is gone (e.g.
        liveness.Peers.gone) when a push slot it claimed stays unfilled, or a buffer it
        registered on stays registered, for GONE_CHECK_S: a gone client's claim is
        quarantined, its registration cleared. `ended` (e.g. liveness.Peers.ended) says
        whether its process is known to have ended; without that proof its slot is held
        for UNPROVEN_QUARANTINE_S instead of QUARANTINE_S. Local."""
        if give_up_s < GONE_CHECK_S:
            raise ValueError(f"give_up_s must be at least {GONE_CHECK_S} s, got {give_up_s}")
        self._client_gone = _asked_at_most_every(gone, GONE_CHECK_S)
        self._client_ended = ended or (lambda rank: False)
        self._give_up_s = give_up_s

    def read_run_control(self) -> ControlView:
        """Downpour's run control block (distbelief.ps.run_control) as it stands on this
        shard (shard 0 holds the one in use). One-sided on its own ACCUM window: a count-1
        int64 Fetch_and_op(NO_OP) per slot, legal against the clients' concurrent SUMs."""
        win = self._live().accum
        ints = np.zeros((self._control.size, 1), dtype=np.int64)
        for slot in range(self._control.size):
            fetch_op(win, None, ints[slot], self.rank, HEADER_BYTES + slot * COUNTER_BYTES,
                     MPI.NO_OP)
        complete(win, (self.rank,))
        return rc.ControlView.from_block(ints[:, 0])

    def add_run_control(self, slot: int, value: int) -> None:
        """Add `value` to slot `slot` of this shard's run control block (shard 0's commands:
        STOP, CHECKPOINT, RELEASE, TEARDOWN, a replica's LOST).

        One-sided on its own ACCUM window: a count-1 int64 Accumulate(SUM), the op the
        clients use, completed by Flush; no lock.
        """
        win = self._live().accum
        # Named: an origin buffer must live until the Flush completes the operation.
        addend = np.array([value], dtype=np.int64)
        add(win, addend, self.rank, HEADER_BYTES + slot * COUNTER_BYTES)
        complete(win, (self.rank,))

    def snapshot(self, out: np.ndarray, pieces: PieceMap | None = None) -> np.ndarray:
        """The whole current parameter vector into `out` (float32, the full size): this
        shard's master copy, and every other shard's published slice; returns the version
        of each slice (int64, one per shard). Used by shard 0 to evaluate while it serves.
        With `pieces`, only those, into the compact `out` (one indexed Get per shard).

        One-sided: a registered read of every other shard's newest buffer, as a client's
        pull, without the pull counter. Waits only for the other shards' own polling.
        """
        self._live()
        size = self.size if pieces is None else pieces.size
        if out.dtype != DTYPE or out.shape != (size,) or not out.flags.c_contiguous:
            raise ValueError(f"snapshot buffer must be a contiguous float32 vector of "
                             f"{size} elements, got {out.dtype} {out.shape}")
        headers = np.zeros((self.topology.ps_shards, 2), dtype=np.int64)
        others = [s for s in self.topology.shard_ranks if s != self.rank
                  and (pieces is None or s in pieces.shards)]
        if others:
            self._reader.read(others, {s: [self.ranges[s]] for s in others}, self.ranges,
                              out, headers, None, count_pull=False, pieces=pieces)
        if pieces is None:
            out[self.start : self.stop] = self._master
        elif self.rank in pieces.shards:
            np.take(self._master, pieces.index(self.rank), out=pieces.part(out, self.rank))
        headers[self.rank, VERSION] = self._taken
        return headers[:, VERSION].copy()

    def fold(self) -> int:
        """Fold every push completed so far into the parameters; returns the number of
        pushes folded (0: none, version unchanged). Local, for tests and callers outside
        serve()."""
        self.read_counters()
        return self._fold_full()

    def _fold_full(self) -> int:
        """Take every FULL push slot (as last read): sum their data by plain loads (into
        the first of them with plain stores; bfloat16 slots are widened into _grad), apply
        the sum with the optimizer as one update, then free the slots (Compare_and_swap
        FULL -> 0) and publish. Loads and stores are legal: the client completed its Put
        (Flush) before it marked the slot FULL, and nobody accesses a FULL slot until the
        shard frees it; Win.Sync orders them after the mark and before the free (unified
        model). Summing in a slot spares the shard a slice-sized buffer (docs/performance.md,
        "Memory per rank"); the slots stay FULL for the update's pass over the slice."""
        windows = self._live()
        full = [k for k in range(windows.slots) if slot_is_full(int(self._states[k, 0]))]
        if not full:
            return 0
        t0 = time.perf_counter()
        win = windows.accum
        win.Sync()
        index = None
        if self._pieces:
            index, grad = self._take_pieces(full)
        elif self._narrowed:  # bfloat16 slots, widened exactly and summed in float32
            grad = self._grad
            kernels.bf16_widen(self._slots[full[0]], grad)
            for k in full[1:]:
                kernels.bf16_widen(self._slots[k], grad, accumulate=True)
        else:
            grad = self._slots[full[0]]
            for k in full[1:]:
                grad += self._slots[k]
        # A take sums its pushes into one gradient, applied as one update: it was pulled
        # at the mean of their versions (the paper's rule when they pulled one version).
        fetched = sum(slot_fetched(int(self._states[k, 0])) for k in full)
        info = StepInfo(update=self.gradients_applied, version=self._taken,
                        fetched=min(self._taken, round(fetched / len(full))),
                        pushes=len(full))
        self._taken += 1
        self._pushes_taken += len(full)
        if index is not None:
            self._optimizer.apply_at(self._master, grad, index, info)
        else:
            self._optimizer.apply(self._master, grad, info)
        if self._pieces:
            self._clear_pieces(full)
        elif not self._narrowed and len(full) > 1:
            # The first slot now holds the other pushes' values too. A client restricted to
            # its pieces (a model partition) Puts only those, and relies on the rest of its
            # own slots staying zero: clear the sum before the slot is freed.
            grad.fill(0)
        win.Sync()
        for k in full:
            state = int(self._states[k, 0])
            self._folded[slot_client(state)] += 1
            self._value[0] = state
            compare_and_swap(win, self._zero, self._value, self._scratch, self.rank,
                             windows.slot(k))
            win.Flush(self.rank)
            self._states[k, 0] = 0
        self._value[0] = self._taken
        fetch_op(win, self._value, self._scratch, self.rank, VERSION_NOW * COUNTER_BYTES,
                 MPI.REPLACE)
        win.Flush(self.rank)
        self.stats.exclusive(wait=0.0, hold=time.perf_counter() - t0)
        self._publish()
        self.stats.folds += 1
        self.stats.pushes += len(full)
        return len(full)

    def _slot_pieces(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """A compact pieces push in slot k: (its positions in the slice, its values)."""
        pieces, values = (int(v) for v in self._slot_heads[k])
        start = -(-values * FLOAT_BYTES // COUNTER_BYTES) * COUNTER_BYTES
        ranges = self._slot_raw[k][start : start + 16 * pieces].view(np.int64).reshape(-1, 2)
        return piece_positions(ranges), self._slots[k][:values]

    def _take_pieces(self, full: list[int]) -> tuple[np.ndarray | None, np.ndarray]:
        """The take's pieces pushes summed: (positions, their gradient), or (None, the
        whole slice's gradient, summed in the first slot that holds values at their
        places) when one of them does."""
        dense = [k for k in full if self._slot_heads[k][0] < 0]
        if dense:
            grad = self._slots[dense[0]]
            for k in full:
                if k in dense[1:]:
                    grad += self._slots[k]
                elif k not in dense:
                    index, values = self._slot_pieces(k)
                    grad[index] += values  # distinct positions within one push
            return None, grad
        parts = [self._slot_pieces(k) for k in full]
        if len(parts) == 1:
            return parts[0]
        index, where = np.unique(np.concatenate([p for p, _ in parts]), return_inverse=True)
        summed = np.bincount(where, weights=np.concatenate([v for _, v in parts]),
                             minlength=len(index))
        return index, summed.astype(DTYPE)

    def _clear_pieces(self, full: list[int]) -> None:
        """Zero what the take's pieces pushes wrote, so a free slot is all zero again."""
        for k in full:
            pieces, values = (int(v) for v in self._slot_heads[k])
            if pieces < 0:
                self._slots[k].fill(0)
            else:
                start = -(-values * FLOAT_BYTES // COUNTER_BYTES) * COUNTER_BYTES
                self._slot_raw[k][: start + 16 * pieces] = 0
            self._slot_heads[k][:] = 0

    def _reclaim(self) -> None:
        """Quarantine the push slots claimed (never filled) by gone clients, and reuse
        them after QUARANTINE_S. Only with watch_clients: otherwise nobody waits on a
        claim anyway (no fold waits for a push), it only holds a slot."""
        if self._client_gone is None:
            return
        windows, now = self._live(), time.perf_counter()
        for k in range(windows.slots):
            state = int(self._states[k, 0])
            if state == QUARANTINED:
                since, hold = self._quarantined.setdefault(k, (now, UNPROVEN_QUARANTINE_S))
                if now - since >= hold:
                    if self._pieces:  # a free slot is all zero: pieces pushes add to it
                        self._slot_raw[k][:] = 0
                        self._slot_heads[k][:] = 0
                    if self._swap_slot(k, state, 0):
                        del self._quarantined[k]
                continue
            if state <= 0 or slot_is_full(state):
                self._claimed_since.pop(k, None)
                continue
            seen, since = self._claimed_since.get(k, (state, now))
            if seen != state:
                since = now
            self._claimed_since[k] = (state, since)
            client = slot_client(state)
            rank = self.topology.ps_shards + client
            if (now - since >= GONE_CHECK_S and self._client_gone(rank)
                    and self._swap_slot(k, state, QUARANTINED)):
                hold = QUARANTINE_S if self._client_ended(rank) else UNPROVEN_QUARANTINE_S
                print(f"distbelief: shard {self.rank}: a push of client {client} never "
                      f"completed (its process is gone; push slot {k} was claimed): the "
                      f"push is written off, the slot quarantined for {hold:.0f} s",
                      file=sys.stderr, flush=True)
                self._claimed_since.pop(k, None)
                self._quarantined[k] = (now, hold)

    def _swap_slot(self, k: int, state: int, new: int) -> bool:
        """Compare_and_swap SLOT[k] from `state` to `new` on its own window; whether it
        held `state`."""
        windows = self._live()
        self._value[0], self._scratch[0] = new, state
        result = np.zeros(1, dtype=np.int64)
        compare_and_swap(windows.accum, self._value, self._scratch, result, self.rank,
                         windows.slot(k))
        windows.accum.Flush(self.rank)
        self._states[k, 0] = new if int(result[0]) == state else int(result[0])
        return int(result[0]) == state

    def _publish(self) -> None:
        """Publish the master parameters into the buffer that is not NEWEST once no reader
        is registered on it; until then the publish waits for a later poll (the parameters
        only get fresher meanwhile). After STUCK_S of waiting, it rewrites the newest buffer
        in place instead if nobody reads that one (_close_newest): a reader stuck on the
        older buffer then holds back no publish, and no client's read-your-writes."""
        buffer = self._free_buffer()
        if buffer is None:
            now = time.perf_counter()
            if not self._unpublished:
                self.stats.holds += 1
                self._held_at = now
            self._unpublished = True
            # Right after an in-place publish the older buffer is still held (a stuck
            # reader holds it for long): try in place again at once.
            if now - self._held_at < STUCK_S and not self._in_place:
                return
            buffer = self._close_newest()
            if buffer is None:
                self._held_at, self._in_place = now, False  # the next try after STUCK_S
                return
            self.stats.publishes_in_place += 1
        self._in_place = buffer == newest_buffer(self._newest)
        self._unpublished = False
        t0 = time.perf_counter()
        self._store_buffer(buffer)
        self._publishes += 1
        self._newest = (self._publishes << BUFFER_BITS) | buffer
        windows = self._live()
        win = windows.params
        self._value[0] = self._newest
        fetch_op(win, self._value, self._scratch, self.rank, NEWEST * COUNTER_BYTES,
                 MPI.REPLACE)
        # With it, each client whose pushes this publish holds learns so (catch_up).
        hints = np.flatnonzero(self._folded != self._hinted)
        for c in hints:
            self._hinted[c] = self._folded[c]
            fetch_op(win, self._hinted[c : c + 1], self._scratch, self.rank,
                     windows.hint(int(c)), MPI.REPLACE)
        win.Flush(self.rank)
        self.stats.exclusive(wait=0.0, hold=time.perf_counter() - t0)

    def _store_buffer(self, b: int) -> None:
        """Write VERSION, APPLIED, FOLDED and the master slice into buffer b with plain
        stores, between two Win.Sync: legal because no Get of it is in flight or can
        start (docs/rma-protocol.md, the reader's registration)."""
        header, data = self._buffers[b]
        win = self._live().params
        win.Sync()
        header[VERSION], header[APPLIED] = self._taken, self._pushes_taken
        header[2 : 2 + self.num_clients] = self._folded[: self.num_clients]
        np.copyto(data, self._master)
        win.Sync()

    def _close_newest(self) -> int | None:
        """Make NEWEST name no buffer (CLOSED) and, if no reader is registered on the
        buffer it named, return that buffer for an in-place publish, which reopens NEWEST
        when it sets it; else reopen it as it was and return None. Legal as _free_buffer
        is: a reader Gets a buffer only after registering and then reading NEWEST naming
        it, so one that registers after READING was read here finds NEWEST CLOSED (or,
        after the store, the new publish) and Gets nothing of the store in progress."""
        windows = self._live()
        win = windows.params
        newest = newest_buffer(self._newest)
        self._value[0] = (self._newest & ~((1 << BUFFER_BITS) - 1)) | CLOSED
        fetch_op(win, self._value, self._scratch, self.rank, NEWEST * COUNTER_BYTES,
                 MPI.REPLACE)
        win.Flush(self.rank)
        if newest not in self._busy_buffers():
            return newest
        self._value[0] = self._newest
        fetch_op(win, self._value, self._scratch, self.rank, NEWEST * COUNTER_BYTES,
                 MPI.REPLACE)
        win.Flush(self.rank)
        return None

    def _busy_buffers(self) -> set[int]:
        """The buffers some reader is registered on: READING, each read with a count-1
        Fetch_and_op NO_OP; the registrations of gone clients held over GONE_CHECK_S are
        cleared first."""
        windows = self._live()
        win = windows.params
        for r in range(windows.readers):
            fetch_op(win, None, self._readings[r], self.rank, windows.reader(r), MPI.NO_OP)
        win.Flush(self.rank)
        self._clear_gone_readers()
        return {int(v) - 1 for v in self._readings[:, 0] if v > 0}

    def _free_buffer(self) -> int | None:
        """A buffer neither NEWEST nor registered by any reader (READING, each read with
        a count-1 Fetch_and_op NO_OP after NEWEST last changed; with 2 buffers, the other
        one or None); clears the registrations of gone clients held over GONE_CHECK_S."""
        busy = self._busy_buffers()
        newest = newest_buffer(self._newest)
        for step in range(1, BUFFERS):
            b = (newest + step) % BUFFERS
            if b not in busy:
                return b
        return None

    def _clear_gone_readers(self) -> None:
        """READING[r] = 0 (REPLACE, the op readers use) for a gone client r whose
        registration has stood for GONE_CHECK_S: a dead reader blocks no buffer for
        longer."""
        if self._client_gone is None:
            return
        windows, now = self._live(), time.perf_counter()
        shards = self.topology.ps_shards
        for r in range(shards, windows.readers):
            value = int(self._readings[r, 0])
            if value <= 0:
                self._registered_since.pop(r, None)
                continue
            seen, since = self._registered_since.get(r, (value, now))
            since = since if seen == value else now
            self._registered_since[r] = (value, since)
            if now - since >= GONE_CHECK_S and self._client_gone(r):
                fetch_op(windows.params, self._zero, self._scratch, self.rank,
                         windows.reader(r), MPI.REPLACE)
                windows.params.Flush(self.rank)
                self._readings[r, 0] = 0
                self._registered_since.pop(r, None)

    def serve_once(self) -> bool:
        """One poll: read the counters (which drives MPI progress), fold the full push
        slots, quarantine gone clients' claims, retry a waiting publish. Returns True if
        there was traffic (a fold, or pulls since the last poll), telling the caller to
        keep polling fast. One-sided on its own windows.
        """
        self.stats.polls += 1
        _, done, pulls = self.read_counters()
        folded = self._fold_full() > 0
        self._reclaim()
        if self._unpublished:
            self._publish()
        # Clients finish only after their last push is FULL, so once every client is
        # done and no slot is full after this fold, nothing is left (and nothing
        # unpublished: shard 0's last snapshot reads the published slices).
        if (done == self.num_clients and not folded and not self._unpublished
                and not any(slot_is_full(int(s)) for s in self._states[:, 0])):
            self._finished = True
        pulled, self.stats.pulls = pulls > self.stats.pulls, pulls
        return folded or pulled

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
        return serve_polls(self, backoff or Backoff(), between, until)

    def free(self) -> None:
        """Serve until every client has finished, then free the windows.

        Collective over the world communicator (with every client's free()).
        """
        self.serve()
        self._open.free(waiting_backoff())


def _asked_at_most_every(gone: Callable[[int], bool],
                         interval: float) -> Callable[[int], bool]:
    """`gone`, asked about each rank at most once per `interval` (the last answer is kept
    in between): an overlapped client holds its slot and its registration for a whole
    step, and a /proc or heartbeat-file check on every poll would spin the shard's core."""
    answers: dict[int, tuple[float, bool]] = {}

    def asked(rank: int) -> bool:
        now = time.perf_counter()
        at, answer = answers.get(rank, (-math.inf, False))
        if now - at >= interval:
            answer = bool(gone(rank))
            answers[rank] = (now, answer)
        return answer

    return asked
