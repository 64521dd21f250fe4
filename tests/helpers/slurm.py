"""Running the slurm/ scripts as SLURM jobs on this machine (tests/slurm_shims stand in for
SLURM's commands): test_slurm.py and test_compare.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distbelief.records.checkpoint import checkpoint_root, find_latest
from helpers.mpi_jobs import REPO, job_env

SCRIPTS = {path.stem: path for path in sorted((REPO / "slurm").glob("*.sbatch"))}
COMMON = REPO / "slurm" / "common.sh"  # what every script sources
SHIMS = REPO / "tests" / "slurm_shims"
JOB_ID = "4242"
TIMEOUT = 120


class Job:
    """One sbatch script run again and again as the same SLURM job (each requeue a new
    run of the script) in `folder`, the submit directory: log in slurm.log, calls of the
    shims in shims.log."""

    def __init__(self, script: str, folder: Path, ntasks: int, config: Path,
                 *overrides: str, env: dict[str, str] | None = None):
        self.script, self.folder, self.ntasks = SCRIPTS[script], folder, ntasks
        self.extra_env = env or {}
        self.out = folder / "out"
        sets = [f'run.out_dir="{self.out}"', *overrides]
        self.args = [str(config), *(arg for s in sets for arg in ("--set", s))]
        self.log, self.shim_log = folder / "slurm.log", folder / "shims.log"
        self.shim_log.touch()

    def env(self, restarts: int, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in job_env().items() if not k.startswith("SLURM_")}
        python_dir = Path(sys.executable).parent
        if not (python_dir / "python3").exists():
            pytest.fail(f"the scripts run python3, but {python_dir} has none")
        env["PATH"] = os.pathsep.join([str(SHIMS), str(python_dir), env["PATH"]])
        host = socket.gethostname()
        env.update(
            SLURM_JOB_ID=JOB_ID, SLURM_JOBID=JOB_ID, SLURM_JOB_NAME="distbelief",
            SLURM_NTASKS=str(self.ntasks), SLURM_NPROCS=str(self.ntasks),
            SLURM_JOB_NUM_NODES="1", SLURM_NNODES="1", SLURM_JOB_NODELIST=host,
            SLURM_NODELIST=host, SLURM_TASKS_PER_NODE=str(self.ntasks),
            SLURM_CPUS_PER_TASK="1", SLURM_SUBMIT_DIR=str(self.folder),
            SLURM_SHIM_LOG=str(self.shim_log), **self.extra_env, **extra)
        if restarts:  # SLURM sets it only in a restarted job
            env["SLURM_RESTART_COUNT"] = str(restarts)
        return env

    def start(self, restarts: int = 0, args: list[str] | None = None,
              **extra: str) -> subprocess.Popen:
        with open(self.log, "a") as log:
            return subprocess.Popen(
                ["bash", str(self.script), *(self.args if args is None else args)],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.folder,
                env=self.env(restarts, **extra), start_new_session=True)

    def wait(self, proc: subprocess.Popen, timeout: float = TIMEOUT) -> int:
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_session(proc)
            pytest.fail(f"{self.script.name} still running after {timeout}s (hang?)\n"
                        f"{self.text()[-4000:]}")

    def run(self, restarts: int = 0, args: list[str] | None = None, **extra: str) -> int:
        """The script from start to end; its exit status."""
        return self.wait(self.start(restarts, args, **extra))

    def run_and_signal(self, signum: int, restarts: int = 0, **extra: str) -> int:
        """The script, sent `signum` once the run is training (as SLURM signals the batch
        shell); its exit status."""
        proc = self.start(restarts, **extra)
        self.wait_for_training(proc)
        os.kill(proc.pid, signum)
        return self.wait(proc)

    def wait_for_training(self, proc: subprocess.Popen, timeout: float = 60) -> None:
        """Until metrics.jsonl shows a trained step: the run's signal handlers are in
        place by then (before them, SIGUSR1 would simply kill a rank)."""
        metrics = self.out / "metrics.jsonl"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"the job ended (status {proc.returncode}) before it was "
                            f"signalled\n{self.text()[-4000:]}")
            if metrics.exists() and any(json.loads(line).get("step", 0) > 0
                                        for line in metrics.read_text().splitlines()
                                        if line.endswith("}")):
                return
            time.sleep(0.05)
        kill_session(proc)
        pytest.fail(f"no trained step after {timeout}s\n{self.text()[-4000:]}")

    def text(self) -> str:
        return self.log.read_text()

    def shim_calls(self, command: str) -> list[str]:
        return [line for line in self.shim_log.read_text().splitlines()
                if line.split()[0] == command]

    def latest_checkpoint_step(self) -> int:
        found, damaged = find_latest(checkpoint_root(self.out))
        assert found is not None and not damaged, self.text()[-3000:]
        return found.step

    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL every process of the job: the script was started in a session of its own,
    and the srun shim starts the ranks in a process group of their own within it."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The session id is the 6th field; the 2nd, (name), may hold spaces.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == proc.pid:
            try:
                os.kill(int(stat.parent.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()
