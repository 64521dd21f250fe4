"""Downpour against TensorFlow 2's ParameterServerStrategy (issue 45, item 5): time to the
target test accuracy (default 88%), samples to it, samples/s and staleness, with the
reference MLP on Fashion-MNIST (784-512-512-10, Adagrad lr 0.02, batch 64), runs of the
two interleaved.

    python benchmarks/bench_tf_ps.py --seeds 3             # 15 runs: 21 min at load 4-18
    python benchmarks/bench_tf_ps.py --seeds 1 --workers 2 # 5 runs, a shorter one

(a) head-to-head: Downpour 1 shard + 2 replicas (mpiexec -n 3, shared-memory transport,
    n_fetch = n_push = 1, run.threads = 1: bench_downpour.py's runs) against TF 1 ps + 2
    workers + its coordinator (benchmarks/tf_ps_peer.py, by --tf-python, a venv with
    tensorflow-cpu: that file's docstring says how to make it), once per
    --steps-per-call K (steps in one scheduled function; 1 is a step per schedule), seed
    by seed, the order turning round each seed; medians over --seeds.
(b) workers: 1 shard + R replicas against 1 ps + R workers, R in --workers, the peer at
    the first K, --scale-seeds seeds each. 3 and 4 Downpour ranks, and TF's 1 + R + 1
    processes, run on 2 cores: OVERSUBSCRIBED from R = 2 on for TF, R = 2 for Downpour.

Both evaluate the whole test set every --eval-every s of wall time in a thread while
training goes on (Downpour on shard 0, TF in the coordinator) and stop at the first
evaluation that meets the target; both count time from the first step after set-up.
Ratios are distbelief / TF: below 1 for a time means Downpour is faster, above 1 for
samples/s. Samples to the target are all replicas' steps x 64 when that evaluation ran.
Staleness: the mean number of updates the parameter server applied between a step's read
of the parameters and its own update (both count it that way; tf_ps_peer.py says how).

The machine is shared: the load average (1 minute) is printed before every run; single
runs move with it, so read the medians and the per-seed ratios (each pair ran back to
back, under nearly one load).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
PEER = BENCH / "tf_ps_peer.py"
BATCH = 64

sys.path.insert(0, str(BENCH))
from bench_downpour import downpour_run, fmt, median_or_none


def load() -> float:
    return os.getloadavg()[0]


def ours(args: argparse.Namespace, replicas: int, seed: int) -> dict:
    r = downpour_run(args, ranks=1 + replicas, seed=seed, target=args.target,
                     eval_every=args.eval_every)
    step = r["target_reached_step"]
    return {"time": r["time_to_target"], "samples": None if step is None else step * BATCH,
            "rate": r["samples_per_second"], "staleness": r["staleness"]["mean"],
            "final": r["final_test_accuracy"]}


def peer(args: argparse.Namespace, workers: int, seed: int, steps_per_call: int) -> dict:
    cmd = [str(args.tf_python), str(PEER), "--data", str(args.data.resolve()),
           "--workers", str(workers), "--seed", str(seed), "--target", str(args.target),
           "--eval-every", str(args.eval_every), "--max-seconds", str(args.max_seconds),
           "--steps-per-call", str(steps_per_call)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=REPO,
                            timeout=args.max_seconds + 300)
    if result.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{result.stderr[-3000:]}")
    r = json.loads(result.stdout.strip().splitlines()[-1])
    step = r["steps_to_target"]
    return {"time": r["time_to_target"], "samples": None if step is None else step * BATCH,
            "rate": r["samples_per_second"], "staleness": r["staleness_mean"],
            "final": r["final_test_accuracy"], "tensorflow": r["tensorflow"]}


def row(name: str, r: dict, before: float) -> str:
    staleness = "-" if r["staleness"] is None else f"{r['staleness']:.2f}"
    return (f"  {name:<30} {fmt(r['time']):>11} {fmt(r['samples'], ',.0f'):>11} "
            f"{r['rate']:>9,.0f} {staleness:>9} {r['final']:>6.4f}   (load {before:.1f})")


HEADER = (f"  {'run':<30} {'s to target':>11} {'samples':>11} {'samples/s':>9} "
          f"{'staleness':>9} {'final':>6}")


def ratio_of(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}"


def summarise(label: str, runs: dict[str, list[dict]]) -> None:
    """Medians per kind, then each peer kind against Downpour: ratio of medians and the
    median of the per-seed ratios."""
    base = runs["downpour"]
    print(f"  {label}: medians over {len(base)} seed(s); distbelief / TF")
    print(f"  {'run':<30} {'s to target':>11} {'samples':>11} {'samples/s':>9} "
          f"{'reached':>7}   ratios: time, samples, samples/s (per-seed ratios' median)")
    for kind, got in runs.items():
        t = median_or_none([r["time"] for r in got])
        n = median_or_none([r["samples"] for r in got])
        rate = statistics.median(r["rate"] for r in got)
        reached = sum(r["time"] is not None for r in got)
        text = f"  {kind:<30} {fmt(t):>11} {fmt(n, ',.0f'):>11} {rate:>9,.0f} " \
               f"{reached:>3}/{len(got):<3}"
        if kind != "downpour":
            t0 = median_or_none([r["time"] for r in base])
            n0 = median_or_none([r["samples"] for r in base])
            rate0 = statistics.median(r["rate"] for r in base)
            paired = [median_or_none([None if a[k] is None or b[k] is None else a[k] / b[k]
                                      for a, b in zip(base, got, strict=True)])
                      for k in ("time", "samples", "rate")]
            text += (f"   {ratio_of(t0, t)}, {ratio_of(n0, n)}, {ratio_of(rate0, rate)}"
                     f" ({', '.join(fmt(p, '.2f') for p in paired)})")
        print(text, flush=True)


def section_head_to_head(args: argparse.Namespace) -> None:
    print(f"\n(a) Downpour 1 shard + 2 replicas against TF 1 ps + 2 workers, to "
          f"{args.target}, eval every {args.eval_every} s, {args.seeds} seed(s) in turn")
    print(HEADER)
    kinds = ["downpour"] + [f"tf, {k} step(s)/call" for k in args.steps_per_call]
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for seed in range(args.seeds):
        order = kinds if seed % 2 == 0 else kinds[::-1]  # neither always runs first
        for kind in order:
            before = load()
            if kind == "downpour":
                r = ours(args, 2, seed)
            else:
                r = peer(args, 2, seed, args.steps_per_call[kinds.index(kind) - 1])
            runs[kind].append(r)
            print(row(f"{kind}, seed {seed}", r, before), flush=True)
    # Keep the seed order of every kind the same for the per-seed ratios.
    summarise("(a)", runs)


def section_workers(args: argparse.Namespace) -> None:
    k = args.steps_per_call[0]
    print(f"\n(b) as replicas and workers are added: 1 shard + R replicas against 1 ps + R "
          f"workers (TF at {k} step(s)/call), to {args.target}, {args.scale_seeds} seed(s); "
          f"OVERSUBSCRIBED ({os.cpu_count()} cores for 1 + R ranks, 2 + R TF processes)")
    print(HEADER)
    for replicas in args.workers:
        runs: dict[str, list[dict]] = {"downpour": [], f"tf, {k} step(s)/call": []}
        for seed in range(args.scale_seeds):
            order = list(runs) if seed % 2 == 0 else list(runs)[::-1]
            for kind in order:
                before = load()
                r = ours(args, replicas, seed) if kind == "downpour" else \
                    peer(args, replicas, seed, k)
                runs[kind].append(r)
                print(row(f"R={replicas} {kind}, seed {seed}", r, before), flush=True)
        summarise(f"R = {replicas}", runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=REPO / "data" / "fashion_mnist.h5")
    p.add_argument("--tf-python", type=Path, default=REPO / ".venv-tf" / "bin" / "python",
                   help="the Python of a venv with tensorflow-cpu (tf_ps_peer.py says how)")
    p.add_argument("--only", choices=["head-to-head", "workers"])
    p.add_argument("--seeds", type=int, default=2, help="(a): seeds, medians reported")
    p.add_argument("--scale-seeds", type=int, default=1, help="(b): seeds per R")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3],
                   help="(b): replica and worker counts")
    p.add_argument("--steps-per-call", type=int, nargs="+", default=[1, 10],
                   help="the peer's steps per scheduled function, one run of each in (a)")
    p.add_argument("--target", type=float, default=0.88)
    p.add_argument("--eval-every", type=float, default=2.0)
    p.add_argument("--max-seconds", type=float, default=120.0)
    args = p.parse_args()
    if not args.data.is_file():
        raise SystemExit(f"{args.data} missing: run `distbelief prepare fashion-mnist`")
    if not args.tf_python.exists():
        raise SystemExit(f"{args.tf_python} does not exist: make the venv {PEER.name}'s "
                         "docstring describes, or give --tf-python")
    if min(args.workers) < 1 or min(args.steps_per_call) < 1 or args.seeds < 1 \
            or args.scale_seeds < 1:
        raise SystemExit("--workers, --steps-per-call, --seeds and --scale-seeds must be >= 1")
    uptime = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout
    print(f"Downpour against TF ParameterServerStrategy, MLP 784-512-512-10, Adagrad lr 0.02, "
          f"batch {BATCH}, {args.data.name}; {os.cpu_count()} cores; uptime: {uptime.strip()}")
    if args.only in (None, "head-to-head"):
        section_head_to_head(args)
    if args.only in (None, "workers"):
        section_workers(args)


if __name__ == "__main__":
    main()
