"""A PyTorch module through distbelief (distbelief.torch.TorchModel) against the same
module trained by plain PyTorch, same run, one thread each.

The model is examples/torch_cnn.py's CNN on Fashion-MNIST-shaped batches (64 x 28 x 28 x
1, 10 classes). Two figures, each the median over --repeats rounds, ours and PyTorch's
alternating round by round so a busy machine slows both alike:

  step     one training step: PyTorch's forward, backward and an SGD update of the
           parameters (torch.optim.SGD), against the replica's share of a distbelief step:
           the parameter vector copied into the module, forward and backward through
           model.protocol.OwnModel (its checks included), the gradient copied out, and an
           SGD update of the flat vector in numpy (a replica's own step; under Downpour
           the update is the shard's).
  ratio    PyTorch's time over ours: 1 means the adapter costs nothing; below 1, what the
           copies and checks cost.

Then, with --downpour, a Downpour run of the same CNN on 3 ranks (1 shard, 2 replicas)
on data/fashion_mnist.h5 for --seconds, and its samples/s per replica against plain
PyTorch's samples/s in one process (what a user would get without distbelief on one
core). The run oversubscribes nothing only on 3 cores or more.

    python benchmarks/bench_torch_model.py [--repeats 20] [--downpour --seconds 60]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
from torch_cnn import CNN

from distbelief.model.protocol import OwnModel
from distbelief.torch import TorchModel

BATCH, SHAPE, CLASSES, LR = 64, (28, 28, 1), 10, 0.01


def plain_step(net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor) -> None:
    opt.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    opt.step()


def our_step(model: OwnModel, params: np.ndarray, grad: np.ndarray, x: np.ndarray,
             y: np.ndarray) -> None:
    model.loss_and_grad(params, x, y, grad)
    params -= np.float32(LR) * grad


def timed(run, loops: int) -> float:
    start = time.perf_counter()
    for _ in range(loops):
        run()
    return (time.perf_counter() - start) / loops


def steps(repeats: int, loops: int) -> tuple[float, float]:
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    x = rng.random((BATCH, *SHAPE), dtype=np.float32)
    y = rng.integers(0, CLASSES, BATCH)
    torch.manual_seed(0)
    net = CNN()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    ours = OwnModel(TorchModel(CNN(), nn.CrossEntropyLoss()), SHAPE, CLASSES)
    params = ours.init_params(0)
    grad = np.empty_like(params)
    for _ in range(3):  # warm both up
        plain_step(net, opt, tx, ty)
        our_step(ours, params, grad, x, y)
    plain, mine = [], []
    for _ in range(repeats):
        plain.append(timed(lambda: plain_step(net, opt, tx, ty), loops))
        mine.append(timed(lambda: our_step(ours, params, grad, x, y), loops))
    return statistics.median(plain), statistics.median(mine)


def downpour(seconds: float) -> list[float]:
    data = REPO / "data" / "fashion_mnist.h5"
    if not data.exists():
        sys.exit(f"{data} is missing: distbelief prepare fashion-mnist")
    with tempfile.TemporaryDirectory() as out:
        cmd = ["mpiexec", "-n", "3", sys.executable, "-m", "distbelief", "train",
               str(REPO / "examples" / "torch_cnn.toml"), "--model", "torch_cnn:model",
               "--set", f'run.out_dir="{out}"', "--set", f"run.max_seconds={seconds}",
               "--set", "run.target_accuracy=0.99", "--fresh"]
        subprocess.run(cmd, check=True, cwd=REPO / "examples", stdout=subprocess.DEVNULL)
        summary = json.loads((Path(out) / "summary.json").read_text())
    return [r["samples_per_second"] for r in summary["replicas"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--loops", type=int, default=5)
    parser.add_argument("--downpour", action="store_true")
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    plain, mine = steps(args.repeats, args.loops)
    print(f"CNN step, batch {BATCH}, 1 thread (median of {args.repeats} x {args.loops}):")
    print(f"  PyTorch alone        {plain * 1e3:8.2f} ms  ({BATCH / plain:,.0f} samples/s)")
    print(f"  through TorchModel   {mine * 1e3:8.2f} ms  ({BATCH / mine:,.0f} samples/s)")
    print(f"  ratio (PyTorch / ours): {plain / mine:.3f}")
    if args.downpour:
        rates = downpour(args.seconds)
        print(f"Downpour, 1 shard + 2 replicas, {args.seconds:g} s: samples/s per replica "
              f"{', '.join(f'{r:,.0f}' for r in rates)}; sum {sum(rates):,.0f}; "
              f"ratio (sum / PyTorch alone): {sum(rates) * plain / BATCH:.2f}")


if __name__ == "__main__":
    main()
