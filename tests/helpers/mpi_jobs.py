"""Launching what the tests run, always under a timeout, so a deadlock fails the test
instead of freezing CI: the command line (run_cli), MPI jobs (run_mpi) on one node or on
simulated nodes, runs in the background, and the environment they get (mpi_env)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Self

import pytest

from distbelief.runtime.launching import stuck_launcher

REPO = Path(__file__).resolve().parents[2]


# -- which MPI launches the MPI tests -------------------------------------------------------
# DISTBELIEF_TEST_MPI=mpich|openmpi names the MPI whose `mpiexec` is first on PATH (CI sets
# it, so a venv holding the wrong MPI fails instead of testing the other one twice); unset,
# `mpiexec --version` decides. Each MPI's launcher gets its own flags below.
TEST_MPI = "DISTBELIEF_TEST_MPI"
MPIS = ("mpich", "openmpi")
LAUNCHER_FLAGS = {
    "mpich": (),
    # More ranks than the two cores; Open MPI refuses both without being told.
    "openmpi": ("--oversubscribe",),
}
# A rank that dies does not end the job: the other ranks finish the run without it.
SURVIVE_A_DEATH = {
    "mpich": ("-disable-auto-cleanup",),  # Hydra
    "openmpi": ("--enable-recovery",),    # PRRTE (Open MPI 5's mpirun)
}
# Open MPI refuses to run as root (containers, CI) unless both are set.
OPENMPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


@functools.cache
def detected_mpi() -> str:
    """"mpich" or "openmpi", from `mpiexec --version` (the mpiexec the tests will run)."""
    try:
        text = subprocess.run(["mpiexec", "--version"], capture_output=True, text=True,
                              timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.fail(f"cannot run `mpiexec --version`: {exc}", pytrace=False)
    if "Open MPI" in text or "OpenRTE" in text:
        return "openmpi"
    if "HYDRA" in text:
        return "mpich"
    pytest.fail(f"`mpiexec --version` names neither MPICH's Hydra nor Open MPI: {text[:200]}",
                pytrace=False)


@functools.cache
def mpi_under_test() -> str:
    """The MPI the MPI tests launch: DISTBELIEF_TEST_MPI if set (and it must be the one on
    PATH), else the detected one."""
    found = detected_mpi()
    chosen = os.environ.get(TEST_MPI, "").strip() or found
    if chosen not in MPIS:
        pytest.fail(f"{TEST_MPI}={chosen!r}: choose one of {', '.join(MPIS)}", pytrace=False)
    if chosen != found:
        pytest.fail(f"{TEST_MPI}={chosen} but the mpiexec on PATH is {found}'s",
                    pytrace=False)
    return chosen


def mpiexec(n: int, *options: str) -> list[str]:
    """`mpiexec [this MPI's flags] [OPTIONS] -n N`: the start of an MPI test's command."""
    return ["mpiexec", *LAUNCHER_FLAGS[mpi_under_test()], *options, "-n", str(n)]


def survive_a_death() -> tuple[str, ...]:
    """The launcher options that let the other ranks live on when one dies."""
    return SURVIVE_A_DEATH[mpi_under_test()]


def every_rank_exited(statuses: list[int], n: int, code: int) -> bool:
    """Whether the per-rank exit statuses of an `n`-rank job show every rank ending with
    `code` together. Open MPI's launcher ends the job at the first non-zero exit: a rank
    still on its way out then gets SIGTERM (143) instead, or is gone before it prints its
    status at all (seen once in CI: only rank 0's line, and PMIX_ERR_UNREACH), which
    counts as long as one rank did exit with `code`. Under MPICH every rank's own status
    is `code`."""
    if mpi_under_test() == "openmpi":
        return (0 < len(statuses) <= n and code in statuses
                and all(s in (code, 143) for s in statuses))
    return statuses == [code] * n


STACK_DUMP = str(Path(__file__).parent / "stack_dump")


