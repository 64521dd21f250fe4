"""Which parameter-server transport a job uses, and opening it on every rank.

OPENERS is the name-to-opener table, one line per transport; open_parameter_server
(collective) validates the ServerSpec, then tries the transport asked for
(requested_transport) or, for "auto", each in the table's order: shared memory
(shared_memory.py) when every rank is on one node and the rule's state can be shared,
else RMA (rma.py), which always opens. A new transport is a module in ps/ with a shard, a
client (endpoint.ParameterServerShard, endpoint.ParameterClient) and an opener, and a
line here.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from mpi4py import MPI

from distbelief.errors import ConfigError
from distbelief.ps.endpoint import TRANSPORT_ENV, ParameterClient, ParameterServerShard, ServerSpec
from distbelief.ps.rma import open_rma
from distbelief.ps.shared_memory import open_shared_memory

Opener = Callable[[MPI.Comm, ServerSpec, bool], ParameterServerShard | ParameterClient | None]
"""(the private communicator, the spec, required) -> this rank's endpoint, or None on every
rank when the transport cannot serve the job (ConfigError instead when required).
Collective over the communicator; every rank reaches the same answer."""

OPENERS: dict[str, Opener] = {
    "shared": open_shared_memory,  # every rank on one node
    "rma": open_rma,  # anywhere
}
"""The transports by name, in the order "auto" tries them."""

TRANSPORTS = ("auto", *OPENERS)


def requested_transport(transport: str | None = None) -> str:
    """`transport`, or else $DISTBELIEF_PS_TRANSPORT, or else "auto"; validated. Pure, so a
    bad value raises ConfigError on every rank before any communication."""
    value = transport or os.environ.get(TRANSPORT_ENV) or "auto"
    if value not in TRANSPORTS:
        raise ConfigError(f"parameter-server transport {value!r} (from "
                          f"{'the caller' if transport else TRANSPORT_ENV}) must be one of "
                          f"{', '.join(TRANSPORTS)}")
    return value


def open_parameter_server(comm_world: MPI.Comm, spec: ServerSpec,
                          transport: str | None = None,
                          ) -> ParameterServerShard | ParameterClient:
    """Create the parameter server: a ParameterServerShard on shard ranks, a
    ParameterClient on every other rank (replicas and the coordinator), on `transport`
    ("auto", "shared" or "rma"; None: $DISTBELIEF_PS_TRANSPORT, else "auto").

    Collective over `comm_world`: every rank calls it with the same spec (but `initial`)
    and transport. It validates first, so a bad configuration raises ConfigError on every
    rank before any communication; then every opener it tries works on one private
    communicator (the server's windows and barriers never mix with the caller's
    traffic). Returns once every shard has published its initial parameters.
    """
    requested = requested_transport(transport)
    spec.check(comm_world)
    comm = comm_world.Dup()
    try:
        for name in OPENERS if requested == "auto" else (requested,):
            endpoint = OPENERS[name](comm, spec, requested != "auto")
            if endpoint is not None:
                return endpoint
    except ConfigError:
        comm.Free()
        raise
    raise RuntimeError("no parameter-server transport opened")  # unreachable: RMA opens
