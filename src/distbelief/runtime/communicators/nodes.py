"""Which ranks share a node: the one answer every node-dependent decision of distbelief
uses (the parameter-server transport, liveness by /proc or by heartbeat, the shared-memory
communicator).

MPI decides, not host names: `Split_type(COMM_TYPE_SHARED)` groups the ranks that can share
memory. Under MPICH's `mpiexec -launcher fork -hosts h1,h2,h3` every rank runs on this
machine with this host name, yet MPI puts each fake host on a node of its own and talks
between them through its network module, and it is MPI's split that the transports and
their failure modes follow. Tests can deal the ranks over more nodes (`simulated_nodes`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from mpi4py import MPI

from distbelief.errors import ConfigError

SIMULATED_NODES_ENV = "DISTBELIEF_SIMULATED_NODES"


def simulated_nodes(environ: Mapping[str, str] | None = None) -> int:
    """N from $DISTBELIEF_SIMULATED_NODES (0: unset or empty, no simulation). Pure, so a bad
    value raises ConfigError on every rank before any communication.

    With N, the ranks of each machine (host name) are dealt over N simulated nodes, rank r
    of the communicator on node r % N (the order in which hydra's `-hosts h1,...,hN` places
    ranks, so the two ways agree), whatever MPI's split of that machine is:
    MPIR_CVAR_NOLOCAL=1 or hydra's fake hosts make it finer (one node per rank, or per fake
    host), and N nodes are N nodes either way. Ranks on different host names are never put
    on one node, so on a real cluster the setting only splits real nodes further. Every
    node-dependent decision then goes as on N nodes: the RMA transport, heartbeats instead
    of /proc. Shared memory is still only taken within one of MPI's nodes
    (`Nodes.shares_memory`, node_communicator). To send MPI's own traffic through its
    network module as well, MPICH needs MPIR_CVAR_NOLOCAL=1 in the launcher's environment
    (or the fake hosts above); docs/cluster.md shows both."""
    text = (os.environ if environ is None else environ).get(SIMULATED_NODES_ENV, "").strip()
    if not text:
        return 0
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{SIMULATED_NODES_ENV}={text!r} must be a whole number of nodes, "
                          f"1 or more (or unset for the real nodes)")
    return value


@dataclass(frozen=True)
class Nodes:
    """The node of every rank of a communicator (0, 1, ... in order of first rank)."""

    node_of: tuple[int, ...]
    me: int
    # MPI's own split (COMM_TYPE_SHARED), numbered the same way: the ranks that can share
    # memory. node_of is this unless simulated.
    mpi_node_of: tuple[int, ...]
    simulated: int = 0  # N of DISTBELIEF_SIMULATED_NODES, 0 if unset

    @property
    def count(self) -> int:
        return max(self.node_of) + 1

    @property
    def single(self) -> bool:
        """Every rank on one node (so shared memory can hold the parameter server)."""
        return self.count == 1

    @property
    def shares_memory(self) -> bool:
        """Every rank on one node, and MPI can put one shared-memory window over them all
        (not so on one simulated node under MPIR_CVAR_NOLOCAL=1 or fake hosts)."""
        return self.single and len(set(self.mpi_node_of)) == 1

    def same_node(self, rank: int) -> bool:
        """`rank` is on this rank's node (its process can be looked at in /proc)."""
        return self.node_of[rank] == self.node_of[self.me]

    def ranks_on(self, node: int) -> list[int]:
        return [rank for rank, n in enumerate(self.node_of) if n == node]

    def describe(self) -> str:
        """'3 nodes (simulated): 0,3 | 1 | 2' for logs."""
        groups = " | ".join(",".join(map(str, self.ranks_on(n))) for n in range(self.count))
        how = " (simulated)" if self.simulated else ""
        return f"{self.count} node{'s' * (self.count > 1)}{how}: {groups}"


def _numbered(keys: list) -> list[int]:
    """0, 1, ... for each distinct key, in order of first appearance. Pure."""
    numbers: dict = {}
    return [numbers.setdefault(key, len(numbers)) for key in keys]


def _colors(mpi_node: list[int], hosts: list[str], simulated: int) -> list[int]:
    """Node numbers 0.. (in order of first rank) from each rank's MPI node and host name:
    MPI's nodes, or with `simulated` N, rank % N within each host (simulated_nodes).
    Pure."""
    if not simulated:
        return _numbered(mpi_node)
    return _numbered([(host, rank % simulated) for rank, host in enumerate(hosts)])


def node_split(comm: MPI.Comm, environ: Mapping[str, str] | None = None) -> Nodes:
    """Which ranks of `comm` share a node (see the module docstring). Collective over
    `comm`: a Split_type, a bcast inside each node and an allgather."""
    simulated = simulated_nodes(environ)
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        leader = shared.bcast(comm.Get_rank(), root=0)  # names this MPI node
    finally:
        shared.Free()
    everyone = comm.allgather((leader, socket.gethostname()))
    mpi_node = [node for node, _ in everyone]
    return Nodes(tuple(_colors(mpi_node, [host for _, host in everyone], simulated)),
                 comm.Get_rank(), tuple(_numbered(mpi_node)), simulated)


def node_communicator(comm: MPI.Comm, nodes: Nodes | None = None) -> MPI.Comm:
    """The ranks of `comm` on this rank's node that MPI can share memory between (all of
    the node's but on a simulated node that MPI splits finer), in `comm`'s order (the
    caller frees it). Collective over `comm` (node_split when `nodes` is None, then a
    Comm.Split)."""
    if nodes is None:
        nodes = node_split(comm)
    both = _numbered(list(zip(nodes.node_of, nodes.mpi_node_of)))
    return comm.Split(both[nodes.me], key=comm.Get_rank())
