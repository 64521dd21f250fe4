"""Synchronous SGD with backup workers (`optimizer.backup_workers = k >= 1`), after Chen,
Pan, Monga, Bengio and Jozefowicz, "Revisiting Distributed Synchronous SGD"
(arXiv:1604.00981, 2016), section 3: R = N + b replicas compute a gradient for every step;
the parameter server applies the mean of the first N = R - k to arrive, drops the late
ones, and the replicas fetch the new parameters for the next step.

Ranks: world rank 0 is the one parameter-server shard (it holds the whole vector, the
optimizer state, the run folder, the evaluations and the checkpoints); ranks 1..R are the
replicas (replica i is rank i + 1).

Mechanism: point-to-point messages tagged by kind, each carrying the step it belongs to,
all polled (Test / Iprobe with back-off sleeps), never waited on with a spinning call:

    shard -> replica   [step, stop code] (float64) then the parameters of that step
    replica -> shard   [step, epoch, position, rows, loss] (float64) then its gradient
    replica -> shard   a last empty message once it has stopped

Why not the one-sided RMA push path of ps/: an Accumulate cannot be taken back, so the
shard could not keep the first R - k gradients of a step and drop the rest, and the
fetch must wait for the step to be applied anyway; messages give the shard exactly
"first come, first taken" with MPI's ordering between one sender and one receiver, and a
late gradient is simply received and dropped (counted: summary.json "dropped_gradients",
and each metrics.jsonl training line's "dropped"). Every sent parameter vector is a copy
kept until its send completes (a buffer must outlive its non-blocking call).

A replica that fell behind takes the newest parameters waiting for it, skipping older
ones, so a straggler is never more than one step late. A lost replica (its process gone
on this node, or its heartbeat stale on another) is written off: the shard goes on
without it as long as R - lost >= R - k, i.e. up to k replicas may be lost. One more loss
and a step can never gather R - k gradients: the shard writes a checkpoint of the last
complete step, says in one line who was lost and why the run cannot go on, and aborts the
job (non-zero exit). Resuming needs the same number of replicas.
"""

from __future__ import annotations

import math
import sys
import time
from typing import IO, Any

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.common import (
    StopRules,
    StopSignals,
    WireBytes,
    evaluate,
    traffic_summary,
    train_shard,
)
from distbelief.algorithms.session import RunSession, RunSetup
from distbelief.algorithms.sync.allreduce import write_checkpoint
from distbelief.config import Config, build_optimizer
from distbelief.records import checkpoint as ckpt
from distbelief.records.console import say
from distbelief.records.metrics import (
    LOG_EVERY_SECONDS,
    ResumePoint,
    RunRecorder,
)
from distbelief.runtime.backoff import Backoff
from distbelief.runtime.communicators.agreement import wait_all
from distbelief.runtime.health import watchdog
from distbelief.runtime.launching import guardian, launcher
from distbelief.runtime.launching.faults import Faults
from distbelief.runtime.threads import set_blas_threads

TAG_DOWN_HEAD, TAG_PARAMS = 11, 12
TAG_UP_HEAD, TAG_GRAD, TAG_BYE = 21, 22, 23
SHARD = 0
STOP, STOP_AFTER_A_LOSS = 1, 2
"""Stop codes in the shard's header: the second tells the replicas to leave without
MPI_Finalize, which would wait for the dead rank (its heartbeat on another node may not
look stale yet)."""
NOTICE_SLACK_S, NOTICE_DELAY_S = 1.0, 0.5
"""A SIGUSR1 seen no more than NOTICE_SLACK_S after a replica was found gone, or followed
by one found gone within NOTICE_DELAY_S (plus the heartbeat timeout across nodes), is
hydra's notice of a death (`-disable-auto-cleanup`), not a stop request: the values
Downpour and Sandblaster use."""


