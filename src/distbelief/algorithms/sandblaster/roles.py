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

LOST REPLICAS (issue 15; the paper: Sandblaster is "robust to machine failure just like
Downpour SGD"). Every rank gathers every rank's identity at the start
(distbelief.runtime.liveness.Peers; on several nodes every rank also beats in
run.out_dir, distbelief.runtime.heartbeat). While it waits, the coordinator sweeps every
SWEEP_S: a replica with a rank whose process on this node is gone, or whose heartbeat on
another node has stopped for run.heartbeat_timeout_seconds, is lost (any of its P ranks
loses the whole replica). The coordinator then prints one line, records it
(metrics.jsonl `replica_lost`, summary.json `lost_replicas`, as Downpour, and the next
checkpoints' manifests), writes its ranks off (the stall watchdog no longer waits for
them), and goes on: its held, uncommitted units go back to the queue; if it committed
units in the current trial, its push may have reached some shards only, so the trial is
abandoned and run again under a new id (the shards zero the trial gradient at
begin_trial and drop pushes of older trials; the argument is in work_units' docstring:
nothing of a partial push counts, nothing counts twice); an evaluation it held goes to
another replica. The line search only sees a slower gradient evaluation. A surviving
partition of a lost replica finds its partner gone in its next wait on it (or is told by
the coordinator) and stops. A shard receives a push with a polled Irecv and drops it if
its sender dies before it has all of it. Checkpoints hold no replica part (below), so a
resumed run starts every replica afresh. hydra (`-disable-auto-cleanup`) announces a
death by SIGUSR1: the coordinator takes a SIGUSR1 that comes within NOTICE_SLACK_S of a
death it found (or is followed by one within NOTICE_DELAY_S, plus the heartbeat timeout
across nodes) for that notice, not for a stop request, as Downpour's shard 0 does (and
waits while a lost replica's surviving partition has not been seen to end: its exit
brings a notice too). A run
that lost a replica ends without collectives (`_finish_apart`: statistics sent to the
coordinator point-to-point, no MPI_Finalize). When every replica is lost the run stops
(`replicas_lost`) with a checkpoint. A lost SHARD or COORDINATOR cannot be gone on
without (the shards hold the only copy of x and the history; the coordinator's line
search state is not stored): the first rank to find it gone in a wait aborts the job
with one line naming it and saying that a rerun resumes from the last checkpoint.

STOP. The coordinator ends the method (max_steps iterations, max_seconds, target
accuracy, converged, line search failed, diverged, or SIGTERM/SIGUSR1 at the end of the
current iteration), writes a checkpoint, runs a final evaluation on a replica (not after
a signal: the job should end soon), answers every replica's next request with "stop",
sends "stop" to the shards, then every rank takes part in a back-off barrier and one
gather of statistics to the coordinator, which writes summary.json (after a lost replica,
point-to-point instead: LOST REPLICAS).

Threads: 1 BLAS thread per rank unless `[run] threads` says otherwise.

MODULES (this package; each imports only those before it): plan (tags, back-off,
SandblasterPlan, pieces and segments, BatchRows), shards (ShardServer), replica
(Replica), coordinator (Coordinator, the summary); this one, roles, sets them up
(start), runs them (train) and ends them together (finish).
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.common import (
    StopSignals,
    TrainingDiverged,
    load_eval_set,
    open_data,
    prepare_run_dir,
    starting_checkpoint,
)
from distbelief.algorithms.sandblaster.coordinator import Coordinator
from distbelief.algorithms.sandblaster.plan import (
    TAG_STATS,
    BatchRows,
    Piece,
    SandblasterPlan,
    all_pieces,
    plan_run,
    poll_backoff,
    shard_segments,
)
from distbelief.algorithms.sandblaster.replica import (
    ANSWER_SLOTS,
    Replica,
    decode_answer,
    encode_answer,
)
from distbelief.algorithms.sandblaster.shards import ShardServer
from distbelief.config import Config
from distbelief.data.hdf5 import read_rows
from distbelief.model.partitioned_network import PartitionedNetwork
from distbelief.ps.vector_shard import VectorShard
from distbelief.records import checkpoint as ckpt
from distbelief.runtime import guardian, watchdog
from distbelief.runtime.agreement import agree, wait_for_everyone
from distbelief.runtime.liveness import Peers
from distbelief.runtime.threads import set_blas_threads
from distbelief.runtime.topology import Communicators, split_communicators

# What the command line and the tests use from here (the roles' modules hold the rest).
__all__ = ["ANSWER_SLOTS", "BatchRows", "Coordinator", "Replica", "ShardServer",
           "decode_answer", "encode_answer", "finish", "shard_segments", "start", "train"]

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
    # Collective (node_split, an allgather): every rank's identity, and on several nodes
    # every rank beats in out_dir (distbelief.runtime.heartbeat) until the end.
    peers = Peers.gather(comm, config.run.out_dir, config.run.heartbeat_timeout_seconds)
    describe = role.plan.topology.describe_rank
    guard = watchdog.Watchdog(comm.Get_rank(), describe, config.run.stall_warn_seconds,
                              config.run.stall_abort_seconds,
                              lambda message: watchdog.abort_job(comm, message), peers.gone)
    role.peers = peers
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
            # A shard or the coordinator (a lost replica is written off, see LOST
            # REPLICAS): nothing goes on without it. End the job with a message.
            watchdog.abort_and_leave(comm, watchdog.lost_message(describe, lost))
        finally:
            peers.close()
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
        x, y = read_rows(info, "train", 0, info.n_train)  # every replica may get any unit
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
    the coordinator, {"stop_reason": ...} elsewhere. After a lost replica: `_finish_apart`."""
    if role.leave:
        return _finish_apart(comm, role)
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


STATS_GRACE_S = 1.0
"""How long the coordinator still looks for the statistics of a rank found gone at the end
of a run that lost a replica."""


def _finish_apart(comm: MPI.Comm, role: Any) -> dict[str, Any]:
    """The end of a run that lost a replica, without collectives (they would wait for the
    dead): every live rank, but those of lost replicas, sends its statistics to the
    coordinator (point-to-point), which waits for them (giving up on a rank found gone),
    writes summary.json, and nobody frees a communicator or calls MPI_Finalize (which
    would wait for the dead too: guardian.skip_mpi_finalize)."""
    guardian.skip_mpi_finalize()
    topology = role.plan.topology
    root = topology.coordinator_rank
    if not isinstance(role, Coordinator):
        if not getattr(role, "lost", False):
            comm.send(role.stats(), dest=root, tag=TAG_STATS)
        return {"stop_reason": "diverged" if role.diverged else None}
    lost = set(role._lost_ranks())
    waiting = {r for r in range(topology.world_size) if r != root and r not in lost}
    all_stats = [role.stats()]
    status, backoff = MPI.Status(), poll_backoff()
    gone_since: dict[int, float] = {}
    with watchdog.current().waiting("the other ranks' final statistics"):
        while waiting:
            if comm.Iprobe(MPI.ANY_SOURCE, TAG_STATS, status):
                source = status.Get_source()
                all_stats.append(comm.recv(source=source, tag=TAG_STATS))
                waiting.discard(source)
                backoff.reset()
                continue
            # A rank sends its statistics and ends: give up on one only once it has been
            # gone for a while, so a message still on its way is not missed.
            now = time.monotonic()
            for rank in role.peers.gone_among(sorted(waiting)):
                if now - gone_since.setdefault(rank, now) > STATS_GRACE_S:
                    waiting.discard(rank)
            backoff.wait()
    return role.write_summary(all_stats)
