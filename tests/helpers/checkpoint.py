"""Checkpoints written as an MPI run writes them, and commits broken at a chosen phase:
test_checkpoint.py, and the process it kills in the middle of a commit."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from distbelief.config import settings_hash
from distbelief.model.layout import ParamLayout, balanced_ranges
from distbelief.records import checkpoint as ckpt

LAYOUT = ParamLayout([(0, "weights", (7, 5)), (0, "bias", (7,)), (1, "weights", (3, 7)),
                      (1, "bias", (3,))])
SETTINGS = {"model": {"layers": [{"type": "dense", "units": 7}]}, "data": {"batch_size": 4},
            "optimizer": {"learning_rate": 0.05}, "run": {"seed": 0}}
HASH = settings_hash(SETTINGS)


def state_for(step: int, size: int = LAYOUT.size) -> tuple[np.ndarray, np.ndarray]:
    """Parameters and Adagrad accumulator that differ for every step."""
    rng = np.random.default_rng(step)
    return (rng.standard_normal(size, dtype=np.float32),
            rng.random(size, dtype=np.float32))


def save(root: Path, step: int, shards: int = 1, replicas: int = 1, keep: int = 3,
         rng_state: dict | None = None) -> Path:
    """A checkpoint written the way an MPI run spreads it: prepare, each writer its part,
    then the commit."""
    params, accum = state_for(step)
    meta = ckpt.CheckpointMeta(step, step * 4, step * 0.5, HASH)
    partial = ckpt.prepare(root, step)
    ranges = balanced_ranges(LAYOUT.size, shards)
    records = [ckpt.write_shard_part(partial, meta, i, a, b, params[a:b], {"accum": accum[a:b]},
                                     {"version": step + i})
               for i, (a, b) in enumerate(ranges)]
    records += [ckpt.write_replica_part(partial, meta, i, {"epoch": step, "position": i},
                                        rng_state, {"step": step},
                                        {"pending": np.full(3, i, np.float32)})
                for i in range(replicas)]
    return ckpt.commit(root, meta, settings=SETTINGS, algorithm="downpour", layout=LAYOUT,
                       shard_ranges=ranges, optimizer_state=["accum"], parts=records,
                       num_replicas=replicas, keep=keep)


# Each phase of a commit, as (function to break, what to do in its place). "stop" raises or
# kills instead of running it; "after" runs it first; "rename only" is the first half of
# deleting an old checkpoint.
PHASES = {
    "while writing a part": ("_sync_and_digest", "stop"),
    "after the parts, before the manifest": ("_write_manifest", "stop"),
    "after the manifest, before the rename": ("_publish", "stop"),
    "after the rename, before retention": ("_prune", "stop"),
    "half-way through deleting an old one": ("_prune", "rename only"),
}


def break_commit(monkeypatch: pytest.MonkeyPatch, phase: str, stop) -> None:
    name, how = PHASES[phase]
    if how == "stop":
        monkeypatch.setattr(ckpt, name, lambda *a, **k: stop())
    else:
        def rename_then_stop(root: Path, keep: int) -> None:
            oldest = ckpt.list_checkpoints(root)[-1][1]
            os.rename(oldest, oldest.with_name(oldest.name + ckpt.DELETING_SUFFIX))
            stop()
        monkeypatch.setattr(ckpt, name, rename_then_stop)
