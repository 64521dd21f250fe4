"""How the control plane's costs grow with the rank count (issue 32): Downpour on the RMA
transport, a tiny model (so that the control plane, not the arithmetic, is what the ranks
do), on simulated nodes of `--per-node` ranks each (MPICH's `-launcher fork -hosts`: MPI
puts each host name's ranks on a node of their own, and distbelief watches the other
nodes' ranks by heartbeat files, as on a cluster), one shard per node.

    python benchmarks/bench_control_plane.py                      # 4, 8 and 16 ranks
    python benchmarks/bench_control_plane.py --ranks 16,32,64,128 # 16 cores or more
    python benchmarks/bench_control_plane.py --one-node           # the same, one node

Past about 8 ranks per core the RMA path starves (32 ranks on 2 cores: replicas waited
over 60 s for a free push slot and the stall watchdog ended the run); such a run is left
out, named, and the others are still printed.

For each rank count it runs `distbelief train` for `--seconds` with a checkpoint every
`--checkpoint-every` seconds and reads summary.json's `control_plane` (each rank's counters:
distbelief.runtime.counters), `shards` and `replicas`. Printed, per rank count:

  fs ops/s per rank      heartbeat files written and read, per second, mean over ranks
  fs ops/s, worst rank   the same, the rank that asks most (shard 0 sweeps the others)
  fs ops/s per node      the same summed over a node's ranks, the busiest node
  data MB per rank       rows and labels read from the dataset file, mean over ranks
  data MB, worst rank    the same, the rank that reads most
  ckpt files per ckpt    checkpoint files written per checkpoint, all ranks together
  ckpt pause s           a replica's pause per checkpoint it paused for (the periodic
                         ones), mean over replicas
  ckpt ack wait s        of which shard 0 waited, from its request until every replica
                         had paused: the wait for the slowest replica to reach a step's end
  replica step s         a replica's wall time per step, mean over replicas (how long
                         the slowest takes to reach a step's end, under this load)
  rma ops per step       a replica's one-sided operations (atomics, Gets, Puts, Flushes)
                         per step it trained, mean over replicas
  ... per shard          the same divided by the shards (a step talks to each shard)
  claim retries per step a replica's claim turns past the first (every slot of a shard
                         busy), per step: the part of the operations that is contention
  fold polls per step    a replica's polls while it waits for its push to be folded
  rma ops/s, shard 0     one-sided operations shard 0 issued (its polls of its own
                         counters) per second
  shard 0 us per poll    shard 0's CPU time per poll (folds, run control, supervision)
  shard 0 us per push    shard 0's CPU time per push it folded
  shard 0 busy           shard 0's CPU time / wall time

and the growth exponent b of a fit figure ~ ranks^b (0: constant; 1: linear), with the
ratio largest / smallest rank count (with a positive figure): the peer of each figure is the same figure at the
smallest rank count, measured in the same invocation. On a machine with fewer cores than
ranks every rank gets less CPU as the count grows, so per-second figures of work driven by
steps fall, and waits (hence polls per step) lengthen: read those against the exponent of
the busy fraction. MPICH only (hydra's fake hosts).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "synthetic_tiny.toml"
RMA_OPS = ("rma_atomics", "rma_gets", "rma_puts", "rma_flushes")


def make_data(folder: Path) -> Path:
    path = folder / "tiny.h5"
    subprocess.run([sys.executable, "-m", "distbelief", "prepare", "synthetic", "--out",
                    str(path), "--train", "20000", "--test", "1000", "--shape", "32",
                    "--classes", "4"], check=True, capture_output=True)
    return path


def train(out: Path, data: Path, ranks: int, args: argparse.Namespace) -> dict | None:
    """One run on ranks / per_node simulated nodes, a shard on each; its summary.json, or
    None (with the reason printed) if it failed or ran past its bound."""
    nodes = ranks // args.per_node
    hosts = ",".join(f"simnode{i}" for i in range(nodes))
    sets = [f'data.path="{data}"', f'run.out_dir="{out}"', 'optimizer.algorithm="downpour"',
            f"cluster.ps_shards={nodes}", "run.max_steps=0", f"run.max_seconds={args.seconds}",
            "run.target_accuracy=1.0", f"run.checkpoint_every_seconds={args.checkpoint_every}",
            "run.eval_every_seconds=1000"]
    placement = [] if args.one_node else ["-hosts", hosts, "-ppn", str(args.per_node)]
    cmd = ["mpiexec", "-launcher", "fork", *placement, "-n", str(ranks), sys.executable,
           "-m", "distbelief", "train", str(CONFIG), "--fresh", *(arg for s in sets for arg in ("--set", s))]
    # RMA on one node too, so that every rank count runs the transport clusters use.
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
           "DISTBELIEF_PS_TRANSPORT": "rma"}
    t0 = time.perf_counter()
    bound = 3 * args.seconds + 90 + ranks  # start-up grows with the ranks on few cores
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it started
        proc.communicate()
        print(f"  {ranks} ranks: ran past {bound:.0f} s; left out", flush=True)
        return None
    summary_path = out / "summary.json"
    if proc.returncode != 0 or not summary_path.exists():
        lines = [line for line in stdout.splitlines() + stderr.splitlines()
                 if line.startswith("distbelief:")]
        print(f"  {ranks} ranks: failed (status {proc.returncode}); left out:\n    "
              + "\n    ".join(lines[:3]), flush=True)
        return None
    print(f"  {ranks} ranks ({nodes} nodes): {time.perf_counter() - t0:.0f} s, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    return json.loads(summary_path.read_text())


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def figures(summary: dict, per_node: int) -> dict[str, float]:
    """The printed figures of one run (the module's docstring)."""
    control = {c["rank"]: c for c in summary["control_plane"]}
    fs = {r: (c["heartbeat_reads"] + c["heartbeat_writes"]) / c["seconds"]
          for r, c in control.items()}
    per_node_fs: dict[int, float] = {}
    for rank, rate in fs.items():  # -ppn fills each fake host with consecutive job ranks
        node = control[rank].get("job_rank", rank) // per_node
        per_node_fs[node] = per_node_fs.get(node, 0.0) + rate
    replicas = [r for r in summary["replicas"] if r["steps"] > 0]
    checkpoints = max(summary["checkpoints_written"], 1)
    requests = max(summary.get("checkpoint_requests", checkpoints), 1)  # what replicas pause for
    shard0 = summary["shards"][0]
    c0 = control[shard0["rank"]]
    return {
        "fs ops/s per rank": mean(list(fs.values())),
        "fs ops/s, worst rank": max(fs.values()),
        "fs ops/s per node": max(per_node_fs.values()),
        "data MB per rank": mean([c["data_bytes_read"] / 1e6 for c in control.values()]),
        "data MB, worst rank": max(c["data_bytes_read"] / 1e6 for c in control.values()),
        "ckpt files per ckpt": sum(c["checkpoint_files"] for c in control.values())
        / checkpoints,
        "ckpt pause s": mean([r["checkpoint_seconds"] / requests for r in replicas]),
        "ckpt ack wait s": summary.get("checkpoint_ack_wait_seconds", math.nan) / requests,
        "replica step s": mean([r["train_seconds"] / r["steps"] for r in replicas]),
        "rma ops per step": mean([sum(control[r["rank"]][k] for k in RMA_OPS) / r["steps"]
                                  for r in replicas]),
        "... per shard": mean([sum(control[r["rank"]][k] for k in RMA_OPS) / r["steps"]
                               for r in replicas]) / len(summary["shards"]),
        "claim retries per step": mean([control[r["rank"]]["rma_claim_retries"] / r["steps"]
                                        for r in replicas]),
        "fold polls per step": mean([control[r["rank"]]["rma_fold_polls"] / r["steps"]
                                     for r in replicas]),
        "rma ops/s, shard 0": sum(c0[k] for k in RMA_OPS) / c0["seconds"],
        "shard 0 us per poll": 1e6 * shard0["cpu_s"] / max(shard0["polls"], 1),
        "shard 0 us per push": 1e6 * shard0["cpu_s"] / max(shard0["pushes"], 1),
        "shard 0 busy": shard0["cpu_s"] / max(shard0["wall_s"], 1e-9),
    }


def exponent(ranks: list[int], values: list[float]) -> float:
    """b of the least-squares fit log(value) = a + b log(ranks), over the positive values
    (one node has no heartbeat files); nan with fewer than two."""
    points = [(math.log(r), math.log(v)) for r, v in zip(ranks, values) if v > 0]
    if len(points) < 2:
        return float("nan")
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mx, my = mean(xs), mean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="4,8,16",
                        help="rank counts, multiples of --per-node (default 4,8,16)")
    parser.add_argument("--per-node", type=int, default=4, help="ranks per simulated node")
    parser.add_argument("--one-node", action="store_true",
                        help="the same shards and replicas, all on one node (MPI's shared "
                             "memory, no heartbeats): what the simulated nodes add")
    parser.add_argument("--seconds", type=float, default=15.0, help="training per run")
    parser.add_argument("--checkpoint-every", type=float, default=4.0,
                        help="seconds between checkpoints")
    parser.add_argument("--data", type=Path, help="dataset (default: a synthetic one)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    if any(r % args.per_node or r < args.per_node for r in ranks):
        parser.error("every rank count must be a multiple of --per-node")
    with tempfile.TemporaryDirectory(prefix="bench-control-", dir="/var/tmp") as tmp:
        data = args.data.resolve() if args.data else make_data(Path(tmp))
        print(f"Downpour on RMA, {CONFIG.name}, {args.seconds:g} s per run, simulated "
              f"nodes of {args.per_node} ranks, a shard per node"
              f"{' (all on one node: --one-node)' if args.one_node else ''}; "
              f"{os.cpu_count()} cores")
        summaries = {n: train(Path(tmp) / f"r{n}", data, n, args) for n in ranks}
    runs = {n: figures(summary, args.per_node) for n, summary in summaries.items() if summary}
    ranks = sorted(runs)
    if not ranks:
        sys.exit("no run finished")
    names = list(runs[ranks[0]])
    width = max(map(len, names))
    print(f"\n{'ranks':<{width}} " + " ".join(f"{n:>9}" for n in ranks)
          + f" {'growth b':>9} {'last/first':>10}")
    for name in names:
        values = [runs[n][name] for n in ranks]
        positive = [v for v in values if v > 0]
        ratio = positive[-1] / positive[0] if positive else float("nan")
        print(f"{name:<{width}} " + " ".join(f"{v:>9.3g}" for v in values)
              + f" {exponent(ranks, values):>9.2f} {ratio:>10.2f}")
    if args.json:
        args.json.write_text(json.dumps({str(n): runs[n] for n in ranks}, indent=1))


if __name__ == "__main__":
    main()
