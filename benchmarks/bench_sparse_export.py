"""A sparse model's checkpoint exported and evaluated a piece at a time (issue 44, part 3;
records.vectors): the peak memory of `distbelief export` and `distbelief evaluate` at two
table sizes, against reading the whole vector as before.

    python benchmarks/bench_sparse_export.py                 # about a minute on 2 cores
    python benchmarks/bench_sparse_export.py --users 200000 2000000 --shards 4

For each size: matrix factorisation data (`--users` x 1,000 items, dim 8; 20,000 test
ratings) and a checkpoint of it in `--shards` parts, written a shard's slice at a time as
the shards write them (model parameters and Adagrad state). Then, each in a fresh process:
the export (HDF5, with the optimizer state), `evaluate` of the checkpoint, `evaluate` of
the export, and, for comparison, the whole vector read and evaluated in one process (the
path before). Each prints its peak: tracemalloc's (the numpy arrays it allocated) and the
process's peak RSS (VmHWM) above its peak once the modules were imported.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

LAYERS = [{"type": "embedding", "dim": 8, "combine": "dot"}]
WORKS = ("export", "evaluate checkpoint", "evaluate export", "whole vector")


def make_run(folder: Path, users: int, shards: int) -> Path:
    """Data and a committed checkpoint of a model of `users` x 1,000 items."""
    from distbelief.config import build_network, config_from_dict, config_hash, hashed_settings
    from distbelief.data.hdf5 import open_dataset
    from distbelief.data.synthetic_sparse import Options, make_sparse_synthetic
    from distbelief.records import checkpoint as ckpt

    data = make_sparse_synthetic("mf", folder / "mf.h5", Options(
        train=20_000, test=20_000, users=users, items=1_000)).info.path
    config = config_from_dict({
        "model": {"loss": "mse", "layers": LAYERS},
        "data": {"path": str(data), "batch_size": 64},
        "optimizer": {"algorithm": "downpour", "learning_rate": 0.1, "update": "adagrad"},
        "run": {"out_dir": str(folder / "run"), "max_steps": 1}})
    network = build_network(config, open_dataset(data))
    root = ckpt.checkpoint_root(config.run.out_dir)
    meta = ckpt.CheckpointMeta(1, 64, 1.0, config_hash(config))
    partial = ckpt.prepare(root, meta.step)
    ranges = network.layout.shard_ranges(shards)
    records = []
    for i, (a, b) in enumerate(ranges):
        params = network.init_slice(0, a, b)
        records.append(ckpt.write_shard_part(partial, meta, i, a, b, params,
                                             {"accum": np.full(b - a, 0.1, np.float32)}))
    records.append(ckpt.write_replica_part(partial, meta, 0, {}))
    ckpt.commit(root, meta, settings=hashed_settings(config), algorithm="downpour",
                layout=network.layout, shard_ranges=ranges, optimizer_state=["accum"],
                parts=records, num_replicas=1, keep=2)
    return Path(config.run.out_dir)


def measure(work: str, run: Path) -> dict:
    """One work in this process: its seconds and peaks."""
    from distbelief.api import evaluate_split
    from distbelief.data.hdf5 import load_test, open_dataset
    from distbelief.records.export import read_trained, write_export

    base_rss = peak_rss_mb()
    tracemalloc.start()
    start = time.perf_counter()
    export = run.parent / "model.h5"
    if work == "export":
        export.unlink(missing_ok=True)
        write_export(read_trained(run, with_optimizer=True), export)
        figure = export.stat().st_size
    elif work == "whole vector":
        trained = read_trained(run)
        info = open_dataset(trained.source["data"])
        x, y = load_test(info)
        figure = trained.network().evaluate(trained.params, x, y, batch_size=1000).loss
    else:
        path = run if work == "evaluate checkpoint" else export
        figure = evaluate_split(path, read_trained(path), None, "test")["loss"]
    seconds = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    rss = peak_rss_mb()
    return {"work": work, "seconds": seconds, "figure": figure, "traced_mb": peak / 1e6,
            "rss_mb": rss, "rss_above_imports_mb": rss - base_rss}


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM: unlike ru_maxrss, not inherited across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1e3
    raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, nargs="+", default=[200_000, 2_000_000])
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--child", nargs=2, metavar=("WORK", "RUN"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import distbelief.api  # the modules, before the baseline RSS
        import distbelief.records.export  # noqa: F401

        print(json.dumps(measure(args.child[0], Path(args.child[1]))))
        return
    print(f"{'users':>10} {'table MB':>9}  {'work':<20} {'s':>6} {'traced MB':>10} "
          f"{'RSS MB':>7} {'RSS above imports':>18}  figure")
    for users in args.users:
        with tempfile.TemporaryDirectory(dir=".") as tmp:
            run = make_run(Path(tmp), users, args.shards)
            table_mb = (users + 1_000) * 8 * 4 / 1e6
            for work in WORKS:
                out = subprocess.run([sys.executable, __file__, "--child", work, str(run)],
                                     check=True, capture_output=True, text=True).stdout
                r = json.loads(out.splitlines()[-1])
                print(f"{users:>10,d} {table_mb:>9.1f}  {work:<20} {r['seconds']:>6.2f} "
                      f"{r['traced_mb']:>10.1f} {r['rss_mb']:>7.0f} "
                      f"{r['rss_above_imports_mb']:>18.0f}  {r['figure']:.6g}", flush=True)


if __name__ == "__main__":
    main()
