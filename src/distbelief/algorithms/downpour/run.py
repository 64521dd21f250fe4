"""Setting a Downpour run up on every rank (open_run, collective): the local set-up, the
checkpoint to start from and each rank's piece of it (Start), the parameter server and the
communicators, held by OpenRun, which every role runs on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.common import StopSignals
from distbelief.algorithms.downpour.plan import SWEEP_S, DownpourPlan, plan_run
from distbelief.algorithms.session import RunSession
from distbelief.config import Config, build_optimizer, run_name
from distbelief.errors import ConfigError
from distbelief.model.layout import balanced_ranges
from distbelief.ps import run_control as rc
from distbelief.ps.endpoint import (
    GIVE_UP_S,
    TRANSPORT_ENV,
    ParameterClient,
    ParameterServerShard,
    ServerSpec,
)
from distbelief.ps.transport import open_parameter_server, requested_transport
from distbelief.records import checkpoint as ckpt
from distbelief.records.console import say
from distbelief.runtime.communicators.agreement import agree
from distbelief.runtime.communicators.topology import Communicators, split_communicators
from distbelief.runtime.health import watchdog
from distbelief.runtime.health.liveness import Peers
from distbelief.runtime.health.watchdog import abort_job
from distbelief.runtime.launching import guardian


@dataclass
class LostShard:
    """A shard lost where a standby took its slice over (cluster.standby_shards): its
    rank, how it went, and when it was found gone (time.time())."""

    rank: int
    why: str
    at: float
    found: float  # time.monotonic() then (a launcher's SIGUSR1 may be the notice of it)
    regroup_seconds: float | None = None  # shard 0: from `found` to serving without it


@dataclass
class OpenRun:
    """A rank's run once set up: its plan, its local data (a replica's TrainShard; rank 0's
    (eval set, chosen checkpoint)), where it starts, its parameter-server endpoint
    (restored from the checkpoint if there is one), its communicators, every rank's
    identity (liveness) and the channel for the replicas' final statistics."""

    plan: DownpourPlan
    local: Any
    start: Start
    endpoint: ParameterServerShard | ParameterClient
    communicators: Communicators
    peers: Peers
    messages: MPI.Comm
    signals: StopSignals
    world: MPI.Comm
    session: RunSession
    _next_shard_check: float = 0.0
    _usr1_checked: int = 0
    lost_shards: list[LostShard] = field(default_factory=list)  # cluster.standby_shards

    def check_shards(self, now: float, force: bool = False) -> None:
        """Abort the job if a shard is gone (on this node its process, on another its
        heartbeat: distbelief.runtime.health.liveness): looked at every SWEEP_S, at once
        after a new SIGUSR1 (hydra's notice of a death), or when `force`d. With
        cluster.standby_shards a lost shard other than 0 is recorded in `lost_shards`
        instead (its slice lives on in shared memory; the shards regroup and shard 0
        adopts it: shards.ShardRole) and nobody waits for it any more. Local."""
        usr1 = self.signals.counts["SIGUSR1"]
        if not force and now < self._next_shard_check and usr1 == self._usr1_checked:
            return
        self._next_shard_check, self._usr1_checked = now + SWEEP_S, usr1
        known = {lost.rank for lost in self.lost_shards}
        for rank in self.peers.gone_among(self.plan.topology.shard_ranks):
            if rank not in known:
                self.shard_lost(rank, f"is gone{self.peers.how_gone(rank)}")

    def shard_lost(self, rank: int, how: str) -> None:
        """Shard `rank` is gone: abort the job, unless a standby takes its slice over
        (check_shards). Local."""
        if rank == 0 or not self.session.config.cluster.standby_shards:
            abort_job(self.world, shard_lost_message(rank, how))
        if rank not in {lost.rank for lost in self.lost_shards}:
            self.lost_shards.append(LostShard(rank, how, time.time(), time.monotonic()))
            if not self.plan.topology.is_shard:
                # A shard writes it off once it has regrouped without it (ShardRole): until
                # then a wait on the shards' communicator must still raise for it.
                watchdog.current().write_off([rank])

    def close(self, teardown: int) -> None:
        """TEARDOWN_FREE: collective over the world communicator (the parameter server,
        then the other communicators). TEARDOWN_LEAVE: nothing is freed (a rank is dead:
        any collective would wait for it) and the process will end without MPI_Finalize,
        which would wait for the dead rank too (guardian.skip_mpi_finalize)."""
        if teardown != rc.TEARDOWN_FREE or self.lost_shards:
            # (a shard this rank found lost after the run's end was decided: written off,
            # nobody would wait for it any more, and the free would wait for ever)
            guardian.skip_mpi_finalize()  # MPI_Finalize would wait for the dead
            return
        self.endpoint.free()
        self.messages.Free()
        self.communicators.free()


