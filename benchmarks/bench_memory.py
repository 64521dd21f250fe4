"""Memory per rank of a training run, from outside: every 0.1 s, each rank's worker
process's resident set split into private (RssAnon) and shared memory (RssShmem, MPI's
windows and shared segments), and its proportional set size (Pss: shared pages divided
among the processes that map them, so Pss summed over ranks is what the node holds).
Prints each rank's maxima next to the peak RSS the run wrote in summary.json, and the
prediction of distbelief.model.memory_model that the run recorded beside it
(`predicted_mb`). For each shard it also prints its slice (its parameters' float32 bytes),
its peak against the slice, the peak less the process's own memory (memory_model.BASE_BYTES)
against the slice, and how many publishes waited for a buffer without readers (`holds`).

    python benchmarks/bench_memory.py -n 3 CONFIG [--set KEY=VALUE ...] [--env NAME=VALUE]

docs/performance.md, "Memory per rank", has the figures and the commands that made them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":")[0]
                if key in ("VmRSS", "RssAnon", "RssShmem", "VmHWM"):
                    out[key] = int(line.split()[1]) * 1024
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    out["Pss"] = int(line.split()[1]) * 1024
    except OSError:
        return {}
    return out


def _rank(pid: int) -> int | None:
    """The MPI rank of a rank's worker process (distbelief.runtime.launching.guardian: the worker
    has DISTBELIEF_GUARDIAN_PID in its environment, its guardian does not); None otherwise."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    if b"distbelief" not in cmd:
        return None
    values = dict(item.split(b"=", 1) for item in env if b"=" in item)
    rank = values.get(b"PMI_RANK") or values.get(b"OMPI_COMM_WORLD_RANK")
    if rank is None or b"DISTBELIEF_GUARDIAN_PID" not in values:  # a guardian, not its worker
        return None
    return int(rank)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        for child in children.get(pid, []):
            found.append(child)
            stack.append(child)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, required=True, help="MPI ranks")
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for mpiexec")
    args = parser.parse_args()
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    env.update(item.split("=", 1) for item in args.env)
    sets = [x for o in args.overrides for x in ("--set", o)]
    cmd = ["mpiexec", "-n", str(args.n), sys.executable, "-m", "distbelief", "train",
           args.config, "--fresh", *sets]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    peaks: dict[int, dict[str, int]] = {}
    pids: dict[int, int] = {}
    while proc.poll() is None:
        for pid in _descendants(proc.pid):
            if pid not in pids:
                rank = _rank(pid)
                if rank is None:
                    continue
                pids[pid] = rank
            figures = _status(pid)
            mine = peaks.setdefault(pids[pid], {})
            for key, value in figures.items():
                mine[key] = max(mine.get(key, 0), value)
        time.sleep(0.1)
    output = proc.stdout.read()
    if proc.returncode:
        print(output[-3000:])
        return proc.returncode
    out_dir = next((line.split("results in ", 1)[1].strip() for line in output.splitlines()
                    if line.startswith("results in ")), None)
    summary = json.loads((Path(out_dir) / "summary.json").read_text()) if out_dir else {}
    roles = {f["rank"]: f for f in summary.get("peak_rss", [])}
    mb = 2**20
    print(f"{'rank':>4} {'role':<12} {'summary peak':>12} {'max RSS':>8} {'anon':>7} "
          f"{'shmem':>7} {'Pss':>7} {'predicted':>9}  (MB)")
    for rank in sorted(peaks):
        p, f = peaks[rank], roles.get(rank, {})
        predicted = f"{f['predicted_mb']:>9.0f}" if "predicted_mb" in f else f"{'-':>9}"
        print(f"{rank:>4} {f.get('role', '?'):<12} {f.get('peak_rss_mb', 0):>12.0f} "
              f"{p.get('VmRSS', 0) / mb:>8.0f} {p.get('RssAnon', 0) / mb:>7.0f} "
              f"{p.get('RssShmem', 0) / mb:>7.0f} {p.get('Pss', 0) / mb:>7.0f} {predicted}")
    base = 90 << 20  # memory_model.BASE_BYTES: the process itself
    for shard in summary.get("shards", []):
        slice_mb = shard["params"] * 4 / mb
        peak = roles.get(shard["rank"], {}).get("peak_rss_mb", 0)
        print(f"shard {shard['rank']}: slice {slice_mb:.1f} MB, peak {peak:.0f} MB = "
              f"{peak / slice_mb:.1f}x the slice, {(peak - base / mb) / slice_mb:.1f}x above "
              f"the process's {base / mb:.0f} MB; {shard.get('holds', 0)} publish(es) held, "
              f"{shard.get('folds', 0)} folds, {shard.get('pulls', 0)} pulls")
    stale = summary.get("staleness") or {}
    print(f"samples/s (summary.json): {summary.get('samples_per_second', 0):.0f}; staleness "
          f"mean {stale.get('mean', 0):.2f}, max {stale.get('max', 0)}")
    print(f"sum of Pss maxima: {sum(p.get('Pss', 0) for p in peaks.values()) / mb:.0f} MB; "
          f"steps {summary.get('steps')}, params {summary.get('num_params')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
