"""Single-process training (`optimizer.algorithm = "sgd"`), and the pieces every trainer shares.

One process, one model, one shard holding the whole training set: next batch -> loss and
gradient -> optimizer step, with evaluations on the test set every `run.eval_every_seconds`
of wall time (evaluation time counts) and one at the end. This is the baseline Downpour is
measured against, so the loop does nothing per step beyond those three calls and a clock read.

Checkpoints (distbelief.records.checkpoint) go to out_dir/checkpoints every
`run.checkpoint_every_seconds` of wall time and/or `run.checkpoint_every_steps` steps, and
always when the run stops, including on SIGTERM or SIGUSR1 (SLURM's time limit, or
`sbatch --signal`): the current step finishes, a checkpoint is written, and train() returns
normally without a final evaluation, so the job ends within a step plus a checkpoint
write. A run resumes from the newest valid checkpoint in its out_dir (see
`starting_checkpoint`); resuming restores parameters, optimizer state, step, samples,
training time so far and the data position, so a resumed run computes bit for bit what an
uninterrupted one would.

Shared with the Downpour replicas:
    prepare_run_dir(config)          out_dir created, config.json written
    open_data(config)                (DatasetInfo, Network) checked against each other
    load_eval_set(config, info)      the test samples evaluations use
    StopRules.from_config(config)    max_steps / max_seconds / target_accuracy
    evaluate(network, params, eval_set) -> (test_loss, test_accuracy)
    starting_checkpoint(config, layout, resume, stream)   which checkpoint to resume from
    StopSignals()                    SIGTERM/SIGUSR1 -> a flag the loop polls
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Self

import numpy as np

from distbelief.config import Config, build_network, config_hash, hashed_settings
from distbelief.errors import UserError
from distbelief.records import checkpoint as ckpt
from distbelief.records.metrics import (
    DISCARDED_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    ResumePoint,
    RunRecorder,
)
from distbelief.runtime.threads import apply_thread_setting

LOG_EVERY_SECONDS = 0.5
"""How often a training line goes to metrics.jsonl (per step would be thousands a second)."""

EVAL_BATCH_SIZE = 1000


def prepare_run_dir(config: Config) -> Path:
    """Create run.out_dir and write the resolved configuration there as config.json."""
    out_dir = config.run.out_dir
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        record = {**config.to_dict(), "config_hash": config_hash(config),
                  "source": str(config.source) if config.source else None}
        (out_dir / "config.json").write_text(json.dumps(record, indent=2) + "\n")
    except OSError as e:
        raise UserError(f"cannot write to run.out_dir {out_dir}: {e.strerror or e}") from e
    return out_dir


def open_data(config: Config) -> tuple[Any, Any]:
    """(DatasetInfo, Network) for the config: the data file opened, the model built on it."""
    from distbelief.data.hdf5 import open_dataset

    info = open_dataset(config.data.path)
    return info, build_network(config, info)


def load_eval_set(config: Config, info: Any) -> tuple[np.ndarray, np.ndarray]:
    """The test samples every evaluation uses: the first run.eval_samples, or all."""
    from distbelief.data.hdf5 import load_test

    return load_test(info, limit=config.run.eval_samples or None)


def evaluate(network: Any, params: np.ndarray,
             eval_set: tuple[np.ndarray, np.ndarray]) -> tuple[float, float]:
    """(test loss, test accuracy) of `params` on the evaluation set."""
    x, y = eval_set
    loss, accuracy = network.evaluate(params, x, y, batch_size=EVAL_BATCH_SIZE)
    return float(loss), float(accuracy)


@dataclass(frozen=True)
class StopRules:
    """When a run ends. Zero means no limit; the target is checked at evaluations."""

    max_steps: int = 0
    max_seconds: float = 0.0
    target_accuracy: float | None = None

    @classmethod
    def from_config(cls, config: Config) -> StopRules:
        run = config.run
        return cls(run.max_steps, run.max_seconds, run.target_accuracy)

    def budget_spent(self, step: int, elapsed: float) -> str | None:
        """"max_steps" or "max_seconds" once that budget is used up, else None."""
        if self.max_steps and step >= self.max_steps:
            return "max_steps"
        if self.max_seconds and elapsed >= self.max_seconds:
            return "max_seconds"
        return None

    def target_reached(self, test_accuracy: float) -> bool:
        return self.target_accuracy is not None and test_accuracy >= self.target_accuracy


class TrainingDiverged(UserError):
    """The training loss became NaN or infinite (usually: the learning rate is too high)."""


RESUME_MODES = ("auto", "require", "fresh")
"""train(resume=...): "auto" continues from a valid checkpoint in out_dir if there is one
(the default, so a requeued job simply resumes); "require" (train --resume) fails without
one; "fresh" (train --fresh) moves the previous run's files aside and starts over."""


