"""Downpour SGD (Dean et al., NIPS 2012): asynchronous model replicas around a sharded
parameter server, over MPI one-sided communication.

    mpiexec -n N python -m distbelief train CONFIG      # [optimizer] algorithm = "downpour"

ROLES (distbelief.topology): world ranks 0..S-1 are parameter-server shards
(`[cluster] ps_shards = S`), ranks S..N-1 are replicas 0..R-1. Every rank validates the
rank count and the data against the configuration before it communicates, so a bad
configuration ends the job with exit 2 on every rank.

REPLICAS train on disjoint parts of the training set (`TrainShard(info, replica, R,
seed)`, each with its own shuffling stream). A replica fetches the parameters before
every `n_fetch`-th step and pushes the sum of its gradients after every `n_push`-th step;
when both fall together it uses `push_pull`, one round of lock traffic. A fetch returns
parameters that contain the replica's own earlier pushes (read-your-writes: while the
shard has not folded the last push, `ParameterClient.catch_up` pulls again), which is the
order in which DistBelief's server answers a replica and makes one replica exactly
sequential SGD; the staleness of a push then counts only other replicas' updates.
Measured: without it every gradient is at least one update stale, and one replica ends
0.4-3 points below the single-process trainer at equal steps and reaches 88% later
(`fetch_own_pushes=False`, kept for experiments). Every push also carries a
`ControlExchange` with shard 0 (no extra round trip): the replica claims its next
`n_push` steps from the global step counter (Fetch_and_op, so max_steps counts TOTAL
steps across replicas exactly: claims are atomic, a replica computes only the steps it
was granted and pushes every one of them), reports the steps it finished and their loss
sum, and reads the stop flag. A replica never waits for another. With `warm_start_steps =
W`, replica 0 starts alone; the others poll shard 0's finished-step count with back-off
sleeps (1 to 20 ms) and start once it has reached W; steps are reported with pushes, so
they start at replica 0's first push at or after step W, or a poll later.

SHARD 0 serves like every shard (ParameterServerShard.serve: poll, fold with Adagrad or
SGD, sleep between polls paced to the replicas' pushes by `PacedBackoff`) and, between
polls, runs the run. Every LOG_EVERY_SECONDS it reads the control slots and writes a
training line (loss = mean minibatch loss of the steps reported since the last line).
Every eval_every_seconds it takes a snapshot of the global parameters (its own master
copy plus a SHARED-lock Get of every other shard's published slice) and hands it to an
evaluation thread: the test-set pass runs on the otherwise idle part of its core while
the main thread keeps polling, so pushes to shard 0 keep their usual latency during
evaluations. (Not measured against the alternative, evaluating in chunks with a poll
between chunks; but an RMA epoch needs two target polls, so every epoch in flight would
wait up to two chunks.) It decides when the run ends: max_seconds, target_accuracy (at an
evaluation), or a non-finite training loss; then it raises the stop flag.

STOP PROTOCOL. A replica stops when a claim grants it no step (max_steps used up), it
reads the stop flag, or a round says so (a signal, a failed checkpoint, a replica with
too many bad gradients); in every case its last push has carried every gradient and step
it computed. It then calls `finish()`; the shards serve until every replica has finished
and every push is folded, so the final parameters contain all the work. Every rank then
keeps polling the agreement rounds (sleeping in between) until one says that every rank
is done; then, on every rank in the same order: a back-off barrier, one `gather` of each
rank's statistics and one `Gatherv` of the shards' final slices to rank 0, a `bcast` of
the stop reason, rank 0's evaluation of the final parameters (not after a signal), the
final checkpoint, summary.json from rank 0, and every rank frees the parameter server
and returns (exit 0, or the run's error on every rank).

METRICS: rank 0 (shard 0) owns the run folder and writes config.json, metrics.jsonl and
summary.json with distbelief.metrics.RunRecorder, the same contract as the single-process
trainer; `step` and `samples` are totals over all replicas. summary.json adds the
Downpour figures: per-replica steps, samples/s, pushes, fetches, RMA time and staleness
(mean, max, histogram), per-shard server statistics, and the combined staleness.

CHECKPOINTS (distbelief.checkpoint's format; `[run] checkpoint_every_seconds`,
`checkpoint_every_steps`, `keep_checkpoints`). A checkpoint is a global consistency point,
agreed through distbelief.agreement's `Rounds`: every rank polls a round of a non-blocking
allreduce from its own loop (replicas after each push, shards between polls; a new round
every ROUND_INTERVAL_S at most), and rank 0 raises the checkpoint flag in its contribution
once one is due. Every rank sees the same result, then takes the same steps, with the
same collectives in the same order (`_Role.checkpoint`):

  1. polled barrier: a replica arrives right after a push, so every gradient it computed
     has landed and its gradient sum is empty; then it waits, sleeping. Shards keep
     serving while they wait, so pushes in flight complete.
  2. each shard folds what its accumulator holds. Nothing is in flight any more, so no
     push is half-applied; shard 0 reads the global step (steps pushed and now folded)
     and creates ckpt-<step>.partial, or decides there is nothing new to save.
  3. bcast of that decision; each shard writes its slice (parameters, optimizer state,
     version and counters), each replica its data position and local step count.
  4. gather of the part records to rank 0, which commits (manifest, rename; only then
     prunes beyond keep_checkpoints), and bcast of the outcome; training goes on.

No rank spins (every wait sleeps between polls) and none waits on RMA after step 1. The
pause lasts about one block of the slowest replica plus the writes. A step-based
checkpoint lands at the first round after the global step passed the multiple, a few
steps later (its name carries its real step). A shard whose slice is not finite writes
nothing and the run stops as diverged, so a non-finite state is never checkpointed; a
write or commit that fails ends the run with that error on every rank (exit 2). The run
always checkpoints when it ends (the same steps, after the last round).

SIGNALS. SIGTERM and SIGUSR1 (SLURM's time limit, `sbatch --signal=B:USR1@N`) only set a
flag on the ranks they reach (trainer.StopSignals, installed before any communication);
the next round carries it to every rank, which write a checkpoint as above and stop:
replicas push nothing more, the run ends without a final evaluation, every rank exits 0.
Bounded: one round (one block) plus the checkpoint plus the end of the run.

RESUME (`--resume`, `--fresh` and the automatic resume, as for the single-process
trainer). Rank 0 picks the checkpoint (trainer.starting_checkpoint: damaged newer ones
reported and set aside, another model refused) and a bcast names it to every rank, which
reads its piece: a shard its own range, re-sliced from however many shards wrote it; a
replica its data position and local step count when the replica count is unchanged
(otherwise every replica starts a fresh pass over its new part of the data). An error on
any rank is raised on every rank (exit 2). Step counts continue: shard 0's counters
count this job's steps and every rank adds the checkpoint's step (`base`), so max_steps
and max_seconds stay totals; metrics.jsonl continues (RunRecorder's resume).

NON-FINITE GRADIENTS (issue 7). A replica checks every step's loss and gradient (one dot
product of the gradient with itself) and drops a non-finite gradient instead of pushing
it (counted per replica in summary.json; the step still counts, its batch was used), so
the shards never apply a non-finite update. After `[run] max_bad_gradients_in_a_row` such
steps in a row, the replica stops and raises a flag in the next round: every rank stops,
the run ends as usual (its final checkpoint holds the last, finite, state) and every rank
raises BadGradients (exit 2) naming the replica.

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

from distbelief import checkpoint as ckpt
from distbelief.agreement import (
    WAIT_SLEEP_S,
    Rounds,
    agree,
    bcast_after_barrier,
    gather_after_barrier,
    wait_for_everyone,
)
from distbelief.config import Config, config_hash, hashed_settings
from distbelief.errors import DataError
from distbelief.faults import Faults
from distbelief.layout import balanced_ranges
from distbelief.metrics import ResumePoint, RunRecorder
from distbelief.optimizers import make_optimizer
from distbelief.parameter_server import (
    STALENESS_BINS,
    Backoff,
    ControlExchange,
    PacedBackoff,
    ParameterClient,
    ParameterServerShard,
    StalenessStats,
    open_parameter_server,
)
from distbelief.partitioned_training import make_replica
from distbelief.threads import set_blas_threads
from distbelief.topology import Communicators, Topology, split_communicators
from distbelief.trainer import (
    LOG_EVERY_SECONDS,
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

WARM_START_POLL_S = (1e-3, 20e-3)
"""Back-off bounds of replicas polling shard 0 while they wait for the warm start: slow,
since each poll is an RMA epoch that shard 0 has to serve."""

ROUND_INTERVAL_S = 5e-3
"""Shortest time between two agreement rounds: the latency of a checkpoint request or a
signal is this plus one block of the slowest replica; the cost is a Test per poll and one
small allreduce per interval."""

# The int64 flags of an agreement round, combined with MAX over all ranks.
ROUND_SIGNAL, ROUND_CHECKPOINT, ROUND_NOT_DONE, ROUND_BAD_GRADIENTS = range(4)
ROUND_WIDTH = 4
SIGNAL_CODES = {name: code for code, name in enumerate(StopSignals.NAMES, start=1)}
SIGNAL_NAMES = {code: name for name, code in SIGNAL_CODES.items()}


class BadGradients(TrainingDiverged):
    """A replica computed run.max_bad_gradients_in_a_row non-finite gradients in a row:
    the run diverged (every replica), or its data holds NaN/inf (one replica)."""


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
                        config.run.max_bad_gradients_in_a_row)


def grant(claimed_before: int, want: int, max_steps: int) -> int:
    """Steps a claim of `want` receives when `claimed_before` were claimed before it (the
    result of the atomic Fetch_and_op): all of them, or what is left of max_steps (0 =
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
    parameters that contain every gradient it pushed before (read-your-writes; the
    DistBelief server answers a replica's fetch after applying its earlier push), so one
    replica is exactly sequential SGD. False: a fetch takes what the shards have
    published, usually without the push made in the same epoch, so every gradient is at
    least one update stale: with one replica ~20% more steps/s, but 0.4-3 points lower
    test accuracy at equal steps and a later 88% (benchmarks/RMA_NOTES.md section 6).
    For experiments and benchmarks. `resume` is one of trainer.RESUME_MODES ("auto":
    continue from a checkpoint in out_dir if there is one; "require"; "fresh").

    Collective over `comm`: every rank calls it with the same configuration. It validates
    the rank count and data first, without communicating (ConfigError/DataError on every
    rank), then sets up and picks the checkpoint to resume from (any rank's UserError
    there is raised on every rank), opens the parameter server (collective), trains
    (one-sided, plus the agreement rounds), and ends with collectives in one fixed order
    (see the module docstring). Rank 0 writes the run folder and prints to `stream`;
    raises TrainingDiverged on every rank if the loss became non-finite, CheckpointError
    on every rank if a checkpoint could not be written.
    """
    if resume not in RESUME_MODES:
        raise ValueError(f"resume must be one of {RESUME_MODES}, got {resume!r}")
    info, network = open_data(config)
    # Validated before the handlers go in: a bad configuration fails at once.
    plan_run(config, comm.Get_size(), comm.Get_rank(), info.n_train)
    set_blas_threads(config.run.threads or 1)
    # Handlers first: a signal that arrives during the set-up is acted on at the first
    # round instead of killing the rank (SIGUSR1's default action).
    with StopSignals() as signals:
        run = open_run(config, comm, resume, stream, signals, info, network)
        endpoint, plan, start = run.endpoint, run.plan, run.start
        with np.errstate(over="ignore", invalid="ignore"):
            if isinstance(endpoint, ParameterClient):  # partitioned when partitions > 1
                role: _Role = make_replica(plan, endpoint, network, run.local, run.sync,
                                           start, fetch_own_pushes,
                                           run.communicators.partition)
            elif plan.topology.world_rank == 0:
                role = Supervisor(config, plan, endpoint, network, run.local[0], info, stream,
                                  run.sync, start)
            else:
                role = _PlainShard(endpoint, run.sync)
            role.run()
            summary = _finish(comm, plan, endpoint, role)
        run.free()
    if role.failure is not None:
        raise ckpt.CheckpointError(role.failure)
    if role.bad_gradients_from is not None:
        limit = plan.max_bad_gradients
        raise BadGradients(
            f"training diverged or the data holds NaN/inf: replica {role.bad_gradients_from} "
            f"computed {limit} non-finite gradients in a row (run.max_bad_gradients_in_a_row "
            f"= {limit}), so the run stopped; they were dropped, never pushed, so the "
            f"parameters and checkpoints are finite. Lower optimizer.learning_rate (now "
            f"{config.optimizer.learning_rate:g}) or check the data")
    if summary["stop_reason"] == "diverged":
        raise TrainingDiverged(f"training diverged: the training loss became "
                               f"non-finite; lower optimizer.learning_rate "
                               f"(now {config.optimizer.learning_rate:g})")
    return summary if plan.topology.world_rank == 0 else None


@dataclass
class OpenRun:
    """A rank's run once set up: its plan, its local data (a replica's TrainShard; rank 0's
    (eval set, chosen checkpoint)), where it starts, its share in the rounds, and its
    parameter-server endpoint, restored from the checkpoint if there is one."""

    plan: DownpourPlan
    local: Any
    start: Start
    sync: _Sync
    endpoint: ParameterServerShard | ParameterClient
    communicators: Communicators

    def free(self) -> None:
        """Collective over the world communicator: the parameter server, then the rounds'
        communicator, then the role communicators."""
        self.endpoint.free()
        self.sync.free()
        self.communicators.free()


def open_run(config: Config, comm: MPI.Comm, resume: str, stream: IO[str] | None,
             signals: StopSignals, info: Any = None, network: Any = None) -> OpenRun:
    """Set up a Downpour run on every rank of `comm` (train's first half; tests use it to
    look at a resumed run's starting state).

    Collective over `comm`: validates without communicating, then the local set-up and
    rank 0's choice of checkpoint (agreed: any rank's UserError is raised on every rank),
    a bcast of the checkpoint's path, each rank's read of its piece (agreed), Comm.Dup for
    the rounds, and open_parameter_server with the restored slices and optimizer state.
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
    opt = config.optimizer
    initial = None
    if topology.is_shard:
        initial = network.init_params(config.run.seed)
        if start.params is not None:
            a, b = start.shard_range
            initial[a:b] = start.params
    sync = _Sync(comm, signals)  # collective (Comm.Dup)
    endpoint = open_parameter_server(
        comm, topology, network.layout.size,
        lambda n: (start.optimizer if start.optimizer is not None
                   else make_optimizer(opt.adagrad, opt.learning_rate, n)),
        initial)
    # Model parallelism: each replica's partitions get a communicator (topology.py).
    communicators = split_communicators(comm, topology)
    return OpenRun(plan, local, start, sync, endpoint, communicators)


def _local_setup(config: Config, plan: DownpourPlan, info: Any, network: Any, resume: str,
                 stream: IO[str] | None) -> Any:
    """What this rank needs before training: a replica its part of the training set; rank 0
    the checkpoint to start from (before config.json is rewritten, so a refused resume
    leaves the run folder as it was), the run folder and the evaluation set. Local."""
    from distbelief.data import TrainShard

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
    saved = len(found.manifest["replicas"])
    if topology.world_rank == 0 and saved != plan.num_replicas:
        _print(stream, f"distbelief: the checkpoint was written by {saved} replica(s), this "
                       f"run has {plan.num_replicas}: each replica starts a fresh pass over "
                       f"its part of the training set")
    return start


def _restore_replica(found: ckpt.Checkpoint, plan: DownpourPlan, data: Any, info: Any,
                     start: Start) -> None:
    """The data position and local step count of this replica: exact when the checkpoint
    has as many replicas; otherwise the parts of the data are new, and each replica
    starts a pass that no earlier epoch used (the number of passes over the whole set
    so far)."""
    if len(found.manifest["replicas"]) == plan.num_replicas:
        saved = found.read_replica(plan.topology.replica_index)
        data.load_state(saved.data_state)
        start.local_steps = saved.counters.get("local_steps", 0)
    else:
        data.load_state({**data.state(), "epoch": 1 + found.samples // info.n_train,
                         "position": 0})


# ------------------------------------------------------------------------------------------
# Agreement and checkpoints: the part every role shares


class _Sync:
    """A rank's share in the agreement rounds (distbelief.agreement): a private duplicate
    of the world communicator for the rounds and the checkpoint collectives, and the
    signal flags this rank reports."""

    def __init__(self, comm: MPI.Comm, signals: StopSignals):
        self.comm = comm.Dup()  # collective over comm
        self.rounds = Rounds(self.comm, ROUND_WIDTH, ROUND_INTERVAL_S)
        self.signals = signals

    def free(self) -> None:
        """Collective over the communicator; after the last round (none in flight)."""
        self.comm.Free()


class _Role:
    """What one rank does between opening the parameter server and the final collectives,
    and its part in the rounds and the checkpoints (the same steps on every rank)."""

    sync: _Sync
    done = False  # this rank's training work is over (replica finished, shard served)
    all_done = False  # a round said that every rank is done
    stop_signal: str | None = None  # the signal the run stops for, once agreed
    failure: str | None = None  # why a checkpoint could not be written (every rank)
    diverged = False  # a shard held non-finite values at a checkpoint (every rank)
    bad_gradients_from: int | None = None  # the replica that gave up (every rank)
    checkpoint_seconds = 0.0

    def run(self) -> None:
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        """This rank's statistics for summary.json (plain JSON values)."""
        raise NotImplementedError

    # -- rounds

    def poll_rounds(self) -> bool:
        """Test the round in flight (post the next one when due) and act on a completed
        round's result; returns True when it ran a checkpoint. Collective in the sense of
        agreement.Rounds: every rank calls it from its loops."""
        result = self.sync.rounds.poll(self._contribution)
        if result is None:
            return False
        self.all_done = result[ROUND_NOT_DONE] == 0
        signal_name = SIGNAL_NAMES.get(int(result[ROUND_SIGNAL]))
        if signal_name is not None and self.stop_signal is None:
            self.stop_signal = signal_name
            self.checkpoint()
            self._stop_for(signal_name)
            return True
        if result[ROUND_BAD_GRADIENTS] and self.bad_gradients_from is None:
            # The state is finite (bad gradients are never pushed): the run ends as usual,
            # with its final checkpoint, then fails on every rank.
            self.bad_gradients_from = int(result[ROUND_BAD_GRADIENTS]) - 1
            self._stop_for("bad_gradients")
        if result[ROUND_CHECKPOINT]:
            self.checkpoint()
            return True
        return False

    def _contribution(self) -> list[int]:
        received = self.sync.signals.received
        code = SIGNAL_CODES.get(received, 0) if self.stop_signal is None else 0
        return [code, int(self._checkpoint_due()), int(not self.done), self._gave_up()]

    def _gave_up(self) -> int:
        """1 + the index of this replica if it met too many bad gradients in a row, else 0."""
        return 0

    def _checkpoint_due(self) -> bool:
        return False  # rank 0 decides

    def drain(self) -> None:
        """This rank's work is over: keep taking part in the rounds (sleeping between
        polls) until one says every rank is done. Collective, as poll_rounds."""
        self.done = True
        backoff = Backoff(*WAIT_SLEEP_S)
        while not self.all_done:
            if self.poll_rounds():
                backoff.reset()
            else:
                backoff.wait()

    def _stop_for(self, reason: str) -> None:
        """The run stops (a signal, a failed or non-finite checkpoint)."""

    # -- checkpoints (see CHECKPOINTS in the module docstring)

    def checkpoint(self) -> None:
        """Write a checkpoint of the whole run together with every other rank, or nothing
        when rank 0 decides there is nothing new. Collective over the sync communicator:
        a polled barrier (shards serve meanwhile), bcast, gather, bcast."""
        began = time.monotonic()
        comm = self.sync.comm
        wait_for_everyone(comm, serve=self._serve_pending)
        self._settle()
        plan = bcast_after_barrier(comm, self._plan_checkpoint())
        if plan is None:
            return
        outcome = plan
        if "meta" in plan:
            meta = ckpt.CheckpointMeta(**plan["meta"])
            reports = gather_after_barrier(comm, self._write_part(Path(plan["partial"]), meta))
            outcome = bcast_after_barrier(comm, self._commit(meta, reports))
        self.checkpoint_seconds += time.monotonic() - began
        self._after_checkpoint(outcome, time.monotonic() - began)

    def _serve_pending(self) -> bool:
        """While waiting for the others to pause: serve (shards). True if work was done."""
        return False

    def _settle(self) -> None:
        """Everyone has paused: fold what is still pending (shards)."""

    def _plan_checkpoint(self) -> dict[str, Any] | None:
        """Rank 0: {"partial", "meta"} to write, {"error"}, or None for nothing new."""
        return None

    def _write_part(self, partial: Path, meta: ckpt.CheckpointMeta) -> dict[str, Any]:
        """Write this rank's part: {"record": [name, size, sha256]}, {"error": ...},
        {"diverged": ...}, or {} when this rank writes none."""
        return {}

    def _commit(self, meta: ckpt.CheckpointMeta,
                reports: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        """Rank 0: commit from every rank's report; the outcome every rank learns."""
        return None

    def _after_checkpoint(self, outcome: dict[str, Any], seconds: float) -> None:
        if "diverged" in outcome:
            self.diverged = True
            self._stop_for("diverged")
        elif "error" in outcome:
            self.failure = outcome["error"]
            self._stop_for("checkpoint_failed")


def _part_report(write: Any) -> dict[str, Any]:
    """Run a part writer; its record, or the CheckpointError's message."""
    try:
        record = write()
    except ckpt.CheckpointError as exc:
        return {"error": str(exc)}
    return {"record": [record.name, record.size, record.sha256]}


# ------------------------------------------------------------------------------------------
# Roles


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
    staleness: StalenessStats = field(default_factory=StalenessStats)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["staleness"] = self.staleness.to_dict()
        out["samples_per_second"] = (self.samples / self.train_seconds
                                     if self.train_seconds > 0 else None)
        return out


class Replica(_Role):
    """One model replica: train on its part of the data, fetch every n_fetch steps, push
    the accumulated gradient every n_push steps. All communication is one-sided, with the
    shards (pull, push, push_pull, exchange); it never waits for another replica, except
    at an agreed checkpoint."""

    def __init__(self, plan: DownpourPlan, client: ParameterClient, network: Any,
                 data: Any, sync: _Sync, start: Start, fetch_own_pushes: bool = True):
        self.plan, self.client, self.network, self.data = plan, client, network, data
        self.sync, self.base = sync, start.base
        self.fetch_own_pushes = fetch_own_pushes
        topology = plan.topology
        self.stats_ = ReplicaStats(topology.replica_index, topology.world_rank,
                                   staleness=client.staleness)
        self.params = np.zeros(network.layout.size, dtype=np.float32)
        self.grad = np.zeros_like(self.params)
        # With n_push = 1 the step's gradient is pushed as it is; otherwise summed here.
        self.pushed = self.grad if plan.n_push == 1 else np.zeros_like(self.params)
        self.control = ControlExchange()
        self.t = start.local_steps  # local steps done (a resumed replica goes on counting)
        self.fresh = False  # params were fetched at the last push (push_pull)
        self.stopping = False  # stop before the next block (a signal, a failure)
        self.faults = Faults.for_rank(topology.world_rank)  # test-only (distbelief.faults)
        self.bad_in_a_row = 0

    def run(self) -> None:
        t0 = time.perf_counter()
        if self.plan.topology.replica_index > 0 and self.plan.warm_start_steps > 0:
            self._wait_for_warm_start()
        start = time.perf_counter()
        self.stats_.wait_seconds = start - t0
        granted = 0 if self.stopping else self._first_claim()
        while granted and not self.stopping:
            granted = self._train_block(granted)
            self.poll_rounds()
        self.client.finish()
        self.stats_.train_seconds = time.perf_counter() - start
        self.drain()

    def _stop_for(self, reason: str) -> None:
        self.stopping = True

    def _gave_up(self) -> int:
        if self.bad_in_a_row < self.plan.max_bad_gradients:
            return 0
        return self.plan.topology.replica_index + 1

    def _wait_for_warm_start(self) -> None:
        """Poll shard 0 (control only, with back-off sleeps) until replica 0 has reported
        warm_start_steps steps, or the run is over already."""
        backoff = Backoff(*WARM_START_POLL_S)
        control = self.control.set(claim=0)
        while not self.stopping:
            self.client.exchange(control)
            over = control.stop or (self.plan.max_steps and self.base
                                    + control.claimed_before >= self.plan.max_steps)
            if over or self.base + control.steps_before >= self.plan.warm_start_steps:
                return
            self.poll_rounds()
            backoff.wait()

    def _first_claim(self) -> int:
        """Claim the first n_push steps and fetch the parameters."""
        control = self.control.set(claim=self.plan.n_push)
        t0 = time.perf_counter()
        self.client.exchange(control)
        self.client.pull(self.params)
        self.stats_.rma_seconds += time.perf_counter() - t0
        self.stats_.fetches += 1
        self.stats_.started_at_step = self.base + control.steps_before
        self.fresh = True
        return self._granted(control)

    def _granted(self, control: ControlExchange) -> int:
        if control.stop:
            return 0
        return grant(self.base + control.claimed_before, self.plan.n_push,
                     self.plan.max_steps)

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
        return self._granted(self.control)

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
        max_bad_gradients in a row, stop (the next round tells every rank)."""
        self.stats_.bad_gradients += 1
        self.bad_in_a_row += 1
        if self.pushed is self.grad:
            self.grad.fill(0)  # n_push = 1: the block pushes nothing
        if self.bad_in_a_row >= self.plan.max_bad_gradients:
            self.stopping = True

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
        """Push the gradient with the control exchange; fetch in the same epochs when the
        next step is due to fetch."""
        t0 = time.perf_counter()
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

    def _write_part(self, partial: Path, meta: ckpt.CheckpointMeta) -> dict[str, Any]:
        # Called right after a push (or before the first claim): nothing is pending.
        return _part_report(lambda: ckpt.write_replica_part(
            partial, meta, self.plan.topology.replica_index, self.data.state(),
            counters={"local_steps": self.t}))

    def stats(self) -> dict[str, Any]:
        return {"role": "replica", "checkpoint_seconds": self.checkpoint_seconds,
                **self.stats_.to_dict()}


class _ShardRole(_Role):
    """What every shard does in the rounds and the checkpoints."""

    shard: ParameterServerShard

    def _shard_duties(self) -> bool:
        """Between two polls: the test-only kill, then the rounds."""
        if self.faults:
            self.faults.after_updates(self.shard.version)
        return self.poll_rounds()

    def _serve_pending(self) -> bool:
        return self.shard.serve_once()

    def _settle(self) -> None:
        # Every push has completed (its epoch closed before the barrier), so a poll sees
        # the final push count and folds all of it; poll until one finds nothing to do.
        while self.shard.serve_once():
            pass

    def _write_part(self, partial: Path, meta: ckpt.CheckpointMeta) -> dict[str, Any]:
        shard = self.shard
        params, state = shard.parameters(), shard.optimizer.state()
        if not (np.isfinite(params).all() and all(np.isfinite(v).all()
                                                  for v in state.values())):
            return {"diverged": f"shard {shard.rank} holds non-finite values at step "
                                f"{meta.step}; not checkpointed"}
        counters = {"version": shard.version, "pushes": shard.stats.pushes,
                    "folds": shard.stats.folds}
        return _part_report(lambda: ckpt.write_shard_part(
            partial, meta, shard.rank, shard.start, shard.stop, params, state, counters))

    def stats(self) -> dict[str, Any]:
        shard = self.shard
        return {"role": "shard", "rank": shard.rank, "version": shard.version,
                "params": shard.stop - shard.start,
                "checkpoint_seconds": self.checkpoint_seconds, **asdict(shard.stats)}


class _PlainShard(_ShardRole):
    """Shards other than 0: serve until every replica has finished (one-sided, own
    windows), taking part in the rounds between polls."""

    def __init__(self, shard: ParameterServerShard, sync: _Sync):
        self.shard, self.sync = shard, sync
        self.faults = Faults.for_rank(shard.rank)  # test-only (distbelief.faults)

    def run(self) -> None:
        self.shard.serve(PacedBackoff(), between=self._shard_duties)
        self.drain()


class Supervisor(_ShardRole):
    """Shard 0: serves its slice like every shard and, between polls, runs the run: training
    lines, evaluations (in a thread, on snapshots), stop rules, progress lines, and the
    checkpoints (it decides when, and commits them).

    Communicates one-sided only (its own windows; Gets of the other shards' PARAMS for
    snapshots), plus the rounds. Owns the RunRecorder.
    """

    def __init__(self, config: Config, plan: DownpourPlan, shard: ParameterServerShard,
                 network: Any, eval_set: tuple[np.ndarray, np.ndarray], info: Any,
                 stream: IO[str] | None, sync: _Sync, start: Start):
        self.config, self.plan, self.shard, self.network = config, plan, shard, network
        self.eval_set, self.stream, self.sync = eval_set, stream, sync
        self.rules = StopRules.from_config(config)
        self.reason: str | None = None
        self.base = start.base
        self.resumed_from = start.checkpoint
        self.steps, self.loss_total, self.loss = self.base, 0.0, math.nan
        self.snapshot = np.zeros(network.layout.size, dtype=np.float32)
        self.pending: tuple[Future, int] | None = None  # evaluation in flight, its step
        self.evaluations, self.eval_seconds = 0, 0.0
        self.faults = Faults.for_rank(0)  # test-only (distbelief.faults)
        run = config.run
        self.root = ckpt.checkpoint_root(run.out_dir)
        self.every_seconds, self.every_steps = (run.checkpoint_every_seconds,
                                                run.checkpoint_every_steps)
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
        self.recorder = RunRecorder(run.out_dir, run.progress_every_seconds, stream,
                                    target_accuracy=run.target_accuracy, resume=resume)
        now = time.monotonic()
        self.next_log = now + LOG_EVERY_SECONDS
        self.next_eval = now + run.eval_every_seconds
        self._schedule_checkpoint(now)

    def run(self) -> None:
        with ThreadPoolExecutor(1, thread_name_prefix="distbelief-eval") as self.executor:
            self.shard.serve(PacedBackoff(), between=self._between)
            if self.pending is not None:
                self._record_eval(*self.pending)
        self._log_training()  # every replica has finished: the totals are final
        if self.reason is None:
            self.reason = "max_steps"
        self.drain()

    def _between(self) -> bool:
        """Shard 0's duties between two polls; cheap unless one of them is due."""
        now = time.monotonic()
        busy = False
        if self.pending is not None and self.pending[0].done():
            self._record_eval(*self.pending)
            busy = True
        if now >= self.next_log:
            self._log_training()
            self.next_log = now + LOG_EVERY_SECONDS
        if self.reason is None:
            self._apply_budget(now)
        if self.reason is None and self.pending is None and now >= self.next_eval:
            self._start_eval()
            busy = True
        self.recorder.progress(self.steps, self.steps * self.plan.batch_size, self.loss)
        return self._shard_duties() or busy

    def _read_control(self) -> None:
        """Steps and recent loss from the control slots."""
        totals = self.shard.read_control()
        steps = self.base + totals.steps
        if steps > self.steps:
            self.loss = (totals.loss_sum - self.loss_total) / (steps - self.steps)
            self.steps, self.loss_total = steps, totals.loss_sum

    def _log_training(self) -> None:
        before = self.steps
        self._read_control()
        if self.steps > before:
            self.recorder.log(self.steps, self.steps * self.plan.batch_size, self.loss,
                              version=self.shard.version)
            if not math.isfinite(self.loss) and self.reason is None:
                self._stop("diverged")

    def _apply_budget(self, now: float) -> None:
        reason = self.rules.budget_spent(self.steps, now - self.recorder.start)
        if reason:
            self._stop(reason)

    def _stop(self, reason: str) -> None:
        self.reason = reason
        self.shard.raise_stop()

    def _stop_for(self, reason: str) -> None:
        # A failure or divergence found at a checkpoint overrides a budget already spent.
        if self.reason is None or reason in ("diverged", "checkpoint_failed", "bad_gradients"):
            self._stop(reason)

    def _start_eval(self) -> None:
        """Snapshot the global parameters (one-sided Gets from the other shards) and
        evaluate them in the thread, while this thread goes on polling."""
        self._read_control()
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
            self._stop("target_accuracy")
        self.next_eval = time.monotonic() + self.config.run.eval_every_seconds

    def final_evaluation(self, params: np.ndarray) -> None:
        """Evaluate the final parameters (all pushes folded) and log it. Local. Not after a
        signal: stopping promptly matters more."""
        if self.stop_signal is not None:
            return  # the last training line has the final steps (run, _plan_checkpoint)
        samples = self.steps * self.plan.batch_size
        t0 = time.perf_counter()
        test_loss, accuracy = evaluate(self.network, params, self.eval_set)
        self.evaluations += 1
        self.eval_seconds += time.perf_counter() - t0
        self.recorder.log_eval(self.steps, samples, self.loss, accuracy, test_loss)

    # -- checkpoints: when, and the commit

    def _schedule_checkpoint(self, now: float) -> None:
        """The next periodic checkpoint: `every_seconds` from now, and the next multiple
        of `every_steps` (also after a resume from another step); inf when off."""
        self.next_checkpoint_time = now + self.every_seconds if self.every_seconds \
            else math.inf
        self.next_checkpoint_step = ((self.steps // self.every_steps + 1) * self.every_steps
                                     if self.every_steps else math.inf)

    def _checkpoint_due(self) -> bool:
        if self.reason is not None or self.done:
            return False  # the checkpoint at the end follows
        if time.monotonic() >= self.next_checkpoint_time:
            return True
        # The control slots directly: _read_control's totals feed the training lines.
        return (self.every_steps > 0 and self.base + self.shard.read_control().steps
                >= self.next_checkpoint_step)

    def _plan_checkpoint(self) -> dict[str, Any] | None:
        # Every push is folded: the totals are those of the checkpoint. Logged now, so
        # that no line up to its step is later than the checkpoint's time.
        self._log_training()
        if self.reason == "diverged" or self.failure is not None \
                or self.steps == self.last_checkpoint_step:
            return None
        meta = ckpt.CheckpointMeta(self.steps, self.steps * self.plan.batch_size,
                                   self.recorder.elapsed(), config_hash(self.config))
        try:
            partial = ckpt.prepare(self.root, meta.step)
        except ckpt.CheckpointError as exc:
            return {"error": str(exc)}
        return {"partial": str(partial), "meta": asdict(meta)}

    def _commit(self, meta: ckpt.CheckpointMeta,
                reports: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        for kind in ("diverged", "error"):
            problems = [r[kind] for r in reports if kind in r]
            if problems:
                return {kind: problems[0]}  # the .partial is cleaned at the next start
        records = [ckpt.PartRecord(*r["record"]) for r in reports if "record" in r]
        try:
            path = ckpt.commit(
                self.root, meta, settings=hashed_settings(self.config), algorithm="downpour",
                layout=self.network.layout, shard_ranges=self.shard.ranges,
                optimizer_state=list(self.shard.optimizer.state()), parts=records,
                num_replicas=self.plan.num_replicas, keep=self.config.run.keep_checkpoints)
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
        self._schedule_checkpoint(time.monotonic())


# ------------------------------------------------------------------------------------------
# The end: collectives in one order on every rank, then rank 0's summary


def _finish(comm: MPI.Comm, plan: DownpourPlan, endpoint: Any, role: _Role) -> dict[str, Any]:
    """Gather statistics and final parameters to rank 0, agree on the stop reason; on rank
    0 evaluate the final parameters; write the final checkpoint; on rank 0 write
    summary.json. Returns {"stop_reason": ...} on other ranks, the summary on rank 0.

    Collective over `comm`, the same calls in the same order on every rank: a back-off
    barrier, gather (statistics), Gatherv (final slices from the shards), bcast (reason),
    then the checkpoint's collectives (after the evaluation, so that no metrics line up to
    the checkpoint's step is later than the checkpoint).
    """
    wait_for_everyone(comm)
    all_stats = comm.gather(role.stats(), root=0)
    final = _gather_parameters(comm, endpoint)
    reason = role.reason if isinstance(role, Supervisor) else None
    reason = comm.bcast(reason, root=0)
    if isinstance(role, Supervisor):
        role.final_evaluation(final)
    role.checkpoint()  # nothing new since the last one: nothing is written
    if role.diverged:  # found by a shard at this checkpoint, on every rank
        reason = "diverged"
    if not isinstance(role, Supervisor):
        return {"stop_reason": reason}
    summary = role.recorder.finish(_summary_extras(role, all_stats))
    _print(role.stream, _summary_line(summary, role.config))
    return summary


def _gather_parameters(comm: MPI.Comm, endpoint: Any) -> np.ndarray | None:
    """The final parameter vector on rank 0 (None elsewhere). Collective over `comm`:
    Gatherv of each shard's slice (replicas send nothing)."""
    size = endpoint.size
    counts = [stop - start for start, stop in endpoint.ranges]
    counts += [0] * (comm.Get_size() - len(counts))
    displs = [endpoint.ranges[r][0] if r < len(endpoint.ranges) else size
              for r in range(comm.Get_size())]
    mine = (endpoint.parameters() if isinstance(endpoint, ParameterServerShard)
            else np.zeros(0, dtype=np.float32))
    out = np.zeros(size, dtype=np.float32) if comm.Get_rank() == 0 else None
    comm.Gatherv([mine, MPI.FLOAT], [out, counts, displs, MPI.FLOAT] if out is not None
                 else None, root=0)
    return out


def _summary_extras(sup: Supervisor, all_stats: list[dict[str, Any]]) -> dict[str, Any]:
    config, plan = sup.config, sup.plan
    replicas = sorted((s for s in all_stats if s["role"] == "replica"),
                      key=lambda s: s["replica"])
    shards = [s for s in all_stats if s["role"] == "shard"]
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
        "staleness": _combined_staleness(replicas),
        "replicas": replicas, "shards": shards,
    }


def _combined_staleness(replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """The staleness of every push of every replica, as one distribution."""
    width = max((len(r["staleness"]["histogram"]) for r in replicas), default=0)
    histogram = np.zeros(width, dtype=np.int64)
    for r in replicas:
        h = r["staleness"]["histogram"]
        histogram[: len(h)] += h
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
    if summary["target_accuracy"] is not None:
        text += (f"; reached {summary['target_accuracy']:g} in "
                 f"{summary['time_to_target']:.1f}s" if summary["reached_target"]
                 else f"; target {summary['target_accuracy']:g} not reached")
    return f"{text}\nresults in {config.run.out_dir}"


def _print(stream: IO[str] | None, text: str) -> None:
    if stream is not None:
        print(text, file=stream, flush=True)
