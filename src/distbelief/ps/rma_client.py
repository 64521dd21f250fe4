"""A replica's (or the coordinator's) handle on every shard over the RMA transport: push,
pull, push_pull, catch_up, finish. The windows and the access rules are in
rma_windows.py, the shard's side in rma_shard.py.

READ-YOUR-WRITES. `catch_up()` pulls again until the pulled versions include the update
that holds the client's last push (phase f: version f + 1), waiting only for the shard.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from distbelief.model.layout import DTYPE
from distbelief.ps.endpoint import (
    APPLIED,
    CONTROL_SHARD,
    COUNTER_BYTES,
    HEADER_BYTES,
    VERSION,
    _Endpoint,
    _waiting_backoff,
)
from distbelief.ps.rma_windows import (
    _NO_INT64,
    BEGUN,
    COMPLETED,
    DONE,
    FETCHED,
    FLOAT_BYTES,
    PHASE,
    PUBLISHED,
    TICKET,
    _complete,
    _int64,
    _issue_buffer_reads,
    _issue_reads_of,
    _read_published,
    _ShardWindows,
    _torn,
)
from distbelief.ps.run_control import ControlExchange
from distbelief.ps.stats import StalenessStats
from distbelief.runtime import watchdog
from distbelief.runtime.backoff import Backoff
from distbelief.runtime.topology import Topology


class ParameterClient(_Endpoint):
    """A replica's (or the coordinator's) handle on all shards: pull, push, finish.

    Created by `open_parameter_server` on every non-shard rank. pull, push and finish are
    one-sided, targeting every shard (each round issued to all shards before one Flush
    per shard, so transfers to several shards overlap); free is collective over the
    world communicator.
    """

    def __init__(self, comm: MPI.Comm, windows: _ShardWindows, topology: Topology,
                 size: int, send_fetched: bool = False):
        super().__init__(comm, windows, topology, size)
        shards = topology.ps_shards
        # Whether a push also adds the version it had pulled to FETCHED (the shards'
        # optimizer revises for delay: AdaRevision); one int64 per shard, same round.
        self._send_fetched = send_fetched
        self._fetched = np.zeros((shards, 1), dtype=np.int64)
        self.pulled_versions = np.zeros(shards, dtype=np.int64)
        self.applied_pushes = np.zeros(shards, dtype=np.int64)
        self.staleness = StalenessStats()
        self._finished = False
        self._headers = np.zeros((shards, 2), dtype=np.int64)
        self._one = np.ones(1, dtype=np.int64)
        self._taken = np.zeros((shards, 1), dtype=np.int64)  # phase of the last push
        self._tickets = np.zeros((shards, 1), dtype=np.int64)
        self._phase_marks = np.zeros((shards, 1), dtype=np.int64)  # phase + 1, to PENDING
        self._unmarks = np.zeros((shards, 1), dtype=np.int64)  # its negation, when done
        self._minus_one = -self._one
        self._client = topology.world_rank - shards  # its PENDING slot
        self._push_versions = np.zeros(shards, dtype=np.int64)  # versions holding last push
        self._published = np.zeros((shards, 1), dtype=np.int64)  # PUBLISHED as last read
        self._begun = np.zeros((shards, 1), dtype=np.int64)  # BEGUN as last read
        self._buffer_headers = np.zeros((shards, 2, 2), dtype=np.int64)  # both buffers'
        # What this client transfers, per shard: all of its range unless restrict_to.
        self._segments = [[r] for r in self.ranges]
        self._touched = np.ones(shards, dtype=bool)
        # push_pull_overlapped: a push whose data, and a pull whose buffer read, were
        # issued but not completed (they complete in the next call, or drain); a caller
        # that alternates pull buffers reads pull_in_flight
        self._in_flight = False
        self.pull_in_flight = False
        self._pull_out: np.ndarray | None = None
        self._in_flight_published = np.zeros((shards, 1), dtype=np.int64)  # PUBLISHED it read
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
        pending = self._live().pending + 2 * self._client * COUNTER_BYTES
        for shard in self._pulled_shards():
            win.Fetch_and_op(_int64(self._one), _int64(self._tickets[shard]), shard,
                             TICKET * COUNTER_BYTES, MPI.SUM)
            win.Accumulate(_int64(self._one), shard, (pending, 1, MPI.INT64_T), MPI.SUM)

    def _note_ticket(self) -> None:
        """Once the ticket round completed: the phase of the push (from its ticket) and
        the version its gradient was computed on (the last pull's, for FETCHED)."""
        self._taken[:, 0] = self._tickets[:, 0] // PHASE
        self._fetched[:, 0] = self.pulled_versions

    def _issue_push_data(self, win: MPI.Win, grad: np.ndarray,
                         control: ControlExchange | None) -> None:
        """A push's second round (after _note_ticket): Accumulate(SUM) of the gradient into
        the accumulator of its phase on each shard, and the control operations on shard
        0."""
        windows = self._live()
        phase_slot = windows.pending + (2 * self._client + 1) * COUNTER_BYTES
        self._phase_marks[:, 0] = self._taken[:, 0] + 1
        np.negative(self._phase_marks, out=self._unmarks)
        for shard in self._pulled_shards():
            low, high = self.ranges[shard]
            base = windows.accumulator(int(self._taken[shard, 0]), high - low)
            # The push's phase + 1 into PENDING's second slot, so the shard can tell which
            # phase a gone client's push was in.
            win.Accumulate(_int64(self._phase_marks[shard]), shard,
                           (phase_slot, 1, MPI.INT64_T), MPI.SUM)
            if self._send_fetched:
                # With the data, so it is complete before COMPLETED counts the push.
                slot = FETCHED + int(self._taken[shard, 0]) % 2
                win.Accumulate(_int64(self._fetched[shard]), shard,
                               (slot * COUNTER_BYTES, 1, MPI.INT64_T), MPI.SUM)
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
        pending = self._live().pending + 2 * self._client * COUNTER_BYTES
        for shard in self._pulled_shards():
            slot = COMPLETED + int(self._taken[shard, 0]) % 2
            win.Accumulate(_int64(self._one), shard, (slot * COUNTER_BYTES, 1, MPI.INT64_T),
                           MPI.SUM)
            win.Accumulate(_int64(self._minus_one), shard, (pending, 1, MPI.INT64_T), MPI.SUM)
            win.Accumulate(_int64(self._unmarks[shard]), shard,
                           (pending + COUNTER_BYTES, 1, MPI.INT64_T), MPI.SUM)

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
        self.drain()
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
        self.drain()
        self._issue_push_ticket(win)
        _complete(win, shards)
        self._note_ticket()
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
        self.drain()
        accum, params = windows.accum, windows.params
        shards, pulled = self.topology.shard_ranks, self._pulled_shards()
        self._issue_push_ticket(accum)
        _issue_reads_of(params, pulled, PUBLISHED, self._published)
        _complete(accum, shards)
        _complete(params, pulled)
        self._note_ticket()
        self._issue_push_data(accum, grad, control)
        _issue_buffer_reads(windows, pulled, self._segments, self.ranges, out, self._headers,
                            self._published, self._one)
        _complete(accum, shards)
        _complete(params, pulled)
        self._issue_push_done(accum)
        _issue_reads_of(params, pulled, BEGUN, self._begun)
        _complete(accum, shards)
        _complete(params, pulled)
        return self._pushed(), self._checked(out, self._published)

    def push_pull_overlapped(self, grad: np.ndarray, out: np.ndarray | None,
                             control: ControlExchange | None = None) -> tuple[np.ndarray, bool]:
        """push(grad, control) and, with `out`, pull(out), returning before their data moves:
        the transfers complete in the next call (or in any other call of this client),
        while the caller computes its next step (the paper's overlapped fetch and push).
        Until then the caller must not touch `grad` or `out`. Returns (staleness of this
        push, per shard; whether the pull issued by the previous call completed, into the
        buffer given then).

        One-sided, to every shard. Each call makes one round of small operations and waits
        for it: it completes the previous call's data (a Flush, usually already done),
        counts that push complete and checks that pull (BEGUN), takes this push's ticket,
        reads PUBLISHED and issues the control operations (so their answers are known at
        once); then it issues this push's data and this pull's buffer read, unflushed.
        The push therefore completes one step later than push_pull's, and the parameters
        computed on next are those of the previous call's pull: every gradient is at
        least two updates stale with one replica, where push_pull's are one, and the
        shards' takes wait for pushes that complete a step late. Staleness is still exact
        (ticket phase against the pulled version)."""
        self._check_vector(grad, "gradient")
        if out is not None:
            self._check_vector(out, "pull buffer")
        windows = self._check_open()
        accum, params = windows.accum, windows.params
        shards, pulled = self.topology.shard_ranks, self._pulled_shards()
        completed_pull = self._finish_in_flight(issue_next=True)
        self._issue_push_ticket(accum)
        if out is not None:
            _issue_reads_of(params, pulled, PUBLISHED, self._published)
        if control is not None:
            control.issue(accum, CONTROL_SHARD, HEADER_BYTES)
        _complete(accum, shards)
        _complete(params, pulled)
        # Before the pull in flight sets pulled_versions: this gradient was computed on the
        # parameters of the pull before it.
        self._note_ticket()
        staleness = self._pushed()
        if completed_pull:
            self._checked(self._pull_out, self._in_flight_published)
        self._issue_push_data(accum, grad, None)
        if out is not None:
            _issue_buffer_reads(windows, pulled, self._segments, self.ranges, out,
                                self._headers, self._published, self._one)
            self._pull_out, self._in_flight_published[:] = out, self._published
        self._in_flight, self.pull_in_flight = True, out is not None
        return staleness, completed_pull

    def _finish_in_flight(self, issue_next: bool) -> bool:
        """Complete what the last push_pull_overlapped left in flight: its data and its
        buffer read (Flush), then issue the push's completion count and, for the pull,
        the read of BEGUN; with `issue_next` they ride in the caller's next round, else
        they are completed here. Returns whether a pull was in flight."""
        if not self._in_flight:
            return False
        windows = self._live()
        shards, pulled = self.topology.shard_ranks, self._pulled_shards()
        _complete(windows.accum, shards)
        _complete(windows.params, pulled)
        self._issue_push_done(windows.accum)
        pull = self.pull_in_flight
        if pull:
            _issue_reads_of(windows.params, pulled, BEGUN, self._begun)
        self._in_flight = self.pull_in_flight = False
        if not issue_next:
            _complete(windows.accum, shards)
            _complete(windows.params, pulled)
            if pull:
                self._checked(self._pull_out, self._in_flight_published)
        return pull

    def _checked(self, out: np.ndarray, published: np.ndarray) -> np.ndarray:
        """The seqlock check of a buffer read into `out` after seeing `published`, once
        its BEGUN read completed: read again, whole, a shard whose buffer was rewritten
        meanwhile; then take the versions read (as _pulled)."""
        pulled = self._pulled_shards()
        if _torn(pulled, published, self._begun):
            _read_published(self._live(), pulled, self._segments, self.ranges, out,
                            self._headers)
        return self._pulled()

    def drain(self) -> bool:
        """Complete what push_pull_overlapped left in flight; returns whether a pull
        completed (into the buffer given then). Every other operation of this client
        calls it first; a caller that alternates pull buffers calls it itself, to adopt
        that pull."""
        return self._finish_in_flight(issue_next=False)

    def push_pull_own(self, grad: np.ndarray, out: np.ndarray,
                      control: ControlExchange | None = None) -> tuple[np.ndarray, int]:
        """push(grad, control), then pull(out) once every shard has applied that push
        (read-your-writes); returns (staleness, as push does; the pulls made beyond the
        first, as catch_up counts them after a push_pull). Pushing alone, not push_pull:
        its pull is read before the push lands, so it never holds it, and would only add
        2.7 MB to a step (0.2-0.3 ms with the reference MLP, benchmarks/RMA_NOTES.md
        section 11)."""
        staleness = self.push(grad, control)
        return staleness, max(0, self.catch_up(out) - 1)

    def catch_up(self, out: np.ndarray, backoff: Backoff | None = None) -> int:
        """Make the last pull contain this client's last push (read-your-writes): pull
        again, sleeping under `backoff` between pulls, until every shard's pulled version
        includes the take that held that push. Returns the number of extra pulls (0 when
        the last pull had it already).

        One-sided, to every shard (pulls). It waits only for the shards to fold, never
        for another client; with one replica, push_pull + catch_up is exactly sequential
        SGD (the DistBelief server answers a replica's fetch after applying its push).
        """
        self.drain()
        backoff = backoff or Backoff(min_sleep_s=20e-6, max_sleep_s=0.2e-3)
        extra = 0
        guard = watchdog.current()
        with guard.waiting("the shards to apply this client's push",
                           self.topology.shard_ranks):
            while (self.pulled_versions < self._push_versions).any():
                if not self._push_published():
                    guard.check()
                    backoff.wait()
                    continue
                self._pull_published(out)
                extra += 1
        return extra

    def _pull_published(self, out: np.ndarray) -> None:
        """pull(out) once _push_published has read PUBLISHED: the buffer it named and then
        BEGUN, two rounds instead of three (a whole pull again if the buffer was torn)."""
        windows, pulled = self._check_open(), self._pulled_shards()
        _issue_buffer_reads(windows, pulled, self._segments, self.ranges, out, self._headers,
                            self._published, self._one)
        _complete(windows.params, pulled)
        _issue_reads_of(windows.params, pulled, BEGUN, self._begun)
        _complete(windows.params, pulled)
        self._checked(out, self._published)

    def _push_published(self) -> bool:
        """Whether every shard behind has published, or is publishing, an update that holds
        this client's last push: one round of 8- and 16-byte reads (PUBLISHED and both
        buffers' VERSION, Fetch_and_op and Get_accumulate NO_OP), so that catch_up does
        not pull 2.7 MB again and again while a shard folds (4-5 pulls per step, each
        served by the folding shard, before: benchmarks/RMA_NOTES.md section 11). A hint
        only: the pull that follows checks what it read."""
        windows, pulled = self._check_open(), self._pulled_shards()
        win, behind = windows.params, [
            s for s in pulled if self.pulled_versions[s] < self._push_versions[s]]
        for shard in behind:
            low, high = self.ranges[shard]
            for b in (0, 1):
                win.Get_accumulate(_NO_INT64, _int64(self._buffer_headers[shard, b]), shard,
                                   (windows.buffer(b, high - low), 2, MPI.INT64_T), MPI.NO_OP)
        _issue_reads_of(win, pulled, PUBLISHED, self._published)
        _complete(win, pulled)
        return all(self._buffer_headers[s, self._published[s, 0] % 2, VERSION]
                   >= self._push_versions[s] for s in behind)

    def exchange(self, control: ControlExchange) -> None:
        """Only the control operations, without a gradient (a replica's first claim, its
        warm-start polls). One-sided: a SHARED epoch on shard 0's ACCUM window."""
        win = self._check_open().accum
        self.drain()
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
        self.drain()
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