class StopSignals:
    """SIGTERM and SIGUSR1 ask the training loop to stop after the current step.

    SLURM sends SIGTERM at the time limit (then SIGKILL after KillWait) and any signal
    chosen with `sbatch --signal=USR1@120` some time before it. The handler only records
    the signal's name in `received`, which the loop polls once a step; everything else
    (the checkpoint, the summary) happens in the loop, outside the handler. Handlers can
    only be installed from the main thread; elsewhere this does nothing. The previous
    handlers come back on exit.
    """

    NAMES = ("SIGTERM", "SIGUSR1")

    def __init__(self) -> None:
        self.received: str | None = None
        self.counts = dict.fromkeys(self.NAMES, 0)  # how many of each arrived
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signal.Signals(signum).name
        self.counts[self.received] += 1

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for name in self.NAMES:
                number = getattr(signal, name)
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()


def train(config: Config, stream: IO[str] | None = sys.stdout,
          resume: str = "auto") -> dict[str, Any]:
    """Train one model in this process until a stop rule fires; returns the run summary.

    Writes config.json, metrics.jsonl, summary.json and checkpoints to run.out_dir (see
    records.metrics, records.checkpoint) and progress lines to `stream` (None for
    silence). `resume` is one of RESUME_MODES.
    """
    from distbelief.data.hdf5 import TrainShard
    from distbelief.model.optimizers import make_optimizer

    if resume not in RESUME_MODES:
        raise ValueError(f"resume must be one of {RESUME_MODES}, got {resume!r}")
    apply_thread_setting(config.run.threads)
    info, network = open_data(config)
    # Before config.json is rewritten: a refused resume leaves the run folder as it was.
    start_from = starting_checkpoint(config, network.layout, resume, stream)
    out_dir = prepare_run_dir(config)
    eval_set = load_eval_set(config, info)
    shard = TrainShard(info, rank=0, num_ranks=1, seed=config.run.seed)
    params = network.init_params(config.run.seed)
    opt = config.optimizer
    optimizer = make_optimizer(opt.adagrad, opt.learning_rate, params.size)
    state = TrainState()
    resume_point = None
    if start_from is not None:
        resume_point = restore(start_from, params, optimizer, shard, state)
    _print(stream, f"distbelief: sgd, {network.layout.size:,d} parameters, data "
                   f"{info.path} ({info.n_train} train / {len(eval_set[1])} eval samples), "
                   f"out {out_dir}\n{network.describe()}")

    recorder = RunRecorder(out_dir, config.run.progress_every_seconds, stream,
                           target_accuracy=config.run.target_accuracy, resume=resume_point)
    saver = Checkpointer(config, network.layout, params, optimizer, shard, recorder, stream,
                         last_step=state.step if start_from is not None else None)
    # Overflow in a diverging run is reported once, as TrainingDiverged, not as a stream of
    # numpy warnings.
    with recorder, np.errstate(over="ignore", invalid="ignore"), StopSignals() as signals:
        reason = _train_loop(config, network, shard, optimizer, params, eval_set, recorder,
                             saver, signals, state)
        saver.save(state)
        summary = recorder.finish({
            "algorithm": "sgd", "stop_reason": reason, "config_hash": config_hash(config),
            "num_params": int(network.layout.size), "eval_samples": len(eval_set[1]),
            "resumed_from": str(start_from.path) if start_from is not None else None,
            "checkpoint": str(saver.last_path) if saver.last_path else None,
        })
    _print(stream, _summary_line(summary, out_dir))
    return summary


@dataclass
class TrainState:
    """The loop's counters, kept outside it so checkpoints and the summary can read them."""

    step: int = 0
    samples: int = 0


