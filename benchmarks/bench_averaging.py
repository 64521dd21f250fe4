"""Parameter averaging and EASGD against the single-process trainer: wall time to the target
test accuracy (default 88%) with the reference MLP on Fashion-MNIST (configs/
fashion_mnist_mlp.toml: 784-512-512-10, Adagrad lr 0.02, batch 64), every run through the
command line, seed by seed interleaved so that all three see the same load.

    python benchmarks/bench_averaging.py --data data/fashion_mnist.h5
    python benchmarks/bench_averaging.py --data FILE --seeds 0 1 2 --average-every 10 \\
        --alpha 0.45

Runs per seed:
  sgd        python -m distbelief train CONFIG                       (1 process)
  averaging  mpiexec -n 2 ... --set optimizer.algorithm="averaging"  (2 replicas)
  easgd      mpiexec -n 3 ... the same with elastic_alpha            (1 shard + 2 replicas)
all with run.threads = 1 and the same run.eval_every_seconds (evaluation time counts).
The figure is summary.json's time_to_target (seconds from the start of training to the
first evaluation at the target). Prints each run, then per algorithm the median time and
the median over seeds of the ratio sgd / algorithm, each ratio taken between the runs of
one seed, which ran one after the other (above 1: the algorithm is faster than the
single-process trainer). A run that misses the target counts as --max-seconds.
`distbelief prepare fashion-mnist --out FILE` writes the data file.
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
CONFIG = REPO / "configs" / "fashion_mnist_mlp.toml"


def command(kind: str, args: argparse.Namespace, out: Path, seed: int) -> list[str]:
    """The command line of one run."""
    sets = [f'data.path="{args.data.resolve()}"', f'run.out_dir="{out}"',
            f"run.seed={seed}", f"run.target_accuracy={args.target}",
            f"run.max_seconds={args.max_seconds}", "run.threads=1",
            f"run.eval_every_seconds={args.eval_every}"]
    ranks = 1
    if kind != "sgd":
        sets += ['optimizer.algorithm="averaging"',
                 f"optimizer.average_every={args.average_every}"]
        ranks = 2
    if kind == "easgd":
        sets += [f"optimizer.elastic_alpha={args.alpha}"]
        ranks = 3  # the shard holding the center, and 2 replicas
    train = [sys.executable, "-m", "distbelief", "train", str(CONFIG), "--fresh",
             *(arg for s in sets for arg in ("--set", s))]
    return train if ranks == 1 else ["mpiexec", "-n", str(ranks), *train]


def run_one(kind: str, args: argparse.Namespace, seed: int) -> float | None:
    """Seconds to the target of one run (None if it did not get there)."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{kind}-") as folder:
        out = Path(folder)
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(command(kind, args, out, seed), capture_output=True, text=True,
                              env=env, timeout=args.max_seconds + 120, check=False)
        if proc.returncode != 0:
            sys.exit(f"{kind} seed {seed} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        summary = json.loads((out / "summary.json").read_text())
    load = os.getloadavg()[0]
    seconds = summary["time_to_target"]
    shown = "-" if seconds is None else f"{seconds:.1f}s"
    rounds = ""
    if summary.get("averages"):  # collective averaging: the time in its rounds
        rounds = (f", {1000 * summary['average_seconds'] / summary['averages']:.1f} ms per "
                  f"average")
    print(f"  {kind:9s} seed {seed}: {shown} to {args.target:g} (final "
          f"{summary['final_test_accuracy']:.4f}, {summary['steps']} steps{rounds}, load "
          f"{load:.1f})", flush=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=REPO / "data" / "fashion_mnist.h5")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--target", type=float, default=0.88)
    parser.add_argument("--average-every", type=int, default=10)
    parser.add_argument("--alpha", type=float, default=0.45,
                        help="EASGD's elastic_alpha (the paper's beta = p alpha = 0.9)")
    parser.add_argument("--eval-every", type=float, default=1.0)
    parser.add_argument("--max-seconds", type=float, default=120)
    parser.add_argument("--only", nargs="+", choices=("sgd", "averaging", "easgd"),
                        default=["sgd", "averaging", "easgd"])
    args = parser.parse_args()
    if not args.data.exists():
        sys.exit(f"{args.data} missing: distbelief prepare fashion-mnist --out {args.data}")
    print(f"time to {args.target:g}, reference MLP, batch 64, Adagrad lr 0.02; averaging "
          f"every {args.average_every} steps, EASGD elastic_alpha {args.alpha:g}; "
          f"{os.cpu_count()} cores", flush=True)
    times: dict[str, list[float]] = {kind: [] for kind in args.only}
    reached = dict.fromkeys(args.only, 0)
    for seed in args.seeds:
        for kind in args.only:
            seconds = run_one(kind, args, seed)
            reached[kind] += seconds is not None
            times[kind].append(args.max_seconds if seconds is None else seconds)
    print("\n| run | ranks | median s to target | runs at target | sgd / run (median of "
          "per-seed ratios) |")
    print("|---|---:|---:|---:|---:|")
    for kind, got in times.items():
        ranks = {"sgd": 1, "averaging": 2, "easgd": 3}[kind]
        ratios = [b / t for b, t in zip(times.get("sgd", []), got, strict=False)]
        ratio = f"{statistics.median(ratios):.2f}" if ratios else "-"
        print(f"| {kind} | {ranks} | {statistics.median(got):.1f} | "
              f"{reached[kind]}/{len(args.seeds)} | {ratio} |")


if __name__ == "__main__":
    main()
