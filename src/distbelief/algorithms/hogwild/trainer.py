"""Hogwild (`optimizer.algorithm = "hogwild"`): lock-free shared parameters on one node.

Niu, Recht, Re and Wright 2011, "Hogwild!: A lock-free approach to parallelizing
stochastic gradient descent" (NIPS 2011). Every rank is a replica (cluster.ps_shards = 0);
the parameter vector lives once, in a shared-memory segment of the node, and each replica
loops: next batch of its own part of the data -> gradient at the shared parameters as
they are now -> the optimizer's update applied in place to the shared vector, with no lock
and no synchronisation with the other replicas. Updates of different replicas may
interleave element by element; the paper shows SGD converges nearly as fast regardless
when updates are sparse, and it is what PyTorch's Hogwild (torch.multiprocessing with
model.share_memory()) does for dense models.

HOGWILD WITH ADAGRAD. With optimizer.update = "adagrad" the accumulator of squared
gradients (Duchi, Hazan and Singer 2011) lives in the same segment and is updated in the
same fused pass, also without a lock: accum += g*g; param -= lr * g / (sqrt(accum) + eps),
element by element, racing with the other replicas. A lost race can drop one g*g from the
accumulator (the step size then stays slightly larger) or apply a gradient computed at
parameters a few updates old: the delayed-Adagrad setting analysed by McMahan and Streeter
2014, "Delay-tolerant algorithms for asynchronous distributed online learning" (NIPS 2014),
and the one Dean et al. 2012 ran on their shards. PyTorch's Hogwild with torch.optim.Adagrad
and its state in shared memory behaves the same way, which is what the peer measures.

WHAT IS RELIED ON (the memory model). The segment is one Win.Allocate_shared window over the
node communicator (rank 0 allocates it, the others map it with Shared_query); accesses are
ordinary loads and stores (MPI-4.1, section 12.2.3, shared memory windows; unified model,
checked). The parameters and the accumulator are raced on by design: aligned float32
stores are single instructions on every CPU MPI runs on, so a read sees an old or a new
value of an element, never a torn one. The control words (below) are aligned int64, each
written by ONE rank only, read by the others; Win.Sync (the memory barrier MPI asks for
between processes' accesses to a shared window; legal in the passive-target epoch that
Lock_all(MODE_NOCHECK) keeps open, no lock traffic) after writing and before reading them
orders them with the data they announce (a replica's published data position). Nothing
waits on MPI's progress engine while training.

STOP RULES AND COUNTERS. run.max_steps counts steps of all replicas together and is split
into per-replica quotas (replica r does max_steps // R steps, one more for the first
max_steps % R replicas): exact, and with no shared atomic on the hot path. A replica that
has done its quota sleeps until the run stops. Rank 0 (replica 0) is also the recorder: it
sums the published counters for metrics.jsonl, evaluates the shared parameters every
run.eval_every_seconds (on a copy taken while the others train), decides max_seconds and
target_accuracy, and writes every checkpoint (one writer).

CHECKPOINTS AND THE END. For a checkpoint rank 0 raises PAUSE; each replica, between two
steps, publishes its data position and counters and sleeps until RESUME; rank 0 then writes
the parameters, the accumulator and every replica's part (records.checkpoint), so the
checkpoint is one consistent state. At the end rank 0 raises STOP; each replica publishes
its final counters and DONE and sleeps until rank 0 has written the final checkpoint and
the summary and says how to tear down (TEARDOWN): freeing the window together, or, after a
lost replica, leaving without any collective.

A LOST REPLICA. Nobody waits for anybody while training, so a replica that dies (other
than rank 0) costs only its share: rank 0 looks at the others' processes in /proc
(runtime.health.liveness) every second, at once after a SIGUSR1 (hydra's notice of a death) and in
every wait, records it as lost (metrics.jsonl, summary, checkpoint manifest), counts its
unfinished quota as done, and the run goes on. Rank 0 holds the recorder and the only
writer: if it dies, every other rank stops with one line naming it (the last checkpoint
resumes the run).

SIGNALS. Each rank publishes how many SIGTERM, SIGINT and SIGUSR1 it received; rank 0
stops the run on any of them (a checkpoint, no final evaluation, exit 0; 130 after a
Ctrl-C), except a SIGUSR1 that a death found within NOTICE_DELAY_S explains. A diverged
loss (not finite) stops every rank with one error line (exit 2) and no checkpoint.
"""

