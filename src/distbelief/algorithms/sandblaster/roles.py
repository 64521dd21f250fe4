"""Sandblaster L-BFGS (Dean et al., NIPS 2012): a coordinator drives batch L-BFGS while
the vectors stay on the parameter-server shards and model replicas compute the batch
gradient in small work units. This module sets each rank's role up (`start`), runs it
(`train`) and ends the roles together (`finish`).

    mpiexec -n N python -m distbelief train CONFIG     # [optimizer] algorithm = "sandblaster"

The design (roles, communication, the order of a trial, checkpoints, lost replicas,
stopping) is docs/sandblaster.md, "Design". The package's modules, each importing only
those before it: plan (tags, back-off, SandblasterPlan, pieces and segments, unit owners
and blocks, BatchRows), unit_rows (UnitRows: a replica's rows), shards (ShardServer),
replica (Replica), coordinator (Coordinator, the summary), roles.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from mpi4py import MPI

from distbelief.algorithms.common import TrainingDiverged
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
from distbelief.algorithms.sandblaster.unit_rows import UnitRows
from distbelief.algorithms.sandblaster.vector_shard import VectorShard
from distbelief.algorithms.session import RunSession, RunSetup
from distbelief.config import Config
from distbelief.model.partitioned_network import PartitionedNetwork
from distbelief.records import checkpoint as ckpt
from distbelief.runtime import memory
from distbelief.runtime.communicators.agreement import agree, polled_bcast, wait_for_everyone
from distbelief.runtime.communicators.topology import Communicators, split_communicators
from distbelief.runtime.health import watchdog
from distbelief.runtime.launching import guardian
from distbelief.runtime.launching.faults import Faults
from distbelief.runtime.threads import set_blas_threads

# What the command line and the tests use from here (the roles' modules hold the rest).
__all__ = ["ANSWER_SLOTS", "BatchRows", "Coordinator", "Replica", "ShardServer",
           "decode_answer", "encode_answer", "finish", "shard_segments", "start", "train"]

# ------------------------------------------------------------------------------------------
# Entry point


def train(config: Config, comm: MPI.Comm, stream: IO[str] | None = sys.stdout,
          resume: str = "auto", setup: RunSetup | None = None) -> dict[str, Any] | None:
    """Run Sandblaster L-BFGS on the ranks of `comm`; returns the summary on the
    coordinator, None elsewhere.

    Collective over `comm`: every rank calls it with the same configuration. Validation
    first (no communication), then a set-up whose UserError is raised on every rank, then
    point-to-point traffic (docs/sandblaster.md, "Design"), then a back-off barrier and a
    gather. Raises TrainingDiverged on every rank if the loss became non-finite. `resume`:
    distbelief.algorithms.common.RESUME_MODES ("auto", "require", "fresh").
    """
    role = start(config, comm, stream, resume, setup=setup)
    # Every rank catches SIGTERM/SIGUSR1 (the launcher forwards them to all): only the
    # coordinator acts on it, at the end of the iteration, with a checkpoint and the usual
    # collective stop; the other ranks must simply not die of it. A lost shard or
    # coordinator ends the job (a lost replica is written off: docs/sandblaster.md, "Lost
    # replicas").
    with role.session.watched(role.plan.topology.describe_rank) as (signals, peers):
        role.peers, role.signals = peers, signals
        role.run()
        summary = finish(comm, role)
    if summary["stop_reason"] == "diverged":
        raise TrainingDiverged("training diverged: the loss became non-finite")
    return summary if isinstance(role, Coordinator) else None


def start(config: Config, comm: MPI.Comm, stream: IO[str] | None = sys.stdout,
          resume: str = "auto", splits: list[list[int]] | None = None,
          setup: RunSetup | None = None) -> Any:
    """Validate, set up and build this rank's role (ShardServer, Coordinator or Replica).
    Collective over `comm` (the session's agreed choice of the checkpoint to resume
    from, broadcast from the coordinator; two set-up agreements around
    topology.split_communicators); call `role.run()` and `finish` next.
    `splits`: with partitions, per layer the P+1 block boundaries (None: balanced, what
    the command line uses; tests pass unequal ones)."""
    session = RunSession("sandblaster", config, comm, stream, resume, setup=setup)
    info, network = session.info, session.network
    plan = plan_run(config, comm.Get_size(), comm.Get_rank(), info.n_train,
                    network.layout.size, info.held_out)
    pieces = all_pieces(network, plan.partitions, splits)  # pure: the same error everywhere
    set_blas_threads(config.run.threads or 1)
    topology = plan.topology
    session.reporting_rank = topology.coordinator_rank
    path = session.choose_checkpoint()
    # With partitions, partition 0 reads the replica's rows and broadcasts them below.
    # A spare (cluster.spare_replicas) reads nothing until it takes a lost replica over;
    # with partitions, partition 0 reads the replica's rows and broadcasts them below.
    local = agree(comm, lambda: _replica_rows(session, plan, topology.replica_index,
                                              topology.partition_index == 0)
                  if topology.is_replica and not topology.is_spare else None)
    communicators = split_communicators(comm, topology)
    role: Any
    if topology.is_shard:
        role = agree(comm, lambda: _shard(config, comm, plan, network, path, pieces,
                                          session.faults))
    else:
        agree(comm, lambda: None)
        if topology.role == "coordinator":
            role = Coordinator(comm, config, plan, network, info, stream, session.found,
                               faults=session.faults)
        elif plan.partitions == 1:
            role = Replica(comm, config, plan, network, local, session.load_eval_set,
                           pieces=pieces[0],
                           rows_for=lambda part: _replica_rows(session, plan, part, True),
                           faults=session.faults)
        else:
            team = communicators.partition
            model = PartitionedNetwork(network, team, splits)
            partners = [r for r in topology.replica_ranks(topology.replica_index)
                        if r != topology.world_rank]

            def share(rows: UnitRows) -> UnitRows:
                """Partition 0's rows to the others (collective over the team, polled)."""
                for array in (rows.x, rows.y):
                    polled_bcast(team, array, "partition 0's training rows", partners)
                return rows

            if local is not None:
                share(local)
            role = Replica(comm, config, plan, model, local, session.load_eval_set,
                           pieces=model.pieces, team=team,
                           rows_for=lambda part: share(_replica_rows(
                               session, plan, part, topology.partition_index == 0)),
                           faults=session.faults)
    role.communicators, role.session = communicators, session
    return role


