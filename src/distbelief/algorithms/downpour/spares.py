"""Hot spares (cluster.spare_replicas = k), shard 0's side: which replica group trains
each training replica's part of the data, and the takeover of a lost one's part by a
spare (SparePool, held by replica_watch.ReplicaWatch).

The job has S + (R + k) x P ranks; the last k replica groups are spares. A spare starts
with no training data and polls shard 0 with back-off sleeps (replica.Replica's
`_wait_as_spare`), pausing for checkpoints and ending with the run like a replica. When
shard 0 declares a group lost and that group was training part r (a replica r, or a spare
that had taken r over), the first free live spare is given part r: shard 0 writes where
the part starts (FROM_EPOCH, FROM_POSITION, FROM_STEPS), then TAKES_OVER = 1 + r, in the
spare's row of the run control block. The spare reads them with its next poll, opens
part r of the training data at that position, publishes SERVING = 1 + r with its position,
fetches fresh parameters and trains, its statistics under its own rank.

Where part r starts: the position its last trainer published in this job (an original
replica's at its last checkpoint pause, a spare's from its takeover on), else the resumed
checkpoint's for r (at the same layout), else a pass no earlier epoch used (the rule
run._restore_replica applies to a lost replica on a resume). A checkpoint writes a served
part's position under index r, so a resume at the same layout restores it exactly. A part
still waiting for its release (cluster.release_spares_at) has no position and was not
lost: a checkpoint lists it in `unreleased_replicas`, and a resume releases it at its step
(at once if that has passed), on a pass no earlier epoch used, as a fresh run would.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from distbelief.ps import run_control as rc

Position = tuple[int, int, int]
"""(epoch, position, local steps) of a part of the training data."""


@dataclass
class Takeover:
    """Spare group `spare` was given part `replaced` when group `lost_group` was lost."""

    spare: int  # its index among the spares (0..k-1)
    group: int  # its replica group (R + spare)
    ranks: list[int]
    replaced: int  # the training replica whose part it trains
    lost_group: int | None  # the group that was lost (None: released to grow the job)
    at_step: int  # the global step when it was given the part
    start: Position
    lost_at: float  # time.monotonic() on shard 0 when the loss was declared (or released)
    lost_wall: float  # time.time() then (compared with the spare's own clock)
    takeover_seconds: float | None = None  # loss -> shard 0 read its SERVING

    def summary(self, stats: dict[str, Any] | None) -> dict[str, Any]:
        """The summary's entry; `stats` the spare's lead rank's statistics (None: lost)."""
        first = stats.get("first_push_at") if stats else None
        out = {k: v for k, v in asdict(self).items() if k not in ("lost_at", "lost_wall")}
        out["start"] = dict(zip(("epoch", "position", "local_steps"), self.start))
        out["loss_to_first_push_seconds"] = (first - self.lost_wall if first is not None
                                             else None)
        out["pushes"] = stats.get("pushes", 0) if stats else None
        return out