def _train_loop(config: Config, network: Any, shard: Any, optimizer: Any,
                params: np.ndarray, eval_set: tuple[np.ndarray, np.ndarray],
                recorder: RunRecorder, saver: Checkpointer, signals: StopSignals,
                state: TrainState) -> str:
    """The hot loop; returns why it stopped. The recorder has the last step's evaluation,
    except after a signal, when stopping promptly matters more. `state` is kept current
    at every checkpoint and on return."""
    rules = StopRules.from_config(config)
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
    reason = rules.budget_spent(step, now - start)
    while not reason:
        x, y = shard.next_batch(batch_size)
        loss_sum += network.loss_and_grad(params, x, y, grad)
        optimizer.step(params, grad)
        step += 1
        samples += len(y)
        loss_count += 1
        now = clock()
        reason = rules.budget_spent(step, now - start) or signals.received
        if now >= next_log or reason:
            recent_loss = loss_sum / loss_count
            loss_sum, loss_count = 0.0, 0
            recorder.log(step, samples, recent_loss)
            next_log = now + LOG_EVERY_SECONDS
            if not math.isfinite(recent_loss):
                _diverged(recorder, step, samples, recent_loss, config)
        if reason:
            break
        if now >= next_eval:
            if loss_count:
                recent_loss = loss_sum / loss_count  # fresher than the last logged mean
            test_loss, accuracy = evaluate(network, params, eval_set)
            recorder.log_eval(step, samples, recent_loss, accuracy, test_loss)
            if rules.target_reached(accuracy):
                state.step, state.samples = step, samples
                return "target_accuracy"
            # Counted from the end of this evaluation, so training always gets the
            # interval, however long evaluating takes.
            next_eval = clock() + eval_every
        if now >= next_save_time or step >= next_save_step:
            if not math.isfinite(loss_sum):  # never checkpoint parameters that diverged
                _diverged(recorder, step, samples, loss_sum, config)
            state.step, state.samples = step, samples
            saver.save(state)
            next_save_time, next_save_step = saver.schedule(step, clock())
        recorder.progress(step, samples, recent_loss)
    state.step, state.samples = step, samples
    if reason not in StopSignals.NAMES:
        test_loss, accuracy = evaluate(network, params, eval_set)
        recorder.log_eval(step, samples, recent_loss, accuracy, test_loss)
    return reason