def _replica_rows(session: RunSession, plan: SandblasterPlan, replica: int,
                  read: bool) -> UnitRows:
    """The training rows of training replica `replica` (a spare's: the one it took over):
    its own block, read now (`read`; else left to fill); other replicas' units' rows when
    it is given them. Local."""
    blocks = plan.blocks
    batches = BatchRows(plan.n_train, plan.batch_size, session.config.run.seed, blocks)
    return UnitRows(session.info, batches, blocks[replica], read)


def _shard(config: Config, comm: MPI.Comm, plan: SandblasterPlan, network: Any,
           checkpoint: str | None, pieces: list[list[Piece]], faults: Faults) -> ShardServer:
    """A shard's server, with its slice of the initial parameters or of the checkpoint.
    Local (reads the checkpoint's overlapping parts)."""
    index = plan.topology.world_rank
    start_, stop_ = network.layout.shard_ranges(plan.topology.ps_shards)[index]
    store = VectorShard(network.init_slice(config.run.seed, start_, stop_), start_,
                        plan.options.m)
    if checkpoint is not None:
        # The ranks verified its parts together when it was chosen (latest_checkpoint):
        # the manifest is checked here, not every byte again.
        params, state = ckpt.verify(checkpoint, parts=()).read_range(start_, stop_)
        store.load_checkpoint(params, state)
    return ShardServer(comm, plan, store, pieces, faults=faults)


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
        if getattr(role, "lost", False):
            memory.written_off()  # nor its peak memory: nobody waits for it
        else:
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
