"""The image layers' kernels against PyTorch CPU doing the same op, 1 thread, same run.

For each op and shape: our forward and backward kernels (NHWC, as the network stores
activations) and PyTorch's (its default NCHW layout, and channels_last, the faster of the
two is the peer), float32, one thread. Each figure is the median over --repeats rounds;
ours and PyTorch's alternate round by round, so a busy machine slows both alike. The
ratio is PyTorch's time over ours: above 1, ours is faster.

    op          ours                           PyTorch
    max pool    kernels.pool_forward/backward   F.max_pool2d (backward: autograd)
                (forward saving the argmax)
    L2 pool     kernels.pool_forward/backward   F.lp_pool2d(p=2)
    lcn         kernels.lcn_forward/backward    conv2d with the fixed Gaussian over the
                                                window and all channels (as the tests)

PyTorch's forward runs with requires_grad (what a training step does: max_pool2d then
keeps its argmax indices); its backward is torch.autograd.grad over the recorded graph.

--clock cpu times with the process's CPU time instead of the wall clock: on a machine
other jobs load, the wall clock also counts their time slices (the two alternate, so the
ratio holds roughly, but each figure swings); CPU time counts only this process's work.

    python benchmarks/bench_layers.py [--repeats 15] [--quick] [--clock wall|cpu]

--step CONFIG times instead one training step of a config's model (Network.loss_and_grad
at its batch size, on random 28x28x1 inputs, one thread): the fastest and the median of
--repeats rounds of 20 steps, in the chosen clock (no PyTorch).

    python benchmarks/bench_layers.py --step configs/fashion_mnist_image.toml --clock cpu
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from distbelief.model import kernels

# (name, N, H, W, C, kernel, stride): the sizes of configs/fashion_mnist_image.toml's
# layers at batch 64, and larger maps nearer the paper's (batch 32).
CASES = [
    ("max pool", 64, 24, 24, 8, 2, 2),
    ("max pool", 32, 96, 96, 16, 2, 2),
    ("max pool", 32, 64, 64, 16, 3, 2),
    ("L2 pool", 64, 24, 24, 8, 2, 2),
    ("L2 pool", 32, 96, 96, 16, 2, 2),
    ("L2 pool", 32, 64, 64, 16, 3, 2),
    ("lcn", 64, 12, 12, 8, 5, 1),
    ("lcn", 64, 5, 5, 16, 3, 1),
    ("lcn", 32, 48, 48, 16, 9, 1),
]


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def timed(run: Callable[[], object], loops: int) -> float:
    start = clock()
    for _ in range(loops):
        run()
    return (clock() - start) / loops


def ours(name: str, x: np.ndarray, dout: np.ndarray, kernel: int, stride: int
         ) -> tuple[Callable, Callable]:
    if name == "lcn":
        out = np.empty_like(x)
        dx = np.empty_like(x)
        return (lambda: kernels.lcn_forward(x, out, kernel, 0.1),
                lambda: kernels.lcn_backward(x, dout, dx, kernel, 0.1))
    mode = "max" if name == "max pool" else "l2"
    out = np.empty_like(dout)
    dx = np.empty_like(x)
    # A training step's forward: max pooling saves its argmax for the backward.
    argmax = np.empty(dout.shape, dtype=np.int32) if mode == "max" else None
    kernels.pool_forward(x, out, kernel, stride, mode, argmax)
    return (lambda: kernels.pool_forward(x, out, kernel, stride, mode, argmax),
            lambda: kernels.pool_backward(x, out, dout, dx, kernel, stride, mode, argmax))


def theirs(torch, name: str, x: np.ndarray, dout: np.ndarray, kernel: int, stride: int,
           channels_last: bool) -> tuple[Callable, Callable]:
    fn = torch.nn.functional
    memory = torch.channels_last if channels_last else torch.contiguous_format
    xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous(memory_format=memory)
    xt.requires_grad_(True)
    gt = torch.from_numpy(dout).permute(0, 3, 1, 2).contiguous(memory_format=memory)
    if name == "lcn":
        channels = x.shape[3]
        g = torch.from_numpy(kernels.gaussian_window(kernel))
        weight = (torch.outer(g, g) / channels).expand(1, channels, kernel, kernel)
        weight = weight.contiguous(memory_format=memory)

        def forward():
            v = xt - fn.conv2d(xt, weight, padding=kernel // 2)
            sigma = torch.sqrt(fn.conv2d(v * v, weight, padding=kernel // 2))
            return v / torch.clamp(sigma, min=0.1)
    elif name == "max pool":
        def forward():
            return fn.max_pool2d(xt, kernel, stride)
    else:
        def forward():
            return fn.lp_pool2d(xt, 2, kernel, stride)
    y = forward()
    return forward, lambda: torch.autograd.grad(y, xt, gt, retain_graph=True)


def step_time(config: str, repeats: int) -> None:
    """Print the time of one training step of `config`'s model."""
    import tomllib

    from distbelief.model.network import Network

    with open(config, "rb") as f:
        spec = tomllib.load(f)
    layers, batch = spec["model"]["layers"], spec["data"]["batch_size"]
    classes = layers[-1]["units"]
    net = Network((28, 28, 1), layers, classes)
    rng = np.random.default_rng(0)
    params = net.init_params(0)
    grad = np.empty_like(params)
    x = rng.random((batch, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, classes, batch)
    step = lambda: net.loss_and_grad(params, x, y, grad)
    step()
    times = [timed(step, 20) for _ in range(repeats)]
    print(f"{config}: one step (batch {batch}) {min(times) * 1e3:.3f} ms fastest, "
          f"{statistics.median(times) * 1e3:.3f} ms median of {repeats} rounds of 20; "
          f"load average {os.getloadavg()[0]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="rounds per figure")
    parser.add_argument("--quick", action="store_true", help="3 rounds, for a smoke test")
    parser.add_argument("--clock", choices=CLOCKS, default="wall",
                        help="wall clock (default) or this process's CPU time")
    parser.add_argument("--step", metavar="CONFIG",
                        help="time one training step of CONFIG's model instead")
    args = parser.parse_args()
    repeats = 3 if args.quick else args.repeats
    global clock
    clock = CLOCKS[args.clock]
    from threadpoolctl import threadpool_limits
    threadpool_limits(1)
    if args.step:
        step_time(args.step, repeats)
        return

    import torch  # a benchmark peer only, never a dependency
    torch.set_num_threads(1)

    print(f"PyTorch {torch.__version__}, 1 thread, float32; median of {repeats} rounds; "
          f"{args.clock} clock; load average {os.getloadavg()[0]:.1f}")
    print(f"{'op':<9} {'N x H x W x C':>16} {'k/s':>5} | {'ours fwd':>9} {'torch fwd':>9} "
          f"{'ratio':>6} | {'ours bwd':>9} {'torch bwd':>9} {'ratio':>6} | torch layout")
    rng = np.random.default_rng(0)
    for name, n, h, w, c, kernel, stride in CASES:
        x = rng.standard_normal((n, h, w, c)).astype(np.float32)
        out_h, out_w = ((h, w) if name == "lcn"
                        else ((h - kernel) // stride + 1, (w - kernel) // stride + 1))
        dout = rng.standard_normal((n, out_h, out_w, c)).astype(np.float32)
        runs = {"ours": ours(name, x, dout, kernel, stride),
                "NCHW": theirs(torch, name, x, dout, kernel, stride, False),
                "NHWC": theirs(torch, name, x, dout, kernel, stride, True)}
        # Loops long enough (~20 ms) that the timer's resolution does not matter.
        loops = {key: max(1, int(0.02 / max(timed(f, 1), 1e-6)))
                 for key, pair in runs.items() for f in pair[:1]}
        times: dict[tuple[str, int], list[float]] = {}
        for _ in range(repeats):
            for key, pair in runs.items():
                for direction, run in enumerate(pair):
                    times.setdefault((key, direction), []).append(timed(run, loops[key]))
        med = {k: statistics.median(v) for k, v in times.items()}
        peer = min(("NCHW", "NHWC"), key=lambda k: med[(k, 0)] + med[(k, 1)])
        shape = f"{n}x{h}x{w}x{c}"
        print(f"{name:<9} {shape:>16} {kernel:>2}/{stride:<2} | "
              f"{med[('ours', 0)] * 1e3:8.3f}m {med[(peer, 0)] * 1e3:8.3f}m "
              f"{med[(peer, 0)] / med[('ours', 0)]:5.2f}x | "
              f"{med[('ours', 1)] * 1e3:8.3f}m {med[(peer, 1)] * 1e3:8.3f}m "
              f"{med[(peer, 1)] / med[('ours', 1)]:5.2f}x | {peer}", flush=True)
    print("times in ms per call; ratio = PyTorch / ours (above 1: ours is faster)")


if __name__ == "__main__":
    main()
