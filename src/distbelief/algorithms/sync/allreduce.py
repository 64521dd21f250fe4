"""Synchronous SGD without backup workers: every rank is a replica, and each step's
gradients are summed with a polled MPI_Iallreduce (the package docstring says what the
algorithm is and where it comes from).

One step on every replica, in lockstep:

    batch -> loss and gradient -> Iallreduce(SUM) of [gradient, loss] and Iallreduce(MAX)
    of the step's decisions -> the same optimizer step on every replica

The two collectives are issued together and completed with back-off sleeps
(runtime.communicators.agreement.wait_all), never with a spinning MPI_Wait: with more ranks than
cores a spinning waiter starves the replicas it waits for (DESIGN.md). Their buffers are
named arrays that live for the whole run, never temporaries (docs/development.md: a
buffer given to a non-blocking call must outlive it).

The decisions travel with the gradient, so deciding costs no extra round trip: rank 0
owns the clock (max_seconds, when to evaluate, when to checkpoint) and every rank can
raise a stop code (a signal reached it); MAX makes the result the same everywhere, so all
replicas evaluate, checkpoint and stop at the same step. An evaluation is collective too:
each replica evaluates 1/R of the evaluation set and the counts are summed, so every
replica knows whether the target was reached.

A replica that dies never joins the next allreduce, which can then never complete. The
polled wait asks the liveness machinery (runtime.health.liveness through the stall watchdog: a
gone process on this node, a stale heartbeat on another) between polls, and the first
replica to notice prints one line naming the lost rank and aborts the job.

Checkpoints have one writer, rank 0, which holds everything (the parameters and the
optimizer state are the same on every replica); the others send it their data positions
(one small gather), so a resumed run continues each replica's batch sequence. Resuming
needs the same number of replicas.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from pathlib import Path
from typing import IO, Any

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.common import (
    EVAL_BATCH_SIZE,
    StopDecision,
    StopSignals,
    WireBytes,
    eval_split,
    figures_of,
    traffic_summary,
)
from distbelief.algorithms.session import RunSession, RunSetup
from distbelief.config import Config, build_optimizer, config_hash, hashed_settings
from distbelief.records import checkpoint as ckpt
from distbelief.records.console import say
from distbelief.records.metrics import LOG_EVERY_SECONDS, ResumePoint
from distbelief.runtime.communicators.agreement import wait_all
from distbelief.runtime.health import watchdog
from distbelief.runtime.threads import set_blas_threads


def lost_replica_line(rank: int) -> str:
    """What a run without backup workers says when replica `rank` is gone."""
    return (f"replica {rank} (rank {rank}) is gone: algorithm = \"sync\" without "
            f"backup_workers cannot go on, as every step's allreduce needs every replica. "
            f"Set optimizer.backup_workers = k (k replicas may be lost) or use algorithm = "
            f"\"downpour\" to survive a lost replica; run the same command again to resume "
            f"from the last checkpoint")


def train(config: Config, comm: MPI.Comm, stream: IO[str] | None = sys.stdout,
          resume: str = "auto", setup: RunSetup | None = None) -> dict[str, Any] | None:
    """Synchronous SGD over the ranks of `comm`, all replicas; the summary on rank 0,
    None elsewhere. Collective over `comm`."""

    session = RunSession("sync", config, comm, stream, resume, setup=setup)
    rank, replicas = comm.Get_rank(), comm.Get_size()
    set_blas_threads(config.run.threads or 1)
    network = session.network
    start_path = session.choose_checkpoint(replicas, "synchronous",
                                           why=" (their data positions)")
    eval_set = _eval_slice(session, rank, replicas)
    shard = session.train_shard(rank, replicas)
    params = network.init_params(config.run.seed)
    optimizer = build_optimizer(config, params.size)
    state = {"step": 0, "samples": 0}
    if start_path is not None:
        restore(Path(start_path), rank, params, optimizer, shard, state)
    session.describe_run(f"{replicas} replicas (allreduce, no backup workers), "
                         f"{network.layout.size:,d} parameters", eval_set[2])
    session.open_recorder()
    run = _Run(session, comm, shard, optimizer, params, eval_set, state)

    def describe(r: int) -> str:
        return f"replica {r} (rank {r})"

    def on_lost(lost: watchdog.RankLost, peers: Any) -> None:
        if rank != min(r for r in range(replicas) if r != lost.rank):
            time.sleep(1.0)  # the lowest survivor speaks for all: one line, not R - 1
        watchdog.abort_and_leave(comm, lost_replica_line(lost.rank))

    with session.watched(describe, on_lost) as (signals, _):
        reason = run.loop(signals)
        run.checkpoint(final=True)
        identical = run.replicas_identical()
        traffic = comm.gather(run.wire.pair(), root=0)
    return session.finish(reason, {
        "replicas": replicas, "backup_workers": 0, "dropped_gradients": 0,
        "replicas_identical": identical,
        **(traffic_summary(traffic) if rank == 0 else {})}, run.last_path,
        eval_samples=eval_set[2],
        note=f"; replicas identical: {'yes' if identical else 'NO'}")


def _eval_slice(session: RunSession, rank: int,
                replicas: int) -> tuple[np.ndarray, np.ndarray, int]:
    """This replica's contiguous 1/R of the evaluation set (the first run.eval_samples of
    the split, or all), read alone: the file system serves each rank its share, not the
    whole set; and the whole set's size."""
    from distbelief.data.hdf5 import model_input, read_rows

    info = session.info
    split = eval_split(info)
    total = {"test": info.n_test, "validation": info.n_val}[split]
    total = min(total, session.config.run.eval_samples or total)
    bounds = np.linspace(0, total, replicas + 1).astype(int)
    x, y = read_rows(info, split, int(bounds[rank]), int(bounds[rank + 1]))
    return model_input(info, x), y, total


