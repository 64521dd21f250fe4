"""Checkpoint write and load speed against the raw disk, and the overhead at the default
interval.

A model of --params float32 parameters (default 100M) plus its Adagrad accumulator is
checkpointed the way the single-process trainer does it (distbelief.records.checkpoint.save_local:
one shard part, one replica part, manifest, atomic commit, retention) and loaded back
(find_latest, which verifies every sha256, then read_state). The same bytes are written as
one plain file with write + fsync, and read back with one read, in the same run, so the
ratios compare like with like on this machine's disk.

Loads are read from the page cache when the file was just written (dropping the cache
needs root); the ratio against a plain read of the same bytes is fair either way, the
absolute figure is a best case.

One untimed round goes first: on this VM the first touch of fresh memory can cost a
second per 400 MB (the host backing the guest's pages), which would land on whichever
measurement allocates first.

The overhead is estimated, not measured: a checkpoint blocks the training loop for its
write time once per interval, so overhead = write / (interval + write).

Downpour (section 2): the same Downpour job (configs/fashion_mnist_downpour.toml, the
reference MLP, 669,706 parameters; --ranks ranks, 1 shard) trains for --seconds seconds
with periodic checkpoints every --every seconds and, as the peer in the same run, with
none (the final checkpoint, written after training, is not counted); training steps
completed in the time, median of --rounds interleaved pairs. Measured overhead at that
short interval = 1 - steps with / steps without. Every Downpour checkpoint pauses every
rank (a global consistency point), so the overhead at the default interval is estimated
from the measured pause per checkpoint (summary.json's checkpoint_seconds / checkpoints
written, rank 0's wall time from the agreed round to the release, once the shards have
copied their state): pause / (interval + pause). The writes that follow in the background
are timed too (the markers' write_seconds, from the release to the commit). Needs
data/fashion_mnist.h5 (`distbelief prepare fashion-mnist`); `--set` makes the model wider,
so that the writes count, for example `--set 'model.layers=[{type="dense", units=4096,
activation="relu"}, {type="dense", units=10, activation="softmax"}]'`.

    python benchmarks/bench_checkpoint.py                  # 100M parameters, then Downpour
    python benchmarks/bench_checkpoint.py --params 10000000 --dir /scratch/me
    python benchmarks/bench_checkpoint.py --only downpour --ranks 3 --every 1
    python benchmarks/bench_checkpoint.py --only replicas --dir /lustre/me

Replicas (section 3): the part of a checkpoint that one rank writes for R replicas (each
a data position and a few counters; Downpour's shard 0, sync's and Hogwild's writer),
as one replicas.h5 with a group per replica against the earlier one file per replica
(each created, fsynced, re-read for its sha256 and renamed), commit included, for R =
10, 100 and 1,000; the ratio is files / one part. On a parallel file system each file
costs metadata-server round trips, so run it there with --dir to see the cluster's figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from distbelief.config import RunConfig, settings_hash
from distbelief.model.layout import ParamLayout
from distbelief.records import checkpoint as ckpt

SETTINGS = {"model": {"benchmark": True}, "run": {"seed": 0}}
REPO = Path(__file__).resolve().parents[1]
DOWNPOUR_CONFIG = REPO / "configs" / "fashion_mnist_downpour.toml"


def raw_write(path: Path, arrays: list[np.ndarray]) -> float:
    start = time.perf_counter()
    with path.open("wb") as f:
        for a in arrays:
            f.write(memoryview(a))
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def raw_read(path: Path, count: int) -> float:
    """One read into a freshly allocated array, as a loader would (and as read_state does)."""
    start = time.perf_counter()
    data = np.empty(count, np.float32)
    with path.open("rb", buffering=0) as f:
        got = f.readinto(memoryview(data).cast("B"))
    seconds = time.perf_counter() - start
    if got != data.nbytes:
        raise RuntimeError(f"read {got} of {data.nbytes} bytes back")
    return seconds


def checkpoint_write(root: Path, step: int, layout: ParamLayout, params: np.ndarray,
                     accum: np.ndarray) -> float:
    meta = ckpt.CheckpointMeta(step, step, float(step), settings_hash(SETTINGS))
    start = time.perf_counter()
    ckpt.save_local(root, meta, settings=SETTINGS, algorithm="sgd", layout=layout,
                    params=params, optimizer_state={"accum": accum},
                    data_state={"epoch": 0, "position": step}, counters={"step": step},
                    keep=2)
    return time.perf_counter() - start


def checkpoint_load(root: Path, params: np.ndarray, accum: np.ndarray) -> tuple[float, float]:
    """(seconds to find and verify the newest checkpoint, seconds to read its state)."""
    start = time.perf_counter()
    found, damaged = ckpt.find_latest(root)
    verified = time.perf_counter()
    got_params, state = found.read_state()
    done = time.perf_counter()
    if damaged or not (np.array_equal(got_params, params)
                       and np.array_equal(state["accum"], accum)):
        raise RuntimeError("the checkpoint did not read back what was written")
    return verified - start, done - verified


def describe(values: list[float]) -> str:
    return f"best {min(values):6.2f}s  median {statistics.median(values):6.2f}s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("write", "downpour", "replicas"), default=None,
                        help="run one section: the 100M write/load, Downpour's overhead, "
                             "or the replicas' part at R = 10-1,000")
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None,
                        help="folder on the disk to measure (default: the system temp dir)")
    parser.add_argument("--ranks", type=int, default=3, help="Downpour: ranks (1 shard)")
    parser.add_argument("--seconds", type=float, default=8.0,
                        help="Downpour: training seconds per run")
    parser.add_argument("--every", type=float, default=1.0,
                        help="Downpour: checkpoint interval of the measured runs (s)")
    parser.add_argument("--pairs", type=int, default=3,
                        help="Downpour: interleaved runs with and without checkpoints")
    parser.add_argument("--data", type=Path, default=REPO / "data" / "fashion_mnist.h5")
    parser.add_argument("--set", dest="sets", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="Downpour: a further setting for train (repeatable), e.g. "
                             "a wider model to make the writes count")
    args = parser.parse_args()
    if args.only in (None, "write"):
        bench_write_load(args)
    if args.only in (None, "downpour"):
        bench_downpour(args)
    if args.only in (None, "replicas"):
        bench_replicas(args)


def replicas_commit(root: Path, step: int, replicas: int, together: bool) -> float:
    """Seconds to write R replicas' states (one part, or a file each) and commit."""
    layout = ParamLayout([(0, "weights", (16,))])
    params = np.zeros(16, dtype=np.float32)
    settings = {"bench": 1}
    meta = ckpt.CheckpointMeta(step, step, 0.0, settings_hash(settings))
    began = time.perf_counter()
    partial = ckpt.prepare(root, step)
    records = [ckpt.write_shard_part(partial, meta, 0, 0, 16, params, {})]
    states = [ckpt.ReplicaState(r, {"local_steps": step}, {"epoch": 0, "position": r},
                                None, {}) for r in range(replicas)]
    if together:
        records.append(ckpt.write_replicas_part(partial, meta, states))
    else:
        records += [ckpt.write_replica_part(partial, meta, s.index, s.data_state, None,
                                            s.counters) for s in states]
    ckpt.commit(root, meta, settings=settings, algorithm="downpour", layout=layout,
                shard_ranges=[(0, 16)], optimizer_state=[], parts=records,
                num_replicas=replicas, keep=2)
    return time.perf_counter() - began


