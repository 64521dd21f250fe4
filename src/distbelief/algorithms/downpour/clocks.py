"""Downpour's staleness bound, `optimizer.max_staleness = s` (stale synchronous parallel,
Ho et al., NIPS 2013): a replica whose clock is more than s ahead of the slowest live
replica's waits until it is not. The replica's side (ReplicaClock: its clock, the gate
before each block, what it waited) and shard 0's (ClockWatch: the lowest live clock, and
the clock a late replica joins at). docs/downpour.md, "Staleness bound", says how and why.

CLOCKS. A replica's clock is the clock it was counted in at plus its pushes in this job
(each of n_push steps). Replicas are counted in at clock 0 from the start, but those the
warm start holds back, which shard 0 counts in once the warm start is over, at the
lowest live clock then (their JOINED slot; a hot spare would join the same way). A replica
publishes its pushes (CLOCK) only once every shard has applied them: its push goes first,
then the exchange that carries its claim, its report and its clock. Shard 0 publishes the
lowest clock among the live replicas (counted in, neither finished nor lost) in
MIN_CLOCK, as it reads the block; a lost or finished replica drops out of it at once.

THE GATE. Before each block, a replica at clock c computes only once it has read
MIN_CLOCK >= c - s, and only on parameters fetched after such a read (or it fetches
again): the fetch then holds every live replica's first c - s pushes, those of clocks
below c - s. Until then it polls shard 0 with control exchanges, sleeping with back-off
(downpour.plan.BOUND_POLL_S), pausing for checkpoints and stopping as every exchange says.
With s = 0 every fetch holds every live replica's previous push: bulk-synchronous steps,
the replicas' gradients applied one after the other. A row replica (row_replica) fetches
the rows of its next batches; rows newly drawn count as never fetched (`emptied`).

WHAT IS BOUNDED. A block's clock lead is c - MIN_CLOCK as the replica read it when it
started the block; the gate keeps it <= s, and since MIN_CLOCK never exceeds the true
lowest clock, the true lead is at most that. The summary reports it (`clock_lead`). The
shards' staleness (`staleness`: updates a shard applied between a gradient's fetch and
its application) is another quantity, counted in a shard's updates from every replica,
not in one replica's clocks: the bound keeps it small but does not make it <= s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from distbelief.ps import run_control as rc

WAIT, GO, FETCH = range(3)
"""The gate's answers: wait for the slowest; compute on the parameters held; fetch first."""


@dataclass
class ReplicaClock:
    """A replica's clock under the bound `bound`, the gate before each block, and what it
    waited there. `joined_at` is None until shard 0 has counted the replica in (a replica
    the warm start held back); `params_clock` is the MIN_CLOCK read before the parameters
    in use were fetched (None: no parameters yet)."""

    bound: int
    joined_at: int | None = 0
    pushes: int = 0
    params_clock: int | None = None
    blocks: int = 0
    waits: int = 0
    wait_seconds: float = 0.0
    lead_max: int = 0
    lead_total: int = 0

    @property
    def clock(self) -> int:
        """The clock: where it was counted in, plus its pushes in this job."""
        return (self.joined_at or 0) + self.pushes

    def gate(self, min_clock: int, joined_at: int | None) -> int:
        """WAIT, GO or FETCH for the next block, with MIN_CLOCK and JOINED as just read."""
        if self.joined_at is None:
            self.joined_at = joined_at
        if self.joined_at is None or min_clock < self.clock - self.bound:
            return WAIT
        if self.params_clock is None or self.params_clock < self.clock - self.bound:
            return FETCH
        return GO

    def fetched(self, min_clock: int) -> None:
        """Parameters were fetched after MIN_CLOCK read `min_clock`."""
        self.params_clock = min_clock

    def emptied(self) -> None:
        """The parameters held were replaced by vectors not fetched yet (a row replica's
        next rows): the gate fetches before a block starts on them."""
        self.params_clock = None

    def started(self, min_clock: int, waited_s: float) -> None:
        """A block starts, MIN_CLOCK at `min_clock`, after waiting `waited_s` (0: none)."""
        lead = self.clock - min_clock
        self.blocks += 1
        self.lead_max = max(self.lead_max, lead)
        self.lead_total += lead
        if waited_s > 0:
            self.waits += 1
            self.wait_seconds += waited_s

    def to_dict(self) -> dict[str, Any]:
        return {"bound": self.bound, "clock": self.clock, "joined_at": self.joined_at,
                "blocks": self.blocks, "waits": self.waits,
                "wait_seconds": self.wait_seconds, "lead_max": self.lead_max,
                "lead_mean": self.lead_total / self.blocks if self.blocks else 0.0}