from __future__ import annotations

import fcntl
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.common import (
    StopRules,
    StopSignals,
    TrainingDiverged,
    apply_step,
    evaluate,
    traffic_summary,
    train_shard,
)
from distbelief.algorithms.session import RunSession, RunSetup
from distbelief.config import Config, build_optimizer, config_hash, hashed_settings
from distbelief.errors import ConfigError
from distbelief.model.layout import DTYPE
from distbelief.records import checkpoint as ckpt
from distbelief.records.console import say
from distbelief.records.metrics import LOG_EVERY_SECONDS
from distbelief.runtime.communicators.agreement import agree
from distbelief.runtime.communicators.nodes import node_split
from distbelief.runtime.health.liveness import Peers
from distbelief.runtime.health.watchdog import abort_job
from distbelief.runtime.launching import guardian
from distbelief.runtime.launching.faults import Faults
from distbelief.runtime.threads import apply_thread_setting

ALGORITHM = "hogwild"

# Control words (int64, written by rank 0 only).
STOP, PAUSE, RESUME, TEARDOWN = 0, 1, 2, 3
CONTROL_WORDS = 8
# Stop codes in STOP: 0 = training; then one per reason, in this order.
REASONS = ("max_steps", "max_seconds", "target_accuracy", *StopSignals.NAMES, "diverged",
           "target_loss", "target_r2", "target_rmse", "target_auc")
TEARDOWN_FREE, TEARDOWN_LEAVE = 1, 2
# A replica's words (int64, written by that replica only; LOSS_SUM holds a float64).
STEPS, SAMPLES, PAUSED, DONE, LOSS_SUM, LOSS_COUNT = range(6)
SIG_TERM, SIG_USR1, SIG_INT = 6, 7, 8  # how many of each signal this rank received
DATA_KEYS = ("seed", "rank", "num_ranks", "n", "epoch", "position")  # TrainShard.state()
DATA_AT = 9
QUOTA = 15  # the step count at which this replica stops (max_steps; -1 without)
TOUCHED = 16  # parameters its steps updated, summed (a sparse model's touch few)
REPLICA_WORDS = 24
ALIGN = 64
LIVENESS_EVERY_S = 1.0
NOTICE_DELAY_S = 0.5
"""Hydra (-disable-auto-cleanup) sends SIGUSR1 to every rank when one dies. A new SIGUSR1
waits this long for a death to be found (rank 0 looks at once, and again then); one found
from NOTICE_DELAY_S before the signal on makes it the launcher's notice, otherwise it is a
stop request (SLURM's `--signal=USR1`), as in Downpour."""
POLL_S = (0.2e-3, 20e-3)  # back-off bounds of every wait (sleeping, never spinning)


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class SharedState:
    """The node's one segment: control words, each replica's words, the parameters and the
    optimizer's state arrays, in a Win.Allocate_shared window that rank 0 allocates."""

    def __init__(self, node: MPI.Comm, size: int, state_names: list[str]):
        replicas = node.Get_size()
        control = _aligned(CONTROL_WORDS * 8)
        words = _aligned(replicas * REPLICA_WORDS * 8)
        vector = _aligned(size * DTYPE().itemsize)
        total = control + words + (1 + len(state_names)) * vector
        self.win = MPI.Win.Allocate_shared(total if node.Get_rank() == 0 else 0, 1,
                                           comm=node)
        if self.win.model != MPI.WIN_UNIFIED:
            self.win.Free()
            raise RuntimeError("shared-memory window is not in the unified memory model")
        self.win.Lock_all(MPI.MODE_NOCHECK)  # for Win.Sync, the memory barrier
        raw = np.frombuffer(self.win.Shared_query(0)[0], dtype=np.uint8)
        self.control = raw[:CONTROL_WORDS * 8].view(np.int64)
        self.words = raw[control:control + replicas * REPLICA_WORDS * 8].view(
            np.int64).reshape(replicas, REPLICA_WORDS)
        self.losses = self.words.view(np.float64)  # column LOSS_SUM
        arrays = [raw[control + words + i * vector:][:size * DTYPE().itemsize].view(DTYPE)
                  for i in range(1 + len(state_names))]
        self.params = arrays[0]
        self.state = dict(zip(state_names, arrays[1:], strict=True))

    def sync(self) -> None:
        """The memory barrier between this process's loads/stores and the others'."""
        self.win.Sync()

    def free(self) -> None:
        """Collective over the node communicator."""
        self.win.Unlock_all()
        self.win.Free()


