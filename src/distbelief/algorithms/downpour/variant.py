"""What an algorithm built on Downpour's machinery supplies in Downpour's place (EASGD:
averaging.elastic; asynchronous DiLoCo: diloco.asynchronous), so that Downpour names none
of them: a replica's role, the shards' update rule, and what shard 0 says of the run."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from distbelief.algorithms.downpour.replica import make_replica


@dataclass(frozen=True)
class Variant:
    """One algorithm on Downpour's machinery; DOWNPOUR is Downpour itself."""

    replica_role: Callable[..., Any] = make_replica
    """(run, network, fetch) -> a replica rank's role."""
    shard_update: Callable[[int], Any] | None = None
    """size -> a shard's update rule; None: optimizer.update's."""
    name: str = "downpour"
    """The run as shard 0's opening line names it."""
    summary: Mapping[str, Any] = field(default_factory=dict)
    """Keys of its own in summary.json (after push_dtype)."""


DOWNPOUR = Variant()