def restore(path: Path, rank: int, params: np.ndarray, optimizer: Any, shard: Any,
            state: dict[str, int]) -> ResumePoint:
    """Load the checkpoint rank 0 chose and verified (starting_checkpoint) into this
    replica's objects: the shared parameters and optimizer state, its own data position."""
    found = ckpt.Checkpoint(path, ckpt.read_manifest(path))
    saved, optimizer_state = found.read_state()
    np.copyto(params, saved)
    try:
        optimizer.load_state(optimizer_state)
        shard.load_state(found.read_replica(rank).data_state)
    except (ValueError, TypeError) as exc:
        raise ckpt.CheckpointError(f"checkpoint {found.path} cannot be resumed here: "
                                   f"{exc}") from exc
    state["step"], state["samples"] = found.step, found.samples
    return ResumePoint(found.step, found.samples, found.wall_seconds, found.path.name)


def write_checkpoint(config: Config, layout: Any, params: np.ndarray, optimizer: Any,
                     data_states: dict[int, dict], state: dict[str, int], wall: float,
                     num_replicas: int, lost: tuple[int, ...] = ()) -> Path:
    """Commit a checkpoint of a sync run from its one writer: the whole vector and the
    optimizer state as shard part 0, every replica of `data_states` in one part. No
    communication."""
    meta = ckpt.CheckpointMeta(state["step"], state["samples"], wall, config_hash(config))
    root = ckpt.checkpoint_root(config.run.out_dir)
    partial = ckpt.prepare(root, meta.step)
    counters = {"step": state["step"], "samples": state["samples"]}
    records = [ckpt.write_shard_part(partial, meta, 0, 0, layout.size, params,
                                     optimizer.state(), counters)]
    records.append(ckpt.write_replicas_part(partial, meta, [
        ckpt.ReplicaState(r, counters, data_states[r], None, {}) for r in sorted(data_states)]))
    return ckpt.commit(root, meta, settings=hashed_settings(config), algorithm="sync",
                       layout=layout, shard_ranges=[(0, layout.size)],
                       optimizer_state=list(optimizer.state()), parts=records,
                       num_replicas=num_replicas, keep=config.run.keep_checkpoints,
                       lost_replicas=lost)


