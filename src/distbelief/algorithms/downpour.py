"""Downpour SGD (Dean et al., NIPS 2012): asynchronous model replicas around a sharded
parameter server, over MPI one-sided communication. A replica that dies does not stop
the others.

    mpiexec -n N python -m distbelief train CONFIG      # [optimizer] algorithm = "downpour"

ROLES (distbelief.runtime.topology): world ranks 0..S-1 are parameter-server shards
(`[cluster] ps_shards = S`), the others are replicas 0..R-1 (each of P ranks with model
parallelism). Every rank validates the rank count and the data against the configuration
before it communicates, so a bad configuration ends the job with exit 2 on every rank.

REPLICAS train on disjoint parts of the training set (`TrainShard(info, replica, R,
seed)`, each with its own shuffling stream). A replica fetches the parameters before
every `n_fetch`-th step and pushes the sum of its gradients after every `n_push`-th step;
when both fall together it uses `push_pull`, one round of lock traffic. A fetch returns
parameters that contain the replica's own earlier pushes (read-your-writes:
`ParameterClient.catch_up`), which is the order in which DistBelief's server answers a
replica and makes one replica exactly sequential SGD; the staleness of a push then counts
only other replicas' updates (without it one replica ends 0.4-3 points lower at equal
steps: `fetch_own_pushes=False`, kept for experiments). A replica never waits for
another.

RUN CONTROL (distbelief.ps.run_control). After the set-up a replica takes part in no
collective: a collective that includes a dead rank never completes. Everything it must
agree on rides on the pushes it makes anyway, through the run control block on shard 0:
each push claims its next `n_push` steps from the global step counter (atomic, so
max_steps counts TOTAL steps across replicas exactly), reports the steps it finished and
their loss sum, publishes its heartbeat and the signals it received, and reads shard 0's
commands: stop, pause for a checkpoint, lost, and at the end the teardown. With
`warm_start_steps = W`, replicas other than 0 poll the block (1 to 20 ms sleeps) and
start once replica 0 has reported W steps.

SHARDS serve (ParameterServerShard.serve: poll, fold, sleep between polls) and, between
polls, take part in rounds among themselves (distbelief.runtime.agreement.Rounds over the
shards' communicator: the shards' signals, rank 0's checkpoint and end flags). Shards
cannot be lost without losing parameters, so their collectives are safe.

SHARD 0 (Supervisor) also runs the run, between polls: it reads the control block (every
CONTROL_POLL_S at most), writes training lines and progress, evaluates snapshots of the
global parameters in a thread (replicas never stall for it), applies the stop rules
(max_seconds, target_accuracy, a non-finite training loss, a replica giving up on
non-finite gradients, a signal), asks for checkpoints, and watches the replicas.

LOST REPLICAS. Shard 0 sweeps every SWEEP_S (and at once when a SIGUSR1 is reported):
a replica whose process on this node is gone (distbelief.runtime.liveness; any of its P ranks),
or whose heartbeat has not moved for `run.replica_timeout_seconds` (ranks on other
nodes), is declared lost: LOST is set in its slots (a replica that was only stalled
stops when it reads it), the summary records it, checkpoints give it no part (a resume
starts it on a fresh pass), and the run goes on without it: the steps it was granted and
had not pushed (at most n_push) are not trained. Whether the other ranks live on is the
launcher's choice: MPICH's hydra keeps them with `-disable-auto-cleanup`
(docs/checkpoints-and-reliability.md says what each launcher does). A lost SHARD ends the
job: every rank checks the shards' processes (shards each other, replicas when they sweep)
and the first to find one gone aborts the job with a message; rerunning resumes from the
last checkpoint.

SIGNALS. SIGTERM and SIGUSR1 (SLURM's time limit, `sbatch --signal=B:USR1@N`) are counted
on the ranks they reach (common.StopSignals): replicas publish their counts in the
block, shards in their rounds. Shard 0 stops the run (STOP_SIGNAL): replicas stop after
their current block, the run ends with its final checkpoint and no final evaluation,
every rank exits 0. Hydra with `-disable-auto-cleanup` also sends SIGUSR1 (several) to
every rank when a rank dies; shard 0 tells the two apart by sweeping first: a SIGUSR1
reported within NOTICE_WINDOW_S of finding a rank gone is the launcher's notice, any other
is a stop request (so a real one that lands in that window is missed, and a rank on
another node dying is not seen by the sweep: its notice stops the run, cleanly).

CHECKPOINTS (distbelief.records.checkpoint's format; `run.checkpoint_every_seconds`,
`checkpoint_every_steps`, `keep_checkpoints`) are global consistency points:
  1. shard 0 adds 1 to CHECKPOINT (request k);
  2. each replica reads it with its next push (all its computed steps are pushed then),
     publishes its data position and local step count with ACKED = k, and pauses,
     polling the block with sleeps;
  3. once every replica has acked k, finished, or been lost, shard 0 raises the flag in
     the next shards' round and the shards, together: fold what is pending, shard 0 names
     ckpt-<step> (bcast), each shard writes its slice and shard 0 every replica's part
     from the published positions (gather), shard 0 commits (bcast of the outcome);
  4. shard 0 adds 1 to RELEASE: the replicas go on.
The pause is about one block of the slowest replica plus the writes. A step-based
checkpoint lands at the first round after its multiple. A shard holding non-finite values
writes nothing and the run stops as diverged; a write that fails stops the run with that
error on every rank (exit 2).

NON-FINITE GRADIENTS. A replica checks every step's loss and gradient (one dot product)
and drops a non-finite gradient instead of pushing it (counted); after
`run.max_bad_gradients_in_a_row` of them it publishes GAVE_UP and stops; shard 0 stops the
run, whose final checkpoint holds the last, finite, state, and every rank raises
BadGradients (exit 2).

END OF THE RUN. A replica stops when a claim grants it nothing (max_steps used up), or
when it reads STOP or LOST. It publishes FINISHED with its final data position (its last
push is in), sends its statistics to rank 0 (point-to-point), and polls the block until
TEARDOWN. Shard 0, once every replica has finished or been lost, ends the shards' serving
with a round; then the shards, together: fold the rest, gather statistics and the final
slices, shard 0 evaluates the final parameters, the final checkpoint, summary.json;
TEARDOWN is FREE when no rank was lost (every rank then frees the windows together) and
LEAVE otherwise (no rank frees: a collective would wait for the dead; shard 0 waits until
the live replicas have read it, so none is left waiting on its windows).

METRICS: rank 0 owns the run folder (config.json, metrics.jsonl, summary.json;
distbelief.records.metrics.RunRecorder, the contract of the single-process trainer; `step` and
`samples` are totals over all replicas). summary.json adds per-replica steps, samples/s,
pushes, fetches, RMA time and staleness (mean, max, histogram), per-shard statistics,
the combined staleness and `lost_replicas`.

Threads: each rank uses 1 BLAS thread unless `[run] threads` says otherwise (ranks
oversubscribe small machines; more threads per rank only fight over the cores).
"""

from __future__ import annotations

import math
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.common import (
    RESUME_MODES,
    StopRules,
    StopSignals,
    TrainingDiverged,
    evaluate,
    load_eval_set,
    open_data,
    prepare_run_dir,
    starting_checkpoint,
)
from distbelief.algorithms.partitioned_sgd import polled_bcast
from distbelief.config import Config, config_hash, hashed_settings
from distbelief.errors import DataError, UserError
from distbelief.model.layout import balanced_ranges
from distbelief.model.optimizers import make_optimizer
from distbelief.model.partitioned_network import PartitionedNetwork, wait_all
from distbelief.ps import run_control as rc
from distbelief.ps.parameter_server import (
    STALENESS_BINS,
    ParameterClient,
    ParameterServerShard,
    StalenessStats,
)
from distbelief.ps.run_control import ControlExchange, ControlView
from distbelief.ps.transport import open_parameter_server
from distbelief.records import checkpoint as ckpt
from distbelief.records.metrics import LOG_EVERY_SECONDS, ResumePoint, RunRecorder
from distbelief.runtime import guardian, watchdog
from distbelief.runtime.agreement import (
    WAIT_SLEEP_S,
    Rounds,
    agree,
    bcast_after_barrier,
    gather_after_barrier,
    wait_for_everyone,
)
from distbelief.runtime.backoff import Backoff, PacedBackoff
from distbelief.runtime.faults import Faults
from distbelief.runtime.liveness import Peers
from distbelief.runtime.threads import set_blas_threads
from distbelief.runtime.topology import Communicators, Topology, split_communicators
from distbelief.runtime.watchdog import RankLost, abort_job

WARM_START_POLL_S = (1e-3, 20e-3)
"""Back-off bounds of replicas polling shard 0 while they wait for the warm start: slow,
since each poll is an RMA epoch that shard 0 has to serve."""

PAUSE_POLL_S = (0.2e-3, 5e-3)
"""Back-off bounds of a replica paused for a checkpoint or waiting for the teardown."""

