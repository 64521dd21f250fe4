"""The [optimizer] keys Sandblaster L-BFGS owns (read by config; imports nothing of the
trainer)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from distbelief.errors import ConfigError
from distbelief.options import Options, choice, integer, number, option

LINE_SEARCHES = ("wolfe", "armijo")


@dataclass(frozen=True)
class SandblasterOptions(Options):
    description: ClassVar[str] = (
        "Sandblaster L-BFGS over MPI ranks: parameter-server shards, one coordinator and "
        "replicas (S + 1 + R x P ranks with cluster.partitions = P). The coordinator "
        "hands out work units of each batch, with backup copies for slow replicas; the "
        "shards keep the L-BFGS history. No learning rate: the line search sets the "
        "step.")
    docs: ClassVar[str] = "docs/sandblaster.md"
    no_learning_rate: ClassVar[str | None] = (
        "L-BFGS takes its step length from a line search")
    ignored_by_others: ClassVar[bool] = True
    batch_may_exceed_data: ClassVar[bool] = True  # then a batch is the whole training set

    m: int = option(10, integer(1), "L-BFGS history pairs (kept on the shards)")
    work_unit_size: int = option(
        0, integer(0), "examples per work unit; 0 = batch / (16 x replicas), at least 32",
        hashed="never", shown="0 (auto)")
    push_every_units: int = option(
        4, integer(1), "a replica pushes its gradient sum every this many units (every "
        "unit at the end of a batch)", hashed="never")
    backup_copies: int = option(
        2, integer(1), "at most this many replicas on one unit, the original included",
        hashed="never")
    line_search: str = option(
        "wolfe", choice(LINE_SEARCHES),
        "`\"wolfe\"` (weak Wolfe, bisection and doubling) or `\"armijo\"` (backtracking)")
    wolfe_c1: float = option(
        1e-4, number(0.0, strict=True, maximum=0.5),
        "the sufficient decrease constant, 0 < c1 < c2")
    wolfe_c2: float = option(
        0.9, number(0.0, strict=True, maximum=1.0), "the curvature constant, c1 < c2 < 1")
    max_line_search: int = option(
        20, integer(1), "loss and gradient evaluations per line search at most")
    gradient_tolerance: float = option(
        1e-6, number(0.0), "stop when the gradient norm is below", hashed="never")

    def checked(self, given: Mapping[str, Any], settings: Mapping[str, Mapping[str, Any]],
                where: str) -> Options:
        if not self.wolfe_c1 < self.wolfe_c2:
            raise ConfigError(f"{where}: optimizer.wolfe_c1 = {self.wolfe_c1:g} must be "
                              f"smaller than optimizer.wolfe_c2 = {self.wolfe_c2:g} (Wolfe "
                              "conditions need 0 < c1 < c2 < 1)")
        if self.wolfe_c2 >= 1.0:
            raise ConfigError(f"{where}: optimizer.wolfe_c2 = {self.wolfe_c2:g} must be "
                              "below 1")
        if not settings["data"]["in_memory"]:
            raise ConfigError(f"{where}: data.in_memory = false streams each replica's own "
                              "part of the training set, but a Sandblaster replica may be "
                              "handed any work unit and reads the whole set; leave "
                              "data.in_memory = true")
        return self
