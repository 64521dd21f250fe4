"""Sandblaster L-BFGS (Dean et al., NIPS 2012): a coordinator drives batch L-BFGS while
the vectors stay on the parameter-server shards and model replicas compute the batch
gradient in small work units.

    mpiexec -n N python -m distbelief train CONFIG     # [optimizer] algorithm = "sandblaster"

ROLES (distbelief.runtime.topology, with a coordinator): world ranks 0..S-1 are shards
(`[cluster] ps_shards = S`), rank S is the coordinator, ranks S+1..N-1 are replicas
0..R-1, each of P ranks (`[cluster] partitions = P`: model parallelism, see PARTITIONED
REPLICAS). Every rank checks the rank count, the partitioning and the data against the
configuration before it communicates (`plan_run`, `partition_pieces`), so a job that
does not fit ends with exit 2 on every rank.

SHARDS hold their slice of x, g, d, the trial point and its gradient, and the m history
pairs, in float64 (distbelief.ps.vector_shard). Each runs a command loop (`ShardServer`):
commands from the coordinator (begin a trial, finish it, accept it, set the direction,
take a snapshot, stop) answered with this slice's partial dot products; fetches from
replicas answered with the float32 trial point or snapshot; gradient pushes from
replicas summed into the trial gradient.

THE COORDINATOR (`Coordinator`) runs lbfgs.minimize (this package): the two-loop recursion
on a Gram matrix of dot products, so it sends and receives O(m) numbers per iteration
(6m+1 per shard on accept, 2m+1 coefficients out and 2 numbers back for the direction,
a few per line-search trial), never a vector; `bytes` counts them. For each gradient
evaluation it hands out work units (work_units in this package: dynamic load balancing,
backup copies in the tail, commit-or-drop so each example counts once), then tells the
shards to finish the trial once they have received all units. It also owns the run
folder (metrics.jsonl, summary.json) and the stop rules, and hands evaluation tasks
(test accuracy of a snapshot of x) to replicas: the test set never needs the parameters
on the coordinator either.

REPLICAS loop: ask the coordinator for a task (reporting the units they finished since
the last commit), push the sum to the shards if told to commit, then do the task: a unit
(fetching the trial point first if it is new to them), an evaluation, or stop.

PARTITIONED REPLICAS (P > 1). A replica is a distbelief.model.partitioned_network.PartitionedNetwork
over its P ranks (topology.split_communicators' partition communicator, the "team").
Partition 0 alone talks to the coordinator, which sees one replica (its rank) and the
same O(m) scalars as without partitions; it hands every answer (commit / drop / hold and
the task) to its partners with a broadcast of 8 integers (an Ibcast polled with back-off
sleeps), so all partitions push, drop, fetch and compute the same units in lockstep.
Each partition holds only its pieces of the parameters (partition.partition_pieces: two
ranges per layer) as one vector of its own size; it fetches only those pieces, from the
shards that hold them, and pushes only its pieces' gradient sum, with its partition
index in the header. A shard knows from the same pure partitioning which partitions own
part of its range ("owners") and which segments of its slice each one sends; it finishes
a trial only when every owner has pushed every unit (per-partition unit counts), so
every committed example still counts exactly once in every element. A fetch that finds a
shard already on a later trial makes the whole replica abandon the unit (an Iallreduce
MIN among the partitions: partners fetching from other shards may have got the older
trial). Test-set evaluations use the PartitionedNetwork's distributed loss and accuracy.

COMMUNICATION is point-to-point over the world communicator, with one tag per message
kind (TAG_*). Why not RMA as Downpour: every shard operation here is a command that
needs an answer computed by the shard (a dot product, a finished sum), so the shard is
an active loop anyway, and two-sided messages give the ordering for free: a replica's
push is matched before the shard can see the coordinator's finish for that trial,
because the shard answers `finish` only once its unit count is complete. Small messages
are pickled tuples; vectors are raw float32 buffers with a 4-slot int32 header. Every
wait polls (Iprobe / Test) with a sleeping back-off (MPICH's blocking calls busy-poll
and would steal the cores the replicas compute on); a blocking `send` is used only for
small messages, which MPICH sends eagerly.

ORDER OF A TRIAL. coordinator -> shards: begin_trial(id, t) and wait for every ack;
only then are units of trial `id` handed out, so every fetch of trial `id` finds it on
every shard (a fetch that arrives after a later trial began sees another id in the
header; the replica abandons the unit). Units are committed before they are pushed, and
`finish_trial(id, n_units)` is answered when the shard has summed exactly n_units units;
the next begin_trial comes only after every shard answered, so no push of trial `id`
can arrive later.

CHECKPOINTS (distbelief.records.checkpoint, format version 1; replicas write no part: the batch
order follows from (seed, iteration), so partitions change nothing here): every
run.checkpoint_every_steps iterations / run.checkpoint_every_seconds, and when the run
stops, the coordinator prepares the folder and commands "checkpoint"; each shard writes
its part (x, and the history pairs oldest first, each float64 vector as a float32 pair
hi + lo) and answers with its part record; the coordinator commits (it is the committer:
it also chose the checkpoint to resume from at start-up, and cleans leftovers). On a
resume the shards read their ranges (any shard count: checkpoints are re-sliced), the
coordinator asks them once for the 3 m^2 dots of the history, and L-BFGS continues from
the checkpoint's iteration with a fresh gradient evaluation at x. The gradient, the
direction and the line search state are not stored: they are recomputed.

STOP. The coordinator ends the method (max_steps iterations, max_seconds, target
accuracy, converged, line search failed, diverged, or SIGTERM/SIGUSR1 at the end of the
current iteration), writes a checkpoint, runs a final evaluation on a replica (not after
a signal: the job should end soon), answers every replica's next request with "stop",
sends "stop" to the shards, then every rank takes part in a back-off barrier and one
gather of statistics to the coordinator, which writes summary.json.

Threads: 1 BLAS thread per rank unless `[run] threads` says otherwise.
"""

from __future__ import annotations

