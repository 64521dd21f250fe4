"""Periodic parameter averaging (`algorithm = "averaging"`, no elastic_alpha, ps_shards = 0).

Every rank is a replica. Each trains on its own part of the training set with its own
optimizer (optimizer.update "adagrad" or "sgd") for `average_every` = tau local steps;
then the replicas' parameters are averaged, x_i <- (1/R) sum_j x_j, and every replica
continues from the average. The optimizer state (Adagrad's accumulators) STAYS LOCAL: it is
never averaged, each replica keeps the one its own gradients built. This is the
"supervisor pattern" of issue 14 and the iterative parameter mixing of McDonald, Hall and
Mann (2010), "Distributed training strategies for the structured perceptron" (NAACL),
analysed for SGD by Zinkevich, Weimer, Smola and Li (2010), "Parallelized stochastic
gradient descent" (NIPS); tau = 1 with SGD is synchronous data-parallel SGD.

One average is one collective round over `comm`: three non-blocking Iallreduces issued
in the same order on every rank (the parameters, float32 SUM; the replicas' loss sums,
float64 SUM; the decisions, int32 MAX), completed by polling with back-off sleeps
(runtime.communicators.agreement.wait_all: MPICH's Wait spins a core, DESIGN.md "spinning waits").
The decisions ride on the average: any rank's stop signal, and rank 0's clock-based
choices (max_seconds, evaluate now, checkpoint now). max_steps counts TOTAL steps over
the replicas, as Downpour's does; replicas run in lockstep, so each trains
ceil(max_steps / R) steps and the last block is cut short to end on an average. After an
average every replica holds the same parameters, so rank 0 alone evaluates them (the
others wait for its verdict, a polled Ibcast) and the run folder is rank 0's.

Checkpoints (records.checkpoint's format) are taken right after an average, collectively:
rank 0 writes the one "shard" part (the averaged parameters), every replica its own
replica part (data position, local steps, and its own optimizer state as arrays), rank 0
commits. A resume therefore restores each replica exactly, and needs the same replica
count (a different one is refused with the count that fits).

A LOST REPLICA cannot be survived: the next average waits for it forever. The polled wait
asks the liveness machinery (runtime.health.liveness: /proc on this node, heartbeats on others)
about every other replica, and once one is gone the lowest live rank ends the job with one
line naming it (the others leave the abort to it) and exit status 1. The last checkpoint
survives; EASGD (elastic_alpha set) is the variant that goes on without a lost replica.

Synchronous DiLoCo (diloco.synchronous) is this trainer with an OUTER step after each
average (a `Variant`): the round's average is handed to an outer optimizer, whose result
every replica continues from, and whose state the checkpoints keep.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.common import (
    EVAL_BATCH_SIZE,
    StopDecision,
    StopSignals,
    WireBytes,
    apply_step,
    traffic_summary,
)
from distbelief.algorithms.session import RunSession, RunSetup
from distbelief.config import Config, build_optimizer, config_hash, hashed_settings
from distbelief.data.hdf5 import training_rows
from distbelief.errors import ConfigError, DataError
from distbelief.model import kernels
from distbelief.records import checkpoint as ckpt
from distbelief.records.console import say
from distbelief.records.metrics import (
    LOG_EVERY_SECONDS,
    RunRecorder,
)
from distbelief.runtime.communicators.agreement import agree, polled_bcast, wait_all
from distbelief.runtime.health import watchdog
from distbelief.runtime.threads import set_blas_threads


@dataclass(frozen=True)
class Variant:
    """What a trainer built on this collective changes: its name (the run's, the
    checkpoints', the summary's), how it is described, and an outer step applied to each
    round's average (diloco.synchronous's OuterStep; None: the average is the result).
    `survivor` names the form that goes on without a lost replica."""

    name: str = "averaging"
    outer: Callable[[np.ndarray], Any] | None = None  # makes the outer step from the start
    narrow: bool = False  # with `outer`: deltas all-gathered as bfloat16 (Replica.average)
    survivor: str = "EASGD, optimizer.elastic_alpha,"
    what: str = "parameter averaging"


AVERAGING = Variant()

OPTIMIZER_PREFIX = "optimizer."  # a replica part's arrays that hold its optimizer state
LOST_ABORT_WAIT_S = 5.0  # how long a rank that is not the lowest live one leaves the abort


def check_job(config: Config, world_size: int, n_train: int, held_out: int = 0) -> None:
    """The job fits collective averaging: every rank a replica of one rank, each with at
    least a batch of rows. Pure, so every rank raises the same error before communicating."""
    cluster, name = config.cluster, config.optimizer.algorithm
    if cluster.ps_shards != 0:
        other = ("optimizer.asynchronous = true for asynchronous DiLoCo" if name == "diloco"
                 else "optimizer.elastic_alpha for EASGD")
        raise ConfigError(f"optimizer.algorithm = \"{name}\" in its collective form keeps "
                          f"no parameters on shards, but cluster.ps_shards = "
                          f"{cluster.ps_shards}; set ps_shards = 0, or set {other}")
    if cluster.partitions != 1:
        raise ConfigError(f"optimizer.algorithm = \"{name}\" runs replicas of one rank "
                          f"each; cluster.partitions = {cluster.partitions} is not supported")
    smallest = n_train // world_size
    if config.data.batch_size > smallest:
        rows = training_rows(n_train, held_out, config.data.path, config.data.validation)
        raise DataError(f"data.batch_size = {config.data.batch_size} is larger than the "
                        f"{smallest} training rows each of the {world_size} replicas gets, "
                        f"from the {rows}; use a smaller batch or fewer replicas")


@dataclass
class Replica:
    """One rank's replica: its data, parameters, optimizer and counters."""

    comm: MPI.Comm
    network: Any
    shard: Any
    params: np.ndarray
    optimizer: Any
    local_steps: int = 0
    averages: int = 0
    average_seconds: float = 0.0
    others: tuple[int, ...] = field(default=())
    outer: Any = None  # Variant.outer: applied to each average
    narrow: bool = False  # Variant.narrow
    wire: WireBytes = field(default_factory=WireBytes)  # this replica's bytes on the wire

    def __post_init__(self) -> None:
        if self.narrow:  # the narrowed round's buffers, named for the nonblocking calls
            n = self.params.size
            self._delta = np.zeros(n, dtype=np.float32)
            self._mine = np.zeros(n, dtype=np.uint16)
            self._gathered = np.zeros((self.size, n), dtype=np.uint16)

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    def wire_so_far(self) -> dict[str, int]:
        """metrics.jsonl's bytes so far, over all replicas: this rank's times R (each
        round, every replica hands the collective the same payload)."""
        return {"bytes_sent": self.wire.sent * self.size,
                "bytes_received": self.wire.received * self.size}

    def average(self, losses: np.ndarray, flags: np.ndarray) -> None:
        """Average the parameters over the replicas in place, sum `losses` and take the
        MAX of `flags`, in one polled round, then apply the outer step if there is one.
        Collective over comm (three Iallreduces).

        The bytes counted are each collective's payload, what this rank hands in and
        receives back (an all-reduce's own traffic depends on the MPI's algorithm: a ring
        moves 2 (R-1)/R of it each way)."""
        if self.narrow:
            self._average_narrowed(losses, flags)
            return
        t0 = time.perf_counter()
        requests = [self.comm.Iallreduce(MPI.IN_PLACE, self.params, op=MPI.SUM),
                    self.comm.Iallreduce(MPI.IN_PLACE, losses, op=MPI.SUM),
                    self.comm.Iallreduce(MPI.IN_PLACE, flags, op=MPI.MAX)]
        wait_all(requests, "the other replicas' parameters for the average", self.others)
        payload = self.params.nbytes + losses.nbytes + flags.nbytes
        self.wire.add(payload, payload)
        self.params *= np.float32(1.0 / self.size)
        if self.outer is not None:
            self.outer.apply(self.params)
        self.averages += 1
        self.average_seconds += time.perf_counter() - t0

    def _average_narrowed(self, losses: np.ndarray, flags: np.ndarray) -> None:
        """The outer step's round with bfloat16 deltas: this replica's delta (theta minus
        its parameters) rounded to bfloat16 and all-gathered (2 bytes a value out, 2 R
        back: an all-reduce cannot sum bfloat16), then widened and averaged in float32 in
        rank order, the same sum on every rank, and the outer step; `losses` and `flags`
        as in average. Collective over comm (an Iallgather and two Iallreduces)."""
        t0 = time.perf_counter()
        np.subtract(self.outer.theta, self.params, out=self._delta)
        kernels.bf16_narrow(self._delta, self._mine)
        requests = [self.comm.Iallgather(self._mine, self._gathered),
                    self.comm.Iallreduce(MPI.IN_PLACE, losses, op=MPI.SUM),
                    self.comm.Iallreduce(MPI.IN_PLACE, flags, op=MPI.MAX)]
        wait_all(requests, "the other replicas' deltas for the outer step", self.others)
        small = losses.nbytes + flags.nbytes
        self.wire.add(self._mine.nbytes + small, self._gathered.nbytes + small)
        for r in range(self.size):
            kernels.bf16_widen(self._gathered[r], self._delta, accumulate=r > 0)
        self._delta *= np.float32(1.0 / self.size)
        self.outer.apply_delta(self._delta, self.params)
        self.averages += 1
        self.average_seconds += time.perf_counter() - t0


