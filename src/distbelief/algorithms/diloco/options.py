"""The [optimizer] keys DiLoCo owns (read by config; imports nothing of the trainers)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from distbelief.errors import ConfigError
from distbelief.options import Options, boolean, choice, integer, number, option

OUTER_UPDATES = ("nesterov", "sgd", "delayed_nesterov")
"""optimizer.outer_update (DiLoCo): the outer optimizer that applies the replicas' deltas:
"nesterov", SGD with Nesterov momentum outer_momentum (the paper's choice), plain "sgd"
(with outer_learning_rate = 1 that is parameter averaging), or "delayed_nesterov"
(asynchronous only: Async Local-SGD's rule, model.optimizers.DelayedNesterov)."""
MOMENTUM_OUTER_UPDATES = ("nesterov", "delayed_nesterov")
"""The outer updates that read optimizer.outer_momentum."""
OUTER_MOMENTUM = {False: 0.9, True: 0.5}
"""optimizer.outer_momentum when unset, by optimizer.asynchronous: the paper's 0.9 for the
synchronous form; 0.5 for the asynchronous one, where staleness adds momentum of its own
(Mitliagkas et al. 2016) and 0.9 missed 88% on the reference MLP in 4 runs of 4
(docs/performance.md, DiLoCo). outer_update = "delayed_nesterov" keeps 0.9."""


@dataclass(frozen=True)
class DiLoCoOptions(Options):
    description: ClassVar[str] = (
        "DiLoCo: each replica trains optimizer.inner_steps local steps, then the "
        "replicas' deltas go to an outer optimizer (outer_update, outer_learning_rate, "
        "outer_momentum). By default every rank is a replica and the deltas are averaged "
        "each round (an all-reduce; a lost replica stops it with one line); with "
        "optimizer.asynchronous = true the outer optimizer runs on the ps_shards shards, "
        "each delta applied as it lands, and a lost replica does not stop the run.")
    docs: ClassVar[str] = "docs/diloco.md"

    inner_steps: int = option(
        50, integer(1), "H, the local steps each replica takes with `optimizer.update` "
        "between two outer steps; see [DiLoCo](diloco.md)")
    outer_update: str = option(
        "nesterov", choice(OUTER_UPDATES),
        "the outer optimizer applied to the replicas' deltas (the parameters a round "
        "started from minus the replica's): `\"nesterov\"` (SGD with Nesterov momentum, "
        "torch's form), `\"sgd\"` (with `outer_learning_rate = 1`, the plain average) or, "
        "asynchronous only, `\"delayed_nesterov\"` (Async Local-SGD's: momentum moved once "
        "every R deltas, on their mean)")
    outer_learning_rate: float = option(
        0.7, number(0.0, strict=True, maximum=10.0),
        "the outer rate (0 < lr <= 10); the asynchronous form applies each replica's delta "
        "at this rate / R")
    outer_momentum: float | None = option(
        None, number(0.0, maximum=0.999),
        "`outer_update = \"nesterov\"` or `\"delayed_nesterov\"` only (an error with "
        "`\"sgd\"`, and out of the hash there); unset, 0.9 (the paper's) synchronous and "
        "0.5 asynchronous, where 0.9 missed 88% in 4 runs of 4; 0.9 with "
        "`\"delayed_nesterov\"`", shown="0.9 / 0.5")
    asynchronous: bool = option(
        False, boolean(),
        "false, every rank a replica and the deltas averaged each round by an all-reduce "
        "(`ps_shards = 0`); true, the outer optimizer runs on the `ps_shards` shards "
        "(default 1) and applies each delta as it lands")
    push_dtype: str = option(
        "float32", choice(("float32", "bfloat16")),
        "as Downpour's: `\"bfloat16\"` narrows the deltas on the wire, in both forms",
        hashed="unless default")

    def checked(self, given: Mapping[str, Any], settings: Mapping[str, Mapping[str, Any]],
                where: str) -> Options:
        delayed = self.outer_update == "delayed_nesterov"
        if self.outer_update not in MOMENTUM_OUTER_UPDATES and "outer_momentum" in given:
            raise ConfigError(f"{where}: optimizer.outer_momentum applies only to "
                              "outer_update = \"nesterov\" or \"delayed_nesterov\", not "
                              f"\"{self.outer_update}\"")
        if delayed and not self.asynchronous:
            raise ConfigError(f"{where}: optimizer.outer_update = \"delayed_nesterov\" is "
                              "for deltas that land one at a time: it needs "
                              "optimizer.asynchronous = true (the synchronous form steps "
                              "once per round on the mean of all deltas, which is plain "
                              "\"nesterov\")")
        if self.outer_momentum is not None:
            return self
        momentum = 0.9 if delayed else OUTER_MOMENTUM[self.asynchronous]
        return dataclasses.replace(self, outer_momentum=momentum)

    def unhashed(self) -> set[str]:
        out = super().unhashed()
        if self.outer_update not in MOMENTUM_OUTER_UPDATES:
            out.add("outer_momentum")  # not read
        return out
