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

STOP PROTOCOL. A replica stops when a claim grants it no step (max_steps used up) or it
reads the stop flag; either way its last push has carried every gradient and step it
computed. It then calls `finish()`; the shards serve until every replica has finished
and every push is folded, so the final parameters contain all the work. Then, on every
rank in the same order: a back-off barrier (no rank spins while others finish), one
`gather` of each rank's statistics and one `Gatherv` of the shards' final slices to rank
0, and a `bcast` of the stop reason. Rank 0 evaluates the final parameters, writes
summary.json, and every rank frees the parameter server and returns (exit 0).

METRICS: rank 0 (shard 0) owns the run folder and writes config.json, metrics.jsonl and
summary.json with distbelief.metrics.RunRecorder, the same contract as the single-process
trainer; `step` and `samples` are totals over all replicas. summary.json adds the
Downpour figures: per-replica steps, samples/s, pushes, fetches, RMA time and staleness
(mean, max, histogram), per-shard server statistics, and the combined staleness.

Threads: each rank uses 1 BLAS thread unless `[run] threads` says otherwise (ranks
oversubscribe small machines; more threads per rank only fight over the cores).
"""

from __future__ import annotations

import math
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import IO, Any

import numpy as np
from mpi4py import MPI

from distbelief.config import Config, config_hash
from distbelief.errors import DataError, UserError
from distbelief.metrics import RunRecorder
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
from distbelief.partitioned_training import make_replica, open_replica_comm
from distbelief.threads import set_blas_threads
from distbelief.topology import Topology
from distbelief.trainer import (
    LOG_EVERY_SECONDS,
    StopRules,
    TrainingDiverged,
    evaluate,
    load_eval_set,
    open_data,
    prepare_run_dir,
)

TEST_ONLY_FAIL_RANK = "DISTBELIEF_TEST_ONLY_FAIL_RANK"
"""TEST-ONLY fault injection: the world rank named in this environment variable raises
RuntimeError once it has done some work (a replica after 3 steps, shard 0 once it has
folded a push), so the tests can check that an exception on one rank ends the whole job.
Nothing else reads it; never set it in a real run."""

WARM_START_POLL_S = (1e-3, 20e-3)
"""Back-off bounds of replicas polling shard 0 while they wait for the warm start: slow,
since each poll is an RMA epoch that shard 0 has to serve."""


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
                        opt.warm_start_steps, config.run.max_steps)


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
          fetch_own_pushes: bool = True) -> dict[str, Any] | None:
    """Run Downpour SGD on the ranks of `comm`; returns the run summary on rank 0, None
    on the other ranks.

    `fetch_own_pushes` (True, what the command line uses): a replica's fetch returns
    parameters that contain every gradient it pushed before (read-your-writes; the
    DistBelief server answers a replica's fetch after applying its earlier push), so one
    replica is exactly sequential SGD. False: a fetch takes what the shards have
    published, usually without the push made in the same epoch, so every gradient is at
    least one update stale: with one replica ~20% more steps/s, but 0.4-3 points lower
    test accuracy at equal steps and a later 88% (benchmarks/RMA_NOTES.md section 6).
    For experiments and benchmarks.

    Collective over `comm`: every rank calls it with the same configuration. It validates
    the rank count and data first, without communicating (ConfigError/DataError on every
    rank), then sets up (any rank's UserError there is raised on every rank), opens the
    parameter server (collective), trains (one-sided), and ends with collectives in one
    fixed order (see the module docstring). Rank 0 writes the run folder and prints to
    `stream`; raises TrainingDiverged on every rank if the loss became non-finite.
    """
    info, network = open_data(config)
    plan = plan_run(config, comm.Get_size(), comm.Get_rank(), info.n_train)
    set_blas_threads(config.run.threads or 1)
    local = _agree(comm, lambda: _local_setup(config, plan, info))
    topology = plan.topology
    opt = config.optimizer
    initial = network.init_params(config.run.seed) if topology.is_shard else None
    endpoint = open_parameter_server(
        comm, topology, network.layout.size,
        lambda n: make_optimizer(opt.adagrad, opt.learning_rate, n), initial)
    # Model parallelism: a replica of P > 1 ranks is built by partitioned_training.
    replica_comm = open_replica_comm(comm, topology)
    with np.errstate(over="ignore", invalid="ignore"):
        if isinstance(endpoint, ParameterClient):
            role: _Role = make_replica(plan, endpoint, network, local, fetch_own_pushes,
                                       replica_comm)
        elif topology.world_rank == 0:
            role = Supervisor(config, plan, endpoint, network, local, info, stream)
        else:
            role = _PlainShard(endpoint)
        role.run()
        summary = _finish(comm, plan, endpoint, role)
    endpoint.free()
    if replica_comm != MPI.COMM_NULL:
        replica_comm.Free()
    if summary["stop_reason"] == "diverged":
        raise TrainingDiverged(f"training diverged: the training loss became "
                               f"non-finite; lower optimizer.learning_rate "
                               f"(now {opt.learning_rate:g})")
    return summary if topology.world_rank == 0 else None


def _local_setup(config: Config, plan: DownpourPlan, info: Any) -> Any:
    """What this rank needs before training: a replica its part of the training set, rank 0
    the run folder and the evaluation set. Local (no communication)."""
    from distbelief.data import TrainShard

    topology = plan.topology
    if topology.is_replica:
        return TrainShard(info, topology.replica_index, plan.num_replicas, config.run.seed)
    if topology.world_rank == 0:
        prepare_run_dir(config)
        return load_eval_set(config, info)
    return None


def _agree(comm: MPI.Comm, setup: Any) -> Any:
    """Run `setup()` here; if it raised a UserError on any rank, raise it on every rank.

    Collective over `comm` (a back-off barrier, then allgather of the error messages):
    the local set-up differs by rank (a replica reads its rows, rank 0 writes the run
    folder), so a failure there would otherwise leave the other ranks waiting forever.
    """
    try:
        result, error = setup(), None
    except UserError as e:
        result, error = None, str(e)
    _wait_for_everyone(comm)
    errors = [message for message in comm.allgather(error) if message is not None]
    if errors:
        raise UserError(errors[0])  # the lowest rank's, so that rank 0 prints one message
    return result


def _wait_for_everyone(comm: MPI.Comm) -> None:
    """Collective over `comm`: an Ibarrier polled with back-off sleeps, so a rank that
    arrives early does not spin a core (MPICH's blocking calls busy-poll) while others
    still work."""
    request = comm.Ibarrier()
    backoff = Backoff(max_sleep_s=10e-3)
    while not request.Test():
        backoff.wait()


def _test_only_failure_armed(rank: int) -> bool:
    """See TEST_ONLY_FAIL_RANK."""
    return os.environ.get(TEST_ONLY_FAIL_RANK) == str(rank)


# ------------------------------------------------------------------------------------------
# Roles


class _Role:
    """What one rank does between opening the parameter server and the final collectives."""

    def run(self) -> None:
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        """This rank's statistics for summary.json (plain JSON values)."""
        raise NotImplementedError


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
    shards (pull, push, push_pull, exchange); it never waits for another replica."""

    def __init__(self, plan: DownpourPlan, client: ParameterClient, network: Any,
                 data: Any, fetch_own_pushes: bool = True):
        self.plan, self.client, self.network, self.data = plan, client, network, data
        self.fetch_own_pushes = fetch_own_pushes
        topology = plan.topology
        self.stats_ = ReplicaStats(topology.replica_index, topology.world_rank,
                                   staleness=client.staleness)
        self.params = np.zeros(network.layout.size, dtype=np.float32)
        self.grad = np.zeros_like(self.params)
        # With n_push = 1 the step's gradient is pushed as it is; otherwise summed here.
        self.pushed = self.grad if plan.n_push == 1 else np.zeros_like(self.params)
        self.control = ControlExchange()
        self.t = 0  # local steps done
        self.fresh = False  # params were fetched at the last push (push_pull)
        self.fail_at = 3 if _test_only_failure_armed(topology.world_rank) else -1

    def run(self) -> None:
        t0 = time.perf_counter()
        if self.plan.topology.replica_index > 0 and self.plan.warm_start_steps > 0:
            self._wait_for_warm_start()
        start = time.perf_counter()
        self.stats_.wait_seconds = start - t0
        granted = self._first_claim()
        while granted:
            granted = self._train_block(granted)
        self.client.finish()
        self.stats_.train_seconds = time.perf_counter() - start

    def _wait_for_warm_start(self) -> None:
        """Poll shard 0 (control only, with back-off sleeps) until replica 0 has reported
        warm_start_steps steps, or the run is over already."""
        backoff = Backoff(*WARM_START_POLL_S)
        control = self.control.set(claim=0)
        while True:
            self.client.exchange(control)
            over = control.stop or (self.plan.max_steps
                                    and control.claimed_before >= self.plan.max_steps)
            if over or control.steps_before >= self.plan.warm_start_steps:
                return
            backoff.wait()

    def _first_claim(self) -> int:
        """Claim the first n_push steps and fetch the parameters."""
        control = self.control.set(claim=self.plan.n_push)
        t0 = time.perf_counter()
        self.client.exchange(control)
        self.client.pull(self.params)
        self.stats_.rma_seconds += time.perf_counter() - t0
        self.stats_.fetches += 1
        self.stats_.started_at_step = control.steps_before
        self.fresh = True
        return self._granted(control)

    def _granted(self, control: ControlExchange) -> int:
        if control.stop:
            return 0
        return grant(control.claimed_before, self.plan.n_push, self.plan.max_steps)

    def _train_block(self, steps: int) -> int:
        """Compute `steps` granted steps (fetching on schedule), then push them with the
        next claim; returns the steps that claim was granted."""
        plan, loss_sum = self.plan, 0.0
        for _ in range(steps):
            if self.t % plan.n_fetch == 0 and not self.fresh:
                self._pull()
            self.fresh = False
            x, y = self.data.next_batch(plan.batch_size)
            loss_sum += self.network.loss_and_grad(self.params, x, y, self.grad)
            if self.pushed is not self.grad:
                self.pushed += self.grad
            self.t += 1
            if self.t == self.fail_at:
                raise RuntimeError(f"test-only failure on rank {self.stats_.rank} "
                                   f"({TEST_ONLY_FAIL_RANK})")
        self._push(self.control.set(plan.n_push, steps, loss_sum))
        self.stats_.steps += steps
        self.stats_.samples += steps * plan.batch_size
        return self._granted(self.control)

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

    def stats(self) -> dict[str, Any]:
        return {"role": "replica", **self.stats_.to_dict()}


class _PlainShard(_Role):
    """Shards other than 0: serve until every replica has finished (one-sided, own windows)."""

    def __init__(self, shard: ParameterServerShard):
        self.shard = shard

    def run(self) -> None:
        self.shard.serve(PacedBackoff())

    def stats(self) -> dict[str, Any]:
        return _shard_stats(self.shard)


def _shard_stats(shard: ParameterServerShard) -> dict[str, Any]:
    return {"role": "shard", "rank": shard.rank, "version": shard.version,
            "params": shard.stop - shard.start, **asdict(shard.stats)}


class Supervisor(_Role):
    """Shard 0: serves its slice like every shard and, between polls, runs the run: training
    lines, evaluations (in a thread, on snapshots), stop rules, progress lines.

    Communicates one-sided only (its own windows; Gets of the other shards' PARAMS for
    snapshots). Owns the RunRecorder.
    """

    def __init__(self, config: Config, plan: DownpourPlan, shard: ParameterServerShard,
                 network: Any, eval_set: tuple[np.ndarray, np.ndarray], info: Any,
                 stream: IO[str] | None):
        self.config, self.plan, self.shard, self.network = config, plan, shard, network
        self.eval_set, self.stream = eval_set, stream
        self.rules = StopRules.from_config(config)
        self.reason: str | None = None
        self.steps, self.loss_total, self.loss = 0, 0.0, math.nan
        self.snapshot = np.zeros(network.layout.size, dtype=np.float32)
        self.pending: tuple[Future, int] | None = None  # evaluation in flight, its step
        self.evaluations, self.eval_seconds = 0, 0.0
        self.fail = _test_only_failure_armed(0)
        _print(stream, _header(config, plan, network, info, len(eval_set[1])))
        # The clock starts once every rank is ready (open_parameter_server's barrier).
        self.recorder = RunRecorder(config.run.out_dir, config.run.progress_every_seconds,
                                    stream, target_accuracy=config.run.target_accuracy)
        self.next_log = self.recorder.start + LOG_EVERY_SECONDS
        self.next_eval = self.recorder.start + config.run.eval_every_seconds

    def run(self) -> None:
        with ThreadPoolExecutor(1, thread_name_prefix="distbelief-eval") as self.executor:
            self.shard.serve(PacedBackoff(), between=self._between)
            if self.pending is not None:
                self._record_eval(*self.pending)
        self._read_control()  # every replica has finished: the totals are final
        if self.reason is None:
            self.reason = "max_steps"

    def _between(self) -> bool:
        """Shard 0's duties between two polls; cheap unless one of them is due."""
        if self.fail and self.shard.stats.folds:
            raise RuntimeError(f"test-only failure on rank 0 ({TEST_ONLY_FAIL_RANK})")
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
        return busy

    def _read_control(self) -> None:
        """Steps and recent loss from the control slots."""
        totals = self.shard.read_control()
        if totals.steps > self.steps:
            self.loss = (totals.loss_sum - self.loss_total) / (totals.steps - self.steps)
            self.steps, self.loss_total = totals.steps, totals.loss_sum

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

    def _start_eval(self) -> None:
        """Snapshot the global parameters (one-sided Gets from the other shards) and
        evaluate them in the thread, while this thread goes on polling."""
        self._read_control()
        self.shard.snapshot(self.snapshot)
        future = self.executor.submit(self._timed_eval, self.snapshot)
        self.pending = (future, self.steps)

    def _timed_eval(self, params: np.ndarray) -> tuple[float, float, float]:
        t0 = time.perf_counter()
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
        """Evaluate the final parameters (all pushes folded) and log it. Local."""
        t0 = time.perf_counter()
        test_loss, accuracy = evaluate(self.network, params, self.eval_set)
        self.evaluations += 1
        self.eval_seconds += time.perf_counter() - t0
        self.recorder.log_eval(self.steps, self.steps * self.plan.batch_size, self.loss,
                               accuracy, test_loss)

    def stats(self) -> dict[str, Any]:
        return _shard_stats(self.shard)


# ------------------------------------------------------------------------------------------
# The end: collectives in one order on every rank, then rank 0's summary


def _finish(comm: MPI.Comm, plan: DownpourPlan, endpoint: Any, role: _Role) -> dict[str, Any]:
    """Gather statistics and final parameters to rank 0, agree on the stop reason; on rank
    0 evaluate the final parameters and write summary.json. Returns {"stop_reason": ...}
    on other ranks, the summary on rank 0.

    Collective over `comm`, the same calls in the same order on every rank: a back-off
    barrier, gather (statistics), Gatherv (final slices from the shards), bcast (reason).
    """
    _wait_for_everyone(comm)
    all_stats = comm.gather(role.stats(), root=0)
    final = _gather_parameters(comm, endpoint)
    reason = role.reason if isinstance(role, Supervisor) else None
    reason = comm.bcast(reason, root=0)
    if not isinstance(role, Supervisor):
        return {"stop_reason": reason}
    role.final_evaluation(final)
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
    return {
        "algorithm": "downpour", "stop_reason": sup.reason,
        "config_hash": config_hash(config), "num_params": int(sup.network.layout.size),
        "eval_samples": len(sup.eval_set[1]), "world_size": plan.topology.world_size,
        "ps_shards": plan.topology.ps_shards, "num_replicas": plan.num_replicas,
        "n_fetch": plan.n_fetch, "n_push": plan.n_push,
        "warm_start_steps": plan.warm_start_steps, "max_steps": plan.max_steps,
        "evaluations": sup.evaluations, "eval_seconds": sup.eval_seconds,
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
    text = (f"distbelief: stopped ({summary['stop_reason']}) after {summary['steps']} steps "
            f"in total, {summary['wall_seconds']:.1f}s; test accuracy "
            f"{summary['final_test_accuracy']:.4f}; samples/s per replica: {rates}; "
            f"staleness mean {summary['staleness']['mean']:.2f} max "
            f"{summary['staleness']['max']}")
    if summary["target_accuracy"] is not None:
        text += (f"; reached {summary['target_accuracy']:g} in "
                 f"{summary['time_to_target']:.1f}s" if summary["reached_target"]
                 else f"; target {summary['target_accuracy']:g} not reached")
    return f"{text}\nresults in {config.run.out_dir}"


def _print(stream: IO[str] | None, text: str) -> None:
    if stream is not None:
        print(text, file=stream, flush=True)
