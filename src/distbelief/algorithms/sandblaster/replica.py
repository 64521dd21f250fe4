"""Sandblaster's replicas (Replica): ask the coordinator for a task, commit or drop the
units done since, compute a unit's gradient or an evaluation; a partitioned replica
shares each answer with its partners (encode_answer / decode_answer). Replicas and
partitioned replicas in docs/sandblaster.md, "Design", say how.
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
    TAG_FETCH,
    TAG_PARAMS,
    TAG_PUSH,
    TAG_REQUEST,
    TAG_TASK,
    Piece,
    SandblasterPlan,
    poll_backoff,
    shard_segments,
)
from distbelief.algorithms.sandblaster.unit_rows import UnitRows
from distbelief.algorithms.sandblaster.work_units import COMMIT, DROP, HOLD
from distbelief.config import Config
from distbelief.data.hdf5 import bytes_read, to_float
from distbelief.model.partitioned_network import PartitionedNetwork
from distbelief.runtime import watchdog
from distbelief.runtime.agreement import wait_all
from distbelief.runtime.faults import Faults

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
    bytes_received: int = 0  # trial points and snapshots fetched from them
    data_bytes_read: int = 0  # x and y bytes this process read from the dataset file
    own_rows: int = 0        # rows of its own block (read at start)
    foreign_units: int = 0   # units of other replicas' blocks it computed rows of
    foreign_reads: int = 0   # ... whose rows it read from the file (not cached)
    foreign_bytes: int = 0   # x and y bytes of those reads


DECISIONS = (HOLD, COMMIT, DROP)
TASK_KINDS = (None, "stop", "evaluate", "unit")
ANSWER_SLOTS = 8


def encode_answer(decision: str, task: tuple | None, out: np.ndarray) -> np.ndarray:
    """The coordinator's answer (decision, task) as int64s, for partition 0 to broadcast:
    [decision, task kind, task arguments...] (a unit's: trial, batch, unit, start, stop;
    a stop's: leave, lost, diverged as 0 or 1)."""
    out.fill(0)
    out[0] = DECISIONS.index(decision)
    out[1] = TASK_KINDS.index(None if task is None else task[0])
    if task is not None:
        out[2:2 + len(task) - 1] = task[1:]
    return out


def decode_answer(values: np.ndarray) -> tuple[str, tuple | None]:
    """What `encode_answer` encoded."""
    kind = TASK_KINDS[int(values[1])]
    arguments = {None: 0, "stop": 3, "evaluate": 1, "unit": 5}[kind]
    task = None if kind is None else (kind, *(int(v) for v in values[2:2 + arguments]))
    return DECISIONS[int(values[0])], task


class Replica:
    """Ask for a task, commit or drop the pending sum, do the task; until told to stop.
    Point-to-point with the coordinator (requests, tasks) and the shards (fetch, push).

    `model`: a Network (one rank per replica), or this partition's PartitionedNetwork over
    `team`, the replica's partition communicator: partition 0 then asks the coordinator
    and shares each answer with its partners (collective over `team`, polled), and every
    vector here is this partition's own pieces (`pieces`) back to back."""

    def __init__(self, comm: MPI.Comm, config: Config, plan: SandblasterPlan, model: Any,
                 rows: UnitRows, load_eval: Callable[[], tuple[np.ndarray, np.ndarray]],
                 pieces: list[Piece], team: MPI.Comm | None = None):
        self.comm, self.plan, self.model = comm, plan, model
        # The evaluation set is read when this replica is first given an evaluation: a
        # replica that never evaluates never reads it.
        self.rows, self.load_eval, self.scale = rows, load_eval, rows.info.scale
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
        self.answer = np.zeros(ANSWER_SLOTS, dtype=np.int64)
        self.agreed = np.zeros(1, dtype=np.int32)
        self.stats_ = ReplicaStats(topology.replica_index, topology.world_rank,
                                   self.partition)
        self.faults = Faults.for_rank(topology.world_rank)  # test-only (distbelief.runtime.faults)
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
        result = None
        while True:
            decision, task = self._next_task(result)
            result = None
            if decision == COMMIT:
                self._push()
            if decision in (COMMIT, DROP):
                self._clear()
            if task is None:
                continue
            if task[0] == "stop":
                self.leave, self.lost, self.diverged = (bool(v) for v in task[1:])
                return
            if task[0] == "evaluate":
                result = self._evaluate(*task[1:])
            else:
                self._compute(*task[1:])

    def _next_task(self, result: tuple | None) -> tuple[str, tuple | None]:
        """The coordinator's answer to this replica's next request (partition 0 asks,
        reporting its pending units and `result`), on every partition."""
        answer = None
        if self.lead:
            answer = self._ask((self.pending_trial, self.pending_units, self.pending_loss,
                                result))
        if self.team is None:
            return answer
        t0 = time.perf_counter()
        if self.lead:
            encode_answer(*answer, self.answer)
        wait_all([self.team.Ibcast(self.answer, root=0)], "the answer from partition 0",
                 self.partners)
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

    def _ask(self, request: tuple) -> tuple[str, tuple | None]:
        """Send a request to the coordinator; wait (polling) for its answer."""
        t0 = time.perf_counter()
        self.comm.send(request, dest=self.coordinator, tag=TAG_REQUEST)
        backoff = poll_backoff()
        guard = watchdog.current()
        with guard.waiting("the coordinator's answer", (self.coordinator,)):
            while not self.comm.Iprobe(self.coordinator, TAG_TASK):
                guard.check(lambda: self.comm.Iprobe(self.coordinator, TAG_TASK))
                backoff.wait()
        answer = self.comm.recv(source=self.coordinator, tag=TAG_TASK)
        self.stats_.comm_seconds += time.perf_counter() - t0
        return answer

    def _fetch(self, kind: str, ident: int) -> bool:
        """Fetch this partition's pieces of the trial point or snapshot `ident` from the
        shards that hold them; False if a shard (any partition's) has moved on to another
        one already (the task is stale). Agreed over the team when it fetched."""
        if self.fetched == (kind, ident):
            return True
        t0 = time.perf_counter()
        requests = [self.comm.Irecv([buf, MPI.FLOAT], shard, TAG_PARAMS)
                    for (shard, _, _), buf in zip(self.links, self.recv)]
        for shard, _, _ in self.links:
            requests.append(self.comm.isend(kind, dest=shard, tag=TAG_FETCH))
        wait_all(requests, f"the {kind} from the shards", [s for s, _, _ in self.links])
        self.stats_.fetches += 1
        self.stats_.bytes_received += sum(buf.nbytes for buf in self.recv)
        current = all(int(buf[:1].view(np.int32)[0]) == ident for buf in self.recv)
        current = self._all_agree(current)
        self.stats_.comm_seconds += time.perf_counter() - t0
        if not current:
            self.fetched = None
            return False
        for (_, offset, size), buf in zip(self.links, self.recv):
            self.params[offset:offset + size] = buf[HEADER:]
        self.fetched = (kind, ident)
        return True

    def _compute(self, trial: int, batch: int, unit: int, start: int, stop: int) -> None:
        """Add one unit's gradient sum to the pending sum; nothing if its trial is over
        already (the shards have begun another: the unit was committed by another replica,
        and this one's next request simply reports nothing)."""
        if not self._fetch("trial", trial):
            self.stats_.abandoned += 1
            return
        t0 = time.perf_counter()
        stored, y = self.rows.unit(batch, start, stop)
        x = to_float(stored, self.scale)
        n = stop - start
        loss = self.model.loss_and_grad(self.params, x, y, self.grad)
        self.grad *= np.float32(n)  # mean -> sum, so units of any size add up
        self.pending += self.grad
        self.pending_loss += loss * n
        self.pending_units.append(unit)
        self.pending_trial = trial
        if self.faults:
            self.faults.after_step(self.stats_.units + 1, time.perf_counter() - t0, "unit")
        self.stats_.compute_seconds += time.perf_counter() - t0
        self.stats_.units += 1
        self.stats_.examples += n

    def _push(self) -> None:
        """Send the committed sum to the shards, each its share of this partition's
        pieces. Point-to-point."""
        t0 = time.perf_counter()
        requests = []
        # Test-only: killed in the middle of this push, after its first shard's part.
        dying = bool(self.faults) and self.faults.kill_in_push_from(self.stats_.units)
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
        self.stats_.bytes_sent += sum(buf.nbytes for buf in self.send)
        self.stats_.comm_seconds += time.perf_counter() - t0

    def _evaluate(self, snapshot: int) -> tuple:
        """(snapshot, test loss, test accuracy) of snapshot `snapshot` (with partitions,
        the PartitionedNetwork's distributed loss and accuracy: the same on every one)."""
        if not self._fetch("snapshot", snapshot):
            # The coordinator takes a new snapshot only after this result: cannot happen.
            raise RuntimeError(f"replica {self.stats_.replica}: snapshot {snapshot} was "
                               "replaced before it was evaluated (protocol error)")
        if self.eval_set is None:
            self.eval_set = self.load_eval()
        loss, accuracy = self.model.evaluate(self.params, *self.eval_set, batch_size=1000)
        self.stats_.evaluations += 1
        return (snapshot, float(loss), float(accuracy))

    def stats(self) -> dict[str, Any]:
        self.stats_.data_bytes_read = bytes_read()
        self.stats_.own_rows = self.rows.hi - self.rows.lo
        self.stats_.foreign_units = self.rows.foreign_units
        self.stats_.foreign_reads = self.rows.foreign_reads
        self.stats_.foreign_bytes = self.rows.foreign_bytes
        out = {"role": "replica", **asdict(self.stats_)}
        if self.team is not None:
            out["model_parallel"] = self.model.traffic.per_step()
        return out


def model_layout(model: Any) -> Any:
    """The whole model's parameter layout of a Network or a PartitionedNetwork."""
    return model.network.layout if isinstance(model, PartitionedNetwork) else model.layout
