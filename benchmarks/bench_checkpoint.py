"""Checkpoint write and load speed against the raw disk, and the overhead at the default
interval.

A model of --params float32 parameters (default 100M) plus its Adagrad accumulator is
checkpointed the way the single-process trainer does it (distbelief.checkpoint.save_local:
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

    python benchmarks/bench_checkpoint.py                  # 100M parameters, 3 rounds
    python benchmarks/bench_checkpoint.py --params 10000000 --dir /scratch/me
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from distbelief import checkpoint as ckpt
from distbelief.config import RunConfig, settings_hash
from distbelief.layout import ParamLayout

SETTINGS = {"model": {"benchmark": True}, "run": {"seed": 0}}


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
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None,
                        help="folder on the disk to measure (default: the system temp dir)")
    args = parser.parse_args()

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


if __name__ == "__main__":
    main()
