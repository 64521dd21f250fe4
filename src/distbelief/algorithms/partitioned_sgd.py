"""Training with model replicas that span several ranks (`[cluster] partitions = P > 1`).

SINGLE REPLICA (`algorithm = "sgd"`, `mpiexec -n P`): the single-process loop of
trainer.py, run by P ranks in lockstep on one `PartitionedNetwork`. Every rank reads the
same batches (same seed) and keeps only its pieces of the parameters and its optimizer
state (Adagrad or SGD are element-wise, so each partition updating its own pieces is
exactly the single-process update). What every rank must agree on comes from collectives
it takes part in anyway: the loss and the test accuracy are Allreduced inside the model,
so divergence and the accuracy target are decided identically everywhere; the two
decisions that depend on a clock (max_seconds, when to evaluate) are rank 0's, broadcast
each step (one 8-byte Ibcast among ranks that are in lockstep already). Rank 0 owns the
run folder (config.json, metrics.jsonl, summary.json) as in trainer.py, and records the
bytes each layer sends per step, summed over the partitions, once as a "partitions"
line in metrics.jsonl and in summary.json. Checkpoints are single-process sgd's (algorithms/
checkpointer.py): when one is due (rank 0's clock, in the same broadcast), every rank
sends its pieces of the parameters and of the optimizer state to rank 0 (a Gatherv per
array), which writes the whole vector. So a partitioned run resumes at any P, or in one
process, and `evaluate` and `export` read it as any sgd run's; every rank reads its pieces
back from the checkpoint on resume. The data position is the same on every rank.

DOWNPOUR (`algorithm = "downpour"`, S + R x P ranks; the class is in downpour/replica.py,
which sends the lead's decisions by runtime.communicators.agreement.polled_bcast):
`PartitionedReplica` is a Downpour replica whose network is a `PartitionedNetwork` over
its replica's P ranks and whose parameter client pulls and pushes only the partition's
pieces of the vector (`ParameterClient.restrict_to`; the paper's Figure 2). Partition 0
(the lead) alone talks to shard 0's run control block for the replica: it claims steps,
reports steps and loss, reads the commands (pause for a checkpoint, stop, lost, teardown)
and publishes the data position (the same on every partition); after each exchange it
hands the grant and the command to its partitions with one broadcast, which they wait for
with back-off sleeps, so all of them pause, stop and end together. They also agree on
whether a step's gradient is finite (Downpour drops non-finite ones). A partition that
finds another gone (the stall watchdog's liveness check in every wait on it) gives its
replica up as lost. The data, shards and supervisor are Downpour's own. """

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import IO, Any

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.checkpointer import Checkpointer, TrainState, restore, schedule
from distbelief.algorithms.common import EVAL_BATCH_SIZE, StopDecision, StopSignals
from distbelief.algorithms.session import RunSession, RunSetup
from distbelief.config import Config, build_optimizer
from distbelief.errors import ConfigError
from distbelief.model.partitioned_network import PartitionedNetwork
from distbelief.records.metrics import LOG_EVERY_SECONDS
from distbelief.runtime.communicators.agreement import agree, polled_bcast
from distbelief.runtime.health import watchdog
from distbelief.runtime.threads import set_blas_threads


def check_rank_count(config: Config, world_size: int) -> None:
    """A single partitioned replica needs exactly `partitions` ranks. Pure."""
    partitions = config.cluster.partitions
    if world_size != partitions:
        raise ConfigError(
            f"optimizer.algorithm = \"sgd\" with cluster.partitions = {partitions} trains one "
            f"model replica on exactly {partitions} MPI ranks, but {world_size} were "
            f"started; run mpiexec -n {partitions}, or use algorithm = \"downpour\" for "
            f"several replicas")


def traffic_totals(model: PartitionedNetwork) -> dict[str, Any] | None:
    """Bytes per step per layer summed over the partitions, on rank 0 (None elsewhere).
    Collective over model.comm (one reduce)."""
    mine = model.traffic.per_step()
    rows = np.array([mine["forward"], mine["backward"]], dtype=np.float64)
    total = np.zeros_like(rows) if model.comm.Get_rank() == 0 else None
    model.comm.Reduce(rows, total, op=MPI.SUM, root=0)
    loss = model.comm.reduce(mine["loss"], op=MPI.SUM, root=0)
    if total is None:
        return None
    return {"partitions": model.comm.Get_size(),
            "forward_bytes_per_step": [int(b) for b in total[0]],
            "backward_bytes_per_step": [int(b) for b in total[1]],
            "loss_allreduce_bytes_per_step": int(loss),
            "total_bytes_per_step": int(total.sum() + loss)}


