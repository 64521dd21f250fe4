"""A replica's (or the coordinator's) handle on every shard over the RMA transport: push,
pull, push_pull, catch_up, finish. The windows and the operations allowed on each
location are in rma_windows.py, the shard's side in rma_shard.py, why it is legal in
docs/rma-protocol.md.

A push: (1) claim a push slot on each shard (Compare_and_swap 0 -> id; the run control
operations, and a read of VERSION_NOW for staleness, ride in the same round); (2) Put
the gradient into it; (3) mark it FULL (Compare_and_swap). Each round is completed by
Flush. A pull is rma_windows.PublishedReader's registered read.

NARROWED PUSHES. With push_dtype "bfloat16" (optimizer.push_dtype) the client rounds each
piece of the gradient to bfloat16 into a buffer of its own just before its Put, which
then moves half the bytes; the shard widens it back (rma_shard). The buffer is reused at
the next push only after that push's Put completed (every call completes the previous
one's transfers first).

BYTES. `bytes_sent` counts the gradient data this client Put, `bytes_received` the
parameter data it Got (the 8-byte counters, headers and atomics are not counted: tens of
bytes a step against megabytes).

READ-YOUR-WRITES. `catch_up()` pulls again until the pulled buffers' FOLDED count of this
client's pushes reaches the pushes it made, waiting only for the shards (polling the
8-byte FOLDED_HINT in between).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from distbelief.model import kernels
from distbelief.model.layout import balanced_ranges
from distbelief.ps.endpoint import (
    CONTROL_SHARD,
    COUNTER_BYTES,
    HEADER_BYTES,
    OpenWindows,
    ParameterClient,
    PieceMap,
    PullLedger,
    PushFaults,
    aligned,
    check_vector,
    touched_mask,
    waiting_backoff,
)
from distbelief.ps.rma_windows import (
    DONE,
    FLOAT_BYTES,
    SLOT_HEADER_BYTES,
    VERSION_NOW,
    PublishedReader,
    ShardWindows,
    add,
    compare_and_swap,
    complete,
    fetch_op,
    full_state,
)
from distbelief.ps.run_control import ControlExchange
from distbelief.runtime import counters
from distbelief.runtime.backoff import Backoff, LearnedBackoff
from distbelief.runtime.communicators.topology import Topology
from distbelief.runtime.health import watchdog


class RmaClient(ParameterClient):
    """A replica's (or the coordinator's) handle on all shards over RMA: pull, push,
    finish.

    Created by rma.open_rma on every non-shard rank. pull, push and finish are
    one-sided, targeting every shard (each round issued to all shards before one Flush
    per shard, so transfers to several shards overlap); free is collective over the
    world communicator.
    """

    def __init__(self, comm: MPI.Comm, windows: ShardWindows, topology: Topology,
                 size: int):
        self.topology, self.size = topology, size
        self.ranges = balanced_ranges(size, topology.ps_shards)
        self._open = OpenWindows(comm, windows)
        self.bytes_sent = 0
        # bfloat16 pushes: the narrowed gradient, Put from here (rma_windows.PUSH_BYTES)
        self._narrowed = (np.zeros(size, dtype=np.uint16)
                          if windows.push_dtype == "bfloat16" else None)
        shards = topology.ps_shards
        # Pushes always carry the version they were computed on, in their FULL mark
        # (StepInfo.fetched on the shard).
        self._client = topology.world_rank - shards  # its id in SLOT and FOLDED
        self._reader = PublishedReader(windows, topology.world_rank, shards, self._client)
        # What this client transfers, per shard (all of its range unless restrict_to),
        # and what it saw of the shards.
        self._ledger = PullLedger(self.ranges)
        self.pulled_versions = self._ledger.pulled_versions
        self.applied_pushes = self._ledger.applied_pushes
        self.staleness = self._ledger.staleness
        self._finished = False
        self._folded_read = np.zeros((shards, 1), dtype=np.int64)  # FOLDED[me] pulled
        self._folded = np.zeros(shards, dtype=np.int64)  # FOLDED as last pulled
        self._pushes_made = np.zeros(shards, dtype=np.int64)  # marked FULL, per shard
        self._hints = np.zeros((shards, 1), dtype=np.int64)
        self._claim_results = np.zeros((shards, 1), dtype=np.int64)
        self._mark_results = np.zeros((shards, 1), dtype=np.int64)  # disjoint: both in flight
        self._slot = np.full(shards, -1, dtype=np.int64)  # slot claimed, per shard
        self._last_slot = np.full(shards, -1, dtype=np.int64)
        self._mine = np.array([self._client + 1], dtype=np.int64)  # a claim's value
        # Waits for a fold: polls spaced by how long they last. (Not the waits for a free
        # slot: a claim sleeps holding its slots on lower shards, so longer sleeps there
        # lengthen everyone's wait, which lengthened the sleeps: with one slot per shard,
        # 5 replicas took minutes for 200 steps.)
        self._fold_wait = LearnedBackoff(min_sleep_s=20e-6, max_sleep_s=0.2e-3)
        self._free = np.zeros(1, dtype=np.int64)
        self._marks = np.zeros((shards, 1), dtype=np.int64)  # FULL values being written
        self._one = np.ones(1, dtype=np.int64)
        # push_pull_overlapped: a push whose data, and a pull whose Get, were issued but
        # not completed (they complete in the next call, or drain); a caller that
        # alternates pull buffers reads pull_in_flight
        self._in_flight = False
        self.pull_in_flight = False
        self._pull_out: np.ndarray | None = None
        self._faults = PushFaults()  # test-only
        self._pull_map: PieceMap | None = None  # use_pieces
        self._push_map: PieceMap | None = None
        self._slot_heads = np.zeros((shards, 2), dtype=np.int64)  # a pieces push's header

    def hang_in_next_push(self, faults: Any) -> None:
        """As ParameterClient.hang_in_next_push: it holds its claimed slots."""
        self._faults.hang = faults.hang

    def kill_in_next_push(self, faults: Any) -> None:
        """As ParameterClient.kill_in_next_push: once its operations are issued, before
        they complete, as a replica whose node crashed mid-push."""
        self._faults.hang = faults.kill

    def linger_in_exchanges(self, seconds: float) -> None:
        """TEST-ONLY (distbelief.runtime.launching.faults "linger"): from now on every exchange
        flushes its operations to shard 0 (they are applied there) and holds its epoch open
        `seconds` longer before the Unlock, as a rank descheduled just before it."""
        self._faults.linger_s = seconds

    def restrict_to(self, pieces: Sequence[tuple[int, int]]) -> None:
        """From now on pull and push only `pieces`, [start, stop) ranges of the vector (a
        model partition's own parameters, the paper's Figure 2). Shards holding none of
        them are not touched: no transfer, no pull or push counted there, no staleness
        sample (epochs are still opened on every shard, so a control exchange with shard
        0 stays legal). Local; call it before the first pull."""
        self._ledger.restrict_to(pieces)

    def use_pieces(self, pulls: PieceMap | None, pushes: PieceMap | None) -> None:
        """As ParameterClient.use_pieces: a pull Gets each shard's pieces with one indexed
        datatype; a push Puts its values, and its pieces as (start, stop) int64 ranges,
        into the slot (rma_windows.SLOT_HEADER_BYTES), so the shard folds those
        coordinates alone. Shards in either map are pushed to and pulled from."""
        if (pulls is not None or pushes is not None) and not self._live().slot_header:
            raise ValueError("this parameter server was opened without pieces "
                             "(ServerSpec.pieces)")
        self._pull_map, self._push_map = pulls, pushes
        shards = set(() if pulls is None else pulls.shards) | set(
            () if pushes is None else pushes.shards)
        self._ledger.touched = touched_mask(len(self.ranges), shards)

    @property
    def bytes_received(self) -> int:
        """Parameter data pulled so far, in bytes (see BYTES above)."""
        return self._reader.bytes_received

    def _live(self) -> ShardWindows:
        return self._open.live()

    def _check_vector(self, vector: np.ndarray, what: str) -> None:
        plan = self._pull_map if what == "pull buffer" else self._push_map
        check_vector(vector, self.size if plan is None else plan.size, what)

    def _check_open(self) -> ShardWindows:
        windows = self._live()
        if self._finished:
            raise RuntimeError("this client already called finish()")
        return windows

    def _pulled_shards(self) -> list[int]:
        return self._ledger.touched_shards()

    def _candidates(self, shard: int) -> list[int]:
        """Slots to try on `shard`, in order: the client's two home slots (the other one
        first after a push, so an overlapped push in flight keeps its own), then the
        rest."""
        k = self._live().slots
        home = [(2 * self._client) % k, (2 * self._client + 1) % k]
        if self._last_slot[shard] == home[0]:
            home.reverse()
        return list(dict.fromkeys(home + [(home[0] + i) % k for i in range(k)]))

    def _claim(self, win: MPI.Win, control: ControlExchange | None,
               also: Sequence[tuple[MPI.Win, Sequence[int]]] = ()) -> None:
        """A push's first round: Compare_and_swap(0 -> id) on a push slot of each shard
        it touches, Fetch_and_op(NO_OP) of VERSION_NOW there, and the control operations
        on shard 0; a shard whose slot was taken is tried on its next slot in another
        round, sleeping after a whole turn (every slot busy: the shard is behind). `also`:
        other windows' operations issued into the first round, completed with it."""
        shards = self.topology.shard_ranks
        pending = {s: self._candidates(s) for s in self._pulled_shards()}
        for s in pending:
            fetch_op(win, None, self._ledger.taken[s], s, VERSION_NOW * COUNTER_BYTES,
                     MPI.NO_OP)
        if control is not None:
            control.issue(win, CONTROL_SHARD, HEADER_BYTES)
        first, backoff = True, Backoff(min_sleep_s=20e-6, max_sleep_s=1e-3)
        guard = watchdog.current()
        held: set[int] = set()
        with guard.waiting("a free push slot on the shards", tuple(pending)):
            while pending:
                turn = {s: order.pop(0) for s, order in pending.items()}
                for s, k in turn.items():
                    compare_and_swap(win, self._mine, self._free, self._claim_results[s], s,
                                     self._live().slot(k))
                complete(win, shards if first else list(turn))
                for other, ranks in (also if first else ()):
                    complete(other, ranks)
                if not first:
                    counters.add("rma_claim_retries")
                first = False
                for s, k in turn.items():
                    if self._claim_results[s, 0] == 0:
                        self._slot[s] = self._last_slot[s] = k
                        # The version this gradient was computed on, fixed now: an
                        # overlapped push's FULL mark goes out after the next pull.
                        self._marks[s, 0] = full_state(self._client,
                                                       int(self.pulled_versions[s]))
                        del pending[s]
                        held.add(s)
                    elif not pending[s]:
                        pending[s] = self._candidates(s)
                        guard.check()
                        backoff.wait()
                if pending:
                    self._release_above(win, min(pending), held, pending)

    def _release_above(self, win: MPI.Win, lowest: int, held: set[int],
                       pending: dict[int, list[int]]) -> None:
        """Give back the slots this push holds on shards above `lowest`, the lowest shard
        it still waits for, and wait for them again. A push waiting for a shard then holds
        slots of lower shards only, so no two pushes can each hold a slot the other waits
        for: with more clients than slots (rma_windows.push_slots), 24 replicas on 8
        shards of 8 slots deadlocked without it (docs/rma-protocol.md, "Claims"). The release is the claim
        undone (Compare_and_swap id -> 0: nothing was Put or marked), completed with the
        next round, which includes its shard."""
        for s in sorted(held):
            if s > lowest:
                compare_and_swap(win, self._free, self._mine, self._claim_results[s], s,
                                 self._live().slot(self._slot[s]))
                held.discard(s)
                pending[s] = self._candidates(s)

    def _issue_push_data(self, win: MPI.Win, grad: np.ndarray) -> None:
        """A push's second round: Put each shard's segments of `grad` into its slot (as
        bfloat16 with a narrowed push, each segment rounded just before its Put)."""
        windows = self._live()
        if self._push_map is not None:
            self._issue_push_pieces(win, grad)
            return
        narrowed, width = self._narrowed, windows.push_bytes
        for shard in self._pulled_shards():
            low, high = self.ranges[shard]
            base = windows.slot_offset(int(self._slot[shard]), high - low)
            for start, stop in self._ledger.segments[shard]:
                target = (base + (start - low) * width, stop - start)
                if narrowed is None:
                    win.Put([grad[start:stop], MPI.FLOAT], shard, (*target, MPI.FLOAT))
                else:
                    kernels.bf16_narrow(grad[start:stop], narrowed[start:stop])
                    win.Put([narrowed[start:stop], MPI.UINT16_T], shard,
                            (*target, MPI.UINT16_T))
                self.bytes_sent += (stop - start) * width
        self._faults.in_push(f"its slot claimed and its data issued on shard {CONTROL_SHARD}")

    def _issue_push_pieces(self, win: MPI.Win, grad: np.ndarray) -> None:
        """A pieces push's second round: into each shard's slot, the values of its pieces
        back to back, then the pieces as int64 ranges of the slice, and the header [P, T];
        a push whose values and ranges would not fit the slot Puts the values at their
        places instead (one indexed datatype) with P = -1 (rma_windows.SLOT_HEADER_BYTES)."""
        windows, plan = self._live(), self._push_map
        for shard in self._pulled_shards():
            low, high = self.ranges[shard]
            data = windows.slot_offset(int(self._slot[shard]), high - low)
            local, values = plan.local[shard], plan.part(grad, shard)
            head = self._slot_heads[shard]
            values_bytes = -(-values.nbytes // COUNTER_BYTES) * COUNTER_BYTES
            if values_bytes + local.nbytes <= aligned(
                    (high - low) * FLOAT_BYTES):
                head[:] = len(local), len(values)
                if len(values):
                    win.Put([values, MPI.FLOAT], shard, (data, len(values), MPI.FLOAT))
                    win.Put([local, MPI.INT64_T], shard,
                            (data + values_bytes, local.size, MPI.INT64_T))
                self.bytes_sent += values.nbytes + local.nbytes + head.nbytes
            else:
                head[:] = -1, len(values)
                kind = MPI.FLOAT.Create_indexed((local[:, 1] - local[:, 0]).tolist(),
                                                local[:, 0].tolist()).Commit()
                win.Put([values, MPI.FLOAT], shard, (data, 1, kind))
                kind.Free()  # the Put keeps what it needs
                self.bytes_sent += values.nbytes + head.nbytes
            win.Put([head, MPI.INT64_T], shard, (data - SLOT_HEADER_BYTES, 2, MPI.INT64_T))
        self._faults.in_push(f"its slot claimed and its data issued on shard {CONTROL_SHARD}")

    def _issue_push_done(self, win: MPI.Win) -> None:
        """A push's third round, once its data has completed at every shard:
        Compare_and_swap(id -> FULL(id, version pulled)) on its slot (the mark set when
        the slot was claimed)."""
        for shard in self._pulled_shards():
            compare_and_swap(win, self._marks[shard], self._mine, self._mark_results[shard],
                             shard, self._live().slot(int(self._slot[shard])))

    def _note_push_done(self) -> None:
        """After the third round completed: count the push (its FULL mark held)."""
        for shard in self._pulled_shards():
            if self._mark_results[shard, 0] == self._mine[0]:
                self._pushes_made[shard] += 1
            else:
                # The shard took this client for gone and wrote its claim off.
                print(f"distbelief: client {self._client}: shard {shard} wrote off this "
                      "client's push (taken for gone)", file=sys.stderr, flush=True)

    def _pulled(self) -> np.ndarray:
        self._folded[:] = self._folded_read[:, 0]
        return self._ledger.pulled()

    def _pushed(self) -> np.ndarray:
        # Staleness: `taken` is VERSION_NOW as the push's claim read it.
        return self._ledger.pushed()

    def pull(self, out: np.ndarray) -> np.ndarray:
        """Fetch all parameters into `out`; returns each shard's version (int64, one per
        shard). One-sided: a registered read of each shard's newest buffer
        (rma_windows.PublishedReader: atomics and Gets), counted in its PULLS."""
        self._check_vector(out, "pull buffer")
        self._check_open()
        self.drain()
        shards = (self._pulled_shards() if self._pull_map is None
                  else self._pull_map.shards)
        self._reader.read(shards, self._ledger.segments, self.ranges, out,
                          self._ledger.headers, self._folded_read, count_pull=True,
                          pieces=self._pull_map)
        return self._pulled()

    def push(self, grad: np.ndarray, control: ControlExchange | None = None) -> np.ndarray:
        """Put `grad` into a push slot of every shard; returns the staleness per shard
        (updates the shard applied after the version of the last pull, before the push).

        One-sided, three rounds each completed by Flush: claim (with `control`'s
        operations on shard 0), Put, mark FULL.
        """
        self._check_vector(grad, "gradient")
        win = self._check_open().accum
        self.drain()
        self._claim(win, control)
        staleness = self._pushed()
        self._issue_push_data(win, grad)
        complete(win, self._pulled_shards())
        self._issue_push_done(win)
        complete(win, self._pulled_shards())
        self._note_push_done()
        return staleness

    def push_pull(self, grad: np.ndarray, out: np.ndarray,
                  control: ControlExchange | None = None) -> tuple[np.ndarray, np.ndarray]:
        """push(grad, control) and pull(out), the pull's first round riding in the push's
        last; returns (staleness, versions) as push and pull do. The parameters fetched
        may or may not contain this gradient yet.

        One-sided, to every shard: the same operations as push and pull.
        """
        self._check_vector(grad, "gradient")
        self._check_vector(out, "pull buffer")
        windows = self._check_open()
        self.drain()
        accum, params, pulled = windows.accum, windows.params, self._pulled_shards()
        self._claim(accum, control)
        staleness = self._pushed()
        self._issue_push_data(accum, grad)
        complete(accum, pulled)
        self._issue_push_done(accum)
        self._reader.issue_newest(pulled, count_pull=True)
        complete(accum, pulled)
        complete(params, pulled)
        self._note_push_done()
        self._finish_read(out)
        return staleness, self._pulled()

    def _finish_read(self, out: np.ndarray) -> None:
        """The rest of a registered read once its NEWEST round completed: register, Get,
        deregister."""
        params, pulled = self._live().params, self._pulled_shards()
        self._reader.register(pulled)
        self._reader.issue_get(pulled, self._ledger.segments, self.ranges, out, self._ledger.headers,
                          self._folded_read, self._pull_map)
        complete(params, pulled)
        registered = list(self._reader.registered)
        self._reader.issue_deregister()
        complete(params, registered)
        self._reader.deregistered()

    def push_pull_overlapped(self, grad: np.ndarray, out: np.ndarray | None,
                             control: ControlExchange | None = None) -> tuple[np.ndarray, bool]:
        """push(grad, control) and, with `out`, pull(out), returning before their data moves:
        the transfers complete in the next call (or in any other call of this client),
        while the caller computes its next step (the paper's overlapped fetch and push).
        Until then the caller must not touch `grad` or `out`. Returns (staleness of this
        push, per shard; whether the pull issued by the previous call completed, into the
        buffer given then).

        One-sided, to every shard. Each call completes the previous call's Put and Get
        (a Flush, usually already done) and, in one round, marks that push FULL,
        deregisters that pull, claims this push's slot, reads NEWEST and issues the
        control operations; with `out` it registers (two small rounds); then it issues
        this push's Put and this pull's Get, unflushed. The push therefore completes one
        step later than push_pull's; staleness is still exact."""
        self._check_vector(grad, "gradient")
        if out is not None:
            self._check_vector(out, "pull buffer")
        windows = self._check_open()
        accum, params, pulled = windows.accum, windows.params, self._pulled_shards()
        completed_pull = self._finish_in_flight(issue_next=True)
        if out is not None:
            self._reader.issue_newest(pulled, count_pull=True)
        self._claim(accum, control, also=[(params, pulled)])
        if self._in_flight:
            self._note_push_done()
            self._reader.deregistered()
            self._in_flight = False
        # Before the pull in flight sets pulled_versions: this gradient was computed on the
        # parameters of the pull before it.
        staleness = self._pushed()
        if completed_pull:
            self._pulled()
        self._issue_push_data(accum, grad)
        if out is not None:
            self._reader.register(pulled)
            self._reader.issue_get(pulled, self._ledger.segments, self.ranges, out, self._ledger.headers,
                          self._folded_read)
            self._pull_out = out
        self._in_flight, self.pull_in_flight = True, out is not None
        return staleness, completed_pull

    def _finish_in_flight(self, issue_next: bool) -> bool:
        """Complete what the last push_pull_overlapped left in flight: its Put and its Get
        (Flush), then issue the push's FULL mark and, for the pull, the deregistration;
        with `issue_next` they ride in the caller's next round (which then counts the push
        and clears `_in_flight`), else they are completed here. Returns whether a pull was
        in flight (its data is in the buffer given then)."""
        if not self._in_flight:
            return False
        windows = self._live()
        pulled = self._pulled_shards()
        complete(windows.accum, pulled)
        complete(windows.params, pulled)
        self._issue_push_done(windows.accum)
        pull = self.pull_in_flight
        registered = list(self._reader.registered)
        self._reader.issue_deregister()
        self.pull_in_flight = False
        if not issue_next:
            complete(windows.accum, pulled)
            complete(windows.params, registered)
            self._note_push_done()
            self._reader.deregistered()
            self._in_flight = False
            if pull:
                self._pulled()
        return pull

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
        first, as catch_up counts them after a push_pull)."""
        staleness = self.push(grad, control)
        return staleness, max(0, self.catch_up(out) - 1)

    def catch_up(self, out: np.ndarray) -> int:
        """Make the last pull contain this client's last push (read-your-writes): poll
        each behind shard's FOLDED_HINT for this client (8 bytes, Fetch_and_op NO_OP),
        sleeping as earlier such waits lasted (LearnedBackoff), and pull once it counts
        every push made; until the pulled FOLDED does. Returns the number of pulls made
        (0 when the last pull had it already).

        One-sided, to every shard. It waits only for the shards to fold, never for
        another client; with one replica, push + catch_up is exactly sequential SGD.
        """
        self.drain()
        backoff, extra, waited = self._fold_wait, 0, False
        guard = watchdog.current()
        with guard.waiting("the shards to apply this client's push",
                           self.topology.shard_ranks):
            while (behind := self._behind()):
                counters.add("rma_fold_polls")
                if not self._hints_reached(behind):
                    if not waited:
                        backoff.begin()
                        waited = True
                    guard.check()
                    backoff.wait()
                    continue
                self.pull(out)
                extra += 1
        if waited:
            backoff.end()
        return extra

    def wait_applied(self) -> None:
        """Return once every shard this client touches has folded and published its last
        push (FOLDED_HINT[me] polled, 8 bytes a shard, sleeping as catch_up does), without
        pulling: a pull from then on holds it. One-sided, to every shard it touches."""
        self.drain()
        shards = [s for s in self._pulled_shards() if self._pushes_made[s]]
        backoff, waited = self._fold_wait, False
        guard = watchdog.current()
        with guard.waiting("the shards to apply this client's push",
                           self.topology.shard_ranks):
            while shards and not self._hints_reached(shards):
                counters.add("rma_fold_polls")
                if not waited:
                    backoff.begin()
                    waited = True
                guard.check()
                backoff.wait()
        if waited:
            backoff.end()

    def _behind(self) -> list[int]:
        """The shards the pull reads whose FOLDED, as last pulled, lacks this client's last
        push. A pieces pull reads only its own shards' FOLDED: a shard only pushed to is
        caught up with by the first later pull that reads it."""
        shards = (self._pulled_shards() if self._pull_map is None
                  else self._pull_map.shards)
        return [s for s in shards if self._folded[s] < self._pushes_made[s]]

    def _hints_reached(self, behind: Sequence[int]) -> bool:
        """Whether every shard behind has published an update holding this client's last
        push: FOLDED_HINT[me], one round of 8-byte reads. A hint only: the pull that
        follows reads FOLDED with the data."""
        windows = self._check_open()
        for s in behind:
            fetch_op(windows.params, None, self._hints[s], s, windows.hint(self._client),
                     MPI.NO_OP)
        complete(windows.params, behind)
        return all(self._hints[s, 0] >= self._pushes_made[s] for s in behind)

    def exchange(self, control: ControlExchange) -> None:
        """Only the control operations, without a gradient (a replica's first claim, its
        warm-start polls). One-sided: count-1 atomics on shard 0's ACCUM window."""
        win = self._check_open().accum
        self.drain()
        control.issue(win, CONTROL_SHARD, HEADER_BYTES)
        complete(win, (CONTROL_SHARD,))
        if self._faults.linger_s:
            time.sleep(self._faults.linger_s)

    def finish(self) -> None:
        """Tell every shard that this rank will push no more. One-sided: a count-1 Accumulate(SUM)
        of 1 into each shard's DONE. Call it after the last push; idempotent."""
        if self._finished:
            return
        win = self._check_open().accum
        self.drain()
        for shard in self.topology.shard_ranks:
            add(win, self._one, shard, DONE * COUNTER_BYTES)
        complete(win, self.topology.shard_ranks)
        self._finished = True

    def free(self) -> None:
        """finish() if not yet done, wait for every rank (polling with back-off sleeps,
        not spinning) and free the windows. Collective over the world communicator (with
        every shard's free())."""
        self.finish()
        self._open.free(waiting_backoff())
