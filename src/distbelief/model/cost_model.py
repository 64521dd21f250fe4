"""Predicted step time of one model replica split over P partitions, before submitting a job.

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
             layer 0 neither computes an input gradient, so neither has a backward
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
sustains on these kernels (not the machine's peak): benchmarks/bench_model_parallel.py
measures it on this machine. Data loading, the optimizer and Downpour's traffic to the
parameter server are not included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from distbelief.model.layers import Dense, Layer, Lcn, Pool
from distbelief.model.partition import balanced_splits, needed_inputs, split_units, unit_width

BYTES_PER_VALUE = 4


@dataclass(frozen=True)
class Link:
    """A partition's network link: bytes per second each way, seconds per message."""

    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or not self.latency >= 0:
            raise ValueError(f"need bandwidth > 0 and latency >= 0, got {self.bandwidth}, "
                             f"{self.latency}")


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


def step_time(layers: list[Layer], partitions: int, batch: int, flops: float,
              link: Link) -> tuple[float, float, float, int, float]:
    """(step, compute, communication seconds, bytes per step, largest partition's flops)
    on the critical path; see the module docstring."""
    splits = [balanced_splits(split_units(layer), partitions) for layer in layers]
    compute = comm = 0.0
    moved = 0
    per_partition = [0.0] * partitions
    for i, layer in enumerate(layers):
        work = [layer_work(layer, splits[i][p], splits[i][p + 1], batch, i == 0)
                for p in range(partitions)]
        for p, (forward, backward) in enumerate(work):
            per_partition[p] += forward + backward
        received, sent, peers = exchanged_values(layers, splits, i)
        moved += 2 * sum(received) * batch * BYTES_PER_VALUE
        # Forward and backward each pay the message cost; the work is split between them.
        wires = [link.latency + batch * BYTES_PER_VALUE * max(received[p], sent[p])
                 / link.bandwidth if peers[p] else 0.0 for p in range(partitions)]
        for direction in (0, 1):  # forward, backward
            slowest = max(range(partitions),
                          key=lambda p: work[p][direction] / flops + wires[p])
            compute += work[slowest][direction] / flops
            comm += wires[slowest]
    if partitions > 1:
        rounds = 2 * math.ceil(math.log2(partitions))
        comm += 3 * rounds * (link.latency + batch * BYTES_PER_VALUE / link.bandwidth)
        moved += 3 * partitions * batch * BYTES_PER_VALUE
    return compute + comm, compute, comm, moved, max(per_partition)


def predict(network: object, partitions: int, batch: int, flops: float,
            link: Link) -> Prediction:
    """The predicted step time and speedup over one partition of `network` (a
    distbelief.model.network.Network; only its layer geometry is read) split over `partitions`
    ranks, each sustaining `flops` FLOP/s and talking over `link`."""
    if partitions < 1 or batch < 1 or not flops > 0:
        raise ValueError(f"need partitions >= 1, batch >= 1, flops > 0; got {partitions}, "
                         f"{batch}, {flops}")
    layers = list(network.layers)
    widest = max(split_units(layer) for layer in layers)
    if partitions > widest:
        raise ValueError(f"{partitions} partitions: the widest layer splits into at most "
                         f"{widest} blocks")
    single = step_time(layers, 1, batch, flops, link)[0]
    total, compute, comm, moved, largest = step_time(layers, partitions, batch, flops, link)
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
