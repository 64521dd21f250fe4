"""What the Sandblaster test files share: its configuration, runs and reference optimum."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
from scipy.optimize import minimize as scipy_minimize

from distbelief.data.hdf5 import open_dataset, read_rows, to_float
from distbelief.model.network import Network
from helpers import set_args
from helpers.mpi_jobs import REPO, run_mpi

PROGRAMS = REPO / "tests" / "mpi_programs"
TIMEOUT = 120
SOFTMAX = '[{ type = "dense", units = 4, activation = "softmax" }]'


def toml(layers: str = SOFTMAX, batch: int = 100000, **optimizer: object) -> str:
    opts = {"algorithm": '"sandblaster"', "m": 5, "work_unit_size": 100, **optimizer}
    lines = "\n".join(f"{k} = {v}" for k, v in opts.items())
    return f"""
[model]
layers = {layers}
[data]
path = "synth.h5"
batch_size = {batch}
[optimizer]
{lines}
[cluster]
ps_shards = 1
[run]
max_steps = 100
eval_every_seconds = 0.5
progress_every_seconds = 0.5
threads = 1
"""


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


def train(n: int, config: Path, out: Path, *overrides: str, env: dict | None = None,
          timeout: float = TIMEOUT):
    return run_mpi(n, ["-m", "distbelief", "train", config,
                       *set_args(f'run.out_dir="{out}"', *overrides)], timeout=timeout, env=env)


def training_set(path: Path) -> tuple[np.ndarray, np.ndarray]:
    info = open_dataset(path)
    x, y = read_rows(info, "train", 0, info.n_train)
    return to_float(x, info.scale), y


def network_for(path: Path, layers: list[dict]) -> Network:
    info = open_dataset(path)
    return Network(info.input_shape, layers, info.num_classes)


def scipy_optimum(net: Network, x: np.ndarray, y: np.ndarray) -> float:
    """The reference: scipy's L-BFGS-B on the same full-batch loss, run to a tight
    tolerance from the same start."""
    grad = np.zeros(net.layout.size, dtype=np.float32)

    def f(w: np.ndarray) -> tuple[float, np.ndarray]:
        loss = net.loss_and_grad(w.astype(np.float32), x, y, grad)
        return loss, grad.astype(np.float64)

    result = scipy_minimize(f, net.init_params(0).astype(np.float64), jac=True,
                            method="L-BFGS-B",
                            options={"maxiter": 2000, "gtol": 1e-10, "ftol": 1e-15})
    return float(result.fun)


def shard_bytes_per_iteration(metrics: list[dict]) -> list[int]:
    """Coordinator<->shard bytes of each iteration that needed one line-search trial (the
    first iteration left out: it also holds the initial evaluation and snapshot)."""
    lines = [m for m in metrics if m["kind"] == "train"]
    return [b["coordinator_shard_bytes"] - a["coordinator_shard_bytes"]
            for a, b in itertools.pairwise(lines)
            if b["line_search_evals"] == 1 and not b["restarted"]]
