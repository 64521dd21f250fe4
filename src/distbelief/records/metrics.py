"""What a training run records: metrics.jsonl, summary.json and progress lines.

Shared by every trainer (single-process SGD, Downpour's reporting rank). One recorder per
run, in the process that owns the run's output folder:

    recorder = RunRecorder(out_dir, progress_every_seconds=2.0,
                           target=Target("accuracy", 0.88), score="accuracy")
    recorder.log(step, samples, loss, **extra)       # a training line; call every ~0.5 s,
                                                     # not every step (loss: recent mean)
    recorder.log_eval(step, samples, loss, figures, params=p, **extra)
                                                     # figures: {"loss", the score, ...}
                                                     # params: what was scored, offered to
                                                     # the run's best keeper (run.keep_best)
    recorder.progress(step, samples, loss)           # cheap to call every step: prints a
                                                     # line only every progress_every_seconds
    recorder.log_event("checkpoint", step, samples, **extra)   # a marker line
    recorder.finish({"stop_reason": "max_steps"})    # writes summary.json, closes the file

metrics.jsonl has one JSON object per line, flushed as it is written, so a run killed
half-way leaves a readable file. Every line has `kind` ("train" or "eval"), `time`
(seconds since the recorder's start), `step`, `samples` and `loss` (training loss); eval
lines add `test_loss` and the model loss's metrics (model.losses): `test_accuracy` for
classes, `test_r2` and `test_rmse` for mse, `test_accuracy` and `test_auc` for
binary_cross_entropy; `val_` instead of `test_` when the run evaluates a validation split
(`eval_split="validation"`; read the loss and the score with eval_loss and eval_accuracy,
which reads whichever score the line has). The **score** is the metric runs are judged
by, higher is better: accuracy, or r2 for mse; summary.json's `score` names it and the
summary's keys below that say "accuracy" say "r2" instead in a run that scores r2
(final_val_r2, best_test_r2, ...); a run with a validation split gets one `{"kind": "test", ...}` line at its end
(distbelief.algorithms.common.final_test); `extra` keywords are added as they are (they
must be JSON-serialisable; Downpour adds e.g. the shards' version). A non-finite number
(a diverged loss) is written as null, here and in summary.json: strict JSON. Marker lines of other kinds
("checkpoint", "resume") have `kind`, `time`, `step` and `samples` but no loss; readers
pick the kinds they plot.

summary.json (written atomically: temp file, fsync, rename) has at least `reached_target`,
`time_to_target` (seconds, or null), `target_reached_value` and `target_reached_step`
(the target metric's value and the step of the first evaluation that met the target, the
one that stops a run with a target; null when none was; `target_reached_accuracy` too,
its accuracy), `target` ({"metric", "value"} or
null), `target_accuracy` (its value when the metric is accuracy), `score`,
`final_test_accuracy` (the last evaluation's,
which may be another one and fall below the target),
`best_test_accuracy`, `final_test_loss`, `steps`, `samples`, `wall_seconds` and
`samples_per_second`, `eval_split` and `collapse` (null, or what
distbelief.records.collapse found), filled from what was logged; with a validation split
the evaluation keys are named `final_val_accuracy`, `best_val_accuracy` and
`final_val_loss` (and final_val_<metric> for the loss's other metrics), and `final_test_accuracy`/`final_test_loss` stay null until the test set
is evaluated at the end. The dict given to `finish` adds keys or overrides them. `best` (the model run.keep_best
kept: its folder, step, split, accuracy, loss; null when none was) and `last` (the newest
checkpoint, `checkpoint`: its folder, step, and accuracy when the last evaluation scored
that step) name the two models a run leaves; `distbelief evaluate` reads the best by
default.

Given the run's budget (`max_steps`, `max_seconds`), progress lines say how much of it is
spent, and their ETA counts down to the stop rule that will end the run first, named: a
budget, or the target accuracy where the evaluations' trend rises toward it (next_stop).
Given a CollapseWatch, a collapse is printed once when found and marked on every later
progress line.

Times come from time.monotonic(); pass `start` (a monotonic time) to count from an earlier
moment than the recorder's creation.

A resumed run continues its metrics: `RunRecorder(out_dir, resume=ResumePoint(step,
samples, elapsed, checkpoint))` keeps the lines up to the checkpoint's step, moves the
lines the interrupted run wrote after it (they describe steps that are trained again) to
metrics.discarded.jsonl, appends a `{"kind": "resume", ...}` line and carries on from the
checkpoint's elapsed time, so `time` stays the run's total training time. The best and
last evaluation and the time to target are read back from the kept lines.

`tensorboard` (run.tensorboard; None: when tensorboardX is installed) also writes every
line and the summary as TensorBoard events in out_dir/tensorboard/ (records.tensorboard).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Self

from distbelief.errors import DataError
from distbelief.model.losses import SCORES
from distbelief.records.collapse import CollapseWatch
from distbelief.records.console import say
from distbelief.records.tensorboard import open_events

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
DISCARDED_FILE = "metrics.discarded.jsonl"
LOG_EVERY_SECONDS = 0.5
"""How often a trainer writes a training line; its loss is the mean over the steps since
the previous line (one line per step would be thousands a second)."""
REQUIRED_SUMMARY_KEYS = ("reached_target", "time_to_target", "score", "steps", "samples",
                         "wall_seconds")
EVAL_SPLITS = ("test", "validation")
EVAL_PREFIX = {"test": "test", "validation": "val"}
"""What an evaluation's keys start with: test_accuracy, val_accuracy."""