def job_env(threads: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    # One BLAS thread per process: MPI tests oversubscribe the two cores.
    env["OPENBLAS_NUM_THREADS"] = str(threads)
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a crashed worker prints its stack
    # ... and SIGUSR2 prints a timed-out job's workers' stacks (helpers/stack_dump).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (STACK_DUMP, env.get("PYTHONPATH"))))
    env.update(OPENMPI_ENV)  # only Open MPI reads them
    return env


def run_cli(args: list[str], timeout: float = 120, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m distbelief ARGS` in a subprocess; output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "distbelief", *map(str, args)],
        capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env or job_env(), check=False,
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
    if mpi_under_test() == "openmpi":
        # PRRTE has no fake hosts: distbelief's own split still makes the ranks several
        # nodes (transport, liveness), while Open MPI's traffic stays in shared memory.
        return (), env
    hosts = ",".join(f"simnode{i}" for i in range(nodes))
    return ("-launcher", "fork", "-hosts", hosts), env


def job_tree(launcher: int) -> Any:
    """helpers.processes.JobTree(launcher), imported here: helpers imports this module."""
    from helpers.processes import JobTree
    return JobTree(launcher)


def run_mpi(n: int, args: list[str], timeout: float = 120, cwd: Path | None = None,
            env: dict[str, str] | None = None,
            launcher_options: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`mpiexec [LAUNCHER_OPTIONS] -n N python ARGS` in a subprocess, under a timeout, with
    the flags of the MPI under test (DISTBELIEF_TEST_MPI).

    ARGS starts with what python runs: `["-m", "distbelief", "train", cfg]` or a script
    path. On timeout the whole process group is killed and the test fails. With
    DISTBELIEF_TEST_NODES=N in ENV (by default the test process's environment) the job runs
    on N simulated nodes (simulated_nodes_launch).
    """
    env = env or job_env()
    nodes = simulated_test_nodes(env)
    if nodes:
        extra, env = simulated_nodes_launch(nodes, env)
        launcher_options = (*extra, *launcher_options)
    cmd = [*mpiexec(n, *launcher_options), sys.executable, *map(str, args)]
    # cli_exit_status.py also leaves each rank's status in a file here: Open MPI's launcher
    # lost a surviving rank's last line of output, after a death, once in a while.
    exit_dir = tempfile.mkdtemp(prefix="distbelief-exit-")
    env = {**env, EXIT_DIR: exit_dir}
    for attempt in (1, 2):
        launched = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=cwd, env=env, start_new_session=True)
        tree = job_tree(proc.pid)
        try:
            out, err = communicate(proc, timeout, tree)
        except subprocess.TimeoutExpired:
            where = tree.describe()
            tree.dump_python_stacks()
            tree.kill()
            out, err = proc.communicate()
            ended = sorted(name for name in os.listdir(exit_dir) if name.startswith("rank-"))
            pytest.fail(f"MPI job timed out after {timeout}s (deadlock?): {cmd}\n"
                        f"statuses written: {ended or 'none'}; still running:\n{where}\n"
                        f"stdout:\n{out[-3000:]}\nstderr (the workers' stacks last):\n"
                        f"{err[-12000:]}")
        if attempt == 1 and launcher_failed_to_start(proc.returncode, err):
            warnings.warn(f"the launcher failed to start ({PMIX_LISTENER_FAILED}); "
                          f"launched again ({cmd[:3]})")
            continue
        break
    finished = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    returned = time.time()
    finished.exit_files = _exit_files(exit_dir, n, tree)
    tree.wait_gone(OUTLIVE_S)
    left = tree.describe()
    if left:
        # A rank that outlives its launcher by OUTLIVE_S would spin for ever on 2 cores.
        warnings.warn(f"processes of the job outlived its launcher; killed:\n{left}")
        tree.kill()
    # When each rank's status was written and the launcher returned, in seconds after the
    # launch: where a slow job's time went (its ranks, or the launcher after them).
    finished.timeline = {"launcher returned": returned - launched, **{
        f"rank {name.removeprefix('rank-')} ended": Path(exit_dir, name).stat().st_mtime
        - launched for name in sorted(os.listdir(exit_dir)) if name.startswith("rank-")
        and not name.endswith(".tmp")}}
    shutil.rmtree(exit_dir, ignore_errors=True)
    return finished


PMIX_LISTENER_FAILED = "The PMIx server's listener thread failed to start"
"""Open MPI 5.0.11's prterun, once in a full run of the Open MPI step beside two busy
loops, stopped with this (exit 213) before starting any rank: PMIx's own start-up, not
the job (seen in other projects' CI too). run_mpi launches such a job once more."""


def launcher_failed_to_start(status: int | None, stderr: str) -> bool:
    return status not in (0, None) and PMIX_LISTENER_FAILED in stderr


STUCK_LAUNCHER_S = 5.0


def communicate(proc: subprocess.Popen, timeout: float, tree: Any) -> tuple[str, str]:
    """proc.communicate(timeout), but a launcher that has collected none of its exited
    children for STUCK_LAUNCHER_S (seen with Open MPI 5.0.11's prterun after a lost shard's
    abort: distbelief.runtime.launching.stuck_launcher, which slurm/one_node.sbatch runs too) is
    ended as the product ends it, with a warning, and the job's outcome read as usual."""
    deadline = time.monotonic() + timeout
    stuck_since = None
    while True:
        tree.sample()  # the ranks have sessions of their own: remembered to be found later
        try:
            return proc.communicate(timeout=min(0.25, max(deadline - time.monotonic(), 0.01)))
        except subprocess.TimeoutExpired:
            now = time.monotonic()
            if now >= deadline:
                raise
            if not stuck_launcher.all_children_exited(proc.pid):
                stuck_since = None
                continue
            stuck_since = now if stuck_since is None else stuck_since
            if now - stuck_since >= STUCK_LAUNCHER_S:
                warnings.warn(f"the launcher had collected none of its exited ranks for "
                              f"{STUCK_LAUNCHER_S:g} s: ended ({proc.args[:3]})")
                tree.kill()


EXIT_FILES_WAIT_S = 15.0
OUTLIVE_S = 20.0
"""How long a job's processes may go on after its launcher returned (an abort's ranks on
their way out, unlinking MPI's /dev/shm files) before run_mpi kills them."""


def _exit_files(exit_dir: str, ranks: int, tree: Any) -> dict[int, int]:
    """{rank: status} from the files cli_exit_status.py wrote in EXIT_DIR. Once a rank of
    the job has died (a status of 128 + signal), the launcher may return before a
    survivor's guardian has written its file (the line it prints never arrives). Under Open
    MPI prterun returns as soon as the last worker has left MPI: measured, a file came
    0.5 s after prterun returned. Under MPICH on 2 simulated nodes, once in a CI run of
    1,334 tests, hydra returned with shard 0's line and file both missing, its worker's
    last line ("results in") printed. So wait, up to EXIT_FILES_WAIT_S, for all `ranks`
    files while a process of the job's `tree` lives (each rank has a session of its own,
    so the launcher's session does not find them): a job the launcher aborted (its
    guardians killed, no files to come) costs no wait, and a rank that never ends still
    fails its test."""
    deadline = time.monotonic() + EXIT_FILES_WAIT_S
    while True:
        running = bool(tree.alive())
        found = {int(name.removeprefix("rank-")): int(Path(exit_dir, name).read_text())
                 for name in os.listdir(exit_dir)
                 if name.startswith("rank-") and name.removeprefix("rank-").isdigit()}
        died = any(status >= 128 for status in found.values())
        if (len(found) >= ranks or not died or not running
                or time.monotonic() > deadline):
            return found
        time.sleep(0.05)


EXIT_DIR = "DISTBELIEF_TEST_EXIT_DIR"
"""Where tests/mpi_programs/cli_exit_status.py writes each rank's exit status (run_mpi)."""


def start_in_background(cmd: list[str], log: Path) -> subprocess.Popen:
    """CMD in a session of its own (a signal to it reaches the whole job, as a terminal's
    Ctrl-C does), its output in LOG. End it with wait_or_kill."""
    with open(log, "w") as f:
        return subprocess.Popen(list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT,
                                env=job_env(), start_new_session=True)


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
    """PROC's exit status; if it has not ended within TIMEOUT s, it and every process it
    started are killed and the test fails."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = job_tree(proc.pid)
        tree.sample()
        tree.kill()
        proc.wait()
        pytest.fail(f"{proc.args} did not end within {timeout} s")


class SharedMemoryWatch:
    """The /dev/shm files mapped by any process whose command line holds `marker` (a run's
    out_dir), sampled every 0.1 s while the `with` block runs; `left()` names those that
    still exist afterwards. A job's own files, whatever else runs on the machine: a test
    that kills ranks checks with it that the job removed what it made there
    (distbelief.runtime.launching.guardian.SharedSegments)."""

    def __init__(self, marker: str | Path):
        self.marker = str(marker).encode()
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(0.1):
            for pid in (name for name in os.listdir("/proc") if name.isdigit()):
                try:
                    if self.marker not in Path(f"/proc/{pid}/cmdline").read_bytes():
                        continue
                    maps = Path(f"/proc/{pid}/maps").read_text(errors="replace")
                except OSError:
                    continue
                self.seen |= {line.split(None, 5)[5] for line in maps.splitlines()
                              if " /dev/shm/" in line and not line.endswith("(deleted)")}

    def left(self, wait: float = 5.0) -> list[str]:
        """The files seen that still exist, once they are gone or `wait` s have passed (an
        aborted job's files are removed by a process it leaves behind, just after it)."""
        deadline = time.monotonic() + wait
        while True:
            left = sorted(path for path in self.seen if os.path.exists(path))
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)