def combined_leads(bound: int | None, replicas: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The summary's `clock_lead`: every replica's blocks as one (None when unbounded)."""
    clocks = [r["clock_bound"] for r in replicas if r.get("clock_bound")]
    if bound is None:
        return None
    blocks = sum(c["blocks"] for c in clocks)
    return {"bound": bound, "max": max((c["lead_max"] for c in clocks), default=0),
            "mean": (sum(c["lead_mean"] * c["blocks"] for c in clocks) / blocks
                     if blocks else 0.0),
            "blocks": blocks, "waits": sum(c["waits"] for c in clocks),
            "wait_seconds": sum(c["wait_seconds"] for c in clocks)}


class ClockWatch:
    """Shard 0's side of the bound: which replicas are counted in and at what clock, and
    MIN_CLOCK, published into the run control block of `shard` (shard 0's endpoint) as
    the rows are read. `late`: the replicas counted in only once the warm start is over;
    `spares`: those counted in when they take a part over (`join`)."""

    def __init__(self, shard: Any, bound: int, replicas: int, late: list[int],
                 spares: Any = ()):
        self.shard, self.bound = shard, bound
        self.joined_at = np.zeros(replicas, dtype=np.int64)
        self.counted = np.ones(replicas, dtype=bool)
        self.counted[list(late)] = False
        self.late = list(late)
        self.counted[list(spares)] = False
        self.min_clock = 0  # as published
        self.waiting = False  # a live replica's clock is past MIN_CLOCK + bound

    def saw(self, rows: np.ndarray, lost: np.ndarray, warm_over: bool) -> bool:
        """The block's replica rows as just read, the replicas lost, whether the warm start
        is over: count the late replicas in once it is, publish MIN_CLOCK if it moved.
        Returns whether it moved."""
        live = self.counted & ~lost & (rows[:, rc.FINISHED] == 0)
        clocks = self.joined_at + rows[:, rc.CLOCK]
        lowest = int(clocks[live].min()) if live.any() else self.min_clock
        if warm_over and self.late:
            # Counted in at the lowest clock: no live replica is then more than the bound
            # ahead of them, and the lowest does not move.
            for replica in self.late:
                self.joined_at[replica] = lowest
                self.shard.add_run_control(rc.replica_slot(int(replica), rc.JOINED),
                                           lowest + 1)
                self.counted[replica] = True
            self.late = []
            live = self.counted & ~lost & (rows[:, rc.FINISHED] == 0)
            clocks = self.joined_at + rows[:, rc.CLOCK]
        self.waiting = bool(live.any() and clocks[live].max() > lowest + self.bound)
        if lowest == self.min_clock:
            return False
        self.shard.add_run_control(rc.MIN_CLOCK, lowest - self.min_clock)
        self.min_clock = lowest
        return True

    def join(self, spare: int) -> None:
        """A spare takes a part over: counted in at MIN_CLOCK as published (as a warm
        start's late replica is), which is not above any live replica's clock."""
        self.joined_at[spare] = self.min_clock
        self.shard.add_run_control(rc.replica_slot(spare, rc.JOINED), self.min_clock + 1)
        self.counted[spare] = True
