"""scaled_sgd's trainer: the sgd trainer on the configuration its two keys change."""

from __future__ import annotations

import dataclasses
import sys
from typing import IO, Any

from distbelief.algorithms import sgd
from distbelief.config import Config


def train(config: Config, stream: IO[str] | None = sys.stdout,
          resume: str = "auto", setup: Any = None) -> dict[str, Any] | None:
    opt, run = config.optimizer, config.run
    steps = min(run.max_steps or opt.step_cap, opt.step_cap or run.max_steps)
    scaled = dataclasses.replace(
        config, optimizer=dataclasses.replace(opt, learning_rate=opt.learning_rate * opt.rate_scale),
        run=dataclasses.replace(run, max_steps=steps))
    return sgd.train(scaled, stream, resume, setup)
