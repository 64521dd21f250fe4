"""Single-process training (`optimizer.algorithm = "sgd"`).

One process, one model, one shard holding the whole training set: next batch -> loss and
gradient -> optimizer step, with evaluations on the test set every `run.eval_every_seconds`
of wall time (evaluation time counts) and one at the end. This is the baseline Downpour is
measured against, so the loop does nothing per step beyond those three calls and a clock read.

Checkpoints (distbelief.records.checkpoint) go to out_dir/checkpoints every
`run.checkpoint_every_seconds` of wall time and/or `run.checkpoint_every_steps` steps, and
always when the run stops, including on SIGTERM or SIGUSR1 (SLURM's time limit, or
`sbatch --signal`): the current step finishes, a checkpoint is written, and train() returns
normally without a final evaluation, so the job ends within a step plus a checkpoint
write. A first Ctrl-C (SIGINT) does the same and `train` exits 130 (StopSignals). A run
resumes from the newest valid checkpoint in its out_dir (see
`starting_checkpoint`); resuming restores parameters, optimizer state, step, samples,
training time so far and the data position, so a resumed run computes bit for bit what an
uninterrupted one would.

The lifecycle every trainer shares (run folder, data, evaluation set, the checkpoint to
start from, the recorder, the summary) is the run skeleton's (algorithms/session.py).
"""

from __future__ import annotations

import math
import sys
import time
from typing import IO, Any

import numpy as np

from distbelief.algorithms.checkpointer import Checkpointer, TrainState, restore
from distbelief.algorithms.common import (
    StopRules,
    StopSignals,
    TrainingDiverged,
    apply_step,
    evaluate,
    train_shard,
)
from distbelief.algorithms.session import RunSession, RunSetup
from distbelief.config import Config, build_optimizer
from distbelief.records.metrics import (
    LOG_EVERY_SECONDS,
)
from distbelief.runtime.threads import apply_thread_setting

# What the command line and the tests use from here.
__all__ = ["StopRules", "TrainingDiverged", "train"]


def train(config: Config, stream: IO[str] | None = sys.stdout,
          resume: str = "auto", setup: RunSetup | None = None) -> dict[str, Any]:
    """Train one model in this process until a stop rule fires; returns the run summary.

    Writes config.json, metrics.jsonl, summary.json and checkpoints to run.out_dir (see
    records.metrics, records.checkpoint) and progress lines to `stream` (None for
    silence). `resume` is one of RESUME_MODES; `setup`: what algorithms.launch found (None:
    the session finds it).
    """

    apply_thread_setting(config.run.threads)
    session = RunSession("sgd", config, None, stream, resume, setup=setup)
    info, network = session.info, session.network
    # Before config.json is rewritten: a refused resume leaves the run folder as it was.
    session.choose_checkpoint()
    start_from = session.found
    eval_set = session.load_eval_set()
    shard = train_shard(config, info, 0, 1)
    params = network.init_params(config.run.seed)
    optimizer = build_optimizer(config, params.size)
    state = TrainState()
    if start_from is not None:
        restore(start_from, params, optimizer, shard, state)
        network.step = state.step  # the dropout masks go on where they were
    session.describe_run(f"{network.layout.size:,d} parameters", len(eval_set[1]))

    recorder = session.open_recorder()
    saver = Checkpointer(config, network.layout, params, optimizer, shard, recorder, stream,
                         last_step=state.step if start_from is not None else None)
    # Overflow in a diverging run is reported once, as TrainingDiverged, not as a stream of
    # numpy warnings.
    with recorder, np.errstate(over="ignore", invalid="ignore"), StopSignals() as signals:
        reason = _train_loop(session, shard, optimizer, params, saver, signals, state)
        saver.save(state)
        return session.finish(reason, checkpoint=saver.last_path)


def _train_loop(session: RunSession, shard: Any, optimizer: Any, params: np.ndarray,
                saver: Checkpointer, signals: StopSignals, state: TrainState) -> str:
    """The hot loop; returns why it stopped. The recorder has the last step's evaluation,
    except after a signal, when stopping promptly matters more. `state` is kept current
    at every checkpoint and on return."""
    config, network, rules = session.config, session.network, session.rules
    eval_set, recorder = session.eval_set, session.recorder
    batch_size = config.data.batch_size
    eval_every = config.run.eval_every_seconds
    grad = np.zeros_like(params)
    clock = time.monotonic
    start = recorder.start
    now = clock()
    next_log = now + LOG_EVERY_SECONDS
    next_eval = now + eval_every
    next_save_time, next_save_step = saver.schedule(state.step, now)
    step, samples = state.step, state.samples
    loss_sum, loss_count, recent_loss = 0.0, 0, math.nan
    # A resumed run whose budget is already spent trains no further step.
    reason = rules.budget_spent(step, now - start, recorder.collapsed)
    while not reason:
        x, y = shard.next_batch(batch_size)
        loss_sum += network.loss_and_grad(params, x, y, grad)
        apply_step(optimizer, network, params, grad, step)
        step += 1
        samples += len(y)
        loss_count += 1
        now = clock()
        reason = rules.budget_spent(step, now - start, recorder.collapsed) or signals.received
        if now >= next_log or reason:
            recent_loss = loss_sum / loss_count
            loss_sum, loss_count = 0.0, 0
            recorder.log(step, samples, recent_loss,
                         learning_rate=optimizer.rate(max(step - 1, 0)))
            next_log = now + LOG_EVERY_SECONDS
            if not math.isfinite(recent_loss):
                raise session.diverged(f"{recent_loss} at step {step}")
        if reason:
            break
        if now >= next_eval:
            if loss_count:
                recent_loss = loss_sum / loss_count  # fresher than the last logged mean
            result = evaluate(network, params, eval_set)
            recorder.log_eval(step, samples, recent_loss, result, params=params)
            if rules.target_reached(result):
                state.step, state.samples = step, samples
                return rules.target_reason
            # Counted from the end of this evaluation, so training always gets the
            # interval, however long evaluating takes.
            next_eval = clock() + eval_every
        if now >= next_save_time or step >= next_save_step:
            if not math.isfinite(loss_sum):  # never checkpoint parameters that diverged
                raise session.diverged(f"{loss_sum} at step {step}")
            state.step, state.samples = step, samples
            saver.save(state)
            next_save_time, next_save_step = saver.schedule(step, clock())
        recorder.progress(step, samples, recent_loss)
    state.step, state.samples = step, samples
    if reason not in StopSignals.NAMES:
        recorder.log_eval(step, samples, recent_loss, evaluate(network, params, eval_set),
                          params=params)
    return reason
