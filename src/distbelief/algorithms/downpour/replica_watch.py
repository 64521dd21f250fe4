"""Shard 0's watch over Downpour's replicas (ReplicaWatch): the run control block's rows
as last read, each replica's heartbeat, and the replicas declared lost (a process gone,
a heartbeat stopped, or no news for run.replica_timeout_seconds), which the run goes on
without. LOST REPLICAS in the package docstring says how.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from distbelief.algorithms.downpour.plan import SWEEP_S
from distbelief.algorithms.downpour.progress import RunProgress
from distbelief.algorithms.downpour.run import OpenRun
from distbelief.algorithms.downpour.spares import SparePool, Takeover, part_start
from distbelief.ps import run_control as rc
from distbelief.ps.run_control import ControlView
from distbelief.records.console import say
from distbelief.runtime.health.liveness import sweep_replicas


@dataclass
class LostReplica:
    """A replica shard 0 declared lost."""

    replica: int
    ranks: list[int]
    why: str
    at_step: int
    at_seconds: float


class ReplicaWatch:
    """What shard 0 knows of each replica: the block's rows as last read (`view`), when
    its heartbeat last moved, and whether it is lost (`lost`, and `lost_mask` for
    whole-array tests); the ranks found gone, and when sweeps found them. Sweeps look at
    the processes and heartbeats (distbelief.runtime.health.liveness; no communication); a lost
    replica is told so through its LOST slot. Indices are replica groups: the R replicas,
    then the spares (cluster.spare_replicas), whose takeovers `spares` makes."""

    def __init__(self, run: OpenRun, progress: RunProgress, recorder: Any,
                 stream: IO[str] | None, n_train: int = 0):
        self.run_, self.plan, self.shard = run, run.plan, run.endpoint
        self.progress, self.recorder, self.stream = progress, recorder, stream
        replicas = self.plan.num_groups
        found, plan = run.start.checkpoint, self.plan
        self.spares = SparePool(plan, self.shard, lambda part: part_start(
            found, plan, n_train, part, progress.steps * plan.batch_size))
        self.joined: Any = None  # optimizer.max_staleness: ClockWatch.join, for a takeover
        self.view: ControlView | None = None
        self.beats = np.zeros(replicas, dtype=np.int64)
        self.beat_times = np.full(replicas, time.monotonic())
        self.lost: dict[int, LostReplica] = {}
        self.lost_mask = np.zeros(replicas, dtype=bool)  # the same, for whole-array tests
        self.dead_ranks: set[int] = set()
        self.death_times: list[float] = []  # when sweeps found ranks newly gone
        self.next_sweep = time.monotonic() + SWEEP_S

    def saw(self, view: ControlView, now: float) -> None:
        """The block as just read: the heartbeats that moved since the last read."""
        self.view = view
        rows = view.replicas
        moved = rows[:, rc.BEAT] != self.beats
        self.beats[moved] = rows[moved, rc.BEAT]
        self.beat_times[moved] = now
        for takeover in self.spares.serving(rows, now):
            self._took_over(takeover)

    def all_done(self) -> bool:
        """Every replica has finished or is lost (as of the last read)."""
        if self.view is None:
            return False
        return bool(np.all(self.lost_mask | (self.view.replicas[:, rc.FINISHED] > 0)))

    def excuse_silence(self) -> None:
        """The replicas were paused, and over RMA their news waits for shard 0's progress:
        a silence while shard 0 itself was busy does not count against them
        (run.replica_timeout_seconds), however long it took."""
        self.beat_times[:] = time.monotonic()

    def sweep(self, now: float, shards: bool = True) -> None:
        """Look for gone shards (fatal; not once the shards have ended the run together and
        may leave) and lost replicas (process gone on this node, or heartbeat stopped for
        run.replica_timeout_seconds)."""
        self.next_sweep = now + SWEEP_S
        peers = self.run_.peers
        if shards:
            self.run_.check_shards(now, force=True)
        timeout = self.plan.replica_timeout_s
        rows = self.view.replicas if self.view is not None else None
        for replica, ranks, gone in sweep_replicas(peers, self.plan.topology,
                                                   self.plan.num_groups, self.dead_ranks,
                                                   self.death_times, now):
            if replica in self.lost:
                continue
            if gone:
                self.lose(replica, ranks, peers.why_gone(gone))
            elif (timeout and rows is not None and not rows[replica, rc.FINISHED]
                  and now - self.beat_times[replica] > timeout):
                self.lose(replica, ranks, f"no news from it for {timeout:g} s "
                                          f"(run.replica_timeout_seconds)")

    def lose(self, replica: int, ranks: list[int], why: str) -> None:
        """Declare `replica` (a group: a replica or a spare) lost: its LOST slot, a line,
        an event; a spare takes its part over if one is free; the run stops when no part
        has a trainer left."""
        steps = self.progress.steps
        self.lost_mask[replica] = True
        self.lost[replica] = LostReplica(replica, ranks, why, steps, self.recorder.elapsed())
        self.shard.add_run_control(rc.replica_slot(replica, rc.LOST), 1)
        rows = self.view.replicas if self.view is not None else None
        takeover = self.spares.lost(replica, rows, self.lost_mask, steps,
                                    lambda g: list(self.plan.topology.replica_ranks(g)))
        if takeover is not None and self.joined is not None:
            self.joined(takeover.group)
        left = self.spares.training()
        spare = (f"; spare {takeover.spare} (rank {takeover.ranks[0]}) takes its part over"
                 if takeover is not None else "")
        say(self.stream, f"distbelief: {self._name(replica)} (rank{'s' * (len(ranks) > 1)} "
                         f"{', '.join(map(str, ranks))}) lost at step {steps}: {why}{spare}; "
                         f"training goes on with {left} replica(s)")
        self.recorder.log_event("replica_lost", steps, steps * self.plan.batch_size,
                                replica=replica, ranks=ranks, why=why)
        if left == 0:
            self.progress.stop(rc.STOP_ALL_LOST, "replicas_lost")

    def _name(self, group: int) -> str:
        if self.plan.is_spare(group):
            return f"spare replica {group - self.plan.first_spare}"
        return f"replica {group}"

    def release_due(self) -> None:
        """cluster.release_spares_at: make a free spare one more training replica at each
        step listed that training has reached (none left: the part waits for none)."""
        steps, pool = self.progress.steps, self.spares
        while pool.pending and steps >= pool.release_at[0]:
            rows = self.view.replicas if self.view is not None else None
            takeover = pool.release(rows, self.lost_mask, steps,
                                    lambda g: list(self.plan.topology.replica_ranks(g)))
            if takeover is None:
                say(self.stream, f"distbelief: no free spare to release at step {steps} "
                                 f"(cluster.release_spares_at)")
                continue
            if self.joined is not None:
                self.joined(takeover.group)
            say(self.stream, f"distbelief: spare replica {takeover.spare} (rank "
                             f"{takeover.ranks[0]}) released at step {steps} to train as "
                             f"replica {takeover.replaced} (cluster.release_spares_at)")
            self.recorder.log_event("spare_released", steps, steps * self.plan.batch_size,
                                    spare=takeover.spare, ranks=takeover.ranks,
                                    replica=takeover.replaced)

    def _took_over(self, takeover: Takeover) -> None:
        """A spare has opened its part (its SERVING read): a line and an event."""
        steps = self.progress.steps
        since = ("after the loss" if takeover.lost_group is not None
                 else "after its release")
        say(self.stream, f"distbelief: spare replica {takeover.spare} (rank "
                         f"{takeover.ranks[0]}) takes over replica {takeover.replaced}'s "
                         f"part at step {steps}, {takeover.takeover_seconds:.2f} s {since}")
        self.recorder.log_event("spare_took_over", steps, steps * self.plan.batch_size,
                                spare=takeover.spare, ranks=takeover.ranks,
                                replaced=takeover.replaced, lost=takeover.lost_group,
                                seconds=takeover.takeover_seconds)
