"""The sync trainer, `train`; the design is the package docstring
(distbelief.algorithms.sync)."""

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
