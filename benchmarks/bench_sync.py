"""Synchronous data-parallel SGD: distbelief's `algorithm = "sync"` against PyTorch DDP
(gloo backend), time to a test accuracy on the reference MLP at 2 replicas.

Task, the same on both sides: MLP 784-512-512-10 (ReLU, softmax cross-entropy; He/Glorot
uniform init, zero biases), Adagrad lr 0.02, batch 64 per replica, Fashion-MNIST
(data/fashion_mnist.h5, from `distbelief prepare fashion-mnist --out data/fashion_mnist.h5`).
Each replica trains on its own contiguous half of the training set (a fresh permutation of
it per epoch), the two gradients are averaged every step, one BLAS / torch thread per
process. Both evaluate every `--eval-every` seconds of wall time (rank 0's clock, counted
from the end of the previous evaluation), each replica on half of the test set, the counts
summed: distbelief's trainer does this, and the peer does the same with a one-integer
all_reduce per step (the flag) and one after each evaluation.

- ours: the real command line, `mpiexec -n 2 python -m distbelief train
  configs/fashion_mnist_mlp.toml --set optimizer.algorithm="sync"`; its time is
  summary.json's time_to_target (from the run's start, after loading the data).
- peer: torch.nn.parallel.DistributedDataParallel over 2 processes
  (torch.multiprocessing, init over a file, gloo), torch.optim.Adagrad; timed from a
  barrier after set-up.

Prints one row per seed and the median, with the ratio ours / peer (below 1: distbelief
is faster). Other processes on the machine distort both; the load average is shown.

    python benchmarks/bench_sync.py                # 1 seed, ~2-4 minutes
    python benchmarks/bench_sync.py --seeds 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "fashion_mnist_mlp.toml"
sys.path.insert(0, str(Path(__file__).resolve().parent))


# -- ours -------------------------------------------------------------------------------------


def ours(args: argparse.Namespace, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        sets = [f'data.path="{args.data.resolve()}"', 'optimizer.algorithm="sync"',
                f"optimizer.learning_rate={args.lr}", f"data.batch_size={args.batch_size}",
                f"run.target_accuracy={args.target}", f"run.max_seconds={args.max_seconds}",
                f"run.eval_every_seconds={args.eval_every}", f"run.seed={seed}",
                "run.threads=1", "run.checkpoint_every_seconds=0", f'run.out_dir="{out}"']
        cmd = ["mpiexec", "-n", str(args.replicas), sys.executable, "-m", "distbelief",
               "train", str(CONFIG), *[a for s in sets for a in ("--set", s)]]
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False,
                                timeout=args.max_seconds + 300)
        if result.returncode != 0:
            raise RuntimeError(f"{cmd} failed:\n{result.stderr[-3000:]}")
        summary = json.loads((out / "summary.json").read_text())
    return {"time_to_target": summary["time_to_target"], "steps": summary["steps"],
            "final_test_accuracy": summary["final_test_accuracy"]}


# -- the peer: PyTorch DDP ----------------------------------------------------------------------


def ddp_worker(rank: int, world: int, init_file: str, args: argparse.Namespace, seed: int,
               result_file: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch_peer import Batches, load_split, make_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    x, y = load_split(args.data, "train")
    bounds = [len(x) * r // world for r in range(world + 1)]  # TrainShard's contiguous split
    x, y = x[bounds[rank]:bounds[rank + 1]], y[bounds[rank]:bounds[rank + 1]]
    test_x, test_y = load_split(args.data, "test")
    tb = [len(test_x) * r // world for r in range(world + 1)]
    test_x, test_y = test_x[tb[rank]:tb[rank + 1]], test_y[tb[rank]:tb[rank + 1]]
    model = DistributedDataParallel(make_model(seed))  # broadcasts rank 0's init
    optimizer = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    batches = Batches(x, y, args.batch_size, seed * 1000 + rank)
    flag, counts = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
    dist.barrier()
    start = time.perf_counter()
    next_eval = start + args.eval_every
    steps, accuracy, reached = 0, math.nan, None
    while True:
        xb, yb = batches.next()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(xb), yb).backward()  # DDP averages the gradients here
        optimizer.step()
        steps += 1
        now = time.perf_counter()
        flag[0] = (2 if now - start >= args.max_seconds else int(now >= next_eval)) \
            if rank == 0 else 0
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag[0] == 2:
            break
        if flag[0] == 1:
            with torch.no_grad():  # in batches of 1000, as distbelief evaluates
                counts[0] = sum(int((model(test_x[i:i + 1000]).argmax(dim=1)
                                     == test_y[i:i + 1000]).sum())
                                for i in range(0, len(test_x), 1000))
            dist.all_reduce(counts)
            accuracy = int(counts[0]) / (tb[-1])
            if accuracy >= args.target:
                reached = time.perf_counter() - start
                break
            next_eval = time.perf_counter() + args.eval_every
    if rank == 0:
        Path(result_file).write_text(json.dumps(
            {"time_to_target": reached, "steps": steps, "final_test_accuracy": accuracy}))
    dist.destroy_process_group()


def peer(args: argparse.Namespace, seed: int) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init_file, result_file = str(Path(tmp) / "init"), str(Path(tmp) / "result.json")
        mp.spawn(ddp_worker, args=(args.replicas, init_file, args, seed, result_file),
                 nprocs=args.replicas, join=True)
        return json.loads(Path(result_file).read_text())


# -- the table --------------------------------------------------------------------------------


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}"


def rate(run: dict) -> str:
    seconds = run["time_to_target"]
    return "-" if not seconds else f"{run['steps'] / seconds:.1f}"


def median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if len(known) == len(values) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=REPO / "data" / "fashion_mnist.h5")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--target", type=float, default=0.88)
    parser.add_argument("--eval-every", type=float, default=2.0)
    parser.add_argument("--max-seconds", type=float, default=300.0)
    args = parser.parse_args()
    print(f"sync SGD vs PyTorch DDP (gloo), reference MLP, {args.replicas} replicas, batch "
          f"{args.batch_size} per replica, Adagrad lr {args.lr}, time to {args.target:.2f} "
          f"test accuracy (s)")
    # Steps per second (to the target, evaluations included) is the less noisy figure:
    # when an evaluation first sees the target depends on the eval cadence's timing.
    print(f"{'seed':>4}  {'load':>5}  {'ours':>7}  {'ddp':>7}  {'ours/ddp':>8}  "
          f"{'ours steps':>10}  {'ddp steps':>9}  {'ours steps/s':>12}  {'ddp steps/s':>11}")
    rows = []
    for seed in range(args.seeds):
        load = os.getloadavg()[0]
        a, b = ours(args, seed), peer(args, seed)  # one after the other, same load
        rows.append((a, b))
        print(f"{seed:>4}  {load:>5.1f}  {fmt(a['time_to_target']):>7}  "
              f"{fmt(b['time_to_target']):>7}  "
              f"{ratio(a['time_to_target'], b['time_to_target']):>8}  {a['steps']:>10}  "
              f"{b['steps']:>9}  {rate(a):>12}  {rate(b):>11}", flush=True)
    m_ours = median([a["time_to_target"] for a, _ in rows])
    m_peer = median([b["time_to_target"] for _, b in rows])
    print(f"median      {fmt(m_ours):>7}  {fmt(m_peer):>7}  {ratio(m_ours, m_peer):>8}")


if __name__ == "__main__":
    main()
