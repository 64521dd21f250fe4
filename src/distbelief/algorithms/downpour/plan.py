"""Downpour's plan and what every role shares: the timing constants and tags, the errors,
the validated plan (plan_run, pure: every rank raises the same error before the first
collective), grant (a claim's steps) and Ending (how the run ended, as one rank knows it).
docs/downpour.md, "Design", says how the run goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distbelief.algorithms.common import TrainingDiverged
from distbelief.config import Config
from distbelief.data.hdf5 import training_rows
from distbelief.errors import ConfigError, DataError, UserError
from distbelief.model.sparse_network import is_sparse
from distbelief.ps import run_control as rc
from distbelief.records import checkpoint as ckpt
from distbelief.runtime.backoff import Backoff
from distbelief.runtime.communicators.topology import Topology

SPARE_POLL_S = (5e-3, 50e-3)
"""Back-off bounds of a spare polling shard 0 for a part to take over: a takeover waits at
most the longest sleep, and the CPU a waiting spare burns stays under 1% of a core."""

WARM_START_POLL_S = (1e-3, 20e-3)
"""Back-off bounds of replicas polling shard 0 while they wait for the warm start: slow,
since each poll is an RMA epoch that shard 0 has to serve."""

PAUSE_POLL_S = (0.2e-3, 5e-3)
"""Back-off bounds of a replica paused for a checkpoint or waiting for the teardown."""

BOUND_POLL_S = (0.05e-3, 0.5e-3)
"""Back-off bounds of a replica waiting for the slowest to come within
optimizer.max_staleness (each poll a control exchange with shard 0)."""

SHARD0_POLLS_PER_S = 20_000
"""What waiting client ranks may ask of shard 0 together, in control exchanges a second
(the warm start, a checkpoint pause, the teardown): each one's longest sleep is at least
their count / SHARD0_POLLS_PER_S, so 1,000 paused replicas poll every 50 ms, not 5 ms."""


def shard0_backoff(bounds: tuple[float, float], clients: int) -> Backoff:
    """Back-off within `bounds` for a client polling shard 0, its longest sleep raised so
    that `clients` of them stay within SHARD0_POLLS_PER_S."""
    low, high = bounds
    return Backoff(low, max(high, clients / SHARD0_POLLS_PER_S))

ROUND_INTERVAL_S = 5e-3
"""Shortest time between two shards' rounds: the latency of a checkpoint once every
replica has paused, and of the end of the run."""

CONTROL_POLL_S = 2e-3
"""Shard 0 reads the run control block at most this often (more often while replicas are
paused for a checkpoint, or wait at optimizer.max_staleness: BOUND_CONTROL_POLL_S)."""

BOUND_CONTROL_POLL_S = 0.2e-3
"""While a replica waits at optimizer.max_staleness, shard 0 reads the block this often at
most, to publish the new lowest clock (the latency of a bulk-synchronous step)."""

SWEEP_S = 0.25
"""How often shard 0 looks for lost replicas and shards, and the other ranks for lost
shards (distbelief.runtime.health.liveness: a /proc read per rank)."""

NOTICE_SLACK_S = 1.0
"""A rank's new SIGUSR1 is the launcher's notice of a death (hydra sends several per
death, within milliseconds) if shard 0 found a rank gone between that rank's previous
report, less this slack, and the decision; otherwise it is a stop request."""

NOTICE_DELAY_S = 0.5
"""How long a new SIGUSR1 waits for a rank to be found gone before it counts as a stop
request (a launcher signals while the dead process is still being torn down)."""

LEAVE_GRACE_S = 30.0
"""With TEARDOWN_LEAVE, how long shard 0 waits for ranks it cannot see (on other nodes) to
say they leave before it leaves itself (over RMA they need its progress to read it)."""

STATS_TAG = 7
"""Tag of a replica's statistics message to rank 0 at its end."""

LEAVING_TAG = 8
"""Tag of a client rank's message to rank 0 that it leaves (TEARDOWN_LEAVE), sent once its
last epoch on shard 0's windows has completed."""

# The int64 flags of a shards' round, combined with MAX over the shards. ROUND_WRITING: a
# shard's writer thread is still writing its part of a checkpoint (0: all are done).
ROUND_TERM, ROUND_USR1, ROUND_CHECKPOINT, ROUND_FINISHED, ROUND_WRITING = range(5)
ROUND_WIDTH = 5


class BadGradients(TrainingDiverged):
    """A replica computed run.max_bad_gradients_in_a_row non-finite gradients in a row:
    the run diverged (every replica), or its data holds NaN/inf (one replica)."""


class RunFailed(UserError):
    """The run stopped because of an error reported on another rank (its message is
    printed by rank 0)."""


# ------------------------------------------------------------------------------------------
# The plan: pure validation, the same on every rank, before any communication


