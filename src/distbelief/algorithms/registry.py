"""The training algorithms by name: one `Algorithm` line each, read by the run's launch
(`algorithms.launch`), `compare`, config validation and the docs' list
(tests/test_registry.py).

Trainers are named as "module:function" strings and imported only when a run asks for one,
so loading one algorithm imports none of the others. This module imports nothing of
distbelief, which lets `config` (below the algorithms in docs/architecture.md) read it.
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
    own_keys: tuple[str, ...] = ()  # [optimizer] keys no other algorithm reads
    shards: str = "never"     # "always", "never", or an optimizer key: shards when it is set
    coordinators: int = 0     # ranks besides the shards and the replicas
    one_process_trainer: str | None = None
    """With cluster.partitions = 1: "module:function", called function(config,
    resume=..., setup=...) in this process, without MPI (setup: session.RunSetup)."""
    shard_trainer: str | None = None
    """With settings that need shards (`needs_shards`): "module:function", called as
    `trainer` is, in its place."""

    def needs_shards(self, optimizer: Mapping[str, Any]) -> bool:
        """Whether runs with these [optimizer] settings keep parameters on shards."""
        if self.shards in ("always", "never"):
            return self.shards == "always"
        return bool(optimizer.get(self.shards))

    def in_one_process(self, partitions: int) -> bool:
        """Whether runs of `partitions` ranks per replica train in this process, no MPI."""
        return self.one_process_trainer is not None and partitions == 1

    def load_trainer(self, partitions: int,
                     optimizer: Mapping[str, Any] | None = None) -> Callable[..., Any]:
        """The trainer for runs of `partitions` ranks per replica with these [optimizer]
        settings (imported now)."""
        name = self.trainer
        if self.in_one_process(partitions):
            name = self.one_process_trainer
        elif self.shard_trainer is not None and self.needs_shards(optimizer or {}):
            name = self.shard_trainer
        module, _, function = name.partition(":")
        return getattr(importlib.import_module(module), function)


ALGORITHMS: tuple[Algorithm, ...] = (
    Algorithm("sgd", "distbelief.algorithms.partitioned_sgd:train",
              "one process, the baseline",
              one_process_trainer="distbelief.algorithms.sgd:train"),
    Algorithm("downpour", "distbelief.algorithms.downpour:train",
              "Downpour SGD against a sharded parameter server",
              own_keys=("fetch", "push_dtype"), shards="always"),
    Algorithm("sandblaster", "distbelief.algorithms.sandblaster.roles:train",
              "Sandblaster L-BFGS", shards="always", coordinators=1),
    Algorithm("sync", "distbelief.algorithms.sync:train",
              "synchronous data-parallel SGD, optionally with backup workers",
              own_keys=("backup_workers",), shards="backup_workers"),
    Algorithm("averaging", "distbelief.algorithms.averaging.collective:train",
              "periodic parameter averaging, or EASGD with optimizer.elastic_alpha",
              own_keys=("average_every", "elastic_alpha"), shards="elastic_alpha",
              shard_trainer="distbelief.algorithms.downpour.elastic:train"),
    Algorithm("hogwild", "distbelief.algorithms.hogwild:train",
              "lock-free shared parameters on one node"),
    Algorithm("diloco", "distbelief.algorithms.averaging.diloco:train",
              "DiLoCo: inner_steps local steps, then an outer optimizer on the replicas' "
              "deltas; optimizer.asynchronous applies each delta on the shards",
              own_keys=("inner_steps", "outer_update", "outer_learning_rate",
                        "outer_momentum", "asynchronous", "push_dtype"),
              shards="asynchronous",
              shard_trainer="distbelief.algorithms.downpour.diloco:train"),
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