LOWER_IS_BETTER = ("loss", "rmse")
"""The metrics a target is met by falling to (the others: by rising to)."""


@dataclass(frozen=True)
class Target:
    """A run's target: a metric of its evaluations ("accuracy", "loss", "r2", "rmse",
    "auc") and the value that stops the run (run.target_accuracy, run.target_loss,
    run.target_metric and run.target_value)."""

    metric: str
    value: float

    @property
    def rises(self) -> bool:
        """Whether the metric meets the target by rising to it (accuracy, r2, auc)."""
        return self.metric not in LOWER_IS_BETTER

    @property
    def reason(self) -> str:
        """The stop reason of a run it stopped: target_accuracy, target_loss, ..."""
        return f"target_{self.metric}"

    def met(self, figures: dict[str, Any]) -> bool:
        """Whether an evaluation's `figures` ({"loss": ..., "accuracy": ...}) meet it."""
        value = figures.get(self.metric)
        if value is None or not math.isfinite(value):
            return False
        return value >= self.value if self.rises else value <= self.value

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "value": self.value}


def target_of(run: Any) -> Target | None:
    """A run's target from its [run] values (a mapping: config.json's; a RunConfig's
    vars): run.target_accuracy, run.target_loss, or run.target_metric with
    run.target_value; None without one."""
    if run.get("target_accuracy") is not None:
        return Target("accuracy", float(run["target_accuracy"]))
    if run.get("target_loss") is not None:
        return Target("loss", float(run["target_loss"]))
    if run.get("target_metric") is not None and run.get("target_value") is not None:
        return Target(str(run["target_metric"]), float(run["target_value"]))
    return None


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run picks up: the checkpoint's counters and training time so far."""

    step: int
    samples: int
    elapsed: float
    checkpoint: str