import itertools
import math
import statistics
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import IO, Any

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.common import (
    StopRules,
    StopSignals,
    TrainingDiverged,
    load_eval_set,
    open_data,
    prepare_run_dir,
    starting_checkpoint,
)
from distbelief.algorithms.sandblaster.lbfgs import Gram, Iteration, LbfgsOptions, minimize
from distbelief.algorithms.sandblaster.work_units import (
    COMMIT,
    DROP,
    HOLD,
    UnitStats,
    WorkUnitTable,
    unit_ranges,
)
from distbelief.config import Config, config_hash, hashed_settings
from distbelief.data.hdf5 import _read_rows, _to_float
from distbelief.errors import ConfigError
from distbelief.model.partition import partition_pieces
from distbelief.model.partitioned_network import PartitionedNetwork, wait_all
from distbelief.ps.vector_shard import VectorShard
from distbelief.records import checkpoint as ckpt
from distbelief.records.metrics import ResumePoint, RunRecorder
from distbelief.runtime import watchdog
from distbelief.runtime.agreement import agree, wait_for_everyone
from distbelief.runtime.backoff import Backoff
from distbelief.runtime.faults import Faults
from distbelief.runtime.threads import set_blas_threads
from distbelief.runtime.topology import Communicators, Topology, split_communicators

TAG_REQUEST, TAG_TASK, TAG_COMMAND, TAG_RESULT, TAG_FETCH, TAG_PARAMS, TAG_PUSH = range(
    201, 208)
HEADER = 4
"""float32 slots in front of every vector message, read as int32: [trial or snapshot id,
units, partition, 0]."""

POLL_S = (20e-6, 1e-3)
"""Back-off bounds of every polling wait (min, max sleep). A replica waiting between
trials or a shard between commands wakes every millisecond at most (a few % of a core)."""

AUTO_UNITS_PER_REPLICA = 16
MIN_AUTO_UNIT = 32
BACKUP_LATE_FACTOR = 1.5
"""A unit gets a backup copy once its newest copy has been out this many times the
median seconds per unit of the recent units (distbelief.algorithms.sandblaster.work_units)."""


# ------------------------------------------------------------------------------------------
# The plan: pure validation, the same on every rank, before any communication


@dataclass(frozen=True)
class SandblasterPlan:
    """A validated Sandblaster run for one rank."""

    topology: Topology
    batch_size: int      # examples per gradient evaluation (<= n_train)
    n_train: int
    unit_size: int
    options: LbfgsOptions
    push_every: int
    backup_copies: int

    @property
    def num_replicas(self) -> int:
        return self.topology.num_replicas

    @property
    def full_batch(self) -> bool:
        return self.batch_size == self.n_train

    @property
    def units(self) -> list[tuple[int, int]]:
        return unit_ranges(self.batch_size, self.unit_size)

    @property
    def partitions(self) -> int:
        return self.topology.partitions


Piece = tuple[int, int]


def shard_segments(pieces: list[Piece], ranges: list[Piece]) -> list[list[Piece]]:
    """Per shard, the parts of `pieces` (sorted [start, stop) ranges of the flat vector: one
    partition's parameters) that lie in the shard's range, in order. Pure. Shards own
    ascending contiguous ranges, so these parts, shard after shard, are the pieces back to
    back: each shard's share of a partition's own-size vector is one contiguous slice."""
    return [[(max(a, low), min(b, high)) for a, b in pieces if max(a, low) < min(b, high)]
            for low, high in ranges]


def all_pieces(network: Any, partitions: int,
               splits: list[list[int]] | None = None) -> list[list[Piece]]:
    """Per partition, the ranges of the flat parameter vector it owns (the whole vector
    when P = 1). Pure and cheap; ConfigError when `splits` do not fit the network."""
    if partitions == 1:
        return [[(0, network.layout.size)]]
    return partition_pieces(network.layers, network.layout, partitions, splits)


def plan_run(config: Config, world_size: int, world_rank: int, n_train: int,
             num_params: int) -> SandblasterPlan:
    """Check that the job fits; pure, so every rank raises the same ConfigError before the
    first collective."""
    opt, cluster = config.optimizer, config.cluster
    topology = Topology(world_size, world_rank, cluster.ps_shards, cluster.partitions,
                        coordinator=True)
    if cluster.ps_shards > num_params:
        raise ConfigError(f"cluster.ps_shards = {cluster.ps_shards} is more than the "
                          f"{num_params} parameters of the model")
    batch = min(config.data.batch_size, n_train)
    unit = opt.work_unit_size or max(min(batch, MIN_AUTO_UNIT),
                                     math.ceil(batch / (AUTO_UNITS_PER_REPLICA
                                                        * topology.num_replicas)))
    if unit > batch:
        raise ConfigError(f"optimizer.work_unit_size = {unit} is larger than the batch of "
                          f"{batch} examples (data.batch_size, at most the {n_train} "
                          f"training rows)")
    options = LbfgsOptions(m=opt.m, c1=opt.wolfe_c1, c2=opt.wolfe_c2,
                           wolfe=opt.line_search == "wolfe",
                           max_line_search=opt.max_line_search,
                           gradient_tolerance=opt.gradient_tolerance,
                           max_iterations=config.run.max_steps, full_batch=batch == n_train)
    return SandblasterPlan(topology, batch, n_train, unit, options, opt.push_every_units,
                           opt.backup_copies)


class BatchRows:
    """Which training rows make up batch k: all rows in order when the batch is the whole
    set, else consecutive pieces of a stream of seeded per-epoch permutations (every
    replica computes the same rows from (seed, k))."""

    def __init__(self, n_train: int, batch_size: int, seed: int):
        self.n, self.batch_size, self.seed = n_train, batch_size, seed
        self._cache: tuple[int, np.ndarray] | None = None

    def rows(self, k: int) -> np.ndarray:
        if self.batch_size >= self.n:
            return np.arange(self.n)
        if self._cache is None or self._cache[0] != k:
            first = k * self.batch_size
            positions = np.arange(first, first + self.batch_size)
            epochs, offsets = np.divmod(positions, self.n)
            out = np.empty(self.batch_size, dtype=np.intp)
            for epoch in np.unique(epochs):
                mask = epochs == epoch
                out[mask] = self._permutation(int(epoch))[offsets[mask]]
            self._cache = (k, out)
        return self._cache[1]

    def _permutation(self, epoch: int) -> np.ndarray:
        seq = np.random.SeedSequence(self.seed, spawn_key=(epoch,))
        return np.random.default_rng(seq).permutation(self.n)


