"""Single-process training (`optimizer.algorithm = "sgd"`), and the pieces every trainer shares.

One process, one model, one shard holding the whole training set: next batch -> loss and
gradient -> optimizer step, with evaluations on the test set every `run.eval_every_seconds`
of wall time (evaluation time counts) and one at the end. This is the baseline Downpour is
measured against, so the loop does nothing per step beyond those three calls and a clock read.

Shared with the Downpour replicas:
    prepare_run_dir(config)          out_dir created, config.json written
    open_data(config)                (DatasetInfo, Network) checked against each other
    load_eval_set(config, info)      the test samples evaluations use
    StopRules.from_config(config)    max_steps / max_seconds / target_accuracy
    evaluate(network, params, eval_set) -> (test_loss, test_accuracy)
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from distbelief.config import Config, build_network, config_hash
from distbelief.errors import UserError
from distbelief.metrics import RunRecorder
from distbelief.threads import apply_thread_setting

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
    from distbelief.data import open_dataset

    info = open_dataset(config.data.path)
    return info, build_network(config, info)


def load_eval_set(config: Config, info: Any) -> tuple[np.ndarray, np.ndarray]:
    """The test samples every evaluation uses: the first run.eval_samples, or all."""
    from distbelief.data import load_test

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


def train(config: Config, stream: IO[str] | None = sys.stdout) -> dict[str, Any]:
    """Train one model in this process until a stop rule fires; returns the run summary.

    Writes config.json, metrics.jsonl and summary.json to run.out_dir (see
    distbelief.metrics) and progress lines to `stream` (None for silence).
    """
    from distbelief.data import TrainShard
    from distbelief.optimizers import make_optimizer

    apply_thread_setting(config.run.threads)
    out_dir = prepare_run_dir(config)
    info, network = open_data(config)
    eval_set = load_eval_set(config, info)
    shard = TrainShard(info, rank=0, num_ranks=1, seed=config.run.seed)
    params = network.init_params(config.run.seed)
    grad = np.zeros_like(params)
    opt = config.optimizer
    optimizer = make_optimizer(opt.adagrad, opt.learning_rate, params.size)
    _print(stream, f"distbelief: sgd, {network.layout.size:,d} parameters, data "
                   f"{info.path} ({info.n_train} train / {len(eval_set[1])} eval samples), "
                   f"out {out_dir}\n{network.describe()}")

    recorder = RunRecorder(out_dir, config.run.progress_every_seconds, stream,
                           target_accuracy=config.run.target_accuracy)
    # Overflow in a diverging run is reported once, as TrainingDiverged, not as a stream of
    # numpy warnings.
    with recorder, np.errstate(over="ignore", invalid="ignore"):
        reason = _train_loop(config, network, shard, optimizer, params, grad, eval_set,
                             recorder)
        summary = recorder.finish({
            "algorithm": "sgd", "stop_reason": reason, "config_hash": config_hash(config),
            "num_params": int(network.layout.size), "eval_samples": len(eval_set[1]),
        })
    _print(stream, _summary_line(summary, out_dir))
    return summary


def _train_loop(config: Config, network: Any, shard: Any, optimizer: Any,
                params: np.ndarray, grad: np.ndarray, eval_set: tuple[np.ndarray, np.ndarray],
                recorder: RunRecorder) -> str:
    """The hot loop; returns why it stopped. The recorder has the last step's evaluation."""
    rules = StopRules.from_config(config)
    batch_size = config.data.batch_size
    eval_every = config.run.eval_every_seconds
    clock = time.monotonic
    start = recorder.start
    next_log = start + LOG_EVERY_SECONDS
    next_eval = start + eval_every
    step = samples = 0
    loss_sum, loss_count, recent_loss = 0.0, 0, math.nan
    while True:
        x, y = shard.next_batch(batch_size)
        loss_sum += network.loss_and_grad(params, x, y, grad)
        optimizer.step(params, grad)
        step += 1
        samples += len(y)
        loss_count += 1
        now = clock()
        reason = rules.budget_spent(step, now - start)
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
                return "target_accuracy"
            # Counted from the end of this evaluation, so training always gets the
            # interval, however long evaluating takes.
            next_eval = clock() + eval_every
        recorder.progress(step, samples, recent_loss)
    test_loss, accuracy = evaluate(network, params, eval_set)
    recorder.log_eval(step, samples, recent_loss, accuracy, test_loss)
    return reason


def _diverged(recorder: RunRecorder, step: int, samples: int, loss: float,
              config: Config) -> None:
    recorder.finish({"algorithm": "sgd", "stop_reason": "diverged"})
    raise TrainingDiverged(f"training diverged: the loss is {loss} at step {step}; "
                           f"lower optimizer.learning_rate "
                           f"(now {config.optimizer.learning_rate:g})")


def _summary_line(summary: dict[str, Any], out_dir: Path) -> str:
    accuracy = summary["final_test_accuracy"]
    text = (f"distbelief: stopped ({summary['stop_reason']}) after {summary['steps']} steps, "
            f"{summary['wall_seconds']:.1f}s; test accuracy {accuracy:.4f}")
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
