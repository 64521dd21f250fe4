"""A parameter-server shard on the RMA transport (between nodes): it folds pushed
gradients into its slice with its optimizer and publishes the result. The windows and
the access rules are in rma_windows.py.

Pushes: double-buffered accumulators, closed by phases. A push is three rounds, each
completed by Flush on every shard: (1) take a ticket (Fetch_and_op SUM 1 on TICKET: it
counts the push as started and returns the phase f) and PENDING += 1; (2) Accumulate the
gradient into accumulator f % 2 (with the control operations) and f + 1 into the client's
second PENDING slot; (3) COMPLETED[f % 2] += 1, PENDING -= 1 and -(f + 1). The shard,
when tickets were taken since its last flip, flips (Fetch_and_op SUM PHASE on TICKET,
which returns the pushes started before it, atomically: so exactly those went to the
closed accumulator) and, on later polls, once COMPLETED of the closed
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

SHUTDOWN. A client's `finish()` adds 1 to `done` on every shard, one-sided, after its
last push has completed; a shard's `serve()` returns once done counts every client and it
has folded every push started before that. `free()` is the same on every rank: one
Ibarrier polled with back-off sleeps, then Unlock_all and the windows freed in one fixed
order.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from distbelief.model.layout import DTYPE
from distbelief.ps import run_control as rc
from distbelief.ps.endpoint import (
    COUNTER_BYTES,
    HEADER_BYTES,
    VERSION,
    Optimizer,
    _Endpoint,
    _waiting_backoff,
    saved_state,
)
from distbelief.ps.rma_windows import (
    _NO_DOUBLE,
    _NO_FLOAT,
    _NO_INT64,
    ACCUM_SLOTS,
    BEGUN,
    COMPLETED,
    DONE,
    FETCHED,
    HOLD_MAX_S,
    HOLDS_ASKED,
    HOLDS_RELEASED,
    PARAMS_SLOTS,
    PHASE,
    PUBLISHED,
    PULLS,
    TICKET,
    _complete,
    _float64,
    _int64,
    _read_published,
    _ShardWindows,
)
from distbelief.ps.run_control import ControlView
from distbelief.ps.stats import ShardStats
from distbelief.runtime.backoff import Backoff
from distbelief.runtime.topology import Topology

GIVE_UP_S = 2.0
"""How long a shard waits for a push that started (took its ticket) to complete before it
folds the accumulator without it: that replica died or froze in the middle of its push.
(A healthy push completes in milliseconds; its data, if it ever lands, is folded later.)
A client whose process is seen gone (`ParameterServerShard.watch_clients`) is given up on
after GONE_CHECK_S instead. The default for a shard told nothing else: `watch_clients` sets
the bound of a job (Downpour: run.heartbeat_timeout_seconds, if longer)."""
GONE_CHECK_S = 0.02


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
        # Views of the two accumulators, for takes by plain loads and stores (_take).
        self._accumulators = [raw[a : a + count * DTYPE().itemsize].view(DTYPE)
                              for a in (windows.accumulator(b, count) for b in (0, 1))]
        self._late_push_possible = False  # a push was written off: takes use accumulates
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
        self._pending = np.zeros((windows.clients, 2), dtype=np.int64)  # PENDING as read
        self._client_gone: Callable[[int], bool] | None = None
        self._give_up_s = GIVE_UP_S  # a push in flight longer than this is written off
        self._given_up: set[int] = set()  # gone clients whose push in flight is written off
        self._written_off = 0  # pushes of gone clients the pending take no longer waits for
        self._buffer_header = np.zeros(2, dtype=np.int64)  # VERSION, APPLIED of a publish
        self._fetched_seen = [0, 0]  # FETCHED of each accumulator at its last take
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
        state = {name: value.copy() for name, value in saved_state(self._optimizer).items()}
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
                self._written_off += self._gone_pending(self._phase - 1)
                if completed + self._written_off < self._expected[closed]:
                    return 0
            missing = self._expected[closed] - completed
            print(f"distbelief: shard {self.rank}: {missing} push(es) started {waited:.2f} s "
                  "ago never completed (a replica died or froze in the middle of a push); "
                  "folding without them", file=sys.stderr, flush=True)
            self._expected[closed] = completed
            self._late_push_possible = True
        return self._take(closed)

    def _gone_pending(self, closed: int) -> int:
        """How many gone clients have a push in flight (PENDING) in phase `closed`, or
        in a phase not yet known (it died between its ticket and its data); each is
        written off once (a gone client's PENDING stays as it left it). A push of a later
        phase (fetch = "overlapped" keeps one open for a whole step) waits for its take.
        The phase mark goes out with the push's data; where an MPI applies unflushed
        accumulates only at the flush, a client that died with its overlapped push in
        flight leaves its mark 0 and is counted against the closed phase, as before the
        mark existed (MPICH applied it in every run tried)."""
        if self._client_gone is None or not self._pending.size:
            return 0
        win = self._live().accum
        win.Get_accumulate(_NO_INT64, _int64(self._pending), self.rank,
                           (self._live().pending, self._pending.size, MPI.INT64_T), MPI.NO_OP)
        self._self_ops(win)
        shards = self.topology.ps_shards
        in_flight, marks = self._pending[:, 0], self._pending[:, 1]
        gone = [c for c in np.flatnonzero((in_flight > 0) & np.isin(marks, (0, closed + 1)))
                if int(c) not in self._given_up and self._client_gone(shards + int(c))]
        self._given_up.update(int(c) for c in gone)
        return len(gone)

    def _take(self, closed: int) -> int:
        """Take accumulator `closed` (every push of its phase completed, none will add to
        it before the next flip): read it into _grad and zero it (by plain loads and
        stores, or by accumulates once a late push is possible); apply it with the
        optimizer on the private master copy; publish."""
        t0 = time.perf_counter()
        if self._late_push_possible:
            self._take_by_accumulates(closed)
        else:
            self._take_by_loads(closed)
        self._taken += 1
        self.stats.exclusive(wait=t0 - self._flipped_at, hold=time.perf_counter() - t0)
        self._flipped_at = None
        self._written_off = 0
        pushes = sum(self._expected)
        new = pushes - self._pushes_taken
        self._pushes_taken = pushes
        if getattr(self._optimizer, "revises", False):
            self._optimizer.step(self._master, self._grad, version=self._taken - 1,
                                 fetched=self._fetched_version(closed, new))
        else:
            self._optimizer.step(self._master, self._grad)
        self._publish()
        self.stats.folds += 1
        self.stats.pushes += new
        return new

    def _take_by_loads(self, closed: int) -> None:
        """Read accumulator `closed` into _grad and zero it with plain loads and stores.
        Legal because no RMA access to it can be concurrent: every push of its phase has
        completed (its client flushed the data before counting it in COMPLETED, which the
        shard read), no push was written off (one could still land), and the next pushes
        into it take their tickets after the shard's next flip, which follows the second
        Win.Sync. Win.Sync orders the loads after the completed accumulates and the
        stores before that flip (unified model). 0.16 ms against 1.5 ms for the
        accumulates below (2.7 MB, MPICH; benchmarks/RMA_NOTES.md section 11)."""
        win = self._live().accum
        accumulator = self._accumulators[closed]
        win.Sync()
        np.copyto(self._grad, accumulator)
        accumulator.fill(0)
        win.Sync()

    def _take_by_accumulates(self, closed: int) -> None:
        """Read accumulator `closed` (Get_accumulate NO_OP) and subtract what was read
        (Accumulate SUM of the negation: exactly zero, and legal against a late SUM).
        Used from the first push written off on: its data may still land at any time."""
        windows = self._live()
        win, count = windows.accum, self.stop - self.start
        data = (windows.accumulator(closed, count), count, MPI.FLOAT)
        win.Get_accumulate(_NO_FLOAT, [self._grad, MPI.FLOAT], self.rank, data, MPI.NO_OP)
        self._self_ops(win)
        np.negative(self._grad, out=self._negated)
        win.Accumulate([self._negated, MPI.FLOAT], self.rank, data, MPI.SUM)
        self._self_ops(win)

    def _fetched_version(self, closed: int, pushes: int) -> int:
        """The version the take of accumulator `closed` was computed on, for AdaRevision:
        the mean, rounded, of the versions its `pushes` pushes had pulled (FETCHED, as
        read with their COMPLETED). A take sums its pushes into one gradient, as for
        Adagrad, so it is revised as one: exactly the paper's rule when they fetched one
        version (one replica; or replicas in step)."""
        total = int(self._counters[FETCHED + closed])
        added, self._fetched_seen[closed] = total - self._fetched_seen[closed], total
        if pushes <= 0:
            return self._taken - 1
        return min(self._taken - 1, round(added / pushes))

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
