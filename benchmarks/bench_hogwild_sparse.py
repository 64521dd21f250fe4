"""Hogwild on sparse problems, as its paper ran them (Niu, Recht, Re and Wright, NIPS 2011):
throughput at 1 and 2 workers, lock-free beside the locking baseline, same run.

Two synthetic problems with the paper's shape statistics (`distbelief prepare
sparse-synthetic`, planted models; fewer rows, for 2 cores):

    rcv1-shaped     logistic regression, 47,236 features, 77 ids a row (RCV1's), 200,000
                    training rows (RCV1: 781,265)
    netflix-shaped  matrix factorisation, 48,019 users x 1,777 items (a tenth of Netflix's
                    users, all of its items), rank 8, 2,000,000 ratings (Netflix: 100M)

Each problem is trained for --seconds by: sgd (one process: the serial baseline), Hogwild
with 1 worker, with 2 workers, and with 2 workers under one lock for every update
(optimizer.locked_updates: the paper's locking baseline). The figure is summary.json's
samples a second over the whole run (rank 0's evaluations every --eval-every seconds
included), with the test loss the run ended at and the bytes its steps read and wrote a
sample. The speedup is over Hogwild with 1 worker.

    python benchmarks/bench_hogwild_sparse.py [--seconds 20] [--quick] [--only rcv1|netflix]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROBLEMS = {
    "rcv1": ("logistic", ["--features", "47236", "--nnz", "77", "--train", "200000",
                          "--test", "10000"], "sparse_logistic.toml", "0.1"),
    "netflix": ("mf", ["--users", "48019", "--items", "1777", "--rank", "8",
                       "--train", "2000000", "--test", "20000"],
                "matrix_factorisation.toml", "0.2"),
}
QUICK_ROWS = {"rcv1": "20000", "netflix": "200000"}
VARIANTS = [("sgd", 1, "sgd", False), ("hogwild, 1 worker", 1, "hogwild", False),
            ("hogwild, 2 workers", 2, "hogwild", False),
            ("locked, 2 workers", 2, "hogwild", True)]


def prepare(name: str, folder: Path, quick: bool) -> Path:
    kind, options, _, _ = PROBLEMS[name]
    if quick:
        options = [QUICK_ROWS[name] if previous == "--train" else value
                   for previous, value in zip(["", *options], options)]
    path = folder / f"{name}.h5"
    subprocess.run([sys.executable, "-m", "distbelief", "prepare", "sparse-synthetic", kind,
                    *options, "--out", str(path)], check=True, capture_output=True)
    return path


def train(name: str, data: Path, out: Path, ranks: int, algorithm: str, locked: bool,
          args: argparse.Namespace) -> dict:
    _, _, config, rate = PROBLEMS[name]
    sets = [f'run.out_dir="{out}"', f'data.path="{data}"', f'optimizer.algorithm="{algorithm}"',
            f"optimizer.learning_rate={rate}", f"run.max_seconds={args.seconds}",
            "run.target_loss=1e-9", f"run.eval_every_seconds={args.eval_every}",
            "run.checkpoint_every_seconds=0", "run.threads=1"]
    if algorithm == "hogwild":
        sets += ["cluster.ps_shards=0", f"optimizer.locked_updates={str(locked).lower()}"]
    launch = [] if algorithm == "sgd" else ["mpiexec", "-n", str(ranks)]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*launch, sys.executable, "-m", "distbelief", "train",
                           str(REPO / "examples" / config), "--fresh",
                           *[a for s in sets for a in ("--set", s)]],
                          capture_output=True, text=True, env=env, check=False,
                          timeout=args.seconds + 180)
    if proc.returncode != 0:
        raise SystemExit(f"{name} {algorithm} failed:\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-2000:]}")
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--eval-every", type=float, default=5.0)
    parser.add_argument("--only", choices=sorted(PROBLEMS))
    parser.add_argument("--quick", action="store_true", help="a tenth of the rows, 5 s runs")
    args = parser.parse_args()
    if args.quick:
        args.seconds = 5.0
    names = [args.only] if args.only else list(PROBLEMS)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name in names:
            data = prepare(name, folder, args.quick)
            print(f"\n{name}-shaped ({args.seconds:g} s a run)")
            print(f"{'':<20} {'samples/s':>10} {'speedup':>8} {'test loss':>10} "
                  f"{'bytes/sample':>13}")
            rows = []
            for label, ranks, algorithm, locked in VARIANTS:
                summary = train(name, data, folder / f"{name}-{len(rows)}", ranks, algorithm,
                                locked, args)
                rows.append((label, summary))
            one = rows[1][1]["samples_per_second"]
            for label, summary in rows:
                rate = summary["samples_per_second"]
                sent = summary.get("bytes_sent_per_sample")
                print(f"{label:<20} {rate:>10,.0f} {rate / one:>7.2f}x "
                      f"{summary['final_test_loss']:>10.4f} "
                      f"{'-' if sent is None else f'{sent:,.1f}':>13}")


if __name__ == "__main__":
    main()
