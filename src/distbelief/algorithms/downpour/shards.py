"""What every Downpour parameter-server shard does (ShardRole): serve, take part in the
shards' rounds, write its part of each checkpoint, and end the run with the others.
Shard 0 does more (supervisor.Supervisor), and its checkpointer (checkpoints.Checkpoints,
a CheckpointLead) plans, completes and commits every checkpoint. "The module docstring"
in the code below is the package's (distbelief.algorithms.downpour).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial as partial_call
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.downpour.plan import (
    ROUND_CHECKPOINT,
    ROUND_FINISHED,
    ROUND_INTERVAL_S,
    ROUND_TERM,
    ROUND_USR1,
    ROUND_WIDTH,
    ROUND_WRITING,
    Ending,
)
from distbelief.algorithms.downpour.run import OpenRun
from distbelief.ps.endpoint import PieceMap, saved_state
from distbelief.records import checkpoint as ckpt
from distbelief.records.console import say
from distbelief.runtime.backoff import Backoff, PacedBackoff
from distbelief.runtime.communicators.agreement import (
    WAIT_SLEEP_S,
    Rounds,
    bcast_polled,
    gather_polled,
    gatherv_polled,
    wait_for_everyone,
)
from distbelief.runtime.health import watchdog
from distbelief.runtime.health.watchdog import RankLost

REGROUP_TAG, STEP_DONE_TAG = 46, 47
"""Tags of a shard's message on the shards' communicator that it regroups without the lost
(ShardRole._agree_on; cluster.standby_shards), and of shard 0's that a step of the end of
the run completed (ShardRole._step_done); no other point-to-point message uses them."""


DRAIN_ROUND_S = 0.2
"""How long a shard that found another lost tests the round in flight before it regroups
(ShardRole._drain_round): every survivor whose round can complete completes it first."""


class RegroupAsked(Exception):
    """Another shard calls for a regroup (it found a shard lost) while this one waited for
    shard 0 to complete a step: regroup, then run the step again."""

# ------------------------------------------------------------------------------------------
# Shards

@dataclass
class Writing:
    """A checkpoint whose parts a shard's writer thread is writing: its meta, the
    thread's future (the part report) and when the pause ended."""

    meta: ckpt.CheckpointMeta
    future: Future
    began: float


@dataclass
class Pause:
    """The replicas' pause for one checkpoint: when it began, whether the parts are
    written after it (in the background, the replicas training meanwhile), and when it
    ended."""

    began: float
    background: bool
    ended: float | None = None


class CheckpointLead(Protocol):
    """What shard 0 does in every checkpoint, which ShardRole calls at each step of it
    (checkpoints.Checkpoints); the other shards have none."""

    def plan_checkpoint(self) -> dict[str, Any] | None:
        """Once every push counted is folded: {"partial", "meta"} to write, {"error"}, or
        None for nothing new (bcast to the shards)."""

    def replicas_part(self, partial: Path,
                      meta: ckpt.CheckpointMeta) -> Callable[[], list[ckpt.PartRecord]]:
        """What writes the replicas' part, after shard 0's slice (in the writer thread)."""

    def pause_ended(self, plan: dict[str, Any], pause: Pause) -> None:
        """The replicas' pause is over: they go on."""

    def commit(self, meta: ckpt.CheckpointMeta,
               reports: list[dict[str, Any]]) -> dict[str, Any]:
        """Commit from every shard's part report (in the writer thread, or at the end):
        the outcome."""

    def committed(self, outcome: dict[str, Any], pause: Pause) -> None:
        """Act on a commit's outcome (in the thread that serves)."""

    def given_up(self) -> None:
        """The checkpoint planned last will not be committed (a shard died before its
        parts were gathered; cluster.standby_shards): the next one may take its step."""


