"""Sandblaster's replicas (Replica): ask the coordinator for a task, commit or drop the
units done since, compute a grant of units' gradients or an evaluation; fetch each trial
point from the relay parent (or the shards) and answer the relay children's fetches; a
partitioned replica shares each answer with its partners (encode_answer / decode_answer).
Replicas, the trial point down a tree and partitioned replicas in docs/sandblaster.md,
"Design", say how.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.sandblaster.plan import (
    HEADER,
    SPARE_POLL_S,
    TAG_FETCH,
    TAG_PARAMS,
    TAG_PUSH,
    TAG_RELAY_FETCH,
    TAG_RELAY_PARAMS,
    TAG_REQUEST,
    TAG_TASK,
    Piece,
    SandblasterPlan,
    poll_backoff,
    relay_parent,
    shard_segments,
)
from distbelief.algorithms.sandblaster.unit_rows import UnitRows
from distbelief.algorithms.sandblaster.work_units import COMMIT, DROP, HOLD
from distbelief.config import Config
from distbelief.data.hdf5 import bytes_read, model_input
from distbelief.model.partitioned_network import PartitionedNetwork
from distbelief.runtime.backoff import Backoff
from distbelief.runtime.communicators.agreement import wait_all
from distbelief.runtime.health import watchdog
from distbelief.runtime.launching.faults import Faults

# ------------------------------------------------------------------------------------------
# Replicas


@dataclass
class ReplicaStats:
    replica: int
    rank: int
    partition: int = 0
    units: int = 0          # units computed (committed or not)
    examples: int = 0
    abandoned: int = 0      # units not computed: their trial was over when fetched
    evaluations: int = 0
    pushes: int = 0
    fetches: int = 0
    compute_seconds: float = 0.0
    comm_seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU time in run(): the work, whatever the load
    bytes_sent: int = 0      # gradient sums pushed to the shards (headers included)
    bytes_received: int = 0  # trial points and snapshots fetched (shards or relay parent)
    shard_fetches: int = 0   # fetches answered by the shards (the others: by the parent)
    relayed: int = 0         # trial point fetches of its relay children it answered
    relay_bytes: int = 0     # bytes of those answers
    relay_fallbacks: int = 0  # its relay parent was lost: it fetched from the shards after
    relay_wait_seconds: float = 0.0  # waiting for the relay parent's answers
    data_bytes_read: int = 0  # x and y bytes this process read from the dataset file
    own_rows: int = 0        # rows of its own block (read at start)
    foreign_units: int = 0   # units of other replicas' blocks it computed rows of
    foreign_reads: int = 0   # ... whose rows it read from the file (not cached)
    foreign_bytes: int = 0   # x and y bytes of those reads
    # cluster.spare_replicas: a spare's (the times are time.time(), as Downpour's)
    spare: bool = False
    replaced: int | None = None  # the training replica whose units it took over
    took_over_at: float | None = None  # when it had read that replica's rows
    first_unit_at: float | None = None  # when its first unit's gradient was computed
    first_push_at: float | None = None  # when its first committed sum was pushed
    spare_wait_seconds: float = 0.0  # waiting for a part, wall
    spare_wait_cpu_seconds: float = 0.0  # and the process's CPU meanwhile (every thread)


DECISIONS = (HOLD, COMMIT, DROP)
TASK_KINDS = (None, "stop", "evaluate", "units", "take_over")
ANSWER_SLOTS = 8
"""The fewest int64s of an encoded answer; a grant of k units takes 5 + k
(answer_slots)."""


def answer_slots(push_every: int) -> int:
    """int64s for any answer when at most `push_every` units are granted at once."""
    return max(ANSWER_SLOTS, 5 + push_every)


def encode_answer(decision: str, task: tuple | None, out: np.ndarray) -> np.ndarray:
    """The coordinator's answer (decision, task) as int64s, for partition 0 to broadcast:
    [decision, task kind, task arguments...] (a grant of units': trial, batch, the number
    of units, the units; a stop's: leave, lost, diverged as 0 or 1)."""
    out.fill(0)
    out[0] = DECISIONS.index(decision)
    out[1] = TASK_KINDS.index(None if task is None else task[0])
    if task is not None:
        arguments = task[1:]
        if task[0] == "units":
            arguments = (*task[1:3], len(task) - 3, *task[3:])
        if 2 + len(arguments) > len(out):
            raise ValueError(f"{len(out)} slots cannot hold the answer {task}")
        out[2:2 + len(arguments)] = arguments
    return out


def decode_answer(values: np.ndarray) -> tuple[str, tuple | None]:
    """What `encode_answer` encoded."""
    kind = TASK_KINDS[int(values[1])]
    if kind == "units":
        units = [int(v) for v in values[5:5 + int(values[4])]]
        return DECISIONS[int(values[0])], (kind, int(values[2]), int(values[3]), *units)
    arguments = {None: 0, "stop": 3, "evaluate": 1, "take_over": 1}[kind]
    task = None if kind is None else (kind, *(int(v) for v in values[2:2 + arguments]))
    return DECISIONS[int(values[0])], task


class Replica:
    """Ask for a task, commit or drop the pending sum, do the task; until told to stop.
    Point-to-point with the coordinator (requests, tasks), the shards (fetch, push) and
    the replicas next to it in the relay tree (trial points from its parent, to its
    children: `_load_trial`, `_serve_children`).

    `model`: a Network (one rank per replica), or this partition's PartitionedNetwork over
    `team`, the replica's partition communicator: partition 0 then asks the coordinator
    and shares each answer with its partners (collective over `team`, polled), and every
    vector here is this partition's own pieces (`pieces`) back to back."""

    def __init__(self, comm: MPI.Comm, config: Config, plan: SandblasterPlan, model: Any,
                 rows: UnitRows | None,
                 load_eval: Callable[[], tuple[np.ndarray, np.ndarray]],
                 pieces: list[Piece], team: MPI.Comm | None = None,
                 rows_for: Callable[[int], UnitRows] | None = None, *, faults: Faults):
        """`rows` None: a spare (cluster.spare_replicas), which reads `rows_for(r)`, the
        rows of the replica r it takes over, when the coordinator tells it to."""
        self.comm, self.plan, self.model = comm, plan, model
        self.rows_for = rows_for
        # The evaluation set is read when this replica is first given an evaluation: a
        # replica that never evaluates never reads it.
        self.rows, self.load_eval = rows, load_eval
        self.eval_set: tuple[np.ndarray, np.ndarray] | None = None
        topology = plan.topology
        self.coordinator = topology.coordinator_rank
        self.team = team if team is not None and team.Get_size() > 1 else None
        self.partition = topology.partition_index
        self.lead = self.partition == 0
        if (any(a >= b for a, b in pieces)
                or any(b > c for (_, b), (c, _) in itertools.pairwise(pieces))):
            raise ValueError(f"pieces must be non-empty, ascending and disjoint: {pieces}")
        ranges = model_layout(model).shard_ranges(topology.ps_shards)
        # (shard, offset, size): each shard's share of this partition's vector.
        self.links: list[tuple[int, int, int]] = []
        offset = 0
        for shard, segments in enumerate(shard_segments(pieces, ranges)):
            size = sum(b - a for a, b in segments)
            if size:
                self.links.append((shard, offset, size))
            offset += size
        self.params = np.zeros(offset, dtype=np.float32)
        self.grad = np.zeros(offset, dtype=np.float32)
        self.pending = np.zeros(offset, dtype=np.float32)
        self.recv = [np.empty(HEADER + size, dtype=np.float32) for _, _, size in self.links]
        self.send = [np.empty(HEADER + size, dtype=np.float32) for _, _, size in self.links]
        self.fetched: tuple[str, int] | None = None
        self.unit_ranges = plan.units
        # The relay tree (plan.relay_parent): this partition's rank in the parent replica
        # (None: the shards) and in the children; the latest trial point loaded, as
        # [header | this partition's pieces], which the children are sent.
        # A spare is outside the relay tree: it fetches from the shards.
        self.spare = topology.is_spare
        parent = None if self.spare else relay_parent(topology.replica_index)
        self.source = (None if parent is None
                       else topology.replica_ranks(parent)[self.partition])
        self.trial_buffer: np.ndarray | None = None
        self.relay_sends: list[tuple[MPI.Request, np.ndarray, int]] = []  # (send, buf, to)
        self.orphans: list[tuple[MPI.Request, np.ndarray]] = []  # with lost ranks, undone
        self.answer = np.zeros(answer_slots(plan.push_every), dtype=np.int64)
        self.agreed = np.zeros(1, dtype=np.int32)
        self.stats_ = ReplicaStats(topology.replica_index, topology.world_rank,
                                   self.partition, spare=self.spare)
        self.faults = faults  # test-only (runtime.launching.faults), the session's
        self.signals = None  # set by train(); only the coordinator acts on signals
        self.partners = [r for r in topology.replica_ranks(topology.replica_index)
                         if r != topology.world_rank]
        # How the run ended for this rank (the coordinator's "stop"): `leave`, a rank of the
        # job was lost (finish without collectives); `lost`, this replica was; `diverged`.
        self.leave = self.lost = self.diverged = False
        self._clear()

    def _clear(self) -> None:
        self.pending.fill(0)
        self.pending_units: list[int] = []
        self.pending_trial, self.pending_loss = -1, 0.0

    def run(self) -> None:
        """Work until the coordinator answers "stop". Point-to-point with the coordinator
        (requests, partition 0 only) and the shards (fetches, pushes); with partitions
        collective over the team in lockstep. Every wait polls with sleeps."""
        cpu = time.process_time()
        try:
            if self.spare and not self._wait_as_spare():
                return  # the run ended before any part was lost
            self._work()
        except watchdog.RankLost as gone:
            if gone.rank not in self.partners:
                raise  # a shard or the coordinator: nothing goes on without it
            # A partition of this replica died: the coordinator drops the whole replica
            # (its committed units' evaluation is run again), and this rank stops.
            print(f"distbelief: rank {self.stats_.rank}: rank {gone.rank}, another "
                  f"partition of replica {self.stats_.replica}, is gone; this replica stops",
                  file=sys.stderr, flush=True)
            self.leave = self.lost = True
        finally:
            self.stats_.cpu_seconds += time.process_time() - cpu

    def _work(self) -> None:
        result, ask = None, True
        while True:
            decision, task = self._next_task(result, ask)
            result = None
            if decision == COMMIT:
                self._push()
            if decision in (COMMIT, DROP):
                self._clear()
            # A commit or drop without a task: the coordinator has parked this replica
            # already; its next answer comes without another request.
            ask = task is not None
            if task is None:
                continue
            if task[0] == "stop":
                self.leave, self.lost, self.diverged = (bool(v) for v in task[1:])
                return
            if task[0] == "evaluate":
                result = self._evaluate(*task[1:])
            else:
                self._compute_units(*task[1:])

    def _wait_as_spare(self) -> bool:
        """A spare: poll the coordinator (SPARE_POLL_S back-off sleeps, never a blocking
        receive: MPICH would spin) until it says which lost replica's units to take over
        (read its rows; True) or that the run is over (False). With partitions the lead
        polls and shares the answer; the others wait for it at the same pace."""
        wall, cpu = time.perf_counter(), time.process_time()
        backoff, guard = Backoff(*SPARE_POLL_S), watchdog.current()
        task = None
        try:
            if self.lead:
                with guard.waiting("a lost replica's part from the coordinator",
                                   (self.coordinator,)):
                    while not self.comm.Iprobe(self.coordinator, TAG_TASK):
                        guard.check(lambda: self.comm.Iprobe(self.coordinator, TAG_TASK))
                        guard.progress()  # a spare waits for as long as no replica is lost
                        backoff.wait()
                _, task = self.comm.recv(source=self.coordinator, tag=TAG_TASK)
            if self.team is not None:
                if self.lead:
                    encode_answer(HOLD, task, self.answer)
                request = [self.team.Ibcast(self.answer, root=0)]
                with guard.waiting("the answer from partition 0", self.partners):
                    while not MPI.Request.Testall(request):
                        guard.check(lambda: MPI.Request.Testall(request))
                        guard.progress()
                        backoff.wait()
                _, task = decode_answer(self.answer)
        finally:
            self.stats_.spare_wait_seconds = time.perf_counter() - wall
            self.stats_.spare_wait_cpu_seconds = time.process_time() - cpu
        if task[0] == "stop":
            self.leave, self.lost, self.diverged = (bool(v) for v in task[1:])
            return False
        if task[0] != "take_over" or self.rows_for is None:
            raise RuntimeError(f"spare {self.stats_.replica}: unexpected task {task} "
                               "(protocol error)")
        part = int(task[1])
        self.rows = self.rows_for(part)  # with partitions: partition 0 reads, and shares
        self.stats_.replaced = part
        self.stats_.took_over_at = time.time()
        return True

    def _next_task(self, result: tuple | None,
                   ask: bool = True) -> tuple[str, tuple | None]:
        """The coordinator's answer to this replica's next request (partition 0 asks,
        reporting its pending units and `result`; not when `ask` is False: it is parked),
        on every partition."""
        answer = None
        if self.lead:
            request = (self.pending_trial, self.pending_units, self.pending_loss, result)
            answer = self._ask(request if ask else None)
        if self.team is None:
            return answer
        t0 = time.perf_counter()
        if self.lead:
            encode_answer(*answer, self.answer)
        self._wait_serving([self.team.Ibcast(self.answer, root=0)],
                           "the answer from partition 0", self.partners)
        self.stats_.comm_seconds += time.perf_counter() - t0
        return decode_answer(self.answer)

    def _all_agree(self, ok: bool) -> bool:
        """Whether `ok` holds on every partition (an Iallreduce MIN over the team, polled);
        `ok` itself with one partition."""
        if self.team is None:
            return ok
        self.agreed[0] = ok
        wait_all([self.team.Iallreduce(MPI.IN_PLACE, self.agreed, op=MPI.MIN)],
                 "the other partitions of this replica", self.partners)
        return bool(self.agreed[0])

    def _ask(self, request: tuple | None) -> tuple[str, tuple | None]:
        """Send a request to the coordinator (None: none, it is parked); wait (polling)
        for its answer, answering relay children meanwhile."""
        t0 = time.perf_counter()
        if request is not None:
            self.comm.send(request, dest=self.coordinator, tag=TAG_REQUEST)
        backoff = poll_backoff()
        guard = watchdog.current()
        with guard.waiting("the coordinator's answer", (self.coordinator,)):
            while not self.comm.Iprobe(self.coordinator, TAG_TASK):
                if self._serve_children():
                    backoff.reset()
                guard.check(lambda: self.comm.Iprobe(self.coordinator, TAG_TASK))
                backoff.wait()
        answer = self.comm.recv(source=self.coordinator, tag=TAG_TASK)
        self.stats_.comm_seconds += time.perf_counter() - t0
        return answer

    def _wait_serving(self, requests: list[MPI.Request], what: str, ranks: Any) -> None:
        """wait_all, answering this rank's relay children meanwhile (a replica waiting for
        its work must not keep its children waiting for the trial point)."""
        backoff, guard = poll_backoff(), watchdog.current()
        with guard.waiting(what, ranks):
            while not MPI.Request.Testall(requests):
                if self._serve_children():
                    backoff.reset()
                guard.check(lambda: MPI.Request.Testall(requests))
                backoff.wait()

    def _fetch(self, kind: str, ident: int) -> bool:
        """This partition's pieces of the trial point or snapshot `ident` in params: a
        trial point from the relay parent (the shards for the tree's first replicas),
        a snapshot from the shards; False if a shard (any partition's) has moved on to
        another one already (the task is stale). Agreed over the team when it fetched."""
        if self.fetched == (kind, ident):
            return True
        t0 = time.perf_counter()
        if kind == "trial":
            current = self._load_trial(ident)
            values = self.trial_buffer
        else:
            values = self._from_shards(kind)
            current = _ident(values) == ident
        current = self._all_agree(current)
        self.stats_.comm_seconds += time.perf_counter() - t0
        if not current:
            self.fetched = None
            return False
        self.params[:] = values[HEADER:]
        self.fetched = (kind, ident)
        if kind == "trial":
            self._serve_children()  # those that asked meanwhile, before this computes
        return True

    def _from_shards(self, kind: str) -> np.ndarray:
        """This partition's pieces of the shards' current trial point or snapshot, as a
        new [header | pieces] buffer; its id is -1 unless every shard had the same one.
        Point-to-point with the shards holding them."""
        requests = [self.comm.Irecv([buf, MPI.FLOAT], shard, TAG_PARAMS)
                    for (shard, _, _), buf in zip(self.links, self.recv)]
        for shard, _, _ in self.links:
            requests.append(self.comm.isend(kind, dest=shard, tag=TAG_FETCH))
        wait_all(requests, f"the {kind} from the shards", [s for s, _, _ in self.links])
        self.stats_.fetches += 1
        self.stats_.shard_fetches += 1
        self.stats_.bytes_received += sum(buf.nbytes for buf in self.recv)
        ids = {int(buf[:1].view(np.int32)[0]) for buf in self.recv}
        out = np.empty(HEADER + len(self.params), dtype=np.float32)
        out[:HEADER].view(np.int32)[:] = (ids.pop() if len(ids) == 1 else -1, 0,
                                          self.partition, 0)
        for (_, offset, size), buf in zip(self.links, self.recv):
            out[HEADER + offset:HEADER + offset + size] = buf[HEADER:]
        return out

    def _load_trial(self, trial: int) -> bool:
        """This partition's pieces of trial point `trial` into trial_buffer, from the relay
        parent or, for the tree's first replicas and after the parent was lost, from the
        shards; False if that trial is over (the parent or a shard is on a later one).
        Point-to-point with the parent or the shards; not agreed over the team (a relay
        serves one partition)."""
        have = -1 if self.trial_buffer is None else _ident(self.trial_buffer)
        if have == trial:
            return True
        if have > trial:
            return False  # trial ids grow: a later trial began, so `trial` is over
        if self.source is None:
            values = self._from_shards("trial")
        else:
            values = np.empty(HEADER + len(self.params), dtype=np.float32)
            receive = self.comm.Irecv([values, MPI.FLOAT], self.source, TAG_RELAY_PARAMS)
            ask = self.comm.isend(trial, dest=self.source, tag=TAG_RELAY_FETCH)
            t0 = time.perf_counter()
            try:
                wait_all([receive, ask], "the trial point from the relay parent",
                         [self.source])
            except watchdog.RankLost as gone:
                if gone.rank != self.source:
                    raise
                # The parent is lost: this partition fetches from the shards from now on
                # (the coordinator goes on without that replica).
                receive.Cancel()
                self.orphans.append((receive, values))
                self.source = None
                self.stats_.relay_fallbacks += 1
                return self._load_trial(trial)
            self.stats_.relay_wait_seconds += time.perf_counter() - t0
            self.stats_.fetches += 1
            self.stats_.bytes_received += values.nbytes
        got = _ident(values)
        if got > have and HEADER + len(self.params) == len(values):
            # (A later trial's point, whole, is kept too: the children will ask for it.)
            self.trial_buffer = values  # a new buffer: sends of the old one may be in flight
        return got == trial

    def _serve_children(self) -> bool:
        """Answer every trial point fetch of this rank's relay children waiting now: the
        trial point asked for (loaded first if it is newer than the one here), or the
        header alone, with another id, if that trial is over; then wait until they have
        it (they wait for it, polling). Returns whether one was waiting. Point-to-point
        with the children (and the parent or shards to load a newer trial point)."""
        status = MPI.Status()
        served = False
        while self.comm.Iprobe(MPI.ANY_SOURCE, TAG_RELAY_FETCH, status):
            child = status.Get_source()
            trial = self.comm.recv(source=child, tag=TAG_RELAY_FETCH)
            if self._load_trial(trial):
                message = self.trial_buffer
            else:
                message = np.zeros(HEADER, dtype=np.float32)
                message[:1].view(np.int32)[0] = -1
            self.relay_sends.append((self.comm.Isend([message, MPI.FLOAT], child,
                                                     TAG_RELAY_PARAMS), message, child))
            self.stats_.relayed += 1
            self.stats_.relay_bytes += message.nbytes
            served = True
        while self.relay_sends:
            try:
                wait_all([r for r, _, _ in self.relay_sends],
                         "the relay children to take the trial point",
                         [to for _, _, to in self.relay_sends])
                self.relay_sends = []
            except watchdog.RankLost as gone:
                # A child is lost: its send is given up (never completed: kept, as the
                # shards keep theirs), the others are waited for.
                self.orphans += [(r, m) for r, m, to in self.relay_sends if to == gone.rank]
                self.relay_sends = [(r, m, to) for r, m, to in self.relay_sends
                                    if to != gone.rank]
        return served

    def _compute_units(self, trial: int, batch: int, *units: int) -> None:
        """Compute the units granted together, one after another (`_compute`), answering
        relay children between them."""
        for done, unit in enumerate(units):
            if not self._fetch("trial", trial):
                self.stats_.abandoned += len(units) - done
                return
            self._compute(trial, batch, unit, *self.unit_ranges[unit])
            self._serve_children()

    def _compute(self, trial: int, batch: int, unit: int, start: int, stop: int) -> None:
        """Add one unit's gradient sum to the pending sum (its trial point fetched)."""
        t0 = time.perf_counter()
        stored, y = self.rows.unit(batch, start, stop)
        x = model_input(self.rows.info, stored)
        n = stop - start
        loss = self.model.loss_and_grad(self.params, x, y, self.grad)
        self.grad *= np.float32(n)  # mean -> sum, so units of any size add up
        self.pending += self.grad
        self.pending_loss += loss * n
        self.pending_units.append(unit)
        self.pending_trial = trial
        self.faults.after_step(self.stats_.units + 1, time.perf_counter() - t0, "unit")
        self.stats_.compute_seconds += time.perf_counter() - t0
        self.stats_.units += 1
        if self.stats_.replaced is not None and self.stats_.first_unit_at is None:
            self.stats_.first_unit_at = time.time()
        self.stats_.examples += n

    def _push(self) -> None:
        """Send the committed sum to the shards, each its share of this partition's
        pieces. Point-to-point."""
        t0 = time.perf_counter()
        requests = []
        # Test-only: killed in the middle of this push, after its first shard's part.
        dying = self.faults.kill_in_push_from(self.stats_.units)
        for (shard, offset, size), buf in zip(self.links, self.send):
            buf[:HEADER].view(np.int32)[:] = (self.pending_trial, len(self.pending_units),
                                              self.partition, 0)
            buf[HEADER:] = self.pending[offset:offset + size]
            requests.append(self.comm.Isend([buf, MPI.FLOAT], shard, TAG_PUSH))
            if dying:
                wait_all(requests)
                self.faults.kill(f"in its push after unit {self.stats_.units}")
        wait_all(requests, "the shards to take this replica's push",
                 [s for s, _, _ in self.links])
        self.stats_.pushes += 1
        if self.stats_.replaced is not None and self.stats_.first_push_at is None:
            self.stats_.first_push_at = time.time()
        self.stats_.bytes_sent += sum(buf.nbytes for buf in self.send)
        self.stats_.comm_seconds += time.perf_counter() - t0

    def _evaluate(self, snapshot: int) -> tuple:
        """(snapshot, the evaluation's figures) of snapshot `snapshot` (with partitions,
        the PartitionedNetwork's distributed loss and accuracy: the same on every one)."""
        if not self._fetch("snapshot", snapshot):
            # The coordinator takes a new snapshot only after this result: cannot happen.
            raise RuntimeError(f"replica {self.stats_.replica}: snapshot {snapshot} was "
                               "replaced before it was evaluated (protocol error)")
        if self.eval_set is None:
            self.eval_set = self.load_eval()
        result = self.model.evaluate(self.params, *self.eval_set, batch_size=1000)
        self.stats_.evaluations += 1
        return (snapshot, dict(result.figures))

    def stats(self) -> dict[str, Any]:
        self.stats_.data_bytes_read = bytes_read()
        if self.rows is not None:  # (None: a spare that took nothing over)
            self.stats_.own_rows = self.rows.hi - self.rows.lo
            self.stats_.foreign_units = self.rows.foreign_units
            self.stats_.foreign_reads = self.rows.foreign_reads
            self.stats_.foreign_bytes = self.rows.foreign_bytes
        out = {"role": "replica", **asdict(self.stats_)}
        if self.team is not None:
            out["model_parallel"] = self.model.traffic.per_step()
        return out


def _ident(values: np.ndarray) -> int:
    """The trial or snapshot id in the header of a vector message."""
    return int(values[:1].view(np.int32)[0])


def model_layout(model: Any) -> Any:
    """The whole model's parameter layout of a Network or a PartitionedNetwork."""
    return model.network.layout if isinstance(model, PartitionedNetwork) else model.layout
