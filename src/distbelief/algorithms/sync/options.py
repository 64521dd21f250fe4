"""The [optimizer] keys synchronous SGD owns (read by config; imports nothing of the
trainer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from distbelief.options import Options, integer, option


@dataclass(frozen=True)
class SyncOptions(Options):
    description: ClassVar[str] = (
        "Synchronous data-parallel SGD: every rank a replica, the gradients averaged each "
        "step by an all-reduce (cluster.ps_shards = 0). With optimizer.backup_workers = k "
        "it runs on 1 shard + R replicas and each step takes the first R - k gradients, "
        "so k slow or lost replicas never hold it up.")
    docs: ClassVar[str] = "docs/sync.md"

    backup_workers: int = option(
        0, integer(0),
        "k > 0 runs on 1 shard + R replicas (R > k), and each step takes the first R - k "
        "gradients and drops the late ones; up to k replicas may be lost")
