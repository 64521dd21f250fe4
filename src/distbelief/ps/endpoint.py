"""What both parameter-server transports share: the shard's update rule (a ShardRule), the
endpoint base class, the header constants, and the transport names.

The flat float32 parameter vector of `size` elements is split into S contiguous balanced
ranges (`distbelief.model.layout.balanced_ranges`); shard s (world rank s, see topology.py) owns
range s. Two transports, chosen once by `open_parameter_server` for the whole job (every
rank agrees; `requested_transport` for how to force one):

- "shared", when every rank of the job is on one node (shared_memory.py): a client
  folds its own gradient into the shard's parameters with the shard's optimizer, and
  copies parameters out, directly in the shard's shared segment under a kernel
  reader-writer lock. No shard is on the critical path of a step.
- "rma" otherwise: replicas push gradients and pull parameters with passive-target RMA
  (float data by Put and Get, counters by integer atomics); the shard folds the pushed
  gradients into its parameters with its optimizer (Adagrad or SGD): rma_windows.py (the
  windows; docs/rma-protocol.md says why every access is legal), rma_shard.py,
  rma_client.py.

Why both: with MPICH on one node every RMA round needs a pass through the target's
progress engine, and the read-your-writes fetch puts the shard's fold on the critical
path too; a 2 ms step paid ~1.25 ms of RMA with a shard that sleeps between polls
(benchmarks/RMA_NOTES.md sections 6-8). In shared memory the same step pays a lock (a few
microseconds), the optimizer step it would pay anyway, and one 2.7 MB copy (~0.1 ms).
Mixing the two in one job (node-local clients on shared memory, the others on RMA) is
not done: Downpour's run control needs one atomic location for the step claims that every
client can reach, and a window that both RMA and plain loads and stores update would need
the shard's progress engine for every lock again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
from mpi4py import MPI

from distbelief.model.layout import balanced_ranges
from distbelief.model.optimizers import ShardRule
from distbelief.runtime import watchdog
from distbelief.runtime.backoff import Backoff
from distbelief.runtime.topology import Topology

HEADER_BYTES = 64  # counters at the head of each window; data starts cache-line aligned
COUNTER_BYTES = 8
CONTROL_SHARD = 0  # holds Downpour's run control block (distbelief.ps.run_control)
# int64 slots of a published parameter buffer's header (RMA) and of a shared segment's
VERSION, APPLIED = 0, 1


RuleFactory = Callable[[int], ShardRule]
"""Slice length -> the update rule for that slice (distbelief.model.optimizers.ShardRule:
an optimizer_for optimizer, or another rule such as EASGD's center update)."""


def saved_state(rule: ShardRule) -> dict[str, np.ndarray]:
    """The live state arrays a checkpoint keeps (ShardRule.saved_state)."""
    return rule.saved_state()


class _Windows(Protocol):
    """A transport's windows (rma_windows._ShardWindows, shared_memory's segments)."""

    def free(self) -> None: ...


class _Endpoint:
    """What shards and clients share: topology, ranges, windows and the collective free."""

    def __init__(self, comm: MPI.Comm, windows: _Windows, topology: Topology,
                 size: int):
        self.topology = topology
        self.size = size
        self.ranges = balanced_ranges(size, topology.ps_shards)
        self._comm: MPI.Comm | None = comm
        self._windows: _Windows | None = windows

    def _live(self) -> _Windows:
        if self._windows is None:
            raise RuntimeError("parameter server already freed")
        return self._windows

    def _free_all(self, backoff: Backoff) -> None:
        """Collective over the world communicator, the same on every rank: wait for every
        rank (Ibarrier polled with back-off sleeps), free the windows, then the private
        communicator."""
        windows = self._live()
        request = self._comm.Ibarrier()
        guard = watchdog.current()
        others = [r for r in range(self._comm.Get_size()) if r != self._comm.Get_rank()]
        with guard.waiting("every rank, to free the parameter server's windows", others):
            while not request.Test():
                guard.check(request.Test)
                backoff.wait()
        windows.free()
        self._windows = None
        self._comm.Free()
        self._comm = None


def _waiting_backoff() -> Backoff:
    """For ranks with nothing to serve: back off up to 10 ms."""
    return Backoff(max_sleep_s=10e-3)


TRANSPORT_ENV = "DISTBELIEF_PS_TRANSPORT"
"""Environment variable naming the transport when open_parameter_server is not told:
"auto" (the default: shared memory when every rank is on one node, else RMA), "shared"
(shared memory or a ConfigError), "rma" (always RMA, e.g. to test the multi-node path)."""
TRANSPORTS = ("auto", "shared", "rma")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // HEADER_BYTES) * HEADER_BYTES


def own_slice(initial: np.ndarray, start: int, stop: int) -> np.ndarray:
    """A shard's initial values: `initial` itself when it is already the slice [start,
    stop) (a lean start), else that slice of the full vector."""
    return initial if initial.size == stop - start else initial[start:stop]
