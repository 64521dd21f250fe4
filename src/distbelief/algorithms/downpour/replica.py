"""Downpour's replicas: Replica (train, fetch, push, follow shard 0's commands; one-sided
only) and PartitionedReplica (one partition of a model-parallel replica); variant.py's
make_replica picks between them and row_replica's RowReplica. REPLICAS, RUN CONTROL and END OF THE RUN in the package
docstring say what they do.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.common import apply_step
from distbelief.algorithms.downpour.clocks import FETCH, WAIT, ReplicaClock
from distbelief.algorithms.downpour.plan import (
    BOUND_POLL_S,
    LEAVING_TAG,
    PAUSE_POLL_S,
    SPARE_POLL_S,
    STATS_TAG,
    WARM_START_POLL_S,
    Ending,
    grant,
    shard0_backoff,
)
from distbelief.algorithms.downpour.run import OpenRun
from distbelief.model.partitioned_network import PartitionedNetwork
from distbelief.ps import run_control as rc
from distbelief.ps.run_control import ControlExchange
from distbelief.ps.stats import StalenessStats
from distbelief.runtime import memory
from distbelief.runtime.backoff import Backoff
from distbelief.runtime.communicators.agreement import polled_bcast, wait_all
from distbelief.runtime.health import watchdog
from distbelief.runtime.health.watchdog import RankLost
from distbelief.runtime.launching.faults import step_faults

# ------------------------------------------------------------------------------------------
# Replicas


@dataclass
class ReplicaStats:
    """What one replica did. Times are wall seconds; `train_seconds` runs from its first
    claim to its finish (warm-start waiting excluded), `rma_seconds` is the part of it
    spent in pushes and pulls. `bytes_sent` and `bytes_received`: the gradient data its
    pushes moved to the shards and the parameter data its fetches moved back, over the
    transport (ps.rma_client's BYTES; the names every algorithm reports, issue 33)."""

    replica: int
    rank: int
    steps: int = 0
    samples: int = 0
    pushes: int = 0
    fetches: int = 0
    train_seconds: float = 0.0
    rma_seconds: float = 0.0
    wait_seconds: float = 0.0
    refetches: int = 0
    bad_gradients: int = 0
    started_at_step: int = 0
    checkpoint_seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    staleness: StalenessStats = field(default_factory=StalenessStats)
    clock_bound: dict[str, Any] | None = None  # optimizer.max_staleness: ReplicaClock's
    # cluster.spare_replicas (downpour.spares): a spare's; the times are time.time()
    spare: bool = False
    replaced: int | None = None  # the training replica whose part it took over
    took_over_at: float | None = None  # when it had opened that part
    first_push_at: float | None = None  # when its first push had completed
    spare_wait_seconds: float = 0.0  # waiting for a part, wall
    spare_wait_cpu_seconds: float = 0.0  # and the process's CPU meanwhile (every thread)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["staleness"] = self.staleness.to_dict()
        out["samples_per_second"] = (self.samples / self.train_seconds
                                     if self.train_seconds > 0 else None)
        return out


# What the lead tells its partitions after each exchange (model parallelism; a replica of
# one rank tells only itself).
GO, PAUSE, STOP, LOST = range(4)


class Replica:
    """One model replica: train on its part of the data, fetch every n_fetch steps, push
    the accumulated gradient every n_push steps, and follow shard 0's commands. All its
    communication is one-sided, with the shards (pull, push, push_pull, exchange), plus
    one message with its statistics to rank 0 at the end; it never waits for another
    replica, but under optimizer.max_staleness for the slowest to come within the bound
    (`_within_bound`; downpour.clocks). With model parallelism its lead partition
    exchanges with shard 0 and tells the others (`_share_values`; PartitionedReplica)."""

    lead = True  # this rank talks to shard 0 for its replica

    def __init__(self, run: OpenRun, network: Any, fetch: str = "own_pushes"):
        plan, client = run.plan, run.endpoint
        self.run_, self.plan, self.client, self.network = run, plan, client, network
        self.data, self.base = run.local, run.start.base
        self.fetch = fetch  # options.FETCHES: what a fetch waits for
        self.fetch_own_pushes = fetch == "own_pushes"
        topology = plan.topology
        self.index = topology.replica_index
        self.spare = topology.is_spare  # waits for a lost replica's part (downpour.spares)
        self.stats_ = ReplicaStats(self.index, topology.world_rank, staleness=client.staleness,
                                   spare=self.spare)
        self.params = np.zeros(network.layout.size, dtype=np.float32)
        self.grad = np.zeros_like(self.params)
        # With n_push = 1 the step's gradient is pushed as it is; otherwise summed here.
        self.pushed = self.grad if plan.n_push == 1 else np.zeros_like(self.params)
        if fetch == "overlapped":  # a second of each: one is in flight while one is used
            self._spare_params = np.zeros_like(self.params)
            self._spare_grad = np.zeros_like(self.params)
            self._spare_pushed = self._spare_grad if plan.n_push == 1 else np.zeros_like(
                self.params)
        # optimizer.max_staleness (downpour.clocks): on every partition, the lead's counts
        self.clock = None if plan.max_staleness is None else ReplicaClock(
            plan.max_staleness,
            None if plan.joins_late(self.index, self.base) or self.spare else 0)
        self.control = ControlExchange(self.index if self.lead else None,
                                       bounded=self.clock is not None, spare=self.spare)
        self.t = run.start.local_steps  # local steps done (a resumed replica goes on)
        self.fresh = False  # params were fetched at the last push (push_pull)
        self.stopping = False
        self.lost = False
        self.acked = 0  # the last checkpoint request this replica paused for
        self.bad_in_a_row = 0
        self.faults = run.session.faults  # test-only (runtime.launching.faults)
        self.injected = step_faults(self.faults, self.client)  # a no-op without faults

    # -- the loop

    def run(self) -> None:
        t0 = time.perf_counter()
        start = t0
        try:
            if self.spare:
                self._wait_as_spare()
                self.stopping = self.stopping or self.spare  # no part given: nothing to train
            if self.index > 0 and self.plan.warm_start_steps > 0 and not self.stopping:
                self._wait_for_warm_start()
            start = time.perf_counter()
            self.stats_.wait_seconds = start - t0
            granted = 0 if self.stopping else self._first_claim()
            while granted and not self.stopping:
                if self.clock is not None and not self._within_bound():
                    break
                granted = self._train_block(granted)
        except RankLost as lost:
            self._abandon(lost)
        self.stats_.train_seconds = time.perf_counter() - start

    def _abandon(self, lost: RankLost) -> None:
        """Another partition of this replica is gone: the replica is lost. The lead says so
        (shard 0 may be on another node than the dead rank) and goes quiet. A lost shard
        ends the job (raised on)."""
        if lost.rank < self.plan.topology.ps_shards:
            raise lost
        self.lost = self.stopping = True
        memory.written_off()  # nobody waits for its peak memory at the end
        if self.lead:
            self.client.exchange(self.control.publish(abandoned=1).set(claim=0))

    def _wait_for_warm_start(self) -> None:
        """Poll shard 0 (control only, with back-off sleeps) until replica 0 has reported
        warm_start_steps steps, or the run is over already."""
        plan = self.plan
        backoff = shard0_backoff(WARM_START_POLL_S, plan.num_replicas)
        while not self.stopping:
            over = False
            if self.lead:
                control = self._exchange(self.control.set(claim=0))
                over = bool(plan.max_steps and self.base + control.claimed_before
                            >= plan.max_steps) or control.warm
                over = over or self.base + control.steps_before >= plan.warm_start_steps
            over, _ = self._decide(int(over))
            if over:
                return
            backoff.wait()

    def _wait_as_spare(self) -> None:
        """A spare (downpour.spares): poll shard 0 (control only, with back-off sleeps,
        pausing for checkpoints like a replica) until it gives this spare a lost replica's
        part, then open the part where shard 0 says; or until the run is over."""
        plan = self.plan
        backoff = shard0_backoff(SPARE_POLL_S, plan.num_groups)
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            self._poll_as_spare(backoff)
        finally:
            self.stats_.spare_wait_seconds = time.perf_counter() - wall
            self.stats_.spare_wait_cpu_seconds = time.process_time() - cpu

    def _poll_as_spare(self, backoff: Any) -> None:
        plan = self.plan
        while not self.stopping:
            over, start = 0, np.array([-1, 0, 0, 0], dtype=np.int64)
            if self.lead:
                control = self._exchange(self.control.set(claim=0))
                over = int(bool(plan.max_steps and self.base + control.claimed_before
                                >= plan.max_steps))
                if control.takes_over is not None and not over and not control.lost:
                    self._exchange(control.set(claim=0))  # its FROM_* slots, complete now
                    start[:] = control.takes_over, *control.takeover_start
            part, epoch, position, steps = (int(v) for v in self._share_values(start))
            if part >= 0:
                self._take_over(part, epoch, position, steps)
            over, _ = self._decide(over)
            if over or part >= 0:
                return
            backoff.wait()

    def _take_over(self, part: int, epoch: int, position: int, steps: int) -> None:
        """Open training replica `part`'s part of the data at (epoch, position), go on
        from its local `steps`, and tell shard 0 (SERVING, with the position) on the
        lead. The first claim then fetches fresh parameters."""
        data = self.run_.session.train_shard(part, self.plan.num_replicas)
        data.load_state({**data.state(), "epoch": epoch, "position": position})
        self.data, self.t = data, steps
        self.spare = self.control.spare = False
        self.stats_.replaced = part
        self.stats_.took_over_at = time.time()
        if self.lead:
            self._publish_position(serving=part + 1)

    def _first_claim(self) -> int:
        """Claim the first n_push steps and fetch the parameters (under the staleness
        bound, the gate fetches them)."""
        t0 = time.perf_counter()
        if self.lead:
            self._exchange(self.control.set(claim=self.plan.n_push))
            self.stats_.started_at_step = self.base + self.control.steps_before
        if self.clock is None:
            self.client.pull(self.params)
            self.stats_.fetches += 1
            self.fresh = True
        self.stats_.rma_seconds += time.perf_counter() - t0
        return self._granted_after_exchange()

    def _within_bound(self) -> bool:
        """optimizer.max_staleness, before a block (downpour.clocks, THE GATE): poll
        shard 0 until the slowest live replica is within the bound, and fetch if the
        parameters held were fetched before it was. The lead decides, every partition
        follows; checkpoints pause it as any exchange does. False if the replica stopped
        while it waited."""
        clock, control = self.clock, self.control
        t0, paused = time.perf_counter(), self.stats_.checkpoint_seconds
        backoff = shard0_backoff(BOUND_POLL_S, self.plan.num_replicas)
        guard = watchdog.current()
        waited = False
        with guard.waiting("the slowest replica to come within optimizer.max_staleness",
                           (0,)):
            while True:
                answer = clock.gate(control.min_clock, control.joined_at) if self.lead else WAIT
                answer, action = self._decide(answer)
                if action != GO:
                    return False
                if answer != WAIT:
                    break
                waited = True
                guard.check()
                backoff.wait()
                if self.lead:
                    self._exchange(control.set(claim=0))
                    guard.progress()  # shard 0 answers: the slowest replica is simply behind
        waited_s = (time.perf_counter() - t0 - (self.stats_.checkpoint_seconds - paused)
                    if waited else 0.0)
        if answer == FETCH:
            self._pull()
            self.fresh = True
        if self.lead:
            clock.started(control.min_clock, waited_s)
        return True

    def _train_block(self, steps: int) -> int:
        """Compute `steps` granted steps (fetching on schedule), then push them with the
        next claim; returns the steps that claim was granted."""
        plan, loss_sum, done = self.plan, 0.0, 0
        while done < steps and not self.stopping:
            if self.t % plan.n_fetch == 0 and not self.fresh:
                self._pull()
            self.fresh = False
            loss, started = self._compute_step()
            done += 1
            if self._usable(loss):
                if self.pushed is not self.grad:
                    self.pushed += self.grad
            else:
                self._drop()
            if math.isfinite(loss):
                loss_sum += loss
            self.injected.after_step(self.t, started)
        self._push(self.control.set(plan.n_push, done, loss_sum))
        self.stats_.steps += done
        self.stats_.samples += done * plan.batch_size
        return self._granted_after_exchange()

    def _train_locally(self, steps: int, exchange: Callable[[Any], None]) -> int:
        """Compute `steps` granted steps, each applied here by `self.local_optimizer` (a
        replica with an optimizer of its own: EASGD, DiLoCo), then `exchange` the block
        with the next claim's control; returns the steps that claim was granted."""
        loss_sum, done = 0.0, 0
        while done < steps and not self.stopping:
            loss, started = self._compute_step()
            done += 1
            if self._usable(loss):
                apply_step(self.local_optimizer, self.network, self.params, self.grad,
                           self.t - 1)
            else:
                self._drop()  # a non-finite gradient is not applied (counted, as Downpour)
            if math.isfinite(loss):
                loss_sum += loss
            self.injected.after_step(self.t, started)
        exchange(self.control.set(self.plan.n_push, done, loss_sum))
        if self.stats_.first_push_at is None:
            self.stats_.first_push_at = time.time()
        self.stats_.steps += done
        self.stats_.samples += done * self.plan.batch_size
        return self._granted_after_exchange()

    def _compute_step(self) -> tuple[float, float]:
        """One step: the next batch's gradient into self.grad; (its loss, the time the step
        began)."""
        started = time.perf_counter()
        x, y = self.data.next_batch(self.plan.batch_size)
        loss = self.network.loss_and_grad(self.params, x, y, self.grad)
        self.t += 1
        self.injected.after_gradient(self.t, self.grad)
        return loss, started

    def _granted_after_exchange(self) -> int:
        """After an exchange: the steps granted, once shard 0's commands are obeyed (0 when
        the replica stops)."""
        granted = 0
        if self.lead:
            granted = grant(self.base + self.control.claimed_before, self.plan.n_push,
                            self.plan.max_steps)
        granted, action = self._decide(granted)
        return granted if action == GO else 0

    def _decide(self, value: int) -> tuple[int, int]:
        """The lead's `value` and its reading of its last exchange, on every partition of
        the replica; pauses for checkpoints (as often as asked) are taken here, together.
        Returns (value, GO, STOP or LOST); STOP and LOST also stop the replica."""
        while True:
            action, arg = self._command() if self.lead else (GO, 0)
            value, action, arg = (int(v) for v in
                                  self._share_values(np.array([value, action, arg])))
            if action != PAUSE:
                break
            self._pause(arg)
        if action in (STOP, LOST):
            self.stopping = True
            self.lost = self.lost or action == LOST
        return value, action

    def _command(self) -> tuple[int, int]:
        """What the lead's last exchange asks of the replica."""
        control = self.control
        if control.lost:
            return LOST, 0
        if control.checkpoint > self.acked:
            return PAUSE, control.checkpoint
        if control.stop or self.stopping:
            return STOP, 0
        return GO, 0

    def _pause(self, request: int) -> None:
        """Checkpoint `request`: publish this replica's position (every step it computed is
        pushed) and wait, polling the block, until shard 0 has written the checkpoint or
        the run stops. Partitions other than the lead wait at their next `_share_values`."""
        self.acked = request
        t0 = time.perf_counter()
        self._settle_pushes()
        if self.lead:
            control = self._publish_position(acked=request)
            backoff = shard0_backoff(PAUSE_POLL_S, self.plan.num_replicas)
            guard = watchdog.current()
            with guard.waiting("shard 0 to write a checkpoint", (0,)):
                while control.release < request and not control.stop and not control.lost:
                    guard.check()
                    backoff.wait()
                    self._exchange(control.set(claim=0))
                    guard.progress()  # shard 0 answers: only the checkpoint takes time
        self.stats_.checkpoint_seconds += time.perf_counter() - t0

    def _publish_position(self, **more: int) -> ControlExchange:
        """Publish the data position and local steps (with `more`), in one exchange; a
        spare that trains no part has none (only `more`)."""
        if self.data is None:
            self.control.publish(**more)
            return self._exchange(self.control.set(claim=0))
        state = self.data.state()
        self.control.publish(epoch=state["epoch"], position=state["position"],
                             local_steps=self.t, **more)
        return self._exchange(self.control.set(claim=0))

    # -- sharing with the other partitions (PartitionedReplica overrides)

    def _share_values(self, values: np.ndarray) -> np.ndarray:
        """The lead's int64 `values` on every partition of the replica."""
        return values

    # -- steps

    def _usable(self, loss: float) -> bool:
        """Whether this step's loss and gradient are finite. One BLAS pass (a dot product
        of the gradient with itself: a NaN or inf anywhere, or an element whose square
        overflows float32, which would make Adagrad's accumulator infinite, gives a
        non-finite result)."""
        if math.isfinite(loss) and math.isfinite(float(np.dot(self.grad, self.grad))):
            self.bad_in_a_row = 0
            return True
        return False

    def _drop(self) -> None:
        """Count a non-finite gradient and keep it out of the push; after
        max_bad_gradients in a row, give up: the next exchange tells shard 0."""
        self.stats_.bad_gradients += 1
        self.bad_in_a_row += 1
        if self.pushed is self.grad:
            self.grad.fill(0)  # n_push = 1: the block pushes nothing
        if self.bad_in_a_row >= self.plan.max_bad_gradients:
            self.stopping = True
            self.control.publish(gave_up=1)

    def _pull(self) -> None:
        t0 = time.perf_counter()
        if self.fetch == "overlapped" and self.client.pull_in_flight:
            # The pull issued with the last push is this fetch, counted when issued.
            self._settle_pushes()
        else:
            self.client.pull(self.params)
            self._catch_up()
            self.stats_.fetches += 1
            if self.clock is not None and self.lead:  # after the last exchange's read
                self.clock.fetched(self.control.min_clock)
        self.stats_.rma_seconds += time.perf_counter() - t0

    def _catch_up(self) -> None:
        """Read-your-writes (see train's fetch_own_pushes): pull again until the
        parameters hold this replica's last push."""
        if self.fetch_own_pushes:
            self.stats_.refetches += self.client.catch_up(self.params)

    def _push(self, control: ControlExchange) -> None:
        """Push the gradient with the control exchange (the lead's); fetch in the same
        epochs when the next step is due to fetch."""
        if self.clock is not None:
            self._push_counted(control)
            return
        t0 = time.perf_counter()
        control = self._before_exchange(control) if self.lead else None
        fetch = self.t % self.plan.n_fetch == 0
        if self.fetch == "overlapped":
            self._push_overlapped(control, fetch)
        elif not fetch:
            self.client.push(self.pushed, control)
        else:
            if self.fetch_own_pushes:
                self.stats_.refetches += self.client.push_pull_own(self.pushed, self.params,
                                                                   control)[1]
            else:
                self.client.push_pull(self.pushed, self.params, control)
            self.stats_.fetches += 1
            self.fresh = True
        self.stats_.rma_seconds += time.perf_counter() - t0
        self._pushed()

    def _pushed(self) -> None:
        """Count a push (and note when the first one had completed)."""
        self.stats_.pushes += 1
        if self.stats_.first_push_at is None:
            self.stats_.first_push_at = time.time()
        if self.pushed is not self.grad:
            self.pushed.fill(0)

    def _push_counted(self, control: ControlExchange) -> None:
        """optimizer.max_staleness (downpour.clocks, CLOCKS): push, wait until every shard
        has applied the push (on every partition), then the control exchange, whose clock
        counts it. The fetch due at the next step rides on the push (read-your-writes, and
        on shared memory one pass with the fold) when the lowest clock last read already
        lets the next block compute on it; else the gate fetches, after its own read."""
        t0 = time.perf_counter()
        clock = self.clock
        if (self.lead and self.t % self.plan.n_fetch == 0
                and self.control.min_clock >= clock.clock + 1 - clock.bound):
            min_clock = self.control.min_clock  # read before this fetch
            self.stats_.refetches += self.client.push_pull_own(self.pushed, self.params)[1]
            self.stats_.fetches += 1
            self.fresh = True
            clock.fetched(min_clock)
        else:
            self.client.push(self.pushed)
            self.client.wait_applied()
        self._agree_applied()
        if self.lead:
            clock.pushes += 1
            self._exchange(control.publish(clock=clock.pushes))
        self.stats_.rma_seconds += time.perf_counter() - t0
        self._pushed()

    def _agree_applied(self) -> None:
        """Every partition's push is applied (PartitionedReplica); one rank: nothing."""

    def _push_overlapped(self, control: ControlExchange | None, fetch: bool) -> None:
        """fetch = "overlapped": push (and fetch) with the transfers left in flight until
        the next push; the next steps compute on the last fetch that completed. The pull
        in flight always lands in _spare_params, adopted when it completes; the gradient
        in flight stays untouched, the next one goes to the other buffer."""
        target = None
        if fetch:
            target = self.params if self.client.pull_in_flight else self._spare_params
        _, completed = self.client.push_pull_overlapped(self.pushed, target, control)
        if completed:
            self.params, self._spare_params = self._spare_params, self.params
        if fetch:
            self.stats_.fetches += 1
            self.fresh = True
        if self.pushed is self.grad:
            self.grad, self._spare_grad = self._spare_grad, self.grad
            self.pushed = self.grad
        else:
            self.pushed, self._spare_pushed = self._spare_pushed, self.pushed

    def _settle_pushes(self) -> None:
        """fetch = "overlapped": complete this rank's push in flight now, adopting the pull
        that came with it, before the replica reports a position (a checkpoint pause, the
        end of its work), which must hold every step it computed."""
        if self.fetch == "overlapped" and self.client.drain():
            self.params, self._spare_params = self._spare_params, self.params

    def _exchange(self, control: ControlExchange) -> ControlExchange:
        """A control-only exchange with shard 0 (the lead's)."""
        self.client.exchange(self._before_exchange(control))
        return control

    def _before_exchange(self, control: ControlExchange) -> ControlExchange:
        """Every exchange publishes the signals this rank received; a new SIGUSR1 may be
        a launcher's notice that a rank died, so the shards are looked at first."""
        counts = self.run_.signals.counts
        control.publish(usr1=counts["SIGUSR1"], term=counts["SIGTERM"])
        self.run_.check_shards(time.monotonic())
        return control

    # -- the end

    def finish(self) -> Ending:
        """Publish the end of this replica's work (FINISHED with its final position: its
        last push is in), send its statistics to rank 0, and wait for the teardown.
        A lost replica publishes nothing and sends nothing. One-sided, plus one message."""
        linger = self.faults.linger_seconds(self.t)  # test-only
        if linger:
            self.client.linger_in_exchanges(linger)
        if not self.lost:
            try:
                self._settle_pushes()
            except RankLost as lost:  # a partner partition died after the last decision
                self._abandon(lost)
        if not self.lost:
            if self.lead:
                self._publish_position(finished=1)
            request = self.run_.messages.isend(self.stats(), dest=0, tag=STATS_TAG)
            backoff = Backoff(*PAUSE_POLL_S)
            guard = watchdog.current()
            with guard.waiting("rank 0 to take this replica's statistics", (0,)):
                while not request.Test():
                    guard.check()
                    backoff.wait()
        teardown, stop, stop_arg = self._wait_for_teardown()
        return Ending(stop, stop_arg, teardown)

    def _wait_for_teardown(self) -> tuple[int, int, int]:
        """Poll the block until shard 0 says how the run ends, then count this rank as
        leaving (LEFT). Every rank of the replica polls on its own, without the
        replica's slots (no heartbeat: a lost replica's stays silent), so a partition
        whose partner died needs no one. Returns (TEARDOWN, STOP, STOP_ARG)."""
        control = ControlExchange(None)
        topology = self.plan.topology
        backoff = shard0_backoff(PAUSE_POLL_S, topology.world_size - len(topology.shard_ranks))
        guard = watchdog.current()
        self.client.exchange(control.set(claim=0))
        with guard.waiting("shard 0 to end the run", (0,)):
            while not control.teardown:
                guard.check()
                backoff.wait()
                self.client.exchange(control.set(claim=0))
                guard.progress()  # shard 0 answers: the run is simply not over yet
        if control.teardown == rc.TEARDOWN_LEAVE:
            self._say_leaving()
        return control.teardown, control.stop, control.stop_arg

    def _say_leaving(self) -> None:
        """Tell rank 0 that this rank is done with its windows, by a message sent after the
        last epoch's Unlock has returned. Not through the block: over RMA an epoch completes
        only while its target is inside MPI, and shard 0 seeing an epoch's operations
        applied does not mean the epoch has completed, so a LEFT count read there would let
        shard 0 leave while this rank still waits in its Unlock. A message rank 0 has
        received was sent, so every epoch before it is closed."""
        request = self.run_.messages.isend(None, dest=0, tag=LEAVING_TAG)
        backoff = Backoff(*PAUSE_POLL_S)
        guard = watchdog.current()
        with guard.waiting("rank 0 to take this rank's leaving message", (0,)):
            while not request.Test():
                guard.check()
                backoff.wait()

    def stats(self) -> dict[str, Any]:
        self.stats_.bytes_sent = int(self.client.bytes_sent)
        self.stats_.bytes_received = int(self.client.bytes_received)
        if self.clock is not None and self.lead:
            self.stats_.clock_bound = self.clock.to_dict()
        return {"role": "replica", **self.stats_.to_dict()}


# ------------------------------------------------------------------------------------------
# Partitioned replicas (model parallelism; partitioned_sgd.py's docstring says how)


class PartitionedReplica(Replica):
    """One partition of a Downpour replica: its own pieces of the parameters, its own
    pushes and pulls; partition 0 (the lead) exchanges with shard 0 for the replica
    (claims, reports, commands, its data position) and shares every decision with the
    others (one Ibcast per block), so all of them pause, stop and end together."""

    def __init__(self, run: Any, network: Any, fetch: str):
        comm = run.communicators.partition
        self.lead = comm.Get_rank() == 0
        model = PartitionedNetwork(network, comm)
        run.endpoint.restrict_to(model.pieces)
        model.layout = network.layout  # whole-model vectors: Replica sizes them so
        super().__init__(run, model, fetch)
        self.model, self.comm = model, comm
        self._finite = np.zeros(1, dtype=np.int32)

    def _settle_pushes(self) -> None:
        """Every partition completes its push in flight before the lead reports for the
        replica (a polled barrier on the partition communicator)."""
        super()._settle_pushes()
        if self.fetch == "overlapped":
            wait_all([self.comm.Ibarrier()], "the other partitions of this replica to "
                     "complete their pushes", self.model.partner_ranks)

    def _agree_applied(self) -> None:
        """Under the staleness bound, before the lead's clock counts the push: every
        partition's push is applied (a polled barrier on the partition communicator)."""
        wait_all([self.comm.Ibarrier()], "the other partitions of this replica to have "
                 "their pushes applied", self.model.partner_ranks)

    def _share_values(self, values: np.ndarray) -> np.ndarray:
        values = np.ascontiguousarray(values, dtype=np.int64)
        lead = self.model.partner_ranks[:1] if not self.lead else ()
        return polled_bcast(self.comm, values, "its lead partition's decision", lead)

    def _usable(self, loss: float) -> bool:
        """Downpour's finite-gradient check, agreed by the partitions (Allreduce MIN):
        one partition's pieces may be finite while another's are not, and a partition
        that dropped a step, or stopped after too many, while the others went on
        would leave them waiting for its activations."""
        before = self.bad_in_a_row
        self._finite[0] = super()._usable(loss)
        wait_all([self.comm.Iallreduce(MPI.IN_PLACE, self._finite, op=MPI.MIN)],
                 "the other partitions of this replica", self.model.partner_ranks)
        self.bad_in_a_row = 0 if self._finite[0] else before
        return bool(self._finite[0])

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["partition"] = self.comm.Get_rank()
        out["model_parallel"] = self.model.traffic.per_step()
        return out