class SparePool:
    """Which group trains each of the R parts (`server`: part -> group, None once its
    last trainer was lost and no spare was left), the free spares, the takeovers made,
    and the last position of each part that a trainer published. `first_start(part)`: where
    a part starts when no trainer published one in this job (the checkpoint's rule)."""

    def __init__(self, plan: Any, shard: Any, first_start: Callable[[int], Position]):
        self.plan, self.shard, self.first_start = plan, shard, first_start
        first, groups, parts = plan.first_spare, plan.num_groups, plan.num_replicas
        # Parts first..parts-1 (cluster.release_spares_at) wait for their release.
        self.server: dict[int, int | None] = {r: r if r < first else None
                                              for r in range(parts)}
        self.pending = list(range(first, parts))
        self.release_at = list(getattr(plan, "release_spares_at", ()))
        self.free = list(range(first, groups))
        self.known: dict[int, Position] = {}
        self.given: dict[int, Position] = {}  # part -> where its current spare starts it
        self.takeovers: list[Takeover] = []

    # -- parts

    def part_of(self, group: int) -> int | None:
        """The part `group` trains, if any."""
        for part, server in self.server.items():
            if server == group:
                return part
        return None

    def training(self) -> int:
        """Parts with a live trainer (a spare given one counts from then on)."""
        return sum(server is not None for server in self.server.values())

    def unserved(self) -> list[int]:
        """Parts whose last trainer was lost and that no spare took: a checkpoint's
        `lost_replicas`. Not the parts waiting for their release (`pending`): nothing of
        theirs was lost, a checkpoint lists them as `unreleased_replicas`."""
        return sorted(part for part, server in self.server.items()
                      if server is None and part not in self.pending)

    def positions(self, rows: np.ndarray) -> dict[int, tuple[int, Position]]:
        """Part -> (its trainer's group, its position) for a checkpoint: its trainer's
        row, or where a spare that has not opened it yet was told to start it."""
        out = {}
        for part, group in self.server.items():
            if group is None:
                continue
            if group < self.plan.first_spare or rows[group, rc.SERVING]:
                row = rows[group]
                out[part] = (group, (int(row[rc.EPOCH]), int(row[rc.POSITION]),
                                     int(row[rc.LOCAL_STEPS])))
            else:
                out[part] = (group, self.given[part])
        return out

    # -- a loss

    def lost(self, group: int, rows: np.ndarray | None, lost_mask: np.ndarray, step: int,
             ranks_of: Callable[[int], list[int]]) -> Takeover | None:
        """Group `group` was declared lost: a free spare leaves the pool; a trainer's part
        goes to the first free live spare (its start written into the spare's row, then
        TAKES_OVER). Returns the takeover, None when there is none."""
        if group in self.free:
            self.free.remove(group)
            return None
        part = self.part_of(group)
        if part is None:
            return None
        self.server[part] = None
        if rows is not None and self._published(group, rows[group]):
            row = rows[group]
            self.known[part] = (int(row[rc.EPOCH]), int(row[rc.POSITION]),
                                int(row[rc.LOCAL_STEPS]))
        return self._assign(part, group, rows, lost_mask, step, ranks_of)

    def release(self, rows: np.ndarray | None, lost_mask: np.ndarray, step: int,
                ranks_of: Callable[[int], list[int]]) -> Takeover | None:
        """The next part waiting for its release (cluster.release_spares_at) goes to the
        first free live spare; None when there is none (the part stays unserved)."""
        part = self.pending.pop(0)
        self.release_at.pop(0)
        return self._assign(part, None, rows, lost_mask, step, ranks_of)

    def _assign(self, part: int, group: int | None, rows: np.ndarray | None,
                lost_mask: np.ndarray, step: int,
                ranks_of: Callable[[int], list[int]]) -> Takeover | None:
        """Part `part` (its trainer `group` lost, or None: released) to the first free
        live spare: its start, then TAKES_OVER, written into the spare's row."""
        now, wall = time.monotonic(), time.time()
        finished = rows[:, rc.FINISHED] if rows is not None else np.zeros(len(lost_mask))
        spare = next((s for s in self.free if not lost_mask[s] and not finished[s]), None)
        if spare is None:
            return None
        self.free.remove(spare)
        start = self.known.get(part) or self.first_start(part)
        self.given[part] = start
        epoch, position, steps = start
        for slot, value in ((rc.FROM_EPOCH, epoch + 1), (rc.FROM_POSITION, position),
                            (rc.FROM_STEPS, steps), (rc.TAKES_OVER, part + 1)):
            if value:  # FROM_* first: a spare that reads TAKES_OVER reads them next time
                self.shard.add_run_control(rc.replica_slot(spare, slot), value)
        self.server[part] = spare
        takeover = Takeover(spare - self.plan.first_spare, spare, ranks_of(spare), part, group,
                            step, start, now, wall)
        self.takeovers.append(takeover)
        return takeover

    def _published(self, group: int, row: np.ndarray) -> bool:
        """Whether `group`'s row holds a position of the part it trains: a replica's once
        it paused for a checkpoint in this job, a spare's once it opened its part."""
        if group < self.plan.first_spare:
            return bool(row[rc.ACKED])
        return bool(row[rc.SERVING])

    def serving(self, rows: np.ndarray, now: float) -> list[Takeover]:
        """Takeovers whose spare has just opened its part (its SERVING, as just read)."""
        done = []
        for takeover in self.takeovers:
            if takeover.takeover_seconds is None and rows[takeover.group, rc.SERVING]:
                takeover.takeover_seconds = now - takeover.lost_at
                done.append(takeover)
        return done


def part_start(found: Any, plan: Any, n_train: int, part: int, samples: int) -> Position:
    """Where part `part` starts when no trainer published its position in this job: the
    checkpoint's (`found`, None for a fresh run) when it has as many replicas and holds
    this part, else a pass no earlier epoch used (`samples` trained so far), the rule of
    run._restore_replica. Local (reads the checkpoint's replicas' part)."""
    if found is not None and found.num_replicas == plan.num_replicas \
            and found.has_replica(part):
        saved = found.read_replica(part)
        return (int(saved.data_state["epoch"]), int(saved.data_state["position"]),
                int(saved.counters.get("local_steps", 0)))
    return 1 + samples // n_train, 0, 0
