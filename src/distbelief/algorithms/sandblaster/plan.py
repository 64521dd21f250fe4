"""Sandblaster's plan and what every role shares: the message tags and the polling
back-off, the validated plan (plan_run, pure: every rank raises the same error before the
first message), the partitions' pieces and the shards' segments of them, and BatchRows
(which rows make up batch k). docs/sandblaster.md, "Design", says how the run goes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from distbelief.algorithms.sandblaster.lbfgs import LbfgsOptions
from distbelief.algorithms.sandblaster.work_units import unit_ranges
from distbelief.config import Config
from distbelief.data.hdf5 import training_rows
from distbelief.errors import ConfigError
from distbelief.model.layout import balanced_ranges
from distbelief.model.partition import partition_pieces
from distbelief.runtime.backoff import Backoff
from distbelief.runtime.communicators.topology import Topology

TAG_REQUEST, TAG_TASK, TAG_COMMAND, TAG_RESULT, TAG_FETCH, TAG_PARAMS, TAG_PUSH = range(
    201, 208)
TAG_FINISHED, TAG_STATS = 208, 209
"""A shard's answer to finish_trial, (trial id, its gt . d), sent when the trial is complete
(maybe never: a trial abandoned after a lost replica); a rank's statistics at the end of a
run that lost a replica (point-to-point instead of a gather: a collective would wait for
the dead)."""
TAG_RELAY_FETCH, TAG_RELAY_PARAMS = 210, 211
"""A replica's fetch of trial point `id` from its parent in
the relay tree (a pickled int) and the answer ([header | its pieces], or the header alone
with another id when that trial is over)."""
HEADER = 4
"""float32 slots in front of every vector message, read as int32: [trial or snapshot id,
units, partition, 0]."""

POLL_S = (20e-6, 1e-3)
"""Back-off bounds of every polling wait (min, max sleep). A replica waiting between
trials or a shard between commands wakes every millisecond at most (a few % of a core)."""
SPARE_POLL_S = (5e-3, 50e-3)
"""Back-off bounds of a waiting spare (cluster.spare_replicas) polling the coordinator for
a lost replica's part: under 1% of a core, and a takeover waits at most 50 ms for it."""

AUTO_UNITS_PER_REPLICA = 16
MIN_AUTO_UNIT = 32
BACKUP_LATE_FACTOR = 1.5
"""A unit gets a backup copy once its newest copy has been out this many times the
median seconds per unit of the recent units (distbelief.algorithms.sandblaster.work_units)."""


# ------------------------------------------------------------------------------------------
# The plan: pure validation, the same on every rank, before any communication


@dataclass(frozen=True)
class SandblasterPlan:
    """A validated Sandblaster run for one rank."""

    topology: Topology
    batch_size: int      # examples per gradient evaluation (<= n_train)
    n_train: int
    unit_size: int
    options: LbfgsOptions
    push_every: int
    backup_copies: int

    @property
    def num_replicas(self) -> int:
        return self.topology.num_replicas

    @property
    def full_batch(self) -> bool:
        return self.batch_size == self.n_train

    @property
    def units(self) -> list[tuple[int, int]]:
        return unit_ranges(self.batch_size, self.unit_size)

    @property
    def partitions(self) -> int:
        return self.topology.partitions

    @property
    def owners(self) -> list[int]:
        """The replica each unit belongs to (unit_owners)."""
        return unit_owners(len(self.units), self.num_replicas)

    @property
    def blocks(self) -> list[Block]:
        """Each replica's block of batch positions and of training rows (owner_blocks)."""
        return owner_blocks(self.units, self.owners, self.num_replicas, self.n_train,
                            self.batch_size)


Block = tuple[int, int, int, int]
"""A replica's (first, stop) batch positions (those of the units it owns) and (first, stop)
training rows (those its units' rows are drawn from)."""


