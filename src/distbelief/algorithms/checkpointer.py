"""Checkpoints of a run whose one replica holds the whole state (`algorithm = "sgd"`):
when to write them, what they hold (the whole vector and the optimizer state as one shard
part, the data position as one replica part), and how a run resumes from one.
"""

from __future__ import annotations

import math
import time
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
        say(self.stream, f"checkpoint {path} ({seconds:.2f}s)")
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
