"""Which parameter-server transport a job uses, and opening it on every rank.

open_parameter_server (collective) chooses shared memory (shared_memory.py) when every
rank is on one node and the optimizer's state can be shared, else RMA (rma_shard.py,
rma_client.py), unless told otherwise (requested_transport). A new transport is a shard
and a client class in ps/ and a branch here.
"""

from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

from distbelief.errors import ConfigError
from distbelief.model.layout import DTYPE, balanced_ranges
from distbelief.ps import run_control as rc
from distbelief.ps.endpoint import TRANSPORT_ENV, TRANSPORTS, RuleFactory
from distbelief.ps.rma_client import ParameterClient
from distbelief.ps.rma_shard import ParameterServerShard
from distbelief.ps.rma_windows import PUSH_BYTES, _ShardWindows
from distbelief.ps.shared_memory import SharedMemoryClient, SharedMemoryShard, _open_shared
from distbelief.runtime.topology import Topology


def requested_transport(transport: str | None = None) -> str:
    """`transport`, or else $DISTBELIEF_PS_TRANSPORT, or else "auto"; validated. Pure, so a
    bad value raises ConfigError on every rank before any communication."""
    value = transport or os.environ.get(TRANSPORT_ENV) or "auto"
    if value not in TRANSPORTS:
        raise ConfigError(f"parameter-server transport {value!r} (from "
                          f"{'the caller' if transport else TRANSPORT_ENV}) must be one of "
                          f"{', '.join(TRANSPORTS)}")
    return value


def open_parameter_server(comm_world: MPI.Comm, topology: Topology, size: int,
                          optimizer: RuleFactory,
                          initial: np.ndarray | None = None,
                          transport: str | None = None,
                          control_replicas: int = 0,
                          gradients_before: int = 0,
                          push_dtype: str = "float32",
                          ) -> ParameterServerShard | ParameterClient:
    """Create the parameter server: a ParameterServerShard on shard ranks, a
    ParameterClient on every other rank (replicas and the coordinator).

    Collective over `comm_world`: every rank calls it, with the same topology, size and
    configuration; it creates the windows in one fixed order. It validates first, so a bad
    configuration raises ConfigError on every rank before any communication.
    `optimizer(n)` builds the optimizer for a slice of n parameters (on shards; on the
    shared transport also on clients, once per shard, and once with n = 1 on every rank
    to see whether its state can be shared); `initial` is the full initial parameter
    vector (each shard copies its slice) or, on a shard, its slice alone (what a lean
    start builds: Network.init_slice); None means zeros. `transport`: "auto", "shared"
    or "rma" (None: $DISTBELIEF_PS_TRANSPORT, else "auto"; see requested_transport).
    `control_replicas` > 0 reserves Downpour's run control block (distbelief.ps.run_control)
    for that many replicas on shard 0 (every shard's windows have the same layout).
    `gradients_before`: on a shard, the gradients its slice had applied in earlier jobs
    (its checkpoint says), where the count its optimizer steps with (`update=`, the
    learning-rate schedule's position) continues.
    `push_dtype` (optimizer.push_dtype, rma_windows.PUSH_BYTES): "bfloat16" rounds each
    pushed gradient to bfloat16; over RMA the push slots hold bfloat16 (half the bytes
    Put), on shared memory the client folds the rounded float32 gradient.
    Returns once every shard has published its initial parameters.
    """
    requested = requested_transport(transport)
    if push_dtype not in PUSH_BYTES:
        raise ConfigError(f"push_dtype {push_dtype!r} must be one of "
                          f"{', '.join(PUSH_BYTES)}")
    if size < topology.ps_shards:
        raise ConfigError(f"cannot shard {size} parameters over {topology.ps_shards} "
                          f"parameter-server shards; use at most {size} shards")
    if comm_world.Get_size() != topology.world_size:
        raise ConfigError(f"topology is for {topology.world_size} ranks, the communicator "
                          f"has {comm_world.Get_size()}")
    ranges = balanced_ranges(size, topology.ps_shards)
    if initial is not None:
        own = ranges[topology.shard_index] if topology.is_shard else (0, size)
        if initial.dtype != DTYPE or initial.shape not in ((size,), (own[1] - own[0],)):
            raise ValueError(f"initial parameters must be float32 of shape ({size},) or, on "
                             f"a shard, its slice's ({own[1] - own[0]},); got "
                             f"{initial.dtype} {initial.shape}")
    # The collective part, identical on every rank whatever its role: a private
    # communicator (our windows and barrier never mix with the caller's traffic), then the
    # windows in one fixed order (size 0 off the shards).
    comm = comm_world.Dup()
    try:
        segments = _open_shared(comm, topology, ranges, optimizer, requested,
                                rc.block_bytes(control_replicas))
    except ConfigError:
        comm.Free()
        raise
    endpoint: ParameterServerShard | ParameterClient
    if segments is not None:
        if topology.is_shard:
            endpoint = SharedMemoryShard(comm, segments, topology, size,
                                         optimizer(ranges[topology.world_rank][1]
                                                   - ranges[topology.world_rank][0]), initial,
                                         gradients_before)
        comm.Barrier()  # every shard has initialised its segment
        if not topology.is_shard:
            endpoint = SharedMemoryClient(comm, segments, topology, size, optimizer,
                                          push_dtype)
        return endpoint
    index = topology.shard_index
    local_count = 0 if index is None else ranges[index][1] - ranges[index][0]
    windows = _ShardWindows(comm, local_count, rc.block_bytes(control_replicas),
                            clients=topology.world_size - topology.ps_shards,
                            push_dtype=push_dtype,
                            largest_count=max(stop - start for start, stop in ranges))
    # Local set-up: a shard publishes its initial parameters under its own lock.
    if topology.is_shard:
        endpoint = ParameterServerShard(comm, windows, topology, size,
                                        optimizer(local_count), initial, gradients_before)
    else:
        endpoint = ParameterClient(comm, windows, topology, size)
    # Collective again: every shard has published before any client can pull.
    comm.Barrier()
    return endpoint