@dataclass
class Replica:
    """This rank's part: its data, its optimizer (working on the shared arrays), its
    counters and quota."""

    index: int
    shard: Any
    optimizer: Any
    steps: int = 0
    samples: int = 0
    quota: float = math.inf
    loss_sum: float = 0.0
    loss_count: int = 0
    touched: int = 0  # parameters its updates wrote, summed over its steps
    faults: Faults = field(default_factory=lambda: Faults(0))
    lock: UpdateLock | None = None  # optimizer.locked_updates

    def publish(self, shared: SharedState) -> None:
        """Counters and data position into this replica's words (then a barrier)."""
        words = shared.words[self.index]
        words[STEPS], words[SAMPLES] = self.steps, self.samples
        shared.losses[self.index, LOSS_SUM] = self.loss_sum
        words[LOSS_COUNT] = self.loss_count
        state = self.shard.state()
        words[DATA_AT:DATA_AT + len(DATA_KEYS)] = [state[k] for k in DATA_KEYS]
        shared.sync()


class UpdateLock:
    """One lock for every replica's update (optimizer.locked_updates): an exclusive
    `flock` on a file in the run folder. A waiting replica sleeps in the kernel, and the
    kernel releases the lock of a replica that dies holding it."""

    NAME = ".hogwild-update.lock"

    def __init__(self, out_dir: str | Path):
        self.path = Path(out_dir) / self.NAME
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self, remove: bool) -> None:
        os.close(self.fd)
        if remove:
            self.path.unlink(missing_ok=True)


def train(config: Config, comm: MPI.Comm, stream: IO[str] | None = sys.stdout,
          resume: str = "auto", setup: RunSetup | None = None) -> dict[str, Any] | None:
    """Train with Hogwild on every rank of `comm`; the summary on rank 0, None elsewhere.

    Collective over `comm`: the node check, the set-up (agreed), the window allocation,
    and at the end the window's free (skipped after a lost replica).
    """
    if config.cluster.partitions != 1:  # the same on every rank: no collective needed
        raise ConfigError(f"optimizer.algorithm = \"hogwild\" runs one whole model replica "
                          f"per rank, but cluster.partitions = {config.cluster.partitions}; "
                          f"set cluster.partitions = 1 (model parallelism is for sgd, "
                          f"downpour and sandblaster)")
    check_one_node(comm)
    apply_thread_setting(config.run.threads)
    rank, replicas = comm.Get_rank(), comm.Get_size()
    session = RunSession(ALGORITHM, config, comm, stream if rank == 0 else None, resume,
                         setup=setup)
    info, network = session.info, session.network
    path = session.choose_checkpoint(replicas, "Hogwild", why=" (their data positions)")
    opt = config.optimizer
    probe = build_optimizer(config, 1)
    shared = SharedState(comm, network.layout.size, sorted(probe.state()))
    agree(comm, lambda: _fill_segment(config, network, shared, path) if rank == 0 else None)
    replica = agree(comm, lambda: _setup_replica(config, info, network, shared, path, rank,
                                                 replicas, session.faults))
    peers = Peers.gather(comm)
    # Rank 0's recorder (its clock) and evaluation set are ready before anybody trains.
    leader = agree(comm, lambda: Leader(session, shared, replica, peers) if rank == 0
                   else None)
    with np.errstate(over="ignore", invalid="ignore"), StopSignals() as signals:
        comm.Barrier()  # every replica's words are set before anybody trains
        if leader is not None:
            summary, reason, teardown = leader.run(signals)
            loss_text = leader.diverged_at
        else:
            summary, loss_text = None, "not finite"
            reason, teardown = _follow(config, network, shared, replica, peers, signals,
                                       comm)
    if replica.lock is not None:
        replica.lock.close(remove=rank == 0)
    if teardown == TEARDOWN_FREE:
        shared.free()
    else:
        guardian.skip_mpi_finalize()  # a rank is dead: MPI_Finalize would wait for it
    if reason == "diverged":
        raise TrainingDiverged(f"training diverged: the loss is {loss_text}; lower "
                               f"optimizer.learning_rate (now {opt.learning_rate:g})")
    return summary