def open_run(config: Config, comm: MPI.Comm, resume: str, stream: IO[str] | None,
             signals: StopSignals, peers: Peers | None = None,
             shard_update: Callable[[int], Any] | None = None,
             session: RunSession | None = None) -> OpenRun:
    """Set up a Downpour run on every rank of `comm` (train's first half; tests use it to
    look at a resumed run's starting state).

    Collective over `comm`: validates without communicating, then rank 0's choice of
    checkpoint and a bcast of its path (RunSession.choose_checkpoint), the local set-up
    (agreed: any rank's UserError is raised on every rank), each rank's read of its
    piece (agreed), an
    allgather of every rank's identity, open_parameter_server with the restored slices
    and optimizer state and the run control block, the role communicators, and a
    Comm.Dup for the final statistics. `shard_update(size)` makes a shard's update rule
    (None: the configured optimizer, shard_optimizer). `session`: the run's RunSession
    (None: one is opened here).
    """
    if shard_update is None:
        shard_update = lambda size: shard_optimizer(config, size)
    if session is None:
        session = RunSession(run_name(config), config, comm, stream, resume)
    info, network = session.info, session.network
    plan = plan_run(config, comm.Get_size(), comm.Get_rank(), info.n_train, info.held_out)
    topology = plan.topology
    # Before config.json is rewritten: a refused resume leaves the run folder as it was.
    path = session.choose_checkpoint()
    chosen = session.found
    local = agree(comm, lambda: _local_setup(session, plan))
    start = agree(comm, lambda: _read_start(config, plan, network, info, local, path, chosen,
                                             stream, shard_update))
    if peers is None:
        peers = Peers.gather(comm)
    initial = shard_initial(network, config.run.seed, plan, start) if topology.is_shard else None
    endpoint = _open_server(config, comm, ServerSpec(
        topology, network.layout.size,
        lambda n: start.optimizer if start.optimizer is not None else shard_update(n),
        initial, control_replicas=plan.num_groups,
        gradients_before=start.gradients_before, pieces=plan.row_pulls,
        push_dtype=config.optimizer.push_dtype, push_slots=session.faults.push_slots()))
    start.params = None  # the shard's slice lives in the endpoint now, not twice
    if isinstance(endpoint, ParameterServerShard):
        # A replica killed mid-push is written off as soon as its process is seen gone; a
        # live one is waited for as long as a live rank may go without a heartbeat.
        endpoint.watch_clients(peers.gone, max(GIVE_UP_S, config.run.heartbeat_timeout_seconds),
                               ended=peers.ended)
    # The shards' communicator (rounds, checkpoints) and each replica's partitions'.
    communicators = split_communicators(comm, topology)
    local = _share_partition_rows(config, plan, info, local, start, communicators.partition)
    messages = comm.Dup()
    return OpenRun(plan, local, start, endpoint, communicators, peers, messages, signals,
                   comm, session)


def _open_server(config: Config, comm: MPI.Comm,
                 spec: ServerSpec) -> ParameterServerShard | ParameterClient:
    """open_parameter_server; with cluster.standby_shards the shared-memory transport
    only, where a lost shard's segment outlives it (ConfigError on every rank where it
    cannot open). Collective over `comm`."""
    if not config.cluster.standby_shards:
        return open_parameter_server(comm, spec)
    why = ("cluster.standby_shards = true needs the shared-memory parameter server (every "
           "rank on one node), where a lost shard's slice outlives it; across nodes an RMA "
           "operation in flight to a dead shard never returns (docs/checkpoints-and-"
           "reliability.md, \"A standby for a lost shard\")")
    if requested_transport() == "rma":
        raise ConfigError(f"{why}; here {TRANSPORT_ENV}=rma asks for RMA")
    try:
        return open_parameter_server(comm, spec, "shared")
    except ConfigError as exc:  # "... was requested (...) but WHY": the reason alone
        raise ConfigError(f"{why}; here {str(exc).partition(' but ')[2] or exc}") from None