# ------------------------------------------------------------------------------------------
# Entry point


def train(config: Config, comm: MPI.Comm, stream: IO[str] | None = sys.stdout,
          resume: str = "auto") -> dict[str, Any] | None:
    """Run Sandblaster L-BFGS on the ranks of `comm`; returns the summary on the
    coordinator, None elsewhere.

    Collective over `comm`: every rank calls it with the same configuration. Validation
    first (no communication), then a set-up whose UserError is raised on every rank, then
    point-to-point traffic (see the module docstring), then a back-off barrier and a
    gather. Raises TrainingDiverged on every rank if the loss became non-finite. `resume`:
    distbelief.algorithms.common.RESUME_MODES ("auto", "require", "fresh").
    """
    role = start(config, comm, stream, resume)
    # collective (an allgather)
    guard = watchdog.for_job(comm, role.plan.topology.describe_rank, config.run)
    # Every rank catches SIGTERM/SIGUSR1 (the launcher forwards them to all): only the
    # coordinator acts on it, at the end of the iteration, with a checkpoint and the usual
    # collective stop; the other ranks must simply not die of it.
    with (np.errstate(over="ignore", invalid="ignore"), StopSignals() as signals,
          watchdog.watching(guard)):
        try:
            role.signals = signals
            role.run()
            summary = finish(comm, role)
        except watchdog.RankLost as lost:
            # Sandblaster does not go on without a rank (its backup tasks cover a slow
            # replica, not a dead one at the end of the run): end the job with a message.
            watchdog.abort_for(comm, role.plan.topology.describe_rank, lost)
    if summary["stop_reason"] == "diverged":
        raise TrainingDiverged("training diverged: the loss became non-finite")
    return summary if isinstance(role, Coordinator) else None


def start(config: Config, comm: MPI.Comm, stream: IO[str] | None = sys.stdout,
          resume: str = "auto", splits: list[list[int]] | None = None) -> Any:
    """Validate, set up and build this rank's role (ShardServer, Coordinator or Replica).
    Collective over `comm` (two set-up agreements around a bcast of the checkpoint to
    resume from, and topology.split_communicators); call `role.run()` and `finish` next.
    `splits`: with partitions, per layer the P+1 block boundaries (None: balanced, what
    the command line uses; tests pass unequal ones)."""
    info, network = open_data(config)
    plan = plan_run(config, comm.Get_size(), comm.Get_rank(), info.n_train,
                    network.layout.size)
    pieces = all_pieces(network, plan.partitions, splits)  # pure: the same error everywhere
    set_blas_threads(config.run.threads or 1)
    topology = plan.topology
    local = agree(comm, lambda: _local_setup(config, plan, info, network, resume, stream))
    found = local if topology.role == "coordinator" else None
    path = comm.bcast(None if found is None else str(found.path),
                      root=topology.coordinator_rank)
    communicators = split_communicators(comm, topology)
    role: Any
    if topology.is_shard:
        role = agree(comm, lambda: _shard(config, comm, plan, network, path, pieces))
    else:
        agree(comm, lambda: None)
        if topology.role == "coordinator":
            role = Coordinator(comm, config, plan, network, info, stream, found)
        elif plan.partitions == 1:
            role = Replica(comm, config, plan, network, *local, pieces=pieces[0])
        else:
            team = communicators.partition
            model = PartitionedNetwork(network, team, splits)
            role = Replica(comm, config, plan, model, *local, pieces=model.pieces, team=team)
    role.communicators = communicators
    return role


def _local_setup(config: Config, plan: SandblasterPlan, info: Any, network: Any,
                 resume: str, stream: IO[str] | None) -> Any:
    """A replica's training rows and evaluation set; on the coordinator the checkpoint to
    resume from (or None) and the run folder. Local."""
    if plan.topology.is_replica:
        x, y = _read_rows(info, "train", 0, info.n_train)  # every replica may get any unit
        return x, y, load_eval_set(config, info), info.scale
    if plan.topology.role == "coordinator":
        found = starting_checkpoint(config, network.layout, resume, stream)
        prepare_run_dir(config)
        return found
    return None


def _shard(config: Config, comm: MPI.Comm, plan: SandblasterPlan, network: Any,
           checkpoint: str | None, pieces: list[list[Piece]]) -> ShardServer:
    """A shard's server, with its slice of the initial parameters or of the checkpoint.
    Local (reads the checkpoint's overlapping parts)."""
    index = plan.topology.world_rank
    start_, stop_ = network.layout.shard_ranges(plan.topology.ps_shards)[index]
    store = VectorShard(network.init_params(config.run.seed)[start_:stop_], start_,
                        plan.options.m)
    if checkpoint is not None:
        params, state = ckpt.verify(checkpoint).read_range(start_, stop_)
        store.load_checkpoint(params, state)
    return ShardServer(comm, plan, store, pieces)


def finish(comm: MPI.Comm, role: Any) -> dict[str, Any]:
    """Back-off barrier, gather of statistics to the coordinator, bcast of the stop
    reason, the role communicators freed; the coordinator writes summary.json. Collective
    over `comm`, the same calls in the same order on every rank. Returns the summary on
    the coordinator, {"stop_reason": ...} elsewhere."""
    wait_for_everyone(comm)
    root = role.plan.topology.ps_shards
    all_stats = comm.gather(role.stats(), root=root)
    reason = comm.bcast(role.reason if isinstance(role, Coordinator) else None, root=root)
    communicators: Communicators | None = getattr(role, "communicators", None)
    if communicators is not None:
        communicators.free()
    if not isinstance(role, Coordinator):
        return {"stop_reason": reason}
    return role.write_summary(all_stats)