def _partition_data(session: RunSession, comm: MPI.Comm) -> tuple[tuple, Any]:
    """(evaluation set, training shard), the same on every partition: every partition
    needs every row's x and y (the input layer is not split, the softmax's classes are).
    In memory, partition 0 alone reads them from the file and broadcasts them (the file
    system serves one copy per replica, not P); streamed, each partition reads its own
    (a window-by-window exchange would be a protocol of its own). Collective over `comm`
    (an agreement, then broadcasts)."""
    lead = comm.Get_rank() == 0
    if not session.config.data.in_memory or comm.Get_size() == 1:
        return agree(comm, lambda: (session.load_eval_set(), session.train_shard(0, 1)))
    mine = agree(comm, lambda: (*session.load_eval_set(), *session.train_shard(0, 1)
                                .stored_rows) if lead else None)
    layout = comm.bcast([(a.shape, a.dtype.str) for a in mine] if lead else None, root=0)
    arrays = mine if lead else [np.empty(shape, dtype) for shape, dtype in layout]
    for array in arrays:
        polled_bcast(comm, array, "partition 0's training rows")
    from distbelief.data.hdf5 import TrainShard

    session.eval_set = (arrays[0], arrays[1])
    shard = TrainShard(session.info, 0, 1, session.config.run.seed, rows=(arrays[2], arrays[3]))
    return session.eval_set, shard


def train(config: Config, comm: MPI.Comm, stream: IO[str] | None = sys.stdout,
          resume: str = "auto", setup: RunSetup | None = None) -> dict[str, Any] | None:
    """Train one replica split over the ranks of `comm`; returns the summary on rank 0,
    None elsewhere. Collective over `comm` (every rank calls it with the same config).

    Validates the rank count and the partitioning first, without communicating, so a bad
    configuration raises ConfigError on every rank. Resumes from the newest checkpoint as
    single-process sgd does (`resume` is one of RESUME_MODES).
    """

    check_rank_count(config, comm.Get_size())
    session = RunSession("sgd", config, comm, stream, resume, setup=setup)
    network = session.network
    model = PartitionedNetwork(network, comm)
    set_blas_threads(config.run.threads or 1)
    session.choose_checkpoint()
    eval_set, shard = _partition_data(session, comm)
    params = model.init_params(config.run.seed)
    optimizer = build_optimizer(config, params.size)
    state = TrainState()
    found = session.start_checkpoint()
    if found is not None:
        agree(comm, lambda: restore(found, params, optimizer, shard, state,
                                    select=model.local_params))
    session.describe_run(f"{network.layout.size:,d} parameters over {comm.Get_size()} "
                         f"partitions (this one {model.local_size:,d})", len(eval_set[1]),
                         model=model.describe(), sep="; ")
    recorder = session.open_recorder()
    whole = WholeState(model, optimizer)
    saver = (Checkpointer(config, network.layout, whole.params, whole, shard, recorder,
                          stream, last_step=state.step if found is not None else None)
             if recorder else None)

    def describe(rank: int) -> str:
        return f"rank {rank} (partition {rank})"

    # Rank 0 acts on a stop signal, at the end of a step; the others must not die of it.
    # A lost partition: one replica over P ranks, nothing goes on without it. A checkpoint
    # commits atomically on rank 0, so a death while one is written leaves nothing half done.
    with session.watched(describe) as (signals, _):
        reason = _loop(session, model, shard, optimizer, params, signals, state,
                       lambda: whole.save(params, saver, state), whole)
        whole.save(params, saver, state)
    traffic = traffic_totals(model)
    if traffic is None:
        return None
    return session.finish(reason, {"model_parallel": traffic}, steps=state.step,
                          checkpoint=saver.last_path,
                          note=f"; {traffic['total_bytes_per_step']:,d} bytes/step between "
                               f"partitions")


class WholeState:
    """The whole model's parameters and optimizer state, gathered from the partitions onto
    rank 0 for a checkpoint (on the other ranks: empty)."""

    def __init__(self, model: PartitionedNetwork, optimizer: Any):
        self.model, self.optimizer = model, optimizer
        comm = model.comm
        self.root = comm.Get_rank() == 0
        pieces = [model.plan.pieces(p) for p in range(comm.Get_size())]
        self.counts = [sum(b - a for a, b in mine) for mine in pieces]
        self.order = np.concatenate([np.arange(a, b) for mine in pieces for a, b in mine])
        size = model.network.layout.size
        if self.root and (len(self.order) != size
                          or not np.array_equal(np.sort(self.order), np.arange(size))):
            raise RuntimeError("the partitions' pieces do not tile the parameter vector")
        names = list(optimizer.state())
        self.params = np.zeros(size if self.root else 0, dtype=np.float32)
        self._state = {name: np.zeros(size if self.root else 0, dtype=np.float32)
                       for name in names}
        self._received = np.zeros(size if self.root else 0, dtype=np.float32)

    def state(self) -> dict[str, np.ndarray]:
        """The gathered optimizer state (Checkpointer reads it as an optimizer's)."""
        return self._state

    def gather(self, local: np.ndarray, whole: np.ndarray) -> None:
        """`local` (this partition's pieces back to back) into `whole` on rank 0.
        Collective over the model's communicator (one Gatherv)."""
        target = [self._received, self.counts, MPI.FLOAT] if self.root else None
        self.model.comm.Gatherv(np.ascontiguousarray(local, dtype=np.float32), target, root=0)
        if self.root:
            whole[self.order] = self._received

    def gather_params(self, params: np.ndarray) -> np.ndarray:
        """The whole parameter vector on rank 0 (empty elsewhere). Collective, as save."""
        with watchdog.current().waiting("the partitions' pieces for the best model",
                                        ranks=self.model.partner_ranks):
            self.gather(params, self.params)
        return self.params

    def save(self, params: np.ndarray, saver: Checkpointer | None, state: TrainState) -> None:
        """Gather everything and checkpoint `state` on rank 0. Collective; a partner dead
        meanwhile ends the job (the watchdog's thread: a Gatherv cannot be polled)."""
        with watchdog.current().waiting("the partitions' pieces for a checkpoint",
                                        ranks=self.model.partner_ranks):
            self.gather(params, self.params)
            for name, local in self.optimizer.state().items():
                self.gather(local, self._state[name])
        if saver is not None:
            saver.save(state)


