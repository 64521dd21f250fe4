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
line in metrics.jsonl and in summary.json. Checkpoints are not written for partitioned
runs yet (said at start).

DOWNPOUR (`algorithm = "downpour"`, S + R x P ranks; the class is in downpour/replica.py,
which sends the lead's decisions by runtime.agreement.polled_bcast): `PartitionedReplica`
is a Downpour replica whose network is a `PartitionedNetwork` over its replica's P ranks
and whose parameter client pulls and pushes only the partition's pieces of the vector
(`ParameterClient.restrict_to`; the paper's Figure 2). Partition 0 (the lead) alone talks
to shard 0's run control block for the replica: it claims steps, reports steps and loss,
reads the commands (pause for a checkpoint, stop, lost, teardown) and publishes the data
position (the same on every partition); after each exchange it hands the grant and the
command to its partitions with one broadcast, which they wait for with back-off sleeps,
so all of them pause, stop and end together. They also agree on whether a step's gradient
is finite (Downpour drops non-finite ones). A partition that finds another gone (the
stall watchdog's liveness check in every wait on it) gives its replica up as lost. The
data, shards and supervisor are Downpour's own.
"""

from __future__ import annotations

import math
import sys
import time
from typing import IO, Any

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.common import EVAL_BATCH_SIZE, STOP_CODE_OF, STOP_CODES, StopSignals
from distbelief.algorithms.session import RunSession
from distbelief.config import Config, build_optimizer
from distbelief.errors import ConfigError
from distbelief.model.partitioned_network import PartitionedNetwork
from distbelief.records.metrics import LOG_EVERY_SECONDS
from distbelief.runtime.agreement import agree, polled_bcast
from distbelief.runtime.faults import Faults
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


def train(config: Config, comm: MPI.Comm, stream: IO[str] | None = sys.stdout,
          resume: str = "auto") -> dict[str, Any] | None:
    """Train one replica split over the ranks of `comm`; returns the summary on rank 0,
    None elsewhere. Collective over `comm` (every rank calls it with the same config).

    Validates the rank count and the partitioning first, without communicating, so a bad
    configuration raises ConfigError on every rank. Always starts fresh: `resume` =
    "require" (train --resume) is a ConfigError, as this path writes no checkpoints.
    """

    if resume == "require":
        raise ConfigError("--resume: a single replica with cluster.partitions > 1 writes no "
                          "checkpoints, so it cannot resume; use optimizer.algorithm = "
                          "\"downpour\" (which checkpoints) or start without --resume")
    check_rank_count(config, comm.Get_size())
    session = RunSession("sgd", config, comm, stream, resume)
    network = session.network
    model = PartitionedNetwork(network, comm)
    set_blas_threads(config.run.threads or 1)
    session.start_fresh()  # nothing here can be resumed
    eval_set, shard = agree(comm, lambda: (session.load_eval_set(),
                                           session.train_shard(0, 1)))
    params = model.init_params(config.run.seed)
    optimizer = build_optimizer(config, params.size)
    session.describe_run(f"{network.layout.size:,d} parameters over {comm.Get_size()} "
                         f"partitions (this one {model.local_size:,d})", len(eval_set[1]),
                         "; checkpoints are not written for partitioned runs",
                         model.describe(), sep="; ")
    session.open_recorder()

    def describe(rank: int) -> str:
        return f"rank {rank} (partition {rank})"

    # Rank 0 acts on a stop signal, at the end of a step; the others must not die of it.
    # A lost partition: one replica over P ranks, nothing goes on without it. No
    # checkpoint is written for partitioned runs, so nothing is left half written either.
    with session.watched(describe) as (signals, _):
        reason, step = _loop(session, model, shard, optimizer, params, eval_set, signals)
    traffic = traffic_totals(model)
    if traffic is None:
        return None
    return session.finish(reason, {"model_parallel": traffic}, steps=step,
                          note=f"; {traffic['total_bytes_per_step']:,d} bytes/step between "
                               f"partitions")


def _loop(session: RunSession, model: PartitionedNetwork, shard: Any, optimizer: Any,
          params: np.ndarray, eval_set: tuple, signals: StopSignals) -> tuple[str, int]:
    """The lockstep loop; returns (why it stopped, steps). Collective over model.comm."""
    config, recorder = session.config, session.recorder
    comm, rules = model.comm, session.rules
    batch_size, eval_every = config.data.batch_size, config.run.eval_every_seconds
    grad = np.zeros_like(params)
    decision = np.zeros(2, dtype=np.int32)  # stop code, evaluate now
    start = recorder.start if recorder else time.monotonic()
    next_log, next_eval = start + LOG_EVERY_SECONDS, start + eval_every
    step, loss_sum, loss_count, recent = 0, 0.0, 0, math.nan
    faults = Faults.for_rank(MPI.COMM_WORLD.Get_rank())  # test-only: AT counts steps

    def evaluate() -> float:
        test_loss, accuracy = model.evaluate(params, *eval_set, batch_size=EVAL_BATCH_SIZE)
        if recorder:
            recorder.log_eval(step, step * batch_size, recent, accuracy, test_loss)
        return accuracy

    while True:
        x, y = shard.next_batch(batch_size)
        loss = model.loss_and_grad(params, x, y, grad)
        if not math.isfinite(loss):  # the same loss on every partition: all stop here
            raise session.diverged(f"{loss} at step {step + 1}")
        optimizer.step(params, grad, update=step)
        step += 1
        if faults:
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
            decision[:] = STOP_CODE_OF[reason], now >= next_eval
            if now >= next_log or reason:
                recent, loss_sum, loss_count = loss_sum / loss_count, 0.0, 0
                recorder.log(step, step * batch_size, recent,
                             learning_rate=optimizer.rate(step - 1))
                next_log = now + LOG_EVERY_SECONDS
            recorder.progress(step, step * batch_size, recent)
        polled_bcast(comm, decision, ranks=model.partner_ranks)
        reason = STOP_CODES[int(decision[0])]
        if reason:
            if reason not in StopSignals.NAMES:  # on a signal, stop promptly
                evaluate()
            return reason, step
        if decision[1]:
            if recorder and loss_count:
                recent = loss_sum / loss_count
            if rules.target_reached(evaluate()):
                return "target_accuracy", step
            next_eval = time.monotonic() + eval_every
