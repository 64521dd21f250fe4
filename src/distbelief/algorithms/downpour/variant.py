"""What an algorithm built on Downpour's machinery supplies in Downpour's place (EASGD:
averaging.elastic; asynchronous DiLoCo: diloco.asynchronous), so that Downpour names none
of them: a replica's role, the shards' update rule, and what shard 0 says of the run."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mpi4py import MPI

from distbelief.algorithms.downpour.replica import PartitionedReplica, Replica


def make_replica(run: Any, network: Any, fetch: str) -> Any:
    """Downpour's replica role for this rank (`run`: downpour.OpenRun): the plain one when
    partitions = 1, else a PartitionedReplica over the replica's partition communicator
    (topology.split_communicators). Local (no communication)."""
    comm = run.communicators.partition
    if run.plan.row_pulls:  # a sparse model moving its batches' rows (row_replica)
        from distbelief.algorithms.downpour.row_replica import RowReplica

        return RowReplica(run, network, fetch)
    if comm == MPI.COMM_NULL or comm.Get_size() == 1:
        return Replica(run, network, fetch)
    return PartitionedReplica(run, network, fetch)


@dataclass(frozen=True)
class Variant:
    """One algorithm on Downpour's machinery; DOWNPOUR is Downpour itself."""

    replica_role: Callable[..., Any] = make_replica
    """(run, network, fetch) -> a replica rank's role."""
    shard_update: Callable[[int], Any] | None = None
    """size -> a shard's update rule; None: optimizer.update's."""
    name: str = "downpour"
    """The run as shard 0's opening line names it."""
    summary: Mapping[str, Any] = field(default_factory=dict)
    """Keys of its own in summary.json (after push_dtype)."""


DOWNPOUR = Variant()