def train(config: Config, comm: MPI.Comm, stream: IO[str] | None = sys.stdout,
          resume: str = "auto", setup: RunSetup | None = None) -> dict[str, Any] | None:
    """Synchronous SGD with backup workers over `comm` (rank 0 the shard, the others
    replicas); the summary on rank 0, None elsewhere. Collective over `comm`."""

    session = RunSession("sync", config, comm, stream, resume, setup=setup)
    rank, replicas = comm.Get_rank(), comm.Get_size() - 1
    set_blas_threads((config.run.threads or 1) if rank else 1)
    info, network = session.info, session.network
    session.choose_checkpoint(replicas, "synchronous", extra_ranks=1,
                              why=" (their data positions)")
    found = session.start_checkpoint()

    def describe(r: int) -> str:
        return "the parameter-server shard (rank 0)" if r == SHARD else \
            f"replica {r - 1} (rank {r})"

    # A replica that lost its shard: nothing goes on (the session's abort).
    with session.watched(describe) as (signals, peers):
        if rank != SHARD:
            shard = train_shard(config, info, rank - 1, replicas)
            if found is not None and found.has_replica(rank - 1):
                shard.load_state(found.read_replica(rank - 1).data_state)
            lost = _replica_loop(config, comm, network, shard,
                                 session.faults) == STOP_AFTER_A_LOSS
            if lost or peers.gone_among(range(comm.Get_size())):
                guardian.skip_mpi_finalize()  # MPI_Finalize would wait for the dead
            return None
        params = network.init_params(config.run.seed)
        opt = config.optimizer
        optimizer = build_optimizer(config, params.size)
        server = _Server(session, comm, params, optimizer, peers, watchdog.current())
        if found is not None:
            server.restore(found)
        session.describe_run(f"{replicas} replicas + 1 parameter-server shard, "
                             f"backup_workers = {opt.backup_workers} (each step takes the "
                             f"first {server.quorum} gradients), {network.layout.size:,d} "
                             f"parameters", len(server.eval_set[1]))
        return server.run(signals)


# ------------------------------------------------------------------------------------------
# A replica


def _replica_loop(config: Config, comm: MPI.Comm, network: Any, shard: Any,
                  faults: Faults) -> int:
    """Fetch the newest parameters, compute a gradient on the next batch, send it; until
    the shard says stop. Returns the stop code. Point-to-point with the shard only."""
    n = network.layout.size
    params = np.zeros(n, dtype=np.float32)
    grad = np.zeros(n, dtype=np.float32)
    down = np.zeros(2, dtype=np.float64)  # [step, stop code]
    up = np.zeros(5, dtype=np.float64)  # [step, epoch, position, rows, loss]
    sending: list[MPI.Request] = []
    computed = 0
    while True:
        if not _fetch_newest(comm, down, params):
            break
        wait_all(sending, "the shard to take a gradient", [SHARD])  # before reusing buffers
        x, y = shard.next_batch(config.data.batch_size)
        began = time.monotonic()
        loss = network.loss_and_grad(params, x, y, grad)
        computed += 1
        faults.after_step(computed, time.monotonic() - began)  # test-only
        state = shard.state()
        up[:] = down[0], state["epoch"], state["position"], state["n"], loss
        sending = [comm.Isend(up, SHARD, TAG_UP_HEAD), comm.Isend(grad, SHARD, TAG_GRAD)]
    # How many gradients it sent: the shard takes them all before it lets go of it (MPI
    # does not order this message after them, as its tag differs).
    sending.append(comm.Isend(np.array([computed], dtype=np.float64), SHARD, TAG_BYE))
    wait_all(sending, "the shard to take the last messages", [SHARD])
    return int(down[1])


