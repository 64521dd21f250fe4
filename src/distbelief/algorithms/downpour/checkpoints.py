"""Shard 0's checkpointer (Checkpoints): when the next checkpoint is due and the request
that pauses the replicas for it, what the checkpoint holds of the replicas (the positions
they published), the commit from every shard's part, and its outcome (logged; or the run
stops). Every shard's side of a checkpoint is shards.ShardRole's, which calls this one at
the steps shards.CheckpointLead names. CHECKPOINTS in the package docstring is the design.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

import numpy as np

from distbelief.algorithms.checkpointer import schedule
from distbelief.algorithms.downpour.progress import RunProgress
from distbelief.algorithms.downpour.replica_watch import ReplicaWatch
from distbelief.algorithms.downpour.run import OpenRun
from distbelief.algorithms.downpour.shards import Pause
from distbelief.config import Config, config_hash, hashed_settings
from distbelief.model.layout import balanced_ranges
from distbelief.ps import run_control as rc
from distbelief.ps.endpoint import saved_state
from distbelief.records import checkpoint as ckpt
from distbelief.records.console import say


class Checkpoints:
    """Shard 0's part in the run's checkpoints, one at a time: it asks for them (the
    CHECKPOINT slot) and learns when every replica has paused (ACKED), plans each one
    (its step, and the replicas' positions as of then), writes the replicas' part,
    releases the replicas (RELEASE) and commits. Writes only shard 0's block and the run's
    checkpoint folder; ShardRole does the collectives and runs the writer thread."""

    def __init__(self, run: OpenRun, config: Config, network: Any, info: Any,
                 progress: RunProgress, replicas: ReplicaWatch, recorder: Any,
                 stream: IO[str] | None, catch_up: Callable[[], None]):
        start = run.start
        self.plan, self.shard = run.plan, run.endpoint
        self.config, self.network, self.info = config, network, info
        self.progress, self.replicas = progress, replicas
        self.recorder, self.stream = recorder, stream
        self.catch_up = catch_up  # read the block and log the training line: totals now
        run_config = config.run
        self.root = ckpt.checkpoint_root(run_config.out_dir)
        self.every_seconds, self.every_steps = (run_config.checkpoint_every_seconds,
                                                run_config.checkpoint_every_steps)
        self.requests = 0  # checkpoint requests made (the CHECKPOINT slot)
        self.awaiting = False  # a request is out: its checkpoint has not been written
        self.ready = False  # every replica has paused for it (or finished, or is lost)
        self.requested_at = 0.0  # when the newest request went out
        self.ack_wait_seconds = 0.0  # requests until every replica had paused, in all
        self.failure: str | None = None  # why a checkpoint could not be written
        self.written = 0  # checkpoints committed by this job
        self.last_step = start.base if start.checkpoint is not None else None
        self.last_path: str | None = None
        self.planned_step = self.last_step  # the newest step being written
        self.snapshot_replicas: list[ckpt.ReplicaState] = []  # theirs, as of that step
        self.snapshot_lost: list[int] = []  # the replicas lost by then (no state)
        self.snapshot_unreleased: list[int] = []  # parts not released by then (no state)
        self.schedule(time.monotonic())

    # -- when

    def schedule(self, now: float) -> None:
        """The next periodic checkpoint: `every_seconds` from now, and the next multiple
        of `every_steps` after the newest checkpoint's step (also after a resume from
        another step), due at once if training passed it while that one was written; inf
        when off."""
        after = self.progress.steps if self.planned_step is None else self.planned_step
        self.next_time, self.next_step = schedule(self.every_seconds, self.every_steps,
                                                  after, now)

    def due(self, now: float) -> bool:
        """Whether to ask for the next periodic checkpoint now (none is asked for)."""
        if self.awaiting or self.progress.stop_code or self.replicas.all_done():
            return False  # the checkpoint at the end follows
        return now >= self.next_time or self.progress.steps >= self.next_step

    def request(self, now: float) -> None:
        """Ask the replicas to pause for a checkpoint (each reads it with its next push)."""
        self.requests += 1
        self.shard.add_run_control(rc.CHECKPOINT, 1)
        self.awaiting, self.ready = True, False
        self.requested_at = now

    @property
    def waiting_for_pauses(self) -> bool:
        """A request is out and some replica has not paused for it yet."""
        return self.awaiting and not self.ready

    @property
    def paused(self) -> bool:
        """Every replica has paused for the request (or finished, or is lost): the shards
        may write the checkpoint."""
        return self.awaiting and self.ready

    def read_acks(self, rows: np.ndarray, now: float) -> None:
        """The block's replica rows as just read: whether every replica has paused."""
        if self.awaiting and not self.ready:
            self.ready = bool(np.all(self.replicas.lost_mask
                                     | (rows[:, rc.ACKED] >= self.requests)
                                     | (rows[:, rc.FINISHED] > 0)))
            if self.ready:  # the part of a replica's pause spent waiting for the others
                self.ack_wait_seconds += now - self.requested_at

    # -- shard 0's steps in a checkpoint (shards.CheckpointLead)

    def plan_checkpoint(self) -> dict[str, Any] | None:
        """{"partial", "meta"} to write, {"error"}, or None when there is nothing new (or
        the run diverged, or a checkpoint failed already)."""
        # Every push is folded: the totals are those of the checkpoint. Logged now, so
        # that no line up to its step is later than the checkpoint's time.
        self.catch_up()
        steps = self.progress.steps
        if self.progress.stop_code == rc.STOP_DIVERGED or self.failure is not None \
                or steps == self.planned_step:
            return None
        meta = ckpt.CheckpointMeta(steps, steps * self.plan.batch_size,
                                   self.recorder.elapsed(), config_hash(self.config))
        try:
            partial = ckpt.prepare(self.root, meta.step)
        except ckpt.CheckpointError as exc:
            return {"error": str(exc)}
        # The replicas' positions as they published them when they paused or finished
        # (lost replicas have none), taken now: they move on once released.
        self.planned_step = meta.step
        self.snapshot_lost = self.replicas.spares.unserved()  # parts nobody trains
        self.snapshot_unreleased = list(self.replicas.spares.pending)  # nor trained yet
        self.snapshot_replicas = [
            ckpt.ReplicaState(r, {"local_steps": local_steps}, state, None, {})
            for r, (state, local_steps) in self._replica_positions().items()]
        return {"partial": str(partial), "meta": asdict(meta)}

    def replicas_part(self, partial: Path,
                      meta: ckpt.CheckpointMeta) -> Callable[[], list[ckpt.PartRecord]]:
        """What writes the replicas' part (one table) in the writer thread, after shard
        0's slice: their positions as planned."""
        replicas = self.snapshot_replicas
        return lambda: [ckpt.write_replicas_part(partial, meta, replicas)]

    def _replica_positions(self) -> dict[int, tuple[dict[str, int], int]]:
        """Replica index -> (TrainShard.state(), local steps) as published, for every
        part of the data that a live group trains: its replica's, or the spare's that took
        it over (downpour.spares), under the replica's index."""
        rows = self.replicas.view.replicas
        replicas = self.plan.num_replicas
        ranges = balanced_ranges(self.info.n_train, replicas)
        positions = {}
        for r, (_, (epoch, position, local_steps)) in sorted(
                self.replicas.spares.positions(rows).items()):
            state = {"seed": self.config.run.seed, "rank": r, "num_ranks": replicas,
                     "n": ranges[r][1] - ranges[r][0], "epoch": epoch, "position": position}
            positions[r] = (state, local_steps)
        return positions

    def pause_ended(self, plan: dict[str, Any], pause: Pause) -> None:
        """The replicas' pause is over (the parts are copied, or written and committed, or
        nothing is written): release them."""
        self.replicas.excuse_silence()
        if "error" in plan:
            self.committed(plan, pause)
        if self.awaiting:  # the replicas paused for it go on
            self.shard.add_run_control(rc.RELEASE, 1)
            self.awaiting = self.ready = False
        if "meta" not in plan:
            self.schedule(time.monotonic())

    def commit(self, meta: ckpt.CheckpointMeta,
               reports: list[dict[str, Any]]) -> dict[str, Any]:
        """Commit from every shard's report (in the writer thread, or at the end): the
        outcome. Reads only what plan_checkpoint fixed."""
        for kind in ("diverged", "error"):
            problems = [r[kind] for r in reports if kind in r]
            if problems:
                return {kind: problems[0]}  # the .partial is cleaned at the next start
        records = [ckpt.PartRecord(*rec) for r in reports for rec in r["records"]]
        try:
            path = ckpt.commit(
                self.root, meta, settings=hashed_settings(self.config),
                algorithm=self.config.optimizer.algorithm,
                layout=self.network.layout, shard_ranges=self.shard.ranges,
                optimizer_state=list(saved_state(self.shard.optimizer)), parts=records,
                num_replicas=self.plan.num_replicas, keep=self.config.run.keep_checkpoints,
                lost_replicas=self.snapshot_lost,
                unreleased_replicas=self.snapshot_unreleased)
        except ckpt.CheckpointError as exc:
            return {"error": str(exc)}
        return {"path": str(path), "step": meta.step, "samples": meta.samples,
                "at": meta.wall_seconds}

    def given_up(self) -> None:
        """The checkpoint planned last is given up (shards.ShardRole, after a lost shard):
        the next may take the same step; its .partial is replaced then, or cleaned at the
        next start."""
        self.planned_step = self.last_step

    def committed(self, outcome: dict[str, Any], pause: Pause) -> None:
        """A checkpoint's outcome: committed (logged), or why not (the run stops). The
        next one is scheduled from now."""
        if "error" in outcome:
            self.failure = outcome["error"]
        if "path" in outcome:
            path = Path(outcome["path"])
            self.written += 1
            self.last_step, self.last_path = outcome["step"], str(path)
            # Timed when committed, later than the training lines logged while it was
            # written: the times in metrics.jsonl keep increasing. A run resumed from it
            # cuts it with them (their time is past the state's, `state_time`).
            now = time.monotonic()
            if pause.background:  # the pause ended before the writes
                paused, written = pause.ended - pause.began, now - pause.ended
                how = f"replicas paused {paused:.2f}s, written in {written:.2f}s meanwhile"
            else:  # the pause ends after this commit
                paused = written = now - pause.began
                how = f"{paused:.2f}s"
            self.recorder.log_event("checkpoint", outcome["step"], outcome["samples"],
                                    state_time=outcome["at"], seconds=paused,
                                    write_seconds=written, path=path.name)
            say(self.stream, f"checkpoint {path} ({how})")
        elif "diverged" in outcome or "error" in outcome:
            say(self.stream, f"distbelief: checkpoint not written: "
                             f"{outcome.get('diverged') or outcome.get('error')}")
        if "diverged" in outcome:
            self.progress.stop(rc.STOP_DIVERGED, "diverged")
        elif "error" in outcome:
            self.progress.stop(rc.STOP_CHECKPOINT_FAILED, "checkpoint_failed")
        self.schedule(time.monotonic())
