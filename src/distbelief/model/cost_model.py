"""Predicted step time of one model replica split over P partitions, and of Downpour with
S shards x R replicas of P partitions, before submitting a job.

    from distbelief.model.cost_model import Link, predict
    p = predict(network, partitions=8, batch=64, flops=50e9, link=Link(12.5e9, 2e-6))
    p.step_seconds, p.speedup, p.bytes_per_step

THE MODEL. The partitioning is the one the trainer uses (distbelief.model.partition: row bands
of locally connected layers, unit blocks of dense layers, balanced). For every layer l
and partition p it counts

    F(l, p)  floating-point operations of p's units per step: forward 2*N*fan_in per
             output value; backward the same again for the weight gradient and, except in
             layer 0, once more for the input gradient. Pool and lcn layers have no
             weights: pooling costs k*k operations per output value forward (2*k*k for
             L2) and 2*k*k backward; LCN 6 + 8k/C per value forward (channel sums,
             centring, squares, division, and two separable k-tap blurs per pixel shared
             by its C channels), twice that backward (it recomputes its statistics); in
             layer 0 neither computes an input gradient, so neither has a backward.
             Dropout costs 1 operation per value each way, layernorm 6 forward and 10
             backward (4 in layer 0: the gain's and bias's gradients only); conv layers
             count as local ones (the same products, with tied weights). They are not
             split (partition.py), so they are priced at P = 1 only
    V(l, p)  values p receives per sample (inputs it is wired to and does not own) and
             values it sends (its outputs that other partitions are wired to, once per
             receiving partition); backward sends them the other way

and charges, per layer and direction, the slowest partition:

    t(l) = max_p [ F(l, p) / flops  +  latency  +  4 * N * max(V_in, V_out) / bandwidth ]

(the latency only where p exchanges anything: a layer's messages are posted together,
so their latencies overlap; links are full duplex, so in and out flow at the same time).
The loss adds three Allreduces of N values (recursive doubling: 2 log2 P steps each).
The step time is the sum over layers of forward and backward, the speedup is T(1)/T(P).

Compute and communication are added, not overlapped: the implementation overlaps a
layer's messages with the work that needs no remote input (model_parallel.py), so this
is an upper bound on the step time when `flops` is right. `flops` is what one partition
sustains on these kernels (not the machine's peak): `distbelief costmodel --measure`
(model/calibrate.py) times it on this machine. Two optional terms make narrow partitions
dear, as the paper's speech curve needs: a per-message processor cost (Link.message,
times the peers a partition exchanges with) and a GEMM rate that falls on narrow blocks
(block_efficiency's half_width). Data loading is not included.

DATA PARALLELISM. predict_layout adds Downpour's parameter server to a partitioned
replica: each step's push and pull, every shard's fold of every replica's gradient and its
link, and ranks sharing cores (its docstring has the terms). docs/model-parallelism.md,
"Cost model", has both models, the parameters of the paper's shape and the
predicted-against-measured table.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from distbelief.model.layers import Dense, Dropout, Layer, LayerNorm, Lcn, Pool
from distbelief.model.partition import (
    balanced_splits,
    check_splittable,
    needed_inputs,
    split_units,
    unit_width,
)

BYTES_PER_VALUE = 4


@dataclass(frozen=True)
class Link:
    """A partition's network link: bytes per second each way, seconds of latency per
    exchange (a layer's messages are posted together, so their latencies overlap), and
    `message` seconds of processor time per message (posting, matching and completing
    it, paid one after another: what grows with the number of peers)."""

    bandwidth: float
    latency: float
    message: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or not self.latency >= 0 or not self.message >= 0:
            raise ValueError(f"need bandwidth > 0, latency >= 0 and message >= 0, got "
                             f"{self.bandwidth}, {self.latency}, {self.message}")


def block_efficiency(width: float, full: float, half_width: float) -> float:
    """The rate of a layer's GEMM on a block `width` units wide against the whole layer's
    (`full` units), when a block of `half_width` units runs at half a wide block's rate:
    w / (w + h), relative to the whole layer's. 1 with half_width = 0 (no penalty)."""
    if half_width <= 0 or width <= 0:
        return 1.0
    return (width / (width + half_width)) / (full / (full + half_width))


@dataclass(frozen=True)
class Prediction:
    """One P's prediction. Times in seconds per training step; bytes summed over
    partitions and both directions (activations forward, their gradients backward)."""

    partitions: int
    step_seconds: float
    compute_seconds: float
    communication_seconds: float
    bytes_per_step: int
    speedup: float
    largest_partition_flops: float


def layer_work(layer: Layer, start: int, stop: int, batch: int,
               first: bool) -> tuple[float, float]:
    """(forward, backward) floating-point operations of split units [start, stop)."""
    outputs = batch * (stop - start) * unit_width(layer)
    if isinstance(layer, Pool):
        taps = layer.kernel * layer.kernel
        forward = outputs * taps * (2.0 if layer.mode == "l2" else 1.0)
        return forward, 0.0 if first else outputs * 2.0 * taps
    if isinstance(layer, Lcn):
        forward = outputs * (6.0 + 8.0 * layer.kernel / layer.in_shape[2])
        return forward, 0.0 if first else 2.0 * forward
    if isinstance(layer, Dropout):
        return float(outputs), 0.0 if first else float(outputs)
    if isinstance(layer, LayerNorm):
        return 6.0 * outputs, (4.0 if first else 10.0) * outputs
    if isinstance(layer, Dense):
        fan_in = layer.in_size
    else:
        fan_in = layer.kernel * layer.kernel * layer.in_shape[2]
    forward = 2.0 * fan_in * outputs
    # Backward: the weight gradient, and the input gradient except in layer 0.
    return forward, forward * (1 if first else 2)


def layer_flops(layer: Layer, start: int, stop: int, batch: int, first: bool) -> float:
    """Forward + backward floating-point operations of split units [start, stop)."""
    return sum(layer_work(layer, start, stop, batch, first))


def exchanged_values(layers: list[Layer], splits: list[list[int]], index: int
                     ) -> tuple[list[int], list[int], list[int]]:
    """Per partition: values received per sample for layer `index`'s inputs, values sent,
    and the number of peers it exchanges with (layer 0 reads the data: nothing)."""
    parts = len(splits[index]) - 1
    received, sent, peers = [0] * parts, [0] * parts, [0] * parts
    if index == 0:
        return received, sent, peers
    layer, width = layers[index], unit_width(layers[index - 1])
    owned = [(splits[index - 1][q] * width, splits[index - 1][q + 1] * width)
             for q in range(parts)]
    for p in range(parts):
        mask = needed_inputs(layer, splits[index][p], splits[index][p + 1])
        for q, (lo, hi) in enumerate(owned):
            if q == p:
                continue
            count = int(mask[lo:hi].sum())
            if count:
                received[p] += count
                sent[q] += count
                peers[p] += 1
                peers[q] += 1
    return received, sent, peers


@functools.lru_cache(maxsize=4096)  # a plan asks for every P up to its rank count
def _split_geometry(layers: tuple[Layer, ...], partitions: int
                    ) -> tuple[list[list[int]], list[tuple[list[int], list[int], list[int]]]]:
    """Each layer's split over `partitions` and its exchanged_values: the same for every
    machine figure, so a plan that prices a thousand layouts counts them once per P.
    ConfigError for P > 1 with a layer that is not split (partition.check_splittable)."""
    check_splittable(layers, partitions)
    splits = [balanced_splits(split_units(layer), partitions) for layer in layers]
    return splits, [exchanged_values(list(layers), splits, i) for i in range(len(layers))]


def step_time(layers: list[Layer], partitions: int, batch: int, flops: float,
              link: Link, half_width: float = 0.0) -> tuple[float, float, float, int, float]:
    """(step, compute, communication seconds, bytes per step, largest partition's flops)
    on the critical path; see the module docstring. `half_width`: block_efficiency's."""
    splits, exchanges = _split_geometry(tuple(layers), partitions)
    compute = comm = 0.0
    moved = 0
    per_partition = [0.0] * partitions
    for i, layer in enumerate(layers):
        full = split_units(layer)
        work = []
        for p in range(partitions):
            forward, backward = layer_work(layer, splits[i][p], splits[i][p + 1], batch,
                                           i == 0)
            per_partition[p] += forward + backward
            # Narrow blocks run slower: as if they had more work at the full rate.
            slow = block_efficiency(splits[i][p + 1] - splits[i][p], full, half_width)
            work.append((forward / slow, backward / slow) if slow > 0 else (0.0, 0.0))
        received, sent, peers = exchanges[i]
        moved += 2 * sum(received) * batch * BYTES_PER_VALUE
        # Forward and backward each pay the message cost; the work is split between them.
        wires = [link.latency + peers[p] * link.message + batch * BYTES_PER_VALUE
                 * max(received[p], sent[p]) / link.bandwidth if peers[p] else 0.0
                 for p in range(partitions)]
        for direction in (0, 1):  # forward, backward
            slowest = max(range(partitions),
                          key=lambda p: work[p][direction] / flops + wires[p])
            compute += work[slowest][direction] / flops
            comm += wires[slowest]
    if partitions > 1:
        rounds = 2 * math.ceil(math.log2(partitions))
        comm += 3 * rounds * (link.latency + link.message
                              + batch * BYTES_PER_VALUE / link.bandwidth)
        moved += 3 * partitions * batch * BYTES_PER_VALUE
    return compute + comm, compute, comm, moved, max(per_partition)


def predict(network: object, partitions: int, batch: int, flops: float,
            link: Link, half_width: float = 0.0) -> Prediction:
    """The predicted step time and speedup over one partition of `network` (a
    distbelief.model.network.Network; only its layer geometry is read) split over `partitions`
    ranks, each sustaining `flops` FLOP/s on whole layers (less on narrow blocks:
    `half_width`, block_efficiency) and talking over `link`."""
    if partitions < 1 or batch < 1 or not flops > 0:
        raise ValueError(f"need partitions >= 1, batch >= 1, flops > 0; got {partitions}, "
                         f"{batch}, {flops}")
    layers = list(network.layers)
    widest = max(split_units(layer) for layer in layers)
    if partitions > widest:
        raise ValueError(f"{partitions} partitions: the widest layer splits into at most "
                         f"{widest} blocks")
    single = step_time(layers, 1, batch, flops, link, half_width)[0]
    total, compute, comm, moved, largest = step_time(layers, partitions, batch, flops, link,
                                                     half_width)
    return Prediction(partitions, total, compute, comm, moved, single / total, largest)


def format_table(predictions: list[Prediction]) -> str:
    """The predictions as an aligned text table."""
    header = (f"{'partitions':>10} {'step ms':>10} {'compute ms':>11} {'comm ms':>9} "
              f"{'MB/step':>9} {'speedup':>8}")
    lines = [header]
    for p in predictions:
        lines.append(f"{p.partitions:>10d} {p.step_seconds * 1e3:>10.2f} "
                     f"{p.compute_seconds * 1e3:>11.2f} {p.communication_seconds * 1e3:>9.2f} "
                     f"{p.bytes_per_step / 1e6:>9.2f} {p.speedup:>7.2f}x")
    return "\n".join(lines)


# -- data parallelism: S shards x R replicas x P partitions ------------------------------


@dataclass(frozen=True)
class Machine:
    """What one rank has: `flops` FLOP/s on whole layers (narrow blocks: `half_width`),
    a `link` (bandwidth each way, latency, per-message cost), a shard's `fold_rate`
    (parameters per second its update rule folds: one pass over parameters, state and
    gradient) and `cores` processors shared by the ranks that compute (0: one each)."""

    flops: float
    link: Link
    fold_rate: float = 1.2e9
    half_width: float = 0.0
    cores: int = 0


@dataclass(frozen=True)
class LayoutPrediction:
    """One layout's prediction. `step_seconds`: a replica's step (compute, push and pull,
    or the shards' pace when they are slower); `samples_per_second`: all replicas."""

    shards: int
    replicas: int
    partitions: int
    compute_seconds: float
    exchange_seconds: float
    shard_seconds: float
    step_seconds: float
    samples_per_second: float
    bottleneck: str


def predict_layout(network: object, shards: int, replicas: int, partitions: int, batch: int,
                   machine: Machine, transport: str = "rma") -> LayoutPrediction:
    """Downpour's step time and throughput for S shards x R replicas x P partitions (S = 0:
    one replica alone, no parameter server, applying its own update: compute plus one fold
    of its N/P parameters).

        compute   the partitioned step (predict), slowed by R*P / cores when more ranks
                  compute than there are cores
        exchange  each partition's push and pull of its 4N/P bytes: 2 (latency + S
                  messages + 4N/P / bandwidth); on shared memory two copies at the link's
                  bandwidth and the fold of the whole vector by the replica itself
        shards    per round of one step of every replica, a shard folds R gradients of
                  its slice n = N/S (R n / fold_rate) and moves 2 R 4n bytes through its
                  link; on shared memory the folds of one slice wait for each other (its
                  lock), so the same R n / fold_rate
        step      max(compute + exchange, shards); throughput R B / step
    """
    link = machine.link
    size = network.layout.size
    busy = replicas * partitions
    slowdown = busy / machine.cores if machine.cores and busy > machine.cores else 1.0
    compute = predict(network, partitions, batch, machine.flops, link,
                      machine.half_width).step_seconds * slowdown
    if shards == 0:  # the replica applies its own update: one fold of its parameters
        step = compute + network.layout.size / partitions / machine.fold_rate
        return LayoutPrediction(0, replicas, partitions, compute, 0.0, 0.0, step,
                                replicas * batch / step, "compute")
    moved = BYTES_PER_VALUE * size / partitions
    if transport == "shared":
        exchange = 2 * moved / link.bandwidth + size / partitions / machine.fold_rate
    else:
        exchange = 2 * (link.latency + shards * link.message + moved / link.bandwidth)
    exchange *= slowdown
    slice_ = size / shards
    fold = replicas * slice_ / machine.fold_rate
    wire = 0.0 if transport == "shared" else 2 * replicas * BYTES_PER_VALUE * slice_ \
        / link.bandwidth
    shard = max(fold, wire)
    step = max(compute + exchange, shard)
    if step == shard:
        bottleneck = "shard fold" if fold >= wire else "shard link"
    else:
        bottleneck = "compute" if compute >= exchange else "push/pull"
    return LayoutPrediction(shards, replicas, partitions, compute, exchange, shard, step,
                            replicas * batch / step, bottleneck)


def format_layouts(predictions: list[LayoutPrediction], memory: list[str] | None = None
                   ) -> str:
    """The layouts as an aligned table (and each one's memory column, if given)."""
    header = (f"{'S x R x P':>11} {'ranks':>5} {'step ms':>8} {'compute':>8} {'push+pull':>9} "
              f"{'shards':>7} {'samples/s':>10}  {'bound by':<10}")
    lines = [header + ("  memory" if memory else "")]
    for i, p in enumerate(predictions):
        lines.append(f"{f'{p.shards} x {p.replicas} x {p.partitions}':>11} "
                     f"{p.shards + p.replicas * p.partitions:>5} {p.step_seconds * 1e3:>8.1f} "
                     f"{p.compute_seconds * 1e3:>8.1f} {p.exchange_seconds * 1e3:>9.1f} "
                     f"{p.shard_seconds * 1e3:>7.1f} {p.samples_per_second:>10.0f}  "
                     f"{p.bottleneck:<10}" + (f"  {memory[i]}" if memory else ""))
    return "\n".join(lines)