ROUND_INTERVAL_S = 5e-3
"""Shortest time between two shards' rounds: the latency of a checkpoint once every
replica has paused, and of the end of the run."""

CONTROL_POLL_S = 2e-3
"""Shard 0 reads the run control block at most this often (more often while replicas are
paused for a checkpoint)."""

SWEEP_S = 0.25
"""How often shard 0 looks for lost replicas and shards, and the other ranks for lost
shards (distbelief.runtime.liveness: a /proc read per rank)."""

NOTICE_SLACK_S = 1.0
"""A rank's new SIGUSR1 is the launcher's notice of a death (hydra sends several per
death, within milliseconds) if shard 0 found a rank gone between that rank's previous
report, less this slack, and the decision; otherwise it is a stop request."""

NOTICE_DELAY_S = 0.5
"""How long a new SIGUSR1 waits for a rank to be found gone before it counts as a stop
request (a launcher signals while the dead process is still being torn down)."""

LEAVE_GRACE_S = 30.0
"""With TEARDOWN_LEAVE, how long shard 0 waits for ranks it cannot see (on other nodes) to
say they leave before it leaves itself (over RMA they need its progress to read it)."""

STATS_TAG = 7
"""Tag of a replica's statistics message to rank 0 at its end."""

# The int64 flags of a shards' round, combined with MAX over the shards.
ROUND_TERM, ROUND_USR1, ROUND_CHECKPOINT, ROUND_FINISHED = range(4)
ROUND_WIDTH = 4


class BadGradients(TrainingDiverged):
    """A replica computed run.max_bad_gradients_in_a_row non-finite gradients in a row:
    the run diverged (every replica), or its data holds NaN/inf (one replica)."""


class RunFailed(UserError):
    """The run stopped because of an error reported on another rank (its message is
    printed by rank 0)."""


# ------------------------------------------------------------------------------------------
# The plan: pure validation, the same on every rank, before any communication


@dataclass(frozen=True)
class DownpourPlan:
    """A validated Downpour run for one rank: its role and the run's cadences."""

    topology: Topology
    batch_size: int
    n_fetch: int
    n_push: int
    warm_start_steps: int
    max_steps: int
    max_bad_gradients: int = 10
    replica_timeout_s: float = 0.0

    @property
    def num_replicas(self) -> int:
        return self.topology.num_replicas


def plan_run(config: Config, world_size: int, world_rank: int, n_train: int) -> DownpourPlan:
    """Check that the job fits the configuration and the data; pure (no communication),
    so every rank raises the same ConfigError/DataError before the first collective."""
    cluster, opt = config.cluster, config.optimizer
    topology = Topology(world_size, world_rank, cluster.ps_shards, cluster.partitions)
    smallest = n_train // topology.num_replicas  # balanced_ranges: sizes differ by <= 1
    if config.data.batch_size > smallest:
        raise DataError(f"data.batch_size = {config.data.batch_size} is larger than the "
                        f"{smallest} training rows each of the {topology.num_replicas} "
                        f"replicas gets ({n_train} rows in {config.data.path}); use a "
                        f"smaller batch or fewer replicas")
    return DownpourPlan(topology, config.data.batch_size, opt.n_fetch, opt.n_push,
                        opt.warm_start_steps, config.run.max_steps,
                        config.run.max_bad_gradients_in_a_row,
                        config.run.replica_timeout_seconds)


def grant(claimed_before: int, want: int, max_steps: int) -> int:
    """Steps a claim of `want` receives when `claimed_before` were claimed before it (the
    result of the atomic fetch-and-add): all of them, or what is left of max_steps (0 =
    no limit). The grants of all claims add up to exactly min(claims, max_steps)."""
    if not max_steps:
        return want
    return max(0, min(want, max_steps - claimed_before))


# ------------------------------------------------------------------------------------------
# Entry point


def train(config: Config, comm: MPI.Comm, stream: IO[str] | None = sys.stdout,
          fetch_own_pushes: bool = True, resume: str = "auto") -> dict[str, Any] | None:
    """Run Downpour SGD on the ranks of `comm`; returns the run summary on rank 0, None
    on the other ranks.

    `fetch_own_pushes` (True, what the command line uses): a replica's fetch returns
    parameters that contain every gradient it pushed before (read-your-writes), so one
    replica is exactly sequential SGD; False is for experiments (every gradient at least
    one update stale). `resume` is one of common.RESUME_MODES ("auto": continue from a
    checkpoint in out_dir if there is one; "require"; "fresh").

    Collective over `comm` for the set-up: every rank calls it with the same
    configuration. It validates the rank count and data first, without communicating
    (ConfigError/DataError on every rank), then sets up and picks the checkpoint to resume
    from (any rank's UserError there is raised on every rank), opens the parameter
    server. Then replicas communicate one-sidedly only, shards among themselves (module
    docstring), and at the end every rank frees the windows together unless a rank was
    lost. Rank 0 writes the run folder and prints to `stream`; raises TrainingDiverged,
    BadGradients or CheckpointError (RunFailed off the shards) on every live rank when
    the run failed.
    """
    if resume not in RESUME_MODES:
        raise ValueError(f"resume must be one of {RESUME_MODES}, got {resume!r}")
    info, network = open_data(config)
    # Validated before the handlers go in: a bad configuration fails at once.
    topology = plan_run(config, comm.Get_size(), comm.Get_rank(), info.n_train).topology
    set_blas_threads(config.run.threads or 1)
    # Handlers first: a signal that arrives during the set-up is counted and acted on
    # once training runs, instead of killing the rank (SIGUSR1's default action).
    with StopSignals() as signals:
        peers = Peers.gather(comm)  # collective: the first, so the set-up is watched too
        guard = watchdog.Watchdog(
            topology.world_rank, topology.describe_rank, config.run.stall_warn_seconds,
            config.run.stall_abort_seconds, lambda message: abort_job(comm, message),
            peers.gone)
        others = [r for r in range(topology.world_size) if r != topology.world_rank]
        with watchdog.watching(guard):
            try:
                with guard.waiting("the other ranks to set the run up", others):
                    run = open_run(config, comm, resume, stream, signals, info, network,
                                   peers)
                with np.errstate(over="ignore", invalid="ignore"):
                    role = _make_role(run, config, network, info, stream, fetch_own_pushes)
                    role.run()
                    ending = role.finish()
                run.close(ending.teardown)
            except RankLost as lost:
                _abort_for(comm, topology, lost)
    ending.raise_error(config)
    return ending.summary


def _abort_for(world: MPI.Comm, topology: Topology, lost: RankLost) -> None:
    """A rank this one waited for is gone where nothing can go on without it: a shard, or
    any rank during the set-up or once the run is ending. Abort the job with a message."""
    if lost.rank < topology.ps_shards:
        abort_job(world, shard_lost_message(lost.rank, "is gone"))
    watchdog.abort_for(world, topology.describe_rank, lost)


@dataclass
class Ending:
    """How the run ended, as one rank knows it."""

    stop: int  # a run_control STOP_* code (0: ended on max_steps)
    stop_arg: int = 0
    teardown: int = rc.TEARDOWN_FREE
    failure: str | None = None  # a checkpoint error (the shards know its text)
    summary: dict[str, Any] | None = None  # rank 0

    def raise_error(self, config: Config) -> None:
        """The run's error, the same kind on every rank (rank 0 prints it)."""
        lr = config.optimizer.learning_rate
        if self.stop == rc.STOP_BAD_GRADIENTS:
            limit = config.run.max_bad_gradients_in_a_row
            raise BadGradients(
                f"training diverged or the data holds NaN/inf: replica {self.stop_arg - 1} "
                f"computed {limit} non-finite gradients in a row "
                f"(run.max_bad_gradients_in_a_row = {limit}), so the run stopped; they were "
                f"dropped, never pushed, so the parameters and checkpoints are finite. "
                f"Lower optimizer.learning_rate (now {lr:g}) or check the data")
        if self.stop == rc.STOP_DIVERGED:
            raise TrainingDiverged(f"training diverged: the training loss became non-finite; "
                                   f"lower optimizer.learning_rate (now {lr:g})")
        if self.stop == rc.STOP_CHECKPOINT_FAILED:
            if self.failure is not None:
                raise ckpt.CheckpointError(self.failure)
            raise RunFailed("the run stopped: a checkpoint could not be written")
        if self.stop == rc.STOP_ALL_LOST:
            raise RunFailed("every replica was lost, so the run stopped (its last state is "
                            "checkpointed); run the same command again to resume")


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
    _next_shard_check: float = 0.0
    _usr1_checked: int = 0

    def check_shards(self, now: float, force: bool = False) -> None:
        """Abort the job if a shard on this node is gone: looked at every SWEEP_S, at once
        after a new SIGUSR1 (hydra's notice of a death), or when `force`d. Local."""
        usr1 = self.signals.counts["SIGUSR1"]
        if not force and now < self._next_shard_check and usr1 == self._usr1_checked:
            return
        self._next_shard_check, self._usr1_checked = now + SWEEP_S, usr1
        gone = self.peers.gone_among(self.plan.topology.shard_ranks)
        if gone:
            abort_job(self.world, shard_lost_message(gone[0], "is gone"))

    def close(self, teardown: int) -> None:
        """TEARDOWN_FREE: collective over the world communicator (the parameter server,
        then the other communicators). TEARDOWN_LEAVE: nothing is freed (a rank is dead:
        any collective would wait for it) and the process will end without MPI_Finalize,
        which would wait for the dead rank too (guardian.skip_mpi_finalize)."""
        if teardown != rc.TEARDOWN_FREE:
            guardian.skip_mpi_finalize()  # MPI_Finalize would wait for the dead
            return
        self.endpoint.free()
        self.messages.Free()
        self.communicators.free()


