"""Shard 0 (Supervisor): it holds a shard's role (shards.ShardRole: it serves its slice
like every shard) and runs the run between polls (the control block, training lines,
evaluations, stop rules, lost replicas, checkpoints), with the objects it is made of
(progress, replica_watch, checkpoints), then writes the summary (the helpers at the end of
this module). "The module docstring" in the code below is the package's
(distbelief.algorithms.downpour).
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import IO, Any

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.common import StopRules, evaluate
from distbelief.algorithms.downpour.checkpoints import Checkpoints
from distbelief.algorithms.downpour.clocks import ClockWatch, combined_leads
from distbelief.algorithms.downpour.plan import (
    BOUND_CONTROL_POLL_S,
    CONTROL_POLL_S,
    LEAVE_GRACE_S,
    LEAVING_TAG,
    NOTICE_DELAY_S,
    NOTICE_SLACK_S,
    STATS_TAG,
    SWEEP_S,
    DownpourPlan,
    Ending,
)
from distbelief.algorithms.downpour.progress import RunProgress
from distbelief.algorithms.downpour.replica_watch import ReplicaWatch
from distbelief.algorithms.downpour.run import OpenRun
from distbelief.algorithms.downpour.shards import ShardRole
from distbelief.algorithms.downpour.variant import DOWNPOUR, Variant
from distbelief.config import Config, config_hash, run_name
from distbelief.model.sparse_rows import RowCache, RowsView
from distbelief.ps import run_control as rc
from distbelief.ps.endpoint import PieceMap
from distbelief.ps.stats import STALENESS_BINS
from distbelief.records.console import say
from distbelief.records.metrics import (
    LOG_EVERY_SECONDS,
    accuracy_text,
    best_last_text,
    target_text,
)
from distbelief.runtime.backoff import Backoff
from distbelief.runtime.communicators.agreement import WAIT_SLEEP_S
from distbelief.runtime.health import watchdog
from distbelief.runtime.launching import launcher


class Supervisor:
    """Shard 0: serves its slice like every shard (its ShardRole, `shard_role`) and,
    between polls, runs the run: the control block, training lines, evaluations (in a
    thread, on snapshots), stop rules (RunProgress), progress lines, lost replicas
    (ReplicaWatch), and the checkpoints (Checkpoints, the ShardRole's CheckpointLead: it
    asks for them, commits them, and writes the replicas' parts).

    Communicates one-sided (its own windows; Gets of the other shards' PARAMS for
    snapshots), in the shards' rounds and collectives, and receives the replicas' final
    statistics. Owns the RunRecorder.
    """

    def __init__(self, run: OpenRun, config: Config, network: Any, info: Any,
                 stream: IO[str] | None, variant: Variant = DOWNPOUR):
        self.run_, self.plan, self.shard = run, run.plan, run.endpoint
        self.signals = run.signals
        self.config, self.network, self.info, self.stream = config, network, info, stream
        self.variant = variant  # the algorithm built on this machinery, if not Downpour
        eval_set, start = run.local[0], run.start
        self.eval_set = eval_set
        plan = self.plan
        self.rules = StopRules.from_config(config)
        self.progress = RunProgress(self.shard, start.base)
        self.resumed_from = start.checkpoint
        # What evaluations read: the whole vector, or a row-sharded run's evaluation rows
        # alone (never a whole table on this rank).
        self.eval_model, self.eval_pieces = network, None
        if plan.row_pulls:
            self.eval_model = RowsView(network)
            self.eval_model.cache = RowCache.for_batches(network, [eval_set[0]])
            self.eval_pieces = PieceMap(self.eval_model.cache.pieces, self.shard.ranges)
        size = network.layout.size if self.eval_pieces is None else self.eval_pieces.size
        self.snapshot = np.zeros(size, dtype=np.float32)
        self.pending: tuple[Future, int] | None = None  # evaluation in flight, its step
        self.evaluations, self.eval_seconds = 0, 0.0
        replicas = plan.num_groups  # the spares' rows too
        # SIGUSR1 counts by source (each replica, then the shards' max in the rounds), as
        # last read (every source is read at each poll, at `usr1_read_at`); and new ones
        # waiting for their meaning. Arrays, so a poll costs O(1) Python work in R.
        self.usr1_seen = np.zeros(replicas + 1, dtype=np.int64)
        self.usr1_read_at = -math.inf
        self.usr1_pending: list[tuple[float, float]] = []  # (previous report, first seen)
        self._notices = launcher.sends_death_notices()  # else every SIGUSR1 is a stop
        self.warm_released = False
        self.replica_stats: dict[int, dict[str, Any]] = {}
        self.logged_steps = -1
        self.logged_loss_total = 0.0  # loss_total at the last training line
        self._next_control = 0.0
        self._terms_seen = 0
        say(stream, _header(config, plan, network, info, len(eval_set[1]), variant.name))
        # The clock starts once every rank is ready (open_parameter_server's barrier).
        self.recorder = run.session.open_recorder()
        self.replicas = ReplicaWatch(run, self.progress, self.recorder, stream, info.n_train)
        # optimizer.max_staleness: the lowest live clock (downpour.clocks)
        self.clocks = None if plan.max_staleness is None else ClockWatch(
            self.shard, plan.max_staleness, replicas,
            [r for r in range(replicas) if plan.joins_late(r, start.base)],
            spares=range(plan.first_spare, replicas))
        if self.clocks is not None:
            self.replicas.joined = self.clocks.join
        self.checkpoints = Checkpoints(run, config, network, info, self.progress,
                                       self.replicas, self.recorder, stream, self._catch_up)
        self.shard_role = ShardRole(run, lead=self.checkpoints)
        now = time.monotonic()
        self.next_log = now + LOG_EVERY_SECONDS
        self.next_eval = now + config.run.eval_every_seconds

    def run(self) -> None:
        with ThreadPoolExecutor(1, thread_name_prefix="distbelief-eval") as self.executor:
            self.shard_role.run(self._duties)
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
        shard_role = self.shard_role
        shard_role.faults.after_updates(self.shard.version)
        now = time.monotonic()
        busy = self._collect_stats()
        if self.pending is not None and self.pending[0].done():
            self._record_eval(*self.pending)
            busy = True
        if shard_role.poll_commit():
            busy = True
        checkpoints = self.checkpoints
        if (now >= self._next_control or checkpoints.waiting_for_pauses
                or self.usr1_pending):
            busy = self._read_control(now) or busy
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
        if not shard_role.writing_checkpoint and checkpoints.due(now):
            checkpoints.request(now)
        steps = self.progress.steps
        self.recorder.progress(steps, steps * self.plan.batch_size, self.progress.loss)
        return shard_role.poll_rounds(self._votes) or busy

    # -- the run control block

    def _read_control(self, now: float) -> bool:
        """Read the block: steps and loss, heartbeats, signals, replicas giving up, the
        pause for a checkpoint, the lowest live clock, the end. True when replicas waiting
        at optimizer.max_staleness may go on (the new lowest clock is published)."""
        self._next_control = now + CONTROL_POLL_S
        view = self.shard.read_run_control()
        progress = self.progress
        steps = progress.base + view.steps
        if steps > progress.steps:
            progress.steps, progress.loss_total = steps, view.loss_sum
        self.replicas.saw(view, now)
        if self.replicas.spares.pending and not progress.stop_code:
            self.replicas.release_due()
        rows = view.replicas
        shard_term, shard_usr1 = self.shard_role.shard_signals
        term = max(int(rows[:, rc.TERM].max(initial=0)), shard_term)
        usr1 = np.append(rows[:, rc.USR1], shard_usr1)
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
        self.checkpoints.read_acks(rows, now)
        return self._read_clocks(rows, now)

    def _read_clocks(self, rows: np.ndarray, now: float) -> bool:
        """optimizer.max_staleness: publish the lowest live clock, counting the replicas
        the warm start held back in once it is over; while a replica waits at the bound,
        read the block again soon (BOUND_CONTROL_POLL_S)."""
        clocks = self.clocks
        if clocks is None:
            return False
        warm_over = (self.warm_released
                     or self.progress.steps >= self.plan.warm_start_steps)
        moved = clocks.saw(rows, self.replicas.lost_mask, warm_over)
        if clocks.waiting:
            self._next_control = min(self._next_control, now + BOUND_CONTROL_POLL_S)
        return moved or clocks.waiting

    def _catch_up(self) -> None:
        """Read the block and log the training line: the totals as of now (a checkpoint's,
        once every push is folded)."""
        self._read_control(time.monotonic())
        self._log_training()

    def _votes(self) -> tuple[bool, bool]:
        """Shard 0's in the shards' rounds: every replica has paused for the checkpoint
        asked for; every replica is done (and none is asked to pause)."""
        checkpoints = self.checkpoints
        finished = not checkpoints.awaiting and self.replicas.all_done()
        return checkpoints.paused, finished

    def _on_signals(self, term: int, usr1: np.ndarray, now: float) -> None:
        """Stop on a SIGTERM; on a SIGUSR1 unless it is the launcher's notice of a death:
        a source's new SIGUSR1 is a notice if a rank was found gone since that source's
        previous report (see SIGNALS in the module docstring)."""
        if self.shard_role.all_finished:
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
        deaths = [*self.replicas.death_times, *(s.found for s in self.run_.lost_shards)]
        waiting = []
        for previous, first in self.usr1_pending:
            if not self._notices:
                self.progress.stop(rc.STOP_SIGNAL, "SIGUSR1")
            elif any(previous - NOTICE_SLACK_S <= t for t in deaths):
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
        self.shard.snapshot(self.snapshot, self.eval_pieces)
        future = self.executor.submit(self._timed_eval, self.snapshot)
        self.pending = (future, self.progress.steps)

    def _timed_eval(self, params: np.ndarray) -> tuple[Any, float]:
        t0 = time.perf_counter()
        with np.errstate(over="ignore", invalid="ignore"):  # per thread: not train()'s
            result = evaluate(self.eval_model, params, self.eval_set)
        return result, time.perf_counter() - t0

    def _record_eval(self, future: Future, steps: int) -> None:
        result, seconds = future.result()  # re-raises the thread's exception
        self.pending = None
        self.evaluations += 1
        self.eval_seconds += seconds
        self.recorder.log_eval(steps, steps * self.plan.batch_size, self.progress.loss,
                               result, params=self._best_candidate(self.snapshot))
        if self.progress.reason is None and self.rules.target_reached(result):
            self.progress.stop(rc.STOP_RULE, self.rules.target_reason)
        self.next_eval = time.monotonic() + self.config.run.eval_every_seconds

    # -- the end

    def finish(self) -> Ending:
        """End the run with the other shards (ShardRole.finish's steps, with shard 0's
        between them): gather the results, take the replicas' statistics and evaluate,
        the final checkpoint, then the summary, bcast to the shards, and TEARDOWN for the
        replicas. Collective over the shards."""
        shard_role = self.shard_role
        # Gathered into the evaluation snapshot's buffer, free by now (the last evaluation
        # was recorded when the loop ended): one full vector on shard 0, not two.
        all_stats, final = shard_role.gather_results(
            into=self.snapshot,
            pieces=None if self.eval_pieces is None else self.eval_pieces.pieces)
        self._final_results(all_stats, final)
        shard_role.final_checkpoint()
        ending = shard_role.share_ending(self._ending())
        self._announce(ending)
        return ending

    def _final_results(self, all_stats: list, final: np.ndarray) -> None:
        """The shards' statistics, the replicas' (waited for), and the final evaluation
        (none after a signal)."""
        self.shard_stats = [s for s in all_stats if s["role"] == "shard"]
        self._wait_for_replica_stats()
        progress = self.progress
        if progress.stop_code != rc.STOP_SIGNAL:  # after a signal, stopping promptly matters
            samples = progress.steps * self.plan.batch_size
            t0 = time.perf_counter()
            result = evaluate(self.eval_model, final, self.eval_set)
            self.evaluations += 1
            self.eval_seconds += time.perf_counter() - t0
            self.recorder.log_eval(progress.steps, samples, progress.loss, result,
                                   params=self._best_candidate(final))

    def _best_candidate(self, params: np.ndarray) -> np.ndarray | None:
        """What the best keeper may keep: the evaluated vector, or nothing in a row-sharded
        run, whose evaluations hold their rows only (docs/sparse-models.md)."""
        return params if self.eval_pieces is None else None

    def _wait_for_replica_stats(self) -> None:
        """Every replica that finished sends its statistics; wait for them (sleeping),
        giving up on a replica whose process turns out to be gone."""
        backoff = Backoff(*WAIT_SLEEP_S)
        topology = self.plan.topology
        lost = self.replicas.lost
        with watchdog.current().waiting("the replicas' final statistics"):
            while True:
                self._collect_stats()
                missing = [rank for r in range(self.plan.num_groups) if r not in lost
                           for rank in topology.replica_ranks(r)
                           if rank not in self.replica_stats]
                if not missing:
                    return
                self.replicas.sweep(time.monotonic())
                backoff.wait()

    def _ending(self) -> Ending:
        replicas, progress = self.replicas, self.progress
        teardown = (rc.TEARDOWN_LEAVE
                    if replicas.lost or replicas.dead_ranks or self.run_.lost_shards
                    else rc.TEARDOWN_FREE)
        summary = self.recorder.finish(_summary_extras(self))
        say(self.stream, _summary_line(summary, self.config))
        return Ending(progress.stop_code, progress.stop_arg, teardown,
                      self.checkpoints.failure, summary)

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
    resumed, checkpoints = sup.resumed_from, sup.checkpoints
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
        "resumed_at_step": sup.progress.base, "checkpoint": checkpoints.last_path,
        "bad_gradients": sum(r["bad_gradients"] for r in replicas),
        "checkpoints_written": checkpoints.written,
        "checkpoint_seconds": sup.shard_role.checkpoint_seconds,
        "checkpoint_requests": checkpoints.requests,
        "checkpoint_ack_wait_seconds": checkpoints.ack_wait_seconds,
        "lost_replicas": [asdict(lost) for _, lost in sorted(sup.replicas.lost.items())],
        # cluster.spare_replicas (downpour.spares): the takeovers, and the parts trained
        # at the end (R when a spare replaced every replica lost)
        "spare_replicas": plan.topology.spares,
        "spares": _takeovers(sup),
        "training_replicas_at_end": sup.replicas.spares.training(),
        # cluster.standby_shards: the shards lost, whose slices shard 0 adopted; on shared
        # memory their clients folded on into the slice, so no update was lost
        "standby_shards": config.cluster.standby_shards,
        "lost_shards": [{"shard": lost.rank, "why": lost.why, "at": lost.at,
                         "adopted_by": 0, "updates_lost": 0,
                         "regroup_seconds": lost.regroup_seconds}
                        for lost in sup.run_.lost_shards],
        "staleness": _combined_staleness(replicas),
        # the bound and what it bounds (downpour.clocks): each block's clock lead
        "max_staleness": plan.max_staleness,
        "clock_lead": combined_leads(plan.max_staleness, replicas),
        "push_dtype": config.optimizer.push_dtype,
        **sup.variant.summary,
        # every replica rank's, summed (each also in its `replicas` entry)
        "bytes_sent": sum(r["bytes_sent"] for r in replicas),
        "bytes_received": sum(r["bytes_received"] for r in replicas),
        "replicas": replicas, "shards": sup.shard_stats,
    }


def _takeovers(sup: Supervisor) -> list[dict[str, Any]]:
    """The summary's `spares`: each takeover, with the spare's first push (its lead
    rank's statistics; the clocks of shard 0 and the spare compared: one node, or nodes
    whose clocks agree)."""
    return [t.summary(sup.replica_stats.get(t.ranks[0]))
            for t in sup.replicas.spares.takeovers]


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
    bound = "" if plan.max_staleness is None else f"max staleness {plan.max_staleness}, "
    return (f"distbelief: {name}, {network.layout.size:,d} parameters; "
            f"{plan.topology.describe()}; n_fetch {opt.n_fetch}, n_push {opt.n_push}, "
            f"warm start {opt.warm_start_steps} steps, {bound}"
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
    lead = summary["clock_lead"]
    if lead is not None:
        text += (f"; clock lead max {lead['max']} (bound {lead['bound']}), waited "
                 f"{lead['wait_seconds']:.1f}s over {lead['waits']} of {lead['blocks']} "
                 f"blocks")
    if summary["lost_replicas"]:
        text += f"; replicas lost: {', '.join(str(r['replica']) for r in summary['lost_replicas'])}"
    for lost in summary["lost_shards"]:
        text += (f"; shard {lost['shard']} lost, its slice adopted by shard "
                 f"{lost['adopted_by']} ({lost['updates_lost']} updates lost)")
    for t in summary["spares"]:
        first, lost = t["loss_to_first_push_seconds"], t["lost_group"] is not None
        text += (f"; spare {t['spare']} {'replaced' if lost else 'released as'} replica "
                 f"{t['replaced']}" + (f" (first push {first:.2f} s after the "
                                       f"{'loss' if lost else 'release'})"
                                       if first is not None else ""))
    text += target_text(summary)
    models = best_last_text(summary)
    text += f"\ndistbelief: {models}" if models else ""
    return f"{text}\nresults in {config.run.out_dir}"
