"""Measure the fused Adagrad kernel against the memory bound and against numpy's expression.

What is measured (one thread, arrays far beyond the caches, median of --repeats runs):

* kernel: distbelief.model.kernels.adagrad_update on P params. It reads params, accum and grad
  and writes params and accum: 5 float32 = 20 bytes of memory traffic per parameter.
* copy: np.copyto between two float32 arrays of 10 bytes per parameter each, i.e. the same
  20 bytes per parameter of traffic (read + write). This is the practical memory bound.
* numpy: the same update written as numpy expressions (temporaries, several passes).
* sgd: distbelief.model.kernels.sgd_update (12 bytes per parameter), for reference.
* adarevision: distbelief.model.optimizers.AdaRevision.step, a shard's fold with
  optimizer.update = "adarevision", on a gradient 3 versions stale: the fused kernel
  (reads params, gsum, z, zmax, the fetched gsum and grad, writes params, gsum, z, zmax:
  40 bytes per parameter) and the copy of gsum into its history slot (8 more). Printed
  against adagrad_update in the same run, as a time ratio, and against the same update
  written as numpy expressions.

GB/s counts traffic as defined above (10^9 bytes per second); Gparam/s is parameters
updated per second. The ratio kernel/copy is the fraction of the memory bound reached.

    python benchmarks/bench_adagrad.py [--size 10000000] [--repeats 9]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from distbelief.model import kernels
from distbelief.model.optimizers import AdaRevision

ADAGRAD_BYTES_PER_PARAM = 20  # read params, accum, grad; write params, accum
SGD_BYTES_PER_PARAM = 12  # read params, grad; write params
ADAREVISION_BYTES_PER_PARAM = 48  # kernel: read 6, write 4 arrays; history: read 1, write 1


def median_seconds(run: Callable[[], None], repeats: int) -> float:
    """Median wall time of run() over repeats calls, after one warm-up call."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def numpy_adagrad(params: np.ndarray, accum: np.ndarray, grad: np.ndarray, lr: float,
                  eps: float) -> None:
    accum += grad * grad
    params -= lr * grad / (np.sqrt(accum) + eps)


def numpy_adarevision(opt: AdaRevision, params: np.ndarray, grad: np.ndarray,
                      fetched: np.ndarray) -> None:
    """The same rule as the kernel, as numpy expressions (what a shard would run without
    the kernel)."""
    backlog = opt.gsum - fetched
    eta_old = opt.learning_rate / (np.sqrt(opt.zmax) + opt.eps)
    opt.z += grad * (grad + 2 * backlog)
    np.maximum(opt.zmax, opt.z, out=opt.zmax)
    eta = opt.learning_rate / (np.sqrt(opt.zmax) + opt.eps)
    params -= eta * grad - (eta_old - eta) * backlog
    opt.gsum += grad


def report(name: str, seconds: float, size: int, bytes_per_param: int) -> float:
    """Print one line and return the GB/s."""
    gparams = size / seconds / 1e9
    gbytes = size * bytes_per_param / seconds / 1e9
    print(f"{name:<34} {seconds * 1e3:8.2f} ms {gparams:8.3f} Gparam/s {gbytes:8.2f} GB/s")
    return gbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=10_000_000, help="parameters (P)")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    size, repeats = args.size, args.repeats
    lr, eps = 0.01, 1e-10

    rng = np.random.default_rng(0)
    params = rng.standard_normal(size, dtype=np.float32)
    grad = rng.standard_normal(size, dtype=np.float32)
    accum = np.zeros(size, np.float32)
    # 10 bytes per parameter each side, so the copy moves the kernel's 20 bytes/param.
    copy_len = size * ADAGRAD_BYTES_PER_PARAM // 2 // 4
    src = rng.standard_normal(copy_len, dtype=np.float32)
    dst = np.empty_like(src)

    print(f"P = {size:,} float32 parameters ({size * 4 / 1e6:.0f} MB per array), "
          f"median of {repeats} runs, one thread")
    print(f"traffic counted: Adagrad {ADAGRAD_BYTES_PER_PARAM} B/param, "
          f"SGD {SGD_BYTES_PER_PARAM} B/param, copy = bytes read + bytes written")
    kernel_gbs = report("adagrad_update (fused kernel)",
                        median_seconds(lambda: kernels.adagrad_update(params, accum, grad,
                                                                      lr, eps), repeats),
                        size, ADAGRAD_BYTES_PER_PARAM)
    copy_gbs = report("np.copyto, same bytes",
                      median_seconds(lambda: np.copyto(dst, src), repeats),
                      size, ADAGRAD_BYTES_PER_PARAM)
    numpy_gbs = report("numpy expression",
                       median_seconds(lambda: numpy_adagrad(params, accum, grad, lr, eps),
                                      repeats),
                       size, ADAGRAD_BYTES_PER_PARAM)
    report("sgd_update (fused kernel)",
           median_seconds(lambda: kernels.sgd_update(params, grad, lr), repeats),
           size, SGD_BYTES_PER_PARAM)
    print(f"ratio kernel/copy {kernel_gbs / copy_gbs:.2f} (target >= 0.7); "
          f"numpy/copy {numpy_gbs / copy_gbs:.2f}")

    # AdaRevision: a shard's whole fold (kernel + history copy), 3 versions stale.
    opt = AdaRevision(size, lr)
    version = [0]

    def revise() -> None:
        opt.step(params, grad, version=version[0] + 3, fetched=version[0])
        version[0] += 1

    # Touch every history slot first: a first write to fresh pages costs page faults
    # (measured here at ~300 ms per 20 MB slot on a loaded machine), paid once per run.
    for _ in range(opt.history):
        revise()
    adagrad_s = median_seconds(lambda: kernels.adagrad_update(params, accum, grad, lr, eps),
                               repeats)
    revision_s = median_seconds(revise, repeats)
    report("AdaRevision.step (kernel + history)", revision_s, size,
           ADAREVISION_BYTES_PER_PARAM)
    fetched = opt.history_00
    numpy_s = median_seconds(lambda: numpy_adarevision(opt, params, grad, fetched), repeats)
    report("AdaRevision as numpy expressions", numpy_s, size, ADAREVISION_BYTES_PER_PARAM)
    print(f"adarevision/adagrad time {revision_s / adagrad_s:.2f} (fold throughput "
          f"{adagrad_s / revision_s:.2f}x Adagrad's); numpy/kernel {numpy_s / revision_s:.2f}")


if __name__ == "__main__":
    main()
