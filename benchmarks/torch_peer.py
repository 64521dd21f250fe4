"""The PyTorch peer of bench_train.py: the reference MLP trained the idiomatic torch way.

Same task as distbelief's single-process trainer: MLP 784-512-512-10 (ReLU, softmax
cross-entropy), uniform He init for the ReLU layers and uniform Glorot for the output layer,
zero biases (distbelief's scheme), torch.optim.Adagrad(lr=0.02) with its defaults, batch 64.
The training set lives in memory as one float32 tensor; batches are consecutive slices of
a fresh permutation per epoch, the last batch of an epoch completed from the next one (the
batching scheme of distbelief.data.hdf5.TrainShard); no DataLoader. Evaluation: the whole test
set in batches of 1000 under torch.no_grad(), every `eval_every` seconds of wall time counted
from the end of the previous evaluation, evaluation time included (distbelief's cadence).

Run as a script; prints one JSON object:
    python benchmarks/torch_peer.py throughput --threads 1 --steps 2000
    python benchmarks/torch_peer.py target --threads 1 --target 0.88
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import h5py
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


def load_split(path: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x float32 (N, 784) scaled to [0, 1], y int64) of one split of a distbelief file."""
    with h5py.File(path, "r") as f:
        x = f[f"{split}/x"][...]
        y = f[f"{split}/y"][...]
        scale = float(f[f"{split}/x"].attrs.get("scale", 1.0))
    x = torch.from_numpy(x.reshape(len(x), -1).astype(np.float32) * np.float32(scale))
    return x.contiguous(), torch.from_numpy(y.astype(np.int64))


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10))
    with torch.no_grad():
        for layer in (model[0], model[2]):
            nn.init.kaiming_uniform_(layer.weight, nonlinearity="relu")  # sqrt(6 / fan_in)
            layer.bias.zero_()
        nn.init.xavier_uniform_(model[4].weight)  # sqrt(6 / (fan_in + fan_out))
        model[4].bias.zero_()
    return model


class Batches:
    """Consecutive slices of one permutation per epoch; every batch full."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int):
        self.x, self.y, self.batch_size = x, y, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.perm = torch.randperm(len(x), generator=self.generator)
        self.position = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        stop = self.position + self.batch_size
        if stop <= len(self.perm):
            index = self.perm[self.position:stop]
            self.position = stop
        else:
            head = self.perm[self.position:]
            self.perm = torch.randperm(len(self.x), generator=self.generator)
            self.position = self.batch_size - len(head)
            index = torch.cat([head, self.perm[:self.position]])
        return self.x.index_select(0, index), self.y.index_select(0, index)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    correct = 0
    for start in range(0, len(x), 1000):
        logits = model(x[start:start + 1000])
        correct += int((logits.argmax(dim=1) == y[start:start + 1000]).sum())
    return correct / len(x)


def setup(args: argparse.Namespace):
    torch.set_num_threads(args.threads)
    x, y = load_split(args.data, "train")
    model = make_model(args.seed)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    return model, optimizer, Batches(x, y, args.batch_size, args.seed)


def throughput(args: argparse.Namespace) -> dict:
    model, optimizer, batches = setup(args)
    for _ in range(args.warmup):
        train_step(model, optimizer, *batches.next())
    start = time.perf_counter()
    for _ in range(args.steps):
        train_step(model, optimizer, *batches.next())
    seconds = time.perf_counter() - start
    return {"steps": args.steps, "seconds": seconds,
            "samples_per_second": args.steps * args.batch_size / seconds}


def time_to_target(args: argparse.Namespace) -> dict:
    model, optimizer, batches = setup(args)
    test_x, test_y = load_split(args.data, "test")
    start = time.perf_counter()
    next_eval = start + args.eval_every
    steps, accuracy, reached = 0, math.nan, None
    while True:
        train_step(model, optimizer, *batches.next())
        steps += 1
        now = time.perf_counter()
        if now - start >= args.max_seconds:
            break
        if now >= next_eval:
            accuracy = evaluate(model, test_x, test_y)
            if accuracy >= args.target:
                reached = time.perf_counter() - start
                break
            next_eval = time.perf_counter() + args.eval_every
    return {"time_to_target": reached, "steps": steps, "final_test_accuracy": accuracy,
            "wall_seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("throughput", "target"))
    parser.add_argument("--data", type=Path, default=Path("data/fashion_mnist.h5"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.88)
    parser.add_argument("--eval-every", type=float, default=2.0)
    parser.add_argument("--max-seconds", type=float, default=120.0)
    args = parser.parse_args()
    result = throughput(args) if args.mode == "throughput" else time_to_target(args)
    print(json.dumps({"impl": "torch", "mode": args.mode, "threads": args.threads, **result}))


if __name__ == "__main__":
    main()
