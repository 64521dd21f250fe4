"""Sandblaster's coordinator (Coordinator): runs lbfgs.minimize on dot products, hands out
work units and evaluations, goes on without a lost replica (handing its units to a spare,
cluster.spare_replicas, if one waits), owns the run folder, the stop rules and the
checkpoints, and writes the summary (the helpers at the end of this module).
docs/sandblaster.md, "Design" (the coordinator, checkpoints, lost replicas, spares,
stopping), says how.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import IO, Any

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.common import StopRules, StopSignals, run_recorder
from distbelief.algorithms.sandblaster.lbfgs import Gram, Iteration, minimize
from distbelief.algorithms.sandblaster.plan import (
    BACKUP_LATE_FACTOR,
    TAG_COMMAND,
    TAG_FINISHED,
    TAG_REQUEST,
    TAG_RESULT,
    TAG_TASK,
    SandblasterPlan,
    poll_backoff,
    relay_children,
    relay_parent,
)
from distbelief.algorithms.sandblaster.work_units import (
    COMMIT,
    DROP,
    HOLD,
    UnitStats,
    WorkUnitTable,
)
from distbelief.config import Config, config_hash, hashed_settings
from distbelief.records import checkpoint as ckpt
from distbelief.records.console import say
from distbelief.records.metrics import ResumePoint, accuracy_text, target_text
from distbelief.runtime.health import watchdog
from distbelief.runtime.health.liveness import Peers, sweep_replicas
from distbelief.runtime.launching import launcher
from distbelief.runtime.launching.faults import Faults

SWEEP_S = 0.25
"""How often the coordinator looks for gone replica ranks while it waits."""
NOTICE_SLACK_S = 1.0
NOTICE_DELAY_S = 0.5
"""A SIGUSR1 first seen no more than NOTICE_SLACK_S after a rank was found gone, or
followed by a rank found gone within NOTICE_DELAY_S (plus the heartbeat timeout when
ranks on other nodes are watched by heartbeat), is hydra's notice of the death
(`-disable-auto-cleanup`), not a stop request: the values Downpour uses."""


class AllReplicasLost(Exception):
    """Every replica is lost: no gradient can be computed any more."""


@dataclass
class LostReplica:
    """A replica the coordinator declared lost (summary.json's lost_replicas, as
    Downpour's)."""

    replica: int
    ranks: list[int]
    why: str
    at_step: int
    at_seconds: float


@dataclass
class SpareTakeover:
    """Spare `spare` (replica group `group`) was told to take over training replica
    `replaced`'s units when group `lost_group` was lost (summary.json's `spares`, as
    Downpour's)."""

    spare: int  # its index among the spares (0..k-1)
    group: int  # its replica index (R + spare)
    ranks: list[int]
    replaced: int  # the training replica whose units (and rows) it took over
    lost_group: int  # the replica group that was lost
    at_step: int  # the iteration when it was told
    lost_at: float  # time.monotonic() when the loss was declared
    lost_wall: float  # time.time() then (compared with the spare's own clock)
    takeover_seconds: float | None = None  # loss -> its first request (its rows read)

    def summary(self, stats: dict[str, Any] | None) -> dict[str, Any]:
        """The summary's entry; `stats` the spare's statistics (None: lost)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("lost_at", "lost_wall")}
        for what in ("unit", "push"):
            at = stats.get(f"first_{what}_at") if stats else None
            out[f"loss_to_first_{what}_seconds"] = (None if at is None
                                                    else at - self.lost_wall)
        out["units_committed"] = stats.get("units_committed") if stats else None
        return out

# ------------------------------------------------------------------------------------------
# The coordinator


@dataclass
class Traffic:
    """Bytes the coordinator sent to and received from shards and replicas (pickled
    message sizes, as MPI carries them)."""

    shard_bytes: int = 0
    shard_messages: int = 0
    replica_bytes: int = 0
    replica_messages: int = 0


@dataclass
class EvaluationRecord:
    """One gradient evaluation (a trial of the line search, or a new batch's gradient)."""

    seconds: float
    stats: UnitStats = field(default_factory=UnitStats)


class Coordinator:
    """Runs L-BFGS through shard commands, deals out work units, keeps the run's records.
    Point-to-point with every shard and replica; never holds a vector."""

    def __init__(self, comm: MPI.Comm, config: Config, plan: SandblasterPlan, network: Any,
                 info: Any, stream: IO[str] | None, resumed: ckpt.Checkpoint | None = None,
                 *, faults: Faults):
        self.comm, self.config, self.plan, self.network = comm, config, plan, network
        self.resumed = resumed
        self.stream = stream
        topology = plan.topology
        self.shards = list(topology.shard_ranks)
        # Every replica group's rank: the R training replicas, then the spares
        # (cluster.spare_replicas), which wait until one takes a lost replica's units over.
        self.replicas = [topology.replica_ranks(r)[0] for r in range(topology.num_groups)]
        self.replica_of = {rank: r for r, rank in enumerate(self.replicas)}  # O(1) lookups
        self.num_training = plan.num_replicas
        # Group -> the training replica whose units (queue, rows) it computes.
        self.serves: dict[int, int] = {r: r for r in range(plan.num_replicas)}
        self.free_spares = list(range(plan.num_replicas, topology.num_groups))
        self.takeovers: list[SpareTakeover] = []
        self.opening: dict[int, SpareTakeover] = {}  # told, its first request not yet in
        self.all_replica_ranks = range(topology.first_replica_rank, topology.world_size)
        self.units = plan.units
        self.owners = plan.owners
        self.rules = StopRules.from_config(config)
        self.traffic = Traffic()
        self.table: WorkUnitTable | None = None
        self.trial_id = 0
        self.batch = 0
        self.loss_sum = 0.0
        self.parked: dict[int, None] = {}  # ranks waiting for work, in the order they asked
        self.stopping = False
        self.stopped: set[int] = set()
        self.ended: set[int] = set()  # replicas stopped or lost
        self.stop_waiting: set[int] = set()  # replicas whose stop waits for their children
        # Replicas that asked for their stop before every other had asked or was lost: a
        # replica that died near the end (on another node: found only by heartbeat) must be
        # known before anyone is told how to end (a collective end would wait for it).
        self.stop_gate: set[int] = set()
        self.gate_open = False  # every replica has asked or ended: stops are given
        self.reason: str | None = None
        self.samples = 0
        self.evaluations: list[EvaluationRecord] = []
        self.iteration_evals: list[EvaluationRecord] = []
        self.unit_totals = UnitStats()
        self.late_discarded = 0
        self.unit_seconds: deque[float] = deque(maxlen=256)  # recent units, issue to report
        self.snapshot_id = 0
        self.eval_task: int | None = None  # a snapshot waiting for a replica to evaluate it
        self.snapshot_at: dict[int, tuple[int, int]] = {}  # snapshot -> (step, samples)
        self.eval_in_flight = False
        self.last_loss = math.nan
        self.step = 0
        # Lost replicas (docs/sandblaster.md, "Lost replicas").
        self.peers: Peers | None = None  # set by roles.train
        self.lost: dict[int, LostReplica] = {}
        self.eval_holder: int | None = None  # the replica evaluating eval_task's snapshot
        # Replicas given an evaluation so far: they hold the evaluation set (a replica
        # reads it at its first evaluation), so the next ones go to them while one lives.
        self.evaluators: set[int] = set()
        self.committers: set[int] = set()  # replicas with units committed in this trial
        self.in_trial = False  # from begin_trial until the shards' finish answers
        self.broken = False  # this trial lost a replica with commits: run it again
        self.restarted_evaluations = 0
        self.death_times: list[float] = []  # when sweeps found ranks newly gone
        self.dead_ranks: set[int] = set()
        self.usr1_seen, self.usr1_pending = 0, []  # SIGUSR1s counted, new ones' first sight
        self.notices = launcher.sends_death_notices()  # else every SIGUSR1 is a stop
        self.next_sweep = 0.0
        # Test-only (distbelief.runtime.launching.faults): AT counts the iterations.
        self.faults = faults
        say(stream, _header(config, plan, network, info))
        resume = None
        if resumed is not None:
            self.step, self.samples = resumed.step, resumed.samples
            resume = ResumePoint(resumed.step, resumed.samples, resumed.wall_seconds,
                                 resumed.path.name)
        self.recorder = run_recorder(config, info, stream, resume=resume)
        self.order: list[int] = []  # history slots in use, oldest first (for checkpoints)
        self.checkpointed = (self.step, self.recorder.elapsed())  # (step, time) of the last
        self.next_eval = self.recorder.start  # evaluate x0 first
        self.method = Coordinator._minimize
        self.signals: StopSignals | None = None
        """What `run` does with the shards and replicas; tests put other methods here."""

    # -- the method -------------------------------------------------------------------------

    def _minimize(self) -> str:
        gram = None
        if self.resumed is not None:
            pairs = sum(1 for name in self.resumed.manifest["optimizer_state"]
                        if name.startswith("s") and not name.endswith("_lo"))
            gram = Gram(self.plan.options.m)
            gram.load(self._command("gram"), pairs)
            self.order = list(gram.order)
        return minimize(self, self.plan.options, self._on_iteration, self.step, gram)

    def run(self) -> None:
        """Run the method, then the final checkpoint and evaluation, then stop every replica
        and shard. Point-to-point with every shard and replica."""
        try:
            self.reason = self.method(self)
        except AllReplicasLost:
            self.reason = "replicas_lost"
            self.in_trial, self.table = False, None
        if self.reason == "converged":
            say(self.stream, f"converged: gradient norm <= "
                   f"{self.plan.options.gradient_tolerance:g}")
        if self.reason != "diverged":
            self._checkpoint()
        if self.reason not in (*StopSignals.NAMES, "replicas_lost"):
            self._evaluate_now()  # the final parameters (on a signal, end soon: none)
        self.stopping = True
        # Waiting spares stop with the others, once every replica's ending is known (the
        # stop gate), as if they had asked.
        self.stop_gate.update(s for s in self.free_spares if s not in self.ended)
        parked, self.parked = self.parked, {}
        for rank in parked:
            self._give_task(rank, HOLD)
        self._serve_until(lambda: len(self.ended) == len(self.replicas), stopping=True)
        self._command("stop", self.leave, self.reason == "diverged", self._lost_ranks())

    @property
    def leave(self) -> bool:
        """Whether the run ends without collectives (a rank of it is lost)."""
        return bool(self.lost)

    def _lost_ranks(self) -> list[int]:
        return sorted(rank for lost in self.lost.values() for rank in lost.ranks)

    def _stop_task(self, lost: bool = False) -> tuple:
        return ("stop", int(self.leave), int(lost), int(self.reason == "diverged"))

    def _on_iteration(self, it: Iteration) -> str | None:
        self.step = it.step
        self.last_loss = it.loss
        self.order = it.order
        stats = UnitStats()
        for record in self.iteration_evals:
            stats.add(record.stats)
        stats.discarded += self.late_discarded  # reported after their trial ended
        self.late_discarded = 0
        self.recorder.log(
            it.step, self.samples, it.loss, grad_norm=it.grad_norm, step_size=it.step_size,
            line_search_evals=it.line_search_evals, pair_kept=it.pair_kept,
            restarted=it.restarted,
            units_per_replica=[stats.committed_by.get(r, 0) for r in range(len(self.replicas))],
            backup_units_issued=stats.backups_issued, backup_units_discarded=stats.discarded,
            evaluation_seconds=[r.seconds for r in self.iteration_evals],
            coordinator_shard_bytes=self.traffic.shard_bytes,
            coordinator_replica_bytes=self.traffic.replica_bytes)
        self.iteration_evals = []
        self.recorder.progress(it.step, self.samples, it.loss)
        self.faults.after_step(it.step, 0.0, "iteration")
        now = time.monotonic()
        if not math.isfinite(it.loss):
            return "diverged"
        if now >= self.next_eval and not self.eval_in_flight:
            self._schedule_evaluation()
        if self._checkpoint_due():
            self._checkpoint()
        if self.reason:
            return self.reason  # the target, seen in an evaluation result
        signal_ = self._signal_stop(now)
        if signal_:
            return signal_
        return self.rules.budget_spent(0, now - self.recorder.start, self.recorder.collapsed)

    # -- checkpoints ---------------------------------------------------------------------------

    def _checkpoint_due(self) -> bool:
        run = self.config.run
        step, at = self.checkpointed
        return bool((run.checkpoint_every_steps and self.step - step
                     >= run.checkpoint_every_steps)
                    or (run.checkpoint_every_seconds and self.recorder.elapsed() - at
                        >= run.checkpoint_every_seconds))

    def _checkpoint(self) -> None:
        """Write and commit a checkpoint of the current iterate and history (the shards
        write their parts on command; this rank commits). Point-to-point with the shards."""
        if self.checkpointed[0] == self.step and self.step > 0:
            return  # this iteration is in a checkpoint already
        root = ckpt.checkpoint_root(self.config.run.out_dir)
        meta = ckpt.CheckpointMeta(self.step, self.samples, self.recorder.elapsed(),
                                   config_hash(self.config))
        partial = ckpt.prepare(root, self.step)
        records = self._command("checkpoint", str(partial), meta, list(self.order),
                                combine=list)
        names = ["x_lo"] + [f"{v}{k:03d}{lo}" for k in range(len(self.order))
                            for v in "sy" for lo in ("", "_lo")]
        layout = self.network.layout
        final = ckpt.commit(root, meta, settings=hashed_settings(self.config),
                            algorithm="sandblaster", layout=layout,
                            shard_ranges=layout.shard_ranges(len(self.shards)),
                            optimizer_state=names, parts=records, num_replicas=0,
                            keep=self.config.run.keep_checkpoints,
                            lost_replicas=self._unserved())
        self.checkpointed = (self.step, self.recorder.elapsed())
        self.recorder.log_event("checkpoint", self.step, self.samples, path=str(final))

    # -- Backend (sandblaster.lbfgs): vector operations on the shards -------------------------

    def evaluate(self, t: float, batch: int) -> tuple[float, float]:
        t0 = time.monotonic()
        while True:
            found = self._try_evaluation(t, batch)
            if found is not None:
                break
            # A replica was lost with units committed in this trial: its push may have
            # reached some shards only (work_units: A LOST REPLICA). Run it again.
            self.restarted_evaluations += 1
            self.recorder.log_event("evaluation_restarted", self.step, self.samples,
                                    trial=self.trial_id)
        gtd, stats = found
        self.samples += self.plan.batch_size
        self.unit_totals.add(stats)
        record = EvaluationRecord(time.monotonic() - t0, stats)
        self.evaluations.append(record)
        self.iteration_evals.append(record)
        return self.loss_sum / self.plan.batch_size, gtd

    def _try_evaluation(self, t: float, batch: int) -> tuple[float, UnitStats] | None:
        """One trial at point t for `batch`: (gt . d, unit statistics), or None if it was
        abandoned (a replica lost with commits in it)."""
        self.trial_id += 1
        self.batch = batch
        self.committers, self.broken, self.in_trial = set(), False, True
        self._command("begin_trial", self.trial_id, t)
        late = (BACKUP_LATE_FACTOR * statistics.median(self.unit_seconds)
                if len(self.unit_seconds) >= 4 else 0.0)
        self.table = WorkUnitTable(len(self.units), self.plan.push_every,
                                   self.plan.backup_copies, backup_after=late,
                                   owners=self.owners)
        self.loss_sum = 0.0
        if self.step == 0 and self.trial_id == 1 and not self.eval_in_flight:
            self._schedule_evaluation()  # x0, while the first batch runs
        parked, self.parked = self.parked, {}
        for rank in parked:
            self._give_task(rank, HOLD)
        self._serve_until(lambda: self.table.complete or self.broken)
        stats = self.table.stats
        self.unit_seconds.extend(self.table.unit_seconds)
        self.table = None
        gtd = None if self.broken else self._finish_trial()
        self.in_trial = False
        if gtd is None:
            self.unit_totals.discarded += stats.issued  # all of it is computed again
            return None
        return gtd, stats

    def _finish_trial(self) -> float | None:
        """Tell the shards to finish the trial once they have every unit; their gt . d
        summed, or None if the trial was abandoned meanwhile (serving replicas and looking
        for lost ones while waiting). Point-to-point with the shards."""
        message = ("finish_trial", (len(self.units), self.plan.batch_size))
        for shard in self.shards:
            self.comm.send(message, dest=shard, tag=TAG_COMMAND)
        self.traffic.shard_bytes += len(MPI.pickle.dumps(message)) * len(self.shards)
        self.traffic.shard_messages += len(self.shards)
        answers = self._shard_answers(
            TAG_FINISHED, "the shards to finish the trial", give_up=self._trial_abandoned,
            keep=lambda answer: answer[0] == self.trial_id)  # not an abandoned trial's
        if answers is None:
            return None  # the shards drop it at the next begin_trial
        return sum(float(answers[shard][1][0]) for shard in self.shards)

    def _trial_abandoned(self) -> bool:
        if self.broken:
            return True
        if not self._training_count():
            raise AllReplicasLost
        return False

    def accept(self, slot: int) -> np.ndarray:
        return self._command("accept", slot)

    def take_gradient(self) -> np.ndarray:
        return self._command("take_gradient")

    def set_direction(self, coefficients: np.ndarray) -> tuple[float, float]:
        gtd, dd = self._command("set_direction", np.asarray(coefficients, dtype=np.float64))
        return float(gtd), float(dd)

    def _command(self, op: str, *args: Any, combine: Any = sum) -> Any:
        """Send `op` to every shard, wait (serving replicas meanwhile) for every answer;
        returns combine(answers in shard order): their sum by default. Point-to-point with
        the shards."""
        message = (op, args)
        size = len(MPI.pickle.dumps(message))
        for shard in self.shards:
            self.comm.send(message, dest=shard, tag=TAG_COMMAND)
        self.traffic.shard_bytes += size * len(self.shards)
        self.traffic.shard_messages += len(self.shards)
        answers = self._shard_answers(TAG_RESULT, f"the shards' answers to {op}",
                                      leaving=op == "stop")
        return combine(answers[shard] for shard in self.shards)

    def _shard_answers(self, tag: int, what: str, give_up: Any = lambda: False,
                       keep: Any = lambda answer: True,
                       leaving: bool = False) -> dict[int, Any] | None:
        """One message per shard on `tag` that keep() accepts (others are dropped), by
        shard rank, serving replicas and looking for lost ones while waiting; None as soon
        as give_up(). With `leaving`, a shard that answered may end at once (it is written
        off)."""
        answers: dict[int, Any] = {}
        status, backoff, guard = MPI.Status(), poll_backoff(), watchdog.current()
        with guard.waiting(what, self.shards):
            while len(answers) < len(self.shards):
                # (A shard may send its answer and leave before this rank has looked.)
                guard.check(lambda: self.comm.Iprobe(MPI.ANY_SOURCE, tag))
                if give_up():
                    return None
                if self.comm.Iprobe(MPI.ANY_SOURCE, tag, status):
                    self.traffic.shard_bytes += status.Get_count(MPI.BYTE)
                    self.traffic.shard_messages += 1
                    source = status.Get_source()
                    answer = self.comm.recv(source=source, tag=tag)
                    if keep(answer):
                        answers[source] = answer
                    if leaving:  # it may end now (after a lost replica it does)
                        guard.write_off([source])
                    backoff.reset()
                elif self._serve_one():
                    backoff.reset()
                else:
                    self._sweep()
                    backoff.wait()
        return answers

    # -- replicas ------------------------------------------------------------------------------

    def _serve_until(self, done: Any, stopping: bool = False) -> None:
        """Serve replicas until done(); AllReplicasLost if none is left first (not while
        `stopping`: then done() counts them). Looks for lost replicas meanwhile."""
        backoff = poll_backoff()
        guard = watchdog.current()
        with guard.waiting("the replicas' work units", self.all_replica_ranks):
            while not done():
                if not stopping and not self._training_count():
                    raise AllReplicasLost
                if self._serve_one() or self._wake_parked() or self._open_stop_gate():
                    backoff.reset()
                else:
                    self._sweep()
                    backoff.wait()

    # -- lost replicas --------------------------------------------------------------------------

    def _sweep(self, force: bool = False) -> None:
        """Every SWEEP_S: declare lost each replica with a rank found gone (liveness.Peers:
        its process on this node, its heartbeat on another), and note new SIGUSR1s."""
        now = time.monotonic()
        if self.peers is None or (now < self.next_sweep and not force):
            return
        self.next_sweep = now + SWEEP_S
        # Deaths include a lost replica's surviving partitions, which stop and exit later:
        # hydra announces each exit with a SIGUSR1 too.
        for replica, ranks, gone in sweep_replicas(self.peers, self.plan.topology,
                                                   len(self.replicas), self.dead_ranks,
                                                   self.death_times, now):
            if replica in self.ended:
                # Lost already, or stopped: after a loss a stopped replica ends at once,
                # which is no loss (relay parents stop after their children: a while).
                continue
            if gone:
                # Every rank found gone: a partition that saw its partner die may have
                # ended already too.
                self._lose(replica, ranks, self.peers.why_gone(gone))
        if self.signals is not None and self.signals.counts["SIGUSR1"] > self.usr1_seen:
            self.usr1_seen = self.signals.counts["SIGUSR1"]
            self.usr1_pending.append(now)

    def _lose(self, replica: int, ranks: list[int], why: str) -> None:
        """Go on without `replica`: its held units back to the queue, this trial run again
        if it committed units in it, its evaluation to another replica; the waits of this
        rank no longer depend on its ranks. Local (answers replicas)."""
        self.lost[replica] = LostReplica(replica, ranks, why, self.step,
                                         self.recorder.elapsed())
        watchdog.current().write_off(ranks)
        waiting = replica in self.free_spares
        if waiting:  # a waiting spare: one fewer to take over
            self.free_spares.remove(replica)
        self.opening.pop(replica, None)
        self.recorder.log_event("replica_lost", self.step, self.samples, replica=replica,
                                ranks=ranks, why=why)
        lead = self.replicas[replica]
        if self.in_trial and replica in self.committers:
            self.broken = True
        elif self.table is not None:
            self.table.release(replica)
        if self.eval_holder == replica:  # its evaluation goes to another replica
            self.eval_holder = None
            self.eval_task = max(self.snapshot_at)
        if lead in self.parked or replica in self.stop_waiting or replica in self.stop_gate:
            self.parked.pop(lead, None)
            self.stop_waiting.discard(replica)
            self.stop_gate.discard(replica)
            if not self.peers.gone(lead):  # a partition is gone, not the lead: stop it
                self._reply(lead, (DROP, self._stop_task(lost=True)))
        elif waiting and not self.peers.gone(lead):  # the same for a waiting spare's lead
            self._reply(lead, (DROP, self._stop_task(lost=True)))
        self._end(replica)
        part = self.serves.get(replica)
        taken = None if part is None or self.stopping else self._take_over(part, replica)
        name = (f"spare replica {replica - self.num_training}" if replica >= self.num_training
                else f"replica {replica}")
        say(self.stream, f"distbelief: {name} (rank{'s' * (len(ranks) > 1)} "
                         f"{', '.join(map(str, ranks))}) lost at step {self.step}: {why}; "
                         + ("" if taken is None else
                            f"spare {taken.spare} ({_ranks_text(taken.ranks)}) takes its "
                            "units over; ")
                         + f"training goes on with {self._training_count()} replica(s)")
        if self.parked and self.eval_task is not None:
            self._give_task(self._parked_evaluator(), HOLD)

    def _take_over(self, part: int, lost: int) -> SpareTakeover | None:
        """Training replica `part`'s units to the first free live spare (it reads that
        replica's rows, then asks like any replica, its own queue being `part`'s); None
        when no spare is left. Local (tells the spare)."""
        topology = self.plan.topology
        spare = next((s for s in self.free_spares if s not in self.ended and not (
            self.peers and self.peers.gone_among(list(topology.replica_ranks(s))))), None)
        if spare is None:
            return None
        self.free_spares.remove(spare)
        self.serves[spare] = part
        rank = self.replicas[spare]
        taken = SpareTakeover(spare - self.num_training, spare,
                              list(topology.replica_ranks(spare)), part, lost, self.step,
                              time.monotonic(), time.time())
        self.takeovers.append(taken)
        self.opening[spare] = taken
        self._reply(rank, (HOLD, ("take_over", part)))
        return taken

    def _training_count(self) -> int:
        """Replica groups computing units: training replicas and spares that took one's
        units over, not lost."""
        return sum(1 for group in self.serves if group not in self.lost)

    def _unserved(self) -> list[int]:
        """Training replicas whose units no live group serves (a checkpoint's
        `lost_replicas`)."""
        served = {part for group, part in self.serves.items() if group not in self.lost}
        return [part for part in range(self.num_training) if part not in served]

    def _relay_children(self, replica: int) -> range:
        """`replica`'s children in the relay tree: of the training replicas only (a spare
        fetches from the shards)."""
        if replica >= self.num_training:
            return range(0)
        return relay_children(replica, self.num_training)

    def _may_evaluate(self, replica: int) -> bool:
        """Whether `replica` may take an evaluation: one that has evaluated before, or
        any replica while none of those lives (so the evaluation set is read by as few
        replicas as the losses allow)."""
        return replica in self.evaluators or not (self.evaluators - self.lost.keys())

    def _parked_evaluator(self) -> int:
        """The parked rank to wake for an evaluation: a replica that may take it, else
        the first parked (given a unit, or parked again, by _give_task)."""
        for replica in self.evaluators - self.lost.keys():
            if self.replicas[replica] in self.parked:
                del self.parked[self.replicas[replica]]
                return self.replicas[replica]
        rank = next(iter(self.parked))
        del self.parked[rank]
        return rank

    def _signal_stop(self, now: float) -> str | None:
        """The signal that stops the run, if any: SIGTERM or SIGINT at once; SIGUSR1 unless
        it is hydra's notice of a lost rank (NOTICE_SLACK_S, NOTICE_DELAY_S)."""
        if self.signals is None:
            return None
        counts = self.signals.counts
        if counts["SIGTERM"]:
            return "SIGINT" if counts["SIGINT"] else "SIGTERM"
        self._sweep(force=True)
        delay = NOTICE_DELAY_S
        if self.peers is not None and self.peers.heartbeats is not None:
            delay += (self.peers.heartbeats.detection_s(len(self.all_replica_ranks))
                      + SWEEP_S)
        waiting = []
        for first in self.usr1_pending:
            if not self.notices:
                return "SIGUSR1"
            if any(first - NOTICE_SLACK_S <= t for t in self.death_times):
                say(self.stream, "distbelief: SIGUSR1 taken as the launcher's notice of the "
                                 "replica(s) found gone; training goes on")
            elif now - first >= delay and set(self._lost_ranks()) <= self.dead_ranks:
                # (While a lost replica's surviving partition has not been seen to end,
                # its exit, and hydra's notice of it, may be on the way: wait for it.)
                return "SIGUSR1"
            else:
                waiting.append(first)
        self.usr1_pending = waiting
        return None

    def _wake_parked(self) -> bool:
        """In the tail of a batch, give parked replicas the backups of units that have
        become late since they asked. Returns whether any got one."""
        if (self.table is None or not self.table.tail or not self.parked
                or not self.table.backup_due(time.monotonic())):
            return False
        parked, self.parked = self.parked, {}
        for rank in parked:
            self._give_task(rank, HOLD)  # parks it again if nothing is late for it
        return len(self.parked) < len(parked)

    def _serve_one(self) -> bool:
        """Answer one replica request if one is waiting; returns whether one was."""
        status = MPI.Status()
        if not self.comm.Iprobe(MPI.ANY_SOURCE, TAG_REQUEST, status):
            return False
        rank = status.Get_source()
        self.traffic.replica_bytes += status.Get_count(MPI.BYTE)
        self.traffic.replica_messages += 1
        trial, units, loss, result = self.comm.recv(source=rank, tag=TAG_REQUEST)
        replica = self.replica_of[rank]
        if replica in self.lost:
            # Its partner died after it asked (or before it was found): nothing of it
            # counts; tell it to stop.
            self.unit_totals.discarded += len(units)
            if not self.peers.gone(rank):
                self._reply(rank, (DROP, self._stop_task(lost=True)))
            self._end(replica)
            return True
        taken = self.opening.pop(replica, None)
        if taken is not None:  # a spare's first request: it has read its rows
            taken.takeover_seconds = time.monotonic() - taken.lost_at
            say(self.stream, f"distbelief: spare replica {taken.spare} "
                             f"({_ranks_text(taken.ranks)}) takes over replica "
                             f"{taken.replaced}'s units at step {self.step}, "
                             f"{taken.takeover_seconds:.2f} s after the loss")
            self.recorder.log_event("spare_took_over", self.step, self.samples,
                                    spare=taken.spare, ranks=taken.ranks,
                                    replaced=taken.replaced, lost=taken.lost_group,
                                    seconds=taken.takeover_seconds)
        if result is not None:
            self._record_evaluation(*result)
        current = self.table is not None and trial == self.trial_id
        if not units:
            decision = HOLD
        elif current:
            decision = self.table.settle(replica, units)
            if decision == COMMIT:
                self.loss_sum += loss
                self.committers.add(replica)
        else:
            decision = DROP  # its trial is over: every unit of it was committed already
            self.unit_totals.discarded += len(units)
            self.late_discarded += len(units)
        held = len(units) if decision == HOLD else 0
        self._give_task(rank, decision, free=not units or decision != HOLD, held=held)
        return True

    def _give_task(self, rank: int, decision: str, free: bool = True, held: int = 0) -> None:
        """Answer `rank` with `decision` and a task, or park it when there is no task and
        nothing to tell (it is answered when work comes). `free`: it holds no uncommitted
        units, so it may take an evaluation (which must not delay a pending push). `held`:
        the units it holds: it is granted up to push_every - held units at once (at least
        one), so that one answer serves a whole push's worth."""
        replica = self.replica_of[rank]
        task: tuple | None = None
        if self.stopping:
            if not self.gate_open:
                self.stop_gate.add(replica)
                if decision != HOLD:
                    self._reply(rank, (decision, None))  # it waits for its stop, unasked
                self._open_stop_gate()
                return
            if any(child not in self.ended for child in self._relay_children(replica)):
                # Its children may still fetch the trial point from it (relay): it stops
                # after them, answering their fetches while it waits.
                self.stop_waiting.add(replica)
                if decision != HOLD:
                    self._reply(rank, (decision, None))  # it waits for its stop, unasked
                return
            task = self._stop_task()
            self.stopped.add(rank)
            if self.leave:  # it ends once it has sent its statistics: not waited for
                watchdog.current().write_off(self.plan.topology.replica_ranks(replica))
            self._reply(rank, (decision, task))
            self._end(replica)
            return
        elif self.eval_task is not None and free and self._may_evaluate(replica):
            task = ("evaluate", self.eval_task)
            self.eval_task = None
            self.eval_holder = replica
            self.evaluators.add(replica)
        elif self.table is not None:
            units = self.table.next_units(replica, max(1, self.plan.push_every - held),
                                          owner=self.serves.get(replica, replica))
            if units:
                task = ("units", self.trial_id, self.batch, *units)
        if task is None and decision == HOLD:
            self.parked[rank] = None
            return
        self._reply(rank, (decision, task))
        if task is None:
            # Told to commit or drop with nothing to do next: it waits for its next answer
            # without asking again (one message less per replica and evaluation).
            self.parked[rank] = None

    def _open_stop_gate(self) -> bool:
        """Once every replica has asked for its stop or ended (lost included), answer the
        ones that asked, all with the same ending. Returns whether it did."""
        if self.gate_open or not self.stop_gate or not all(
                r in self.ended or r in self.stop_gate for r in range(len(self.replicas))):
            return False
        self.gate_open = True
        gate, self.stop_gate = sorted(self.stop_gate), set()
        for replica in gate:  # relay parents first: they wait for their children
            if replica not in self.ended:
                self._give_task(self.replicas[replica], HOLD)
        return True

    def _end(self, replica: int) -> None:
        """`replica` is stopped or lost: its parent in the relay tree, if it waits to stop
        and this was its last running child, stops now."""
        self.ended.add(replica)
        parent = relay_parent(replica) if replica < self.num_training else None
        if (parent is not None and parent in self.stop_waiting
                and all(c in self.ended for c in self._relay_children(parent))):
            self.stop_waiting.discard(parent)
            self._give_task(self.replicas[parent], HOLD)

    def _reply(self, rank: int, message: tuple) -> None:
        self.comm.send(message, dest=rank, tag=TAG_TASK)
        self.traffic.replica_bytes += len(MPI.pickle.dumps(message))
        self.traffic.replica_messages += 1

    # -- evaluations (test accuracy) on replicas ---------------------------------------------

    def _schedule_evaluation(self) -> None:
        """Snapshot x on the shards and hand its evaluation to the next free replica."""
        self.snapshot_id += 1
        self._command("snapshot", self.snapshot_id)
        self.eval_task = self.snapshot_id
        self.snapshot_at[self.snapshot_id] = (self.step, self.samples)
        self.eval_in_flight = True
        if self.parked:
            self._give_task(self._parked_evaluator(), HOLD)

    def _record_evaluation(self, snapshot: int, figures: dict[str, float]) -> None:
        """A replica's evaluation of a snapshot: its figures ({"loss", "accuracy", ...})."""
        self.eval_in_flight = False
        self.eval_holder = None
        step, samples = self.snapshot_at.pop(snapshot)
        self.recorder.log_eval(step, samples, self.last_loss, figures)
        self.next_eval = time.monotonic() + self.config.run.eval_every_seconds
        if self.reason is None and self.rules.target_reached(figures):
            self.reason = self.rules.target_reason

    def _evaluate_now(self) -> None:
        """Evaluate the current x and wait for the result (the final evaluation)."""
        try:
            self._serve_until(lambda: not self.eval_in_flight)
            self._schedule_evaluation()
            self._serve_until(lambda: not self.eval_in_flight)
        except AllReplicasLost:
            self.reason = "replicas_lost"

    # -- summary ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {"role": "coordinator", "rank": self.comm.Get_rank()}

    def write_summary(self, all_stats: list[dict[str, Any]]) -> dict[str, Any]:
        replicas = sorted((s for s in all_stats if s["role"] == "replica"),
                          key=lambda s: (s["replica"], s["partition"]))
        for r in replicas:
            r["units_committed"] = self.unit_totals.committed_by.get(r["replica"], 0)
        plan, totals = self.plan, self.unit_totals
        iterations = max(self.step, 1)
        extras = {
            "algorithm": "sandblaster", "stop_reason": self.reason,
            "config_hash": config_hash(self.config),
            "num_params": int(self.network.layout.size),
            "world_size": plan.topology.world_size, "ps_shards": plan.topology.ps_shards,
            "num_replicas": plan.num_replicas, "partitions": plan.partitions,
            "batch_size": plan.batch_size,
            "work_unit_size": plan.unit_size, "units_per_evaluation": len(self.units),
            "m": plan.options.m, "iterations": self.step,
            "gradient_evaluations": len(self.evaluations),
            "evaluation_seconds_mean": (float(np.mean([e.seconds for e in self.evaluations]))
                                        if self.evaluations else None),
            "units_issued": totals.issued, "backup_units_issued": totals.backups_issued,
            "backup_units_discarded": totals.discarded,
            "coordinator_traffic": asdict(self.traffic),
            "coordinator_shard_bytes_per_iteration": self.traffic.shard_bytes / iterations,
            "final_loss": self.last_loss,
            "lost_replicas": [asdict(lost) for _, lost in sorted(self.lost.items())],
            "restarted_evaluations": self.restarted_evaluations,
            "spare_replicas": plan.topology.spares,
            "spares": [t.summary(next((r for r in replicas if r["replica"] == t.group), None))
                       for t in self.takeovers],
            "training_replicas_at_end": self._training_count(),
            "replicas": replicas, "shards": [s for s in all_stats if s["role"] == "shard"],
            # Every replica rank's vectors to and from the shards (each in its `replicas`
            # entry); the coordinator's scalars are coordinator_traffic.
            "bytes_sent": sum(r.get("bytes_sent", 0) for r in replicas),
            "bytes_received": sum(r.get("bytes_received", 0) for r in replicas),
        }
        summary = self.recorder.finish(extras)
        say(self.stream, _summary_line(summary, self.config))
        return summary


def _ranks_text(ranks: list[int]) -> str:
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"


def _header(config: Config, plan: SandblasterPlan, network: Any, info: Any) -> str:
    opt = plan.options
    return (f"distbelief: sandblaster L-BFGS, {network.layout.size:,d} parameters; "
            f"{plan.topology.describe()}; m {opt.m}, batch {plan.batch_size} in "
            f"{len(plan.units)} units of {plan.unit_size}, "
            f"{'Wolfe' if opt.wolfe else 'Armijo'} line search; data {info.path}, out "
            f"{config.run.out_dir}\n{network.describe()}")


def _summary_line(summary: dict[str, Any], config: Config) -> str:
    text = (f"distbelief: stopped ({summary['stop_reason']}) after {summary['iterations']} "
            f"iterations ({summary['gradient_evaluations']} gradient evaluations), "
            f"{summary['wall_seconds']:.1f}s; loss {summary['final_loss']:.6g}; "
            f"{accuracy_text(summary)}; backup units "
            f"{summary['backup_units_issued']} issued, {summary['backup_units_discarded']} "
            f"discarded")
    if summary["lost_replicas"]:
        text += (f"; replicas lost: "
                 f"{', '.join(str(r['replica']) for r in summary['lost_replicas'])} "
                 f"({summary['restarted_evaluations']} evaluation(s) run again)")
    for taken in summary["spares"]:
        text += f"; spare {taken['spare']} took over replica {taken['replaced']}"
    text += target_text(summary)
    return f"{text}\nresults in {config.run.out_dir}"