def _fetch_newest(comm: MPI.Comm, down: np.ndarray, params: np.ndarray) -> bool:
    """Receive the shard's next header and parameters, then any newer ones already
    waiting (a replica that fell behind skips to the newest); False once told to stop."""
    wait_all([comm.Irecv(down, SHARD, TAG_DOWN_HEAD)], "the parameters from the shard",
             [SHARD])
    while True:
        if down[1]:
            return False
        wait_all([comm.Irecv(params, SHARD, TAG_PARAMS)], "the parameters from the shard",
                 [SHARD])
        if not comm.Iprobe(SHARD, TAG_DOWN_HEAD):
            return True
        comm.Recv(down, SHARD, TAG_DOWN_HEAD)  # already here: no wait


# ------------------------------------------------------------------------------------------
# The parameter-server shard


MAX_PARAMS_IN_FLIGHT = 2
"""Parameter sends to one replica not yet received at most: a replica that is alive but
frozen (stopped, swapping) must not make the shard keep a 2.7 MB copy per step for it."""


class _Server:
    """The shard: takes the first R - k gradients of each step, applies their mean, sends
    the parameters out, drops the late gradients; evaluates, logs and checkpoints."""

    def __init__(self, session: RunSession, comm: MPI.Comm, params: np.ndarray,
                 optimizer: Any, peers: Any, guard: watchdog.Watchdog):
        config = session.config
        self.session, self.config, self.comm, self.network = (session, config, comm,
                                                              session.network)
        self.params, self.optimizer, self.peers, self.guard = params, optimizer, peers, guard
        self.stream = session.stream
        self.replicas = comm.Get_size() - 1
        self.k = config.optimizer.backup_workers
        self.quorum = self.replicas - self.k
        self.live = set(range(1, self.replicas + 1))
        self.lost: dict[int, int] = {}  # rank -> step at which it was found gone
        self.state = {"step": 0, "samples": 0}
        self.dropped = 0
        self.data_states: dict[int, dict] = {}  # replica index -> its last data position
        self.sending: list[tuple[MPI.Request, np.ndarray]] = []
        self.params_in_flight: dict[int, list[MPI.Request]] = {}  # rank -> its sends
        self.resume_point: ResumePoint | None = None
        self.last_path: str | None = None
        self.last_saved: int | None = None
        self.recorder: RunRecorder | None = None
        self.received: dict[int, int] = {}  # rank -> gradients received from it
        # rank -> that replica's bytes, counted here where the messages are sent and
        # received: what it sent is what this shard received from it, and the reverse.
        self.wire = {rank: WireBytes() for rank in self.live}
        self.notices = launcher.sends_death_notices()  # else every SIGUSR1 is a stop
        self.usr1_seen, self.usr1_first = 0, None  # SIGUSR1s counted, a new one's sight
        self.last_death = -math.inf
        self.notice_delay = NOTICE_DELAY_S + (
            config.run.heartbeat_timeout_seconds if peers.heartbeats is not None else 0.0)
        self.eval_set = session.load_eval_set()

    def restore(self, found: ckpt.Checkpoint) -> None:
        saved, optimizer_state = found.read_state()
        np.copyto(self.params, saved)
        try:
            self.optimizer.load_state(optimizer_state)
        except (ValueError, TypeError) as exc:
            raise ckpt.CheckpointError(f"checkpoint {found.path} cannot be resumed here: "
                                       f"{exc}") from exc
        for index in range(self.replicas):
            if found.has_replica(index):
                self.data_states[index] = found.read_replica(index).data_state
        self.state = {"step": found.step, "samples": found.samples}
        self.last_saved = found.step
        self.resume_point = ResumePoint(found.step, found.samples, found.wall_seconds,
                                        found.path.name)

    # -- the loop

    def run(self, signals: StopSignals) -> dict[str, Any]:
        config = self.config
        run, rules = config.run, StopRules.from_config(config)
        self.recorder = recorder = self.session.open_recorder(self.resume_point)
        n, batch = self.params.size, config.data.batch_size
        total, incoming = np.zeros(n, dtype=np.float32), np.zeros(n, dtype=np.float32)
        head = np.zeros(5, dtype=np.float64)
        now = time.monotonic()
        next_log, next_eval = now + LOG_EVERY_SECONDS, now + run.eval_every_seconds
        save_every_s = run.checkpoint_every_seconds or math.inf
        next_save = now + save_every_s
        loss_sum, loss_count, recent, dropped_logged = 0.0, 0, math.nan, 0
        reason = rules.budget_spent(self.state["step"], recorder.elapsed())
        if not reason:
            self._send_params(stop=0)
        while not reason:
            total[:] = 0
            taken, step_loss = 0, 0.0
            backoff = Backoff(min_sleep_s=20e-6, max_sleep_s=1e-3)
            next_check = time.monotonic()
            with self.guard.waiting("gradients from the replicas"):
                while taken < self.quorum:
                    source = self._receive(head, incoming)
                    if source is None:
                        if time.monotonic() >= next_check:
                            self._find_lost()
                            next_check = time.monotonic() + watchdog.CHECK_S
                        self._prune_sends()
                        backoff.wait()
                        continue
                    backoff.reset()
                    if int(head[0]) == self.state["step"]:
                        total += incoming
                        taken, step_loss = taken + 1, step_loss + float(head[4])
                    else:
                        self.dropped += 1
            loss = step_loss / taken
            if not math.isfinite(loss):
                self._stop_replicas()
                raise self.session.diverged(f"{loss} at step {self.state['step'] + 1}")
            total *= np.float32(1.0 / taken)
            self.optimizer.step(self.params, total, update=self.state["step"])
            self.state["step"] += 1
            self.state["samples"] += batch * taken
            step, samples = self.state["step"], self.state["samples"]
            loss_sum, loss_count = loss_sum + loss, loss_count + 1
            now = time.monotonic()
            reason = (rules.budget_spent(step, recorder.elapsed(), recorder.collapsed)
                      or self._signal(signals))
            if not reason:  # the replicas compute the next step while this rank logs,
                self._send_params(stop=0)  # evaluates and checkpoints
            if now >= next_log or reason:
                recent, loss_sum, loss_count = loss_sum / loss_count, 0.0, 0
                recorder.log(step, samples, recent, dropped=self.dropped - dropped_logged,
                             learning_rate=self.optimizer.rate(step - 1))
                dropped_logged = self.dropped
                next_log = now + LOG_EVERY_SECONDS
            recorder.progress(step, samples, recent)
            if reason:
                break
            if now >= next_eval:
                result = evaluate(self.network, self.params, self.eval_set)
                recorder.log_eval(step, samples, recent, result, params=self.params)
                if rules.target_reached(result):
                    reason = rules.target_reason
                    break
                next_eval = time.monotonic() + run.eval_every_seconds
            every = run.checkpoint_every_steps
            if now >= next_save or (every and step % every == 0):
                self.checkpoint()
                next_save = time.monotonic() + save_every_s
        self._stop_replicas()
        if reason not in StopSignals.NAMES and reason != rules.target_reason:
            recorder.log_eval(self.state["step"], self.state["samples"], recent,
                              evaluate(self.network, self.params, self.eval_set),
                              params=self.params)
        self.checkpoint()
        if self.lost:
            guardian.skip_mpi_finalize()  # MPI_Finalize would wait for the dead
        return self.session.finish(reason, {
            "replicas": self.replicas, "backup_workers": self.k,
            "dropped_gradients": self.dropped,
            **traffic_summary([self.wire[rank].pair() for rank in sorted(self.wire)]),
            "lost_replicas": [{"replica": r - 1, "ranks": [r], "step": s, "why": self._why(r)}
                              for r, s in sorted(self.lost.items())]}, self.last_path,
            note=f"; {self.dropped:,d} late gradients dropped, {len(self.lost)} replica(s) "
                 f"lost")

    def _signal(self, signals: StopSignals) -> str | None:
        """The signal that stops the run, if one arrived: a SIGTERM or Ctrl-C at once; a
        SIGUSR1 unless it is the launcher's notice of a replica's death."""
        if signals.counts["SIGTERM"]:
            return signals.received if signals.received == "SIGINT" else "SIGTERM"
        if not signals.counts["SIGUSR1"]:
            return None
        now = time.monotonic()
        if not self.notices:
            return "SIGUSR1"
        if signals.counts["SIGUSR1"] > self.usr1_seen:
            self.usr1_seen = signals.counts["SIGUSR1"]
            self.usr1_first = self.usr1_first or now
        if self.usr1_first is None:
            return None
        self._find_lost()
        if abs(self.usr1_first - self.last_death) <= NOTICE_SLACK_S + self.notice_delay:
            self.usr1_first = None  # a death notice
            return None
        if now - self.usr1_first >= self.notice_delay:
            return "SIGUSR1"
        return None

    # -- messages

    def _send_params(self, stop: int) -> None:
        """The current step's parameters (or a stop) to every live replica; a copy kept
        until each send completes. A replica with MAX_PARAMS_IN_FLIGHT sends not yet
        received (frozen, or far behind) is skipped this step: it takes the newest it has
        when it catches up, and the copies kept for it stay bounded."""
        head = np.array([self.state["step"], stop], dtype=np.float64)
        snapshot = None if stop else self.params.copy()
        for rank in sorted(self.live):
            if snapshot is not None:
                pending = [r for r in self.params_in_flight.get(rank, []) if not r.Test()]
                self.params_in_flight[rank] = pending
                if len(pending) >= MAX_PARAMS_IN_FLIGHT:
                    continue
            self.sending.append((self.comm.Isend(head, rank, TAG_DOWN_HEAD), head))
            self.wire[rank].add(received=head.nbytes)
            if snapshot is not None:
                self.wire[rank].add(received=snapshot.nbytes)
                request = self.comm.Isend(snapshot, rank, TAG_PARAMS)
                self.sending.append((request, snapshot))
                self.params_in_flight[rank].append(request)

    def _prune_sends(self) -> None:
        self.sending = [(r, b) for r, b in self.sending if not r.Test()]

    def _receive(self, head: np.ndarray, grad: np.ndarray) -> int | None:
        """One gradient from any replica, if one has arrived: its rank, with its header in
        `head` and the gradient in `grad`; None if none is waiting."""
        status = MPI.Status()
        if not self.comm.Iprobe(MPI.ANY_SOURCE, TAG_UP_HEAD, status):
            return None
        source = status.Get_source()
        self.comm.Recv(head, source, TAG_UP_HEAD)
        try:
            wait_all([self.comm.Irecv(grad, source, TAG_GRAD)], "a gradient", [source])
        except watchdog.RankLost:  # it died between the two messages
            self._lose(source)
            self._check_quorum()
            return None
        self.received[source] = self.received.get(source, 0) + 1
        self.wire[source].add(sent=head.nbytes + grad.nbytes)
        self.data_states[source - 1] = {
            "seed": self.config.run.seed, "rank": source - 1, "num_ranks": self.replicas,
            "n": int(head[3]), "epoch": int(head[1]), "position": int(head[2])}
        return source

    def _find_lost(self) -> None:
        """Write off the replicas whose process is gone; stop the job if too few remain."""
        for rank in sorted(self.live):
            if self.peers.gone(rank):
                self._lose(rank)
        self._check_quorum()

    def _lose(self, rank: int) -> None:
        """Go on without replica rank `rank`: no more parameters to it, no wait on it."""
        if rank not in self.live:
            return
        self.live.discard(rank)
        self.lost[rank] = self.state["step"]
        self.last_death = time.monotonic()
        self.guard.write_off([rank])
        self.recorder.log_event("replica_lost", self.state["step"],
                                self.state["samples"], replica=rank - 1, ranks=[rank],
                                why=self._why(rank))
        say(self.stream, f"distbelief: replica {rank - 1} (rank {rank}) lost at "
                         f"step {self.state['step']}; going on with "
                         f"{len(self.live)} replicas (each step takes the first "
                         f"{self.quorum} gradients)")

    def _check_quorum(self) -> None:
        """If fewer than R - k replicas are left, no step can complete: checkpoint, say so in
        one line and end the job."""
        if len(self.live) < self.quorum:
            self.checkpoint()
            lost = ", ".join(f"replica {r - 1} (rank {r})" for r in sorted(self.lost))
            watchdog.abort_and_leave(self.comm, (
                f"{len(self.lost)} replicas lost ({lost}), more than optimizer.backup_workers"
                f" = {self.k}: each step needs R - k = {self.quorum} gradients and only "
                f"{len(self.live)} replica(s) are left, so algorithm = \"sync\" cannot go "
                f"on. Raise backup_workers, or use algorithm = \"downpour\"; the last "
                f"checkpoint is at step {self.state['step']}"))

    def _why(self, rank: int) -> str:
        how = self.peers.how_gone(rank)
        return f"rank {rank} is gone{how}" if how else f"the process of rank {rank} is gone"

    def _stop_replicas(self) -> None:
        """Tell every live replica to stop and take what they still send, until each has
        said goodbye or is gone. Late gradients among them are counted as dropped."""
        self._send_params(stop=STOP_AFTER_A_LOSS if self.lost else STOP)
        head = np.zeros(5, dtype=np.float64)
        grad = np.zeros(self.params.size, dtype=np.float32)
        bye = np.zeros(1, dtype=np.float64)
        sent: dict[int, int] = {}  # rank -> gradients it says it sent
        waiting = set(self.live)
        backoff = Backoff(min_sleep_s=20e-6, max_sleep_s=1e-3)
        with self.guard.waiting("the replicas to stop"):
            while waiting:
                status = MPI.Status()
                if self.comm.Iprobe(MPI.ANY_SOURCE, TAG_BYE, status):
                    self.comm.Recv(bye, status.Get_source(), TAG_BYE)
                    sent[status.Get_source()] = int(bye[0])
                source = self._receive(head, grad)
                if source is not None and int(head[0]) < self.state["step"]:
                    self.dropped += 1
                waiting -= {r for r, count in sent.items()
                            if self.received.get(r, 0) >= count}
                if source is not None:
                    continue
                for rank in sorted(waiting):
                    # A replica that said goodbye may have left before its goodbye was
                    # read, and one probe may not bring it in (CI, under load: a finished
                    # replica was written off beside the killed one). It is lost only if
                    # nothing of its own arrives for watchdog.DRAIN_S.
                    if self.peers.gone(rank) and not watchdog.drained(
                            lambda rank=rank: self.comm.Iprobe(rank, MPI.ANY_TAG)):
                        waiting.discard(rank)
                        if rank not in sent:
                            self.lost.setdefault(rank, self.state["step"])
                self._prune_sends()
                backoff.wait()
        self.sending = [(r, b) for r, b in self.sending if not r.Test()]

    def checkpoint(self) -> None:
        """Commit a checkpoint of the current step (the shard holds everything but the
        replicas' data positions, which came with their gradients). No communication."""
        if self.state["step"] == self.last_saved or self.recorder is None:
            return
        began = time.monotonic()
        wall = self.recorder.elapsed()
        lost = tuple(r - 1 for r in self.lost)
        states = {i: s for i, s in self.data_states.items() if i not in lost}
        path = write_checkpoint(self.config, self.network.layout, self.params,
                                self.optimizer, states, self.state, wall, self.replicas,
                                lost=tuple(i for i in range(self.replicas)
                                           if i not in states))
        seconds = time.monotonic() - began
        self.last_saved, self.last_path = self.state["step"], str(path)
        self.recorder.log_event("checkpoint", self.state["step"], self.state["samples"],
                                at=wall, seconds=seconds, path=path.name)
        say(self.stream, f"checkpoint {path} ({seconds:.2f}s)")
