"""The RMA transport's opener (transport.OPENERS["rma"]): every shard's windows, then an
RmaShard on shard ranks and an RmaClient on the others. It works for any placement of
the ranks, so it never declines. The windows: rma_windows.py; why each access is legal:
docs/rma-protocol.md.
"""

from __future__ import annotations

from mpi4py import MPI

from distbelief.ps.endpoint import ParameterClient, ParameterServerShard, ServerSpec
from distbelief.ps.rma_client import RmaClient
from distbelief.ps.rma_shard import RmaShard
from distbelief.ps.rma_windows import ShardWindows


def open_rma(comm: MPI.Comm, spec: ServerSpec,
             required: bool) -> ParameterServerShard | ParameterClient:
    """Collective over `comm` (the parameter server's private communicator): the windows
    in one fixed order (size 0 off the shards), then each shard publishes its initial
    parameters, and a barrier, so that no client pulls before every shard published.
    `required` changes nothing: RMA can always be used."""
    topology, ranges = spec.topology, spec.ranges
    index = topology.shard_index
    local_count = 0 if index is None else ranges[index][1] - ranges[index][0]
    windows = ShardWindows(comm, local_count, spec.control_bytes,
                           clients=topology.world_size - topology.ps_shards,
                           push_dtype=spec.push_dtype, pieces=spec.pieces,
                           largest_count=max(stop - start for start, stop in ranges),
                           slots=spec.push_slots)
    endpoint: ParameterServerShard | ParameterClient
    if topology.is_shard:
        endpoint = RmaShard(comm, windows, topology, spec.size, spec.rule(local_count),
                            spec.initial, spec.gradients_before)
    else:
        endpoint = RmaClient(comm, windows, topology, spec.size)
    comm.Barrier()
    return endpoint