def shard_initial(network: Any, seed: int, plan: DownpourPlan, start: Start) -> np.ndarray:
    """A shard's initial slice, and only its slice, ever: the checkpoint's on a resume
    (_read_start read just that range), else built alone (Network.init_slice: the values
    init_params would give it), never the whole vector (6.8 GB at 1.7B parameters). Local."""
    if start.params is not None:
        return start.params
    topology = plan.topology
    a, b = balanced_ranges(network.layout.size, topology.ps_shards)[topology.shard_index]
    return network.init_slice(seed, a, b)


def _local_setup(session: RunSession, plan: DownpourPlan) -> Any:
    """What this rank needs before training: a replica its part of the training set; rank 0
    the evaluation set and the checkpoint it chose. Local."""
    topology = plan.topology
    if topology.is_spare:
        return None  # a spare opens a part when it takes one over (downpour.spares)
    if _rows_from_lead(session.config, topology):
        return None  # _share_partition_rows: partition 0 reads the replica's rows
    if topology.is_replica:
        return session.train_shard(topology.replica_index, plan.num_replicas)
    if topology.world_rank == 0:
        return session.load_eval_set(), session.found
    return None


def _rows_from_lead(config: Config, topology: Any) -> bool:
    """Whether this rank takes its replica's training rows from its partition 0 instead
    of the file: a partition other than 0 of a replica split over P > 1 ranks, with the
    data in memory (streamed, each partition reads its own windows)."""
    return (topology.is_replica and topology.partitions > 1
            and topology.partition_index > 0 and config.data.in_memory)


def _share_partition_rows(config: Config, plan: DownpourPlan, info: Any, local: Any,
                          start: Start, partition: MPI.Comm) -> Any:
    """A replica split over P partitions reads its block of rows from the file once:
    partition 0 read it (_local_setup) and restored its position from the checkpoint;
    it broadcasts the rows, the position and the local steps, and the others build the
    same TrainShard from them (every partition needs every row's x and y: the input
    layer is not split, the softmax's classes are). Returns this rank's training data.
    Collective over the replica's partition communicator; other ranks return `local`."""
    topology = plan.topology
    if not (topology.is_replica and topology.partitions > 1 and config.data.in_memory) \
            or topology.is_spare:
        return local
    from distbelief.data.hdf5 import TrainShard, shard_range
    from distbelief.runtime.communicators.agreement import polled_bcast

    index, seed = topology.replica_index, config.run.seed
    if local is not None:  # partition 0
        x, y = local.stored_rows
        state = local.state()
        meta = np.array([state["epoch"], state["position"], start.local_steps], np.int64)
    else:
        lo, hi = shard_range(info, index, plan.num_replicas, seed)
        x = np.empty((hi - lo, *info.input_shape), dtype=info.stored_dtype)
        y, meta = np.empty(hi - lo, dtype=np.int32), np.empty(3, dtype=np.int64)
    for array in (meta, x, y):
        polled_bcast(partition, array, "partition 0's training rows")
    if local is not None:
        return local
    shard = TrainShard(info, index, plan.num_replicas, seed, rows=(x, y))
    shard.load_state({**shard.state(), "epoch": int(meta[0]), "position": int(meta[1])})
    start.local_steps = int(meta[2])
    return shard


@dataclass
class Start:
    """Where one rank starts: the checkpoint (None for a fresh run) and its piece of it."""

    checkpoint: ckpt.Checkpoint | None = None
    shard_range: tuple[int, int] = (0, 0)
    params: np.ndarray | None = None  # a shard's slice
    optimizer: Any = None  # a shard's optimizer with its state loaded
    local_steps: int = 0  # a replica's steps before (decides its fetch schedule)
    gradients_before: int = 0  # a shard's: gradients its slice applied (the schedule's count)

    @property
    def base(self) -> int:
        """Global steps before this job."""
        return self.checkpoint.step if self.checkpoint is not None else 0


