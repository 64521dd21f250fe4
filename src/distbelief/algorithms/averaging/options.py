"""The [optimizer] keys periodic averaging (EASGD included) owns (read by config; imports
nothing of the trainers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from distbelief.options import Options, integer, number, option


@dataclass(frozen=True)
class AveragingOptions(Options):
    description: ClassVar[str] = (
        "Every rank is a replica (cluster.ps_shards = 0) that trains on its own part of "
        "the data and averages its parameters with the others every "
        "optimizer.average_every steps; a lost replica stops it with one line. With "
        "optimizer.elastic_alpha set it is EASGD: a center variable on the ps_shards "
        "shards (the model that is evaluated and checkpointed), each replica and the "
        "center pulled toward each other every average_every steps, and a lost replica "
        "does not stop the run.")
    docs: ClassVar[str] = "docs/averaging.md"

    average_every: int = option(
        10, integer(1), "local steps between two averages (EASGD: between two exchanges "
        "with the center); see [averaging](averaging.md)")
    elastic_alpha: float | None = option(
        None, number(0.0, strict=True, maximum=1.0),
        "set (0 < a <= 1), EASGD's moving rate, with the center variable on the "
        "`ps_shards` shards")

    def run_name(self) -> str | None:
        return None if self.elastic_alpha is None else "easgd"