class Checkpointer:
    """When and what the single-process trainer checkpoints: one shard part (the whole
    vector and the optimizer state) and one replica part (the data position)."""

    def __init__(self, config: Config, layout: Any, params: np.ndarray, optimizer: Any,
                 shard: Any, recorder: RunRecorder, stream: IO[str] | None,
                 last_step: int | None = None):
        run = config.run
        self.root = ckpt.checkpoint_root(run.out_dir)
        self.every_seconds, self.every_steps = run.checkpoint_every_seconds, \
            run.checkpoint_every_steps
        self.keep = run.keep_checkpoints
        self.settings = hashed_settings(config)
        self.config_hash = config_hash(config)
        self.layout, self.params, self.optimizer, self.shard = layout, params, optimizer, shard
        self.recorder, self.stream = recorder, stream
        self.last_step = last_step  # the step of the checkpoint this run started from
        self.last_path: Path | None = None

    def schedule(self, step: int, now: float) -> tuple[float, float]:
        """(monotonic time, step) of the next periodic checkpoint; inf when off. Steps are
        multiples of checkpoint_every_steps, also after a resume from another step."""
        at_time = now + self.every_seconds if self.every_seconds else math.inf
        at_step = (step // self.every_steps + 1) * self.every_steps if self.every_steps \
            else math.inf
        return at_time, at_step

    def save(self, state: TrainState) -> Path | None:
        """Checkpoint the current state, unless this step is checkpointed already."""
        if state.step == self.last_step:
            return None
        began = time.monotonic()
        meta = ckpt.CheckpointMeta(state.step, state.samples, self.recorder.elapsed(),
                                   self.config_hash)
        counters = {"step": state.step, "samples": state.samples}
        path = ckpt.save_local(
            self.root, meta, settings=self.settings, algorithm="sgd", layout=self.layout,
            params=self.params, optimizer_state=self.optimizer.state(),
            data_state=self.shard.state(), counters=counters, keep=self.keep)
        seconds = time.monotonic() - began
        self.last_step, self.last_path = state.step, path
        # Timed at the state it holds, so that a run resumed from it, which continues
        # from that time, keeps the times in metrics.jsonl increasing.
        self.recorder.log_event("checkpoint", state.step, state.samples, at=meta.wall_seconds,
                                seconds=seconds, path=path.name)
        _print(self.stream, f"checkpoint {path} ({seconds:.2f}s)")
        return path


def restore(found: ckpt.Checkpoint, params: np.ndarray, optimizer: Any, shard: Any,
            state: TrainState) -> ResumePoint:
    """Load a verified, compatible single-process checkpoint into the run's objects."""
    saved, optimizer_state = found.read_state()
    np.copyto(params, saved)
    replica = found.read_replica(0)
    try:
        optimizer.load_state(optimizer_state)
        shard.load_state(replica.data_state)
    except (ValueError, TypeError) as exc:
        raise ckpt.CheckpointError(f"checkpoint {found.path} cannot be resumed here: "
                                   f"{exc}") from exc
    state.step, state.samples = found.step, found.samples
    return ResumePoint(found.step, found.samples, found.wall_seconds, found.path.name)


def starting_checkpoint(config: Config, layout: Any, resume: str,
                        stream: IO[str] | None) -> ckpt.Checkpoint | None:
    """The checkpoint a run starts from, or None for a fresh start (see RESUME_MODES).

    Damaged checkpoints newer than the one chosen are reported and renamed to .damaged
    (kept, never loaded); leftovers of a killed commit are removed. A checkpoint of another
    model or configuration is refused (CheckpointMismatch) rather than overwritten, and so
    is a folder whose checkpoints are all damaged. Call it on the committer only (rank 0),
    before any writer starts.
    """
    out_dir = config.run.out_dir
    root = ckpt.checkpoint_root(out_dir)
    if resume == "fresh":
        moved = archive_previous_run(out_dir)
        if moved is not None:
            _print(stream, f"distbelief: --fresh: moved the previous run's files to {moved}")
        return None
    found, damaged = ckpt.find_latest(root)
    for _, problem in damaged:
        _print(stream, f"distbelief: warning: {problem}")
    if found is None:
        if damaged:
            raise ckpt.CheckpointError(
                f"no valid checkpoint in {root}: all {len(damaged)} are damaged (see the "
                f"warnings above); train --fresh moves them aside and starts over")
        if resume == "require":
            raise ckpt.CheckpointError(f"train --resume: there is no checkpoint in {root}")
        ckpt.clean_leftovers(root)
        return None
    try:
        found.check_compatible(hashed_settings(config), layout)
    except ckpt.CheckpointMismatch as exc:
        raise ckpt.CheckpointMismatch(f"{exc}. To train this configuration, pass --fresh "
                                      "(moves the old run aside) or choose another "
                                      "run.out_dir") from exc
    for path, _ in damaged:
        _print(stream, f"distbelief: set {path.name} aside as {ckpt.set_aside(path).name}")
    ckpt.clean_leftovers(root)
    why = "" if resume == "require" else " (found in run.out_dir; train --fresh starts over)"
    _print(stream, f"distbelief: resuming from {found.path} at step {found.step}, "
                   f"{found.samples:,d} samples, {found.wall_seconds:.1f}s trained{why}")
    return found


ARCHIVED_NAMES = (ckpt.CHECKPOINTS_DIR, METRICS_FILE, DISCARDED_FILE, SUMMARY_FILE,
                  "config.json")


def archive_previous_run(out_dir: str | Path) -> Path | None:
    """Move a previous run's files (checkpoints, metrics, summary, config) into
    out_dir/previous-<UTC time>/; returns that folder, or None if there was nothing."""
    out_dir = Path(out_dir)
    present = [out_dir / name for name in ARCHIVED_NAMES if (out_dir / name).exists()]
    if not present:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    target = out_dir / f"previous-{stamp}"
    n = 1
    while target.exists():
        n += 1
        target = out_dir / f"previous-{stamp}-{n}"
    target.mkdir()
    for path in present:
        os.rename(path, target / path.name)
    return target


def _diverged(recorder: RunRecorder, step: int, samples: int, loss: float,
              config: Config) -> None:
    recorder.finish({"algorithm": "sgd", "stop_reason": "diverged"})
    raise TrainingDiverged(f"training diverged: the loss is {loss} at step {step}; "
                           f"lower optimizer.learning_rate "
                           f"(now {config.optimizer.learning_rate:g})")


def _summary_line(summary: dict[str, Any], out_dir: Path) -> str:
    accuracy = summary["final_test_accuracy"]
    shown = "-" if accuracy is None else f"{accuracy:.4f}"  # a signal before any evaluation
    text = (f"distbelief: stopped ({summary['stop_reason']}) after {summary['steps']} steps, "
            f"{summary['wall_seconds']:.1f}s; test accuracy {shown}")
    if summary["target_accuracy"] is not None:
        if summary["reached_target"]:
            text += (f"; reached {summary['target_accuracy']:g} in "
                     f"{summary['time_to_target']:.1f}s")
        else:
            text += f"; target {summary['target_accuracy']:g} not reached"
    return f"{text}\nresults in {out_dir}"


def _print(stream: IO[str] | None, text: str) -> None:
    if stream is not None:
        print(text, file=stream, flush=True)
