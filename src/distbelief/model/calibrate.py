"""`distbelief costmodel --measure`: the cost model's machine figures, timed on this machine
instead of assumed.

    flops       a training step of the model itself (Network.loss_and_grad, batch B, one
                BLAS thread): its floating-point operations over the best of a few steps
    half_width  the largest dense layer's GEMM at its full width and at an eighth of it;
                the ratio of their rates gives the width at which a block runs at half
                speed (cost_model.block_efficiency)
    link        a Put and a Get of the parameter vector through a one-rank MPI window
                (what the RMA transport does, here through this MPI's shared memory),
                and the round trip of 8 bytes for the latency
    fold_rate   the Adagrad kernel over a slice of the parameters

Each figure is the best of a few repetitions. Local: MPI is started as a singleton.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from distbelief.model.cost_model import Link, Machine, step_time
from distbelief.model.layers import Dense


@dataclass(frozen=True)
class Measured:
    flops: float
    half_width: float
    bandwidth: float
    latency: float
    fold_rate: float
    step_seconds: float

    def machine(self, message: float = 0.0, cores: int = 0) -> Machine:
        return Machine(self.flops, Link(self.bandwidth, self.latency, message),
                       self.fold_rate, self.half_width, cores)

    def describe(self) -> str:
        return (f"measured here: a step {self.step_seconds * 1e3:.1f} ms = "
                f"{self.flops / 1e9:.1f} GFLOP/s, half-speed block width "
                f"{self.half_width:.0f} units, transport {self.bandwidth / 1e9:.2f} GB/s and "
                f"{self.latency * 1e6:.1f} us, fold {self.fold_rate / 1e9:.2f} Gparam/s")


def _best(run: Callable[[], None], repeats: int = 5) -> float:
    run()  # warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(network: object, batch: int, repeats: int = 5) -> Measured:
    """Time this machine on `network`'s shapes at `batch` (see the module docstring)."""
    from distbelief.model import kernels

    rng = np.random.default_rng(0)
    params = network.init_params(0)
    grad = np.zeros_like(params)
    x = rng.random((batch, *network.input_shape), dtype=np.float32)
    y = (rng.integers(0, network.num_classes, batch).astype(np.int64)
         if network.loss_fn.targets == "classes"
         else rng.random((batch, network.num_classes), dtype=np.float32))
    step = _best(lambda: network.loss_and_grad(params, x, y, grad), repeats)
    work = step_time(list(network.layers), 1, batch, 1.0, Link(1.0, 0.0))[1]
    flops = work / step
    half_width = _half_width(network, batch, repeats)
    bandwidth, latency = _transport(params.nbytes, repeats)
    size = min(params.size, 1 << 24)
    p, a, g = (np.ones(size, np.float32) for _ in range(3))
    fold = _best(lambda: kernels.adagrad_update(p, a, g, 1e-3, 1e-10, None), repeats)
    return Measured(flops, half_width, bandwidth, latency, size / fold, step)


def _half_width(network: object, batch: int, repeats: int) -> float:
    """h in w / (w + h) from the rates of the widest dense layer's GEMM at full width and
    at an eighth of it (0 when narrow blocks are no slower)."""
    dense = [layer for layer in network.layers if isinstance(layer, Dense)]
    if not dense:
        return 0.0
    layer = max(dense, key=lambda d: d.in_size * d.out_size)
    full, narrow = layer.out_size, max(1, layer.out_size // 8)
    a = np.ones((batch, layer.in_size), np.float32)
    rates = []
    for width in (full, narrow):
        w = np.ones((layer.in_size, width), np.float32)
        out = np.empty((batch, width), np.float32)
        rates.append(width / _best(lambda w=w, out=out: np.matmul(a, w, out=out), repeats))
    ratio = rates[1] / rates[0]  # (n / (n + h)) / (f / (f + h))
    if ratio >= 1:
        return 0.0
    # ratio (n + h) f = n (f + h)  =>  h = n f (1 - ratio) / (ratio f - n)
    denominator = ratio * full - narrow
    return float(narrow * full * (1 - ratio) / denominator) if denominator > 0 else float(full)


def _transport(nbytes: int, repeats: int) -> tuple[float, float]:
    """(bytes per second of a Put and of a Get, each way; seconds of an 8-byte round):
    between ranks 1 and 0 of COMM_WORLD when costmodel runs under `mpiexec -n 2` (rank 1
    times Put and Get into rank 0's window, as a replica's push and pull), else through a
    one-rank window (memory copies: an upper bound). The figures are the same on every
    rank (bcast from rank 1). Collective over COMM_WORLD."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    comm = world if world.Get_size() >= 2 else MPI.COMM_SELF
    me, target = comm.Get_rank(), 0
    win = MPI.Win.Allocate(nbytes if me == target else 0, 1, comm=comm)
    data = np.ones(nbytes // 4, np.float32)
    timer = comm.Get_size() - 1 if comm.Get_size() == 1 else 1
    win.Lock_all(MPI.MODE_NOCHECK)
    result = (0.0, 0.0)
    try:
        if me == timer:
            def round_trip(buffer: np.ndarray) -> None:
                win.Put(buffer, target, 0)
                win.Flush(target)
                win.Get(buffer, target, 0)
                win.Flush(target)

            seconds = _best(lambda: round_trip(data), repeats)
            small = np.ones(2, np.float32)
            latency = _best(lambda: round_trip(small), repeats * 20) / 2
            result = (2 * nbytes / seconds, latency)
        comm.Barrier()
    finally:
        win.Unlock_all()
        win.Free()
    return comm.bcast(result, root=timer)
