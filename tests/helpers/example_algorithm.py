"""The minimal algorithm of docs/architecture.md ("A new algorithm"): full-batch gradient
descent, each rank computing the gradient of its part of the training set, summed over
the ranks of `comm`; rank 0 evaluates and writes the run's records. No checkpoints. The
run skeleton (distbelief.algorithms.session.RunSession) does the rest."""

from __future__ import annotations

import sys
from typing import IO, Any

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.common import evaluate
from distbelief.algorithms.session import RunSession, RunSetup
from distbelief.config import Config
from distbelief.runtime.communicators.agreement import polled_bcast, wait_all


def train(config: Config, comm: MPI.Comm, stream: IO[str] | None = sys.stdout,
          resume: str = "auto", setup: RunSetup | None = None) -> dict[str, Any] | None:
    """Collective over `comm`; the summary on rank 0, None elsewhere. `setup`: what the
    launch found (the data, the network, the checkpoints)."""
    session = RunSession(config.optimizer.algorithm, config, comm, stream, resume,
                         setup=setup)
    info, network, rules = session.info, session.network, session.rules
    session.start_fresh()  # no checkpoints: nothing to resume
    shard = session.train_shard(comm.Get_rank(), comm.Get_size())
    x, y = shard.next_batch(shard.n)  # this rank's whole part
    params = network.init_params(config.run.seed)
    grad = np.zeros_like(params)
    recorder = session.open_recorder()  # rank 0's; None elsewhere
    eval_set = session.load_eval_set() if recorder is not None else None
    step, reason, stop = 0, None, np.zeros(1, np.int64)
    with session.watched(lambda r: f"rank {r}"):  # a lost rank ends the job
        while not stop[0]:
            loss = network.loss_and_grad(params, x, y, grad)  # the mean over this part
            grad *= len(y) / info.n_train  # summed over the ranks: the mean over all
            wait_all([comm.Iallreduce(MPI.IN_PLACE, grad, op=MPI.SUM)], "the gradients")
            params -= config.optimizer.learning_rate * grad
            step += 1
            if recorder is not None:
                result = evaluate(network, params, eval_set)
                recorder.log_eval(step, step * info.n_train, loss, result)
                reason = (rules.target_reason if rules.target_reached(result)
                          else rules.budget_spent(step, recorder.elapsed()))
                stop[0] = reason is not None
            polled_bcast(comm, stop, "rank 0's decision", (0,))
    return session.finish(reason)
