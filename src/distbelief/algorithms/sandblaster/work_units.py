"""Work units of one Sandblaster gradient evaluation: who computes what, and whose result
counts. Pure bookkeeping on the coordinator (no communication, no vectors).

A batch of B examples is cut into units of `work_unit_size` consecutive batch positions.
Replicas ask for units when they are free (`next_units`: up to a push's worth at once, one
coordinator answer for all of them), so a fast replica does more of them (dynamic load
balancing). Each unit belongs to a replica (`owners`: contiguous
groups, plan.unit_owners), whose rows it is drawn from and which holds those rows in
memory; a replica gets its own queued units first, then, once they are all out, the last
queued unit of the replica with the most left (it reads that unit's rows from the file:
the price of balancing the load, paid only by what is moved). When the queues are empty,
a replica that asks gets a BACKUP copy of a unit that is still uncommitted, held by fewer
than `backup_copies` replicas (the least-copied, longest-outstanding first), as
MapReduce's backup tasks, once its newest copy has been out for `backup_after` seconds
(the coordinator passes 1.5 x the median time replicas took per grant lately, from its
issue to the report of its last unit; `unit_seconds` collects them): a unit that is merely in progress at normal speed is not
worth a copy, which on an oversubscribed node would only take CPU from the replicas
finishing the batch. A replica that gets nothing
waits (parked by the coordinator) and asks again when a unit becomes late.

EXACTLY ONCE. A replica sums the gradients of the units it computed and, with its next
request, reports their ids (`settle`). The coordinator decides, per report:
  - "drop": some unit of the sum was already committed (a duplicate) or the evaluation is
    over; the replica throws the sum away. Its other units go back to the queue unless
    someone else holds them;
  - "commit": the units are marked committed to this replica, which then pushes the sum
    to the shards. Only committed sums are ever pushed, and a unit is committed once, so
    every example of the batch enters the shards' gradient exactly once;
  - "hold": keep summing (saves pushes: "push every few units").
A report commits when it holds `push_every` units, or the queue is empty (the tail of the
batch: no finished unit may wait behind a slow one), so a held sum is always followed by
another unit and another report. Since committing, not finishing, is what counts, a
straggler's finished-but-uncommitted units are outstanding like any other, and backups
cover them.

The shards count the units in the pushes they receive; the evaluation is over when they
have all `n_units` (distbelief.algorithms.sandblaster.shards).

A LOST REPLICA (its process gone; the coordinator's sweep). Its held, uncommitted units
go back to the queue (`release`): nothing of them reached a shard, since only committed
sums are pushed. Its committed units are another matter: the coordinator marked them
committed before the replica pushed, and a replica killed in its push may have reached
some shards and not others (with several shards, or partitions, a push is several
messages), or none. No shard can take back a sum it has added, and the coordinator cannot
tell which parts arrived, so a replica lost with units committed in the current
evaluation makes the coordinator abandon the evaluation and run it again under a new trial
id (the same point t): the shards zero the trial gradient at begin_trial and drop every
push that carries an older trial id, so of the lost replica's push nothing counts, and of
the new trial every unit is committed once, by a live replica, and pushed whole. Counted
twice or half is impossible either way. A replica lost with no commit in the evaluation
costs nothing but its held units, which `release` gives to the others.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field

COMMIT, DROP, HOLD = "commit", "drop", "hold"


def unit_ranges(batch_size: int, unit_size: int) -> list[tuple[int, int]]:
    """[start, stop) batch positions of each unit; the last one may be shorter."""
    if batch_size < 1 or unit_size < 1:
        raise ValueError(f"batch_size and unit_size must be positive, got {batch_size}, "
                         f"{unit_size}")
    return [(a, min(a + unit_size, batch_size)) for a in range(0, batch_size, unit_size)]


@dataclass
class UnitStats:
    """Counts over one evaluation (or summed over many)."""

    issued: int = 0            # units handed out, backups included
    backups_issued: int = 0    # second and later copies
    discarded: int = 0         # unit results thrown away (duplicates, stale)
    committed_by: dict[int, int] = field(default_factory=dict)  # replica -> units

    def add(self, other: UnitStats) -> None:
        self.issued += other.issued
        self.backups_issued += other.backups_issued
        self.discarded += other.discarded
        for replica, n in other.committed_by.items():
            self.committed_by[replica] = self.committed_by.get(replica, 0) + n


class WorkUnitTable:
    """The units of one evaluation: queued, held (by which replicas), committed.

    Every operation costs O(1) per unit it hands out or settles, whatever the number of
    replicas: the queues are deques, the owner with the most queued units is the top of a
    heap, each replica's held units are a set, and the units that may get a backup copy
    are kept by their number of copies, longest outstanding first (`copies`)."""

    def __init__(self, n_units: int, push_every: int = 4, backup_copies: int = 2,
                 backup_after: float = 0.0, owners: list[int] | None = None):
        if n_units < 1 or push_every < 1 or backup_copies < 1:
            raise ValueError("n_units, push_every and backup_copies must be positive")
        self.shared = owners is None  # one queue, every replica's: no owners
        owners = [0] * n_units if owners is None else list(owners)
        if len(owners) != n_units:
            raise ValueError(f"owners names {len(owners)} units, expected {n_units}")
        self.n_units, self.push_every, self.backup_copies = n_units, push_every, backup_copies
        self.backup_after = backup_after
        self.issued_at: dict[tuple[int, int], float] = {}  # (unit, replica) -> when
        self.unit_seconds: list[float] = []  # issue to report, of each report
        self.owners = owners
        self.queues: dict[int, deque[int]] = {}  # owner -> its queued units, in order
        for unit, owner in enumerate(owners):
            self.queues.setdefault(owner, deque()).append(unit)
        # (-queued, owner), one entry per change of a queue's length; the top entry that
        # matches its queue's length now is the owner with the most queued (lowest first).
        self.longest = [(-len(q), owner) for owner, q in self.queues.items()]
        heapq.heapify(self.longest)
        self.n_queued = n_units
        self.stolen = 0  # units handed to a replica other than their owner, first copies
        self.holders: list[set[int]] = [set() for _ in range(n_units)]
        self.held: dict[int, set[int]] = {}  # replica -> the uncommitted units it holds
        # copies[c]: the uncommitted units held by exactly c replicas (0 < c < backup
        # copies), in the order they came to c: the candidates for a backup copy.
        self.copies: list[dict[int, None]] = [{} for _ in range(backup_copies)]
        self.first_issued = [0.0] * n_units
        self.committed = [False] * n_units
        self.n_committed = 0
        self.stats = UnitStats()

    @property
    def complete(self) -> bool:
        return self.n_committed == self.n_units

    @property
    def tail(self) -> bool:
        """Every unit has been handed out at least once."""
        return not self.n_queued

    def _queued_for(self, owner: int) -> int | None:
        """The next queued unit for a replica serving `owner`'s units: its own first, else
        the last one of the replica with the most queued (the end its owner reaches last);
        None if none."""
        if not self.n_queued:
            return None
        self.n_queued -= 1
        owner = 0 if self.shared else owner
        own = self.queues.get(owner)
        if own:
            unit = own.popleft()
        else:
            self.stolen += 1
            while True:
                length, owner = self.longest[0]
                if -length == len(self.queues[owner]):
                    break
                heapq.heappop(self.longest)  # an old length of that queue
            unit = self.queues[owner].pop()
        heapq.heappush(self.longest, (-len(self.queues[owner]), owner))
        return unit

    def _requeue(self, unit: int) -> None:
        """`unit` back to the front of its owner's queue."""
        owner = self.owners[unit]
        self.queues[owner].appendleft(unit)
        heapq.heappush(self.longest, (-len(self.queues[owner]), owner))
        self.n_queued += 1

    def _hold(self, unit: int, replica: int, holds: bool) -> None:
        """`replica` takes (`holds`) or gives up a copy of uncommitted `unit`."""
        holders = self.holders[unit]
        self.copies[min(len(holders), self.backup_copies - 1)].pop(unit, None)
        if holds:
            holders.add(replica)
            self.held.setdefault(replica, set()).add(unit)
        else:
            holders.discard(replica)
            self.held.get(replica, set()).discard(unit)
        if 0 < len(holders) < self.backup_copies:
            self.copies[len(holders)][unit] = None

    def next_unit(self, replica: int, now: float | None = None) -> int | None:
        """A unit for `replica` (queued first, its own before others', else a late unit's
        backup copy), or None."""
        units = self.next_units(replica, 1, now)
        return units[0] if units else None

    def next_units(self, replica: int, k: int, now: float | None = None,
                   owner: int | None = None) -> list[int]:
        """Up to `k` queued units for `replica` (those of `owner`, default itself, before
        others': a spare serves a lost replica's), or, when none is queued, one late unit's
        backup copy; [] if there is nothing for it (a bulk grant: one coordinator answer
        for several units)."""
        now = time.monotonic() if now is None else now
        owner = replica if owner is None else owner
        units = []
        while len(units) < k:
            unit = self._queued_for(owner)
            if unit is None:
                break
            if not self.first_issued[unit]:
                self.first_issued[unit] = now
            units.append(unit)
        if not units:
            unit = self._backup_for(replica, now)
            if unit is None:
                return []
            self.stats.backups_issued += 1
            units.append(unit)
        for unit in units:
            self._hold(unit, replica, True)
            self.issued_at[(unit, replica)] = now
        self.stats.issued += len(units)
        return units

    def _backup_for(self, replica: int, now: float) -> int | None:
        """The least-copied, longest-outstanding uncommitted unit that `replica` does not
        hold and whose newest copy is late; None if none. Looks past only the units this
        replica holds and those not late yet."""
        for level in self.copies[1:]:
            for unit in level:
                holders = self.holders[unit]
                if replica in holders:
                    continue
                newest = max(self.issued_at[(unit, r)] for r in holders)
                if now - newest >= self.backup_after:
                    return unit
        return None

    def release(self, replica: int) -> list[int]:
        """`replica` is lost: the units it holds and nobody has committed go back to the
        front of the queue unless another replica holds them too. Returns those units."""
        back = []
        for unit in sorted(self.held.pop(replica, ())):
            self._hold(unit, replica, False)
            if not self.holders[unit]:
                back.append(unit)
        for unit in reversed(back):
            self._requeue(unit)
        return back

    def settle(self, replica: int, units: list[int], now: float | None = None) -> str:
        """COMMIT, DROP or HOLD the sum of `units` that `replica` reports (see the module
        docstring); its last unit is the one it just computed. An empty report is HOLD
        (nothing to push)."""
        if not units:
            return HOLD
        issued = self.issued_at.get((units[-1], replica))
        if issued is not None:
            self.unit_seconds.append((time.monotonic() if now is None else now) - issued)
        if any(self.committed[u] for u in units):
            self.stats.discarded += len(units)
            for u in units:
                if self.committed[u]:
                    continue
                self._hold(u, replica, False)
                if not self.holders[u]:
                    self._requeue(u)
            return DROP
        if len(units) < self.push_every and not self.tail:
            return HOLD
        for u in units:
            self.committed[u] = True
            holders = self.holders[u]
            self.copies[min(len(holders), self.backup_copies - 1)].pop(u, None)
            for r in holders:
                self.held[r].discard(u)
            holders.clear()
        self.n_committed += len(units)
        self.stats.committed_by[replica] = self.stats.committed_by.get(replica, 0) + len(units)
        return COMMIT

    def backup_due(self, now: float) -> bool:
        """Whether the longest-outstanding unit of some number of copies is late: a
        replica that asks now may get its backup copy (O(backup_copies))."""
        for level in self.copies[1:]:
            for unit in level:
                newest = max(self.issued_at[(unit, r)] for r in self.holders[unit])
                if now - newest >= self.backup_after:
                    return True
                break
        return False
