"""Downpour's staleness bound (`optimizer.max_staleness`, stale synchronous parallel) on
Fashion-MNIST with the reference MLP 784-512-512-10 (configs/fashion_mnist_downpour.toml:
Adagrad lr 0.02, batch 64), through the command line as a user would run it, 1 shard + R
replicas (R + 1 ranks; on this 2-core machine OVERSUBSCRIBED from R = 2).

    python benchmarks/bench_staleness_bound.py                  # both sections
    python benchmarks/bench_staleness_bound.py --only accuracy  # or: speed

(a) accuracy: `max_staleness = 0` (bulk-synchronous: each fetch holds every replica's
    previous push) against synchronous SGD (`algorithm = "sync"`, R ranks, the mean of R
    gradients per step), at equal samples: sync `--steps` steps, Downpour R x `--steps`
    steps of one batch each. Also unbounded Downpour, for scale. Per seed: each run's
    final test accuracy on the whole test set; then the medians and the difference
    s=0 - sync in points. The two do not train the same numbers (sync takes one step on
    the mean gradient, s = 0 the R gradients one after the other, each on parameters that
    miss the others' of the same clock), so the comparison is of accuracy, not of bits.
(b) speed: `--seconds` of training at each bound of `--bounds` and unbounded, interleaved,
    `--rounds` rounds; with `--straggler`, replica R-1 takes that many times its compute
    time per step. Reported: samples/s per replica (mean over the replicas), each bound's
    ratio to the unbounded run of the same round, the milliseconds a replica spent in the
    transport per push (its pushes, fetches and exchanges with them, not the waits: the
    protocol's own cost, steadier than samples/s on a shared machine), the clock lead
    (max, mean), the seconds a replica waited at the bound (mean over the replicas) and
    the mean wait of a block that waited; then each bound's best samples/s over the
    rounds against the unbounded run's best (the best is the least disturbed).

The machine is shared: each row shows the load average just before it.
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
CONFIG = REPO / "configs" / "fashion_mnist_downpour.toml"


def load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


def train(out: Path, ranks: int, data: Path, *overrides: str,
          faults: str = "") -> tuple[dict, float]:
    """One run through `mpiexec -n RANKS python -m distbelief train`; (summary.json,
    wall seconds)."""
    sets = [f'data.path="{data.resolve()}"', f'run.out_dir="{out}"', "run.threads=1",
            "run.target_accuracy=1.0", "run.eval_every_seconds=1000", *overrides]
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "distbelief", "train",
           str(CONFIG), "--fresh", *(arg for s in sets for arg in ("--set", s))]
    env = {**os.environ, "DISTBELIEF_FAULTS": faults, "OPENBLAS_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800,
                          check=False)
    seconds = time.perf_counter() - t0
    summary_path = out / "summary.json"
    if proc.returncode or not summary_path.exists():
        sys.exit(f"run failed (status {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(summary_path.read_text()), seconds


def section_accuracy(args: argparse.Namespace, tmp: Path) -> None:
    r = args.replicas
    print(f"(a) final test accuracy at equal samples ({args.steps * r * 64:,d}: sync "
          f"{args.steps} steps of {r} batches, Downpour {args.steps * r} steps), {r} "
          f"replicas, seeds {args.seeds}")
    runs = {"sync": (r, ['optimizer.algorithm="sync"', "cluster.ps_shards=0",
                         f"run.max_steps={args.steps}"]),
            "downpour s=0": (r + 1, ["optimizer.max_staleness=0",
                                     f"run.max_steps={args.steps * r}"]),
            "downpour": (r + 1, [f"run.max_steps={args.steps * r}"])}
    accuracy: dict[str, list[float]] = {name: [] for name in runs}
    print(f"{'run':<14} {'seed':>4} {'samples':>9} {'test acc':>9} {'wall s':>7}")
    for seed in args.seeds:
        for name, (ranks, sets) in runs.items():
            before = load()
            summary, seconds = train(tmp / f"{name}-{seed}".replace(" ", ""), ranks,
                                     args.data, *sets, f"run.seed={seed}")
            accuracy[name].append(summary["final_test_accuracy"])
            print(f"{name:<14} {seed:>4} {summary['samples']:>9,d} "
                  f"{summary['final_test_accuracy']:>9.4f} {seconds:>7.1f}   ({before})")
    median = {name: statistics.median(values) for name, values in accuracy.items()}
    print("medians: " + ", ".join(f"{name} {value:.4f}" for name, value in median.items()))
    diffs = [100 * (a - b) for a, b in zip(accuracy["downpour s=0"], accuracy["sync"],
                                           strict=True)]
    print("s=0 - sync, per seed: " + ", ".join(f"{d:+.2f}" for d in diffs)
          + f" points (median {statistics.median(diffs):+.2f})")


def section_speed(args: argparse.Namespace, tmp: Path) -> None:
    r = args.replicas
    faults = f"delay:{r}:0:{args.straggler:g}x" if args.straggler else ""
    print(f"\n(b) {args.seconds:g} s of training per run, {r} replicas"
          + (f", replica {r - 1} {args.straggler:g}x slower per step" if faults else "")
          + f"; {args.rounds} interleaved round(s)")
    print(f"{'bound':<6} {'samples/s/replica':>18} {'/ unbounded':>12} {'ms/push':>8} "
          f"{'lead max':>9} {'lead mean':>10} {'waited s':>9} {'ms/wait':>8}")
    bounds = [None, *args.bounds]
    best: dict[int | None, float] = {}
    for n in range(args.rounds):
        plain = None
        for bound in bounds:
            sets = ["run.max_steps=0", f"run.max_seconds={args.seconds}"]
            if bound is not None:
                sets.append(f"optimizer.max_staleness={bound}")
            before = load()
            summary, _ = train(tmp / f"speed-{bound}-{n}", r + 1, args.data, *sets,
                               faults=faults)
            replicas = summary["replicas"]
            rate = statistics.mean(x["samples_per_second"] for x in replicas)
            plain = rate if bound is None else plain
            best[bound] = max(best.get(bound, 0.0), rate)
            lead = summary["clock_lead"]
            waited = (statistics.mean(x["clock_bound"]["wait_seconds"] for x in replicas)
                      if lead else 0.0)
            per_wait = 1e3 * lead["wait_seconds"] / lead["waits"] if lead and lead["waits"] else 0
            per_push = statistics.mean(1e3 * x["rma_seconds"] / x["pushes"] for x in replicas)
            print(f"{'-' if bound is None else bound:<6} {rate:>18,.0f} "
                  f"{rate / plain:>12.2f} {per_push:>8.2f} {lead['max'] if lead else '-':>9} "
                  f"{lead['mean'] if lead else 0:>10.2f} {waited:>9.1f} {per_wait:>8.2f}"
                  f"   ({before})")
    print("best over the rounds, / unbounded's best: " + ", ".join(
        f"s={bound} {best[bound] / best[None]:.2f}" for bound in args.bounds))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=REPO / "data" / "fashion_mnist.h5")
    p.add_argument("--only", choices=["accuracy", "speed"])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--steps", type=int, default=1000, help="(a): sync's steps")
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")],
                   default=[0, 1, 2], help="(a): comma-separated")
    p.add_argument("--seconds", type=float, default=20.0, help="(b): seconds per run")
    p.add_argument("--bounds", type=lambda s: [int(x) for x in s.split(",")],
                   default=[0, 1, 4], help="(b): comma-separated max_staleness values")
    p.add_argument("--straggler", type=float, default=0.0,
                   help="(b): replica R-1's slow-down factor per step (0: none)")
    p.add_argument("--rounds", type=int, default=1, help="(b)")
    args = p.parse_args()
    if not args.data.exists():
        sys.exit(f"{args.data} missing: run `distbelief prepare fashion-mnist` first")
    print(f"Staleness bound, MLP 784-512-512-10, 1 shard + {args.replicas} replicas on "
          f"{os.cpu_count()} cores; {load()} before\n")
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "accuracy"):
            section_accuracy(args, Path(tmp))
        if args.only in (None, "speed"):
            section_speed(args, Path(tmp))


if __name__ == "__main__":
    main()