def describe_rank(rank: int) -> str:
    return f"replica {rank} (rank {rank})"


def train(config: Config, comm: MPI.Comm, stream: IO[str] | None = sys.stdout,
          resume: str = "auto", variant: Variant = AVERAGING,
          setup: RunSetup | None = None) -> dict[str, Any] | None:
    """Train with periodic parameter averaging on the ranks of `comm`; the summary on rank
    0, None elsewhere. Collective over `comm` (every rank calls it with the same config).

    Validates the job first without communicating (ConfigError/DataError on every rank);
    any rank's UserError in the set-up is raised on every rank (agreement.agree). A lost
    replica ends the job (module docstring). `variant`: what a trainer built on this one
    changes (synchronous DiLoCo's outer step).
    """

    session = RunSession(variant.name, config, comm, stream, resume, setup=setup)
    info, network = session.info, session.network
    size, rank = comm.Get_size(), comm.Get_rank()
    check_job(config, size, info.n_train, info.held_out)
    set_blas_threads(config.run.threads or 1)
    path = session.choose_checkpoint(size, variant.name,
                                     why=" and each replica's optimizer state is its own")
    eval_set = agree(comm, lambda: session.load_eval_set() if rank == 0 else None)
    opt = config.optimizer
    params = network.init_params(config.run.seed)  # the same on every rank (same seed)
    outer = variant.outer(params) if variant.outer is not None else None
    replica = Replica(comm, network, session.train_shard(rank, size), params,
                      build_optimizer(config, params.size),
                      others=tuple(r for r in range(size) if r != rank), outer=outer,
                      narrow=variant.narrow and outer is not None)
    found = agree(comm, lambda: _restore(path, session.found, replica))
    if rank == 0:
        what = (f"{outer.describe()}, inner steps {opt.average_every}" if outer is not None
                else f"average every {opt.average_every} steps")
        session.describe_run(f"{size} replica(s), {what}, "
                             f"{network.layout.size:,d} parameters", len(eval_set[1]))
    recorder = session.open_recorder()
    saver = Saver(config, replica, recorder, stream,
                  last_step=found.step if found is not None else None, name=variant.name)
    with session.watched(describe_rank,
                         lambda lost, peers: _stop_for_lost(comm, peers, lost, saver,
                                                            variant)
                         ) as (signals, _):
        reason = _loop(session, replica, eval_set, saver, signals)
        saver.save()
        # Every replica's own count (the same in lockstep, but counted where it was spent).
        traffic = comm.gather(replica.wire.pair(), root=0)
    extras: dict[str, Any] = {
        "replicas": size, "average_every": opt.average_every,
        "averages": replica.averages, "average_seconds": replica.average_seconds}
    if outer is not None:
        extras.update(outer.summary())
    if rank == 0:
        extras.update(traffic_summary(traffic))
    return session.finish(reason, extras, saver.last_path,
                          steps_note=f" ({replica.averages} averages)")


