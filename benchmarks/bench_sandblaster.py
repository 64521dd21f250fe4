"""Sandblaster L-BFGS on Fashion-MNIST with the reference MLP 784-512-512-10, next to
Downpour SGD in the same benchmark run, and the straggler's cost.

    python benchmarks/bench_sandblaster.py                       # both sections, ~6 minutes
    python benchmarks/bench_sandblaster.py --only straggler --straggler-replicas 4

Sections (every run is `mpiexec -n N python -m distbelief train CONFIG`, output in a
temporary folder, figures read from its metrics.jsonl and summary.json):
(a) accuracy: Sandblaster (configs/fashion_mnist_sandblaster.toml: batch 6000, m 10,
    units of 250) and Downpour (configs/fashion_mnist_downpour.toml: Adagrad lr 0.02,
    batch 64) with the same number of replicas and 1 shard (Sandblaster has one more
    rank, its coordinator), each for `--seconds` of wall time without a target, evaluating
    the whole test set every 2 s. Reported: best test accuracy and the time it was first
    reached, and each one's time to the lower of the two bests (a common bar), as a ratio
    Sandblaster / Downpour.
(b) straggler: Sandblaster on the same model, `--straggler-steps` iterations, with and
    without replica 1 (world rank 3) made 10x slower per work unit (the test-only
    fault DISTBELIEF_FAULTS="delay:3:0:10x", distbelief.runtime.launching.faults); reported: median seconds per gradient evaluation
    (one batch) in both runs and their ratio (the acceptance bound is 1.3), the units each
    replica committed, and the backup units issued and discarded.

The machine is shared: each row shows the load average measured just before it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SANDBLASTER = REPO / "configs" / "fashion_mnist_sandblaster.toml"
DOWNPOUR = REPO / "configs" / "fashion_mnist_downpour.toml"


def load() -> str:
    return f"load {os.getloadavg()[0]:.2f}"


def train(config: Path, ranks: int, out: Path, overrides: list[str], timeout: float,
          env: dict | None = None) -> tuple[dict, list[dict]]:
    """One run through the command line; (summary, metrics lines)."""
    sets = [a for o in [f'run.out_dir="{out}"', *overrides] for a in ("--set", o)]
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "distbelief", "train",
           str(config), *sets]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          check=False)
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    return json.loads((out / "summary.json").read_text()), metrics


def first_time_at(metrics: list[dict], accuracy: float) -> float | None:
    for m in metrics:
        if m["kind"] == "eval" and m["test_accuracy"] >= accuracy:
            return m["time"]
    return None


def best(metrics: list[dict]) -> tuple[float, float]:
    """(best test accuracy, time it was first reached)."""
    evals = [m for m in metrics if m["kind"] == "eval"]
    top = max(m["test_accuracy"] for m in evals)
    return top, first_time_at(metrics, top)


def section_accuracy(args: argparse.Namespace, tmp: Path) -> None:
    print(f"(a) time to best test accuracy, {args.replicas} replica(s) + 1 shard, "
          f"{args.seconds:.0f} s each")
    budget = [f"run.max_seconds={args.seconds}", "run.eval_every_seconds=2.0",
              "run.target_accuracy=0.999", "cluster.ps_shards=1"]
    runs = {}
    for name, config, ranks in [("sandblaster", SANDBLASTER, args.replicas + 2),
                                ("downpour", DOWNPOUR, args.replicas + 1)]:
        before = load()
        _, metrics = train(config, ranks, tmp / name, budget, timeout=args.seconds + 240)
        runs[name] = metrics
        accuracy, at = best(metrics)
        print(f"  {name:<12} {ranks} ranks  best {accuracy:.4f} at {at:6.1f} s   ({before})")
    bar = min(best(m)[0] for m in runs.values())
    sb, dp = (first_time_at(runs[k], bar) for k in ("sandblaster", "downpour"))
    print(f"  time to {bar:.4f} (the lower best): sandblaster {sb:.1f} s, downpour "
          f"{dp:.1f} s, ratio sandblaster/downpour {sb / dp:.2f}")


def evaluation_seconds(metrics: list[dict]) -> float:
    return statistics.median(s for m in metrics if m["kind"] == "train"
                             for s in m["evaluation_seconds"])


def section_straggler(args: argparse.Namespace, tmp: Path) -> None:
    print(f"(b) straggler: {args.straggler_replicas} replicas, replica 1 slowed 10x per unit, "
          f"{args.straggler_steps} iterations")
    overrides = [f"run.max_steps={args.straggler_steps}", "run.eval_every_seconds=1000",
                 "cluster.ps_shards=1"]
    times = {}
    for name, env in [("plain", None),
                      ("straggler", {"DISTBELIEF_FAULTS": "delay:3:0:10x"})]:
        before = load()
        summary, metrics = train(SANDBLASTER, args.straggler_replicas + 2, tmp / name, overrides,
                                 timeout=600, env=env)
        times[name] = evaluation_seconds(metrics)
        units = [r["units_committed"] for r in summary["replicas"]]
        print(f"  {name:<10} {times[name]:.3f} s per batch; units per replica {units}; "
              f"backups {summary['backup_units_issued']} issued, "
              f"{summary['backup_units_discarded']} discarded   ({before})")
    r = args.straggler_replicas
    print(f"  batch time ratio straggler/plain {times['straggler'] / times['plain']:.2f} "
          f"(bound 1.3; losing one of {r} replicas that each have a core of their own "
          f"costs {r / (r - 1):.2f} at best, oversubscribed replicas share the cores the "
          f"straggler frees)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["accuracy", "straggler"])
    parser.add_argument("--replicas", type=int, default=3,
                        help="model replicas in every run (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=150.0,
                        help="wall time of each run in (a) (default: %(default)s)")
    parser.add_argument("--straggler-steps", type=int, default=8)
    parser.add_argument("--straggler-replicas", type=int, default=5,
                        help="replicas in (b) (default: %(default)s; losing one of R costs "
                             "R/(R-1) when each has a core, so R >= 5 for the 1.3 bound)")
    args = parser.parse_args()
    if not (REPO / "data" / "fashion_mnist.h5").is_file():
        sys.exit("data/fashion_mnist.h5 missing: run `distbelief prepare fashion-mnist`")
    with tempfile.TemporaryDirectory(prefix="bench_sandblaster_") as tmp:
        if args.only in (None, "accuracy"):
            section_accuracy(args, Path(tmp))
        if args.only in (None, "straggler"):
            section_straggler(args, Path(tmp))


if __name__ == "__main__":
    main()