class RunRecorder:
    """Appends metrics lines, prints progress and writes the summary of one run."""

    def __init__(self, out_dir: str | Path, progress_every_seconds: float = 2.0,
                 stream: IO[str] | None = sys.stdout, target_accuracy: float | None = None,
                 start: float | None = None, resume: ResumePoint | None = None, *,
                 max_steps: int = 0, max_seconds: float = 0.0, eval_split: str = "test",
                 collapse: CollapseWatch | None = None, tensorboard: bool | None = False,
                 target: Target | None = None, score: str = "accuracy"):
        """`target_accuracy` is short for target=Target("accuracy", value); `score` names
        the evaluations' score (model.losses: "accuracy", or "r2")."""
        if eval_split not in EVAL_SPLITS:
            raise ValueError(f"eval_split must be one of {EVAL_SPLITS}, got {eval_split!r}")
        self.out_dir = Path(out_dir)
        self.max_steps, self.max_seconds = max_steps, max_seconds
        self.eval_split = eval_split
        self._prefix = EVAL_PREFIX[eval_split]
        self.collapse = collapse
        # Set by the trainer's set-up (algorithms.checkpointer.BestKeeper): offered each
        # evaluation given with its parameters.
        self.best_keeper: Any = None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.progress_every_seconds = progress_every_seconds
        self.stream = stream
        if target is None and target_accuracy is not None:
            target = Target("accuracy", target_accuracy)
        self.target = target
        self.score = score
        if start is None:
            start = time.monotonic() - (resume.elapsed if resume else 0.0)
        self.start = start
        self._step = 0
        self._samples = 0
        self._loss = math.nan
        self._last_eval: dict[str, Any] | None = None
        self._best_accuracy: float | None = None
        self.time_to_target: float | None = None
        self._target_eval: dict[str, Any] | None = None  # the first eval at the target
        self._trend: deque[tuple[float, float]] = deque(maxlen=TREND_EVALS)  # for the ETA
        self._next_progress = self.start + progress_every_seconds
        # Every line also goes to TensorBoard (records.tensorboard) when asked for.
        self._events = open_events(self.out_dir, tensorboard,
                                   None if resume is None else resume.step, stream)
        if resume is None:
            # A new run starts a new file: lines from an earlier run in the same folder
            # would mix two runs in one curve.
            self._file = (self.out_dir / METRICS_FILE).open("w", encoding="utf-8")
            self._progress_mark = (self.start, 0)  # (time, samples) of the last progress line
            self._rate_mark = (self.start, 0)  # (time, step) the ETA's step rate counts from
        else:
            self._continue(resume)
            # Rates and the first line count from now, not from the run's shifted start.
            self._progress_mark = (time.monotonic(), resume.samples)
            self._rate_mark = (time.monotonic(), resume.step)
            self._next_progress = time.monotonic() + progress_every_seconds

    def _continue(self, resume: ResumePoint) -> None:
        """Open metrics.jsonl for appending after the lines up to the resume point."""
        path = self.out_dir / METRICS_FILE
        kept = _keep_lines_until(path, self.out_dir / DISCARDED_FILE, resume)
        for line in kept:
            if line.get("kind") == "eval":
                self._note_eval(line)
        self._remember(resume.step, resume.samples, math.nan)
        self._file = path.open("a", encoding="utf-8")
        self.log_event("resume", resume.step, resume.samples, checkpoint=resume.checkpoint)

    def elapsed(self) -> float:
        """Seconds since the start of the run."""
        return time.monotonic() - self.start

    @property
    def reached_target(self) -> bool:
        return self._target_eval is not None

    def log(self, step: int, samples: int, loss: float, **extra: Any) -> None:
        """Append a training line (time, step, samples, loss, extra)."""
        self._remember(step, samples, loss)
        now = self.elapsed()
        self._write({"kind": "train", "time": now, "step": step, "samples": samples,
                     "loss": float(loss), **extra})
        if self.collapse is not None:
            found = self.collapse.add(now, step, float(loss))
            if found is not None:
                say(self.stream, f"distbelief: warning: {found.describe()}")

    @property
    def collapsed(self) -> bool:
        """Whether the CollapseWatch found a collapse (and the loss has not recovered)."""
        return (self.collapse is not None and self.collapse.found is not None
                and self.collapse.recovered_at is None)

    def log_event(self, kind: str, step: int, samples: int, at: float | None = None,
                  **extra: Any) -> None:
        """Append a marker line (a checkpoint written, a resume): no loss, not plotted.
        `at` is its time (seconds since the start) when that is not now."""
        self._write({"kind": kind, "time": self.elapsed() if at is None else at, "step": step,
                     "samples": samples, **extra})

    def log_eval(self, step: int, samples: int, loss: float, figures: Any,
                 params: Any = None, **extra: Any) -> None:
        """Append an evaluation line (on the eval split: test_ or val_ keys) of `figures`
        (a dict with "loss" and the score, or a model.losses.Evaluation); notes the first
        time the target is met. `params`, the vector evaluated, goes to the best keeper,
        which keeps it if it is the best so far. `loss` is the recent training loss."""
        figures = dict(getattr(figures, "figures", figures))
        if self.score not in figures or "loss" not in figures:
            raise ValueError(f"an evaluation needs 'loss' and {self.score!r}, got "
                             f"{sorted(figures)}")
        self._remember(step, samples, loss)
        now = self.elapsed()
        line = {"kind": "eval", "time": now, "step": step, "samples": samples,
                "loss": float(loss),
                **{f"{self._prefix}_{name}": float(value) for name, value in figures.items()},
                **extra}
        self._write(line)
        self._note_eval(line)
        if params is not None and self.best_keeper is not None:
            self.best_keeper.offer({"step": int(step), "samples": int(samples), "time": now,
                                    "split": self.eval_split, "score": self.score,
                                    self.score: float(figures[self.score]),
                                    "loss": float(figures["loss"])}, params)

    def _note_eval(self, line: dict[str, Any]) -> None:
        score = eval_accuracy(line)
        if score is None:
            return
        self._last_eval = line
        if self._best_accuracy is None or score > self._best_accuracy:
            self._best_accuracy = score
        if self.target is None:
            return
        figures = eval_figures(line)
        if self.target.metric in figures:
            value = figures[self.target.metric]
            # The trend rises toward the target: a falling metric's is taken negated.
            self._trend.append((float(line["time"]), value if self.target.rises else -value))
        if self._target_eval is None and self.target.met(figures):
            self._target_eval = line
            self.time_to_target = float(line["time"])

    @property
    def last_accuracy(self) -> float | None:
        """The last evaluation's score (on the eval split), or None."""
        return None if self._last_eval is None else eval_accuracy(self._last_eval)

    def progress(self, step: int, samples: int, loss: float,
                 test_accuracy: float | None = None) -> None:
        """Print a progress line if `progress_every_seconds` have passed since the last one.

        samples/s is measured since the previous progress line, over the whole job (every
        trainer passes the samples of all its replicas); test accuracy defaults to the last
        evaluation's. The ETA counts down to the stop rule that comes first (next_stop).
        """
        now = time.monotonic()
        if now < self._next_progress or self.stream is None:
            return
        self._next_progress = now + self.progress_every_seconds
        mark_time, mark_samples = self._progress_mark
        self._progress_mark = (now, samples)
        rate = (samples - mark_samples) / max(now - mark_time, 1e-9)
        if test_accuracy is None:
            test_accuracy = self.last_accuracy
        accuracy = "-" if test_accuracy is None else f"{test_accuracy:.4f}"
        if not math.isfinite(loss):  # none measured yet: the metrics' latest, or nothing
            loss = self._loss
        shown = f"{loss:.4f}" if math.isfinite(loss) else "-"
        elapsed = now - self.start
        step_rate = (step - self._rate_mark[1]) / max(now - self._rate_mark[0], 1e-9)
        spent = budget_text(step, elapsed, self.max_steps, self.max_seconds, step_rate,
                            self.target, self._trend)
        warning = f"  [collapsed: {self.collapse.found.kind}]" if self.collapsed else ""
        name = "acc" if self.score == "accuracy" else self.score
        say(self.stream, f"step {step:>8d}  {rate:>9.0f} samples/s (all replicas)  "
                         f"loss {shown}  {self._prefix} {name} {accuracy}  elapsed "
                         f"{elapsed:.1f}s{spent}{warning}")

    def summary(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """The summary of what was logged so far, updated with `extra`."""
        wall = self.elapsed()
        last = self._last_eval or {}
        hit = self._target_eval or {}
        p, score, target = self._prefix, self.score, self.target
        out: dict[str, Any] = {
            "reached_target": self.reached_target,
            "time_to_target": self.time_to_target,
            # The evaluation that reached the target, kept apart from the final one: a run
            # stopped by its target evaluates again at the end (Downpour: the parameters
            # after the replicas' last pushes), and that can fall just under the target.
            "target_reached_value": (None if target is None
                                     else hit.get(f"{p}_{target.metric}")),
            "target_reached_accuracy": hit.get(f"{p}_accuracy"),
            "target_reached_step": hit.get("step"),
            "target": None if target is None else target.to_dict(),
            "target_accuracy": (target.value if target is not None
                                and target.metric == "accuracy" else None),
            "score": score,
            "eval_split": self.eval_split,
            f"final_test_{score}": None,
            "final_test_loss": None,
            **{f"final_{key}": value for key, value in last.items()
               if key.startswith(f"{p}_")},
            f"final_{p}_{score}": last.get(f"{p}_{score}"),
            f"best_{p}_{score}": self._best_accuracy,
            f"final_{p}_loss": last.get(f"{p}_loss"),
            "collapse": None if self.collapse is None else self.collapse.summary(),
            "steps": self._step,
            "samples": self._samples,
            "wall_seconds": wall,
            "samples_per_second": self._samples / wall if wall > 0 else None,
        }
        out.update(extra or {})
        out["best"] = None if self.best_keeper is None else self.best_keeper.summary()
        if self.best_keeper is not None and self.best_keeper.failed:
            out["best_not_kept"] = self.best_keeper.failed
        out["last"] = last_checkpoint(out.get("checkpoint"), last, p, score)
        # Bytes on the wire per sample trained, for every trainer that reports its bytes.
        samples = out.get("samples")
        for key in ("bytes_sent", "bytes_received"):
            if out.get(key) is not None:
                out[f"{key}_per_sample"] = out[key] / samples if samples else None
        return out

    def finish(self, summary: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write summary.json atomically, close metrics.jsonl; returns the summary written."""
        out = self.summary(summary)
        missing = [k for k in REQUIRED_SUMMARY_KEYS if k not in out]
        if missing:
            raise ValueError(f"summary lacks {missing}")
        write_json_atomic(self.out_dir / SUMMARY_FILE, out)
        if self._events is not None:
            self._events.summary(out)
        self.close()
        return out

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self._events is not None:
            self._events.close()

    def _remember(self, step: int, samples: int, loss: float) -> None:
        self._step, self._samples, self._loss = step, samples, float(loss)

    def _write(self, line: dict[str, Any]) -> None:
        self._file.write(json.dumps(finite_or_null(line), allow_nan=False) + "\n")
        self._file.flush()
        if self._events is not None:
            self._events.line(line)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


FIGURES = ("accuracy", "r2", "rmse", "auc")
"""Every metric an evaluation may report besides its loss, in the order they are shown."""


def line_score(line: dict[str, Any]) -> str:
    """The score an evaluation line carries ("accuracy" when it has none)."""
    return next((score for score in SCORES for prefix in ("val", "test")
                 if f"{prefix}_{score}" in line), "accuracy")


def eval_accuracy(line: dict[str, Any]) -> float | None:
    """An evaluation line's score (accuracy, or r2: the one it has): on the validation
    split if it has one, else test."""
    for prefix in ("val", "test"):
        for score in SCORES:
            value = line.get(f"{prefix}_{score}")
            if value is not None:
                return float(value)
    return None


def eval_figures(line: dict[str, Any]) -> dict[str, float]:
    """An evaluation line's figures without their split's prefix: {"loss": ..., "r2": ...}
    (validation's when it has them, else test's)."""
    prefix = "val_" if any(key.startswith("val_") for key in line) else "test_"
    return {key[len(prefix):]: value for key, value in line.items()
            if key.startswith(prefix) and isinstance(value, (int, float))}


def summary_target(summary: dict[str, Any]) -> dict[str, Any] | None:
    """A summary's target, {"metric", "value"}, or None (a summary from before targets
    had metrics has its target_accuracy)."""
    if summary.get("target"):
        return dict(summary["target"])
    if summary.get("target_accuracy") is not None:
        return {"metric": "accuracy", "value": summary["target_accuracy"]}
    return None


def target_reached_value(summary: dict[str, Any]) -> float | None:
    """The target metric's value in the evaluation that met the target, or None."""
    value = summary.get("target_reached_value")
    return summary.get("target_reached_accuracy") if value is None else value


def score_name(summary: dict[str, Any]) -> str:
    """The metric a run's summary scores it by ("accuracy" before there was a choice)."""
    return str(summary.get("score") or "accuracy")


def eval_loss(line: dict[str, Any]) -> float | None:
    """An evaluation line's loss, on the split eval_accuracy reads."""
    value = line.get("val_loss", line.get("test_loss"))
    return None if value is None else float(value)


def accuracy_name(lines_or_summary: Any) -> str:
    """"validation accuracy" when a run's evaluations (its eval lines, or its summary)
    were on a validation split, else "test accuracy" ("r2" for a run scored by r2): what
    a figure's axis says."""
    if isinstance(lines_or_summary, dict):
        validation = lines_or_summary.get("eval_split") == "validation"
        score = score_name(lines_or_summary)
    else:
        lines = list(lines_or_summary)
        validation = any(key.startswith("val_") for line in lines for key in line)
        score = next((line_score(line) for line in lines if line_score(line) != "accuracy"),
                     "accuracy")
    return f"{'validation' if validation else 'test'} {score}"


def budget_fraction(step: int, elapsed: float, max_steps: int,
                    max_seconds: float) -> float | None:
    """How much of the run's budget is spent (0..1, whichever limit comes first), or None
    without one."""
    parts = [step / max_steps if max_steps else None,
             elapsed / max_seconds if max_seconds else None]
    known = [x for x in parts if x is not None]
    return min(1.0, max(known)) if known else None


def next_stop(step: int, elapsed: float, max_steps: int, max_seconds: float,
              step_rate: float, target: Target | float | None = None,
              evals: Sequence[tuple[float, float]] = ()) -> tuple[float, str] | None:
    """(seconds left, which rule) for the stop rule that will end the run first: run.max_steps
    at `step_rate` steps a second, run.max_seconds, or the target (a number: an accuracy)
    where the evaluations' trend (`evals`: (time, value) pairs, oldest first; a falling
    metric's values negated) is rising toward it (target_seconds_left). None when no rule
    gives a time."""
    left = []
    if max_steps and step_rate > 0:
        left.append((max(0.0, (max_steps - step) / step_rate), "max_steps"))
    if max_seconds:
        left.append((max(0.0, max_seconds - elapsed), "max_seconds"))
    if target is not None:
        if not isinstance(target, Target):
            target = Target("accuracy", float(target))
        goal = target.value if target.rises else -target.value
        trend = target_seconds_left(evals, goal, elapsed)
        if trend is not None:
            name = "" if target.metric == "accuracy" else f"{target.metric} "
            left.append((trend, f"target {name}{target.value:g} at the current trend"))
    return min(left, key=lambda x: x[0]) if left else None


TREND_EVALS = 8
"""How many of the newest evaluations the target's trend is fitted on."""
TREND_MIN_EVALS = 4
TREND_RISING = 0.75
"""The share of the pairs of those evaluations that must rise for a trend to count: noise
around a flat curve gives about half, and then no target ETA is given."""
LONGEST_ETA_S = 365 * 86400.0
"""A target further off than this at the trend gets no forecast (the trend says nothing)."""


def target_seconds_left(evals: Sequence[tuple[float, float]], target: float,
                        now: float) -> float | None:
    """Seconds from `now` (seconds into the run) until the accuracy reaches `target`, from
    the newest TREND_EVALS evaluations ((time, accuracy), oldest first): accuracy taken as
    a straight line in the logarithm of the training time, whose slope is robust to noise
    (Theil-Sen: the median of the slopes of every pair). Log time because accuracy curves
    flatten: a straight line in time is far too hopeful early on (docs/configuration.md,
    "Progress and the ETA"). None when there are fewer than TREND_MIN_EVALS, when fewer
    than TREND_RISING of the pairs rise (not rising, or noise), or when the newest has
    reached the target (the run stops there)."""
    recent = [(math.log(t), float(a)) for t, a in list(evals)[-TREND_EVALS:]
              if t > 0 and math.isfinite(t) and math.isfinite(a)]
    if len(recent) < TREND_MIN_EVALS or recent[-1][1] >= target:
        return None
    slopes = [(a2 - a1) / (x2 - x1) for i, (x1, a1) in enumerate(recent)
              for x2, a2 in recent[i + 1:] if x2 > x1]
    if not slopes or sum(s > 0 for s in slopes) < TREND_RISING * len(slopes):
        return None
    slope = _median(slopes)
    if slope <= 0:
        return None
    intercept = _median([a - slope * x for x, a in recent])
    log_time = (target - intercept) / slope
    if log_time > math.log(LONGEST_ETA_S + now):
        return None
    return max(0.0, math.exp(log_time) - now)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def duration_text(seconds: float) -> str:
    """42s, 3m05s, 2h07m: short, for a progress line."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def budget_text(step: int, elapsed: float, max_steps: int, max_seconds: float,
                step_rate: float, target: Target | float | None = None,
                evals: Sequence[tuple[float, float]] = ()) -> str:
    """"  12% of budget, ETA 3m05s (max_seconds)" for a progress line: the budget spent,
    and the time to the stop rule that comes first (next_stop), named; "" when neither is
    known."""
    fraction = budget_fraction(step, elapsed, max_steps, max_seconds)
    found = next_stop(step, elapsed, max_steps, max_seconds, step_rate, target, evals)
    parts = [] if fraction is None else [f"{100 * fraction:.0f}% of budget"]
    if found is not None:
        parts.append(eta_text(*found))
    return f"  {', '.join(parts)}" if parts else ""


def eta_text(seconds: float, rule: str) -> str:
    """"ETA 3m05s (max_seconds)": the time left and the stop rule it counts down to."""
    return f"ETA {duration_text(seconds)} ({rule})"


def last_checkpoint(path: str | None, last_eval: dict[str, Any],
                    prefix: str, score: str = "accuracy") -> dict[str, Any] | None:
    """summary.json's `last`: the newest checkpoint's folder and step (from its name), and
    the last evaluation's score when it scored that step (under the key "accuracy", or
    "r2": `score`)."""
    if not path:
        return None
    _, _, number = Path(path).name.partition("-")
    step = int(number) if number.isdigit() else None
    scored = step is not None and last_eval.get("step") == step
    return {"path": str(path), "step": step,
            score: last_eval.get(f"{prefix}_{score}") if scored else None}


def accuracy_text(summary: dict[str, Any]) -> str:
    """"test accuracy 0.8812" (or "validation accuracy ...") for a trainer's closing line:
    the final evaluation's, "-" when there was none (a signal before the first); for a
    run its target stopped, the evaluation that met the target (a later one can be lower:
    target_text gives it)."""
    p = EVAL_PREFIX.get(summary.get("eval_split", "test"), "test")
    score = score_name(summary)
    accuracy = summary.get(f"final_{p}_{score}")
    if summary.get("stop_reason") == f"target_{score}" \
            and target_reached_value(summary) is not None:
        accuracy = target_reached_value(summary)
    shown = "-" if accuracy is None else f"{accuracy:.4f}"
    return f"{'validation' if p == 'val' else 'test'} {score} {shown}"


def target_text(summary: dict[str, Any]) -> str:
    """The target part of a trainer's closing line: "" without a target; the reaching
    evaluation's time, accuracy and step; and the final accuracy when it differs from that
    one (it may lie under the target), so the line never seems to contradict summary.json.
    """
    target = summary_target(summary)
    if not target:
        return ""
    metric = "" if target["metric"] == "accuracy" else f"{target['metric']} "
    if not summary.get("reached_target"):
        return f"; target {metric}{target['value']:g} not reached"
    hit = target_reached_value(summary)
    text = (f"; reached {metric}{target['value']:g} in {summary['time_to_target']:.1f}s "
            f"({hit:.4f} at step {summary['target_reached_step']})")
    score = score_name(summary)
    final = summary.get(f"final_test_{score}")
    if final is not None and (final != hit or target["metric"] != score):
        text += f"; final test {score} {final:.4f}"
    return text


def best_last_text(summary: dict[str, Any]) -> str:
    """The closing line's models: "best: step 4,305, test accuracy 0.8803 (FOLDER); last:
    step 4,400 (FOLDER)", with the last one's accuracy when an evaluation scored it;
    "" when the run left no checkpoint."""
    best, last = summary.get("best"), summary.get("last")
    score = score_name(summary)
    parts = []
    if best:
        parts.append(f"best: step {best['step']:,d}, {scored_text(best)} ({best['path']})")
    if last:
        step = "?" if last.get("step") is None else f"{last['step']:,d}"
        scored = "" if last.get(score) is None else \
            f", {summary.get('eval_split', 'test')} {score} {last[score]:.4f}"
        parts.append(f"last: step {step}{scored} ({last['path']})")
    return "; ".join(parts)


def finite_or_null(value: Any) -> Any:
    """`value` with every non-finite float (a diverged loss) as None: strict JSON readers
    (jq, JavaScript, most languages' parsers) reject the NaN and Infinity tokens."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write JSON to `path` so readers see the old file or the new one, never half of one.
    Non-finite floats are written as null."""
    write_text_atomic(path, json.dumps(finite_or_null(data), indent=2, sort_keys=True,
                                       allow_nan=False) + "\n")


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` so readers see the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _keep_lines_until(path: Path, discarded: Path, resume: ResumePoint) -> list[dict]:
    """Cut metrics.jsonl back to the lines up to `resume.step` written by then (their time
    is at most `resume.elapsed`: under Downpour an evaluation of a step before the
    checkpoint can finish after it); returns them parsed.

    The cut lines (after the checkpoint, or unreadable, like a half-written last line) are
    appended to `discarded` and fsynced before metrics.jsonl is replaced, so a crash in
    between duplicates lines at worst and never loses one.
    """
    if not path.is_file():
        return []
    kept_text, kept, cut = [], [], []
    content = path.read_text(encoding="utf-8")
    for text in content.splitlines():
        line = _parse_line(text)
        if line is None and not text.strip():
            continue
        if line is not None and line.get("step", math.inf) <= resume.step \
                and line.get("time", 0.0) <= resume.elapsed:
            kept_text.append(text)
            kept.append(line)
        else:
            cut.append(text)
    if cut:
        header = {"kind": "discarded", "reason": f"written after checkpoint "
                  f"{resume.checkpoint} (step {resume.step}), which the run resumed from"}
        with discarded.open("a", encoding="utf-8") as f:
            f.write("\n".join([json.dumps(header), *cut]) + "\n")
            f.flush()
            os.fsync(f.fileno())
    if cut or not content.endswith("\n"):  # appending must start on a line of its own
        write_text_atomic(path, "".join(t + "\n" for t in kept_text))
    return kept


def _parse_line(text: str) -> dict[str, Any] | None:
    """A metrics line as a dict with a numeric step, or None."""
    try:
        line = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(line, dict) or not isinstance(line.get("step"), (int, float)):
        return None
    return line


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The lines of a metrics.jsonl; a truncated last line (a killed run) is dropped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    records = []
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            records.append(json.loads(text))
        except json.JSONDecodeError:
            if number == len(lines):
                break  # the run was killed while writing this line
            raise DataError(f"{path}, line {number}: not a JSON object: {text[:60]!r}") from None
    return records


def scored_text(evaluation: dict[str, Any]) -> str:
    """"test accuracy 0.8803" or "validation r2 0.9712": a kept model's evaluation (a
    checkpoint manifest's `best`, summary.json's `best`), by its score."""
    score = evaluation.get("score") or "accuracy"
    return f"{evaluation.get('split', 'test')} {score} {evaluation[score]:.4f}"
