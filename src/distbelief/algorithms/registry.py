"""The training algorithms by name: one `Algorithm` line each, read by the run's launch
(`algorithms.launch`), `distbelief help`, `compare`, config validation and the docs' list
(tests/test_registry.py).

Trainers are named as "module:function" strings and imported only when a run asks for one,
so loading one algorithm imports none of the others. An algorithm's own [optimizer] keys
are an options dataclass in its package ("module:Class", distbelief.options.Options),
which imports nothing of its trainer. This module imports nothing of distbelief, which lets
`config` (below the algorithms in docs/architecture.md) read it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Algorithm:
    """What the rest of the package needs to know about one algorithm."""

    name: str                 # optimizer.algorithm
    trainer: str              # "module:function": function(config, comm, resume=, setup=)
    summary: str              # a few words for --help and the docs
    options: str | None = None
    """"module:Class": the [optimizer] keys only this algorithm reads (an Options
    dataclass, distbelief.options); None: it has none of its own."""
    shards: str = "never"
    """"always", "never", "ignored" (never, and cluster.ps_shards is not checked), or an
    optimizer key: shards when it is set."""
    coordinators: int = 0     # ranks besides the shards and the replicas
    one_replica: bool = False
    """True: it trains one replica (over cluster.partitions ranks), so a replica count
    does not apply to it (compare runs it once per grid point, not per count)."""
    shard_rule: str | None = None
    """"module:function", function(config, size): the update rule its shards apply, where
    it is not optimizer.update's (config.build_optimizer); the memory plan counts its
    state arrays."""
    one_process_trainer: str | None = None
    """With cluster.partitions = 1: "module:function", called function(config,
    resume=..., setup=...) in this process, without MPI (setup: session.RunSetup)."""
    shard_trainer: str | None = None
    """With settings that need shards (`needs_shards`): "module:function", called as
    `trainer` is, in its place."""
    spares: str = "never"
    """Whether cluster.spare_replicas may be > 0 (replicas a spare can stand in for:
    algorithms.downpour.spares, Sandblaster's coordinator): "always", "never", or an
    optimizer key (when it is set)."""
    no_spares: str = ""
    """Why it cannot use spare replicas (where `spares` says so), for the error."""
    standby_shards: str = "never"
    """Whether cluster.standby_shards may be true (a lost shard's slice adopted by shard 0:
    Downpour's shards, algorithms.downpour.shards): "always", "never", or an optimizer
    key (when it is set)."""
    no_standby_shards: str = "its shards cannot adopt a lost shard's slice (only Downpour's do)"
    """Why a lost shard ends its runs, for the error."""

    def needs_shards(self, optimizer: Mapping[str, Any]) -> bool:
        """Whether runs with these [optimizer] settings keep parameters on shards."""
        if self.shards in ("always", "never", "ignored"):
            return self.shards == "always"
        return bool(optimizer.get(self.shards))

    def takes_spares(self, optimizer: Mapping[str, Any]) -> bool:
        """Whether runs with these [optimizer] settings can have spare replicas."""
        if self.spares in ("always", "never"):
            return self.spares == "always"
        return optimizer.get(self.spares) not in (None, False)

    def takes_standby_shards(self, optimizer: Mapping[str, Any]) -> bool:
        """Whether runs with these [optimizer] settings can have cluster.standby_shards."""
        if self.standby_shards in ("always", "never"):
            return self.standby_shards == "always"
        return optimizer.get(self.standby_shards) not in (None, False)

    def in_one_process(self, partitions: int) -> bool:
        """Whether runs of `partitions` ranks per replica train in this process, no MPI."""
        return self.one_process_trainer is not None and partitions == 1

    def load_options(self) -> type | None:
        """The options dataclass of this algorithm's own keys (imported now), or None."""
        return None if self.options is None else _load(self.options)

    def load_shard_rule(self) -> Callable[..., Any] | None:
        """The function that makes its shards' update rule (imported now); None where it is
        optimizer.update's."""
        return None if self.shard_rule is None else _load(self.shard_rule)

    def load_trainer(self, partitions: int,
                     optimizer: Mapping[str, Any] | None = None) -> Callable[..., Any]:
        """The trainer for runs of `partitions` ranks per replica with these [optimizer]
        settings (imported now)."""
        name = self.trainer
        if self.in_one_process(partitions):
            name = self.one_process_trainer
        elif self.shard_trainer is not None and self.needs_shards(optimizer or {}):
            name = self.shard_trainer
        return _load(name)


def _load(name: str) -> Any:
    """What "module:name" names, its module imported now."""
    module, _, attribute = name.partition(":")
    return getattr(importlib.import_module(module), attribute)


ALGORITHMS: tuple[Algorithm, ...] = (
    Algorithm("sgd", "distbelief.algorithms.partitioned_sgd:train",
              "one process, the baseline", shards="ignored", one_replica=True,
              one_process_trainer="distbelief.algorithms.sgd:train",
              no_spares="one model on P ranks has no replica to stand in for"),
    Algorithm("downpour", "distbelief.algorithms.downpour.trainer:train",
              "Downpour SGD against a sharded parameter server",
              options="distbelief.algorithms.downpour.options:DownpourOptions",
              shards="always", spares="always", standby_shards="always"),
    Algorithm("sandblaster", "distbelief.algorithms.sandblaster.roles:train",
              "Sandblaster L-BFGS", shards="always", coordinators=1,
              options="distbelief.algorithms.sandblaster.options:SandblasterOptions",
              spares="always"),
    Algorithm("sync", "distbelief.algorithms.sync.trainer:train",
              "synchronous data-parallel SGD, optionally with backup workers",
              options="distbelief.algorithms.sync.options:SyncOptions",
              shards="backup_workers",
              no_spares="every replica takes part in each step's all-reduce"),
    Algorithm("averaging", "distbelief.algorithms.averaging.collective:train",
              "periodic parameter averaging, or EASGD with optimizer.elastic_alpha",
              options="distbelief.algorithms.averaging.options:AveragingOptions",
              shards="elastic_alpha",
              shard_trainer="distbelief.algorithms.averaging.elastic:train",
              spares="elastic_alpha", standby_shards="elastic_alpha",
              no_spares="periodic averaging's all-reduce takes every replica (EASGD, with "
                        "optimizer.elastic_alpha, can)"),
    Algorithm("hogwild", "distbelief.algorithms.hogwild.trainer:train",
              "lock-free shared parameters on one node",
              options="distbelief.algorithms.hogwild.options:HogwildOptions",
              no_spares="its replicas are threads of one process, lost together"),
    Algorithm("diloco", "distbelief.algorithms.diloco.synchronous:train",
              "DiLoCo: inner_steps local steps, then an outer optimizer on the replicas' "
              "deltas; optimizer.asynchronous applies each delta on the shards",
              options="distbelief.algorithms.diloco.options:DiLoCoOptions",
              shards="asynchronous",
              shard_trainer="distbelief.algorithms.diloco.asynchronous:train",
              shard_rule="distbelief.config:build_outer_optimizer", spares="asynchronous",
              standby_shards="asynchronous",
              no_spares="the synchronous form's all-reduce takes every replica (the "
                        "asynchronous form, optimizer.asynchronous = true, can)"),
)
"""Every algorithm, one line each: a new one is a folder under algorithms/ and a line here."""


def names() -> tuple[str, ...]:
    return tuple(algorithm.name for algorithm in ALGORITHMS)


def get(name: str) -> Algorithm:
    """The algorithm called `name`; KeyError when there is none."""
    for algorithm in ALGORITHMS:
        if algorithm.name == name:
            return algorithm
    raise KeyError(name)