def _backoff() -> Backoff:
    return Backoff(*POLL_S)


# ------------------------------------------------------------------------------------------
# Shards


class ShardServer:
    """A shard's command loop: the coordinator's vector operations, replicas' fetches and
    pushes. Point-to-point with the coordinator and every replica.

    `pieces`: per partition, the ranges of the flat vector it owns (`all_pieces`). Partition
    p of any replica fetches and pushes `segments[p]`, the parts of its pieces in this
    shard's range, back to back; a trial is finished once every partition owning some of
    the range ("owners") has pushed every unit."""

    def __init__(self, comm: MPI.Comm, plan: SandblasterPlan, store: VectorShard,
                 pieces: list[list[Piece]]):
        self.comm, self.plan, self.store = comm, plan, store
        topology = plan.topology
        self.coordinator = topology.coordinator_rank
        self.first_replica, self.partitions = topology.first_replica_rank, topology.partitions
        lo, hi = store.start, store.stop
        if len(pieces) != self.partitions:
            raise ValueError(f"pieces for {len(pieces)} partitions, the topology has "
                             f"{self.partitions}")
        self.segments = [[(a - lo, b - lo) for a, b in shard_segments(own, [(lo, hi)])[0]]
                         for own in pieces]
        self.sizes = [sum(b - a for a, b in segs) for segs in self.segments]
        self.owners = [p for p, size in enumerate(self.sizes) if size]
        self.unit_counts = [0] * self.partitions  # units pushed by each partition, this trial
        self.push_buffer = np.empty(HEADER + hi - lo, dtype=np.float32)
        self.trial_msgs = self._messages(store.trial32, -1)
        self.snapshot_msgs = self._messages(store.snapshot32, -1)
        self.sending: list[tuple[MPI.Request, np.ndarray]] = []
        self.finish_due: tuple[int, int] | None = None  # (n_units, batch_size)
        self.signals = None  # set by train(); only the coordinator acts on signals
        self.running = True
        self.counts = {"commands": 0, "fetches": 0, "pushes": 0}

    def _messages(self, values: np.ndarray, ident: int) -> list[np.ndarray | None]:
        """Per partition, a new [header | its segments of values] float32 buffer (a send of
        the old one may be in flight); None for partitions that own nothing here."""
        out: list[np.ndarray | None] = []
        for segs, size in zip(self.segments, self.sizes):
            if not size:
                out.append(None)
                continue
            msg = np.empty(HEADER + size, dtype=np.float32)
            msg[:HEADER].view(np.int32)[:] = (ident, 0, 0, 0)
            at = HEADER
            for a, b in segs:
                msg[at:at + b - a] = values[a:b]
                at += b - a
            out.append(msg)
        return out

    def _partition_of(self, source: int) -> int:
        """The partition index of replica rank `source` (protocol error for another rank)."""
        if source < self.first_replica:
            raise RuntimeError(f"shard {self.comm.Get_rank()}: replica message from rank "
                               f"{source}, which is no replica (protocol error)")
        return (source - self.first_replica) % self.partitions

    def _trial_complete(self) -> bool:
        n_units = self.finish_due[0]
        return all(self.unit_counts[p] >= n_units for p in self.owners)

    def run(self) -> None:
        """Serve until the coordinator says stop and every send has completed.
        Point-to-point with the coordinator and the replicas; polls with back-off sleeps."""
        status, backoff = MPI.Status(), _backoff()
        while self.running or self.sending:
            busy = False
            while self.running and self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                self._handle(status)
                busy = True
            if self.finish_due and self._trial_complete():
                self._finish_trial()
                busy = True
            self.sending = [(r, b) for r, b in self.sending if not r.Test()]
            if busy:
                backoff.reset()
            else:
                backoff.wait()

    def _handle(self, status: MPI.Status) -> None:
        source, tag = status.Get_source(), status.Get_tag()
        if tag == TAG_PUSH:
            partition = self._partition_of(source)
            count = status.Get_count(MPI.FLOAT)
            self.comm.Recv([self.push_buffer, MPI.FLOAT], source, TAG_PUSH)
            trial, units, sender = (int(v) for v in self.push_buffer[:3].view(np.int32))
            if trial != self.store.trial_id:
                raise RuntimeError(f"shard {self.comm.Get_rank()}: push for trial {trial} "
                                   f"during trial {self.store.trial_id} (protocol error)")
            if sender != partition or count != HEADER + self.sizes[partition]:
                raise RuntimeError(f"shard {self.comm.Get_rank()}: push of {count} floats "
                                   f"from rank {source} (partition {partition}, header "
                                   f"{sender}); expected {HEADER + self.sizes[partition]} "
                                   f"(protocol error)")
            self.store.add_gradient(self.push_buffer[HEADER:count], units,
                                    self.segments[partition])
            self.unit_counts[partition] += units
            self.counts["pushes"] += 1
        elif tag == TAG_FETCH:
            partition = self._partition_of(source)
            kind = self.comm.recv(source=source, tag=TAG_FETCH)
            msg = (self.trial_msgs if kind == "trial" else self.snapshot_msgs)[partition]
            if msg is None:
                raise RuntimeError(f"shard {self.comm.Get_rank()}: fetch from rank {source}, "
                                   f"whose partition {partition} owns nothing here "
                                   f"(protocol error)")
            self.sending.append((self.comm.Isend([msg, MPI.FLOAT], source, TAG_PARAMS), msg))
            self.counts["fetches"] += 1
        elif tag == TAG_COMMAND and source == self.coordinator:
            op, args = self.comm.recv(source=source, tag=TAG_COMMAND)
            self.counts["commands"] += 1
            self._command(op, args)
        else:
            raise RuntimeError(f"shard {self.comm.Get_rank()}: unexpected message tag {tag} "
                               f"from rank {source}")

    def _command(self, op: str, args: tuple) -> None:
        store = self.store
        if op == "begin_trial":
            result = store.begin_trial(*args)
            self.unit_counts = [0] * self.partitions
            self.trial_msgs = self._messages(store.trial32, store.trial_id)
        elif op == "finish_trial":
            self.finish_due = args  # answered once every unit has been pushed
            return
        elif op == "accept":
            result = store.accept(*args)
        elif op == "take_gradient":
            result = store.take_gradient()
        elif op == "set_direction":
            result = store.set_direction(*args)
        elif op == "snapshot":
            result = store.take_snapshot(*args)
            self.snapshot_msgs = self._messages(store.snapshot32, store.snapshot_id)
        elif op == "gram":
            result = store.gram()
        elif op == "checkpoint":
            partial, meta, order = args
            params, state = store.checkpoint_arrays(order)
            result = ckpt.write_shard_part(partial, meta, self.comm.Get_rank(), store.start,
                                           store.stop, params, state)
        elif op == "stop":
            self.running, result = False, np.zeros(0)
        else:
            raise RuntimeError(f"shard: unknown command {op!r}")
        self.comm.send(result, dest=self.coordinator, tag=TAG_RESULT)

    def _finish_trial(self) -> None:
        n_units, batch_size = self.finish_due
        wrong = {p: self.unit_counts[p] for p in self.owners if self.unit_counts[p] != n_units}
        if wrong:
            raise RuntimeError(f"shard {self.comm.Get_rank()}: units pushed for trial "
                               f"{self.store.trial_id} by partition {wrong}, expected "
                               f"{n_units} from each of {self.owners}")
        self.finish_due = None
        self.comm.send(self.store.finish_trial(batch_size), dest=self.coordinator,
                       tag=TAG_RESULT)

    def stats(self) -> dict[str, Any]:
        return {"role": "shard", "rank": self.comm.Get_rank(), "start": self.store.start,
                "stop": self.store.stop, "owners": self.owners, **self.counts}


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


