"""The [optimizer] keys Hogwild owns (read by config; imports nothing of the trainer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from distbelief.options import Options, boolean, option


@dataclass(frozen=True)
class HogwildOptions(Options):
    description: ClassVar[str] = (
        "Hogwild: every rank a replica on one node (cluster.ps_shards = 0), the parameters "
        "(and Adagrad's accumulator) in one shared-memory segment that each replica "
        "updates in place without a lock; a sparse model's step writes only its batch's "
        "rows. optimizer.locked_updates = true makes every update take one lock instead: "
        "the locking baseline Hogwild is measured against.")
    docs: ClassVar[str] = "docs/sparse-models.md"

    locked_updates: bool = option(
        False, boolean(),
        "true applies each replica's update under one lock that the node's replicas share "
        "(a file lock in the run folder: a replica that waits sleeps in the kernel, and a "
        "dead one's lock is released); the gradients are still computed in parallel. The "
        "baseline of [Hogwild on sparse problems](sparse-models.md#hogwild-on-sparse-problems)",
        hashed="never")