def unit_owners(n_units: int, num_replicas: int) -> list[int]:
    """The replica each unit belongs to: balanced contiguous groups of units, so a replica
    owns one block of batch positions, hence of rows (owner_blocks), and reads only those
    at start. With fewer units than replicas, the last replicas own none. Pure."""
    owners: list[int] = []
    for replica, (a, b) in enumerate(balanced_ranges(n_units, min(n_units, num_replicas))):
        owners += [replica] * (b - a)
    return owners


def owner_blocks(units: list[tuple[int, int]], owners: list[int], num_replicas: int,
                 n_train: int, batch_size: int) -> list[Block]:
    """Per replica, its owned units' batch positions [p, q) and the rows [n p / B, n q / B)
    they are drawn from (BatchRows): the rows in proportion to the positions, so each
    block of rows is read at the same pace, and in the full batch the positions are the
    rows. A replica that owns no unit gets empty blocks. Pure."""
    blocks = []
    for replica in range(num_replicas):
        mine = [units[u] for u, owner in enumerate(owners) if owner == replica]
        if not mine:
            blocks.append((0, 0, 0, 0))
            continue
        p, q = mine[0][0], mine[-1][1]
        blocks.append((p, q, n_train * p // batch_size, n_train * q // batch_size))
    return blocks


Piece = tuple[int, int]


def shard_segments(pieces: list[Piece], ranges: list[Piece]) -> list[list[Piece]]:
    """Per shard, the parts of `pieces` (sorted [start, stop) ranges of the flat vector: one
    partition's parameters) that lie in the shard's range, in order. Pure. Shards own
    ascending contiguous ranges, so these parts, shard after shard, are the pieces back to
    back: each shard's share of a partition's own-size vector is one contiguous slice."""
    return [[(max(a, low), min(b, high)) for a, b in pieces if max(a, low) < min(b, high)]
            for low, high in ranges]


def all_pieces(network: Any, partitions: int,
               splits: list[list[int]] | None = None) -> list[list[Piece]]:
    """Per partition, the ranges of the flat parameter vector it owns (the whole vector
    when P = 1). Pure and cheap; ConfigError when `splits` do not fit the network."""
    if partitions == 1:
        return [[(0, network.layout.size)]]
    return partition_pieces(network.layers, network.layout, partitions, splits)


def plan_run(config: Config, world_size: int, world_rank: int, n_train: int,
             num_params: int, held_out: int = 0) -> SandblasterPlan:
    """Check that the job fits; pure, so every rank raises the same ConfigError before the
    first collective. `n_train` rows are trained on, after `held_out` went to the
    validation split."""
    opt, cluster = config.optimizer, config.cluster
    topology = Topology(world_size, world_rank, cluster.ps_shards, cluster.partitions,
                        coordinator=True, spares=cluster.spare_replicas)
    if cluster.release_spares_at:
        raise ConfigError("cluster.release_spares_at: Sandblaster's spares only replace lost "
                          "replicas (growth is Downpour's); leave it out")
    if cluster.ps_shards > num_params:
        raise ConfigError(f"cluster.ps_shards = {cluster.ps_shards} is more than the "
                          f"{num_params} parameters of the model")
    batch = min(config.data.batch_size, n_train)
    unit = opt.work_unit_size or max(min(batch, MIN_AUTO_UNIT),
                                     math.ceil(batch / (AUTO_UNITS_PER_REPLICA
                                                        * topology.num_replicas)))
    if unit > batch:
        rows = training_rows(n_train, held_out, config.data.path, config.data.validation)
        raise ConfigError(f"optimizer.work_unit_size = {unit} is larger than the batch of "
                          f"{batch} examples (data.batch_size, at most the {rows})")
    options = LbfgsOptions(m=opt.m, c1=opt.wolfe_c1, c2=opt.wolfe_c2,
                           wolfe=opt.line_search == "wolfe",
                           max_line_search=opt.max_line_search,
                           gradient_tolerance=opt.gradient_tolerance,
                           max_iterations=config.run.max_steps, full_batch=batch == n_train)
    return SandblasterPlan(topology, batch, n_train, unit, options, opt.push_every_units,
                           opt.backup_copies)


class BatchRows:
    """Which training rows make up batch k: all rows in order when the batch is the whole
    set, else, for each block (first, stop positions, first, stop rows) of `blocks`
    (default: one block, the whole batch over the whole set), consecutive pieces of a
    stream of seeded per-epoch permutations of the block's rows, at its positions of the
    batch. Every replica computes the same rows from (seed, k). With one block per
    replica (SandblasterPlan.blocks) the batch is stratified: a replica's units draw only
    from its own rows, each block's share of the batch in proportion to its rows, and each
    epoch of a block visits its rows once."""

    def __init__(self, n_train: int, batch_size: int, seed: int,
                 blocks: list[Block] | None = None):
        self.n, self.batch_size, self.seed = n_train, batch_size, seed
        self.blocks = [(0, batch_size, 0, n_train)] if blocks is None else blocks
        self._k = -1
        self._cache: dict[int, np.ndarray] = {}  # block -> its rows of batch self._k

    def rows(self, k: int) -> np.ndarray:
        """The rows of batch k, position by position."""
        return self.rows_at(k, 0, self.batch_size)

    def rows_at(self, k: int, start: int, stop: int) -> np.ndarray:
        """The rows at positions [start, stop) of batch k; only the blocks holding those
        positions are computed (a replica's own unit: its own block's stream alone)."""
        if self.batch_size >= self.n:
            return np.arange(start, min(stop, self.n))
        if k != self._k:
            self._k, self._cache = k, {}
        parts = []
        for index, (p, q, lo, hi) in enumerate(self.blocks):
            if q > p and p < stop and start < q:
                rows = self._cache.get(index)
                if rows is None:
                    rows = self._cache[index] = lo + self._stream(index, hi - lo,
                                                                  k * (q - p), q - p)
                parts.append(rows[max(start, p) - p:min(stop, q) - p])
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.intp)

    def _stream(self, block: int, n: int, first: int, count: int) -> np.ndarray:
        """Positions [first, first + count) of block `block`'s stream over its n rows."""
        positions = np.arange(first, first + count)
        epochs, offsets = np.divmod(positions, n)
        out = np.empty(count, dtype=np.intp)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self._permutation(block, int(epoch), n)[offsets[mask]]
        return out

    def _permutation(self, block: int, epoch: int, n: int) -> np.ndarray:
        # One block keys by the epoch alone: the batches of one replica's runs as before.
        key = (epoch,) if len(self.blocks) == 1 else (epoch, block)
        seq = np.random.SeedSequence(self.seed, spawn_key=key)
        return np.random.default_rng(seq).permutation(n)


RELAY_FANOUT = 2
"""Children per node of the relay tree over replicas: the shards serve trial points to
replicas 0..RELAY_FANOUT-1 only, and every replica serves its RELAY_FANOUT children, so a
shard sends O(RELAY_FANOUT) copies of its slice per trial whatever the number of replicas
(docs/sandblaster.md, "The trial point down a tree")."""


def relay_parent(replica: int) -> int | None:
    """The replica that `replica` fetches trial points from; None: from the shards. Pure."""
    return None if replica < RELAY_FANOUT else replica // RELAY_FANOUT - 1


def relay_children(replica: int, num_replicas: int) -> range:
    """The replicas that fetch trial points from `replica` (relay_parent's inverse). Pure."""
    first = RELAY_FANOUT * (replica + 1)
    return range(min(first, num_replicas), min(first + RELAY_FANOUT, num_replicas))


def poll_backoff() -> Backoff:
    """A fresh back-off for a polled wait of any Sandblaster role (sleeps within POLL_S)."""
    return Backoff(*POLL_S)