class ShardRole:
    """What every shard does: serve, take part in the shards' rounds, write checkpoints
    and end the run together (collectives over the shards' communicator only). On shard
    0, `lead` plans, completes and commits each checkpoint, and the supervisor that holds
    this role runs its own duties between the polls and its own part of the end."""

    def __init__(self, run: OpenRun, lead: CheckpointLead | None = None):
        self.run_, self.plan, self.shard = run, run.plan, run.endpoint
        self.lead = lead
        self.comm = run.communicators.shards
        self.rounds = Rounds(self.comm, ROUND_WIDTH, ROUND_INTERVAL_S)
        self.signals = run.signals
        self.faults = run.session.faults  # test-only (distbelief.runtime.launching.faults)
        self.all_finished = False  # a round said every replica has finished or is lost
        self.shard_signals = (0, 0)  # the shards' max SIGTERM, SIGUSR1 counts (rounds)
        self.checkpoint_seconds = 0.0  # the replicas' pauses: agreed round to release
        self.write_seconds = 0.0  # the writes after the release, in the writer thread
        self.writing: Writing | None = None  # parts being written, not yet gathered
        self.committing: Future | None = None  # shard 0: a commit in the writer thread
        self.pause: Pause | None = None  # the newest checkpoint's
        self.background = run.session.config.run.checkpoint_in_background
        self.parts_written = 0  # checkpoints this shard has written its part of
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="distbelief-checkpoint")
        # cluster.standby_shards: the shards in self.comm (world ranks, in its order), and
        # on shard 0 the lost shards' slices it adopted (_regroup)
        self.members = list(run.plan.topology.shard_ranks)
        self.adopted: list[Any] = []
        self._regroups = 0  # regroups done: a regroup's messages name it
        self._sent: list[MPI.Request] = []  # sends never waited for (kept while in flight)
        self._inbox: dict[int, list[tuple]] = {}  # regroup messages received, by shard

    def run(self, duties: Callable[[], bool] | None = None) -> None:
        """Serve until a round says the run is over, doing `duties` between two polls
        (True when they did some work; default: this shard's own, `_duties`)."""
        self.shard.serve(PacedBackoff(), between=duties or self._duties,
                         until=lambda: self.all_finished)

    def _duties(self) -> bool:
        """Between two polls: the test-only faults, the shards' liveness, the rounds."""
        self.faults.after_updates(self.shard.version)
        self.run_.check_shards(time.monotonic())
        return self.poll_rounds()

    # -- rounds

    def poll_rounds(self, votes: Callable[[], tuple[bool, bool]] | None = None) -> bool:
        """Test the shards' round in flight (post the next one when due, with shard 0's
        `votes`: every replica has paused for the checkpoint asked for, every replica is
        done) and act on a completed one. True when it ran a checkpoint. Collective over
        the shards in the sense of agreement.Rounds."""
        if len(self.run_.lost_shards) > len(self.adopted_ranks()):
            result = self._drain_round()
            if result is None:
                self._regroup()
                return True
        else:
            result = self.rounds.poll(lambda: self._contribution(votes))
        if result is None:
            return False
        self.shard_signals = (int(result[ROUND_TERM]), int(result[ROUND_USR1]))
        written = self.writing is not None and not result[ROUND_WRITING]
        try:
            if written:
                self._gather_parts()
            if result[ROUND_CHECKPOINT]:
                self.checkpoint(self.background)
        except RankLost as lost:
            self._lost_in_checkpoint(lost)
            return True
        if result[ROUND_FINISHED]:
            self.all_finished = True
        return bool(result[ROUND_CHECKPOINT]) or written

    # -- a lost shard's slice adopted (cluster.standby_shards)

    def _drain_round(self) -> np.ndarray | None:
        """A shard is lost and the shards are to regroup: the round in flight, if it
        completes within DRAIN_ROUND_S, else None (no new one is posted). The lost shard
        may have posted its part before it died; then the round completes for every
        survivor, and one that had already acted on it (say, ended the serving for the end
        of the run) must not be left alone in it by the others dropping it."""
        if not self.rounds.in_flight:
            return None
        deadline = time.monotonic() + DRAIN_ROUND_S
        backoff = Backoff(*WAIT_SLEEP_S)
        while time.monotonic() < deadline:
            result = self.rounds.poll(list)
            if result is not None:
                return result
            backoff.wait()
        return None

    def adopted_ranks(self) -> list[int]:
        """The lost shards the shards have regrouped without."""
        return [r for r in self.run_.plan.topology.shard_ranks if r not in self.members]

    def _surviving(self, step: Callable[[], Any],
                   given_up: Callable[[], None] | None = None) -> Any:
        """Run `step`, collective over the shards, again on the survivors each time a
        shard dies during it and is adopted (cluster.standby_shards; every survivor is
        held in the same collective, the first one the dead shard missed), after
        `given_up()` undid what the failed try left. Without a standby the loss ends the
        job (OpenRun.shard_lost)."""
        while True:
            try:
                result = step()
                self._step_done()
                return result
            except RankLost as lost:
                self._lost_in_collective(lost, given_up)
            except RegroupAsked:
                if given_up is not None:
                    given_up()
                self._regroup()

    def _step_done(self) -> None:
        """After a step of _surviving: shard 0 tells the others it completed; they wait
        for that or for a call to regroup. Without it a shard whose part of a gather was
        sent would go on to the next step while shard 0, missing a dead shard's part,
        regroups and runs this one again. Shard 0's message is never waited for (a shard
        dying now is found in the next step). Point-to-point; RegroupAsked on the others."""
        comm = self.comm
        if comm.Get_rank() == 0:
            self._sent = [request for request in self._sent if not request.Test()]
            self._sent += [comm.isend(True, dest=r, tag=STEP_DONE_TAG)
                           for r in range(1, comm.Get_size())]
            return
        guard, backoff = watchdog.current(), Backoff(*WAIT_SLEEP_S)
        with guard.waiting("shard 0 to complete a step of the end of the run",
                           [self.members[0]]):
            while not comm.iprobe(source=0, tag=STEP_DONE_TAG):
                if any(comm.iprobe(source=r, tag=REGROUP_TAG)
                       for r in range(comm.Get_size())):
                    self.run_.check_shards(time.monotonic(), force=True)
                    raise RegroupAsked
                guard.check()
                backoff.wait()
            comm.recv(source=0, tag=STEP_DONE_TAG)

    def _lost_in_checkpoint(self, lost: RankLost) -> None:
        """A shard died while the shards wrote a periodic checkpoint: with a standby, that
        checkpoint is given up (its .partial is cleaned at the next start; shard 0 asks
        for the next one at once) and the replicas are released; else the job ends."""
        self._lost_in_collective(lost, self._give_up_writing)

    def _lost_in_collective(self, lost: RankLost,
                            given_up: Callable[[], None] | None) -> None:
        if lost.rank not in self.members:
            raise lost
        self.run_.shard_lost(lost.rank, f"is gone (found while {lost.what})")
        if given_up is not None:
            given_up()
        self._regroup()

    def _agree_on(self, members: list[int]) -> None:
        """Wait (polled, sleeping) until every other shard in `members` has said that it
        regroups with exactly these: Comm.Create_group blocks inside MPI, and a member
        that died before calling it would hold everyone there for ever. Messages on the
        old communicator; the views only shrink, so a stale one never matches. RankLost
        if a member is found gone meanwhile. Point-to-point with the survivors only."""
        # Two exchanges: the views (a shard may wait long in it for the others to find the
        # loss), then "go" (every survivor is at the end of the first within a poll or
        # two), after which each calls Create_group at once: a shard that dies between its
        # "go" and its Create_group, a few milliseconds at most, still holds the others
        # there, and the watchdog then ends the job naming it.
        for phase in ("view", "go"):
            self._exchange((phase, self._regroups, *members), members)

    def _exchange(self, message: tuple, members: list[int]) -> None:
        """Send `message` to every other member and wait (polled, sleeping) until each
        has sent the same; RankLost if a member is found gone meanwhile."""
        me = self.run_.plan.topology.world_rank
        for rank in members:
            if rank != me:  # never waited for: a message to a dead shard may never go
                self._sent.append(self.comm.isend(message, dest=self.members.index(rank),
                                                  tag=REGROUP_TAG))
        waiting = {r for r in members if r != me}
        guard, backoff = watchdog.current(), Backoff(*WAIT_SLEEP_S)
        with guard.waiting("the other shards to agree to regroup", sorted(waiting)):
            while waiting:
                for rank in sorted(waiting):
                    # Kept, not dropped, when they do not match yet: a shard that found
                    # one more loss first sends the view this one will come to.
                    source, inbox = self.members.index(rank), self._inbox.setdefault(rank, [])
                    while self.comm.iprobe(source=source, tag=REGROUP_TAG):
                        inbox.append(self.comm.recv(source=source, tag=REGROUP_TAG))
                    if message in inbox:
                        inbox.remove(message)
                        waiting.discard(rank)
                if waiting:
                    self.run_.check_shards(time.monotonic(), force=True)
                    for lost in self.run_.lost_shards:  # found now: written off the guard
                        if lost.rank in waiting:
                            raise RankLost(lost.rank, "the shards agreed to regroup")
                    guard.check()
                    backoff.wait()

    def _give_up_writing(self) -> None:
        """The checkpoint whose parts are being written is given up (a shard died before
        they were gathered): released, not committed. This shard's writer finishes first,
        so that nothing it writes lands in the next checkpoint's .partial."""
        writing, self.writing = self.writing, None
        if writing is not None:
            self._wait_for(writing.future)
        if self.lead is not None:
            self.lead.given_up()
        if self.pause is not None and self.pause.ended is None:
            self._end_pause({})

    def _regroup(self) -> None:
        """Go on without the lost shards: a new shards' communicator over the survivors
        (Comm.Create_group: collective over the survivors only, each calling it once it
        has found the loss, after an agreement by message; the round in flight on the old
        one was finished first if it could complete, _drain_round, else is dropped by
        every survivor), fresh rounds on it, and on shard 0 a view of each lost shard's
        slice (its shared segment, which every client goes on folding into: nothing is
        lost). The lost are written off the watchdog only now: until they left the
        shards' communicator, a wait on it had to raise for them."""
        if self.writing is not None:  # planned with the lost shard, whose part may be missing
            self._give_up_writing()
        while True:
            lost = {s.rank for s in self.run_.lost_shards}
            members = [r for r in self.members if r not in lost]
            try:
                self._agree_on(members)
                break
            except RankLost as more:  # another shard died meanwhile: without it too
                if more.rank not in members:
                    raise
                self.run_.shard_lost(more.rank, f"is gone (found while {more.what})")
        keep = [self.members.index(r) for r in members]
        # Blocking, but every survivor has just said it is here: only a death in the
        # next microseconds would hold it (the watchdog then ends the job).
        with watchdog.current().waiting("the other shards to regroup without the lost",
                                        members):
            group = self.comm.Get_group().Incl(keep)
            comm = self.comm.Create_group(group)
            group.Free()
        gone = [r for r in self.members if r not in members]
        watchdog.current().write_off(gone)  # no longer in any wait of the shards
        self.comm, self.members = comm, members
        self.run_.communicators.shards = comm
        self._regroups += 1
        self._inbox = {}  # the old communicator's: the next regroup's come on the new one
        self.rounds = Rounds(comm, ROUND_WIDTH, ROUND_INTERVAL_S)
        if self.lead is not None:
            have = {view.rank for view in self.adopted}
            for rank in sorted(lost - have):
                self.adopted.append(self.shard.adopt(rank))
                record = next(s for s in self.run_.lost_shards if s.rank == rank)
                record.regroup_seconds = time.monotonic() - record.found
                say(self.run_.session.stream, f"distbelief: parameter-server shard {rank} "
                    f"is lost; shard 0 serves its slice from shared memory and training goes "
                    f"on ({len(members)} shard(s) left)")

    def _contribution(self, votes: Callable[[], tuple[bool, bool]] | None) -> list[int]:
        counts = self.signals.counts
        paused, finished = votes() if votes is not None else (False, False)
        return [counts["SIGTERM"], counts["SIGUSR1"], int(paused), int(finished),
                int(self._still_writing())]

    def _still_writing(self) -> bool:
        return self.writing is not None and not self.writing.future.done()

    @property
    def writing_checkpoint(self) -> bool:
        """A checkpoint's parts are being written or its commit is running: the next one
        waits (one at a time)."""
        return self.writing is not None or self.committing is not None

    # -- checkpoints (CHECKPOINTS in the package docstring)

    def checkpoint(self, background: bool = True) -> None:
        """Write a checkpoint of the whole run with the other shards, or nothing when shard
        0 decides there is nothing new. Collective over the shards: a polled barrier
        (serving meanwhile), bcast, and later a gather.

        The replicas are paused only while the shards fold what is pending and copy their
        state; the files are written after the release, by each shard's writer thread,
        and gathered for the commit once every shard's thread is done (a round says so:
        `poll_rounds`). With `background` False (the final checkpoint, where nobody pushes
        any more, or run.checkpoint_in_background = false) the live arrays are written,
        uncopied, with the replicas still paused, and gathered before this returns."""
        self.pause = Pause(time.monotonic(), background)
        comm = self.comm
        wait_for_everyone(comm, serve=self.shard.serve_once)
        self._settle()
        ours = self.lead.plan_checkpoint() if self.lead is not None else None
        plan = bcast_polled(comm, ours, what="shard 0's checkpoint plan") or {}
        if "meta" not in plan:
            self._end_pause(plan)
            return
        meta = ckpt.CheckpointMeta(**plan["meta"])
        write = self._part_writer(Path(plan["partial"]), meta, copy=background)
        if background:
            self._end_pause(plan)
            self.writing = Writing(meta, self.writer.submit(write), time.monotonic())
            return
        done: Future = Future()  # written here, not serving: the arrays are the live ones
        self.writing = Writing(meta, done, time.monotonic())
        done.set_result(write())
        self._gather_parts(now=True)
        self._end_pause(plan)

    def _settle(self) -> None:
        """Every push counted has completed: fold all of it (poll until nothing is left)."""
        while self.shard.serve_once():
            pass

    def _part_writer(self, partial: Path, meta: ckpt.CheckpointMeta,
                     copy: bool) -> Callable[[], dict[str, Any]]:
        """What writes this shard's part, for the writer thread: it returns {"records":
        [[name, size, sha256], ...]}, {"error": ...} or {"diverged": ...}. With `copy`,
        it writes copies taken now (the shard serves again before it writes); else the
        live arrays, which must not change until it is done. Shard 0's also writes the
        replicas' part (CheckpointLead.replicas_part)."""
        slices = [_slice_part(shard, copy) for shard in [self.shard, *self.adopted]]
        index, self.parts_written = self.parts_written, self.parts_written + 1
        replicas = self.lead.replicas_part(partial, meta) if self.lead is not None else None

        def write() -> dict[str, Any]:
            self.faults.before_checkpoint_write(index)
            records = []
            for shard, params, state, counters in slices:
                if not (_all_finite(params) and all(_all_finite(v) for v in state.values())):
                    return {"diverged": f"shard {shard.rank} holds non-finite values at "
                                        f"step {meta.step}; not checkpointed"}
                report = part_report(partial_call(
                    _write_slice, partial, meta, shard, params, state, counters))
                if "records" not in report:
                    return report
                records += report["records"]
            if replicas is not None:
                theirs = part_report(replicas)
                if "records" not in theirs:
                    return theirs
                records += theirs["records"]
            return {"records": records}

        return write

    def _end_pause(self, plan: dict[str, Any]) -> None:
        """The pause is over (the parts are copied, or written and committed, or nothing
        is written): count it. Shard 0 releases the replicas."""
        pause = self.pause
        pause.ended = time.monotonic()
        self.checkpoint_seconds += pause.ended - pause.began
        if self.lead is not None:
            self.lead.pause_ended(plan, pause)

    def _gather_parts(self, now: bool = False) -> None:
        """Collective over the shards, once every shard's writer is done (or to wait for
        it, `now`): gather the part reports to shard 0, which commits."""
        writing = self.writing
        self._wait_for(writing.future)
        self.writing = None
        self.write_seconds += time.monotonic() - writing.began
        reports = gather_polled(self.comm, writing.future.result(),
                                what="the shards' checkpoint part reports")
        if self.lead is None:
            return
        if now:
            self.lead.committed(self.lead.commit(writing.meta, reports), self.pause)
        else:
            self.committing = self.writer.submit(self.lead.commit, writing.meta, reports)

    def poll_commit(self) -> bool:
        """Shard 0: whether the commit in the writer thread is done; if so, its outcome is
        acted on (CheckpointLead.committed)."""
        if self.committing is None or not self.committing.done():
            return False
        self._committed()
        return True

    def _committed(self) -> None:
        future, self.committing = self.committing, None
        self.lead.committed(future.result(), self.pause)

    def _wait_for(self, future: Future) -> None:
        """Serve (or sleep) until this shard's own `future` is done."""
        backoff = Backoff(*WAIT_SLEEP_S)
        with watchdog.current().waiting("this shard's checkpoint writer"):
            while not future.done():
                if self.shard.serve_once():
                    backoff.reset()
                else:
                    backoff.wait()

    # -- the end

    def finish(self) -> Ending:
        """End the run with the other shards: fold the rest, gather statistics and the
        final slices to shard 0 (which evaluates them), the final checkpoint, and how the
        run ended, as shard 0 says. Collective over the shards; shard 0's supervisor takes
        the same steps with its own between them (Supervisor.finish)."""
        self.gather_results()
        self.final_checkpoint()
        return self.share_ending(None)

    def gather_results(self, into: np.ndarray | None = None, pieces: np.ndarray | None = None
                       ) -> tuple[list | None, np.ndarray | None]:
        """Fold the rest and complete the checkpoint being written, then gather every
        shard's statistics and the final parameter vector to shard 0, into `into` there
        if given; in a row-sharded run (plan.row_pulls) only shard 0's `pieces` of it
        (its evaluation rows), back to back. Collective over the shards; (None, None) on
        the others."""
        self._settle()
        self._surviving(self._finish_writing, self._give_up_writing)
        all_stats = self._surviving(lambda: gather_polled(self.comm, self.stats(),
                                                          what="the shards' statistics"))
        if all_stats is not None:  # shard 0: the slices it adopted, in shard order
            all_stats = sorted(all_stats + [self._adopted_stats(view) for view in self.adopted],
                               key=lambda stats: stats["rank"])
        if self.plan.row_pulls:
            return all_stats, self._surviving(lambda: self._gather_pieces(into, pieces))
        return all_stats, self._surviving(lambda: self._gather_parameters(into))

    def final_checkpoint(self) -> None:
        """The final checkpoint (none if its step is written), then the writer thread
        ends. Collective over the shards."""
        self._surviving(lambda: self.checkpoint(background=False), self._give_up_writing)
        self.writer.shutdown()

    def share_ending(self, ending: Ending | None) -> Ending:
        """Shard 0's `ending` on every shard (its summary on shard 0 only). Collective
        over the shards: bcast."""
        ending = self._surviving(lambda: bcast_polled(self.comm, ending,
                                                      what="how the run ends"))
        if self.comm.Get_rank() != 0:
            ending.summary = None
        return ending

    def _finish_writing(self) -> None:
        """A checkpoint still being written is gathered and committed before the final
        one. Collective over the shards (all of them hold one or none)."""
        if self.writing is not None:
            self._gather_parts(now=True)
        if self.committing is not None:
            self._wait_for(self.committing)
            self._committed()

    def _gather_parameters(self, into: np.ndarray | None) -> np.ndarray | None:
        """The final parameter vector on shard 0, in `into` if given (None elsewhere).
        Collective over the shards: Gatherv of each shard's slice."""
        shard = self.shard
        ranges = [shard.ranges[r] for r in self.members]
        counts = [stop - start for start, stop in ranges]
        displs = [start for start, _ in ranges]
        out = None
        if self.comm.Get_rank() == 0:
            out = into if into is not None else np.zeros(shard.size, dtype=np.float32)
        gatherv_polled(self.comm, shard.parameters(copy=False), out, counts, displs,
                       what="the shards' final slices")
        for view in self.adopted:
            out[view.start : view.stop] = view.parameters()
        return out

    def _gather_pieces(self, into: np.ndarray | None, pieces: np.ndarray | None
                       ) -> np.ndarray | None:
        """Shard 0's `pieces` of the final vector, into `into` there: never the whole
        vector on one rank. Collective over the shards: a bcast of the pieces, then a
        Gatherv of each shard's part of them."""
        shard = self.shard
        plan = PieceMap(bcast_polled(self.comm, pieces, what="the pieces to gather"),
                        shard.ranges)
        mine = np.take(shard.parameters(copy=False), plan.index(shard.rank)).astype(np.float32)
        out = None
        if shard.rank == 0:
            out = into if into is not None else np.zeros(plan.size, dtype=np.float32)
        gatherv_polled(self.comm, mine, out, plan.count[self.members].tolist(),
                       plan.at[self.members].tolist(), what="the shards' final pieces")
        for view in self.adopted:
            np.take(view.parameters(), plan.index(view.rank), out=plan.part(out, view.rank))
        return out

    def _adopted_stats(self, view: Any) -> dict[str, Any]:
        """An adopted slice's entry in the summary's shards: what its segment counts
        (its clients' folds; on shared memory the shard itself folds nothing), and when
        and how its shard was lost."""
        view.stats.pushes, _, view.stats.pulls = view.read_counters()
        view.stats.folds = view.version
        lost = next(s for s in self.run_.lost_shards if s.rank == view.rank)
        return {"role": "shard", "rank": view.rank, "version": view.version,
                "params": view.stop - view.start, "lost": lost.why, "lost_at": lost.at,
                "adopted_by": self.shard.rank, **asdict(view.stats)}

    def stats(self) -> dict[str, Any]:
        shard = self.shard
        stats = {"role": "shard", "rank": shard.rank, "version": shard.version,
                 "params": shard.stop - shard.start,
                 "checkpoint_seconds": self.checkpoint_seconds,
                 "checkpoint_write_seconds": self.write_seconds, **asdict(shard.stats)}
        delays = shard.optimizer.delay_stats()
        if delays is not None:
            # AdaRevision: the folds this shard's optimizer made (every one on RMA; none
            # on shared memory, where each client folds its own pushes).
            stats["adarevision"] = delays
        scaled = shard.optimizer.scaling_stats()
        if scaled is not None:  # optimizer.staleness_scaling: the same folds' rate factors
            stats["staleness_scaling"] = scaled
        return stats


