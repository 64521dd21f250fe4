"""Row-sharded tables on the parameter server (issue 44, part 3): Downpour's bytes on the
wire per sample with table_pulls = "rows" against the whole-vector path ("whole") in the
same run, against the touched rows' own bytes (an int64 id and the row's float32 values,
pull plus push), on both transports; and a replica's peak memory for two table sizes.

    python benchmarks/bench_sparse_rows.py            # about 6 minutes on 2 cores
    python benchmarks/bench_sparse_rows.py --only bytes|memory

Runs 1 shard + 2 replicas (mpiexec -n 3) for a fixed number of steps on data made by
`distbelief prepare sparse-synthetic` in a temporary folder; reads each run's summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

WORKLOADS = {
    # name: (prepare arguments, model layers, loss, table widths)
    "logistic": (["logistic", "--features", "20000", "--train", "200000"],
                 '[{type = "sparse_linear", units = 1, activation = "sigmoid"}]',
                 "binary_cross_entropy", 1),
    "mf": (["mf", "--users", "2000", "--items", "1000", "--train", "200000"],
           '[{type = "embedding", dim = 8, combine = "dot"}]', "mse", 8),
}
CONFIG = """
[model]
loss = "{loss}"
layers = {layers}
[data]
path = "{data}"
batch_size = 64
[optimizer]
algorithm = "downpour"
learning_rate = 0.1
update = "adagrad"
table_pulls = "{pulls}"
[run]
max_steps = {steps}
max_seconds = 120
eval_every_seconds = 1000
seed = 0
out_dir = "{out}"
"""


def prepare(folder: Path, name: str, args: list[str]) -> Path:
    path = folder / f"{name}.h5"
    if not path.exists():
        subprocess.run([sys.executable, "-m", "distbelief", "prepare", "sparse-synthetic",
                        *args, "--out", str(path)], check=True, capture_output=True)
    return path


def train(folder: Path, tag: str, data: Path, layers: str, loss: str, pulls: str,
          steps: int, transport: str, env: dict[str, str] | None = None) -> dict:
    out = folder / tag
    config = folder / f"{tag}.toml"
    config.write_text(CONFIG.format(loss=loss, layers=layers, data=data, pulls=pulls,
                                    steps=steps, out=out))
    env = dict(os.environ, DISTBELIEF_PS_TRANSPORT=transport, **(env or {}))
    proc = subprocess.run(["mpiexec", "-n", "3", sys.executable, "-m", "mpi4py", "-m",
                           "distbelief", "train", str(config)], check=False, env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-2000:])
    return json.loads((out / "summary.json").read_text())


def own_bytes_per_sample(summary: dict, width: int) -> float:
    """The touched rows' own bytes a sample: each fetched row once pulled and once pushed,
    as an int64 id and `width` float32 values."""
    rows = sum(r["rows_pulled"] for r in summary["replicas"])
    return 2 * rows * (8 + 4 * width) / summary["samples"]


def bytes_table(folder: Path, steps: int) -> None:
    print("| workload | transport | rows: B/sample | own rows' B/sample | rows / own | "
          "whole: B/sample | whole / rows | samples/s per replica rows, whole |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for name, (args, layers, loss, width) in WORKLOADS.items():
        data = prepare(folder, name, args)
        for transport in ("shared", "rma"):
            runs = {pulls: train(folder, f"{name}-{transport}-{pulls}", data, layers, loss,
                                 pulls, steps, transport) for pulls in ("rows", "whole")}
            wire = {p: s["bytes_sent_per_sample"] + s["bytes_received_per_sample"]
                    for p, s in runs.items()}
            own = own_bytes_per_sample(runs["rows"], width)
            rates = ", ".join(f"{s['samples_per_second'] / s['num_replicas']:,.0f}"
                              for s in runs.values())
            print(f"| {name} | {transport} | {wire['rows']:,.0f} | {own:,.0f} | "
                  f"{wire['rows'] / own:.2f} | {wire['whole']:,.0f} | "
                  f"{wire['whole'] / wire['rows']:.1f} | {rates} |", flush=True)


def memory_table(folder: Path, steps: int) -> None:
    """A replica's peak for two table sizes. On one node MPICH maps a shard's RMA window
    into the ranks that read it, so the pages a replica reads of the shard's slice count
    in its resident set too (shared pages: the shard's memory, held once); with
    MPIR_CVAR_NOLOCAL=1 MPI's network module carries the traffic, as between nodes, and a
    replica's peak is its own memory alone."""
    print("| users (table rows) | table MB | replica peak MB, rows (network module) | "
          "replica predicted MB | replica peak MB, rows (one node) | "
          "replica peak MB, whole (network module) | shard peak MB, rows |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for users in (20_000, 2_000_000):
        data = prepare(folder, f"mf{users}", ["mf", "--users", str(users), "--items", "1000",
                                               "--train", "200000"])
        runs = {}
        for pulls, env in (("rows", {"MPIR_CVAR_NOLOCAL": "1"}), ("rows-local", {}),
                           ("whole", {"MPIR_CVAR_NOLOCAL": "1"})):
            runs[pulls] = train(folder, f"mem{users}-{pulls}", data, WORKLOADS["mf"][1],
                                "mse", pulls.removesuffix("-local"), steps, "rma", env)
        replica = {p: max(r["peak_rss_mb"] for r in s["peak_rss"]
                          if r["role"].startswith("replica")) for p, s in runs.items()}
        predicted = max(r.get("predicted_mb", 0) for r in runs["rows"]["peak_rss"]
                        if r["role"].startswith("replica"))
        shard = max(r["peak_rss_mb"] for r in runs["rows"]["peak_rss"]
                    if r["role"].startswith("shard"))
        print(f"| {users:,} | {(users + 1000) * 8 * 4 / 1e6:,.0f} | {replica['rows']:.0f} | "
              f"{predicted:.0f} | {replica['rows-local']:.0f} | {replica['whole']:.0f} | "
              f"{shard:.0f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["bytes", "memory"])
    p.add_argument("--steps", type=int, default=None,
                   help="steps a run (default 3000 for bytes, 1000 for memory)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-rows-") as tmp:
        folder = Path(tmp)
        if args.only in (None, "bytes"):
            bytes_table(folder, args.steps or 3000)
        if args.only in (None, "memory"):
            memory_table(folder, args.steps or 1000)


if __name__ == "__main__":
    main()