def bench_replicas(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench_checkpoint-", dir=args.dir))
    print(f"replicas' part, in {work}; load average {os.getloadavg()[0]:.2f}")
    try:
        step = 0
        for replicas in (10, 100, 1000):
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.rounds):
                for together in (False, True):  # alternated, so drift hits both
                    step += 1
                    times[together].append(replicas_commit(work / "checkpoints", step,
                                                           replicas, together))
            one, files = (statistics.median(times[t]) for t in (True, False))
            print(f"R = {replicas:5d}: one part {one * 1e3:8.1f} ms   a file each "
                  f"{files * 1e3:8.1f} ms   ratio {files / one:6.1f}x")
    finally:
        shutil.rmtree(work)


def bench_write_load(args: argparse.Namespace) -> None:
    n = args.params
    rng = np.random.default_rng(0)
    params = rng.standard_normal(n, dtype=np.float32)
    accum = rng.random(n, dtype=np.float32)
    layout = ParamLayout([(0, "weights", (n,))])
    gigabytes = 2 * n * 4 / 1e9
    interval = RunConfig.checkpoint_every_seconds
    work = Path(tempfile.mkdtemp(prefix="bench_checkpoint-", dir=args.dir))
    print(f"{n:,d} parameters + Adagrad state = {gigabytes:.2f} GB, in {work}; "
          f"load average {os.getloadavg()[0]:.2f}")
    try:
        raw_w, raw_r, ck_w, ck_v, ck_r = [], [], [], [], []
        for step in range(args.rounds + 1):  # round 0 warms up and is not counted
            raw = work / "raw.bin"
            timings = [raw_write(raw, [params, accum]), raw_read(raw, 2 * n)]
            raw.unlink()
            timings.append(checkpoint_write(work / "checkpoints", step, layout, params, accum))
            timings += checkpoint_load(work / "checkpoints", params, accum)
            if step:
                for values, seconds in zip((raw_w, raw_r, ck_w, ck_v, ck_r), timings,
                                           strict=True):
                    values.append(seconds)
        ck_l = [v + r for v, r in zip(ck_v, ck_r, strict=True)]
    finally:
        shutil.rmtree(work)

    print(f"raw write + fsync     {describe(raw_w)}   {gigabytes / min(raw_w):5.2f} GB/s")
    print(f"checkpoint write      {describe(ck_w)}   {gigabytes / min(ck_w):5.2f} GB/s   "
          f"ratio {min(ck_w) / min(raw_w):.2f}x raw")
    print(f"raw read              {describe(raw_r)}   {gigabytes / min(raw_r):5.2f} GB/s")
    print(f"checkpoint load       {describe(ck_l)}   {gigabytes / min(ck_l):5.2f} GB/s   "
          f"ratio {min(ck_l) / min(raw_r):.2f}x raw   (verify sha256 {min(ck_v):.2f}s + "
          f"read {min(ck_r):.2f}s)")
    write = statistics.median(ck_w)
    print(f"overhead at run.checkpoint_every_seconds = {interval:g} (the default), estimated "
          f"as write / (interval + write) with the median write: "
          f"{100 * write / (interval + write):.2f}% of training time")


