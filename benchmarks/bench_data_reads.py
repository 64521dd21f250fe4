"""Bytes each rank reads from the dataset file, by role (issue 32 item 2): a Sandblaster
run at R replicas on a synthetic Fashion-MNIST-sized row (28x28 uint8), full batch and
minibatch; each rank's distbelief.data.hdf5.bytes_read() at the end, gathered and printed
as one JSON line per run, with the training set's size for scale.

    python benchmarks/bench_data_reads.py [--replicas 2 4] [--n-train 12000] [--steps 5]

It launches `mpiexec -n (R + 2) python benchmarks/bench_data_reads.py --rank CONFIG` per
run (one shard, the coordinator, R replicas). Run it against another checkout with
PYTHONPATH=<that checkout>/src to compare (the counter exists since it was added).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIG = """
[model]
layers = [{{ type = "dense", units = 10, activation = "softmax" }}]
[data]
path = "{data}"
batch_size = {batch}
[optimizer]
algorithm = "sandblaster"
m = 5
[cluster]
ps_shards = 1
[run]
out_dir = "{out}"
max_steps = {steps}
eval_every_seconds = 1000
progress_every_seconds = 1000
threads = 1
"""


def rank_report(config_path: str) -> None:
    from mpi4py import MPI

    from distbelief.algorithms.sandblaster import roles as sandblaster
    from distbelief.config import load_config
    from distbelief.data.hdf5 import bytes_read

    comm = MPI.COMM_WORLD
    config = load_config(config_path)
    role = sandblaster.start(config, comm, stream=None)
    role.run()
    name = type(role).__name__
    sandblaster.finish(comm, role)
    rows = comm.gather((comm.Get_rank(), name, bytes_read()), root=0)
    if comm.Get_rank() == 0:
        print("RANKS " + json.dumps(rows), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--n-train", type=int, default=12000)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_report(args.rank)
        return
    from distbelief.data.converters import make_synthetic

    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "synth.h5"
        make_synthetic(data, args.n_train, 2000, (28, 28, 1), 10, 0)
        train_bytes = args.n_train * (28 * 28 + 4)
        for replicas in args.replicas:
            for batch in (args.n_train, args.n_train // 6):
                config = Path(tmp) / "c.toml"
                config.write_text(CONFIG.format(data=data, batch=batch, steps=args.steps,
                                                out=Path(tmp) / f"out-{replicas}-{batch}"))
                proc = subprocess.run(["mpiexec", "-n", str(replicas + 2), sys.executable,
                                       __file__, "--rank", str(config)], env=env, check=False,
                                      capture_output=True, text=True, timeout=600)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RANKS ")),
                            None)
                if proc.returncode or line is None:
                    sys.exit(f"run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
                ranks = json.loads(line.removeprefix("RANKS "))
                print(json.dumps({
                    "replicas": replicas, "batch": batch, "train_bytes": train_bytes,
                    "bytes_read": {f"{rank}:{role}": n for rank, role, n in ranks},
                    "replica_fraction_of_train": [round(n / train_bytes, 3)
                                                  for _, role, n in ranks
                                                  if role == "Replica"]}), flush=True)


if __name__ == "__main__":
    main()