DECISIONS = (HOLD, COMMIT, DROP)
TASK_KINDS = (None, "stop", "evaluate", "unit")
ANSWER_SLOTS = 8


def encode_answer(decision: str, task: tuple | None, out: np.ndarray) -> np.ndarray:
    """The coordinator's answer (decision, task) as int64s, for partition 0 to broadcast:
    [decision, task kind, task arguments...] (a unit's: trial, batch, unit, start, stop)."""
    out.fill(0)
    out[0] = DECISIONS.index(decision)
    out[1] = TASK_KINDS.index(None if task is None else task[0])
    if task is not None:
        out[2:2 + len(task) - 1] = task[1:]
    return out


def decode_answer(values: np.ndarray) -> tuple[str, tuple | None]:
    """What `encode_answer` encoded."""
    kind = TASK_KINDS[int(values[1])]
    arguments = {None: 0, "stop": 0, "evaluate": 1, "unit": 5}[kind]
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
                 x: np.ndarray, y: np.ndarray, eval_set: tuple[np.ndarray, np.ndarray],
                 scale: float, pieces: list[Piece], team: MPI.Comm | None = None):
        self.comm, self.plan, self.model = comm, plan, model
        self.x, self.y, self.eval_set, self.scale = x, y, eval_set, scale
        topology = plan.topology
        self.coordinator = topology.coordinator_rank
        self.team = team if team is not None and team.Get_size() > 1 else None
        self.partition = topology.partition_index
        self.lead = self.partition == 0
        self.batches = BatchRows(plan.n_train, plan.batch_size, config.run.seed)
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
        wait_all([self.team.Ibcast(self.answer, root=0)])
        self.stats_.comm_seconds += time.perf_counter() - t0
        return decode_answer(self.answer)

    def _all_agree(self, ok: bool) -> bool:
        """Whether `ok` holds on every partition (an Iallreduce MIN over the team, polled);
        `ok` itself with one partition."""
        if self.team is None:
            return ok
        self.agreed[0] = ok
        wait_all([self.team.Iallreduce(MPI.IN_PLACE, self.agreed, op=MPI.MIN)])
        return bool(self.agreed[0])

    def _ask(self, request: tuple) -> tuple[str, tuple | None]:
        """Send a request to the coordinator; wait (polling) for its answer."""
        t0 = time.perf_counter()
        self.comm.send(request, dest=self.coordinator, tag=TAG_REQUEST)
        backoff = _backoff()
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
        rows = self.batches.rows(batch)[start:stop]
        x = _to_float(self.x[rows], self.scale)
        n = stop - start
        loss = self.model.loss_and_grad(self.params, x, self.y[rows], self.grad)
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
        for (shard, offset, size), buf in zip(self.links, self.send):
            buf[:HEADER].view(np.int32)[:] = (self.pending_trial, len(self.pending_units),
                                              self.partition, 0)
            buf[HEADER:] = self.pending[offset:offset + size]
            requests.append(self.comm.Isend([buf, MPI.FLOAT], shard, TAG_PUSH))
        wait_all(requests, "the shards to take this replica's push",
                 [s for s, _, _ in self.links])
        self.stats_.pushes += 1
        self.stats_.comm_seconds += time.perf_counter() - t0

    def _evaluate(self, snapshot: int) -> tuple:
        """(snapshot, test loss, test accuracy) of snapshot `snapshot` (with partitions,
        the PartitionedNetwork's distributed loss and accuracy: the same on every one)."""
        if not self._fetch("snapshot", snapshot):
            # The coordinator takes a new snapshot only after this result: cannot happen.
            raise RuntimeError(f"replica {self.stats_.replica}: snapshot {snapshot} was "
                               "replaced before it was evaluated (protocol error)")
        loss, accuracy = self.model.evaluate(self.params, *self.eval_set, batch_size=1000)
        self.stats_.evaluations += 1
        return (snapshot, float(loss), float(accuracy))

    def stats(self) -> dict[str, Any]:
        out = {"role": "replica", **asdict(self.stats_)}
        if self.team is not None:
            out["model_parallel"] = self.model.traffic.per_step()
        return out