def check_one_node(comm: MPI.Comm) -> None:
    """ConfigError on every rank unless all of `comm` is on one node (MPI's node split, or
    the simulated one). Collective over `comm`."""
    nodes = node_split(comm)
    hosts = comm.allgather(MPI.Get_processor_name())
    if nodes.shares_memory:
        return
    if nodes.single:  # one simulated node that MPI splits finer
        raise ConfigError(
            "optimizer.algorithm = \"hogwild\" needs every rank in one shared-memory "
            "segment, but MPI shares no memory between these ranks (MPIR_CVAR_NOLOCAL=1, or "
            "hydra's -hosts); start them without it")
    groups = "; ".join(f"{_ranks_text(nodes.ranks_on(n))} on node {n} (host "
                       f"{hosts[nodes.ranks_on(n)[0]]})" for n in range(nodes.count))
    how = " (simulated)" if nodes.simulated else ""
    raise ConfigError(
        f"optimizer.algorithm = \"hogwild\" needs every rank on one node (the parameters "
        f"live in one shared-memory segment), but the {comm.Get_size()} ranks are on "
        f"{nodes.count} nodes{how}: {groups}; start every rank on one node, or use "
        f"algorithm = \"downpour\" across nodes")


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}..{ranks[-1]}"
    return f"rank{'s' * (len(ranks) > 1)} {','.join(map(str, ranks))}"


def _fill_segment(config: Config, network: Any, shared: SharedState,
                  path: str | None) -> None:
    """Rank 0, before any replica touches the segment: initial or restored values."""
    shared.control[:] = 0
    shared.words[:] = 0
    np.copyto(shared.params, network.init_params(config.run.seed))
    for array in shared.state.values():
        array[:] = 0  # Adagrad's accumulator starts at zero (model.optimizers)
    if path is not None:
        saved, state = ckpt.verify(path).read_state()
        np.copyto(shared.params, saved)
        for name, value in state.items():
            np.copyto(shared.state[name], value)
    shared.sync()


def _setup_replica(config: Config, info: Any, network: Any, shared: SharedState,
                   path: str | None, rank: int, replicas: int, faults: Faults) -> Replica:
    """This rank's replica; rank 0 also fills the segment (initial or restored values)."""
    shard = train_shard(config, info, rank, replicas)
    optimizer = build_optimizer(config, network.layout.size)
    found = ckpt.verify(path) if path is not None else None
    for name, view in shared.state.items():
        setattr(optimizer, name, view)  # the optimizer works on the shared arrays
    replica = Replica(rank, shard, optimizer, faults=faults,
                      lock=UpdateLock(config.run.out_dir) if config.optimizer.locked_updates
                      else None)
    start_total = 0
    if found is not None:
        start_total = found.step
        if found.has_replica(rank):
            part = found.read_replica(rank)
            try:
                shard.load_state(part.data_state)
            except (ValueError, TypeError) as exc:
                raise ckpt.CheckpointError(f"checkpoint {found.path} cannot be resumed "
                                           f"here: {exc}") from exc
            replica.steps = part.counters["steps"]
            replica.samples = part.counters["samples"]
            # Checkpoints from before sparse models: every step wrote the whole vector.
            replica.touched = part.counters.get("touched", replica.steps * network.layout.size)
    if config.run.max_steps:
        remaining = max(config.run.max_steps - start_total, 0)
        replica.quota = replica.steps + remaining // replicas + (rank < remaining % replicas)
    words = shared.words[rank]
    words[STEPS], words[SAMPLES] = replica.steps, replica.samples
    words[TOUCHED] = replica.touched
    words[QUOTA] = replica.quota if config.run.max_steps else -1
    shared.sync()
    return replica


