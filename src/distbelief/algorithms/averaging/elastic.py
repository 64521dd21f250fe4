"""EASGD, elastic averaging SGD (`algorithm = "averaging"` with `elastic_alpha` set), in its
asynchronous form: Zhang, Choromanska and LeCun (2015), "Deep learning with elastic
averaging SGD" (NIPS), Algorithm 1 (asynchronous EASGD), on Downpour's machinery.

A center variable x~ lives on the parameter-server shard(s) (ps_shards >= 1). Replica i
trains on its own part of the data with its own optimizer (optimizer.update adagrad or
sgd; that state stays local) and, every tau = `average_every` local steps:

    read x~                       (a pull from the shards)
    e   = alpha (x_i - x~)        (alpha = `elastic_alpha`, the paper's moving rate)
    x_i = x_i - e                 (the replica moves toward the center)
    x~  = x~ + e                  (the center moves toward the replica: a push of e)

The push is Downpour's one-sided accumulate (MPI_Accumulate SUM into the shard's
accumulator, or the shared-memory segment), which is exactly an add, so the shard needs
only an update rule that applies what it received AS IS: `CenterUpdate` below, x~ += sum
of the e's pushed since the last fold, where Downpour's shards apply an Adagrad or SGD
step. Choosing the rule, rather than pushing -e/lr through the SGD rule or adding a mode
to the shard loop, keeps the shard code unchanged (the rule is the shard's optimizer
object, which both transports already call) and keeps the arithmetic exact: no learning
rate is multiplied in and divided out. The rule has no state, so the shard checkpoints
hold the center variable and nothing else.

Everything else is Downpour's (algorithms.downpour): the shards and their checkpoints,
shard 0's supervisor (stop rules, evaluation, metrics, summary), run control (each push
claims the next tau steps; max_steps counts total steps), and the handling of a lost
replica, which EASGD, unlike the collective average (averaging.collective), survives: the
others keep moving the center. The model that is evaluated, checkpointed and reported is
the center variable x~. A resumed run starts every replica from the checkpointed center,
with a fresh local optimizer state (the replicas' own variables x_i are not checkpointed;
the paper's analysis starts them anywhere).
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
from distbelief.config import Config, build_optimizer
from distbelief.errors import ConfigError
from distbelief.model.optimizers import ShardRule


class CenterUpdate(ShardRule):
    """The shard-side rule of EASGD: the center variable takes what replicas pushed as a
    plain sum, x~ += delta (the elastic differences e). Stateless."""

    def step(self, params: np.ndarray, delta: np.ndarray,
             copy: np.ndarray | None = None, *, update: int | None = None) -> None:
        """params += delta in place; with `copy`, also store the result there. No rate, so
        `update` (the shard's count) changes nothing."""
        np.add(params, delta, out=params)
        if copy is not None:
            np.copyto(copy, params)

    def state(self) -> dict[str, np.ndarray]:
        return {}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        if state:
            raise ValueError(f"the EASGD center keeps no optimizer state, got "
                             f"{sorted(map(str, state))}")


def elastic_step(params: np.ndarray, center: np.ndarray, alpha: float,
                 out: np.ndarray) -> np.ndarray:
    """One elastic exchange on the replica's side: out = e = alpha (params - center), and
    params -= e. Returns `out` (what the replica pushes to the center). Local."""
    np.subtract(params, center, out=out)
    out *= np.float32(alpha)
    params -= out
    return out


class ElasticReplica(Replica):
    """A Downpour replica that runs EASGD: local optimizer steps on its own parameters
    x_i, and at the end of every block of tau steps the elastic exchange with the center
    (module docstring). Its run control (claims, commands, checkpoints, the end) is
    Downpour's, one exchange per block."""

    def __init__(self, run: Any, network: Any, fetch: str, config: Config):
        super().__init__(run, network, fetch)
        opt = config.optimizer
        self.alpha = float(opt.elastic_alpha)
        # Its schedule runs on this replica's local steps (self.t, resumed with it).
        self.local_optimizer = build_optimizer(config, self.params.size)
        self.center = np.zeros_like(self.params)
        self.pushed = np.zeros_like(self.params)  # e, never the gradient itself

    def _train_block(self, steps: int) -> int:
        """Train `steps` granted local steps on x_i, then the elastic exchange with the
        next claim; returns the steps that claim was granted."""
        return self._train_locally(steps, self._exchange_elastic)

    def _exchange_elastic(self, control: Any) -> None:
        """Read x~ (with this replica's own earlier pushes in it), move x_i toward it and
        push the difference with the control exchange. One-sided, with the shards."""
        t0 = time.perf_counter()
        control = self._before_exchange(control) if self.lead else None
        self.client.pull(self.center)
        if self.fetch_own_pushes:
            self.stats_.refetches += self.client.catch_up(self.center)
        self.stats_.fetches += 1
        elastic_step(self.params, self.center, self.alpha, self.pushed)
        self.client.push(self.pushed, control)
        self.stats_.rma_seconds += time.perf_counter() - t0
        self.stats_.pushes += 1


def downpour_settings(config: Config) -> Config:
    """The configuration Downpour's machinery runs EASGD with: a replica pulls and pushes
    once per tau = average_every steps (n_fetch = n_push = tau), which is what config.json
    then records."""
    tau = config.optimizer.average_every
    return dataclasses.replace(config, optimizer=dataclasses.replace(
        config.optimizer, n_fetch=tau, n_push=tau))


def train(config: Config, comm: MPI.Comm, stream: IO[str] | None = sys.stdout,
          resume: str = "auto", setup: RunSetup | None = None) -> dict[str, Any] | None:
    """Run asynchronous EASGD on the ranks of `comm` (ps_shards shards, the others
    replicas); the summary on rank 0, None elsewhere. Collective over `comm` for the
    set-up, then as Downpour (algorithms.downpour.train, whose errors it raises)."""
    from distbelief.algorithms import downpour

    if config.cluster.partitions != 1:
        raise ConfigError("optimizer.elastic_alpha (EASGD) runs replicas of one rank each; "
                          f"cluster.partitions = {config.cluster.partitions} is not "
                          "supported")
    config = downpour_settings(config)
    opt = config.optimizer
    variant = downpour.Variant(
        replica_role=lambda run, network, fetch: ElasticReplica(run, network, fetch, config),
        shard_update=lambda size: CenterUpdate(),
        name=f"averaging (EASGD, elastic_alpha {opt.elastic_alpha:g}, "
             f"every {opt.average_every} steps)")
    return downpour.train(config, comm, stream, resume=resume, variant=variant, setup=setup)