def _slice_part(shard: Any, copy: bool) -> tuple[Any, np.ndarray, dict[str, np.ndarray],
                                                  dict[str, int]]:
    """What a checkpoint writes of one shard's slice (ShardRole._part_writer): the shard,
    its parameters and state (copies taken now with `copy`, else the live arrays) and its
    counters."""
    if copy:
        params, state, _ = shard.checkpoint_state()
    else:
        params, state = shard.parameters(copy=False), saved_state(shard.optimizer)
    counters = {"version": shard.version, "pushes": shard.stats.pushes,
                "folds": shard.stats.folds, "gradients_applied": shard.gradients_applied}
    return shard, params, state, counters


def _write_slice(partial: Path, meta: ckpt.CheckpointMeta, shard: Any, params: np.ndarray,
                 state: dict[str, np.ndarray], counters: dict[str, int]) -> list[Any]:
    return [ckpt.write_shard_part(partial, meta, shard.rank, shard.start, shard.stop, params,
                                  state, counters)]


def _all_finite(values: np.ndarray, block: int = 1 << 20) -> bool:
    """np.isfinite(values).all() in blocks: no slice-sized temporary on a shard."""
    return all(np.isfinite(values[i : i + block]).all() for i in range(0, values.size, block))


def part_report(write: Any) -> dict[str, Any]:
    """Run a part writer; its records, or the CheckpointError's message."""
    try:
        records = write()
    except ckpt.CheckpointError as exc:
        return {"error": str(exc)}
    return {"records": [[r.name, r.size, r.sha256] for r in records]}
