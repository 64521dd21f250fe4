"""Measure the fused Adagrad kernel against the memory bound and against numpy's expression.

What is measured (one thread, arrays far beyond the caches, median of --repeats runs):

* kernel: distbelief.model.kernels.adagrad_update on P params. It reads params, accum and grad
  and writes params and accum: 5 float32 = 20 bytes of memory traffic per parameter.
* copy: np.copyto between two float32 arrays of 10 bytes per parameter each, i.e. the same
  20 bytes per parameter of traffic (read + write). This is the practical memory bound.
* numpy: the same update written as numpy expressions (temporaries, several passes).
* sgd: distbelief.model.kernels.sgd_update (12 bytes per parameter), for reference.

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

ADAGRAD_BYTES_PER_PARAM = 20  # read params, accum, grad; write params, accum
SGD_BYTES_PER_PARAM = 12  # read params, grad; write params


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


if __name__ == "__main__":
    main()