def open_run(config: Config, comm: MPI.Comm, resume: str, stream: IO[str] | None,
             signals: StopSignals, info: Any = None, network: Any = None,
             peers: Peers | None = None) -> OpenRun:
    """Set up a Downpour run on every rank of `comm` (train's first half; tests use it to
    look at a resumed run's starting state).

    Collective over `comm`: validates without communicating, then the local set-up and
    rank 0's choice of checkpoint (agreed: any rank's UserError is raised on every rank),
    a bcast of the checkpoint's path, each rank's read of its piece (agreed), an
    allgather of every rank's identity, open_parameter_server with the restored slices
    and optimizer state and the run control block, the role communicators, and a
    Comm.Dup for the final statistics.
    """
    if info is None or network is None:
        info, network = open_data(config)
    plan = plan_run(config, comm.Get_size(), comm.Get_rank(), info.n_train)
    topology = plan.topology
    local = agree(comm, lambda: _local_setup(config, plan, info, network, resume, stream))
    chosen = local[1] if topology.world_rank == 0 else None
    path = comm.bcast(str(chosen.path) if chosen is not None else None, root=0)
    start = agree(comm, lambda: _read_start(config, plan, network, info, local, path, chosen,
                                             stream))
    if peers is None:
        peers = Peers.gather(comm)
    opt = config.optimizer
    initial = None
    if topology.is_shard:
        initial = network.init_params(config.run.seed)
        if start.params is not None:
            a, b = start.shard_range
            initial[a:b] = start.params
    endpoint = open_parameter_server(
        comm, topology, network.layout.size,
        lambda n: (start.optimizer if start.optimizer is not None
                   else make_optimizer(opt.adagrad, opt.learning_rate, n)),
        initial, control_replicas=plan.num_replicas)
    # The shards' communicator (rounds, checkpoints) and each replica's partitions'.
    communicators = split_communicators(comm, topology)
    messages = comm.Dup()
    return OpenRun(plan, local, start, endpoint, communicators, peers, messages, signals,
                   comm)


def _local_setup(config: Config, plan: DownpourPlan, info: Any, network: Any, resume: str,
                 stream: IO[str] | None) -> Any:
    """What this rank needs before training: a replica its part of the training set; rank 0
    the checkpoint to start from (before config.json is rewritten, so a refused resume
    leaves the run folder as it was), the run folder and the evaluation set. Local."""
    from distbelief.data.hdf5 import TrainShard

    topology = plan.topology
    if topology.is_replica:
        return TrainShard(info, topology.replica_index, plan.num_replicas, config.run.seed)
    if topology.world_rank == 0:
        chosen = starting_checkpoint(config, network.layout, resume, stream)
        prepare_run_dir(config)
        return load_eval_set(config, info), chosen
    return None


@dataclass
class Start:
    """Where one rank starts: the checkpoint (None for a fresh run) and its piece of it."""

    checkpoint: ckpt.Checkpoint | None = None
    shard_range: tuple[int, int] = (0, 0)
    params: np.ndarray | None = None  # a shard's slice
    optimizer: Any = None  # a shard's optimizer with its state loaded
    local_steps: int = 0  # a replica's steps before (decides its fetch schedule)

    @property
    def base(self) -> int:
        """Global steps before this job."""
        return self.checkpoint.step if self.checkpoint is not None else 0