def _read_start(config: Config, plan: DownpourPlan, network: Any, info: Any, local: Any,
                path: str | None, chosen: ckpt.Checkpoint | None,
                stream: IO[str] | None,
                shard_update: Callable[[int], Any]) -> Start:
    """Read this rank's piece of the checkpoint at `path` (rank 0 verified all of it).
    Local; CheckpointError if the piece cannot be used."""
    if path is None:
        return Start()
    found = chosen if chosen is not None else ckpt.Checkpoint(Path(path),
                                                              ckpt.read_manifest(path))
    start = Start(found)
    topology = plan.topology
    try:
        if topology.is_shard:
            start.shard_range = balanced_ranges(network.layout.size,
                                                topology.ps_shards)[topology.shard_index]
            start.params, state = found.read_range(*start.shard_range)
            start.optimizer = shard_update(start.params.size)
            start.optimizer.load_state(state)
            start.gradients_before = _gradients_before(found, *start.shard_range)
        elif topology.is_replica and local is not None:  # else its lead's (below)
            _restore_replica(found, plan, local, info, start)
    except (ValueError, TypeError) as exc:
        raise ckpt.CheckpointError(f"checkpoint {found.path} cannot be resumed here: "
                                   f"{exc}") from exc
    saved = found.num_replicas
    if topology.world_rank == 0 and saved != plan.num_replicas:
        say(stream, f"distbelief: the checkpoint was written by {saved} replica(s), this "
                       f"run has {plan.num_replicas}: each replica starts a fresh pass over "
                       f"its part of the training set")
    if topology.world_rank == 0 and saved == plan.num_replicas \
            and found.manifest.get("lost_replicas"):
        lost = ", ".join(str(r) for r in found.manifest["lost_replicas"])
        say(stream, f"distbelief: replica(s) {lost} had been lost when the checkpoint was "
                       f"written: they start a fresh pass over their part of the training set")
    return start


def _restore_replica(found: ckpt.Checkpoint, plan: DownpourPlan, data: Any, info: Any,
                     start: Start) -> None:
    """The data position and local step count of this replica: exact when the checkpoint
    has as many replicas and holds this one's part; otherwise the parts of the data are
    new (or this replica had been lost), and it starts a pass that no earlier epoch used
    (the number of passes over the whole set so far)."""
    index = plan.topology.replica_index
    if found.num_replicas == plan.num_replicas and found.has_replica(index):
        saved = found.read_replica(index)
        data.load_state(saved.data_state)
        start.local_steps = saved.counters.get("local_steps", 0)
    else:
        data.load_state({**data.state(), "epoch": 1 + found.samples // info.n_train,
                         "position": 0})


def _gradients_before(found: ckpt.Checkpoint, start: int, stop: int) -> int:
    """The gradients a shard's slice [start, stop) had applied when `found` was written:
    its part's count, exact when the shard count is the checkpoint's; on another shard
    count, the largest count of the parts it overlaps (their counts differ only by the
    pushes that touched some shards and not others). A checkpoint from before the count
    was kept has none: 0 (its configuration had no schedule, so nothing depends on it)."""
    counts = [c.get("gradients_applied", 0) for c in found.shard_counters(start, stop)]
    return max(counts, default=0)


def shard_optimizer(config: Config, size: int) -> Any:
    """The configured update rule for a shard of `size` parameters (optimizer.update), on
    the configured learning-rate schedule (stepped with the shard's gradient count), its
    rate scaled by each push's staleness as optimizer.staleness_scaling says."""
    rule = build_optimizer(config, size)
    rule.staleness_scaling = config.optimizer.staleness_scaling
    return rule


def shard_lost_message(shard: int, how: str) -> str:
    return (f"parameter-server shard {shard} (world rank {shard}) {how}: its slice of the "
            f"parameters cannot be recovered without it, so the job stops. Run the same "
            f"command again to resume from the last checkpoint")