def _step(network: Any, shared: SharedState, replica: Replica, grad: np.ndarray,
          batch_size: int) -> None:
    """One Hogwild step: a gradient at the shared parameters, applied in place, no lock."""
    began = time.monotonic()
    x, y = replica.shard.next_batch(batch_size)
    loss = network.loss_and_grad(shared.params, x, y, grad)
    replica.faults.poison(replica.steps + 1, grad)
    if replica.lock is None:
        _update(network, shared, replica, grad)
    else:
        with replica.lock:
            _update(network, shared, replica, grad)
    replica.steps += 1
    replica.samples += len(y)
    replica.loss_sum += float(loss)
    replica.loss_count += 1
    # Counted before anything else can happen to this rank: the update is in already.
    words = shared.words[replica.index]
    words[STEPS], words[SAMPLES] = replica.steps, replica.samples
    shared.losses[replica.index, LOSS_SUM] = replica.loss_sum
    words[LOSS_COUNT], words[TOUCHED] = replica.loss_count, replica.touched
    replica.faults.after_step(replica.steps, time.monotonic() - began)


class Backoff:
    """A sleeping poll: short sleeps first, doubling up to POLL_S[1]."""

    def __init__(self) -> None:
        self.delay = POLL_S[0]

    def sleep(self) -> None:
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, POLL_S[1])


def _follow(config: Config, network: Any, shared: SharedState, replica: Replica,
            peers: Peers, signals: StopSignals, world: MPI.Comm) -> tuple[str, int]:
    """A replica other than rank 0: train until STOP, answering PAUSE between steps; then
    publish, say DONE and wait for TEARDOWN. Returns (stop reason, teardown)."""
    grad = np.zeros_like(shared.params)
    batch = config.data.batch_size
    control, words = shared.control, shared.words[replica.index]
    next_check = time.monotonic() + LIVENESS_EVERY_S
    wait = None
    while True:
        shared.sync()
        if control[STOP]:
            break
        if control[PAUSE] > words[PAUSED]:
            replica.publish(shared)
            words[PAUSED] = control[PAUSE]
            shared.sync()
        elif control[RESUME] < words[PAUSED] or replica.steps >= replica.quota:
            wait = wait or Backoff()
            wait.sleep()  # paused for a checkpoint, or quota done: wait for rank 0
        else:
            wait = None
            _step(network, shared, replica, grad, batch)
        _publish_signals(signals, words)
        now = time.monotonic()
        if now >= next_check:
            next_check = now + LIVENESS_EVERY_S
            _check_leader(peers, world)
    replica.publish(shared)
    words[DONE] = 1
    shared.sync()
    wait = Backoff()
    while True:
        shared.sync()
        if control[TEARDOWN]:
            break
        _check_leader(peers, world)  # rank 0 leaves once TEARDOWN is set: look first
        wait.sleep()
    return REASONS[control[STOP] - 1], int(control[TEARDOWN])


def _update(network: Any, shared: SharedState, replica: Replica, grad: np.ndarray) -> None:
    """The optimizer's update of the shared vector with `grad`, in place."""
    # The schedule counts the updates of every replica, as they published them (a plain
    # racy read, as everything here: an update or two behind at most).
    # A sparse model's batch rows alone: writing back the rest unchanged would undo what
    # the other replicas wrote there meanwhile.
    replica.touched += apply_step(replica.optimizer, network, shared.params, grad,
                                  int(shared.words[:, STEPS].sum()))


def _publish_signals(signals: StopSignals, words: np.ndarray) -> None:
    counts = signals.counts
    words[SIG_TERM], words[SIG_USR1], words[SIG_INT] = (counts["SIGTERM"], counts["SIGUSR1"],
                                                        counts["SIGINT"])


def _check_leader(peers: Peers, world: MPI.Comm) -> None:
    """Abort the job with one line if rank 0 is gone (its process, in /proc)."""
    if peers.gone(0):
        abort_job(world, "rank 0 (Hogwild's replica 0, which evaluates, records "
                                  "and checkpoints) is gone: the run stops; run the same "
                                  "command again to resume from the last checkpoint")


