"""Work units of one Sandblaster gradient evaluation: who computes what, and whose result
counts. Pure bookkeeping on the coordinator (no communication, no vectors).

A batch of B examples is cut into units of `work_unit_size` consecutive batch positions.
Replicas ask for a unit when they are free (`next_unit`), so a fast replica does more of
them (dynamic load balancing). Each unit belongs to a replica (`owners`: contiguous
groups, plan.unit_owners), whose rows it is drawn from and which holds those rows in
memory; a replica gets its own queued units first, then, once they are all out, the last
queued unit of the replica with the most left (it reads that unit's rows from the file:
the price of balancing the load, paid only by what is moved). When the queues are empty,
a replica that asks gets a BACKUP copy of a unit that is still uncommitted, held by fewer
than `backup_copies` replicas (the least-copied, longest-outstanding first), as
MapReduce's backup tasks, once its newest copy has been out for `backup_after` seconds
(the coordinator passes 1.5 x the median time replicas took per unit lately;
`unit_seconds` collects them): a unit that is merely in progress at normal speed is not
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
    """The units of one evaluation: queued, held (by which replicas), committed."""

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
        self.unit_seconds: list[float] = []  # issue to report, of each reported unit
        self.owners = owners
        self.queues: dict[int, deque[int]] = {}  # owner -> its queued units, in order
        for unit, owner in enumerate(owners):
            self.queues.setdefault(owner, deque()).append(unit)
        self.n_queued = n_units
        self.stolen = 0  # units handed to a replica other than their owner, first copies
        self.holders: list[set[int]] = [set() for _ in range(n_units)]
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

    def _queued_for(self, replica: int) -> int | None:
        """The next queued unit for `replica`: its own first, else the last one of the
        replica with the most queued (the end its owner reaches last); None if none."""
        if not self.n_queued:
            return None
        self.n_queued -= 1
        own = self.queues[0] if self.shared else self.queues.get(replica)
        if own:
            return own.popleft()
        self.stolen += 1
        return max(self.queues.values(), key=len).pop()

    def _requeue(self, unit: int) -> None:
        """`unit` back to the front of its owner's queue."""
        self.queues[self.owners[unit]].appendleft(unit)
        self.n_queued += 1

    def next_unit(self, replica: int, now: float | None = None) -> int | None:
        """A unit for `replica` (queued first, its own before others', else a late unit's
        backup copy), or None."""
        now = time.monotonic() if now is None else now
        unit = self._queued_for(replica)
        if unit is not None:
            if not self.first_issued[unit]:
                self.first_issued[unit] = now
        else:
            unit = self._backup_for(replica, now)
            if unit is None:
                return None
            self.stats.backups_issued += 1
        self.holders[unit].add(replica)
        self.issued_at[(unit, replica)] = now
        self.stats.issued += 1
        return unit

    def _backup_for(self, replica: int, now: float) -> int | None:
        best, best_key = None, None
        for unit in range(self.n_units):
            holders = self.holders[unit]
            if (self.committed[unit] or replica in holders
                    or len(holders) >= self.backup_copies):
                continue
            newest = max((self.issued_at[(unit, r)] for r in holders), default=0.0)
            if now - newest < self.backup_after:
                continue  # its newest copy is not late yet
            key = (len(holders), self.first_issued[unit])
            if best_key is None or key < best_key:
                best, best_key = unit, key
        return best

    def release(self, replica: int) -> list[int]:
        """`replica` is lost: the units it holds and nobody has committed go back to the
        front of the queue unless another replica holds them too. Returns those units."""
        back = []
        for unit, holders in enumerate(self.holders):
            if replica in holders:
                holders.discard(replica)
                if not self.committed[unit] and not holders:
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
                self.holders[u].discard(replica)
                if not self.committed[u] and not self.holders[u]:
                    self._requeue(u)
            return DROP
        if len(units) < self.push_every and not self.tail:
            return HOLD
        for u in units:
            self.committed[u] = True
            self.holders[u].clear()
        self.n_committed += len(units)
        self.stats.committed_by[replica] = self.stats.committed_by.get(replica, 0) + len(units)
        return COMMIT