def _loop(session: RunSession, replica: Replica, eval_set: Any, saver: Saver,
          signals: StopSignals) -> str:
    """Blocks of local steps, each ending with an average; returns why the run stopped.
    Collective over replica.comm."""
    config, recorder = session.config, session.recorder
    rules, size = session.rules, replica.size
    tau, batch_size = config.optimizer.average_every, config.data.batch_size
    eval_every = config.run.eval_every_seconds
    local_budget = -(-rules.max_steps // size) if rules.max_steps else 0
    grad = np.zeros_like(replica.params)
    losses = np.zeros(2, dtype=np.float64)  # this block's loss sum and step count
    decision = StopDecision()  # MAX-allreduced with the average
    verdict = np.zeros(1, dtype=np.int32)
    now = time.monotonic()
    next_log, next_eval = now + LOG_EVERY_SECONDS, now + eval_every
    next_save_time, next_save_step = saver.schedule(replica.local_steps * size, now)
    faults = session.faults  # test-only: kill:RANK:STEP
    pending_loss, pending_count, recent = 0.0, 0, math.nan
    while True:
        # Averages fall on multiples of tau, also after a resume; the budget cuts the last.
        steps = tau - replica.local_steps % tau
        if local_budget:
            steps = max(0, min(steps, local_budget - replica.local_steps))
        losses[:] = 0.0
        for _ in range(steps):
            x, y = replica.shard.next_batch(batch_size)
            losses[0] += replica.network.loss_and_grad(replica.params, x, y, grad)
            apply_step(replica.optimizer, replica.network, replica.params, grad,
                       replica.local_steps)
            replica.local_steps += 1
            faults.after_step(replica.local_steps, 0.0)
        losses[1] = steps
        step = replica.local_steps * size
        if recorder is not None:  # rank 0 owns the clock
            now = time.monotonic()
            spent = rules.budget_spent(step, now - recorder.start, recorder.collapsed)
            decision.encode(spent, now >= next_eval,
                            now >= next_save_time or step >= next_save_step)
        else:
            decision.encode()
        decision.merge(signals.received)
        moved = sum(replica.wire.pair())
        replica.average(losses, decision.flags)
        faults.after_transfer(sum(replica.wire.pair()) - moved)
        samples = step * batch_size
        if losses[1]:
            pending_loss, pending_count = pending_loss + losses[0], pending_count + losses[1]
        if not math.isfinite(losses[0]):  # the same sum on every rank: all stop here
            raise session.diverged(f"{losses[0]} at step {step}")
        reason = decision.reason
        if recorder is not None:
            now = time.monotonic()
            if (now >= next_log or reason) and pending_count:
                recent = pending_loss / pending_count
                pending_loss, pending_count = 0.0, 0
                recorder.log(step, samples, recent, learning_rate=replica.optimizer.rate(
                    max(replica.local_steps - 1, 0)), **replica.wire_so_far())
                next_log = now + LOG_EVERY_SECONDS
            recorder.progress(step, samples, recent)
        if reason:
            if reason not in StopSignals.NAMES and recorder is not None:
                _evaluate(replica, eval_set, recorder, step, samples, recent)
            return reason
        if decision.eval_due:
            if recorder is not None:
                result = _evaluate(replica, eval_set, recorder, step, samples, recent)
                verdict[0] = rules.target_reached(result)
            polled_bcast(replica.comm, verdict, "rank 0's evaluation", (0,))
            if verdict[0]:
                return rules.target_reason
            next_eval = time.monotonic() + eval_every
        if decision.save_due:
            saver.save()
            next_save_time, next_save_step = saver.schedule(step, time.monotonic())


def _evaluate(replica: Replica, eval_set: Any, recorder: RunRecorder, step: int,
              samples: int, recent: float) -> Any:
    """Evaluate the (just averaged) parameters on rank 0 and log it; the Evaluation."""
    x, y = eval_set
    result = replica.network.evaluate(replica.params, x, y, batch_size=EVAL_BATCH_SIZE)
    recorder.log_eval(step, samples, recent, result, params=replica.params,
                      **replica.wire_so_far())
    return result


# ------------------------------------------------------------------------------------------
# Checkpoints


class Saver:
    """When and how the replicas checkpoint, right after an average (all hold the same
    parameters): rank 0 the parameters, each replica its own part. Collective."""

    def __init__(self, config: Config, replica: Replica, recorder: RunRecorder | None,
                 stream: IO[str] | None, last_step: int | None, name: str = "averaging"):
        self.name = name
        run = config.run
        self.root = ckpt.checkpoint_root(run.out_dir)
        self.every_seconds, self.every_steps = run.checkpoint_every_seconds, \
            run.checkpoint_every_steps
        self.keep, self.settings = run.keep_checkpoints, hashed_settings(config)
        self.config_hash, self.batch_size = config_hash(config), config.data.batch_size
        self.replica, self.recorder, self.stream = replica, recorder, stream
        self.last_step = last_step
        self.last_path: Path | None = None

    def schedule(self, step: int, now: float) -> tuple[float, float]:
        """(monotonic time, total step) of the next periodic checkpoint; inf when off."""
        at_time = now + self.every_seconds if self.every_seconds else math.inf
        at_step = (step // self.every_steps + 1) * self.every_steps if self.every_steps \
            else math.inf
        return at_time, at_step

    def save(self) -> None:
        """Checkpoint the state right after an average, unless this step has one already.
        Collective over the replicas' communicator (three agreements and a gather); a
        failed write raises CheckpointError on every rank."""
        replica = self.replica
        step = replica.local_steps * replica.size
        if step == self.last_step:
            return
        comm, rank0 = replica.comm, replica.rank == 0
        began = time.monotonic()
        elapsed = comm.bcast(self.recorder.elapsed() if rank0 else None, root=0)
        meta = ckpt.CheckpointMeta(step, step * self.batch_size, elapsed, self.config_hash)
        partial = agree(comm, lambda: ckpt.prepare(self.root, step) if rank0 else None)
        partial = comm.bcast(partial, root=0)
        counters = {"step": step, "local_steps": replica.local_steps}
        arrays = {OPTIMIZER_PREFIX + name: value
                  for name, value in replica.optimizer.state().items()}
        record = agree(comm, lambda: ckpt.write_replica_part(
            partial, meta, replica.rank, replica.shard.state(), counters=counters,
            arrays=arrays))
        records = comm.gather(record, root=0)
        path = agree(comm, lambda: self._commit(partial, meta, records) if rank0 else None)
        self.last_step = step
        if rank0:
            self.last_path = path
            seconds = time.monotonic() - began
            self.recorder.log_event("checkpoint", step, meta.samples, at=meta.wall_seconds,
                                    seconds=seconds, path=path.name)
            say(self.stream, f"checkpoint {path} ({seconds:.2f}s)")

    def _commit(self, partial: Path, meta: ckpt.CheckpointMeta,
                records: list[ckpt.PartRecord]) -> Path:
        replica = self.replica
        size = replica.params.size
        outer = replica.outer.state() if replica.outer is not None else {}
        shard = ckpt.write_shard_part(partial, meta, 0, 0, size, replica.params, outer,
                                      {"step": meta.step})
        return ckpt.commit(self.root, meta, settings=self.settings, algorithm=self.name,
                           layout=replica.network.layout, shard_ranges=[(0, size)],
                           optimizer_state=list(outer), parts=[shard, *records],
                           num_replicas=replica.size, keep=self.keep)


def _restore(path: str | None, chosen: ckpt.Checkpoint | None,
             replica: Replica) -> ckpt.Checkpoint | None:
    """Load this replica's piece of the checkpoint at `path` (rank 0 verified all of it):
    the averaged parameters, its data position, local steps and optimizer state. Local;
    CheckpointError when it cannot be used here."""
    if path is None:
        return None
    found = chosen if chosen is not None else ckpt.Checkpoint(Path(path),
                                                              ckpt.read_manifest(path))
    try:
        params, outer = found.read_state(with_optimizer=replica.outer is not None)
        np.copyto(replica.params, params)
        if replica.outer is not None:
            replica.outer.load(replica.params, outer)
        saved = found.read_replica(replica.rank)
        replica.shard.load_state(saved.data_state)
        replica.optimizer.load_state({name[len(OPTIMIZER_PREFIX):]: value
                                      for name, value in saved.arrays.items()
                                      if name.startswith(OPTIMIZER_PREFIX)})
    except (ValueError, TypeError) as exc:
        raise ckpt.CheckpointError(f"checkpoint {found.path} cannot be resumed here: "
                                   f"{exc}") from exc
    replica.local_steps = saved.counters.get("local_steps", found.step // replica.size)
    return found


# ------------------------------------------------------------------------------------------
# A lost replica


def lost_replica_message(rank: int, how: str, last_step: int | None,
                         variant: Variant = AVERAGING) -> str:
    """The one line that ends a collective averaging run whose replica `rank` died."""
    survives = (f"the last checkpoint (step {last_step}) survives it: run the same command "
                f"again to resume from it" if last_step is not None else
                "no checkpoint was written yet, so a rerun starts over")
    return (f"replica {rank} (rank {rank}) is gone{how}: {variant.what} needs every "
            f"replica in each average, so the run stops; {survives} ({variant.survivor} "
            f"goes on without a lost replica)")


def _stop_for_lost(comm: MPI.Comm, peers: Any, lost: watchdog.RankLost, saver: Saver,
                   variant: Variant = AVERAGING) -> None:
    """End the job for a lost replica: the lowest live rank prints the line and aborts; the
    others give it LOST_ABORT_WAIT_S to do so, then abort themselves. Never returns."""
    size = comm.Get_size()
    live = [r for r in range(size) if r == comm.Get_rank() or not peers.gone(r)]
    message = lost_replica_message(lost.rank, peers.how_gone(lost.rank), saver.last_step,
                                   variant)
    if live and live[0] != comm.Get_rank():
        time.sleep(LOST_ABORT_WAIT_S)  # the lowest live rank aborts the job meanwhile
    watchdog.abort_and_leave(comm, message)
