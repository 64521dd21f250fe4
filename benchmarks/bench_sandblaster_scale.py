"""Sandblaster's control plane as the replicas grow: the bytes one shard sends per
line-search trial (trial points to the replicas) and the coordinator's messages per work
unit, at 2, 4 and 6 replicas, for this checkout and (with --before) an older source tree
in the same run.

    python benchmarks/bench_sandblaster_scale.py
    git -C REPO archive BASE src | tar -x -C /tmp/before   # the older tree, built:
    cp src/distbelief/model/_kernels*.so /tmp/before/src/distbelief/model/
    python benchmarks/bench_sandblaster_scale.py --before /tmp/before/src

Every run is `mpiexec -n R+2 python -m distbelief train` (1 shard, the coordinator, R
replicas) of a 16-64-4 MLP on a synthetic set of 3,000 rows, full batch, units of 100 rows
(30 per gradient evaluation), push_every_units 4, --steps iterations. Figures from
summary.json: the shard's trial-point bytes over the trials (gradient evaluations, and
evaluations run again), and coordinator_traffic.replica_messages over units_issued.
Before the relay tree the shards' summary has no trial_bytes: it is counted as the
shard's fetches less the snapshot fetches (one per evaluation, one partition), times the
message size. docs/sandblaster.md, "The trial point down a tree", has the table.
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
HEADER = 4
CONFIG = """
[model]
layers = [{ type = "dense", units = %(hidden)d, activation = "relu" },
          { type = "dense", units = 4, activation = "softmax" }]
[data]
path = "synth.h5"
batch_size = 3000
[optimizer]
algorithm = "sandblaster"
m = 5
work_unit_size = %(unit)d
push_every_units = 4
[cluster]
ps_shards = 1
[run]
max_steps = %(steps)d
eval_every_seconds = 100
progress_every_seconds = 100
threads = 1
"""


def run(src: Path, replicas: int, folder: Path, timeout: float, faults: str = "") -> dict:
    """One training run with the package from `src`; its summary.json."""
    out = folder / f"out-{replicas}-{abs(hash(str(src)))}-{bool(faults)}"
    env = {**os.environ, "PYTHONPATH": str(src), "OPENBLAS_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1", "DISTBELIEF_FAULTS": faults}
    cmd = ["mpiexec", "-n", str(replicas + 2), sys.executable, "-m", "distbelief", "train",
           str(folder / "scale.toml"), "--set", f'run.out_dir="{out}"']
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=folder, check=False)
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
             if line.strip()]
    summary["evaluation_seconds_median"] = statistics.median(
        s for m in lines if m["kind"] == "train" for s in m["evaluation_seconds"])
    return summary


def figures(summary: dict) -> tuple[float, float, float, float]:
    """(shard bytes per trial, coordinator messages per unit, median seconds per gradient
    evaluation, the longest a replica waited for its relay parent per evaluation)."""
    (shard,) = summary["shards"]
    trials = summary["gradient_evaluations"] + summary["restarted_evaluations"]
    if "trial_bytes" in shard:
        sent = shard["trial_bytes"]
    else:
        snapshots = sum(r["evaluations"] for r in summary["replicas"])
        sent = (shard["fetches"] - snapshots) * 4 * (HEADER + shard["stop"] - shard["start"])
    messages = summary["coordinator_traffic"]["replica_messages"] / summary["units_issued"]
    relay_wait = max(r.get("relay_wait_seconds", 0.0) for r in summary["replicas"])
    return sent / trials, messages, summary["evaluation_seconds_median"], relay_wait / trials


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="an older tree's src folder to compare")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 6])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--hidden", type=int, default=64, help="hidden units of the MLP")
    parser.add_argument("--unit", type=int, default=100, help="work_unit_size (rows)")
    parser.add_argument("--straggler", action="store_true",
                        help="replica 1 (world rank 3, a relay parent from 5 replicas on) "
                             "10x slower per unit in every run (faults delay:3:0:10x)")
    args = parser.parse_args()
    trees = [("after", REPO / "src")]
    if args.before:
        trees.insert(0, ("before", args.before.resolve()))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
        make = ("from distbelief.data.converters import make_synthetic; "
                f"make_synthetic({str(folder / 'synth.h5')!r}, n_train=3000, n_test=500, "
                "input_shape=(16,), num_classes=4, seed=3)")
        subprocess.run([sys.executable, "-c", make], check=True, env=env)
        (folder / "scale.toml").write_text(CONFIG % {"steps": args.steps, "unit": args.unit,
                                                     "hidden": args.hidden})
        faults = "delay:3:0:10x" if args.straggler else ""
        print(f"load {os.getloadavg()[0]:.2f}; {args.steps} iterations, "
              f"{-(-3000 // args.unit)} units per evaluation, 1 shard"
              f"{'; replica 1 10x slower' if faults else ''}")
        print("| code | R | params | shard bytes per trial | coordinator messages per unit "
              "| s per evaluation | relay wait per evaluation | final loss |")
        print("|------|---|--------|-----------------------|-------------------------------"
              "|------------------|---------------------------|------------|")
        for replicas in args.replicas:
            for name, src in trees:
                summary = run(src, replicas, folder, args.timeout, faults)
                per_trial, per_unit, seconds, waited = figures(summary)
                print(f"| {name} | {replicas} | {summary['num_params']:,d} | "
                      f"{per_trial:,.0f} | {per_unit:.2f} | {seconds:.3f} | "
                      f"{waited * 1000:.1f} ms | {summary['final_loss']:.5f} |", flush=True)


if __name__ == "__main__":
    main()
