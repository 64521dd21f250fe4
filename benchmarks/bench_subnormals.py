"""The paper's speech model with saturated parameters: a training step with subnormal floats
kept (IEEE, numpy's default) against flushed to zero (FTZ/DAZ, distbelief's default since
issue 31), in the same process.

The model: configs/paper_speech_42m.toml (440 inputs, 4 x 2560 sigmoid, 8192 softmax, 42M
parameters), batch 128, random inputs in [0, 1) and random labels. It is first trained
`--saturate` steps with Adagrad at the default learning rate 0.02, subnormals kept, which
is what filled its gradients with subnormals in the issue's run. Then `Network.loss_and_grad`
on that state is timed `--repeats` times in each mode, alternated, one BLAS thread; the
printed ratio is the median step time kept / flushed, with the number of subnormal entries
in each mode's gradient.

    python benchmarks/bench_subnormals.py                 # about 2 minutes
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # after the thread count

from distbelief.model import kernels
from distbelief.model.network import Network
from distbelief.model.optimizers import Adagrad

LAYERS = [*({"type": "dense", "units": 2560, "activation": "sigmoid"} for _ in range(4)),
          {"type": "dense", "units": 8192, "activation": "softmax"}]
TINY = np.finfo(np.float32).tiny  # the smallest normal float32


def subnormals(a: np.ndarray) -> int:
    return int(np.count_nonzero((a != 0) & (np.abs(a) < TINY)))


def step_seconds(network: Network, params: np.ndarray, x: np.ndarray, y: np.ndarray,
                 grad: np.ndarray) -> float:
    t0 = time.perf_counter()
    network.loss_and_grad(params, x, y, grad)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saturate", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    network = Network((440,), LAYERS, 8192)
    params = network.init_params(0)
    grad = np.zeros_like(params)
    x = rng.random((128, 440), dtype=np.float32)
    y = rng.integers(0, 8192, 128).astype(np.int32)
    kernels.flush_subnormals(False)
    optimizer = Adagrad(params.size, 0.02)
    fresh = step_seconds(network, params, x, y, grad)
    for _ in range(args.saturate):  # a new batch each step, as training draws them
        xs = rng.random((128, 440), dtype=np.float32)
        ys = rng.integers(0, 8192, 128).astype(np.int32)
        loss = network.loss_and_grad(params, xs, ys, grad)
        optimizer.step(params, grad)
    print(f"speech model, {params.size:,d} parameters, batch 128, 1 BLAS thread; after "
          f"{args.saturate} Adagrad steps at lr 0.02: loss {loss:.2f}, load average "
          f"{os.getloadavg()[0]:.2f}")
    times: dict[bool, list[float]] = {False: [], True: []}
    counts: dict[bool, int] = {}
    for _ in range(args.repeats):
        for flush in (False, True):
            kernels.flush_subnormals(flush)
            times[flush].append(step_seconds(network, params, x, y, grad))
            counts[flush] = subnormals(grad)
    kernels.flush_subnormals(False)
    for flush, name in ((False, "kept"), (True, "flushed")):
        print(f"  subnormals {name:>7}: step {', '.join(f'{t:.3f}' for t in times[flush])} s "
              f"(median {statistics.median(times[flush]):.3f}); {counts[flush]:,d} subnormal "
              f"gradient entries")
    kept, flushed = (statistics.median(times[f]) for f in (False, True))
    print(f"  kept / flushed: {kept / flushed:.1f}x; a step on fresh parameters: {fresh:.3f} s")


if __name__ == "__main__":
    main()
