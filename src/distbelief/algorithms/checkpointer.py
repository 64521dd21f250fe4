"""Checkpoints of a run whose one replica holds the whole state (`algorithm = "sgd"`):
when to write them, what they hold (the whole vector and the optimizer state as one shard
part, the data position as one replica part), and how a run resumes from one.

BestKeeper keeps every trainer's best model (run.keep_best): the recorder hands it each
evaluation with the parameters it scored, and it writes them (records.checkpoint.save_best)
when they beat every earlier evaluation of the run, a resumed run's included.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from distbelief.config import Config, config_hash, hashed_settings
from distbelief.records import checkpoint as ckpt
from distbelief.records.console import say
from distbelief.records.metrics import ResumePoint, RunRecorder


@dataclass
class TrainState:
    """The loop's counters, kept outside it so checkpoints and the summary can read them."""

    step: int = 0
    samples: int = 0


def schedule(every_seconds: float, every_steps: int, step: int,
             now: float) -> tuple[float, float]:
    """(monotonic time, step) of the next periodic checkpoint; inf when off. Steps are
    multiples of `every_steps`, also after a resume from another step. Pure."""
    at_time = now + every_seconds if every_seconds else math.inf
    at_step = (step // every_steps + 1) * every_steps if every_steps else math.inf
    return at_time, at_step


class Checkpointer:
    """When and what a one-replica run checkpoints: one shard part (the whole vector and
    the optimizer state: `params`, `optimizer.state()`) and one replica part (the data
    position). A partitioned run gives whole-model buffers it gathers into before save."""

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
        """(monotonic time, step) of the next periodic checkpoint (`schedule`)."""
        return schedule(self.every_seconds, self.every_steps, step, now)

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
        say(self.stream, f"checkpoint {path} ({seconds:.2f}s)")
        return path


def restore(found: ckpt.Checkpoint, params: np.ndarray, optimizer: Any, shard: Any,
            state: TrainState,
            select: Callable[[np.ndarray], np.ndarray] = lambda whole: whole) -> ResumePoint:
    """Load a verified, compatible one-replica checkpoint into the run's objects; `select`
    takes this rank's part of each whole-model array (a partition's pieces)."""
    saved, optimizer_state = found.read_state()
    np.copyto(params, select(saved))
    replica = found.read_replica(0)
    try:
        optimizer.load_state({name: select(array) for name, array in optimizer_state.items()})
        shard.load_state(replica.data_state)
    except (ValueError, TypeError) as exc:
        raise ckpt.CheckpointError(f"checkpoint {found.path} cannot be resumed here: "
                                   f"{exc}") from exc
    state.step, state.samples = found.step, found.samples
    return ResumePoint(found.step, found.samples, found.wall_seconds, found.path.name)


class BestKeeper:
    """The run's best model: offered each evaluation (its metrics line) with the
    parameters it scored, it keeps them as best-<step> when their score (accuracy, r2) beats the best
    so far, which a resumed run reads back from the best on disk. Runs on the rank that
    evaluates and records (it holds the whole vector then); no communication."""

    def __init__(self, config: Config, layout: Any, algorithm: str,
                 stream: IO[str] | None = None):
        self.root = ckpt.checkpoint_root(config.run.out_dir)
        self.stream = stream
        self.failed: str | None = None  # why a best could not be written; none kept since
        self.settings = hashed_settings(config)
        self.config_hash = config_hash(config)
        self.layout, self.algorithm = layout, algorithm
        found, _ = ckpt.find_best(self.root)
        # A best of another configuration (the run was refused or started over) counts not.
        self.best = (found.best if found is not None
                     and found.manifest["config_hash"] == self.config_hash else None)
        self.path: Path | None = found.path if self.best is not None else None

    def offer(self, evaluation: dict[str, Any], params: np.ndarray) -> Path | None:
        """Keep `params` if `evaluation` (step, samples, time, split, score, the score's
        value under its name, loss) is the best so far by its score; returns the folder
        written, or None."""
        if self.failed or (self.best is not None
                           and _score(evaluation) <= _score(self.best)):
            return None
        if params.shape != (self.layout.size,):
            raise ValueError(f"a best model is the whole vector ({self.layout.size}), got "
                             f"{params.shape}: offer it from the rank that holds it")
        meta = ckpt.CheckpointMeta(int(evaluation["step"]), int(evaluation["samples"]),
                                   float(evaluation["time"]), self.config_hash)
        try:
            self.path = ckpt.save_best(self.root, meta, settings=self.settings,
                                       algorithm=self.algorithm, layout=self.layout,
                                       params=params, evaluation=evaluation)
        except (ckpt.CheckpointError, OSError) as exc:
            # Only this rank writes a best: raising here would leave the others waiting.
            # The run goes on, and the periodic checkpoints decide whether it can.
            self.failed = str(exc)
            say(self.stream, f"distbelief: best checkpoint not written: {exc}; the run goes "
                             "on keeping no best (summary.json: best_not_kept)")
            return None
        self.best = dict(evaluation)
        return self.path

    def summary(self) -> dict[str, Any] | None:
        """summary.json's `best`: the folder, and the evaluation that kept it."""
        if self.best is None:
            return None
        return {**self.best, "path": str(self.path)}


def _score(evaluation: dict[str, Any]) -> float:
    """An evaluation's score (a best kept before runs had scores has an accuracy)."""
    return float(evaluation[evaluation.get("score") or "accuracy"])
