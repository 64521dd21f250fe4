"""The downpour trainer, `train`; the design is the package docstring
(distbelief.algorithms.downpour)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.common import StopSignals
from distbelief.algorithms.downpour.plan import grant, plan_run
from distbelief.algorithms.downpour.run import OpenRun, open_run, shard_lost_message
from distbelief.algorithms.downpour.shards import ShardRole
from distbelief.algorithms.downpour.supervisor import Supervisor
from distbelief.algorithms.downpour.variant import DOWNPOUR, Variant
from distbelief.algorithms.session import RunSession, RunSetup
from distbelief.config import Config, run_name
from distbelief.ps import run_control as rc
from distbelief.runtime.communicators.topology import Topology
from distbelief.runtime.health import watchdog
from distbelief.runtime.health.liveness import Peers
from distbelief.runtime.health.watchdog import RankLost, abort_job
from distbelief.runtime.threads import set_blas_threads

# What the command line, the tests and the benchmarks use from here.
__all__ = ["OpenRun", "Variant", "grant", "open_run", "plan_run", "train"]


# ------------------------------------------------------------------------------------------
# Entry point


def train(config: Config, comm: MPI.Comm, stream: IO[str] | None = sys.stdout,
          resume: str = "auto", variant: Variant = DOWNPOUR,
          setup: RunSetup | None = None) -> dict[str, Any] | None:
    """Run Downpour SGD on the ranks of `comm`; returns the run summary on rank 0, None
    on the other ranks.

    What a replica's fetch waits for is `optimizer.fetch` (options.FETCHES; the default,
    "own_pushes", makes one replica exactly sequential SGD). `resume` is one of common.RESUME_MODES ("auto": continue from a
    checkpoint in out_dir if there is one; "require"; "fresh").

    Collective over `comm` for the set-up: every rank calls it with the same
    configuration. It validates the rank count and data first, without communicating
    (ConfigError/DataError on every rank), then sets up and picks the checkpoint to resume
    from (any rank's UserError there is raised on every rank), opens the parameter
    server. Then replicas communicate one-sidedly only, shards among themselves (module
    docstring), and at the end every rank frees the windows together unless a rank was
    lost. Rank 0 writes the run folder and prints to `stream`; raises TrainingDiverged,
    BadGradients or CheckpointError (RunFailed off the shards) on every live rank when
    the run failed.

    `variant` is what an algorithm built on Downpour's machinery (EASGD, asynchronous
    DiLoCo) supplies in Downpour's place: a replica's role, the shards' update rule, the
    run's name and its own summary keys (variant.Variant).
    """
    session = RunSession(run_name(config), config, comm, stream, resume, setup=setup)
    info, network = session.info, session.network
    # Validated before the handlers go in: a bad configuration fails at once.
    topology = plan_run(config, comm.Get_size(), comm.Get_rank(), info.n_train,
                        info.held_out).topology
    set_blas_threads((config.run.threads or 1) if topology.is_replica else 1)
    # Handlers first: a signal that arrives during the set-up is counted and acted on
    # once training runs, instead of killing the rank (SIGUSR1's default action).
    with StopSignals() as signals:
        # Collective: the first, so the set-up is watched too. On several nodes every
        # rank beats in out_dir (distbelief.runtime.health.heartbeat) until the end.
        peers = Peers.gather(comm, config.run.out_dir, config.run.heartbeat_timeout_seconds)
        guard = watchdog.Watchdog(
            topology.world_rank, topology.describe_rank, config.run.stall_warn_seconds,
            config.run.stall_abort_seconds, lambda message: abort_job(comm, message),
            peers.gone, lambda lost: _abort_for(comm, topology, lost, peers))
        others = [r for r in range(topology.world_size) if r != topology.world_rank]
        with watchdog.watching(guard), _closing(peers):
            try:
                with guard.waiting("the other ranks to set the run up", others):
                    run = open_run(config, comm, resume, stream, signals, peers,
                                   variant.shard_update, session)
                with np.errstate(over="ignore", invalid="ignore"):
                    role = _make_role(run, config, network, info, stream, variant)
                    role.run()
                    ending = role.finish()
                if ending.teardown == rc.TEARDOWN_FREE:
                    session.faults.before_teardown()  # test-only
                _close(run, ending.teardown)
            except RankLost as lost:
                _abort_for(comm, topology, lost, peers)
    ending.raise_error(config)
    return ending.summary


def _close(run: OpenRun, teardown: int) -> None:
    """The teardown (OpenRun.close). A shard lost in it, after the run ended whole, with
    cluster.standby_shards: nothing is freed and this rank leaves as after any loss; its
    records stand. Other losses propagate (RankLost)."""
    try:
        run.close(teardown)
    except RankLost as lost:
        if not (0 < lost.rank < run.plan.topology.ps_shards
                and run.session.config.cluster.standby_shards):
            raise
        run.shard_lost(lost.rank, f"is gone (found while {lost.what})")
        run.close(rc.TEARDOWN_LEAVE)


def _abort_for(world: MPI.Comm, topology: Topology, lost: RankLost, peers: Peers) -> None:
    """A rank this one waited for is gone where nothing can go on without it: a shard, or
    any rank during the set-up or once the run is ending. Abort the job with a message."""
    if lost.rank < topology.ps_shards:
        abort_job(world, shard_lost_message(lost.rank, f"is gone{peers.how_gone(lost.rank)}"))
    else:
        watchdog.abort_for(world, topology.describe_rank, lost)


@contextmanager
def _closing(peers: Peers) -> Iterator[None]:
    """Stop this rank's heartbeat at the end, however the run ends (but an abort)."""
    try:
        yield
    finally:
        peers.close()


def _make_role(run: OpenRun, config: Config, network: Any, info: Any,
               stream: IO[str] | None, variant: Variant = DOWNPOUR) -> Any:
    topology = run.plan.topology
    if topology.is_replica:  # partitioned when partitions > 1
        return variant.replica_role(run, network, config.optimizer.fetch)
    if topology.world_rank == 0:
        return Supervisor(run, config, network, info, stream, variant)
    return ShardRole(run)
