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
    python benchmarks/bench_subnormals.py --data speech.h5  # batches from a data file

With --data, the saturating steps and the timed one draw batches from the file's first
4,096 training rows (a speech-shaped file: `distbelief prepare synthetic --out speech.h5
--train 20000 --test 2000 --shape 440 --classes 8192`, whose labels come from a teacher
network, so the model saturates as it does in training; random labels saturate less).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # after the thread count

from distbelief.data.hdf5 import open_dataset, read_rows
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
    parser.add_argument("--data", help="a speech-shaped dataset file to draw batches from")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    network = Network((440,), LAYERS, 8192)
    params = network.init_params(0)
    grad = np.zeros_like(params)
    if args.data:
        info = open_dataset(args.data)
        x_stored, y_all = read_rows(info, "train", 0, 4096)
        pool = (x_stored.astype(np.float32) * np.float32(info.scale)).reshape(-1, 440), y_all
    else:
        pool = (rng.random((4096, 440), dtype=np.float32),
                rng.integers(0, 8192, 4096).astype(np.int32))

    def batch() -> tuple[np.ndarray, np.ndarray]:
        at = int(rng.integers(0, len(pool[1]) - 128))
        return pool[0][at:at + 128], pool[1][at:at + 128]

    x, y = batch()
    kernels.flush_subnormals(False)
    optimizer = Adagrad(params.size, 0.02)
    fresh = step_seconds(network, params, x, y, grad)
    for _ in range(args.saturate):  # a new batch each step, as training draws them
        xs, ys = batch()
        loss = network.loss_and_grad(params, xs, ys, grad)
        optimizer.step(params, grad)
    print(f"speech model, {params.size:,d} parameters, batch 128, 1 BLAS thread, "
          f"{'data ' + args.data if args.data else 'random data'}; after "
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
