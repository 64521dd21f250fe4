"""The cost model's prediction against short training runs on this machine: for each
layout S:R:P, `distbelief costmodel --measure` (under mpiexec -n 2, so the transport is
timed between two processes), right before each run, predicts samples/s, then a run of MAX_SECONDS measures them
(the replicas' samples/s summed; a run without shards: its own). Evaluations are pushed
past the end of the run so that they do not share the cores.

    python benchmarks/validate_cost_model.py CONFIG 0:1:1,0:1:2,1:1:1,2:1:1,1:2:1,2:2:1 \\
        [--transport rma|shared] [--seconds 25] [--message-us 0]

docs/model-parallelism.md, "Predicted against measured", has the table and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def _distbelief(n: int, *args: str, env: dict[str, str]) -> str:
    cmd = ([] if n == 1 else ["mpiexec", "-n", str(n)]) + [sys.executable, "-m", "distbelief",
                                                           *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return proc.stdout


def _predict(args: argparse.Namespace, layout: str, cores: str,
             env: dict[str, str]) -> tuple[float, float, str]:
    """(step ms, samples/s, the calibration) from `costmodel --measure`, timed right before
    the run (the machine is shared: its load drifts)."""
    out = _distbelief(2, "costmodel", args.config, "--measure", "--cores", cores,
                      "--layouts", layout, "--transport", args.transport,
                      "--message-us", str(args.message_us), env=env)
    figures = re.search(r"a step ([\d.]+ ms) = ([\d.]+ GFLOP/s).*transport ([\d.]+ GB/s)",
                        out)
    for line in out.splitlines():
        found = re.match(r"\s*\d+ x \d+ x \d+\s+\d+\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+"
                         r"[\d.]+\s+(\d+)", line)
        if found:
            return float(found.group(1)), float(found.group(2)), ", ".join(figures.groups())
    raise SystemExit(f"no prediction in:\n{out}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("layouts")
    parser.add_argument("--transport", choices=("rma", "shared"), default="rma")
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--message-us", type=float, default=0.0)
    args = parser.parse_args()
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               DISTBELIEF_PS_TRANSPORT=args.transport)
    cores = str(os.cpu_count() or 1)
    print(f"{'S:R:P':>7} {'predicted samples/s':>20} {'measured':>9} {'ratio':>6}  "
          f"{'predicted step ms':>17} {'measured':>9}  calibration")
    for text in args.layouts.split(","):
        s_, r_, p_ = map(int, text.split(":"))
        out = Path(tempfile.mkdtemp(prefix="validate-"))
        algorithm = "downpour" if s_ else "sgd"
        sets = [f'run.out_dir="{out}"', f"run.max_seconds={args.seconds}",
                "run.eval_every_seconds=1000", "run.max_steps=0",
                f'optimizer.algorithm="{algorithm}"', f"cluster.ps_shards={max(s_, 1)}",
                f"cluster.partitions={p_}"]
        ranks = s_ + r_ * p_
        _distbelief(ranks, "train", args.config, "--fresh",
                    *[x for s in sets for x in ("--set", s)], env=env)
        summary = json.loads((out / "summary.json").read_text())
        if s_:
            measured = sum(r["samples_per_second"] for r in summary["replicas"]
                           if r.get("partition", 0) == 0)
            step = 1e3 / (sum(r["steps"] / r["train_seconds"] for r in summary["replicas"]
                              if r.get("partition", 0) == 0) / r_)
        else:
            measured = summary["samples_per_second"]
            step = 1e3 * summary["wall_seconds"] / max(summary["steps"], 1)
        want_step, want, figures = _predict(args, text, cores, env)
        print(f"{text:>7} {want:>20.0f} {measured:>9.0f} {measured / want:>6.2f}  "
              f"{want_step:>17.0f} {step:>9.0f}  {figures}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
