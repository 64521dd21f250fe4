"""A lost shard adopted by a standby (cluster.standby_shards) against the same run without
the loss: final test accuracy per seed, the updates each slice holds, and how long the
shards took to go on without it. Downpour on Fashion-MNIST with the reference MLP
(configs/fashion_mnist_downpour.toml: 784-512-512-10, Adagrad), 3 shards + 2 replicas on
one node (the shared-memory transport), a fixed number of steps; in the faulted run shard 1
kills itself (-9, the test-only fault `kill`) after a given number of its updates. The
data: `distbelief prepare fashion-mnist` (Debian's dataset-fashion-mnist).

    python benchmarks/standby_accuracy.py                      # seeds 0 1 2, 3000 steps
    python benchmarks/standby_accuracy.py --seeds 0 1 2 3 4 --steps 4000 --kill-at 1500
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers import exit_statuses, set_args
from helpers.mpi_jobs import job_env, run_mpi, survive_a_death

from distbelief.runtime.launching.faults import ENV as FAULTS

SHARDS, REPLICAS = 3, 2


def run(config: Path, data: Path, out: Path, seed: int, steps: int, faults: str) -> dict:
    """One run's summary.json (SystemExit naming the run if it failed)."""
    env = {**job_env(), FAULTS: faults, "DISTBELIEF_PS_TRANSPORT": "shared"}
    args = ["train", config, *set_args(
        f'run.out_dir="{out}"', f'data.path="{data}"', f"run.seed={seed}",
        f"run.max_steps={steps}", "run.max_seconds=0", "run.target_accuracy=0.999",
        "run.eval_every_seconds=30", f"cluster.ps_shards={SHARDS}",
        "cluster.standby_shards=true", "run.checkpoint_every_steps=1000")]
    proc = run_mpi(SHARDS + REPLICAS, [REPO / "tests" / "mpi_programs" / "cli_exit_status.py",
                                       *args], timeout=900, env=env,
                   launcher_options=survive_a_death())
    statuses = exit_statuses(proc)
    expected = [137 if r == 1 and faults else 0 for r in range(SHARDS + REPLICAS)]
    if statuses != expected:
        raise SystemExit(f"seed {seed} ({faults or 'no fault'}): exit statuses {statuses}\n"
                         f"{proc.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path,
                        default=REPO / "configs" / "fashion_mnist_downpour.toml")
    parser.add_argument("--data", type=Path, default=REPO / "data" / "fashion_mnist.h5")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--kill-at", type=int, default=1000,
                        help="shard 1 dies after this many of its updates")
    args = parser.parse_args()
    print(f"{SHARDS} shards + {REPLICAS} replicas, {args.steps} steps, shard 1 killed after "
          f"{args.kill_at} updates; {args.config.name}", flush=True)
    print(f"{'seed':>4}  {'clean acc':>9}  {'faulted acc':>11}  {'clean s':>7}  "
          f"{'faulted s':>9}  {'regroup s':>9}  slices' updates (faulted)", flush=True)
    clean_acc, faulted_acc = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            clean = run(args.config, args.data, Path(tmp) / f"clean{seed}", seed, args.steps,
                        "")
            faulted = run(args.config, args.data, Path(tmp) / f"faulted{seed}", seed,
                          args.steps, f"kill:1:{args.kill_at}")
            lost = faulted["lost_shards"]
            if [x["shard"] for x in lost] != [1]:
                raise SystemExit(f"seed {seed}: lost_shards {lost}")
            versions = [s["version"] for s in faulted["shards"]]
            clean_acc.append(clean["final_test_accuracy"])
            faulted_acc.append(faulted["final_test_accuracy"])
            print(f"{seed:>4}  {clean_acc[-1]:9.4f}  {faulted_acc[-1]:11.4f}  "
                  f"{clean['wall_seconds']:7.1f}  {faulted['wall_seconds']:9.1f}  "
                  f"{lost[0]['regroup_seconds']:9.3f}  {versions}", flush=True)
    print(f"clean   accuracy: mean {statistics.mean(clean_acc):.4f}, "
          f"range {min(clean_acc):.4f}-{max(clean_acc):.4f}")
    print(f"faulted accuracy: mean {statistics.mean(faulted_acc):.4f}, "
          f"range {min(faulted_acc):.4f}-{max(faulted_acc):.4f}")
    print(f"faulted / clean mean accuracy: "
          f"{statistics.mean(faulted_acc) / statistics.mean(clean_acc):.4f}")


if __name__ == "__main__":
    main()