def model_layout(model: Any) -> Any:
    """The whole model's parameter layout of a Network or a PartitionedNetwork."""
    return model.network.layout if isinstance(model, PartitionedNetwork) else model.layout


# ------------------------------------------------------------------------------------------
# The coordinator


@dataclass
class Traffic:
    """Bytes the coordinator sent to and received from shards and replicas (pickled
    message sizes, as MPI carries them)."""

    shard_bytes: int = 0
    shard_messages: int = 0
    replica_bytes: int = 0
    replica_messages: int = 0


@dataclass
class EvaluationRecord:
    """One gradient evaluation (a trial of the line search, or a new batch's gradient)."""

    seconds: float
    stats: UnitStats = field(default_factory=UnitStats)


class Coordinator:
    """Runs L-BFGS through shard commands, deals out work units, keeps the run's records.
    Point-to-point with every shard and replica; never holds a vector."""

    def __init__(self, comm: MPI.Comm, config: Config, plan: SandblasterPlan, network: Any,
                 info: Any, stream: IO[str] | None, resumed: ckpt.Checkpoint | None = None):
        self.comm, self.config, self.plan, self.network = comm, config, plan, network
        self.resumed = resumed
        self.stream = stream
        topology = plan.topology
        self.shards = list(topology.shard_ranks)
        self.replicas = [topology.replica_ranks(r)[0] for r in range(plan.num_replicas)]
        self.all_replica_ranks = range(topology.first_replica_rank, topology.world_size)
        self.units = plan.units
        self.rules = StopRules.from_config(config)
        self.traffic = Traffic()
        self.table: WorkUnitTable | None = None
        self.trial_id = 0
        self.batch = 0
        self.loss_sum = 0.0
        self.parked: list[int] = []
        self.stopping = False
        self.stopped: set[int] = set()
        self.reason: str | None = None
        self.samples = 0
        self.evaluations: list[EvaluationRecord] = []
        self.iteration_evals: list[EvaluationRecord] = []
        self.unit_totals = UnitStats()
        self.late_discarded = 0
        self.unit_seconds: deque[float] = deque(maxlen=256)  # recent units, issue to report
        self.snapshot_id = 0
        self.eval_task: int | None = None  # a snapshot waiting for a replica to evaluate it
        self.snapshot_at: dict[int, tuple[int, int]] = {}  # snapshot -> (step, samples)
        self.eval_in_flight = False
        self.last_loss = math.nan
        self.step = 0
        _print(stream, _header(config, plan, network, info))
        resume = None
        if resumed is not None:
            self.step, self.samples = resumed.step, resumed.samples
            resume = ResumePoint(resumed.step, resumed.samples, resumed.wall_seconds,
                                 resumed.path.name)
        self.recorder = RunRecorder(config.run.out_dir, config.run.progress_every_seconds,
                                    stream, target_accuracy=config.run.target_accuracy,
                                    resume=resume)
        self.order: list[int] = []  # history slots in use, oldest first (for checkpoints)
        self.checkpointed = (self.step, self.recorder.elapsed())  # (step, time) of the last
        self.next_eval = self.recorder.start  # evaluate x0 first
        self.method = Coordinator._minimize
        self.signals: StopSignals | None = None
        """What `run` does with the shards and replicas; tests put other methods here."""

    # -- the method -------------------------------------------------------------------------

    def _minimize(self) -> str:
        gram = None
        if self.resumed is not None:
            pairs = sum(1 for name in self.resumed.manifest["optimizer_state"]
                        if name.startswith("s") and not name.endswith("_lo"))
            gram = Gram(self.plan.options.m)
            gram.load(self._command("gram"), pairs)
            self.order = list(gram.order)
        return minimize(self, self.plan.options, self._on_iteration, self.step, gram)

    def run(self) -> None:
        """Run the method, then the final checkpoint and evaluation, then stop every replica
        and shard. Point-to-point with every shard and replica."""
        self.reason = self.method(self)
        if self.reason == "converged":
            _print(self.stream, f"converged: gradient norm <= "
                   f"{self.plan.options.gradient_tolerance:g}")
        if self.reason != "diverged":
            self._checkpoint()
        if self.reason not in StopSignals.NAMES:  # on a signal, end soon: no evaluation
            self._evaluate_now()  # the final parameters
        self.stopping = True
        for rank in self.parked:
            self._reply(rank, (HOLD, ("stop",)))
            self.stopped.add(rank)
        self.parked = []
        self._serve_until(lambda: len(self.stopped) == len(self.replicas))
        self._command("stop")

    def _on_iteration(self, it: Iteration) -> str | None:
        self.step = it.step
        self.last_loss = it.loss
        self.order = it.order
        stats = UnitStats()
        for record in self.iteration_evals:
            stats.add(record.stats)
        stats.discarded += self.late_discarded  # reported after their trial ended
        self.late_discarded = 0
        self.recorder.log(
            it.step, self.samples, it.loss, grad_norm=it.grad_norm, step_size=it.step_size,
            line_search_evals=it.line_search_evals, pair_kept=it.pair_kept,
            restarted=it.restarted,
            units_per_replica=[stats.committed_by.get(r, 0) for r in range(len(self.replicas))],
            backup_units_issued=stats.backups_issued, backup_units_discarded=stats.discarded,
            evaluation_seconds=[r.seconds for r in self.iteration_evals],
            coordinator_shard_bytes=self.traffic.shard_bytes,
            coordinator_replica_bytes=self.traffic.replica_bytes)
        self.iteration_evals = []
        self.recorder.progress(it.step, self.samples, it.loss)
        now = time.monotonic()
        if not math.isfinite(it.loss):
            return "diverged"
        if now >= self.next_eval and not self.eval_in_flight:
            self._schedule_evaluation()
        if self._checkpoint_due():
            self._checkpoint()
        if self.reason:
            return self.reason  # target accuracy, seen in an evaluation result
        if self.signals is not None and self.signals.received:
            return self.signals.received
        return self.rules.budget_spent(0, now - self.recorder.start)

    # -- checkpoints ---------------------------------------------------------------------------

    def _checkpoint_due(self) -> bool:
        run = self.config.run
        step, at = self.checkpointed
        return bool((run.checkpoint_every_steps and self.step - step
                     >= run.checkpoint_every_steps)
                    or (run.checkpoint_every_seconds and self.recorder.elapsed() - at
                        >= run.checkpoint_every_seconds))

    def _checkpoint(self) -> None:
        """Write and commit a checkpoint of the current iterate and history (the shards
        write their parts on command; this rank commits). Point-to-point with the shards."""
        if self.checkpointed[0] == self.step and self.step > 0:
            return  # this iteration is in a checkpoint already
        root = ckpt.checkpoint_root(self.config.run.out_dir)
        meta = ckpt.CheckpointMeta(self.step, self.samples, self.recorder.elapsed(),
                                   config_hash(self.config))
        partial = ckpt.prepare(root, self.step)
        records = self._command("checkpoint", str(partial), meta, list(self.order),
                                combine=list)
        names = ["x_lo"] + [f"{v}{k:03d}{lo}" for k in range(len(self.order))
                            for v in "sy" for lo in ("", "_lo")]
        layout = self.network.layout
        final = ckpt.commit(root, meta, settings=hashed_settings(self.config),
                            algorithm="sandblaster", layout=layout,
                            shard_ranges=layout.shard_ranges(len(self.shards)),
                            optimizer_state=names, parts=records, num_replicas=0,
                            keep=self.config.run.keep_checkpoints)
        self.checkpointed = (self.step, self.recorder.elapsed())
        self.recorder.log_event("checkpoint", self.step, self.samples, path=str(final))

    # -- Backend (sandblaster.lbfgs): vector operations on the shards -------------------------

    def evaluate(self, t: float, batch: int) -> tuple[float, float]:
        t0 = time.monotonic()
        self.trial_id += 1
        self.batch = batch
        self._command("begin_trial", self.trial_id, t)
        late = (BACKUP_LATE_FACTOR * statistics.median(self.unit_seconds)
                if len(self.unit_seconds) >= 4 else 0.0)
        self.table = WorkUnitTable(len(self.units), self.plan.push_every,
                                   self.plan.backup_copies, backup_after=late)
        self.loss_sum = 0.0
        if self.step == 0 and self.trial_id == 1 and not self.eval_in_flight:
            self._schedule_evaluation()  # x0, while the first batch runs
        parked, self.parked = self.parked, []
        for rank in parked:
            self._give_task(rank, HOLD)
        self._serve_until(lambda: self.table.complete)
        stats = self.table.stats
        self.unit_seconds.extend(self.table.unit_seconds)
        self.table = None
        (gtd,) = self._command("finish_trial", len(self.units), self.plan.batch_size)
        self.samples += self.plan.batch_size
        self.unit_totals.add(stats)
        record = EvaluationRecord(time.monotonic() - t0, stats)
        self.evaluations.append(record)
        self.iteration_evals.append(record)
        return self.loss_sum / self.plan.batch_size, float(gtd)

    def accept(self, slot: int) -> np.ndarray:
        return self._command("accept", slot)

    def take_gradient(self) -> np.ndarray:
        return self._command("take_gradient")

    def set_direction(self, coefficients: np.ndarray) -> tuple[float, float]:
        gtd, dd = self._command("set_direction", np.asarray(coefficients, dtype=np.float64))
        return float(gtd), float(dd)

    def _command(self, op: str, *args: Any, combine: Any = sum) -> Any:
        """Send `op` to every shard, wait (serving replicas meanwhile) for every answer;
        returns combine(answers in shard order): their sum by default. Point-to-point with
        the shards."""
        message = (op, args)
        size = len(MPI.pickle.dumps(message))
        for shard in self.shards:
            self.comm.send(message, dest=shard, tag=TAG_COMMAND)
        self.traffic.shard_bytes += size * len(self.shards)
        self.traffic.shard_messages += len(self.shards)
        answers, status = {}, MPI.Status()
        backoff = _backoff()
        guard = watchdog.current()
        with guard.waiting(f"the shards' answers to {op}", self.shards):
            while len(answers) < len(self.shards):
                guard.check()
                if self.comm.Iprobe(MPI.ANY_SOURCE, TAG_RESULT, status):
                    self.traffic.shard_bytes += status.Get_count(MPI.BYTE)
                    self.traffic.shard_messages += 1
                    source = status.Get_source()
                    answers[source] = self.comm.recv(source=source, tag=TAG_RESULT)
                    backoff.reset()
                elif self._serve_one():
                    backoff.reset()
                else:
                    backoff.wait()
        return combine(answers[shard] for shard in self.shards)

    # -- replicas ------------------------------------------------------------------------------

    def _serve_until(self, done: Any) -> None:
        backoff = _backoff()
        guard = watchdog.current()
        with guard.waiting("the replicas' work units", self.all_replica_ranks):
            while not done():
                if self._serve_one() or self._wake_parked():
                    backoff.reset()
                else:
                    backoff.wait()

    def _wake_parked(self) -> bool:
        """In the tail of a batch, give parked replicas the backups of units that have
        become late since they asked. Returns whether any got one."""
        if self.table is None or not self.table.tail or not self.parked:
            return False
        parked, self.parked = self.parked, []
        for rank in parked:
            self._give_task(rank, HOLD)  # parks it again if nothing is late yet
        return len(self.parked) < len(parked)

    def _serve_one(self) -> bool:
        """Answer one replica request if one is waiting; returns whether one was."""
        status = MPI.Status()
        if not self.comm.Iprobe(MPI.ANY_SOURCE, TAG_REQUEST, status):
            return False
        rank = status.Get_source()
        self.traffic.replica_bytes += status.Get_count(MPI.BYTE)
        self.traffic.replica_messages += 1
        trial, units, loss, result = self.comm.recv(source=rank, tag=TAG_REQUEST)
        if result is not None:
            self._record_evaluation(*result)
        replica = self.replicas.index(rank)
        current = self.table is not None and trial == self.trial_id
        if not units:
            decision = HOLD
        elif current:
            decision = self.table.settle(replica, units)
            if decision == COMMIT:
                self.loss_sum += loss
        else:
            decision = DROP  # its trial is over: every unit of it was committed already
            self.unit_totals.discarded += len(units)
            self.late_discarded += len(units)
        self._give_task(rank, decision, free=not units or decision != HOLD)
        return True

    def _give_task(self, rank: int, decision: str, free: bool = True) -> None:
        """Answer `rank` with `decision` and a task, or park it when there is no task and
        nothing to tell (it is answered when work comes). `free`: it holds no uncommitted
        units, so it may take an evaluation (which must not delay a pending push)."""
        replica = self.replicas.index(rank)
        task: tuple | None = None
        if self.stopping:
            task = ("stop",)
            self.stopped.add(rank)
        elif self.eval_task is not None and free:
            task = ("evaluate", self.eval_task)
            self.eval_task = None
        elif self.table is not None:
            unit = self.table.next_unit(replica)
            if unit is not None:
                start, stop = self.units[unit]
                task = ("unit", self.trial_id, self.batch, unit, start, stop)
        if task is None and decision == HOLD:
            self.parked.append(rank)
            return
        self._reply(rank, (decision, task))

    def _reply(self, rank: int, message: tuple) -> None:
        self.comm.send(message, dest=rank, tag=TAG_TASK)
        self.traffic.replica_bytes += len(MPI.pickle.dumps(message))
        self.traffic.replica_messages += 1

    # -- evaluations (test accuracy) on replicas ---------------------------------------------

    def _schedule_evaluation(self) -> None:
        """Snapshot x on the shards and hand its evaluation to the next free replica."""
        self.snapshot_id += 1
        self._command("snapshot", self.snapshot_id)
        self.eval_task = self.snapshot_id
        self.snapshot_at[self.snapshot_id] = (self.step, self.samples)
        self.eval_in_flight = True
        if self.parked:
            self._give_task(self.parked.pop(0), HOLD)

    def _record_evaluation(self, snapshot: int, loss: float, accuracy: float) -> None:
        self.eval_in_flight = False
        step, samples = self.snapshot_at.pop(snapshot)
        self.recorder.log_eval(step, samples, self.last_loss, accuracy, loss)
        self.next_eval = time.monotonic() + self.config.run.eval_every_seconds
        if self.reason is None and self.rules.target_reached(accuracy):
            self.reason = "target_accuracy"

    def _evaluate_now(self) -> None:
        """Evaluate the current x and wait for the result (the final evaluation)."""
        self._serve_until(lambda: not self.eval_in_flight)
        self._schedule_evaluation()
        self._serve_until(lambda: not self.eval_in_flight)

    # -- summary ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {"role": "coordinator", "rank": self.comm.Get_rank()}

    def write_summary(self, all_stats: list[dict[str, Any]]) -> dict[str, Any]:
        replicas = sorted((s for s in all_stats if s["role"] == "replica"),
                          key=lambda s: (s["replica"], s["partition"]))
        for r in replicas:
            r["units_committed"] = self.unit_totals.committed_by.get(r["replica"], 0)
        plan, totals = self.plan, self.unit_totals
        iterations = max(self.step, 1)
        extras = {
            "algorithm": "sandblaster", "stop_reason": self.reason,
            "config_hash": config_hash(self.config),
            "num_params": int(self.network.layout.size),
            "world_size": plan.topology.world_size, "ps_shards": plan.topology.ps_shards,
            "num_replicas": plan.num_replicas, "partitions": plan.partitions,
            "batch_size": plan.batch_size,
            "work_unit_size": plan.unit_size, "units_per_evaluation": len(self.units),
            "m": plan.options.m, "iterations": self.step,
            "gradient_evaluations": len(self.evaluations),
            "evaluation_seconds_mean": (float(np.mean([e.seconds for e in self.evaluations]))
                                        if self.evaluations else None),
            "units_issued": totals.issued, "backup_units_issued": totals.backups_issued,
            "backup_units_discarded": totals.discarded,
            "coordinator_traffic": asdict(self.traffic),
            "coordinator_shard_bytes_per_iteration": self.traffic.shard_bytes / iterations,
            "final_loss": self.last_loss,
            "replicas": replicas, "shards": [s for s in all_stats if s["role"] == "shard"],
        }
        summary = self.recorder.finish(extras)
        _print(self.stream, _summary_line(summary, self.config))
        return summary