def _loop(session: RunSession, model: PartitionedNetwork, shard: Any, optimizer: Any,
          params: np.ndarray, signals: StopSignals, state: TrainState,
          checkpoint: Callable[[], None], whole: WholeState) -> str:
    """The lockstep loop; returns why it stopped, with `state` at the last step. Rank 0
    decides each step whether to stop, evaluate or checkpoint (`checkpoint()`, collective).
    An evaluation that beats the run's best (every partition gets the same accuracy) also
    gathers the whole vector for rank 0's best keeper (run.keep_best). Collective over
    model.comm."""
    config, recorder = session.config, session.recorder
    comm, rules, eval_set = model.comm, session.rules, session.eval_set
    batch_size, eval_every = config.data.batch_size, config.run.eval_every_seconds
    run = config.run
    grad = np.zeros_like(params)
    decision = StopDecision()  # rank 0's, broadcast each step
    start = recorder.start if recorder else time.monotonic()
    now = time.monotonic()
    next_log, next_eval = now + LOG_EVERY_SECONDS, now + eval_every
    step, loss_sum, loss_count, recent = state.step, 0.0, 0, math.nan
    save_at = schedule(run.checkpoint_every_seconds, run.checkpoint_every_steps, step,
                       now)
    faults = session.faults  # test-only: AT counts steps
    # The best figure so far, rank 0's (a resumed run's from its best model), on every rank.
    keeper = recorder.best_keeper if recorder else None
    best = np.array([-np.inf if keeper is None or keeper.best is None
                     else keeper.best[keeper.best.get("score") or "accuracy"]])
    polled_bcast(comm, best, ranks=model.partner_ranks)

    def evaluate() -> Any:
        result = model.evaluate(params, *eval_set, batch_size=EVAL_BATCH_SIZE)
        whole_params = None
        if run.keep_best and result.score > best[0]:  # the same verdict on every partition
            best[0] = result.score
            whole_params = whole.gather_params(params)
        if recorder:
            recorder.log_eval(step, step * batch_size, recent, result, params=whole_params)
        return result

    # A resumed run whose budget is already spent trains no further step.
    if recorder:
        decision.encode(rules.budget_spent(step, now - start, recorder.collapsed))
    polled_bcast(comm, decision.flags, ranks=model.partner_ranks)
    if decision.reason:
        return decision.reason
    while True:
        x, y = shard.next_batch(batch_size)
        loss = model.loss_and_grad(params, x, y, grad)
        if not math.isfinite(loss):  # the same loss on every partition: all stop here
            raise session.diverged(f"{loss} at step {step + 1}")
        optimizer.step(params, grad, update=step)
        step += 1
        state.step, state.samples = step, step * batch_size
        faults.after_step(step, 0.0)
        loss_sum, loss_count = loss_sum + loss, loss_count + 1
        if step == 1:
            traffic = traffic_totals(model)
            if recorder:
                recorder.log_event("partitions", step, batch_size, **traffic)
        if recorder:
            now = time.monotonic()
            reason = (rules.budget_spent(step, now - start, recorder.collapsed)
                      or signals.received)
            decision.encode(reason, now >= next_eval,
                            now >= save_at[0] or step >= save_at[1])
            if now >= next_log or reason:
                recent, loss_sum, loss_count = loss_sum / loss_count, 0.0, 0
                recorder.log(step, step * batch_size, recent,
                             learning_rate=optimizer.rate(step - 1))
                next_log = now + LOG_EVERY_SECONDS
            recorder.progress(step, step * batch_size, recent)
        polled_bcast(comm, decision.flags, ranks=model.partner_ranks)
        reason = decision.reason
        if reason:
            if reason not in StopSignals.NAMES:  # on a signal, stop promptly
                evaluate()
            return reason
        if decision.eval_due:
            if recorder and loss_count:
                recent = loss_sum / loss_count
            if rules.target_reached(evaluate()):
                return rules.target_reason
            next_eval = time.monotonic() + eval_every
        if decision.save_due:
            checkpoint()
            save_at = schedule(run.checkpoint_every_seconds,
                               run.checkpoint_every_steps, step, time.monotonic())