def downpour_run(args: argparse.Namespace, out: Path, every: float) -> dict:
    """One Downpour job for --seconds; its summary.json."""
    sets = {"data.path": f'"{args.data.resolve()}"', "run.out_dir": f'"{out}"',
            "run.max_steps": 0, "run.max_seconds": args.seconds,
            "run.target_accuracy": 1.0,  # never reached: every run trains the full time
            "run.checkpoint_every_seconds": every, "run.keep_checkpoints": 2,
            "run.progress_every_seconds": 1000}
    cmd = ["mpiexec", "-n", str(args.ranks), sys.executable, "-m", "distbelief", "train",
           str(DOWNPOUR_CONFIG), "--fresh"]
    for setting in [f"{key}={value}" for key, value in sets.items()] + args.sets:
        cmd += ["--set", setting]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.seconds + 120,
                          env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads((out / "summary.json").read_text())


def bench_downpour(args: argparse.Namespace) -> None:
    if not args.data.is_file():
        raise SystemExit(f"{args.data} missing: distbelief prepare fashion-mnist")
    work = Path(tempfile.mkdtemp(prefix="bench_checkpoint_downpour-", dir=args.dir))
    print(f"\nDownpour, {args.ranks} ranks (1 shard, {args.ranks - 1} replicas), "
          f"{args.seconds:g} s per run, checkpoints every {args.every:g} s against none; "
          f"load average {os.getloadavg()[0]:.2f}")
    steps_with, steps_without, pauses, writes = [], [], [], []
    try:
        for pair in range(args.pairs):
            without = downpour_run(args, work / "without", 0.0)
            with_ = downpour_run(args, work / "with", args.every)
            steps_without.append(without["steps"] / without["wall_seconds"])
            steps_with.append(with_["steps"] / with_["wall_seconds"])
            # The final checkpoint, after training, is in checkpoint_seconds too: leave
            # it out of the periodic pause.
            periodic = with_["checkpoints_written"] - 1
            final_marks = [m for m in _marks(work / "with") if m["step"] == with_["steps"]]
            final = final_marks[-1]["seconds"] if final_marks else 0.0
            if periodic > 0:
                pauses.append((with_["checkpoint_seconds"] - final) / periodic)
            writes += [m["write_seconds"] for m in _marks(work / "with")
                       if m["step"] != with_["steps"] and "write_seconds" in m]
            print(f"  pair {pair}: {steps_without[-1]:7.1f} steps/s without, "
                  f"{steps_with[-1]:7.1f} with {periodic} checkpoints; "
                  f"load {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(work)
    a, b = statistics.median(steps_without), statistics.median(steps_with)
    pause = statistics.median(pauses)
    interval = RunConfig.checkpoint_every_seconds
    print(f"steps/s, median: {a:.1f} without checkpoints, {b:.1f} with one every "
          f"{args.every:g} s: measured overhead {100 * (1 - b / a):.2f}% at that interval")
    print(f"pause per checkpoint (every rank waits), median: {pause * 1000:.1f} ms; at "
          f"run.checkpoint_every_seconds = {interval:g} (the default), estimated as pause / "
          f"(interval + pause): {100 * pause / (interval + pause):.4f}% of training time "
          f"(target < 5%)")
    if writes:
        print(f"written after the release, in the background, median: "
              f"{statistics.median(writes) * 1000:.1f} ms per checkpoint")


def _marks(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if m.get("kind") == "checkpoint"]


if __name__ == "__main__":
    main()