def _header(config: Config, plan: SandblasterPlan, network: Any, info: Any) -> str:
    opt = plan.options
    return (f"distbelief: sandblaster L-BFGS, {network.layout.size:,d} parameters; "
            f"{plan.topology.describe()}; m {opt.m}, batch {plan.batch_size} in "
            f"{len(plan.units)} units of {plan.unit_size}, "
            f"{'Wolfe' if opt.wolfe else 'Armijo'} line search; data {info.path}, out "
            f"{config.run.out_dir}\n{network.describe()}")


def _summary_line(summary: dict[str, Any], config: Config) -> str:
    accuracy = summary["final_test_accuracy"]
    text = (f"distbelief: stopped ({summary['stop_reason']}) after {summary['iterations']} "
            f"iterations ({summary['gradient_evaluations']} gradient evaluations), "
            f"{summary['wall_seconds']:.1f}s; loss {summary['final_loss']:.6g}; test accuracy "
            f"{'-' if accuracy is None else f'{accuracy:.4f}'}; backup units "
            f"{summary['backup_units_issued']} issued, {summary['backup_units_discarded']} "
            f"discarded")
    return f"{text}\nresults in {config.run.out_dir}"


def _print(stream: IO[str] | None, text: str) -> None:
    if stream is not None:
        print(text, file=stream, flush=True)
