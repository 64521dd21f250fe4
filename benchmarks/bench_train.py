"""Single-process training: distbelief against PyTorch CPU on the reference MLP.

What it measures, for BLAS/torch thread counts 1 and 2 (each measurement in a fresh
process, so thread pools and caches do not carry over):

(a) training throughput, samples/s: `--steps` training steps after `--warmup` untimed ones,
    the best of `--repeats` runs (interleaved, so a neighbour's load hits both); a step is drawing a batch from the in-memory training set, forward, backward and the
    Adagrad update. distbelief: TrainShard.next_batch + Network.loss_and_grad +
    optimizer.step (the loop of distbelief.algorithms.sgd without its clock reads and logging).
    torch: benchmarks/torch_peer.py (index_select batch, forward, cross_entropy, backward,
    torch.optim.Adagrad.step).
(b) wall time to `--target` test accuracy (default 0.88): distbelief's real trainer
    (distbelief.algorithms.sgd.train on configs/fashion_mnist_mlp.toml) against the torch peer,
    both evaluating on the whole test set every `--eval-every` seconds of wall time counted
    from the end of the previous evaluation, evaluation time included. Setup (loading data,
    building the model) is not timed in either.

Task: MLP 784-512-512-10 ReLU, softmax cross-entropy, He/Glorot uniform init, Adagrad
lr 0.02 (eps 1e-10), batch 64, Fashion-MNIST (data/fashion_mnist.h5, made by
`distbelief prepare fashion-mnist`), same batching scheme (a fresh permutation per epoch).
Ratios are distbelief / torch: above 1 for throughput, below 1 for time, means distbelief is
faster. Other processes on the machine distort the figures, 2-thread ones most (BLAS and
OpenMP threads spin-wait for a core that is busy): each row shows the load average just
before it was measured. Time to target depends on the seed (different RNG streams in the two), so it is
noisier than throughput; `--seeds` repeats it and reports the median.

    python benchmarks/bench_train.py                 # everything, ~3 minutes
    python benchmarks/bench_train.py --no-target     # throughput only, ~1 minute
    python benchmarks/bench_train.py --no-throughput --seeds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "fashion_mnist_mlp.toml"
PEER = Path(__file__).resolve().parent / "torch_peer.py"


# -- workers: run in their own process ---------------------------------------------------------


def ours_throughput(args: argparse.Namespace) -> dict:
    from distbelief.algorithms.common import open_data
    from distbelief.config import load_config
    from distbelief.data.hdf5 import TrainShard
    from distbelief.model.optimizers import make_optimizer
    from distbelief.runtime.threads import set_blas_threads

    set_blas_threads(args.threads)
    config = load_config(CONFIG, [f'data.path="{args.data.resolve()}"',
                                  f"run.seed={args.seed}"])
    info, network = open_data(config)
    shard = TrainShard(info, seed=args.seed)
    params = network.init_params(args.seed)
    grad = params.copy()
    optimizer = make_optimizer(True, config.optimizer.learning_rate, params.size)
    batch = config.data.batch_size

    def step() -> None:
        x, y = shard.next_batch(batch)
        network.loss_and_grad(params, x, y, grad)
        optimizer.step(params, grad)

    for _ in range(args.warmup):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = time.perf_counter() - start
    return {"steps": args.steps, "seconds": seconds,
            "samples_per_second": args.steps * batch / seconds}


def ours_target(args: argparse.Namespace) -> dict:
    from distbelief.algorithms.sgd import train
    from distbelief.config import load_config

    with tempfile.TemporaryDirectory() as out:
        config = load_config(CONFIG, [
            f'data.path="{args.data.resolve()}"', f"run.threads={args.threads}",
            f"run.seed={args.seed}", f"run.target_accuracy={args.target}",
            f"run.max_seconds={args.max_seconds}", f"run.eval_every_seconds={args.eval_every}",
            "run.eval_samples=0", f'run.out_dir="{out}"'])
        summary = train(config, stream=None)
    return {key: summary[key] for key in
            ("time_to_target", "steps", "final_test_accuracy", "wall_seconds")}


# -- the driver ------------------------------------------------------------------------------------


def run_worker(impl: str, mode: str, threads: int, args: argparse.Namespace,
               seed: int = 0) -> dict:
    common = ["--threads", str(threads), "--data", str(args.data), "--steps", str(args.steps),
              "--warmup", str(args.warmup), "--seed", str(seed), "--target", str(args.target),
              "--eval-every", str(args.eval_every), "--max-seconds", str(args.max_seconds)]
    if impl == "torch":
        cmd = [sys.executable, str(PEER), mode, *common]
    else:
        cmd = [sys.executable, __file__, "--worker", mode, *common]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=args.max_seconds + 300,
                            check=False, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"{impl} {mode} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def median_time_to_target(impl: str, threads: int, args: argparse.Namespace) -> dict:
    runs = [run_worker(impl, "target", threads, args, seed) for seed in range(args.seeds)]
    times = [r["time_to_target"] for r in runs]
    reached = [t for t in times if t is not None]
    return {"median": statistics.median(reached) if len(reached) == len(times) else None,
            "times": times, "steps": [r["steps"] for r in runs]}


def fmt(value: float | None, spec: str) -> str:
    return "not reached" if value is None else format(value, spec)


def ratio(ours: float | None, peer: float | None) -> str:
    return "-" if ours is None or peer is None else f"{ours / peer:.2f}"


def throughput_table(thread_counts: list[int], args: argparse.Namespace) -> None:
    print(f"(a) training throughput, {args.steps} steps after {args.warmup} warm-up, "
          f"best of {args.repeats}")
    print(f"{'threads':>7} {'distbelief':>12} {'torch':>12} {'ratio':>6}   samples/s")
    for threads in thread_counts:
        load = os.getloadavg()[0]
        ours = peer = 0.0
        for _ in range(args.repeats):
            ours = max(ours, run_worker("ours", "throughput", threads, args)
                       ["samples_per_second"])
            peer = max(peer, run_worker("torch", "throughput", threads, args)
                       ["samples_per_second"])
        print(f"{threads:>7} {ours:>12,.0f} {peer:>12,.0f} {ratio(ours, peer):>6}   "
              f"(load before {load:.1f})", flush=True)


def target_table(thread_counts: list[int], args: argparse.Namespace) -> None:
    print(f"(b) wall time to {args.target} test accuracy, eval every {args.eval_every}s on "
          f"the whole test set, median of {args.seeds} seed(s)")
    print(f"{'threads':>7} {'distbelief':>12} {'torch':>12} {'ratio':>6}   seconds")
    for threads in thread_counts:
        load = os.getloadavg()[0]
        ours = median_time_to_target("ours", threads, args)
        peer = median_time_to_target("torch", threads, args)
        print(f"{threads:>7} {fmt(ours['median'], '.1f'):>12} {fmt(peer['median'], '.1f'):>12} "
              f"{ratio(ours['median'], peer['median']):>6}   "
              f"(steps {ours['steps']} vs {peer['steps']}; load before {load:.1f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=REPO / "data" / "fashion_mnist.h5")
    parser.add_argument("--threads", default="1,2", help="thread counts (default: 1,2)")
    parser.add_argument("--steps", type=int, default=2000, help="timed steps for (a)")
    parser.add_argument("--warmup", type=int, default=100, help="untimed steps for (a)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of (a), best kept")
    parser.add_argument("--target", type=float, default=0.88)
    parser.add_argument("--eval-every", type=float, default=2.0)
    parser.add_argument("--max-seconds", type=float, default=120.0)
    parser.add_argument("--seeds", type=int, default=1, help="repeats of (b), median")
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--no-target", action="store_true", help="skip (b)")
    parser.add_argument("--no-throughput", action="store_true", help="skip (a)")
    parser.add_argument("--worker", choices=("throughput", "target"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        args.threads = int(args.threads)
        work = ours_throughput if args.worker == "throughput" else ours_target
        print(json.dumps({"impl": "distbelief", "threads": args.threads, **work(args)}))
        return
    if not args.data.is_file():
        raise SystemExit(f"{args.data} missing: run `distbelief prepare fashion-mnist`")

    thread_counts = [int(t) for t in args.threads.split(",")]
    print(f"MLP 784-512-512-10, Adagrad lr 0.02, batch 64, {args.data.name}; "
          f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    if not args.no_throughput:
        throughput_table(thread_counts, args)
    if not args.no_target:
        target_table(thread_counts, args)


if __name__ == "__main__":
    main()
