"""The conv layer's training step against PyTorch CPU's conv2d, 1 thread, same run.

For each conv layer of configs/fashion_mnist_conv.toml at its batch size (64): one
forward and backward of our layer (layers.Conv: im2col kernel, BLAS through numpy, the
fused bias + relu and its derivative, col2im) and of PyTorch's F.conv2d + relu with
autograd, float32, one thread each. Layer 0 computes no input gradient (the network
skips it for the first layer), so PyTorch's input does not require one there either.
PyTorch runs in its default NCHW layout and in channels_last; the faster is the peer.
Each figure is the median over --repeats rounds; ours and PyTorch's alternate round by
round, so a busy machine slows both alike. The ratio is PyTorch's time over ours: above
1, ours is faster.

Then where our step's time goes: each call the layer makes, timed inside the step (im2col,
twice: forward and again for the weight gradient; the forward GEMM; bias + relu; the relu
derivative with the bias gradient; the weight-gradient and input-gradient GEMMs; col2im),
summed over the chunks the batch goes through.

--clock cpu times with the process's CPU time instead of the wall clock (a loaded
machine's other jobs then count for neither).

    python benchmarks/bench_conv.py [--repeats 15] [--quick] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from distbelief.model import kernels
from distbelief.model.layers import Conv

# (name, N, H, W, Cin, kernel, filters, first): configs/fashion_mnist_conv.toml's conv
# layers, "valid" padding, stride 1, relu.
CASES = [
    ("conv 0", 64, 28, 28, 1, 3, 16, True),
    ("conv 2", 64, 13, 13, 16, 3, 32, False),
]
PADDING = "valid"
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def timed(run: Callable[[], object], loops: int) -> float:
    start = clock()
    for _ in range(loops):
        run()
    return (clock() - start) / loops


def ours(x: np.ndarray, layer: Conv, first: bool, rng: np.random.Generator):
    """One training step of our layer."""
    n = x.shape[0]
    flat = x.reshape(n, -1)
    (_, wshape), (_, bshape) = layer.param_shapes()
    weights = (rng.standard_normal(wshape) * 0.1).astype(np.float32)
    bias = np.zeros(bshape, dtype=np.float32)
    out = np.empty((n, layer.out_size), dtype=np.float32)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dweights, dbias = np.empty_like(weights), np.empty_like(bias)
    dx = None if first else np.empty_like(flat)

    def step():
        layer.forward(flat, weights, bias, out)
        # backward overwrites dout with dz = dout * relu'(out): doing it again is the same.
        layer.backward(flat, out, dout, weights, dweights, dbias, dx)
    return step


def theirs(torch, x: np.ndarray, layer: Conv, first: bool, channels_last: bool):
    fn = torch.nn.functional
    memory = torch.channels_last if channels_last else torch.contiguous_format
    xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous(memory_format=memory)
    xt.requires_grad_(not first)
    k, filters, cin = layer.kernel, layer.filters, layer.in_shape[2]
    wt = (torch.randn(filters, cin, k, k) * 0.1).contiguous(memory_format=memory)
    wt.requires_grad_(True)
    bt = torch.zeros(filters, requires_grad=True)
    gy = torch.randn(x.shape[0], filters, *layer.out_shape[:2]).contiguous(
        memory_format=memory)
    inputs = [wt, bt] if first else [xt, wt, bt]

    def step():
        y = torch.relu(fn.conv2d(xt, wt, bt, padding=k // 2 if PADDING == "same" else 0))
        torch.autograd.grad(y, inputs, gy)
    return step


def breakdown(layer: Conv, step: Callable[[], object], loops: int,
              repeats: int) -> dict[str, float]:
    """Seconds per step in each call the layer's step makes, timed inside the step itself
    (its chunks summed; called alone in a loop, each would find its data in cache)."""
    spent: dict[str, float] = {}
    matmul = np.matmul
    originals = {name: getattr(kernels, name) for name in
                 ("im2col", "bias_activation", "activation_backward", "col2im")}

    def gemm_name(out: np.ndarray) -> str:
        if out.shape[-1] == layer.patch:
            return "dcolumns GEMM"
        return "dweights GEMM" if out.shape[0] == layer.patch else "forward GEMM"

    def timed_call(name: str | None, call: Callable) -> Callable:
        def run(*args, **kwargs):
            start = clock()
            result = call(*args, **kwargs)
            key = name or gemm_name(kwargs["out"])
            spent[key] = spent.get(key, 0.0) + clock() - start
            return result
        return run

    for name, call in originals.items():
        setattr(kernels, name, timed_call(name, call))
    np.matmul = timed_call(None, matmul)
    try:
        step()
        rounds = []
        for _ in range(repeats):
            spent.clear()
            for _ in range(loops):
                step()
            rounds.append({key: value / loops for key, value in spent.items()})
    finally:
        np.matmul = matmul
        for name, call in originals.items():
            setattr(kernels, name, call)
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="rounds per figure")
    parser.add_argument("--quick", action="store_true", help="3 rounds, for a smoke test")
    parser.add_argument("--clock", choices=CLOCKS, default="wall",
                        help="wall clock (default) or this process's CPU time")
    args = parser.parse_args()
    repeats = 3 if args.quick else args.repeats
    global clock
    clock = CLOCKS[args.clock]
    from threadpoolctl import threadpool_limits
    threadpool_limits(1)
    import torch  # a benchmark peer only, never a dependency
    torch.set_num_threads(1)

    print(f"PyTorch {torch.__version__}, 1 thread, float32; median of {repeats} rounds; "
          f"{args.clock} clock; load average {os.getloadavg()[0]:.1f}")
    print(f"{'layer':<7} {'N x H x W x Cin':>16} {'k':>2} {'F':>3} | {'ours ms':>8} "
          f"{'torch ms':>8} {'ratio':>6} | torch layout")
    rng = np.random.default_rng(0)
    details = []
    totals = {"ours": 0.0, "torch": 0.0}
    for name, n, h, w, cin, kernel, filters, first in CASES:
        layer = Conv((h, w, cin), kernel, 1, filters, PADDING, "relu")
        x = rng.standard_normal((n, h, w, cin)).astype(np.float32)
        step = ours(x, layer, first, rng)
        runs = {"ours": step, "NCHW": theirs(torch, x, layer, first, False),
                "NHWC": theirs(torch, x, layer, first, True)}
        # Loops long enough (~50 ms) that the timer's resolution does not matter.
        loops = {key: max(1, int(0.05 / max(timed(run, 1), 1e-6)))
                 for key, run in runs.items()}
        times: dict[str, list[float]] = {key: [] for key in runs}
        for _ in range(repeats):
            for key, run in runs.items():
                times[key].append(timed(run, loops[key]))
        med = {key: statistics.median(t) for key, t in times.items()}
        peer = min(("NCHW", "NHWC"), key=med.__getitem__)
        totals["ours"] += med["ours"]
        totals["torch"] += med[peer]
        shape = f"{n}x{h}x{w}x{cin}"
        print(f"{name:<7} {shape:>16} {kernel:>2} {filters:>3} | {med['ours'] * 1e3:8.3f} "
              f"{med[peer] * 1e3:8.3f} {med[peer] / med['ours']:5.2f}x | {peer}",
              flush=True)
        details.append((name, med["ours"], breakdown(layer, step, loops["ours"], repeats)))
    print(f"{'both':<7} {'':>16} {'':>2} {'':>3} | {totals['ours'] * 1e3:8.3f} "
          f"{totals['torch'] * 1e3:8.3f} {totals['torch'] / totals['ours']:5.2f}x |")
    print("times in ms per forward + backward; ratio = PyTorch / ours (above 1: ours is "
          "faster)")
    for name, whole, phases in details:
        parts = ", ".join(f"{phase} {t * 1e3:.2f}" for phase, t in phases.items())
        gemms = sum(t for phase, t in phases.items() if "GEMM" in phase)
        print(f"{name}: {whole * 1e3:.2f} ms; in it: {parts} ms; the GEMMs "
              f"{gemms / sum(phases.values()):.0%} of those calls")


if __name__ == "__main__":
    main()
