"""Shared test helpers: run the command line or an MPI job as a subprocess, always under a
timeout, so a deadlock fails the test instead of freezing CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


def _env(threads: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    # One BLAS thread per process: MPI tests oversubscribe the two cores.
    env["OPENBLAS_NUM_THREADS"] = str(threads)
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_cli(args: list[str], timeout: float = 120, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m distbelief ARGS` in a subprocess; output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "distbelief", *map(str, args)],
        capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env or _env(), check=False,
    )


def run_mpi(n: int, args: list[str], timeout: float = 120, cwd: Path | None = None,
            env: dict[str, str] | None = None,
            launcher_options: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`mpiexec [LAUNCHER_OPTIONS] -n N python ARGS` in a subprocess, under a timeout.

    ARGS starts with what python runs: `["-m", "distbelief", "train", cfg]` or a script
    path. On timeout the whole process group is killed and the test fails.
    """
    cmd = ["mpiexec", *launcher_options, "-n", str(n), sys.executable, *map(str, args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=cwd, env=env or _env(), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"MPI job timed out after {timeout}s (deadlock?): {cmd}\n"
                    f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture
def fashion_mnist_dir() -> Path:
    """The Debian dataset-fashion-mnist IDX folder; CI installs it, so its absence fails."""
    if not FASHION_MNIST_DIR.is_dir():
        pytest.fail(f"{FASHION_MNIST_DIR} missing: apt-get install dataset-fashion-mnist")
    return FASHION_MNIST_DIR
