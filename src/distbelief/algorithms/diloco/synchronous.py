"""Synchronous DiLoCo (`algorithm = "diloco"`, `asynchronous = false`, ps_shards = 0):
Douillard et al. (2023), "DiLoCo: Distributed Low-Communication Training of Language
Models", arXiv 2311.08105, Algorithm 1, on the averaging collective (averaging/collective.py).

Every rank is a replica; all start each round from the same global parameters theta.
A round:

    x_i   = theta, then H = inner_steps steps of the inner optimizer (optimizer.update,
            its state local to the replica and kept across rounds) on replica i's data
    Delta = (1/R) sum_i (theta - x_i)         the outer gradient: one all-reduce
    theta = OuterOpt(theta, Delta)            outer_update "nesterov" (lr outer_learning_rate,
                                              momentum outer_momentum) or "sgd"

The all-reduce is the averaging collective's (the parameters summed, then 1/R); since
every replica holds the same theta, (1/R) sum_i (theta - x_i) = theta - mean_i x_i, so
the bytes and the collective are averaging's, and the outer step (OuterStep) follows it.
With outer_update = "sgd" and outer_learning_rate = 1 a round is exactly parameter
averaging's average (theta - (theta - mean) = mean, up to float rounding).

With push_dtype = "bfloat16" the round carries the deltas themselves instead, each
rounded to bfloat16 and all-gathered (an all-reduce cannot sum bfloat16), then widened and
averaged in float32 in rank order on every rank (collective.Replica._average_narrowed):
half the bytes sent, R/2 times the bytes of an all-reduce received.

Checkpoints are averaging's, taken right after a round (every replica holds theta), with
the outer optimizer's state (the Nesterov buffer) in the parameter part. A lost replica
stops the run with one line (collective.py); asynchronous DiLoCo (asynchronous.py)
goes on without it.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import IO, Any

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.averaging import collective
from distbelief.algorithms.session import RunSetup
from distbelief.config import Config, build_outer_optimizer


class OuterStep:
    """DiLoCo's outer step on the replicas' averaged parameters: the delta from the round's
    starting point theta, then the outer optimizer on theta. Local (every replica applies
    it to the same numbers, so all hold the same theta after it)."""

    def __init__(self, config: Config, params: np.ndarray):
        opt = config.optimizer
        self.config = config
        self.optimizer = build_outer_optimizer(config, params.size)
        self.theta = params.copy()  # the global parameters this round started from
        self.delta = np.zeros_like(params)
        self.rounds = 0
        self.describe_text = (
            f"outer {opt.outer_update} lr {opt.outer_learning_rate:g}"
            + (f" momentum {opt.outer_momentum:g}" if opt.outer_update == "nesterov" else ""))

    def apply(self, average: np.ndarray) -> None:
        """`average` (the mean of the replicas' parameters) becomes the new theta: the
        outer optimizer steps theta with delta = theta - average. In place."""
        np.subtract(self.theta, average, out=self.delta)
        self.apply_delta(self.delta, average)

    def apply_delta(self, delta: np.ndarray, out: np.ndarray) -> None:
        """The outer optimizer steps theta with `delta` (the replicas' mean delta); the new
        theta is copied to `out` (the replica's parameters)."""
        self.optimizer.step(self.theta, delta, update=self.rounds)
        np.copyto(out, self.theta)
        self.rounds += 1

    def state(self) -> dict[str, np.ndarray]:
        """The outer optimizer's state, for the checkpoint's parameter part."""
        return {f"outer_{name}": value for name, value in self.optimizer.state().items()}

    def load(self, params: np.ndarray, state: dict[str, np.ndarray]) -> None:
        """Resume from a checkpoint: theta is its parameters, the outer state its own."""
        np.copyto(self.theta, params)
        self.optimizer.load_state({name.removeprefix("outer_"): value
                                   for name, value in state.items()})

    def describe(self) -> str:
        return self.describe_text

    def summary(self) -> dict[str, Any]:
        opt = self.config.optimizer
        return {"asynchronous": False, "inner_steps": opt.inner_steps,
                "outer_update": opt.outer_update,
                "outer_learning_rate": opt.outer_learning_rate,
                "outer_momentum": opt.outer_momentum if opt.outer_update == "nesterov"
                else None, "rounds": self.rounds}


def collective_settings(config: Config) -> Config:
    """The configuration the averaging collective runs DiLoCo with: a round every
    inner_steps local steps (average_every = H, which config.json then records)."""
    return dataclasses.replace(config, optimizer=dataclasses.replace(
        config.optimizer, average_every=config.optimizer.inner_steps))


def train(config: Config, comm: MPI.Comm, stream: IO[str] | None = sys.stdout,
          resume: str = "auto", setup: RunSetup | None = None) -> dict[str, Any] | None:
    """Run synchronous DiLoCo on the ranks of `comm` (every rank a replica); the summary on
    rank 0, None elsewhere. Collective over `comm`, as collective.train (whose errors it
    raises)."""
    config = collective_settings(config)
    variant = collective.Variant(
        name="diloco", outer=lambda params: OuterStep(config, params),
        narrow=config.optimizer.push_dtype == "bfloat16",
        survivor="asynchronous DiLoCo, optimizer.asynchronous = true,",
        what="synchronous DiLoCo")
    return collective.train(config, comm, stream, resume, variant=variant, setup=setup)