def _read_start(config: Config, plan: DownpourPlan, network: Any, info: Any, local: Any,
                path: str | None, chosen: ckpt.Checkpoint | None,
                stream: IO[str] | None) -> Start:
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
            opt = config.optimizer
            start.optimizer = make_optimizer(opt.adagrad, opt.learning_rate,
                                             start.params.size)
            start.optimizer.load_state(state)
        elif topology.is_replica:
            _restore_replica(found, plan, local, info, start)
    except (ValueError, TypeError) as exc:
        raise ckpt.CheckpointError(f"checkpoint {found.path} cannot be resumed here: "
                                   f"{exc}") from exc
    saved = found.num_replicas
    if topology.world_rank == 0 and saved != plan.num_replicas:
        _print(stream, f"distbelief: the checkpoint was written by {saved} replica(s), this "
                       f"run has {plan.num_replicas}: each replica starts a fresh pass over "
                       f"its part of the training set")
    if topology.world_rank == 0 and saved == plan.num_replicas \
            and found.manifest.get("lost_replicas"):
        lost = ", ".join(str(r) for r in found.manifest["lost_replicas"])
        _print(stream, f"distbelief: replica(s) {lost} had been lost when the checkpoint was "
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


def _make_role(run: OpenRun, config: Config, network: Any, info: Any,
               stream: IO[str] | None, fetch_own_pushes: bool) -> Any:
    topology = run.plan.topology
    if topology.is_replica:  # partitioned when partitions > 1
        return make_replica(run, network, fetch_own_pushes)
    if topology.world_rank == 0:
        return Supervisor(run, config, network, info, stream)
    return _ShardRole(run)


def make_replica(run: Any, network: Any, fetch_own_pushes: bool) -> Any:
    """Downpour's replica role for this rank (`run`: downpour.OpenRun): the plain one when
    partitions = 1, else a PartitionedReplica over the replica's partition communicator
    (topology.split_communicators). Local (no communication)."""
    comm = run.communicators.partition
    if comm == MPI.COMM_NULL or comm.Get_size() == 1:
        return Replica(run, network, fetch_own_pushes)
    return PartitionedReplica(run, network, fetch_own_pushes)


def shard_lost_message(shard: int, how: str) -> str:
    return (f"parameter-server shard {shard} (world rank {shard}) {how}: its slice of the "
            f"parameters cannot be recovered without it, so the job stops. Run the same "
            f"command again to resume from the last checkpoint")


# ------------------------------------------------------------------------------------------
# Replicas


@dataclass
class ReplicaStats:
    """What one replica did. Times are wall seconds; `train_seconds` runs from its first
    claim to its finish (warm-start waiting excluded), `rma_seconds` is the part of it
    spent in pushes and pulls."""

    replica: int
    rank: int
    steps: int = 0
    samples: int = 0
    pushes: int = 0
    fetches: int = 0
    train_seconds: float = 0.0
    rma_seconds: float = 0.0
    wait_seconds: float = 0.0
    refetches: int = 0
    bad_gradients: int = 0
    started_at_step: int = 0
    checkpoint_seconds: float = 0.0
    staleness: StalenessStats = field(default_factory=StalenessStats)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["staleness"] = self.staleness.to_dict()
        out["samples_per_second"] = (self.samples / self.train_seconds
                                     if self.train_seconds > 0 else None)
        return out


# What the lead tells its partitions after each exchange (model parallelism; a replica of
# one rank tells only itself).
GO, PAUSE, STOP, LOST = range(4)


class Replica:
    """One model replica: train on its part of the data, fetch every n_fetch steps, push
    the accumulated gradient every n_push steps, and follow shard 0's commands. All its
    communication is one-sided, with the shards (pull, push, push_pull, exchange), plus
    one message with its statistics to rank 0 at the end; it never waits for another
    replica. With model parallelism its lead partition exchanges with shard 0 and tells
    the others (`_share_values`; PartitionedReplica)."""

    lead = True  # this rank talks to shard 0 for its replica

    def __init__(self, run: OpenRun, network: Any, fetch_own_pushes: bool = True):
        plan, client = run.plan, run.endpoint
        self.run_, self.plan, self.client, self.network = run, plan, client, network
        self.data, self.base = run.local, run.start.base
        self.fetch_own_pushes = fetch_own_pushes
        topology = plan.topology
        self.index = topology.replica_index
        self.stats_ = ReplicaStats(self.index, topology.world_rank, staleness=client.staleness)
        self.params = np.zeros(network.layout.size, dtype=np.float32)
        self.grad = np.zeros_like(self.params)
        # With n_push = 1 the step's gradient is pushed as it is; otherwise summed here.
        self.pushed = self.grad if plan.n_push == 1 else np.zeros_like(self.params)
        self.control = ControlExchange(self.index if self.lead else None)
        self.t = run.start.local_steps  # local steps done (a resumed replica goes on)
        self.fresh = False  # params were fetched at the last push (push_pull)
        self.stopping = False
        self.lost = False
        self.acked = 0  # the last checkpoint request this replica paused for
        self.bad_in_a_row = 0
        self.faults = Faults.for_rank(topology.world_rank)  # test-only (distbelief.runtime.faults)

    # -- the loop

    def run(self) -> None:
        t0 = time.perf_counter()
        start = t0
        try:
            if self.index > 0 and self.plan.warm_start_steps > 0:
                self._wait_for_warm_start()
            start = time.perf_counter()
            self.stats_.wait_seconds = start - t0
            granted = 0 if self.stopping else self._first_claim()
            while granted and not self.stopping:
                granted = self._train_block(granted)
        except RankLost as lost:
            if lost.rank < self.plan.topology.ps_shards:
                raise
            # Another partition of this replica is gone: the replica is lost. The lead
            # says so (shard 0 may be on another node than the dead rank) and goes quiet.
            self.lost = self.stopping = True
            if self.lead:
                self.client.exchange(self.control.publish(abandoned=1).set(claim=0))
        self.stats_.train_seconds = time.perf_counter() - start

    def _wait_for_warm_start(self) -> None:
        """Poll shard 0 (control only, with back-off sleeps) until replica 0 has reported
        warm_start_steps steps, or the run is over already."""
        backoff = Backoff(*WARM_START_POLL_S)
        plan = self.plan
        while not self.stopping:
            over = False
            if self.lead:
                control = self._exchange(self.control.set(claim=0))
                over = bool(plan.max_steps and self.base + control.claimed_before
                            >= plan.max_steps) or control.warm
                over = over or self.base + control.steps_before >= plan.warm_start_steps
            over, _ = self._decide(int(over))
            if over:
                return
            backoff.wait()

    def _first_claim(self) -> int:
        """Claim the first n_push steps and fetch the parameters."""
        t0 = time.perf_counter()
        if self.lead:
            self._exchange(self.control.set(claim=self.plan.n_push))
            self.stats_.started_at_step = self.base + self.control.steps_before
        self.client.pull(self.params)
        self.stats_.rma_seconds += time.perf_counter() - t0
        self.stats_.fetches += 1
        self.fresh = True
        return self._granted_after_exchange()

    def _train_block(self, steps: int) -> int:
        """Compute `steps` granted steps (fetching on schedule), then push them with the
        next claim; returns the steps that claim was granted."""
        plan, loss_sum, done = self.plan, 0.0, 0
        while done < steps and not self.stopping:
            if self.t % plan.n_fetch == 0 and not self.fresh:
                self._pull()
            self.fresh = False
            t0 = time.perf_counter()
            x, y = self.data.next_batch(plan.batch_size)
            loss = self.network.loss_and_grad(self.params, x, y, self.grad)
            self.t += 1
            done += 1
            if self.faults:
                self.faults.poison(self.t, self.grad)
            if self._usable(loss):
                if self.pushed is not self.grad:
                    self.pushed += self.grad
            else:
                self._drop()
            if math.isfinite(loss):
                loss_sum += loss
            if self.faults:
                self.faults.after_step(self.t, time.perf_counter() - t0)
                if self.faults.hang_due(self.t):
                    self.client.hang_in_next_push(self.faults)
        self._push(self.control.set(plan.n_push, done, loss_sum))
        self.stats_.steps += done
        self.stats_.samples += done * plan.batch_size
        return self._granted_after_exchange()

    def _granted_after_exchange(self) -> int:
        """After an exchange: the steps granted, once shard 0's commands are obeyed (0 when
        the replica stops)."""
        granted = 0
        if self.lead:
            granted = grant(self.base + self.control.claimed_before, self.plan.n_push,
                            self.plan.max_steps)
        granted, action = self._decide(granted)
        return granted if action == GO else 0

    def _decide(self, value: int) -> tuple[int, int]:
        """The lead's `value` and its reading of its last exchange, on every partition of
        the replica; pauses for checkpoints (as often as asked) are taken here, together.
        Returns (value, GO, STOP or LOST); STOP and LOST also stop the replica."""
        while True:
            action, arg = self._command() if self.lead else (GO, 0)
            value, action, arg = (int(v) for v in
                                  self._share_values(np.array([value, action, arg])))
            if action != PAUSE:
                break
            self._pause(arg)
        if action in (STOP, LOST):
            self.stopping = True
            self.lost = self.lost or action == LOST
        return value, action

    def _command(self) -> tuple[int, int]:
        """What the lead's last exchange asks of the replica."""
        control = self.control
        if control.lost:
            return LOST, 0
        if control.checkpoint > self.acked:
            return PAUSE, control.checkpoint
        if control.stop or self.stopping:
            return STOP, 0
        return GO, 0

    def _pause(self, request: int) -> None:
        """Checkpoint `request`: publish this replica's position (every step it computed is
        pushed) and wait, polling the block, until shard 0 has written the checkpoint or
        the run stops. Partitions other than the lead wait at their next `_share_values`."""
        self.acked = request
        t0 = time.perf_counter()
        if self.lead:
            control = self._publish_position(acked=request)
            backoff = Backoff(*PAUSE_POLL_S)
            guard = watchdog.current()
            with guard.waiting("shard 0 to write a checkpoint", (0,)):
                while control.release < request and not control.stop and not control.lost:
                    guard.check()
                    backoff.wait()
                    self._exchange(control.set(claim=0))
                    guard.progress()  # shard 0 answers: only the checkpoint takes time
        self.stats_.checkpoint_seconds += time.perf_counter() - t0

    def _publish_position(self, **more: int) -> ControlExchange:
        """Publish the data position and local steps (with `more`), in one exchange."""
        state = self.data.state()
        self.control.publish(epoch=state["epoch"], position=state["position"],
                             local_steps=self.t, **more)
        return self._exchange(self.control.set(claim=0))

    # -- sharing with the other partitions (PartitionedReplica overrides)

    def _share_values(self, values: np.ndarray) -> np.ndarray:
        """The lead's int64 `values` on every partition of the replica."""
        return values

    # -- steps

    def _usable(self, loss: float) -> bool:
        """Whether this step's loss and gradient are finite. One BLAS pass (a dot product
        of the gradient with itself: a NaN or inf anywhere, or an element whose square
        overflows float32, which would make Adagrad's accumulator infinite, gives a
        non-finite result)."""
        if math.isfinite(loss) and math.isfinite(float(np.dot(self.grad, self.grad))):
            self.bad_in_a_row = 0
            return True
        return False

    def _drop(self) -> None:
        """Count a non-finite gradient and keep it out of the push; after
        max_bad_gradients in a row, give up: the next exchange tells shard 0."""
        self.stats_.bad_gradients += 1
        self.bad_in_a_row += 1
        if self.pushed is self.grad:
            self.grad.fill(0)  # n_push = 1: the block pushes nothing
        if self.bad_in_a_row >= self.plan.max_bad_gradients:
            self.stopping = True
            self.control.publish(gave_up=1)

    def _pull(self) -> None:
        t0 = time.perf_counter()
        self.client.pull(self.params)
        self._catch_up()
        self.stats_.rma_seconds += time.perf_counter() - t0
        self.stats_.fetches += 1

    def _catch_up(self) -> None:
        """Read-your-writes (see train's fetch_own_pushes): pull again until the
        parameters hold this replica's last push."""
        if self.fetch_own_pushes:
            self.stats_.refetches += self.client.catch_up(self.params)

    def _push(self, control: ControlExchange) -> None:
        """Push the gradient with the control exchange (the lead's); fetch in the same
        epochs when the next step is due to fetch."""
        t0 = time.perf_counter()
        control = self._before_exchange(control) if self.lead else None
        if self.t % self.plan.n_fetch == 0:
            self.client.push_pull(self.pushed, self.params, control)
            self._catch_up()
            self.stats_.fetches += 1
            self.fresh = True
        else:
            self.client.push(self.pushed, control)
        self.stats_.rma_seconds += time.perf_counter() - t0
        self.stats_.pushes += 1
        if self.pushed is not self.grad:
            self.pushed.fill(0)

    def _exchange(self, control: ControlExchange) -> ControlExchange:
        """A control-only exchange with shard 0 (the lead's)."""
        self.client.exchange(self._before_exchange(control))
        return control

    def _before_exchange(self, control: ControlExchange) -> ControlExchange:
        """Every exchange publishes the signals this rank received; a new SIGUSR1 may be
        a launcher's notice that a rank died, so the shards are looked at first."""
        counts = self.run_.signals.counts
        control.publish(usr1=counts["SIGUSR1"], term=counts["SIGTERM"])
        self.run_.check_shards(time.monotonic())
        return control

    # -- the end

    def finish(self) -> Ending:
        """Publish the end of this replica's work (FINISHED with its final position: its
        last push is in), send its statistics to rank 0, and wait for the teardown.
        A lost replica publishes nothing and sends nothing. One-sided, plus one message."""
        if not self.lost:
            if self.lead:
                self._publish_position(finished=1)
            request = self.run_.messages.isend(self.stats(), dest=0, tag=STATS_TAG)
            backoff = Backoff(*PAUSE_POLL_S)
            guard = watchdog.current()
            with guard.waiting("rank 0 to take this replica's statistics", (0,)):
                while not request.Test():
                    guard.check()
                    backoff.wait()
        teardown, stop, stop_arg = self._wait_for_teardown()
        return Ending(stop, stop_arg, teardown)

    def _wait_for_teardown(self) -> tuple[int, int, int]:
        """Poll the block until shard 0 says how the run ends, then count this rank as
        leaving (LEFT). Every rank of the replica polls on its own, without the
        replica's slots (no heartbeat: a lost replica's stays silent), so a partition
        whose partner died needs no one. Returns (TEARDOWN, STOP, STOP_ARG)."""
        control = ControlExchange(None)
        backoff = Backoff(*PAUSE_POLL_S)
        guard = watchdog.current()
        self.client.exchange(control.set(claim=0))
        with guard.waiting("shard 0 to end the run", (0,)):
            while not control.teardown:
                guard.check()
                backoff.wait()
                self.client.exchange(control.set(claim=0))
                guard.progress()  # shard 0 answers: the run is simply not over yet
        self.client.exchange(control.set(claim=0, leaving=True))
        return control.teardown, control.stop, control.stop_arg

    def stats(self) -> dict[str, Any]:
        return {"role": "replica", **self.stats_.to_dict()}


# ------------------------------------------------------------------------------------------
# Partitioned replicas (model parallelism; partitioned_sgd.py's docstring says how)


class PartitionedReplica(Replica):
    """One partition of a Downpour replica: its own pieces of the parameters, its own
    pushes and pulls; partition 0 (the lead) exchanges with shard 0 for the replica
    (claims, reports, commands, its data position) and shares every decision with the
    others (one Ibcast per block), so all of them pause, stop and end together."""

    def __init__(self, run: Any, network: Any, fetch_own_pushes: bool):
        comm = run.communicators.partition
        self.lead = comm.Get_rank() == 0
        model = PartitionedNetwork(network, comm)
        run.endpoint.restrict_to(model.pieces)
        model.layout = network.layout  # whole-model vectors: Replica sizes them so
        super().__init__(run, model, fetch_own_pushes)
        self.model, self.comm = model, comm
        self._finite = np.zeros(1, dtype=np.int32)

    def _share_values(self, values: np.ndarray) -> np.ndarray:
        values = np.ascontiguousarray(values, dtype=np.int64)
        lead = self.model.partner_ranks[:1] if not self.lead else ()
        return polled_bcast(self.comm, values, "its lead partition's decision", lead)

    def _usable(self, loss: float) -> bool:
        """Downpour's finite-gradient check, agreed by the partitions (Allreduce MIN):
        one partition's pieces may be finite while another's are not, and a partition
        that dropped a step, or stopped after too many, while the others went on
        would leave them waiting for its activations."""
        before = self.bad_in_a_row
        self._finite[0] = super()._usable(loss)
        wait_all([self.comm.Iallreduce(MPI.IN_PLACE, self._finite, op=MPI.MIN)],
                 "the other partitions of this replica", self.model.partner_ranks)
        self.bad_in_a_row = 0 if self._finite[0] else before
        return bool(self._finite[0])

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["partition"] = self.comm.Get_rank()
        out["model_parallel"] = self.model.traffic.per_step()
        return out


# ------------------------------------------------------------------------------------------
# Shards


class _ShardRole:
    """What every shard does: serve, take part in the shards' rounds, write checkpoints
    and end the run together (collectives over the shards' communicator only)."""

    def __init__(self, run: OpenRun):
        self.run_, self.plan, self.shard = run, run.plan, run.endpoint
        self.comm = run.communicators.shards
        self.rounds = Rounds(self.comm, ROUND_WIDTH, ROUND_INTERVAL_S)
        self.signals = run.signals
        self.faults = Faults.for_rank(self.shard.rank)  # test-only (distbelief.runtime.faults)
        self.all_finished = False  # a round said every replica has finished or is lost
        self.checkpoint_seconds = 0.0
        self.failure: str | None = None  # why a checkpoint could not be written
        self.diverged = False  # a shard held non-finite values at a checkpoint

    def run(self) -> None:
        self.shard.serve(PacedBackoff(), between=self._duties,
                         until=lambda: self.all_finished)

    def _duties(self) -> bool:
        """Between two polls: the test-only faults, the shards' liveness, the rounds."""
        if self.faults:
            self.faults.after_updates(self.shard.version)
        self.run_.check_shards(time.monotonic())
        return self._poll_rounds()

    # -- rounds

    def _poll_rounds(self) -> bool:
        """Test the shards' round in flight (post the next one when due) and act on a
        completed one. True when it ran a checkpoint. Collective over the shards in the
        sense of agreement.Rounds."""
        result = self.rounds.poll(self._contribution)
        if result is None:
            return False
        self._on_round(result)
        if result[ROUND_CHECKPOINT]:
            self.checkpoint()
        if result[ROUND_FINISHED]:
            self.all_finished = True
        return bool(result[ROUND_CHECKPOINT])

    def _contribution(self) -> list[int]:
        counts = self.signals.counts
        return [counts["SIGTERM"], counts["SIGUSR1"], 0, 0]

    def _on_round(self, result: np.ndarray) -> None:
        """Shard 0 reads the shards' signals here."""

    # -- checkpoints (CHECKPOINTS in the module docstring)

    def checkpoint(self) -> None:
        """Write a checkpoint of the whole run with the other shards, or nothing when shard
        0 decides there is nothing new. Collective over the shards: a polled barrier
        (serving meanwhile), bcast, gather, bcast."""
        began = time.monotonic()
        comm = self.comm
        wait_for_everyone(comm, serve=self.shard.serve_once)
        self._settle()
        plan = bcast_after_barrier(comm, self._plan_checkpoint())
        outcome: dict[str, Any] = {}
        if plan is not None:
            outcome = plan
            if "meta" in plan:
                meta = ckpt.CheckpointMeta(**plan["meta"])
                reports = gather_after_barrier(comm, self._write_parts(Path(plan["partial"]),
                                                                       meta))
                outcome = bcast_after_barrier(comm, self._commit(meta, reports))
        self.checkpoint_seconds += time.monotonic() - began
        self._after_checkpoint(outcome, time.monotonic() - began)

    def _settle(self) -> None:
        """Every push counted has completed: fold all of it (poll until nothing is left)."""
        while self.shard.serve_once():
            pass

    def _plan_checkpoint(self) -> dict[str, Any] | None:
        """Shard 0: {"partial", "meta"} to write, {"error"}, or None for nothing new."""
        return None

    def _write_parts(self, partial: Path, meta: ckpt.CheckpointMeta) -> dict[str, Any]:
        """Write this shard's part: {"records": [[name, size, sha256], ...]}, {"error": ...}
        or {"diverged": ...}."""
        shard = self.shard
        params, state = shard.parameters(), shard.optimizer.state()
        if not (np.isfinite(params).all() and all(np.isfinite(v).all()
                                                  for v in state.values())):
            return {"diverged": f"shard {shard.rank} holds non-finite values at step "
                                f"{meta.step}; not checkpointed"}
        counters = {"version": shard.version, "pushes": shard.stats.pushes,
                    "folds": shard.stats.folds}
        return _part_report(lambda: [ckpt.write_shard_part(
            partial, meta, shard.rank, shard.start, shard.stop, params, state, counters)])

    def _commit(self, meta: ckpt.CheckpointMeta,
                reports: list[dict[str, Any]] | None) -> dict[str, Any]:
        """Shard 0: commit from every shard's report; the outcome every shard learns."""
        return {}

    def _after_checkpoint(self, outcome: dict[str, Any], seconds: float) -> None:
        if "diverged" in outcome:
            self.diverged = True
        elif "error" in outcome:
            self.failure = outcome["error"]

    # -- the end

    def finish(self) -> Ending:
        """End the run with the other shards: fold the rest, gather statistics and the
        final slices to shard 0 (which evaluates them), the final checkpoint, shard 0's
        summary, and the teardown decision. Collective over the shards."""
        self._settle()
        all_stats = gather_after_barrier(self.comm, self.stats())
        final = self._gather_parameters()
        self._before_final_checkpoint(all_stats, final)
        self.checkpoint()  # the final one (skipped if its step is already checkpointed)
        ending = bcast_after_barrier(self.comm, self._ending())
        ending.failure = ending.failure or self.failure
        self._announce(ending)
        if self.comm.Get_rank() != 0:
            ending.summary = None
        return ending

    def _gather_parameters(self) -> np.ndarray | None:
        """The final parameter vector on shard 0 (None elsewhere). Collective over the
        shards: Gatherv of each shard's slice."""
        shard = self.shard
        counts = [stop - start for start, stop in shard.ranges]
        displs = [start for start, _ in shard.ranges]
        out = np.zeros(shard.size, dtype=np.float32) if self.comm.Get_rank() == 0 else None
        wait_for_everyone(self.comm)
        self.comm.Gatherv([shard.parameters(), MPI.FLOAT],
                          [out, counts, displs, MPI.FLOAT] if out is not None else None,
                          root=0)
        return out

    def _before_final_checkpoint(self, all_stats: list | None, final: np.ndarray | None) -> None:
        """Shard 0: the replicas' statistics and the final evaluation."""

    def _ending(self) -> Ending | None:
        """Shard 0: how the run ended (bcast to the shards)."""
        return None

    def _announce(self, ending: Ending) -> None:
        """Shard 0: TEARDOWN for the replicas."""

    def stats(self) -> dict[str, Any]:
        shard = self.shard
        return {"role": "shard", "rank": shard.rank, "version": shard.version,
                "params": shard.stop - shard.start,
                "checkpoint_seconds": self.checkpoint_seconds, **asdict(shard.stats)}


def _part_report(write: Any) -> dict[str, Any]:
    """Run a part writer; its records, or the CheckpointError's message."""
    try:
        records = write()
    except ckpt.CheckpointError as exc:
        return {"error": str(exc)}
    return {"records": [[r.name, r.size, r.sha256] for r in records]}


@dataclass
class LostReplica:
    """A replica shard 0 declared lost."""

    replica: int
    ranks: list[int]
    why: str
    at_step: int
    at_seconds: float


class Supervisor(_ShardRole):
    """Shard 0: serves its slice like every shard and, between polls, runs the run: the
    control block, training lines, evaluations (in a thread, on snapshots), stop rules,
    progress lines, lost replicas, and the checkpoints (it asks for them, commits them,
    and writes the replicas' parts).

    Communicates one-sided (its own windows; Gets of the other shards' PARAMS for
    snapshots), in the shards' rounds and collectives, and receives the replicas' final
    statistics. Owns the RunRecorder.
    """

    def __init__(self, run: OpenRun, config: Config, network: Any, info: Any,
                 stream: IO[str] | None):
        super().__init__(run)
        self.config, self.network, self.info, self.stream = config, network, info, stream
        eval_set, start = run.local[0], run.start
        self.eval_set = eval_set
        plan = self.plan
        self.rules = StopRules.from_config(config)
        self.reason: str | None = None
        self.stop_code, self.stop_arg = 0, 0
        self.base = start.base
        self.resumed_from = start.checkpoint
        self.steps, self.loss_total, self.loss = self.base, 0.0, math.nan
        self.snapshot = np.zeros(network.layout.size, dtype=np.float32)
        self.pending: tuple[Future, int] | None = None  # evaluation in flight, its step
        self.evaluations, self.eval_seconds = 0, 0.0
        # The run control block, as last read, and what shard 0 knows of each replica.
        self.view: ControlView | None = None
        replicas = plan.num_replicas
        self.beats = np.zeros(replicas, dtype=np.int64)
        self.beat_times = np.full(replicas, time.monotonic())
        self.lost: dict[int, LostReplica] = {}
        self.lost_mask = np.zeros(replicas, dtype=bool)  # the same, for whole-array tests
        self.dead_ranks: set[int] = set()
        self.death_times: list[float] = []  # when sweeps found ranks newly gone
        # SIGUSR1 counts by source (replica index, or "shards": their max in the rounds):
        # (count, when it was last seen); and new ones waiting for their meaning.
        self.usr1_seen: dict[Any, tuple[int, float]] = {}
        self.usr1_pending: list[tuple[float, float]] = []  # (previous report, first seen)
        self.warm_released = False
        self.replica_stats: dict[int, dict[str, Any]] = {}
        self.requests = 0  # checkpoint requests made (the CHECKPOINT slot)
        self.awaiting = False  # a request is out: its checkpoint has not been written
        self.ready = False  # every replica has paused for it (or finished, or is lost)
        self.logged_steps = -1
        self.logged_loss_total = 0.0  # loss_total at the last training line
        self._next_control = 0.0
        self._next_sweep = time.monotonic() + SWEEP_S
        self._shard_signals = (0, 0)  # max SIGTERM, SIGUSR1 counts of the shards
        self._terms_seen = 0
        run_config = config.run
        self.root = ckpt.checkpoint_root(run_config.out_dir)
        self.every_seconds, self.every_steps = (run_config.checkpoint_every_seconds,
                                                run_config.checkpoint_every_steps)
        self.last_checkpoint_step = self.base if start.checkpoint is not None else None
        self.last_checkpoint: str | None = None
        self.checkpoints = 0
        _print(stream, _header(config, plan, network, info, len(eval_set[1])))
        resume = None
        if start.checkpoint is not None:
            found = start.checkpoint
            resume = ResumePoint(found.step, found.samples, found.wall_seconds,
                                 found.path.name)
        # The clock starts once every rank is ready (open_parameter_server's barrier).
        self.recorder = RunRecorder(run_config.out_dir, run_config.progress_every_seconds,
                                    stream, target_accuracy=run_config.target_accuracy,
                                    resume=resume)
        now = time.monotonic()
        self.next_log = now + LOG_EVERY_SECONDS
        self.next_eval = now + run_config.eval_every_seconds
        self._schedule_checkpoint(now)

    def run(self) -> None:
        with ThreadPoolExecutor(1, thread_name_prefix="distbelief-eval") as self.executor:
            super().run()
            if self.pending is not None:
                self._record_eval(*self.pending)
        self._read_control(time.monotonic())
        self._log_training()  # every replica has finished: the totals are final
        if self.reason is None:
            self.reason = "max_steps"

    def _duties(self) -> bool:
        """Shard 0's duties between two polls; cheap unless one of them is due."""
        if self.faults:
            self.faults.after_updates(self.shard.version)
        now = time.monotonic()
        busy = self._collect_stats()
        if self.pending is not None and self.pending[0].done():
            self._record_eval(*self.pending)
            busy = True
        if (now >= self._next_control or (self.awaiting and not self.ready)
                or self.usr1_pending):
            self._read_control(now)
        if now >= self._next_sweep:
            self._sweep(now)
        if now >= self.next_log:
            self._log_training()
            self.next_log = now + LOG_EVERY_SECONDS
        if self.reason is None:
            self._apply_budget(now)
        if self.reason is None and self.pending is None and now >= self.next_eval:
            self._start_eval()
            busy = True
        if not self.awaiting and self._checkpoint_due(now):
            self.requests += 1
            self.shard.add_run_control(rc.CHECKPOINT, 1)
            self.awaiting, self.ready = True, False
        self.recorder.progress(self.steps, self.steps * self.plan.batch_size, self.loss)
        return self._poll_rounds() or busy

    # -- the run control block

    def _read_control(self, now: float) -> None:
        """Read the block: steps and loss, heartbeats, signals, replicas giving up, the
        pause for a checkpoint, the end."""
        self._next_control = now + CONTROL_POLL_S
        view = self.view = self.shard.read_run_control()
        steps = self.base + view.steps
        if steps > self.steps:
            self.steps, self.loss_total = steps, view.loss_sum
        rows = view.replicas
        moved = rows[:, rc.BEAT] != self.beats
        self.beats[moved] = rows[moved, rc.BEAT]
        self.beat_times[moved] = now
        term = max(int(rows[:, rc.TERM].max(initial=0)), self._shard_signals[0])
        usr1 = {r: int(count) for r, count in enumerate(rows[:, rc.USR1])}
        usr1["shards"] = self._shard_signals[1]
        self._on_signals(term, usr1, now)
        for replica in np.flatnonzero(rows[:, rc.GAVE_UP]):
            if int(replica) not in self.lost:
                self._stop(rc.STOP_BAD_GRADIENTS, "bad_gradients", int(replica) + 1)
        for replica in np.flatnonzero(rows[:, rc.ABANDONED]):
            if int(replica) not in self.lost:
                self._lose(int(replica), list(self.plan.topology.replica_ranks(replica)),
                           "one of its partitions found another gone")
        if self.plan.warm_start_steps and not self.warm_released and (
                0 in self.lost or rows[0, rc.FINISHED]):
            # The others wait for replica 0's warm-start steps, which will never come.
            self.shard.add_run_control(rc.WARM, 1)
            self.warm_released = True
        if self.awaiting and not self.ready:
            self.ready = bool(np.all(self.lost_mask | (rows[:, rc.ACKED] >= self.requests)
                                     | (rows[:, rc.FINISHED] > 0)))

    def _replicas_done(self) -> bool:
        if self.view is None:
            return False
        return bool(np.all(self.lost_mask | (self.view.replicas[:, rc.FINISHED] > 0)))

    def _contribution(self) -> list[int]:
        counts = self.signals.counts
        finished = not self.awaiting and self._replicas_done()
        return [counts["SIGTERM"], counts["SIGUSR1"], int(self.awaiting and self.ready),
                int(finished)]

    def _on_round(self, result: np.ndarray) -> None:
        self._shard_signals = (int(result[ROUND_TERM]), int(result[ROUND_USR1]))

    def _on_signals(self, term: int, usr1: dict[Any, int], now: float) -> None:
        """Stop on a SIGTERM; on a SIGUSR1 unless it is the launcher's notice of a death:
        a source's new SIGUSR1 is a notice if a rank was found gone since that source's
        previous report (see SIGNALS in the module docstring)."""
        if self.all_finished:
            return  # the run is ending: ranks leaving make hydra send SIGUSR1s
        if term > self._terms_seen:
            self._terms_seen = term
            self._stop(rc.STOP_SIGNAL, "SIGTERM")
        for source, count in usr1.items():
            seen, when = self.usr1_seen.get(source, (0, -math.inf))
            if count > seen:
                self.usr1_pending.append((when, now))
            self.usr1_seen[source] = (count, now)
        if not self.usr1_pending:
            return
        self._sweep(now)
        waiting = []
        for previous, first in self.usr1_pending:
            if any(previous - NOTICE_SLACK_S <= t for t in self.death_times):
                if not self.stop_code:
                    _print(self.stream, "distbelief: SIGUSR1 taken as the launcher's notice "
                                        "of the rank(s) found gone; training goes on")
            elif now - first >= NOTICE_DELAY_S:
                self._stop(rc.STOP_SIGNAL, "SIGUSR1")
            else:
                waiting.append((previous, first))
        self.usr1_pending = waiting

    # -- liveness

    def _sweep(self, now: float, shards: bool = True) -> None:
        """Look for gone shards (fatal; not once the shards have ended the run together and
        may leave) and lost replicas (process gone on this node, or heartbeat stopped for
        run.replica_timeout_seconds)."""
        self._next_sweep = now + SWEEP_S
        topology, peers = self.plan.topology, self.run_.peers
        if shards:
            self.run_.check_shards(now, force=True)
        timeout = self.plan.replica_timeout_s
        rows = self.view.replicas if self.view is not None else None
        for replica in range(self.plan.num_replicas):
            ranks = list(topology.replica_ranks(replica))
            gone = peers.gone_among(ranks)
            if set(gone) - self.dead_ranks:
                self.death_times.append(now)
            self.dead_ranks.update(gone)
            if replica in self.lost:
                continue
            if gone:
                self._lose(replica, ranks, f"the process of rank {gone[0]} is gone")
            elif (timeout and rows is not None and not rows[replica, rc.FINISHED]
                  and now - self.beat_times[replica] > timeout):
                self._lose(replica, ranks, f"no news from it for {timeout:g} s "
                                           f"(run.replica_timeout_seconds)")

    def _lose(self, replica: int, ranks: list[int], why: str) -> None:
        self.lost_mask[replica] = True
        self.lost[replica] = LostReplica(replica, ranks, why, self.steps,
                                         self.recorder.elapsed())
        self.shard.add_run_control(rc.replica_slot(replica, rc.LOST), 1)
        left = self.plan.num_replicas - len(self.lost)
        _print(self.stream, f"distbelief: replica {replica} (rank{'s' * (len(ranks) > 1)} "
                            f"{', '.join(map(str, ranks))}) lost at step {self.steps}: {why}; "
                            f"training goes on with {left} replica(s)")
        self.recorder.log_event("replica_lost", self.steps, self.steps * self.plan.batch_size,
                                replica=replica, ranks=ranks, why=why)
        if left == 0:
            self._stop(rc.STOP_ALL_LOST, "replicas_lost")

    def _collect_stats(self) -> bool:
        """Receive the replicas' final statistics as they come (point-to-point)."""
        got = False
        messages = self.run_.messages
        status = MPI.Status()
        while messages.Iprobe(MPI.ANY_SOURCE, STATS_TAG, status):
            source = status.Get_source()
            self.replica_stats[source] = messages.recv(source=source, tag=STATS_TAG)
            got = True
        return got

    # -- training lines, stops, evaluations

    def _log_training(self) -> None:
        """A training line, if steps were reported since the last one. Its loss is the mean
        over every step since the previous line (LOG_EVERY_SECONDS apart), as the other
        trainers log it, so the curves of different algorithms compare."""
        if self.steps == self.logged_steps or self.steps == self.base:
            return
        since = max(self.logged_steps, self.base)
        self.loss = (self.loss_total - self.logged_loss_total) / (self.steps - since)
        self.logged_steps, self.logged_loss_total = self.steps, self.loss_total
        self.recorder.log(self.steps, self.steps * self.plan.batch_size, self.loss,
                          version=self.shard.version)
        if not math.isfinite(self.loss) and self.reason is None:
            self._stop(rc.STOP_DIVERGED, "diverged")

    def _apply_budget(self, now: float) -> None:
        reason = self.rules.budget_spent(self.steps, now - self.recorder.start)
        if reason:
            self._stop(rc.STOP_RULE, reason)

    def _stop(self, code: int, reason: str, arg: int = 0) -> None:
        """Stop the run: the first reason counts, except that an error (divergence, bad
        gradients, a failed checkpoint) overrides a budget or a signal."""
        errors = (rc.STOP_BAD_GRADIENTS, rc.STOP_DIVERGED, rc.STOP_CHECKPOINT_FAILED)
        if self.stop_code and (self.stop_code in errors or code not in errors):
            return
        self.shard.add_run_control(rc.STOP, code - self.stop_code)
        self.shard.add_run_control(rc.STOP_ARG, arg - self.stop_arg)
        self.stop_code, self.stop_arg, self.reason = code, arg, reason

    def _start_eval(self) -> None:
        """Snapshot the global parameters (one-sided Gets from the other shards) and
        evaluate them in the thread, while this thread goes on polling."""
        self.shard.snapshot(self.snapshot)
        future = self.executor.submit(self._timed_eval, self.snapshot)
        self.pending = (future, self.steps)

    def _timed_eval(self, params: np.ndarray) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        with np.errstate(over="ignore", invalid="ignore"):  # per thread: not train()'s
            loss, accuracy = evaluate(self.network, params, self.eval_set)
        return loss, accuracy, time.perf_counter() - t0

    def _record_eval(self, future: Future, steps: int) -> None:
        test_loss, accuracy, seconds = future.result()  # re-raises the thread's exception
        self.pending = None
        self.evaluations += 1
        self.eval_seconds += seconds
        self.recorder.log_eval(steps, steps * self.plan.batch_size, self.loss, accuracy,
                               test_loss)
        if self.reason is None and self.rules.target_reached(accuracy):
            self._stop(rc.STOP_RULE, "target_accuracy")
        self.next_eval = time.monotonic() + self.config.run.eval_every_seconds

    # -- checkpoints: when, the parts of the replicas, the commit

    def _schedule_checkpoint(self, now: float) -> None:
        """The next periodic checkpoint: `every_seconds` from now, and the next multiple
        of `every_steps` (also after a resume from another step); inf when off."""
        self.next_checkpoint_time = now + self.every_seconds if self.every_seconds \
            else math.inf
        self.next_checkpoint_step = ((self.steps // self.every_steps + 1) * self.every_steps
                                     if self.every_steps else math.inf)

    def _checkpoint_due(self, now: float) -> bool:
        if self.stop_code or self._replicas_done():
            return False  # the checkpoint at the end follows
        return now >= self.next_checkpoint_time or self.steps >= self.next_checkpoint_step

    def _plan_checkpoint(self) -> dict[str, Any] | None:
        # Every push is folded: the totals are those of the checkpoint. Logged now, so
        # that no line up to its step is later than the checkpoint's time.
        self._read_control(time.monotonic())
        self._log_training()
        if self.stop_code == rc.STOP_DIVERGED or self.failure is not None \
                or self.steps == self.last_checkpoint_step:
            return None
        meta = ckpt.CheckpointMeta(self.steps, self.steps * self.plan.batch_size,
                                   self.recorder.elapsed(), config_hash(self.config))
        try:
            partial = ckpt.prepare(self.root, meta.step)
        except ckpt.CheckpointError as exc:
            return {"error": str(exc)}
        return {"partial": str(partial), "meta": asdict(meta)}

    def _write_parts(self, partial: Path, meta: ckpt.CheckpointMeta) -> dict[str, Any]:
        """Shard 0's slice and every replica's part (from the positions they published
        when they paused or finished; lost replicas have none)."""
        mine = super()._write_parts(partial, meta)
        if "records" not in mine:
            return mine
        replicas = _part_report(lambda: [
            ckpt.write_replica_part(partial, meta, r, state, counters={"local_steps": steps})
            for r, (state, steps) in self._replica_positions().items()])
        if "records" not in replicas:
            return replicas
        return {"records": mine["records"] + replicas["records"]}

    def _replica_positions(self) -> dict[int, tuple[dict[str, int], int]]:
        """Replica index -> (TrainShard.state(), local steps) as published, for every
        replica that is not lost."""
        rows = self.view.replicas
        replicas = self.plan.num_replicas
        ranges = balanced_ranges(self.info.n_train, replicas)
        positions = {}
        for r in range(replicas):
            if r in self.lost:
                continue
            row = rows[r]
            state = {"seed": self.config.run.seed, "rank": r, "num_ranks": replicas,
                     "n": ranges[r][1] - ranges[r][0], "epoch": int(row[rc.EPOCH]),
                     "position": int(row[rc.POSITION])}
            positions[r] = (state, int(row[rc.LOCAL_STEPS]))
        return positions

    def _commit(self, meta: ckpt.CheckpointMeta,
                reports: list[dict[str, Any]] | None) -> dict[str, Any]:
        for kind in ("diverged", "error"):
            problems = [r[kind] for r in reports if kind in r]
            if problems:
                return {kind: problems[0]}  # the .partial is cleaned at the next start
        records = [ckpt.PartRecord(*rec) for r in reports for rec in r["records"]]
        try:
            path = ckpt.commit(
                self.root, meta, settings=hashed_settings(self.config), algorithm="downpour",
                layout=self.network.layout, shard_ranges=self.shard.ranges,
                optimizer_state=list(self.shard.optimizer.state()), parts=records,
                num_replicas=self.plan.num_replicas, keep=self.config.run.keep_checkpoints,
                lost_replicas=sorted(self.lost))
        except ckpt.CheckpointError as exc:
            return {"error": str(exc)}
        return {"path": str(path), "step": meta.step, "samples": meta.samples,
                "at": meta.wall_seconds}

    def _after_checkpoint(self, outcome: dict[str, Any], seconds: float) -> None:
        super()._after_checkpoint(outcome, seconds)
        if "path" in outcome:
            path = Path(outcome["path"])
            self.checkpoints += 1
            self.last_checkpoint_step, self.last_checkpoint = outcome["step"], str(path)
            # Timed at the state it holds, so that a run resumed from it, which continues
            # from that time, keeps the times in metrics.jsonl increasing.
            self.recorder.log_event("checkpoint", outcome["step"], outcome["samples"],
                                    at=outcome["at"], seconds=seconds, path=path.name)
            _print(self.stream, f"checkpoint {path} ({seconds:.2f}s)")
        elif "diverged" in outcome or "error" in outcome:
            _print(self.stream, f"distbelief: checkpoint not written: "
                                f"{outcome.get('diverged') or outcome.get('error')}")
        if "diverged" in outcome:
            self._stop(rc.STOP_DIVERGED, "diverged")
        elif "error" in outcome:
            self._stop(rc.STOP_CHECKPOINT_FAILED, "checkpoint_failed")
        if self.awaiting:  # the replicas paused for it go on
            self.shard.add_run_control(rc.RELEASE, 1)
            self.awaiting = self.ready = False
        self._schedule_checkpoint(time.monotonic())

    # -- the end

    def _before_final_checkpoint(self, all_stats: list | None, final: np.ndarray | None) -> None:
        self.shard_stats = [s for s in all_stats if s["role"] == "shard"]
        self._wait_for_replica_stats()
        if self.stop_code != rc.STOP_SIGNAL:  # after a signal, stopping promptly matters
            samples = self.steps * self.plan.batch_size
            t0 = time.perf_counter()
            test_loss, accuracy = evaluate(self.network, final, self.eval_set)
            self.evaluations += 1
            self.eval_seconds += time.perf_counter() - t0
            self.recorder.log_eval(self.steps, samples, self.loss, accuracy, test_loss)

    def _wait_for_replica_stats(self) -> None:
        """Every replica that finished sends its statistics; wait for them (sleeping),
        giving up on a replica whose process turns out to be gone."""
        backoff = Backoff(*WAIT_SLEEP_S)
        topology = self.plan.topology
        with watchdog.current().waiting("the replicas' final statistics"):
            while True:
                self._collect_stats()
                missing = [rank for r in range(self.plan.num_replicas) if r not in self.lost
                           for rank in topology.replica_ranks(r)
                           if rank not in self.replica_stats]
                if not missing:
                    return
                self._sweep(time.monotonic())
                backoff.wait()

    def _ending(self) -> Ending:
        teardown = rc.TEARDOWN_LEAVE if self.lost or self.dead_ranks else rc.TEARDOWN_FREE
        summary = self.recorder.finish(_summary_extras(self))
        _print(self.stream, _summary_line(summary, self.config))
        return Ending(self.stop_code, self.stop_arg, teardown, self.failure, summary)

    def _announce(self, ending: Ending) -> None:
        """Tell the other ranks how the run ends. With LEAVE (nobody frees; some rank is
        dead), wait until every client rank has said it leaves, or is found gone, before
        leaving: over RMA their reads need this rank's progress. Ranks it cannot see
        (other nodes) get LEAVE_GRACE_S. Nothing is recorded any more (summary written)."""
        self.shard.add_run_control(rc.TEARDOWN, ending.teardown)
        if ending.teardown == rc.TEARDOWN_FREE:
            return
        topology, peers = self.plan.topology, self.run_.peers
        clients = range(topology.first_replica_rank, topology.world_size)
        dead = len(peers.gone_among(clients))  # before the announce: they never leave
        backoff = Backoff(*WAIT_SLEEP_S)
        deadline = time.monotonic() + LEAVE_GRACE_S
        with watchdog.current().waiting("the other ranks to read the end of the run"):
            # A rank that dies from now on never says it leaves: LEAVE_GRACE_S covers it.
            while (self.shard.read_run_control().left + dead < len(clients)
                   and time.monotonic() < deadline):
                backoff.wait()


# ------------------------------------------------------------------------------------------
# The summary


def _summary_extras(sup: Supervisor) -> dict[str, Any]:
    config, plan = sup.config, sup.plan
    replicas = sorted(sup.replica_stats.values(), key=lambda s: (s["replica"], s["rank"]))
    resumed = sup.resumed_from
    return {
        "algorithm": "downpour", "stop_reason": sup.reason,
        "config_hash": config_hash(config), "num_params": int(sup.network.layout.size),
        "eval_samples": len(sup.eval_set[1]), "world_size": plan.topology.world_size,
        "ps_shards": plan.topology.ps_shards, "num_replicas": plan.num_replicas,
        "n_fetch": plan.n_fetch, "n_push": plan.n_push,
        "warm_start_steps": plan.warm_start_steps, "max_steps": plan.max_steps,
        "evaluations": sup.evaluations, "eval_seconds": sup.eval_seconds,
        "resumed_from": str(resumed.path) if resumed is not None else None,
        "resumed_at_step": sup.base, "checkpoint": sup.last_checkpoint,
        "bad_gradients": sum(r["bad_gradients"] for r in replicas),
        "checkpoints_written": sup.checkpoints, "checkpoint_seconds": sup.checkpoint_seconds,
        "lost_replicas": [asdict(lost) for _, lost in sorted(sup.lost.items())],
        "staleness": _combined_staleness(replicas),
        "replicas": replicas, "shards": sup.shard_stats,
    }


def _combined_staleness(replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """The staleness of every push of every replica, as one distribution."""
    width = max((len(r["staleness"]["histogram"]) for r in replicas), default=0)
    histogram = np.zeros(width, dtype=np.int64)
    for r in replicas:
        h = r["staleness"]["histogram"]
        histogram[: len(h)] += np.asarray(h, dtype=np.int64)
    samples = int(histogram.sum())
    mean = float((histogram * np.arange(width)).sum() / samples) if samples else 0.0
    return {"samples": samples, "mean": mean,
            "max": max((r["staleness"]["max"] for r in replicas), default=0),
            "histogram": [int(c) for c in histogram], "histogram_cap": STALENESS_BINS - 1}


def _header(config: Config, plan: DownpourPlan, network: Any, info: Any,
            eval_samples: int) -> str:
    opt = config.optimizer
    return (f"distbelief: downpour, {network.layout.size:,d} parameters; "
            f"{plan.topology.describe()}; n_fetch {opt.n_fetch}, n_push {opt.n_push}, "
            f"warm start {opt.warm_start_steps} steps, "
            f"{'Adagrad' if opt.adagrad else 'SGD'} lr {opt.learning_rate:g}; data "
            f"{info.path} ({info.n_train} train / {eval_samples} eval samples), out "
            f"{config.run.out_dir}\n{network.describe()}")


def _summary_line(summary: dict[str, Any], config: Config) -> str:
    rates = ", ".join(f"{r['samples_per_second'] or 0:.0f}" for r in summary["replicas"])
    accuracy = summary["final_test_accuracy"]
    shown = "-" if accuracy is None else f"{accuracy:.4f}"  # a signal before any evaluation
    text = (f"distbelief: stopped ({summary['stop_reason']}) after {summary['steps']} steps "
            f"in total, {summary['wall_seconds']:.1f}s; test accuracy {shown}; samples/s "
            f"per replica: {rates}; staleness mean {summary['staleness']['mean']:.2f} max "
            f"{summary['staleness']['max']}")
    if summary["lost_replicas"]:
        text += f"; replicas lost: {', '.join(str(r['replica']) for r in summary['lost_replicas'])}"
    if summary["target_accuracy"] is not None:
        text += (f"; reached {summary['target_accuracy']:g} in "
                 f"{summary['time_to_target']:.1f}s" if summary["reached_target"]
                 else f"; target {summary['target_accuracy']:g} not reached")
    return f"{text}\nresults in {config.run.out_dir}"


def _print(stream: IO[str] | None, text: str) -> None:
    if stream is not None:
        print(text, file=stream, flush=True)
