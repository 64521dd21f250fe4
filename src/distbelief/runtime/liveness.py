"""Which ranks are still alive, found without MPI.

MPI gives no portable way to learn that a rank died (MPICH's ULFM extension is not
usable with the PyPI build: MPIR_CVAR_ENABLE_FT=1 fails an assertion in MPI_Init), and a
collective or a lock that waits for a dead rank never returns. So Downpour watches its
ranks itself (distbelief.algorithms.downpour):

- `Peers`: every rank's host name, process id and process start time, gathered once at
  set-up. A rank on this node is gone when its process no longer exists, is a zombie,
  or is another process that got the same id (its start time differs). Exact, and cheap
  (a /proc read per rank).
- Ranks on other nodes cannot be looked at this way; Downpour notices them by their
  heartbeat (distbelief.ps.run_control's BEAT) stopping for `run.replica_timeout_seconds`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from mpi4py import MPI

from distbelief.runtime.ownership import process_start_time

# The same /proc reading decides whether a run directory's owner is alive.
_start_time = process_start_time


@dataclass(frozen=True)
class Peers:
    """Host, pid and process start time of every rank of a communicator."""

    hosts: tuple[str, ...]
    pids: tuple[int, ...]
    starts: tuple[int | None, ...]
    me: int

    @classmethod
    def gather(cls, comm: MPI.Comm) -> Peers:
        """Collective over `comm` (allgather): every rank's identity."""
        pid = os.getpid()
        mine = (socket.gethostname(), pid, _start_time(pid))
        everyone = comm.allgather(mine)
        return cls(tuple(e[0] for e in everyone), tuple(e[1] for e in everyone),
                   tuple(e[2] for e in everyone), comm.Get_rank())

    def on_this_node(self, rank: int) -> bool:
        return self.hosts[rank] == self.hosts[self.me]

    def gone(self, rank: int) -> bool:
        """True if `rank` is on this node and its process has ended (or its id now belongs
        to another process). False if it is alive, or on another node (not knowable here).
        Local."""
        if rank == self.me or not self.on_this_node(rank) or self.starts[rank] is None:
            return False
        return _start_time(self.pids[rank]) != self.starts[rank]

    def gone_among(self, ranks: range | list[int]) -> list[int]:
        """The ranks of `ranks` that are gone (see `gone`)."""
        return [rank for rank in ranks if self.gone(rank)]
