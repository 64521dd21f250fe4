"""The [optimizer] keys Downpour owns (read by config; imports nothing of the trainer)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from distbelief.errors import ConfigError
from distbelief.options import Options, choice, integer, option

STALENESS_SCALINGS = ("none", "inverse")
"""optimizer.staleness_scaling (model.optimizers.STALENESS_SCALINGS, which the shards
apply; repeated here because options modules import nothing of the model)."""

FETCHES = ("own_pushes", "asynchronous", "overlapped")
"""optimizer.fetch: what a replica's fetch waits for (docs/downpour.md, "Fetch")."""
PUSH_DTYPES = ("float32", "bfloat16")
"""optimizer.push_dtype: the number format of a replica's pushed gradient."""
TABLE_PULLS = ("rows", "whole")
"""optimizer.table_pulls: what a replica of a sparse model moves of its tables."""


@dataclass(frozen=True)
class DownpourOptions(Options):
    description: ClassVar[str] = (
        "Downpour SGD over MPI ranks: parameter-server shards (cluster.ps_shards) and "
        "asynchronous model replicas, launched with mpiexec (S + R x P ranks with "
        "cluster.partitions = P). A replica fetches the parameters every "
        "optimizer.n_fetch steps and pushes its summed gradient every n_push steps; "
        "optimizer.warm_start_steps lets replica 0 train alone first; "
        "optimizer.max_staleness bounds how far a replica may run ahead of the slowest. "
        "A lost replica does not stop the run.")
    docs: ClassVar[str] = "docs/downpour.md"
    shard_updates: ClassVar[tuple[str, ...]] = ("adarevision", "dcasgd")
    refused_because: ClassVar[Mapping[str, str]] = {
        "max_staleness": "it gates Downpour's pushes and fetches; EASGD and asynchronous "
                         "DiLoCo run on Downpour's shards but exchange with them on their "
                         "own schedule, where no such gate is built (docs/downpour.md, "
                         "\"Staleness bound\")"}

    fetch: str = option(
        "own_pushes", choice(FETCHES),
        "what a replica's fetch waits for: `\"own_pushes\"` (the shards have applied this "
        "replica's last push: read-your-writes, so one replica is sequential SGD), "
        "`\"asynchronous\"` (the fetch rides on the push and returns what the shards had "
        "published: at least one update stale) or `\"overlapped\"` (push and fetch move "
        "while the next step computes, as the paper's fetch and push threads: at least two "
        "updates stale); see [Downpour](downpour.md#fetch-what-a-replicas-fetch-waits-for)",
        hashed="unless default")
    table_pulls: str = option(
        "rows", choice(TABLE_PULLS),
        "for a sparse model: `\"rows\"` pulls only the table rows of the replica's next "
        "`n_fetch` batches and pushes only their gradients, the shards applying them at "
        "those rows alone (a replica never holds a whole table); `\"whole\"` moves the "
        "whole vector as for a dense model "
        "([Sparse models](sparse-models.md#row-sharded-tables-on-the-parameter-server))",
        hashed="never")
    push_dtype: str = option(
        "float32", choice(PUSH_DTYPES),
        "`\"bfloat16\"` rounds each pushed gradient to bfloat16 (round to nearest even); "
        "the shards widen it and fold in float32, the optimizer unchanged. Over RMA a push "
        "then Puts half the bytes; on one node (shared memory) the gradient is rounded the "
        "same way and nothing else changes "
        "([Downpour](downpour.md#narrowed-pushes-optimizerpush_dtype))",
        hashed="unless default")
    staleness_scaling: str = option(
        "none", choice(STALENESS_SCALINGS),
        "`\"inverse\"` divides the learning rate of each update a shard applies by the "
        "push's staleness, the shard's updates between the gradient's fetch and its "
        "application (at least 1), on every update rule the shards run (Zhang, Gupta, "
        "Lian and Liu, IJCAI 2016); `\"none\"` keeps the configured rate "
        "([Downpour](downpour.md#staleness-aware-steps-optimizerstaleness_scaling))",
        hashed="unless default")
    max_staleness: int | None = option(
        None, integer(0),
        "stale synchronous parallel (Ho et al., NIPS 2013): a replica whose clock (its "
        "pushes, each of `n_push` steps) is more than this many ahead of the slowest live "
        "replica's waits, without spinning, until it is not, and each fetch holds every "
        "live replica's pushes up to that many clocks back; `0` is bulk-synchronous; unset, "
        "fully asynchronous ([Downpour](downpour.md#staleness-bound-optimizermax_staleness))",
        hashed="unless default")

    def checked(self, given: Mapping[str, Any], settings: Mapping[str, Mapping[str, Any]],
                where: str) -> Options:
        if self.max_staleness is not None and self.fetch != "own_pushes":
            raise ConfigError(
                f"{where}: optimizer.max_staleness = {self.max_staleness} fetches after the "
                f"replica's own push is applied and the slowest replica is within the bound, "
                f"which leaves optimizer.fetch = \"{self.fetch}\" nothing to save; leave "
                f"fetch at \"own_pushes\"")
        return self
