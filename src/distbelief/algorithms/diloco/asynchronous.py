"""Asynchronous DiLoCo (`algorithm = "diloco"`, `asynchronous = true`): DiLoCo's outer
optimizer (Douillard et al. 2023, arXiv 2311.08105) on the parameter-server shards, each
replica's delta applied as it lands, as in Async Local-SGD (Liu et al. 2024, arXiv
2401.09135), on Downpour's machinery.

Replica i, every block of H = inner_steps local steps:

    theta_i = pull                    the global parameters, with its own last delta in
    x_i     = theta_i, then H steps of the inner optimizer (optimizer.update, state local)
    Delta_i = theta_i - x_i           pushed (optionally as bfloat16: optimizer.push_dtype)

and each shard applies what lands on its slice with the outer optimizer
(config.build_outer_optimizer: Nesterov momentum or SGD at outer_learning_rate / R, R
replicas: R deltas landing move the parameters as much as one synchronous round, whose
outer step takes their average; unweighted, Nesterov at 0.7 diverged with 2 replicas; or
Async Local-SGD's delayed Nesterov, whose momentum moves once every R deltas), as
Downpour's shards apply a gradient: the outer step IS the shard's update rule, so neither
transport changes. Deltas of two replicas that land between two folds of a shard are
summed into one outer step (Downpour's accumulate), and the shards' version counters
measure each delta's staleness (outer steps applied between its pull and its
application), reported in summary.json as Downpour's is.

Everything else is Downpour's (n_fetch = n_push = H, which config.json records): shards
and their checkpoints (the outer optimizer's state included), shard 0's supervisor, run
control (max_steps counts total steps), a lost replica written off while the others go
on. A resumed run starts every replica from the checkpointed global parameters with a
fresh inner optimizer state (as EASGD's replicas, averaging/elastic.py).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import IO, Any

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.downpour.replica import Replica
from distbelief.algorithms.session import RunSetup
from distbelief.config import Config, build_optimizer, build_outer_optimizer
from distbelief.errors import ConfigError


class DilocoReplica(Replica):
    """A Downpour replica that runs DiLoCo's inner loop: H local steps of its own
    optimizer from the last pulled parameters, then push the delta and pull the new
    global parameters in one exchange (read-your-writes: the pull holds the push)."""

    def __init__(self, run: Any, network: Any, fetch: str, config: Config):
        super().__init__(run, network, fetch)
        # Its schedule runs on this replica's local steps (self.t, resumed with it).
        self.local_optimizer = build_optimizer(config, self.params.size)
        self.theta = np.zeros_like(self.params)  # the global parameters last pulled
        self.pushed = np.zeros_like(self.params)  # the delta, never a gradient

    def _first_claim(self) -> int:
        granted = super()._first_claim()
        np.copyto(self.theta, self.params)
        return granted

    def _train_block(self, steps: int) -> int:
        """Train `steps` granted local steps from theta, then push the delta with the next
        claim and pull; returns the steps that claim was granted."""
        return self._train_locally(steps, self._exchange_delta)

    def _exchange_delta(self, control: Any) -> None:
        """Push theta - x_i with the control exchange, then pull the parameters once the
        shards have applied it; x_i and theta become them. One-sided, with the shards."""
        t0 = time.perf_counter()
        control = self._before_exchange(control) if self.lead else None
        np.subtract(self.theta, self.params, out=self.pushed)
        self.stats_.refetches += self.client.push_pull_own(self.pushed, self.params,
                                                           control)[1]
        np.copyto(self.theta, self.params)
        self.stats_.rma_seconds += time.perf_counter() - t0
        self.stats_.pushes += 1
        self.stats_.fetches += 1


def downpour_settings(config: Config) -> Config:
    """The configuration Downpour's machinery runs DiLoCo with: a replica pushes and pulls
    once per H = inner_steps local steps (n_fetch = n_push = H, as config.json records)."""
    h = config.optimizer.inner_steps
    return dataclasses.replace(config, optimizer=dataclasses.replace(
        config.optimizer, n_fetch=h, n_push=h))


def train(config: Config, comm: MPI.Comm, stream: IO[str] | None = sys.stdout,
          resume: str = "auto", setup: RunSetup | None = None) -> dict[str, Any] | None:
    """Run asynchronous DiLoCo on the ranks of `comm` (ps_shards shards, the others
    replicas); the summary on rank 0, None elsewhere. Collective over `comm` for the
    set-up, then as Downpour (algorithms.downpour.train, whose errors it raises)."""
    from distbelief.algorithms import downpour

    if config.cluster.partitions != 1:
        raise ConfigError("optimizer.algorithm = \"diloco\" runs replicas of one rank each; "
                          f"cluster.partitions = {config.cluster.partitions} is not "
                          "supported")
    config = downpour_settings(config)
    # Each delta weighs 1/R: R of them make one synchronous round's step (module docstring).
    replicas = max(comm.Get_size() - config.cluster.ps_shards, 1)
    opt = config.optimizer
    momentum = None if opt.outer_update == "sgd" else opt.outer_momentum
    variant = downpour.Variant(
        replica_role=lambda run, network, fetch: DilocoReplica(run, network, fetch, config),
        shard_update=lambda size: build_outer_optimizer(config, size, replicas),
        name=(f"diloco (asynchronous, outer {opt.outer_update} lr "
              f"{opt.outer_learning_rate:g}"
              + ("" if momentum is None else f" momentum {momentum:g}")
              + f", inner steps {opt.inner_steps})"),
        summary={"asynchronous": True, "inner_steps": opt.inner_steps,
                 "outer_update": opt.outer_update,
                 "outer_learning_rate": opt.outer_learning_rate,
                 "outer_momentum": momentum})
    return downpour.train(config, comm, stream, resume=resume, variant=variant, setup=setup)
