"""Synchronous data-parallel SGD (`optimizer.algorithm = "sync"`), with optional backup
workers.

Every step, each of R replicas computes a gradient on its own batch from its own disjoint
part of the training set (data.hdf5.TrainShard, as Downpour's replicas do); the step
applies the mean of those gradients with the configured update rule (optimizer.update:
Adagrad or fixed-rate SGD, model.optimizers), so the result is single-process SGD with an
R times larger batch. This is what Horovod, PyTorch DDP and TensorFlow's
SyncReplicasOptimizer do; the project compares Downpour against it.

Two ways to run a step, chosen by `optimizer.backup_workers`:

- k = 0 (allreduce.py, `cluster.ps_shards = 0`): every rank is a replica; the gradients
  are summed with a non-blocking allreduce that is polled with back-off sleeps (MPICH's
  blocking waits spin a core: DESIGN.md), and every replica applies the same step to its
  own copy of the parameters, so the copies stay bit for bit identical (checked at the
  end of every run: summary.json "replicas_identical"). A lost replica stops the run with
  one line: the collective can never complete without it.
- k >= 1 (backups.py, `cluster.ps_shards = 1`): Chen, Pan, Monga, Bengio, Jozefowicz,
  "Revisiting Distributed Synchronous SGD" (arXiv:1604.00981, 2016): R replicas compute
  gradients for each step, the parameter server applies the mean of the first R - k to
  arrive and drops the rest, so the k slowest replicas (stragglers, or dead ones) never
  hold a step up.

References: Dean et al., "Large Scale Distributed Deep Networks" (NIPS 2012) for the
setting; Goyal et al., "Accurate, Large Minibatch SGD" (2017) and Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training" (VLDB 2020) for the
allreduce form; Chen et al. 2016 (above) for backup workers.

The trainer is trainer.py. This `__init__` imports nothing, so that config can read
options.py (the [optimizer] keys this algorithm owns) without MPI; the trainer's names
are still reached as `distbelief.algorithms.sync.NAME`, imported on first use.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__") or name == "trainer":  # not one of the trainer's names
        raise AttributeError(name)
    from distbelief.algorithms.sync import trainer

    return getattr(trainer, name)
