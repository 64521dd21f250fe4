"""Training from a streamed file (data.in_memory = false) against the in-memory path, in
the same run (issue 30 item 3).

(a) Fashion-MNIST, the reference MLP, single-process SGD: samples/s of `--steps` steps,
    in memory and streamed, alternated `--repeats` times (a neighbour's load hits both);
    the ratio streamed / in memory of the medians (target: at least 0.95), and each run's
    peak RSS.
(b) With `--large-gb G`: a synthetic set of G GB on disk (28x28 uint8 rows, made once under
    `--workdir` by `distbelief prepare synthetic` and kept), larger than this machine's
    memory for G above it; the same model streams it for `--seconds` with
    data.stream_memory_mb = `--memory-mb`. Printed: samples/s and the MB/s of rows that is,
    the disk's read rate measured in the same run (`--drop-caches`: the page cache emptied
    before each, so both read from the disk), the samples/s of Fashion-MNIST (rows of the
    same shape) in memory for as long, just before, as the compute bound, and the run's
    peak RSS against the setting.

Each training run is `python -m distbelief train` in a fresh process, one BLAS thread.

    python benchmarks/bench_streaming.py                       # (a), about a minute
    python benchmarks/bench_streaming.py --large-gb 30 --workdir /var/tmp/db-stream --drop-caches
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "fashion_mnist_mlp.toml"
ROW_BYTES = 28 * 28
# Runs one training command, then prints the process's peak RSS (VmHWM) as the last line.
RUNNER = ("import sys\nfrom distbelief.cli import main\nrc = main(sys.argv[1:])\n"
          "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')]\n"
          "print('PEAK_RSS_KB', hwm[0].split()[1])\nsys.exit(rc)\n")


def train(data: Path, out: Path, *sets: str) -> tuple[dict, float]:
    """(summary, peak RSS in MB) of one single-process training run."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", RUNNER, "train", str(CONFIG), "--fresh",
           "--set", f'data.path="{data}"', "--set", f'run.out_dir="{out}"',
           "--set", "run.target_accuracy=0.999", "--set", "run.eval_every_seconds=1000",
           *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        sys.exit(f"training failed:\n{proc.stderr[-2000:]}")
    peak = int(proc.stdout.strip().splitlines()[-1].split()[1]) / 1024
    return json.loads((out / "summary.json").read_text()), peak


def fashion_mnist_file(work: Path) -> Path:
    data = work / "fashion_mnist.h5"
    if not data.exists():
        subprocess.run([sys.executable, "-m", "distbelief", "prepare", "fashion-mnist",
                        "--out", str(data)], check=True)
    return data


def fashion_mnist(args: argparse.Namespace, work: Path) -> None:
    data = fashion_mnist_file(work)
    budget = f"run.max_steps={args.steps}"
    rates: dict[str, list[float]] = {"in memory": [], "streamed": []}
    peaks: dict[str, list[float]] = {"in memory": [], "streamed": []}
    for _ in range(args.repeats):
        for name, sets in (("in memory", []), ("streamed", ["data.in_memory=false"])):
            summary, peak = train(data, work / "runs" / name.replace(" ", "_"), budget, *sets)
            rates[name].append(summary["samples_per_second"])
            peaks[name].append(peak)
    print(f"(a) Fashion-MNIST, reference MLP, sgd, {args.steps} steps, {args.repeats} runs "
          f"each (alternated), load average {os.getloadavg()[0]:.2f}")
    for name, seen in rates.items():
        print(f"    {name:>9}: samples/s {', '.join(f'{r:,.0f}' for r in seen)} "
              f"(median {statistics.median(seen):,.0f}); peak RSS "
              f"{max(peaks[name]):,.0f} MB")
    ratio = statistics.median(rates["streamed"]) / statistics.median(rates["in memory"])
    print(f"    streamed / in memory: {ratio:.3f} (target >= 0.95)")


def disk_read_rate(path: Path, start: int, nbytes: int) -> float:
    """MB/s of reading `nbytes` of `path` from offset `start` (a part nothing read yet)."""
    block = 8 << 20
    t0 = time.perf_counter()
    with path.open("rb", buffering=0) as f:
        f.seek(start)
        done = 0
        while done < nbytes:
            chunk = f.read(min(block, nbytes - done))
            if not chunk:
                break
            done += len(chunk)
    return done / (time.perf_counter() - t0) / 1e6


def drop_page_cache(args: argparse.Namespace) -> None:
    """With --drop-caches (root): empty the page cache, so reads come from the disk."""
    if args.drop_caches:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")


def large(args: argparse.Namespace, work: Path) -> None:
    rows = int(args.large_gb * 1e9 / ROW_BYTES)
    data = work / f"synthetic_{args.large_gb:g}gb.h5"
    if not data.exists():
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "distbelief", "prepare", "synthetic", "--out",
                        str(data), "--train", str(rows), "--test", "10000", "--shape",
                        "28,28,1", "--classes", "10"], check=True)
        print(f"    made {data} ({data.stat().st_size / 1e9:.1f} GB) in "
              f"{time.perf_counter() - t0:.0f} s")
    size = data.stat().st_size
    mem_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    budget = (f"run.max_seconds={args.seconds}", "run.max_steps=0", "run.eval_samples=2000")
    # The compute bound in the same conditions: Fashion-MNIST (rows of the same shape) in
    # memory, for as long, just before.
    bound, _ = train(fashion_mnist_file(work), work / "runs" / "bound", *budget)
    compute_bound = bound["samples_per_second"]
    drop_page_cache(args)
    summary, peak = train(data, work / "runs" / "large", *budget, "data.in_memory=false",
                          f"data.stream_memory_mb={args.memory_mb}")
    rate = summary["samples_per_second"]
    drop_page_cache(args)
    disk = disk_read_rate(data, size // 2, min(size // 10, 4 << 30))
    print(f"(b) synthetic {size / 1e9:.1f} GB on disk (this machine's memory: "
          f"{mem_total / 1e9:.1f} GB), streamed for {args.seconds:g} s with "
          f"data.stream_memory_mb = {args.memory_mb}, load average {os.getloadavg()[0]:.2f}")
    print(f"    samples/s {rate:,.0f} = {rate * ROW_BYTES / 1e6:.1f} MB/s of rows; the disk "
          f"reads {disk:,.0f} MB/s; Fashion-MNIST in memory, run for as long just "
          f"before, trained {compute_bound:,.0f} samples/s (the compute bound): streamed / "
          f"in memory {rate / compute_bound:.3f}")
    print(f"    peak RSS {peak:,.0f} MB with data.stream_memory_mb = {args.memory_mb} "
          f"(the rows alone would need {rows * ROW_BYTES / 2**20 / 1024:,.1f} GB in memory)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--large-gb", type=float, default=0.0,
                        help="also stream a synthetic set this large (GB on disk)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--skip-small", action="store_true", help="(b) only")
    parser.add_argument("--memory-mb", type=int, default=256)
    parser.add_argument("--drop-caches", action="store_true",
                        help="(root) empty the page cache before (b)'s run and its disk "
                             "read, so both read from the disk")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the data files go (kept between runs)")
    args = parser.parse_args()
    if args.workdir is None:
        args.workdir = Path(tempfile.mkdtemp(prefix="bench-streaming-"))
    args.workdir.mkdir(parents=True, exist_ok=True)
    if not args.skip_small:
        fashion_mnist(args, args.workdir)
    if args.large_gb:
        large(args, args.workdir)


if __name__ == "__main__":
    main()