class _Run:
    """One replica's side of the lockstep loop, its evaluations and checkpoints."""

    def __init__(self, session: RunSession, comm: MPI.Comm, shard: Any, optimizer: Any,
                 params: np.ndarray, eval_set: tuple, state: dict[str, int]):
        self.session, self.config, self.comm = session, session.config, comm
        self.network, self.shard = session.network, shard
        self.optimizer, self.params, self.eval_set = optimizer, params, eval_set
        self.recorder, self.state, self.stream = session.recorder, state, session.stream
        self.rank, self.replicas = comm.Get_rank(), comm.Get_size()
        self.others = [r for r in range(self.replicas) if r != self.rank]
        self.last_path: str | None = None
        self.last_saved = state["step"] if state["step"] else None
        self.recent_loss = math.nan
        self.wire = WireBytes()  # this replica's, for summary.json

    # -- the loop

    def loop(self, signals: StopSignals) -> str:
        """Train until a stop rule fires; returns why. Collective over the replicas."""
        config, comm, n = self.config, self.comm, self.params.size
        rules = self.session.rules
        batch = config.data.batch_size
        run = config.run
        # Named buffers for the collectives (they must outlive each non-blocking call).
        send = np.zeros(n + 1, dtype=np.float32)  # [gradient, loss]
        total = np.zeros_like(send)
        vote, decided = StopDecision(), StopDecision()  # this rank's, and the MAX of all
        grad, mean_grad = send[:n], total[:n]
        faults = self.session.faults  # test-only
        start = self.recorder.start if self.recorder else time.monotonic()
        now = time.monotonic()
        next_log, next_eval = now + LOG_EVERY_SECONDS, now + run.eval_every_seconds
        save_every_s = run.checkpoint_every_seconds or math.inf
        next_save = now + save_every_s
        step, samples = self.state["step"], self.state["samples"]
        loss_sum, loss_count = 0.0, 0
        # A resumed run that used its budget stops at once: rank 0's clock decides, for all.
        spent = comm.bcast(rules.budget_spent(step, now - start) if self.recorder else None)
        if spent:
            return spent
        while True:
            x, y = self.shard.next_batch(batch)
            began = time.monotonic()
            send[n] = self.network.loss_and_grad(self.params, x, y, grad)
            faults.after_step(step + 1, time.monotonic() - began)
            now = time.monotonic()
            if self.recorder is not None:  # rank 0 owns the clock
                spent = rules.budget_spent(step + 1, now - start, self.recorder.collapsed)
                every = run.checkpoint_every_steps
                vote.encode(spent, now >= next_eval,
                            now >= next_save or bool(every and (step + 1) % every == 0))
            elif rules.max_steps and step + 1 >= rules.max_steps:
                vote.encode("max_steps")
            else:
                vote.encode()
            vote.merge(signals.received)
            wait_all([comm.Iallreduce(send, total, op=MPI.SUM),
                      comm.Iallreduce(vote.flags, decided.flags, op=MPI.MAX)],
                     "the step's gradient allreduce", self.others)
            self.wire.add(send.nbytes + vote.flags.nbytes,
                          total.nbytes + decided.flags.nbytes)
            faults.after_transfer(send.nbytes + vote.flags.nbytes + total.nbytes
                                  + decided.flags.nbytes)
            loss = float(total[n]) / self.replicas
            if not math.isfinite(loss):  # the same sum everywhere: every replica stops
                raise self.session.diverged(f"{loss} at step {step + 1}")
            mean_grad *= np.float32(1.0 / self.replicas)
            self.optimizer.step(self.params, mean_grad, update=step)
            step, samples = step + 1, samples + batch * self.replicas
            self.state["step"], self.state["samples"] = step, samples
            loss_sum, loss_count = loss_sum + loss, loss_count + 1
            reason = decided.reason
            if self.recorder is not None:
                if now >= next_log or reason:
                    self.recent_loss, loss_sum, loss_count = loss_sum / loss_count, 0.0, 0
                    self.recorder.log(step, samples, self.recent_loss,
                                      learning_rate=self.optimizer.rate(step - 1),
                                      **self.wire_so_far())
                    next_log = now + LOG_EVERY_SECONDS
                self.recorder.progress(step, samples, self.recent_loss)
            if reason:
                if reason not in StopSignals.NAMES:  # on a signal, stop promptly
                    self.evaluate()
                return reason
            if decided.eval_due:
                if loss_count:
                    self.recent_loss = loss_sum / loss_count
                if rules.target_reached(self.evaluate()):
                    return rules.target_reason
                next_eval = time.monotonic() + run.eval_every_seconds
            if decided.save_due:
                self.checkpoint()
                next_save = time.monotonic() + save_every_s

    def wire_so_far(self) -> dict[str, int]:
        """metrics.jsonl's bytes so far, over all replicas: this rank's times R (every
        replica hands each collective the same payload in lockstep)."""
        return {"bytes_sent": self.wire.sent * self.replicas,
                "bytes_received": self.wire.received * self.replicas}

    # -- collective pieces

    def evaluate(self) -> Any:
        """The Evaluation of the (identical) parameters, each replica evaluating its slice
        of the evaluation set and the tallies summed (model.losses); logged by rank 0.
        Collective (one polled Iallreduce)."""
        x, y, _ = self.eval_set
        figures = figures_of(self.network)
        part = (self.network.tally(self.params, x, y, EVAL_BATCH_SIZE) if len(y)
                else figures.empty_tally())
        summed = np.zeros_like(part)
        wait_all([self.comm.Iallreduce(part, summed, op=MPI.SUM)], "an evaluation",
                 self.others)
        self.wire.add(part.nbytes, summed.nbytes)
        result = figures.evaluation(summed)
        if self.recorder is not None:
            self.recorder.log_eval(self.state["step"], self.state["samples"],
                                   self.recent_loss, result, params=self.params,
                                   **self.wire_so_far())
        return result

    def checkpoint(self, final: bool = False) -> None:
        """Rank 0 commits a checkpoint of the current step with every replica's data
        position (a gather to rank 0). Collective. `final`: the one written at the end,
        unless this step has one already."""
        if final and self.state["step"] == self.last_saved:
            return
        with watchdog.current().waiting("the data positions for a checkpoint",
                                        self.others):
            states = self.comm.gather(self.shard.state(), root=0)
        self.last_saved = self.state["step"]
        if self.recorder is None:
            return
        began = time.monotonic()
        wall = self.recorder.elapsed()
        path = write_checkpoint(self.config, self.network.layout, self.params,
                                self.optimizer, dict(enumerate(states)), self.state, wall,
                                self.replicas)
        seconds = time.monotonic() - began
        self.last_path = str(path)
        self.recorder.log_event("checkpoint", self.state["step"], self.state["samples"],
                                at=wall, seconds=seconds, path=path.name)
        say(self.stream, f"checkpoint {path} ({seconds:.2f}s)")

    def replicas_identical(self) -> bool:
        """Whether every replica holds the same parameters and optimizer state, bit for bit
        (a SHA-256 digest of each, gathered). Collective."""
        digest = hashlib.sha256(self.params.tobytes())
        for _, values in sorted(self.optimizer.state().items()):
            digest.update(values.tobytes())
        mine = digest.hexdigest()
        with watchdog.current().waiting("the final parameter check", self.others):
            sums = self.comm.allgather(mine)
        return len(set(sums)) == 1
