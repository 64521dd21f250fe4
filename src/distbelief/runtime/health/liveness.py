"""Which ranks are still alive, found without MPI.

MPI gives no portable way to learn that a rank died (MPICH's ULFM extension is not
usable with the PyPI build: MPIR_CVAR_ENABLE_FT=1 fails an assertion in MPI_Init), and a
collective or a lock that waits for a dead rank never returns. So the trainers watch their
ranks themselves: a rank on this node by /proc (`Peers`), a rank on another node by its
heartbeat (runtime.health.heartbeat), and on top the lost-replica sweep of Downpour and
Sandblaster (`sweep_replicas`).
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mpi4py import MPI

from distbelief.runtime.communicators.nodes import Nodes, node_split
from distbelief.runtime.communicators.topology import Topology
from distbelief.runtime.health.heartbeat import FOLDER, Heartbeats
from distbelief.runtime.health.ownership import process_start_time

# The same /proc reading decides whether a run directory's owner is alive.
_start_time = process_start_time


@dataclass(frozen=True)
class Peers:
    """Node, host, pid and process start time of every rank of a communicator, and the
    heartbeats of the ranks on other nodes (None on one node, or when not asked for).

    The node is runtime.communicators.nodes' (MPI's node split, or the simulated one),
    gathered once at set-up. A rank on this node is gone when its process no longer
    exists, is a zombie, or is another process that got the same id (its start time
    differs): exact, and cheap (a /proc read per rank). Ranks on other nodes cannot be
    looked at this way (with simulated nodes they could, and are not: the point is to take
    the other path); they are noticed by their heartbeat stopping (Downpour: a replica's
    BEAT in distbelief.ps.run_control for `run.replica_timeout_seconds` when it is alive
    but stuck, and its node's heartbeat file, which lists the node's live ranks, for
    `run.heartbeat_timeout_seconds` when it died)."""

    nodes: Nodes
    hosts: tuple[str, ...]
    pids: tuple[int, ...]
    starts: tuple[int | None, ...]
    me: int
    heartbeats: Heartbeats | None = None

    @classmethod
    def gather(cls, comm: MPI.Comm, heartbeat_dir: Path | None = None,
               heartbeat_timeout_s: float = 0.0) -> Peers:
        """Collective over `comm` (node_split, then a bcast and an allgather): every rank's
        identity. With `heartbeat_dir` and a timeout, and ranks on more than one node,
        every rank maps its node's table and starts beating under heartbeat_dir
        (distbelief.runtime.health.heartbeat) before the allgather, so every node's file exists
        once it returns; close() stops it."""
        nodes = node_split(comm)
        heartbeats = None
        if heartbeat_dir is not None and heartbeat_timeout_s > 0 and not nodes.single:
            token = comm.bcast(secrets.token_hex(6) if comm.Get_rank() == 0 else None, root=0)
            table = node_table_path(token, nodes.node_of[nodes.me])
            folder = Path(heartbeat_dir) / FOLDER / token
            try:
                heartbeats = Heartbeats(folder, comm.Get_rank(), heartbeat_timeout_s,
                                        nodes.node_of, table=table)
            except OSError as exc:  # never fatal: this node's ranks are then never listed
                print(f"distbelief: rank {comm.Get_rank()}: cannot share {table} "
                      f"({exc.strerror or exc}); a death of this rank is found by the stall "
                      f"watchdog only", file=sys.stderr, flush=True)
            failed = heartbeats.start() if heartbeats is not None else None
            if failed is not None:
                print(f"distbelief: rank {comm.Get_rank()}: cannot write its node's "
                      f"heartbeat in {folder} ({failed.strerror or failed}); it tries again "
                      f"every beat", file=sys.stderr, flush=True)
        pid = os.getpid()
        mine = (socket.gethostname(), pid, _start_time(pid))
        everyone = comm.allgather(mine)
        peers = cls(nodes, tuple(e[0] for e in everyone), tuple(e[1] for e in everyone),
                    tuple(e[2] for e in everyone), comm.Get_rank(), heartbeats)
        if heartbeats is not None:
            # The node's writer lists the ranks of the node whose processes live (/proc).
            heartbeats.local_gone = peers.gone
            if comm.Get_rank() == min(nodes.ranks_on(nodes.node_of[nodes.me])):
                # Every rank of the node mapped the table before the allgather: unlinked
                # now, nothing is left in /dev/shm however the job ends.
                table.unlink(missing_ok=True)
        return peers

    def close(self) -> None:
        """Stop this rank's heartbeat (if any); the node's last rank removes its file.
        Local."""
        if self.heartbeats is not None:
            self.heartbeats.stop()

    def on_this_node(self, rank: int) -> bool:
        # Both: MPI's node (or the simulated one), and the host name, so that a process
        # id is never looked up on a machine it does not belong to.
        return self.nodes.same_node(rank) and self.hosts[rank] == self.hosts[self.me]

    def gone(self, rank: int) -> bool:
        """True if `rank`'s process has ended (or its id now belongs to another process),
        looked at in /proc on this node; on another node, if its heartbeat has stopped
        (False without heartbeats: not knowable here). Local."""
        if rank == self.me:
            return False
        if not self.on_this_node(rank):
            return self.heartbeats is not None and self.heartbeats.stopped(rank)
        if self.starts[rank] is None:
            return False
        return _start_time(self.pids[rank]) != self.starts[rank]

    def ended(self, rank: int) -> bool:
        """True only if `rank`'s process is known to have ended: on this node, looked at in
        /proc. A stopped heartbeat on another node is no proof (a stopped or swapping
        process is silent too). Local."""
        return rank != self.me and self.on_this_node(rank) and self.gone(rank)

    def how_gone(self, rank: int) -> str:
        """How `rank` was found gone, as a suffix for "rank N is gone": "" on this node (its
        process ended), " (its heartbeat ...)" on another."""
        if self.on_this_node(rank):
            return ""
        timeout = self.heartbeats.timeout_s if self.heartbeats is not None else 0
        return (f" (its heartbeat from another node stopped for {timeout:g} s: "
                f"run.heartbeat_timeout_seconds)")

    def why_gone(self, gone: list[int]) -> str:
        """Why a replica whose ranks `gone` (from gone_among, not empty) were found gone is
        lost, for the line that says so: "rank 3 is gone (its heartbeat ...)"."""
        names = ", ".join(map(str, gone))
        how = self.how_gone(gone[0])
        return f"rank {names} is gone{how}" if how else f"the process of rank {names} is gone"

    def gone_among(self, ranks: range | list[int]) -> list[int]:
        """The ranks of `ranks` that are gone (see `gone`)."""
        return [rank for rank in ranks if self.gone(rank)]


NODE_TABLE_DIR = Path("/dev/shm")


def node_table_path(token: str, node: int) -> Path:
    """Where the ranks of `node` share their heartbeat table (node-local memory)."""
    return NODE_TABLE_DIR / f"distbelief-heartbeats-{token}-node{node}"


def sweep_replicas(peers: Peers, topology: Topology, replicas: int, dead_ranks: set[int],
                   death_times: list[float], now: float) -> Iterator[tuple[int, list[int],
                                                                         list[int]]]:
    """(replica, its world ranks, those found gone) for each replica, the lost-replica
    sweep of Downpour's supervisor and Sandblaster's coordinator. Ranks newly found gone
    are added to `dead_ranks`, and `now` to `death_times` (a sweep that finds them: a
    launcher announces each exit with a SIGUSR1, which the caller then does not take for a
    user's checkpoint request). Communicates with no one."""
    for replica in range(replicas):
        ranks = list(topology.replica_ranks(replica))
        gone = peers.gone_among(ranks)
        if set(gone) - dead_ranks:
            death_times.append(now)
            dead_ranks.update(gone)
        yield replica, ranks, gone
