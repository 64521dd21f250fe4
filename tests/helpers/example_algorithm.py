"""The minimal algorithm of docs/architecture.md ("A new algorithm"): full-batch gradient
descent, each rank computing the gradient of its part of the training set, summed over
the ranks of `comm`; rank 0 evaluates and writes the run's records. No checkpoints."""

from __future__ import annotations

import sys
from typing import IO, Any

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.common import (
    StopRules,
    evaluate,
    load_eval_set,
    open_data,
    prepare_run_dir,
)
from distbelief.config import Config, config_hash
from distbelief.data.hdf5 import TrainShard
from distbelief.records.metrics import RunRecorder
from distbelief.runtime.agreement import polled_bcast, wait_all


def train(config: Config, comm: MPI.Comm, stream: IO[str] | None = sys.stdout,
          resume: str = "auto") -> dict[str, Any] | None:
    """Collective over `comm`; the summary on rank 0, None elsewhere."""
    rank, size = comm.Get_rank(), comm.Get_size()
    info, network = open_data(config)
    shard = TrainShard(info, rank=rank, num_ranks=size, seed=config.run.seed)
    x, y = shard.next_batch(shard.n)  # this rank's whole part
    params = network.init_params(config.run.seed)
    grad = np.zeros_like(params)
    recorder = None
    if rank == 0:
        recorder = RunRecorder(prepare_run_dir(config), config.run.progress_every_seconds,
                               stream, target_accuracy=config.run.target_accuracy)
        eval_set, rules = load_eval_set(config, info), StopRules.from_config(config)
    step, reason, stop = 0, None, np.zeros(1, np.int64)
    while not stop[0]:
        loss = network.loss_and_grad(params, x, y, grad)  # the means over this rank's part
        grad *= len(y) / info.n_train  # summed over the ranks: the mean over the whole set
        wait_all([comm.Iallreduce(MPI.IN_PLACE, grad, op=MPI.SUM)], "the other gradients")
        params -= config.optimizer.learning_rate * grad
        step += 1
        if recorder is not None:
            test_loss, accuracy = evaluate(network, params, eval_set)
            recorder.log_eval(step, step * info.n_train, loss, accuracy, test_loss)
            reason = ("target_accuracy" if rules.target_reached(accuracy)
                      else rules.budget_spent(step, recorder.elapsed()))
            stop[0] = reason is not None
        polled_bcast(comm, stop, "rank 0's decision", (0,))
    if recorder is None:
        return None
    return recorder.finish({"algorithm": config.optimizer.algorithm, "stop_reason": reason,
                            "config_hash": config_hash(config)})
