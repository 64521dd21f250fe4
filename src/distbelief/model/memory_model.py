"""Predicted memory of every rank of a job, before it starts: a formula per role in the
parameters N, a shard's slice n = N / S, the batch B and the activations. Pure arithmetic
on the network's geometry; `distbelief costmodel` prints it and `train` refuses a layout
that needs more than a node has (docs/performance.md, "Memory per rank", has the formulas
next to what was measured, and where the bytes go).

Bytes of float32 values, per role (s = the optimizer's state arrays per parameter:
Adagrad 1, SGD 0; K = push slots = min(2 x clients, max(8, 64 MiB / (n b)), 64); b = bytes
per pushed value, 4 or 2 with push_dtype = "bfloat16"; A(B) = activations of a batch of B; D = a replica's part of
the training data; BASE = the interpreter, numpy, h5py and MPI, about 90 MB):

    RMA shard          4n (1 + s + 2) + K n b + BASE      master, state, 2 publish buffers,
                                                        push slots (MPI window memory)
    shared-memory shard 4n (1 + s) + BASE                parameters and state, in the segment
    either, besides    4n (1 + s)                        with periodic checkpoints: the copy
                                                        written in the background
    shard 0, besides   4N + A_eval + eval set            the evaluation snapshot
    replica            4N_p (2 + extras) + A(B)/P + D + BASE   parameters and gradient (N_p =
                                                        its partition's share, N / P)
    row replica        4C (3 + [n_push > 1]) + A(B) + D + BASE   a sparse model's replica
                                                        moving its batches' rows: its row
                                                        cache and gradients, C values
    one process        4N (2 + s) + A(B) + D + BASE

extras: 1 with n_push > 1 (the summed push), 2 more with fetch = "overlapped" (a second
parameters and gradient in flight), 1/2 for bfloat16 pushes over RMA (the narrowed copy), 1
for bfloat16 pushes on shared memory (the rounded copy). C (optimizer.table_pulls = "rows",
model.sparse_rows) = each table's rows that n_fetch batches can read, min(rows, n_fetch B
ids a sample) x width, plus the dense part: never the table; on shared memory 16 bytes per
value more for the pieces' positions. Shard 0's evaluation snapshot is then the evaluation
set's rows the same way (values and positions, 12 bytes a value), not 4N. On one node with the shared-memory
transport a replica's resident set also counts the shard segments it maps (shared pages,
held once by the node), so its peak RSS is larger than its line here; the node's total is
the sum of the lines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

BYTES = 4
BASE_BYTES = 90 << 20
"""A rank's resident set with a tiny model: 69 MB for one process, 73-90 MB for the ranks
of a Downpour job (measured, docs/performance.md)."""
PUBLISH_BUFFERS = 2  # ps.rma_windows.BUFFERS (tests/test_memory.py checks they agree)
PUSH_SLOTS_ANY_SIZE = 8     # ps.rma_windows.PUSH_SLOTS_ANY_SIZE
PUSH_SLOT_MEMORY = 64 << 20  # ps.rma_windows.PUSH_SLOT_MEMORY
MAX_PUSH_SLOTS = 64          # ps.rma_windows.MAX_PUSH_SLOTS
EVAL_BATCH = 1000    # algorithms.common.EVAL_BATCH_SIZE
STATE_ARRAYS = {"adagrad": 1, "sgd": 0, "momentum": 1, "adam": 2}
"""Optimizer state arrays per parameter, by optimizer.update (others: 1)."""


@dataclass(frozen=True)
class RoleMemory:
    """One kind of rank: its name, how many ranks play it, the bytes each needs, and the
    parts that make them up (bytes, by name)."""

    role: str
    count: int
    bytes: int
    parts: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Workload:
    """What besides the layout decides memory: the batch, the optimizer's state arrays,
    the transport ("rma" or "shared"), pushes (dtype bytes, n_push, overlapped fetch), the
    training data (rows, bytes per row), the evaluation set (rows), whether shards copy
    their state for periodic checkpoints, and the float32-sized values of one input row
    as the model takes it (0: the network's input size; sparse rows and ids are far
    smaller than their table's width: data.hdf5.DatasetInfo.input_row_bytes / 4)."""

    batch: int = 128
    state_arrays: int = 1
    transport: str = "rma"
    push_bytes: int = 4
    n_push: int = 1
    overlapped: bool = False
    train_rows: int = 0
    row_bytes: int = 0
    eval_rows: int = 0
    checkpoint_copy: bool = False
    input_values: int = 0
    row_ids: tuple[float, ...] = ()
    """A row-sharded sparse model (optimizer.table_pulls = "rows"): the ids a sample
    reads of each table (empty: replicas hold the whole vector)."""
    n_fetch: int = 1


def activation_bytes(network: object, batch: int, backward: bool = True,
                     input_values: int = 0) -> int:
    """Bytes of a batch's activations: the flat input (`input_values` float32-sized values
    a row, else the network's input size), every layer's output and (for training) its
    gradient, as Network keeps them, and the layers' scratch (conv's im2col columns)."""
    layers = list(network.layers)
    outputs = sum(layer.out_size for layer in layers)
    saved = sum(getattr(layer, "saved_per_output", 0) * layer.out_size for layer in layers)
    inputs = input_values or math.prod(network.input_shape)
    scratch = sum(layer.scratch_bytes(batch) for layer in layers
                  if hasattr(layer, "scratch_bytes"))
    return BYTES * batch * (inputs + outputs * (2 if backward else 1) + saved) + scratch


def push_slots(clients: int, slot_bytes: int) -> int:
    fit = PUSH_SLOT_MEMORY // slot_bytes if slot_bytes > 0 else MAX_PUSH_SLOTS
    return max(1, min(2 * clients, MAX_PUSH_SLOTS, max(PUSH_SLOTS_ANY_SIZE, fit)))


def shard_memory(num_params: int, shards: int, clients: int, work: Workload) -> RoleMemory:
    """A parameter-server shard of a Downpour (or EASGD) job, without shard 0's extras."""
    n = math.ceil(num_params / shards)
    parts = {"parameters": BYTES * n, "optimizer state": BYTES * n * work.state_arrays}
    if work.transport == "rma":
        parts["publish buffers"] = BYTES * n * PUBLISH_BUFFERS
        parts["push slots"] = push_slots(clients, n * work.push_bytes) * n * work.push_bytes
    if work.checkpoint_copy:
        parts["checkpoint copy"] = BYTES * n * (1 + work.state_arrays)
    parts["process"] = BASE_BYTES
    return RoleMemory("shard", shards, sum(parts.values()), parts)


def row_cache_values(network: object, samples: int, row_ids: tuple[float, ...]) -> int | None:
    """Values of a row cache that `samples` samples can fill (model.sparse_rows.RowCache):
    each table's rows they can read, at most the table, and the dense part; None when
    `row_ids` does not describe the network's tables."""
    tables = getattr(network, "tables", None)
    if not row_ids or tables is None or len(tables) != len(row_ids):
        return None
    in_tables = sum(rows * width for _, rows, width in tables)
    cached = sum(min(rows, math.ceil(samples * ids)) * width
                 for (_, rows, width), ids in zip(tables, row_ids))
    return cached + network.layout.size - in_tables


def replica_memory(network: object, partitions: int, work: Workload,
                   replicas: int = 1, spares: int = 0) -> RoleMemory:
    """A replica's rank (one partition of it when partitions > 1; a row cache's with
    `work.row_ids`)."""
    n = math.ceil(network.layout.size / partitions)
    copies = 2 + (work.n_push > 1) + (2 if work.overlapped else 0)
    cache = row_cache_values(network, work.n_fetch * work.batch, work.row_ids)
    if cache is not None and partitions == 1:
        # params, gradient and the block's banked gradient (row_replica), plus the merged
        # sum with n_push > 1; shared memory gathers by int64 positions, pull and push.
        parts = {"row cache and gradients": BYTES * cache * (3 + (work.n_push > 1))}
        if work.transport == "shared":
            parts["piece positions"] = 16 * cache
    else:
        parts = {"parameters and gradient": BYTES * n * copies}
    if work.push_bytes == 2:
        parts["bfloat16 push copy"] = n * (2 if work.transport == "rma" else BYTES)
    parts["activations"] = math.ceil(activation_bytes(network, work.batch,
                                                      input_values=work.input_values)
                                     / partitions)
    parts["training data"] = math.ceil(work.train_rows / max(replicas, 1)) * work.row_bytes
    parts["process"] = BASE_BYTES
    return RoleMemory("replica" if partitions == 1 else "replica partition",
                      (replicas + spares) * partitions, sum(parts.values()), parts)


def evaluation_memory(network: object, work: Workload) -> dict[str, int]:
    """What the rank that evaluates holds besides its role: a parameter snapshot, the
    evaluation set and a forward pass of EVAL_BATCH rows (with `work.row_ids`, the
    snapshot holds the evaluation set's rows and their positions alone)."""
    rows = row_cache_values(network, work.eval_rows, work.row_ids)
    snapshot = BYTES * network.layout.size if rows is None else 3 * BYTES * rows
    return {"evaluation snapshot": snapshot,
            "evaluation set": work.eval_rows * work.row_bytes,
            "evaluation activations": activation_bytes(network, min(EVAL_BATCH, max(
                work.eval_rows, 1)), backward=False, input_values=work.input_values)}


def predict_memory(network: object, shards: int, replicas: int, partitions: int,
                   work: Workload, spares: int = 0) -> list[RoleMemory]:
    """Each role's memory for S shards x R replicas x P partitions (S = 0: no shards, one
    process when R = P = 1): shard 0 first (it evaluates), then the other shards, then the
    replicas' ranks. `spares` (Downpour's spare replicas) are planned as replicas, whose
    part of the data (1/R) they hold once they take a lost one's over."""
    if shards == 0 and replicas * partitions == 1:
        n = network.layout.size
        parts = {"parameters and gradient": BYTES * n * 2,
                 "optimizer state": BYTES * n * work.state_arrays,
                 "activations": activation_bytes(network, work.batch,
                                                 input_values=work.input_values),
                 "training data": work.train_rows * work.row_bytes,
                 **evaluation_memory(network, work), "process": BASE_BYTES}
        parts.pop("evaluation snapshot")
        return [RoleMemory("the one process", 1, sum(parts.values()), parts)]
    roles = []
    replica = replica_memory(network, partitions, work, replicas, spares)
    if shards:
        shard = shard_memory(network.layout.size, shards, (replicas + spares) * partitions,
                             work)
        first = {**shard.parts, **evaluation_memory(network, work)}
        roles.append(RoleMemory("shard 0", 1, sum(first.values()), first))
        if shards > 1:
            roles.append(RoleMemory("shard", shards - 1, shard.bytes, shard.parts))
        roles.append(replica)
    else:  # replica 0 evaluates
        first = {**replica.parts, **evaluation_memory(network, work)}
        first.pop("evaluation snapshot")
        roles.append(RoleMemory("replica 0", 1, sum(first.values()), first))
        if replica.count > 1:
            roles.append(RoleMemory(replica.role, replica.count - 1, replica.bytes,
                                    replica.parts))
    return roles


def largest(roles: list[RoleMemory]) -> RoleMemory:
    return max(roles, key=lambda role: role.bytes)


def total_bytes(roles: list[RoleMemory]) -> int:
    return sum(role.bytes * role.count for role in roles)


def format_memory(roles: list[RoleMemory]) -> str:
    """The roles as an aligned table, MB per rank and its largest parts."""
    lines = [f"{'role':<18} {'ranks':>5} {'MB/rank':>8}  parts (MB)"]
    for role in roles:
        parts = ", ".join(f"{name} {size / 2**20:.0f}" for name, size in role.parts.items()
                          if size >= 2**20)
        lines.append(f"{role.role:<18} {role.count:>5} {role.bytes / 2**20:>8.0f}  {parts}")
    lines.append(f"{'all ranks':<18} {sum(r.count for r in roles):>5} "
                 f"{total_bytes(roles) / 2**20:>8.0f}")
    return "\n".join(lines)
