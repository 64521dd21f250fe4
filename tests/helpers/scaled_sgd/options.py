"""scaled_sgd's own [optimizer] keys (imports nothing of its trainer)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from distbelief.errors import ConfigError
from distbelief.options import Options, integer, number, option


@dataclass(frozen=True)
class ScaledOptions(Options):
    description: ClassVar[str] = ("Single-process sgd whose learning rate is scaled by "
                                  "optimizer.rate_scale, for at most optimizer.step_cap steps.")

    rate_scale: float = option(1.0, number(0.0, strict=True, maximum=10.0),
                               "the factor on optimizer.learning_rate")
    step_cap: int = option(0, integer(0), "stop after this many steps at most (0 = no cap)",
                           hashed="never")

    def checked(self, given: Mapping[str, Any], settings: Mapping[str, Mapping[str, Any]],
                where: str) -> Options:
        if settings["optimizer"]["learning_rate"] * self.rate_scale > 1.0:
            raise ConfigError(f"{where}: optimizer.rate_scale = {self.rate_scale:g} takes "
                              "the learning rate above 1")
        return self
