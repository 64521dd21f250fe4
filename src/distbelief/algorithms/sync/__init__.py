"""Synchronous data-parallel SGD (`optimizer.algorithm = "sync"`), with optional backup
workers.

Every step, each of R replicas computes a gradient on its own batch from its own disjoint
part of the training set (data.hdf5.TrainShard, as Downpour's replicas do); the step
applies the mean of those gradients with the configured update rule (optimizer.update:
Adagrad or fixed-rate SGD, model.optimizers), so the result is single-process SGD with an
R times larger batch. This is what Horovod, PyTorch DDP and TensorFlow's
SyncReplicasOptimizer do; the project compares Downpour against it.

Two ways to run a step, chosen by `optimizer.backup_workers`:

- k = 0 (allreduce.py, `cluster.ps_shards = 0`): every rank is a replica; the gradients
  are summed with a non-blocking allreduce that is polled with back-off sleeps (MPICH's
  blocking waits spin a core: DESIGN.md), and every replica applies the same step to its
  own copy of the parameters, so the copies stay bit for bit identical (checked at the
  end of every run: summary.json "replicas_identical"). A lost replica stops the run with
  one line: the collective can never complete without it.
- k >= 1 (backups.py, `cluster.ps_shards = 1`): Chen, Pan, Monga, Bengio, Jozefowicz,
  "Revisiting Distributed Synchronous SGD" (arXiv:1604.00981, 2016): R replicas compute
  gradients for each step, the parameter server applies the mean of the first R - k to
  arrive and drops the rest, so the k slowest replicas (stragglers, or dead ones) never
  hold a step up.

References: Dean et al., "Large Scale Distributed Deep Networks" (NIPS 2012) for the
setting; Goyal et al., "Accurate, Large Minibatch SGD" (2017) and Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training" (VLDB 2020) for the
allreduce form; Chen et al. 2016 (above) for backup workers.
"""

from __future__ import annotations

import sys
from typing import IO, Any

from mpi4py import MPI

from distbelief.algorithms.session import RunSetup
from distbelief.config import Config
from distbelief.errors import ConfigError


def check_configuration(config: Config, world_size: int) -> int:
    """The number of replicas R for `world_size` ranks; ConfigError (the same on every
    rank, before any communication) when the configuration does not fit. Pure."""
    cluster, k = config.cluster, config.optimizer.backup_workers
    if cluster.partitions != 1:
        raise ConfigError(f"optimizer.algorithm = \"sync\" runs one rank per replica: "
                          f"cluster.partitions = {cluster.partitions} is not supported; "
                          f"leave it out (or use algorithm = \"downpour\" for model "
                          f"parallelism)")
    if k and cluster.ps_shards != 1:
        raise ConfigError(f"optimizer.algorithm = \"sync\" with backup_workers = {k} "
                          f"gathers each step on one parameter-server shard: set "
                          f"cluster.ps_shards = 1 (it is {cluster.ps_shards})")
    replicas = world_size - cluster.ps_shards
    if replicas < 1:
        raise ConfigError(f"{world_size} MPI rank(s) leave no replica after "
                          f"{cluster.ps_shards} parameter-server shard; run mpiexec -n "
                          f"{cluster.ps_shards + k + 1} or more")
    if k >= replicas:
        raise ConfigError(f"optimizer.backup_workers = {k} needs more replicas than that: "
                          f"{world_size} MPI ranks give {replicas} replica(s) after the "
                          f"shard, and each step takes the first R - k = {replicas - k} "
                          f"gradients; run mpiexec -n {cluster.ps_shards + k + 1} or more, "
                          f"or lower backup_workers")
    return replicas


def train(config: Config, comm: MPI.Comm, stream: IO[str] | None = sys.stdout,
          resume: str = "auto", setup: RunSetup | None = None) -> dict[str, Any] | None:
    """Train with synchronous SGD over the ranks of `comm`; the summary on the rank that
    wrote it (rank 0), None elsewhere. Collective over `comm`."""
    check_configuration(config, comm.Get_size())
    if config.optimizer.backup_workers:
        from distbelief.algorithms.sync import backups

        return backups.train(config, comm, stream, resume, setup)
    from distbelief.algorithms.sync import allreduce

    return allreduce.train(config, comm, stream, resume, setup)
