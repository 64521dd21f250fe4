"""Shared test helpers: run the command line or an MPI job as a subprocess, always under a
timeout, so a deadlock fails the test instead of freezing CI."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")

# PyTorch is the reference of a few tests (marked `torch`), never a dependency: the plain
# `pip install torch` on Linux fetches a multi-GB CUDA build, so the test extra leaves it
# out and those tests skip, naming the CPU wheel. CI's second step installs it and sets
# DISTBELIEF_REQUIRE_TORCH=1, which turns the skip into a failure.
TORCH_INSTALL = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
REQUIRE_TORCH = "DISTBELIEF_REQUIRE_TORCH"


def import_torch():
    """torch, or a skip (a failure under DISTBELIEF_REQUIRE_TORCH=1) naming the install."""
    try:
        import torch
    except ImportError:
        reason = f"needs PyTorch as the reference, not installed: {TORCH_INSTALL}"
        if os.environ.get(REQUIRE_TORCH) == "1":
            pytest.fail(f"{REQUIRE_TORCH}=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    return torch


@pytest.fixture(name="torch")
def torch_fixture():
    """PyTorch for a test that compares with it (such tests are marked `torch`)."""
    torch = import_torch()
    torch.set_num_threads(1)
    return torch


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A test that asks for the torch fixture is a torch test: `-m torch` selects exactly
    # these, with no marker to forget.
    for item in items:
        if "torch" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.torch)


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


# Simulated nodes (issue 17): with DISTBELIEF_TEST_NODES=N (N >= 2) every MPI job run_mpi
# starts runs as if its ranks were spread over N nodes, rank r on node r % N: hydra starts
# them on N fake hosts (`-launcher fork -hosts`), so MPI itself splits them into N nodes
# and talks between them through its network module, and DISTBELIEF_SIMULATED_NODES=N
# makes distbelief's own node split say the same. The tests marked `nodes` are the ones CI
# runs in this mode as well (`DISTBELIEF_TEST_NODES=2 python -m pytest -m nodes`).
TEST_NODES = "DISTBELIEF_TEST_NODES"


def simulated_test_nodes(env: dict[str, str] | None = None) -> int:
    """N from DISTBELIEF_TEST_NODES in `env` (default: this process's; 0: one node)."""
    text = (os.environ if env is None else env).get(TEST_NODES, "").strip()
    if not text:
        return 0
    if not text.isdigit() or int(text) < 2:
        raise pytest.UsageError(f"{TEST_NODES}={text!r}: a number of nodes, 2 or more")
    return int(text)


def simulated_nodes_launch(nodes: int, env: dict[str, str]) -> tuple[tuple[str, ...],
                                                                        dict[str, str]]:
    """(hydra's options, the environment) that run a job on `nodes` simulated nodes. A
    test that asks for the shared-memory transport gets the one several nodes use."""
    env = {**env, "DISTBELIEF_SIMULATED_NODES": str(nodes)}
    env.pop(TEST_NODES, None)
    if env.get("DISTBELIEF_PS_TRANSPORT") == "shared":
        env["DISTBELIEF_PS_TRANSPORT"] = "auto"
    hosts = ",".join(f"simnode{i}" for i in range(nodes))
    return ("-launcher", "fork", "-hosts", hosts), env


def run_mpi(n: int, args: list[str], timeout: float = 120, cwd: Path | None = None,
            env: dict[str, str] | None = None,
            launcher_options: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`mpiexec [LAUNCHER_OPTIONS] -n N python ARGS` in a subprocess, under a timeout.

    ARGS starts with what python runs: `["-m", "distbelief", "train", cfg]` or a script
    path. On timeout the whole process group is killed and the test fails. With
    DISTBELIEF_TEST_NODES=N in ENV (by default the test process's environment) the job runs
    on N simulated nodes (simulated_nodes_launch).
    """
    env = env or _env()
    nodes = simulated_test_nodes(env)
    if nodes:
        extra, env = simulated_nodes_launch(nodes, env)
        launcher_options = (*extra, *launcher_options)
    cmd = ["mpiexec", *launcher_options, "-n", str(n), sys.executable, *map(str, args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=cwd, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"MPI job timed out after {timeout}s (deadlock?): {cmd}\n"
                    f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def start_in_background(cmd: list[str], log: Path) -> subprocess.Popen:
    """CMD in a session of its own (a signal to it reaches the whole job, as a terminal's
    Ctrl-C does), its output in LOG. End it with wait_or_kill."""
    with open(log, "w") as f:
        return subprocess.Popen(list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT,
                                env=_env(), start_new_session=True)


def wait_for_training(proc: subprocess.Popen, out: Path, log: Path) -> None:
    """Until the run in OUT has logged a training line; fails if it ends first or takes
    over 60 s."""
    deadline = time.monotonic() + 60
    path = out / "metrics.jsonl"
    while not (path.exists() and '"train"' in path.read_text()):
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "no training line"
        time.sleep(0.05)


def wait_or_kill(proc: subprocess.Popen, timeout: float = 60) -> int:
    """PROC's exit status; if it has not ended within TIMEOUT s, its process group is
    killed and the test fails."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        pytest.fail(f"{proc.args} did not end within {timeout} s")


@pytest.fixture
def fashion_mnist_dir() -> Path:
    """The Debian dataset-fashion-mnist IDX folder; CI installs it, so its absence fails."""
    if not FASHION_MNIST_DIR.is_dir():
        pytest.fail(f"{FASHION_MNIST_DIR} missing: apt-get install dataset-fashion-mnist")
    return FASHION_MNIST_DIR
