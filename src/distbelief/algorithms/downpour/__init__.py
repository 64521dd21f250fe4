"""Downpour SGD (Dean et al., NIPS 2012): asynchronous model replicas around a sharded
parameter server, over MPI one-sided communication. A replica that dies does not stop
the others.

    mpiexec -n N python -m distbelief train CONFIG      # [optimizer] algorithm = "downpour"

The design, section by section (ROLES, REPLICAS, RUN CONTROL, SHARDS, SHARD 0, LOST
REPLICAS, SIGNALS, CHECKPOINTS, NON-FINITE GRADIENTS, END OF THE RUN, METRICS, threads), is
docs/downpour.md, "Design".

MODULES (each imports only those before it; trainer.py imports them all): plan (the
constants, errors, DownpourPlan, grant, Ending), run (open_run, OpenRun, Start: the set-up
and the restore), clocks (ReplicaClock, ClockWatch: the staleness bound,
optimizer.max_staleness), replica (Replica, PartitionedReplica), row_replica (RowReplica: a
sparse model's replica moving its batches' rows), shards (ShardRole: what every shard
does), progress (RunProgress: shard 0's steps, loss and stop decision), spares (SparePool:
shard 0's side of the hot spares, cluster.spare_replicas, and of growth,
cluster.release_spares_at), replica_watch (ReplicaWatch: the replicas' heartbeats and the lost ones), checkpoints
(Checkpoints: shard 0's checkpointer: when, the replicas' part, the commit), variant
(Variant: what an algorithm built on this machinery, EASGD or asynchronous DiLoCo,
supplies in Downpour's place; make_replica, the replica role a rank takes), supervisor (Supervisor: shard 0, and the summary), trainer
(train), options (the [optimizer] keys Downpour owns).

The trainer is trainer.py. This `__init__` imports nothing, so that config can read
options.py (the [optimizer] keys this algorithm owns) without MPI; the trainer's names
are still reached as `distbelief.algorithms.downpour.NAME`, imported on first use.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__") or name == "trainer":  # not one of the trainer's names
        raise AttributeError(name)
    from distbelief.algorithms.downpour import trainer

    return getattr(trainer, name)