@dataclass(frozen=True)
class DownpourPlan:
    """A validated Downpour run for one rank: its role and the run's cadences."""

    topology: Topology
    batch_size: int
    n_fetch: int
    n_push: int
    warm_start_steps: int
    max_steps: int
    max_bad_gradients: int = 10
    replica_timeout_s: float = 0.0
    row_pulls: bool = False
    """A sparse model whose replicas pull and push their batches' table rows only
    (optimizer.table_pulls = "rows"; downpour.row_replica)."""
    max_staleness: int | None = None  # optimizer.max_staleness (downpour.clocks)
    release_spares_at: tuple[int, ...] = ()
    """cluster.release_spares_at: the global steps at which a spare becomes one more
    training replica (downpour.spares: the job grows)."""

    @property
    def num_replicas(self) -> int:
        """The parts of the training data: the R replicas training from the start, and
        one more for each spare to be released (cluster.release_spares_at)."""
        return self.topology.num_replicas + len(self.release_spares_at)

    @property
    def first_spare(self) -> int:
        """The first spare group (R): groups from it on start as spares."""
        return self.topology.num_replicas

    @property
    def num_groups(self) -> int:
        """Every replica group, the spares after the R training replicas: the run control
        block has a row for each (cluster.spare_replicas; downpour.spares)."""
        return self.topology.num_groups

    def is_spare(self, replica: int) -> bool:
        return replica >= self.first_spare

    def joins_late(self, replica: int, base: int) -> bool:
        """Whether `replica` starts training only once the warm start is over, in a job
        that starts `base` global steps in (every rank answers the same). Spares are
        counted in when they take a part over, not here."""
        return (0 < replica < self.first_spare and self.warm_start_steps > 0
                and base < self.warm_start_steps)


def plan_run(config: Config, world_size: int, world_rank: int, n_train: int,
             held_out: int = 0) -> DownpourPlan:
    """Check that the job fits the configuration and the data; pure (no communication),
    so every rank raises the same ConfigError/DataError before the first collective.
    `n_train` rows are trained on, after `held_out` went to the validation split."""
    cluster, opt = config.cluster, config.optimizer
    topology = Topology(world_size, world_rank, cluster.ps_shards, cluster.partitions,
                        spares=cluster.spare_replicas)
    release = tuple(cluster.release_spares_at)
    if len(release) > cluster.spare_replicas:
        raise ConfigError(f"cluster.release_spares_at lists {len(release)} step(s), but "
                          f"cluster.spare_replicas = {cluster.spare_replicas}: release at "
                          f"most as many spares as the job has")
    parts = topology.num_replicas + len(release)
    smallest = n_train // parts  # balanced_ranges: sizes differ by <= 1
    if config.data.batch_size > smallest:
        rows = training_rows(n_train, held_out, config.data.path, config.data.validation)
        raise DataError(f"data.batch_size = {config.data.batch_size} is larger than the "
                        f"{smallest} training rows each of the {parts} "
                        f"replicas gets, from the {rows}; use a smaller batch or fewer "
                        f"replicas")
    return DownpourPlan(topology, config.data.batch_size, opt.n_fetch, opt.n_push,
                        opt.warm_start_steps, config.run.max_steps,
                        config.run.max_bad_gradients_in_a_row,
                        config.run.replica_timeout_seconds, _row_pulls(config),
                        opt.max_staleness, release)


def _row_pulls(config: Config) -> bool:
    """Whether replicas move table rows only (optimizer.table_pulls); ConfigError where
    the rest of the configuration cannot take it."""
    opt = config.optimizer
    # Downpour's own replicas alone move rows (make_replica's RowReplica); EASGD's and
    # DiLoCo's, on this machinery too, push whole vectors whatever table_pulls says.
    if (opt.algorithm != "downpour" or getattr(opt, "table_pulls", "whole") != "rows"
            or not is_sparse(config.model.layers)):
        return False
    why = None
    if opt.fetch == "overlapped":
        why = "optimizer.fetch = \"overlapped\" computes on a pull issued a step earlier"
    elif opt.push_dtype != "float32":
        why = "optimizer.push_dtype must be \"float32\""
    elif opt.update == "adarevision":
        why = "optimizer.update = \"adarevision\" keeps its state per version, not per row"
    if why:
        raise ConfigError(f"optimizer.table_pulls = \"rows\" (the default for a sparse "
                          f"model): {why}; set table_pulls = \"whole\" to move the whole "
                          f"vector instead")
    return True


def grant(claimed_before: int, want: int, max_steps: int) -> int:
    """Steps a claim of `want` receives when `claimed_before` were claimed before it (the
    result of the atomic fetch-and-add): all of them, or what is left of max_steps (0 =
    no limit). The grants of all claims add up to exactly min(claims, max_steps)."""
    if not max_steps:
        return want
    return max(0, min(want, max_steps - claimed_before))


@dataclass
class Ending:
    """How the run ended, as one rank knows it."""

    stop: int  # a run_control STOP_* code (0: ended on max_steps)
    stop_arg: int = 0
    teardown: int = rc.TEARDOWN_FREE
    failure: str | None = None  # a checkpoint error (the shards know its text)
    summary: dict[str, Any] | None = None  # rank 0

    def raise_error(self, config: Config) -> None:
        """The run's error, the same kind on every rank (rank 0 prints it)."""
        lr = config.optimizer.learning_rate
        if self.stop == rc.STOP_BAD_GRADIENTS:
            limit = config.run.max_bad_gradients_in_a_row
            raise BadGradients(
                f"training diverged or the data holds NaN/inf: replica {self.stop_arg - 1} "
                f"computed {limit} non-finite gradients in a row "
                f"(run.max_bad_gradients_in_a_row = {limit}), so the run stopped; they were "
                f"dropped, never pushed, so the parameters and checkpoints are finite. "
                f"Lower optimizer.learning_rate (now {lr:g}) or check the data")
        if self.stop == rc.STOP_DIVERGED:
            raise TrainingDiverged(f"training diverged: the training loss became non-finite; "
                                   f"lower optimizer.learning_rate (now {lr:g})")
        if self.stop == rc.STOP_CHECKPOINT_FAILED:
            if self.failure is not None:
                raise ckpt.CheckpointError(self.failure)
            raise RunFailed("the run stopped: a checkpoint could not be written")
        if self.stop == rc.STOP_ALL_LOST:
            raise RunFailed("every replica was lost, so the run stopped (its last state is "
                            "checkpointed); run the same command again to resume")
