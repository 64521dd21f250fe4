"""Hogwild here against PyTorch's Hogwild: time to a test accuracy, same model, data, init,
batch, learning rate and optimizer, printed side by side with the ratio.

Ours: `mpiexec -n R python -m distbelief train configs/fashion_mnist_mlp.toml` with
optimizer.algorithm = "hogwild", run.threads = 1 (one BLAS thread per rank); the
figure is summary.json's time_to_target (from the start of training, evaluations
included).

The peer: the idiom of PyTorch's own Hogwild example (examples/mnist_hogwild):
torch.multiprocessing, model.share_memory(), and here torch.optim.Adagrad's state in
shared memory too (optimizer.share_memory()), R processes, torch.set_num_threads(1) each.
Model, init, batching and evaluation cadence are benchmarks/torch_peer.py's (the reference
MLP 784-512-512-10, Adagrad lr 0.02, batch 64); process r trains on the r-th contiguous
part of the training set (distbelief's TrainShard split), and process 0 evaluates the live
shared model every --eval-every seconds counted from the end of the previous evaluation,
evaluation time included, as distbelief's rank 0 does. The clock starts once
every process is ready.

    python benchmarks/bench_hogwild.py --data data/fashion_mnist.h5 --replicas 2 --repeats 3

Prints one line per run and a JSON summary: the median time to target of each and the
ratio ours / torch (below 1: ours is faster).
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))


def run_ours(args: argparse.Namespace, out: Path) -> dict:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    sets = [f'run.out_dir="{out}"', 'optimizer.algorithm="hogwild"', "run.threads=1",
            f'data.path="{args.data.resolve()}"', f"run.target_accuracy={args.target}",
            f"run.eval_every_seconds={args.eval_every}", f"run.max_seconds={args.max_seconds}",
            f"optimizer.learning_rate={args.lr}", "run.checkpoint_every_seconds=0"]
    cmd = ["mpiexec", "-n", str(args.replicas), sys.executable, "-m", "distbelief", "train",
           str(REPO / "configs" / "fashion_mnist_mlp.toml"), "--fresh",
           *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          timeout=args.max_seconds + 120, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"distbelief failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {"impl": "distbelief hogwild", "time_to_target": summary["time_to_target"],
            "steps": summary["steps"], "final_test_accuracy": summary["final_test_accuracy"],
            "samples_per_second": summary["samples_per_second"]}


def _torch_worker(rank: int, args: argparse.Namespace, model, optimizer, ready, stop,
                  steps, result) -> None:
    import torch
    from torch_peer import Batches, evaluate, load_split, train_step

    torch.set_num_threads(1)
    x, y = load_split(args.data, "train")
    lo, hi = len(x) * rank // args.replicas, len(x) * (rank + 1) // args.replicas
    batches = Batches(x[lo:hi].contiguous(), y[lo:hi].contiguous(), args.batch_size,
                      args.seed + rank)
    test = load_split(args.data, "test") if rank == 0 else None
    ready.wait()
    start = time.perf_counter()
    next_eval = start + args.eval_every
    done = 0
    while not stop.is_set():
        train_step(model, optimizer, *batches.next())
        done += 1
        if rank != 0:
            continue
        now = time.perf_counter()
        if now - start >= args.max_seconds:
            stop.set()
        elif now >= next_eval:
            accuracy = evaluate(model, *test)
            if accuracy >= args.target:
                result["time_to_target"] = time.perf_counter() - start
                result["final_test_accuracy"] = accuracy
                stop.set()
            next_eval = time.perf_counter() + args.eval_every
    with steps.get_lock():
        steps.value += done
    if rank == 0:
        result["wall_seconds"] = time.perf_counter() - start


def run_torch(args: argparse.Namespace) -> dict:
    import torch
    import torch.multiprocessing as mp
    from torch_peer import make_model

    torch.set_num_threads(1)
    model = make_model(args.seed)
    model.share_memory()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    optimizer.share_memory()  # the accumulator is shared too: Hogwild with Adagrad
    ctx = mp.get_context("fork")
    ready, stop = ctx.Barrier(args.replicas + 1), ctx.Event()
    steps = ctx.Value("q", 0)
    manager = ctx.Manager()
    result = manager.dict()
    procs = [ctx.Process(target=_torch_worker,
                         args=(r, args, model, optimizer, ready, stop, steps, result))
             for r in range(args.replicas)]
    for p in procs:
        p.start()
    ready.wait()
    for p in procs:
        p.join(args.max_seconds + 60)
    out = dict(result)
    manager.shutdown()
    wall = out.get("wall_seconds", math.nan)
    return {"impl": "torch hogwild", "time_to_target": out.get("time_to_target"),
            "steps": steps.value, "final_test_accuracy": out.get("final_test_accuracy"),
            "samples_per_second": steps.value * args.batch_size / wall}


def median_time(runs: list[dict], limit: float) -> float | None:
    """The median time to target; a run that missed it counts as `limit` (its budget), so
    the median is then a lower bound; None if most runs missed it."""
    times = [limit if r["time_to_target"] is None else r["time_to_target"] for r in runs]
    missed = sum(r["time_to_target"] is None for r in runs)
    return None if missed > len(runs) // 2 else statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=REPO / "data" / "fashion_mnist.h5")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.88)
    parser.add_argument("--eval-every", type=float, default=2.0)
    parser.add_argument("--max-seconds", type=float, default=120.0)
    args = parser.parse_args()
    if not args.data.exists():
        raise SystemExit(f"{args.data}: no such file; make it with "
                         f"`distbelief prepare fashion-mnist --out {args.data}`")
    ours, theirs = [], []
    with tempfile.TemporaryDirectory(prefix="bench-hogwild-") as tmp:
        for i in range(args.repeats):  # interleaved, so load drifts hit both alike
            ours.append(run_ours(args, Path(tmp) / f"run{i}"))
            print(json.dumps({**ours[-1], "load": os.getloadavg()[0]}), flush=True)
            theirs.append(run_torch(args))
            print(json.dumps({**theirs[-1], "load": os.getloadavg()[0]}), flush=True)
    a, b = median_time(ours, args.max_seconds), median_time(theirs, args.max_seconds)
    rate = statistics.median
    print(json.dumps({
        "replicas": args.replicas, "target": args.target, "repeats": args.repeats,
        "ours_median_s": a, "torch_median_s": b,
        "missed": {"ours": sum(r["time_to_target"] is None for r in ours),
                   "torch": sum(r["time_to_target"] is None for r in theirs)},
        "ratio_ours_over_torch": a / b if a and b else None,
        "samples_per_second": {"ours": rate(r["samples_per_second"] for r in ours),
                               "torch": rate(r["samples_per_second"] for r in theirs)},
        "load": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
