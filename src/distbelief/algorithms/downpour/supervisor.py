"""Shard 0 (Supervisor): it serves its slice like every shard and runs the run between
polls (the control block, training lines, evaluations, stop rules, lost replicas,
checkpoints), then writes the summary (the helpers at the end of this module). "The module
docstring" in the code below is the package's (distbelief.algorithms.downpour).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.common import StopRules, evaluate
from distbelief.algorithms.downpour.plan import (
    CONTROL_POLL_S,
    LEAVE_GRACE_S,
    LEAVING_TAG,
    NOTICE_DELAY_S,
    NOTICE_SLACK_S,
    ROUND_TERM,
    ROUND_USR1,
    STATS_TAG,
    SWEEP_S,
    DownpourPlan,
    Ending,
)
from distbelief.algorithms.downpour.progress import RunProgress
from distbelief.algorithms.downpour.replica_watch import ReplicaWatch
from distbelief.algorithms.downpour.run import OpenRun
from distbelief.algorithms.downpour.shards import ShardRole, part_report
from distbelief.algorithms.downpour.variant import DOWNPOUR, Variant
from distbelief.config import Config, config_hash, hashed_settings, run_name
from distbelief.model.layout import balanced_ranges
from distbelief.ps import run_control as rc
from distbelief.ps.endpoint import saved_state
from distbelief.ps.stats import STALENESS_BINS
from distbelief.records import checkpoint as ckpt
from distbelief.records.console import say
from distbelief.records.metrics import (
    LOG_EVERY_SECONDS,
    accuracy_text,
    best_last_text,
    target_text,
)
from distbelief.runtime import launcher, watchdog
from distbelief.runtime.agreement import WAIT_SLEEP_S
from distbelief.runtime.backoff import Backoff


class Supervisor(ShardRole):
    """Shard 0: serves its slice like every shard and, between polls, runs the run: the
    control block, training lines, evaluations (in a thread, on snapshots), stop rules,
    progress lines, lost replicas, and the checkpoints (it asks for them, commits them,
    and writes the replicas' parts).

    Communicates one-sided (its own windows; Gets of the other shards' PARAMS for
    snapshots), in the shards' rounds and collectives, and receives the replicas' final
    statistics. Owns the RunRecorder.
    """

    def __init__(self, run: OpenRun, config: Config, network: Any, info: Any,
                 stream: IO[str] | None, variant: Variant = DOWNPOUR):
        super().__init__(run)
        self.config, self.network, self.info, self.stream = config, network, info, stream
        self.variant = variant  # the algorithm built on this machinery, if not Downpour
        eval_set, start = run.local[0], run.start
        self.eval_set = eval_set
        plan = self.plan
        self.rules = StopRules.from_config(config)
        self.progress = RunProgress(self.shard, start.base)
        self.resumed_from = start.checkpoint
        self.snapshot = np.zeros(network.layout.size, dtype=np.float32)
        self.pending: tuple[Future, int] | None = None  # evaluation in flight, its step
        self.evaluations, self.eval_seconds = 0, 0.0
        replicas = plan.num_replicas
        # SIGUSR1 counts by source (each replica, then the shards' max in the rounds), as
        # last read (every source is read at each poll, at `usr1_read_at`); and new ones
        # waiting for their meaning. Arrays, so a poll costs O(1) Python work in R.
        self.usr1_seen = np.zeros(replicas + 1, dtype=np.int64)
        self.usr1_read_at = -math.inf
        self.usr1_pending: list[tuple[float, float]] = []  # (previous report, first seen)
        self._notices = launcher.sends_death_notices()  # else every SIGUSR1 is a stop
        self.warm_released = False
        self.replica_stats: dict[int, dict[str, Any]] = {}
        self.requests = 0  # checkpoint requests made (the CHECKPOINT slot)
        self.awaiting = False  # a request is out: its checkpoint has not been written
        self.ready = False  # every replica has paused for it (or finished, or is lost)
        self.requested_at = 0.0  # when the newest request went out
        self.ack_wait_seconds = 0.0  # requests until every replica had paused, in all
        self.logged_steps = -1
        self.logged_loss_total = 0.0  # loss_total at the last training line
        self._next_control = 0.0
        self._shard_signals = (0, 0)  # max SIGTERM, SIGUSR1 counts of the shards
        self._terms_seen = 0
        run_config = config.run
        self.root = ckpt.checkpoint_root(run_config.out_dir)
        self.every_seconds, self.every_steps = (run_config.checkpoint_every_seconds,
                                                run_config.checkpoint_every_steps)
        self.last_checkpoint_step = start.base if start.checkpoint is not None else None
        self.last_checkpoint: str | None = None
        self.planned_step = self.last_checkpoint_step  # the newest step being written
        self.snapshot_replicas: list[ckpt.ReplicaState] = []  # theirs, as of that step
        self.snapshot_lost: list[int] = []  # the replicas lost by then (no state)
        self.committing: Future | None = None  # a commit in the writer thread
        self.pause_ended = 0.0  # when the newest checkpoint's pause ended
        self.checkpoints = 0
        say(stream, _header(config, plan, network, info, len(eval_set[1]), variant.name))
        # The clock starts once every rank is ready (open_parameter_server's barrier).
        self.recorder = run.session.open_recorder()
        self.replicas = ReplicaWatch(run, self.progress, self.recorder, stream)
        now = time.monotonic()
        self.next_log = now + LOG_EVERY_SECONDS
        self.next_eval = now + run_config.eval_every_seconds
        self._schedule_checkpoint(now)

    def run(self) -> None:
        with ThreadPoolExecutor(1, thread_name_prefix="distbelief-eval") as self.executor:
            super().run()
            if self.pending is not None:
                self._record_eval(*self.pending)
        self._read_control(time.monotonic())
        self._log_training()  # every replica has finished: the totals are final
        progress = self.progress
        if progress.reason is None:
            progress.reason = "max_steps"
        elif progress.reason == "SIGTERM":  # a replica's count was read before our own SIGINT
            progress.reason = self._term_name()

    def _duties(self) -> bool:
        """Shard 0's duties between two polls; cheap unless one of them is due."""
        if self.faults:
            self.faults.after_updates(self.shard.version)
        now = time.monotonic()
        busy = self._collect_stats()
        if self.pending is not None and self.pending[0].done():
            self._record_eval(*self.pending)
            busy = True
        if self.committing is not None and self.committing.done():
            self._committed()
            busy = True
        if (now >= self._next_control or (self.awaiting and not self.ready)
                or self.usr1_pending):
            self._read_control(now)
        if now >= self.replicas.next_sweep:
            self.replicas.sweep(now)
        if now >= self.next_log:
            self._log_training()
            self.next_log = now + LOG_EVERY_SECONDS
        if self.progress.reason is None:
            self._apply_budget(now)
        if self.progress.reason is None and self.pending is None and now >= self.next_eval:
            self._start_eval()
            busy = True
        if not self.awaiting and self._checkpoint_due(now):
            self.requests += 1
            self.shard.add_run_control(rc.CHECKPOINT, 1)
            self.awaiting, self.ready = True, False
            self.requested_at = now
        steps = self.progress.steps
        self.recorder.progress(steps, steps * self.plan.batch_size, self.progress.loss)
        return self._poll_rounds() or busy

    # -- the run control block

    def _read_control(self, now: float) -> None:
        """Read the block: steps and loss, heartbeats, signals, replicas giving up, the
        pause for a checkpoint, the end."""
        self._next_control = now + CONTROL_POLL_S
        view = self.shard.read_run_control()
        progress = self.progress
        steps = progress.base + view.steps
        if steps > progress.steps:
            progress.steps, progress.loss_total = steps, view.loss_sum
        self.replicas.saw(view, now)
        rows = view.replicas
        term = max(int(rows[:, rc.TERM].max(initial=0)), self._shard_signals[0])
        usr1 = np.append(rows[:, rc.USR1], self._shard_signals[1])
        self._on_signals(term, usr1, now)
        lost = self.replicas.lost
        for replica in np.flatnonzero(rows[:, rc.GAVE_UP]):
            if int(replica) not in lost:
                progress.stop(rc.STOP_BAD_GRADIENTS, "bad_gradients", int(replica) + 1)
        for replica in np.flatnonzero(rows[:, rc.ABANDONED]):
            if int(replica) not in lost:
                ranks = list(self.plan.topology.replica_ranks(replica))
                self.replicas.lose(int(replica), ranks, "one of its partitions found another gone")
        if self.plan.warm_start_steps and not self.warm_released and (
                0 in lost or rows[0, rc.FINISHED]):
            # The others wait for replica 0's warm-start steps, which will never come.
            self.shard.add_run_control(rc.WARM, 1)
            self.warm_released = True
        if self.awaiting and not self.ready:
            self.ready = bool(np.all(self.replicas.lost_mask
                                     | (rows[:, rc.ACKED] >= self.requests)
                                     | (rows[:, rc.FINISHED] > 0)))
            if self.ready:  # the part of a replica's pause spent waiting for the others
                self.ack_wait_seconds += now - self.requested_at

    def _contribution(self) -> list[int]:
        counts = self.signals.counts
        finished = not self.awaiting and self.replicas.all_done()
        return [counts["SIGTERM"], counts["SIGUSR1"], int(self.awaiting and self.ready),
                int(finished), int(self._still_writing())]

    def _on_round(self, result: np.ndarray) -> None:
        self._shard_signals = (int(result[ROUND_TERM]), int(result[ROUND_USR1]))

    def _on_signals(self, term: int, usr1: np.ndarray, now: float) -> None:
        """Stop on a SIGTERM; on a SIGUSR1 unless it is the launcher's notice of a death:
        a source's new SIGUSR1 is a notice if a rank was found gone since that source's
        previous report (see SIGNALS in the module docstring)."""
        if self.all_finished:
            return  # the run is ending: ranks leaving make hydra send SIGUSR1s
        if term > self._terms_seen:
            self._terms_seen = term
            self.progress.stop(rc.STOP_SIGNAL, self._term_name())
        new = int(np.count_nonzero(usr1 > self.usr1_seen))  # sources with a new SIGUSR1
        self.usr1_pending += [(self.usr1_read_at, now)] * new
        self.usr1_seen, self.usr1_read_at = usr1, now
        if not self.usr1_pending:
            return
        self.replicas.sweep(now)
        waiting = []
        for previous, first in self.usr1_pending:
            if not self._notices:
                self.progress.stop(rc.STOP_SIGNAL, "SIGUSR1")
            elif any(previous - NOTICE_SLACK_S <= t for t in self.replicas.death_times):
                if not self.progress.stop_code:
                    say(self.stream, "distbelief: SIGUSR1 taken as the launcher's notice "
                                        "of the rank(s) found gone; training goes on")
            elif now - first >= self._notice_delay():
                self.progress.stop(rc.STOP_SIGNAL, "SIGUSR1")
            else:
                waiting.append((previous, first))
        self.usr1_pending = waiting

    def _term_name(self) -> str:
        """What the TERM counts stand for: a first SIGINT is counted as a SIGTERM (StopSignals),
        so it is SIGINT when this rank had one. A Ctrl-C reaches every rank; a SIGINT sent
        to one replica alone reads as SIGTERM."""
        return "SIGINT" if self.signals.counts["SIGINT"] else "SIGTERM"

    # -- liveness

    def _notice_delay(self) -> float:
        """How long a new SIGUSR1 waits for a rank to be found gone: NOTICE_DELAY_S, plus
        the heartbeats' detection bound when ranks on other nodes are found by their
        heartbeat (else hydra's notice of a death there would stop the run before the death
        is found)."""
        beats, watched = self.run_.peers.heartbeats, self.plan.topology.world_size
        return NOTICE_DELAY_S + (beats.detection_s(watched) + SWEEP_S if beats is not None
                                 else 0.0)

    def _collect_stats(self) -> bool:
        """Receive the replicas' final statistics as they come (point-to-point)."""
        got = False
        messages = self.run_.messages
        status = MPI.Status()
        while messages.Iprobe(MPI.ANY_SOURCE, STATS_TAG, status):
            source = status.Get_source()
            self.replica_stats[source] = messages.recv(source=source, tag=STATS_TAG)
            got = True
        return got

    # -- training lines, stops, evaluations

    def _log_training(self) -> None:
        """A training line, if steps were reported since the last one. Its loss is the mean
        over every step since the previous line (LOG_EVERY_SECONDS apart), as the other
        trainers log it, so the curves of different algorithms compare."""
        progress = self.progress
        if progress.steps == self.logged_steps or progress.steps == progress.base:
            return
        since = max(self.logged_steps, progress.base)
        since_logged = progress.loss_total - self.logged_loss_total
        progress.loss = since_logged / (progress.steps - since)
        self.logged_steps, self.logged_loss_total = progress.steps, progress.loss_total
        rate = getattr(self.shard.optimizer, "rate", None)  # EASGD's center has none
        extra = {} if rate is None else {
            "learning_rate": rate(max(self.shard.gradients_applied - 1, 0))}
        self.recorder.log(progress.steps, progress.steps * self.plan.batch_size, progress.loss,
                          version=self.shard.version, **extra)
        if not math.isfinite(progress.loss) and progress.reason is None:
            progress.stop(rc.STOP_DIVERGED, "diverged")

    def _apply_budget(self, now: float) -> None:
        reason = self.rules.budget_spent(self.progress.steps, now - self.recorder.start,
                                         self.recorder.collapsed)
        if reason:
            self.progress.stop(rc.STOP_RULE, reason)

    def _start_eval(self) -> None:
        """Snapshot the global parameters (one-sided Gets from the other shards) and
        evaluate them in the thread, while this thread goes on polling."""
        self.shard.snapshot(self.snapshot)
        future = self.executor.submit(self._timed_eval, self.snapshot)
        self.pending = (future, self.progress.steps)

    def _timed_eval(self, params: np.ndarray) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        with np.errstate(over="ignore", invalid="ignore"):  # per thread: not train()'s
            loss, accuracy = evaluate(self.network, params, self.eval_set)
        return loss, accuracy, time.perf_counter() - t0

    def _record_eval(self, future: Future, steps: int) -> None:
        test_loss, accuracy, seconds = future.result()  # re-raises the thread's exception
        self.pending = None
        self.evaluations += 1
        self.eval_seconds += seconds
        self.recorder.log_eval(steps, steps * self.plan.batch_size, self.progress.loss,
                               accuracy, test_loss, params=self.snapshot)
        if self.progress.reason is None and self.rules.target_reached(accuracy):
            self.progress.stop(rc.STOP_RULE, "target_accuracy")
        self.next_eval = time.monotonic() + self.config.run.eval_every_seconds

    # -- checkpoints: when, the parts of the replicas, the commit

    def _schedule_checkpoint(self, now: float) -> None:
        """The next periodic checkpoint: `every_seconds` from now, and the next multiple
        of `every_steps` after the newest checkpoint's step (also after a resume from
        another step), due at once if training passed it while that one was written; inf
        when off."""
        self.next_checkpoint_time = now + self.every_seconds if self.every_seconds \
            else math.inf
        after = self.progress.steps if self.planned_step is None else self.planned_step
        self.next_checkpoint_step = ((after // self.every_steps + 1) * self.every_steps
                                     if self.every_steps else math.inf)

    def _checkpoint_due(self, now: float) -> bool:
        if self.progress.stop_code or self.replicas.all_done():
            return False  # the checkpoint at the end follows
        if self.writing is not None or self.committing is not None:
            return False  # one at a time: the previous one is still being written
        return (now >= self.next_checkpoint_time
                or self.progress.steps >= self.next_checkpoint_step)

    def _plan_checkpoint(self) -> dict[str, Any] | None:
        # Every push is folded: the totals are those of the checkpoint. Logged now, so
        # that no line up to its step is later than the checkpoint's time.
        self._read_control(time.monotonic())
        self._log_training()
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
        self.snapshot_lost = sorted(self.replicas.lost)
        self.snapshot_replicas = [
            ckpt.ReplicaState(r, {"local_steps": steps}, state, None, {})
            for r, (state, steps) in self._replica_positions().items()]
        return {"partial": str(partial), "meta": asdict(meta)}

    def _part_writer(self, partial: Path, meta: ckpt.CheckpointMeta,
                     copy: bool) -> Callable[[], dict[str, Any]]:
        """Shard 0's slice, then the replicas' part (one table)."""
        mine, replicas = super()._part_writer(partial, meta, copy), self.snapshot_replicas

        def write() -> dict[str, Any]:
            report = mine()
            if "records" not in report:
                return report
            theirs = part_report(lambda: [ckpt.write_replicas_part(partial, meta, replicas)])
            if "records" not in theirs:
                return theirs
            return {"records": report["records"] + theirs["records"]}

        return write

    def _replica_positions(self) -> dict[int, tuple[dict[str, int], int]]:
        """Replica index -> (TrainShard.state(), local steps) as published, for every
        replica that is not lost."""
        rows = self.replicas.view.replicas
        replicas = self.plan.num_replicas
        ranges = balanced_ranges(self.info.n_train, replicas)
        positions = {}
        for r in range(replicas):
            if r in self.replicas.lost:
                continue
            row = rows[r]
            state = {"seed": self.config.run.seed, "rank": r, "num_ranks": replicas,
                     "n": ranges[r][1] - ranges[r][0], "epoch": int(row[rc.EPOCH]),
                     "position": int(row[rc.POSITION])}
            positions[r] = (state, int(row[rc.LOCAL_STEPS]))
        return positions

    def _end_pause(self, plan: dict[str, Any]) -> None:
        super()._end_pause(plan)
        self.replicas.excuse_silence()
        self.pause_ended = time.monotonic()
        if "error" in plan:
            self._after_checkpoint(plan)
        if self.awaiting:  # the replicas paused for it go on
            self.shard.add_run_control(rc.RELEASE, 1)
            self.awaiting = self.ready = False
        if "meta" not in plan:
            self._schedule_checkpoint(time.monotonic())

    def _commit_parts(self, meta: ckpt.CheckpointMeta, reports: list[dict[str, Any]] | None,
                      now: bool) -> None:
        if now:
            self._after_checkpoint(self._commit(meta, reports))
        else:
            self.committing = self.writer.submit(self._commit, meta, reports)

    def _committed(self) -> None:
        """The writer thread's commit is done: act on its outcome."""
        future, self.committing = self.committing, None
        self._after_checkpoint(future.result())

    def _finish_writing(self) -> None:
        super()._finish_writing()
        if self.committing is not None:
            self._wait_for(self.committing)
            self._committed()

    def _commit(self, meta: ckpt.CheckpointMeta,
                reports: list[dict[str, Any]] | None) -> dict[str, Any]:
        """Commit from every shard's report (in the writer thread, or at the end): the
        outcome. Reads only what _plan_checkpoint fixed."""
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
                lost_replicas=self.snapshot_lost)
        except ckpt.CheckpointError as exc:
            return {"error": str(exc)}
        return {"path": str(path), "step": meta.step, "samples": meta.samples,
                "at": meta.wall_seconds}

    def _after_checkpoint(self, outcome: dict[str, Any]) -> None:
        """A checkpoint's outcome: committed (logged), or why not (the run stops). The
        next one is scheduled from now."""
        if "error" in outcome:
            self.failure = outcome["error"]
        if "path" in outcome:
            path = Path(outcome["path"])
            self.checkpoints += 1
            self.last_checkpoint_step, self.last_checkpoint = outcome["step"], str(path)
            # Timed when committed, later than the training lines logged while it was
            # written: the times in metrics.jsonl keep increasing. A run resumed from it
            # cuts it with them (their time is past the state's, `state_time`).
            now = time.monotonic()
            if self.in_background:  # the pause ended before the writes
                pause, written = self.pause_ended - self.began, now - self.pause_ended
                how = f"replicas paused {pause:.2f}s, written in {written:.2f}s meanwhile"
            else:  # the pause ends after this commit
                pause = written = now - self.began
                how = f"{pause:.2f}s"
            self.recorder.log_event("checkpoint", outcome["step"], outcome["samples"],
                                    state_time=outcome["at"], seconds=pause,
                                    write_seconds=written, path=path.name)
            say(self.stream, f"checkpoint {path} ({how})")
        elif "diverged" in outcome or "error" in outcome:
            say(self.stream, f"distbelief: checkpoint not written: "
                                f"{outcome.get('diverged') or outcome.get('error')}")
        if "diverged" in outcome:
            self.progress.stop(rc.STOP_DIVERGED, "diverged")
        elif "error" in outcome:
            self.progress.stop(rc.STOP_CHECKPOINT_FAILED, "checkpoint_failed")
        self._schedule_checkpoint(time.monotonic())

    # -- the end

    def _final_buffer(self) -> np.ndarray:
        """The evaluation snapshot's buffer, free by now (the last evaluation was recorded
        when the loop ended): one full vector on shard 0, not two."""
        return self.snapshot

    def _before_final_checkpoint(self, all_stats: list | None, final: np.ndarray | None) -> None:
        self.shard_stats = [s for s in all_stats if s["role"] == "shard"]
        self._wait_for_replica_stats()
        progress = self.progress
        if progress.stop_code != rc.STOP_SIGNAL:  # after a signal, stopping promptly matters
            samples = progress.steps * self.plan.batch_size
            t0 = time.perf_counter()
            test_loss, accuracy = evaluate(self.network, final, self.eval_set)
            self.evaluations += 1
            self.eval_seconds += time.perf_counter() - t0
            self.recorder.log_eval(progress.steps, samples, progress.loss, accuracy, test_loss,
                                   params=final)

    def _wait_for_replica_stats(self) -> None:
        """Every replica that finished sends its statistics; wait for them (sleeping),
        giving up on a replica whose process turns out to be gone."""
        backoff = Backoff(*WAIT_SLEEP_S)
        topology = self.plan.topology
        lost = self.replicas.lost
        with watchdog.current().waiting("the replicas' final statistics"):
            while True:
                self._collect_stats()
                missing = [rank for r in range(self.plan.num_replicas) if r not in lost
                           for rank in topology.replica_ranks(r)
                           if rank not in self.replica_stats]
                if not missing:
                    return
                self.replicas.sweep(time.monotonic())
                backoff.wait()

    def _ending(self) -> Ending:
        replicas, progress = self.replicas, self.progress
        teardown = (rc.TEARDOWN_LEAVE if replicas.lost or replicas.dead_ranks
                    else rc.TEARDOWN_FREE)
        summary = self.recorder.finish(_summary_extras(self))
        say(self.stream, _summary_line(summary, self.config))
        return Ending(progress.stop_code, progress.stop_arg, teardown, self.failure, summary)

    def _announce(self, ending: Ending) -> None:
        """Tell the other ranks how the run ends. With LEAVE (nobody frees; some rank is
        dead), wait until every client rank has said it leaves, or is found gone, before
        leaving: over RMA their reads need this rank's progress. Ranks it cannot see
        (other nodes) get LEAVE_GRACE_S. Nothing is recorded any more (summary written)."""
        self.shard.add_run_control(rc.TEARDOWN, ending.teardown)
        if ending.teardown == rc.TEARDOWN_FREE:
            return
        topology, peers = self.plan.topology, self.run_.peers
        waiting = set(range(topology.first_replica_rank, topology.world_size))
        messages, status = self.run_.messages, MPI.Status()
        backoff = Backoff(*WAIT_SLEEP_S)
        deadline = time.monotonic() + LEAVE_GRACE_S
        with watchdog.current().waiting("the other ranks to read the end of the run"):
            # Iprobe keeps this rank in MPI, so the epochs still open on it complete. A rank
            # gone has no epoch open; one on another node that dies never says it leaves:
            # LEAVE_GRACE_S covers it.
            while waiting and time.monotonic() < deadline:
                while messages.Iprobe(MPI.ANY_SOURCE, LEAVING_TAG, status):
                    source = status.Get_source()
                    messages.recv(source=source, tag=LEAVING_TAG)
                    waiting.discard(source)
                waiting.difference_update(peers.gone_among(sorted(waiting)))
                if waiting:
                    backoff.wait()


# ------------------------------------------------------------------------------------------
# The summary


def _summary_extras(sup: Supervisor) -> dict[str, Any]:
    config, plan = sup.config, sup.plan
    replicas = sorted(sup.replica_stats.values(), key=lambda s: (s["replica"], s["rank"]))
    resumed = sup.resumed_from
    return {
        # "averaging" for EASGD, which runs on this machinery (algorithms.averaging.elastic)
        "algorithm": run_name(config), "stop_reason": sup.progress.reason,
        "config_hash": config_hash(config), "num_params": int(sup.network.layout.size),
        "eval_samples": len(sup.eval_set[1]), "world_size": plan.topology.world_size,
        "ps_shards": plan.topology.ps_shards, "num_replicas": plan.num_replicas,
        "n_fetch": plan.n_fetch, "n_push": plan.n_push,
        "elastic_alpha": config.optimizer.elastic_alpha,
        "warm_start_steps": plan.warm_start_steps, "max_steps": plan.max_steps,
        "evaluations": sup.evaluations, "eval_seconds": sup.eval_seconds,
        "resumed_from": str(resumed.path) if resumed is not None else None,
        "resumed_at_step": sup.progress.base, "checkpoint": sup.last_checkpoint,
        "bad_gradients": sum(r["bad_gradients"] for r in replicas),
        "checkpoints_written": sup.checkpoints, "checkpoint_seconds": sup.checkpoint_seconds,
        "checkpoint_requests": sup.requests, "checkpoint_ack_wait_seconds": sup.ack_wait_seconds,
        "lost_replicas": [asdict(lost) for _, lost in sorted(sup.replicas.lost.items())],
        "staleness": _combined_staleness(replicas),
        "push_dtype": config.optimizer.push_dtype,
        **sup.variant.summary,
        # every replica rank's, summed (each also in its `replicas` entry)
        "bytes_sent": sum(r["bytes_sent"] for r in replicas),
        "bytes_received": sum(r["bytes_received"] for r in replicas),
        "replicas": replicas, "shards": sup.shard_stats,
    }


def _combined_staleness(replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """The staleness of every push of every replica, as one distribution."""
    width = max((len(r["staleness"]["histogram"]) for r in replicas), default=0)
    histogram = np.zeros(width, dtype=np.int64)
    for r in replicas:
        h = r["staleness"]["histogram"]
        histogram[: len(h)] += np.asarray(h, dtype=np.int64)
    samples = int(histogram.sum())
    mean = float((histogram * np.arange(width)).sum() / samples) if samples else 0.0
    return {"samples": samples, "mean": mean,
            "max": max((r["staleness"]["max"] for r in replicas), default=0),
            "histogram": [int(c) for c in histogram], "histogram_cap": STALENESS_BINS - 1}


def _header(config: Config, plan: DownpourPlan, network: Any, info: Any,
            eval_samples: int, name: str) -> str:
    opt = config.optimizer
    return (f"distbelief: {name}, {network.layout.size:,d} parameters; "
            f"{plan.topology.describe()}; n_fetch {opt.n_fetch}, n_push {opt.n_push}, "
            f"warm start {opt.warm_start_steps} steps, "
            f"update {opt.update}, lr {opt.learning_rate:g}; data "
            f"{info.path} ({info.n_train} train / {eval_samples} eval samples), out "
            f"{config.run.out_dir}\n{network.describe()}")


def _summary_line(summary: dict[str, Any], config: Config) -> str:
    rates = ", ".join(f"{r['samples_per_second'] or 0:.0f}" for r in summary["replicas"]
                      if not r.get("partition"))  # a replica's partitions train its samples
    text = (f"distbelief: stopped ({summary['stop_reason']}) after {summary['steps']} steps "
            f"in total, {summary['wall_seconds']:.1f}s; {accuracy_text(summary)}; samples/s "
            f"per replica: {rates}; staleness mean {summary['staleness']['mean']:.2f} max "
            f"{summary['staleness']['max']}")
    if summary["lost_replicas"]:
        text += f"; replicas lost: {', '.join(str(r['replica']) for r in summary['lost_replicas'])}"
    text += target_text(summary)
    models = best_last_text(summary)
    text += f"\ndistbelief: {models}" if models else ""
    return f"{text}\nresults in {config.run.out_dir}"