class Leader:
    """Rank 0: replica 0, plus the recorder, the stop rules, liveness and checkpoints."""

    def __init__(self, session: RunSession, shared: SharedState, replica: Replica,
                 peers: Peers):
        config, network, start_from = session.config, session.network, session.found
        self.session, self.config, self.network, self.shared = (session, config, network,
                                                                shared)
        self.replica, self.peers, self.stream = replica, peers, session.stream
        self.signals = StopSignals()  # replaced by the installed one in run()
        self.start_from = start_from
        self.num_replicas = shared.words.shape[0]
        self.eval_set = session.load_eval_set()
        self.rules = StopRules.from_config(config)
        self.lost: dict[int, dict[str, Any]] = {}
        self.last_saved = start_from.step if start_from is not None else None
        self.last_path: Path | None = None
        self.pause_epoch = 0
        self.diverged_at = "not finite"  # the loss and step, said by rank 0's error line
        self._loss_seen = (0.0, 0)
        self._next_check = 0.0
        self._usr1_seen, self._usr1_since = 0, None
        self._last_loss_at = -math.inf
        run = config.run
        self.every_seconds, self.every_steps = (run.checkpoint_every_seconds,
                                                run.checkpoint_every_steps)
        # Steps and samples of replicas lost before the checkpoint this run starts from:
        # counted in its totals, though no replica part holds them.
        self.offset = (0, 0)
        if start_from is not None:
            parts = [start_from.read_replica(i).counters
                     for i in range(self.num_replicas) if start_from.has_replica(i)]
            self.offset = (start_from.step - sum(p["steps"] for p in parts),
                           start_from.samples - sum(p["samples"] for p in parts))
        self.recorder = session.open_recorder()
        session.describe_run(f"{self.num_replicas} replica(s) on one node, "
                             f"{network.layout.size:,d} parameters in one shared segment",
                             len(self.eval_set[1]))

    # -- counters -------------------------------------------------------------------------

    def totals(self) -> tuple[int, int]:
        """(steps, samples) of all replicas, from their published words."""
        self.shared.sync()
        words = self.shared.words
        words[0, STEPS], words[0, SAMPLES] = self.replica.steps, self.replica.samples
        return (int(words[:, STEPS].sum()) + self.offset[0],
                int(words[:, SAMPLES].sum()) + self.offset[1])

    def recent_loss(self) -> float:
        """Mean training loss of all replicas' steps since the last call (nan if none)."""
        r = self.replica
        self.shared.losses[0, LOSS_SUM], self.shared.words[0, LOSS_COUNT] = (r.loss_sum,
                                                                             r.loss_count)
        total = float(self.shared.losses[:, LOSS_SUM].sum())
        count = int(self.shared.words[:, LOSS_COUNT].sum())
        seen_sum, seen_count = self._loss_seen
        self._loss_seen = (total, count)
        return (total - seen_sum) / (count - seen_count) if count > seen_count else math.nan

    # -- the loop -------------------------------------------------------------------------

    def run(self, signals: StopSignals) -> tuple[dict[str, Any], str, int]:
        """Train and lead until a stop rule; then the end protocol. Returns (summary,
        reason, teardown)."""
        self.signals = signals
        with self.recorder:
            reason = self._loop()
            self.shared.control[STOP] = REASONS.index(reason) + 1
            self.shared.sync()
            self._wait_for_all(DONE, 1)
            steps, samples = self.totals()
            self.recorder.log(steps, samples, self.recent_loss(),
                              learning_rate=self.replica.optimizer.rate(max(steps - 1, 0)),
                              **self._wire(steps))
            if reason != "diverged":
                if reason not in StopSignals.NAMES:
                    self._evaluate(steps, samples)
                self.save(steps, samples)
            summary = self.session.finish(
                reason, self._summary_extras(), self.last_path,
                steps_note=f" of {self.num_replicas} replica(s)",
                closing_line=reason != "diverged")
        teardown = TEARDOWN_LEAVE if self.lost else TEARDOWN_FREE
        self.shared.control[TEARDOWN] = teardown
        self.shared.sync()
        return summary, reason, teardown

    def _loop(self) -> str:
        replica, run = self.replica, self.config.run
        grad = np.zeros_like(self.shared.params)
        clock = time.monotonic
        start = self.recorder.start
        now = clock()
        next_log, next_eval = now + LOG_EVERY_SECONDS, now + run.eval_every_seconds
        next_save_time, next_save_step = self._schedule(self.totals()[0], now)
        recent = math.nan
        wait = None
        steps, samples = self.totals()
        reason = self.rules.budget_spent(steps, now - start, self.recorder.collapsed)
        while not reason:
            if replica.steps < replica.quota:
                _step(self.network, self.shared, replica, grad, self.config.data.batch_size)
                wait = None
            else:
                wait = wait or Backoff()
                wait.sleep()
            now = clock()
            self._check_replicas(now)
            steps, samples = self.totals()
            reason = (self._quotas_done()
                      or self.rules.budget_spent(steps, now - start, self.recorder.collapsed)
                      or self._signal(now))
            if now >= next_log or reason:
                recent = self.recent_loss()
                self.recorder.log(steps, samples, recent,
                                  learning_rate=replica.optimizer.rate(max(steps - 1, 0)),
                                  **self._wire(steps))
                next_log = now + LOG_EVERY_SECONDS
                if not math.isfinite(recent):
                    if math.isnan(recent) and not self._any_loss():
                        pass  # no step finished yet
                    else:
                        self.diverged_at = f"{recent} at step {steps}"
                        return "diverged"
            if reason:
                break
            if now >= next_eval:
                result = self._evaluate(steps, samples, recent)
                if self.rules.target_reached(result):
                    return self.rules.target_reason
                next_eval = clock() + run.eval_every_seconds
            if now >= next_save_time or steps >= next_save_step:
                self.checkpoint_now()
                next_save_time, next_save_step = self._schedule(steps, clock())
            self.recorder.progress(steps, samples, recent)
        return reason

    def _any_loss(self) -> bool:
        return bool(self.shared.words[:, LOSS_COUNT].sum())

    def _quotas_done(self) -> str | None:
        """"max_steps" once every live replica has done its quota."""
        if not self.rules.max_steps:
            return None
        words = self.shared.words
        done = all(i in self.lost or words[i, STEPS] >= words[i, QUOTA]
                   for i in range(self.num_replicas))
        return "max_steps" if done else None

    def _signal(self, now: float) -> str | None:
        """The stop a signal on any rank asks for, if any (SIGINT, SIGTERM; a SIGUSR1 only
        once it is known not to be the launcher's notice of a death)."""
        words = self.shared.words
        _publish_signals(self.signals, words[0])
        if words[:, SIG_INT].any():
            return "SIGINT"
        if words[:, SIG_TERM].any():
            return "SIGTERM"
        usr1 = int(words[:, SIG_USR1].sum())
        if usr1 > self._usr1_seen and self._usr1_since is None:
            self._usr1_since = now
            self._check_replicas(now, force=True)
        if self._usr1_since is None or now - self._usr1_since < NOTICE_DELAY_S:
            return None
        self._check_replicas(now, force=True)
        since, self._usr1_since, self._usr1_seen = self._usr1_since, None, usr1
        if self._last_loss_at >= since - NOTICE_DELAY_S:
            return None  # hydra's notice of the death just found
        return "SIGUSR1"

    def _evaluate(self, steps: int, samples: int, recent: float | None = None) -> Any:
        """Evaluate a copy of the shared parameters (the others keep training); returns
        the Evaluation."""
        params = self.shared.params.copy()
        result = evaluate(self.network, params, self.eval_set)
        self.recorder.log_eval(steps, samples, self.recent_loss() if recent is None
                               else recent, result, params=params, **self._wire(steps))
        return result

    # -- liveness -------------------------------------------------------------------------

    def _check_replicas(self, now: float, force: bool = False) -> None:
        """Look for dead replicas in /proc every LIVENESS_EVERY_S, or now if `force`d."""
        if not force and now < self._next_check:
            return
        self._next_check = now + LIVENESS_EVERY_S
        for rank in range(1, self.num_replicas):
            if rank not in self.lost and self.peers.gone(rank):
                self._lose(rank)
                self._last_loss_at = now

    def _lose(self, rank: int) -> None:
        steps, samples = self.totals()
        why = "its process is gone"
        self.lost[rank] = {"replica": rank, "ranks": [rank], "why": why,
                           "at_step": steps}
        self.recorder.log_event("replica_lost", steps, samples, replica=rank, why=why)
        say(self.stream, f"distbelief: replica {rank} (rank {rank}) lost at step {steps}: "
                         f"{why}; the others go on")

    def _wait_for_all(self, slot: int, value: int) -> None:
        """Sleep until every live replica other than rank 0 has words[slot] >= value."""
        wait = Backoff()
        while True:
            self.shared.sync()
            if all(i in self.lost or self.shared.words[i, slot] >= value
                   for i in range(1, self.num_replicas)):
                return
            wait.sleep()
            self._check_replicas(time.monotonic())

    # -- checkpoints ----------------------------------------------------------------------

    def _schedule(self, step: int, now: float) -> tuple[float, float]:
        at_time = now + self.every_seconds if self.every_seconds else math.inf
        at_step = ((step // self.every_steps + 1) * self.every_steps if self.every_steps
                   else math.inf)
        return at_time, at_step

    def checkpoint_now(self) -> None:
        """Pause every replica between two steps, checkpoint, resume them."""
        self.pause_epoch += 1
        self.shared.control[PAUSE] = self.pause_epoch
        self.shared.sync()
        self._wait_for_all(PAUSED, self.pause_epoch)
        steps, samples = self.totals()
        self.save(steps, samples)
        self.shared.control[RESUME] = self.pause_epoch
        self.shared.sync()

    def save(self, steps: int, samples: int) -> None:
        """Write a checkpoint of the (quiescent) segment and every replica's published
        words, unless this step is checkpointed already. Rank 0 only: one writer."""
        if steps == self.last_saved:
            return
        self.replica.publish(self.shared)
        config = self.config
        began = time.monotonic()
        meta = ckpt.CheckpointMeta(steps, samples, self.recorder.elapsed(),
                                   config_hash(config))
        root = ckpt.checkpoint_root(config.run.out_dir)
        partial = ckpt.prepare(root, steps)
        size = self.network.layout.size
        records = [ckpt.write_shard_part(partial, meta, 0, 0, size, self.shared.params,
                                         self.shared.state, {"step": steps,
                                                             "samples": samples})]
        states = []
        for i in range(self.num_replicas):
            if i in self.lost:
                continue
            words = self.shared.words[i]
            data = {k: int(words[DATA_AT + j]) for j, k in enumerate(DATA_KEYS)}
            counters = {"steps": int(words[STEPS]), "samples": int(words[SAMPLES]),
                        "touched": int(words[TOUCHED])}
            states.append(ckpt.ReplicaState(i, counters, data, None, {}))
        records.append(ckpt.write_replicas_part(partial, meta, states))
        path = ckpt.commit(root, meta, settings=hashed_settings(config), algorithm=ALGORITHM,
                           layout=self.network.layout, shard_ranges=[(0, size)],
                           optimizer_state=list(self.shared.state), parts=records,
                           num_replicas=self.num_replicas, keep=config.run.keep_checkpoints,
                           lost_replicas=sorted(self.lost))
        seconds = time.monotonic() - began
        self.last_saved, self.last_path = steps, path
        self.recorder.log_event("checkpoint", steps, samples, at=meta.wall_seconds,
                                seconds=seconds, path=path.name)
        say(self.stream, f"checkpoint {path} ({seconds:.2f}s)")

    def _wire(self, steps: int) -> dict[str, int]:
        """metrics.jsonl's bytes so far (as _summary_extras counts them): every step reads
        the parameters it updates and writes its update into them."""
        if self.network.touched() is None:  # a dense model: the whole vector, each step
            touched = 4 * steps * int(self.shared.params.size)
        else:
            touched = 4 * int(self.shared.words[:, TOUCHED].sum())
        return {"bytes_sent": touched, "bytes_received": touched}

    def _summary_extras(self) -> dict[str, Any]:
        words = self.shared.words
        replicas = [{"replica": i, "steps": int(words[i, STEPS]),
                     "samples": int(words[i, SAMPLES])}
                    for i in range(self.num_replicas) if i not in self.lost]
        # No network: each step reads the parameters it updates and writes its update into
        # them, in place (all of them; a sparse model's batch rows and its dense part):
        # those are the bytes counted (float32 each).
        traffic = [(4 * int(words[r["replica"], TOUCHED]),) * 2 for r in replicas]
        start = self.session.found
        return {"num_replicas": self.num_replicas, "replicas": replicas,
                "lost_replicas": list(self.lost.values()),
                "resumed_at_step": start.step if start is not None else None,
                **traffic_summary(traffic)}
