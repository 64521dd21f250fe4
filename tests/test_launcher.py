"""What the MPI launcher tells a process (distbelief.runtime.launching.launcher), for MPICH's Hydra,
Open MPI's mpirun and srun, and the osc/ucx default the command line sets before MPI_Init
under Open MPI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from helpers import exit_statuses
from helpers.configs import small_config_text
from helpers.mpi_jobs import (
    PMIX_LISTENER_FAILED,
    REPO,
    job_env,
    launcher_failed_to_start,
    mpiexec,
    run_mpi,
    simulated_nodes_launch,
    survive_a_death,
)

from distbelief.data.converters import make_synthetic
from distbelief.runtime.launching import guardian, stuck_launcher
from distbelief.runtime.launching.faults import ENV as FAULTS
from distbelief.runtime.launching.launcher import (
    launcher_rank,
    launcher_size,
    quiet_osc_ucx,
    sends_death_notices,
)

PROGRAMS = REPO / "tests" / "mpi_programs"
TOML = small_config_text(None, 3, run={"max_steps": 600, "eval_every_seconds": 1,
                                         "progress_every_seconds": None})


@pytest.mark.parametrize("environ, rank, size", [
    ({}, None, 1),                                                   # no launcher
    ({"PMI_RANK": "2", "PMI_SIZE": "5"}, "2", 5),                    # Hydra, srun --mpi=pmi2
    ({"OMPI_COMM_WORLD_RANK": "3", "PMIX_RANK": "3",
      "OMPI_COMM_WORLD_SIZE": "4"}, "3", 4),                         # Open MPI's mpirun
    ({"PMIX_RANK": "1", "SLURM_STEP_NUM_TASKS": "6"}, "1", 6),       # srun --mpi=pmix
    ({"SLURM_STEP_NUM_TASKS": "6"}, None, 1),                        # srun without MPI
    ({"PMI_RANK": "", "OMPI_COMM_WORLD_RANK": "0", "PMI_SIZE": "x"}, "0", 1),
], ids=["none", "hydra", "openmpi", "srun-pmix", "srun-no-mpi", "junk"])
def test_rank_and_size_from_each_launcher(environ: dict, rank: str | None, size: int) -> None:
    assert launcher_rank(environ) == rank
    assert launcher_size(environ) == size


def test_only_hydra_is_expected_to_send_notices_of_a_death() -> None:
    # Hydra's proxies set HYDI_CONTROL_FD in every rank (seen with MPICH 5.0.2); srun and
    # Open MPI's mpirun set nothing of the kind, and send no SIGUSR1 when a rank dies.
    assert sends_death_notices({"HYDI_CONTROL_FD": "7", "PMI_RANK": "0"})
    assert not sends_death_notices({"PMI_RANK": "0", "SLURM_PROCID": "0"})
    assert not sends_death_notices({"OMPI_COMM_WORLD_RANK": "0", "PMIX_RANK": "0"})


def test_osc_ucx_is_excluded_only_without_infiniband_and_without_a_user_choice(
        tmp_path: Path) -> None:
    none = tmp_path / "none"  # no /sys/class/infiniband at all
    environ: dict[str, str] = {}
    assert quiet_osc_ucx(environ, none) and environ == {"OMPI_MCA_osc": "^ucx"}

    empty = tmp_path / "empty"
    empty.mkdir()
    environ = {}
    assert quiet_osc_ucx(environ, empty) and environ == {"OMPI_MCA_osc": "^ucx"}

    for chosen in ("ucx", "sm,rdma", ""):  # the user's choice wins, even an empty one
        environ = {"OMPI_MCA_osc": chosen}
        assert not quiet_osc_ucx(environ, none) and environ == {"OMPI_MCA_osc": chosen}

    infiniband = tmp_path / "infiniband"
    (infiniband / "mlx5_0").mkdir(parents=True)
    environ = {}
    assert not quiet_osc_ucx(environ, infiniband) and environ == {}


@pytest.mark.both_mpis
def test_a_killed_worker_is_named_by_rank_and_no_osc_ucx_error_is_printed(tmp_path: Path) -> None:
    # 1 shard + 2 replicas on the RMA transport (windows from Win.Allocate, the ones osc/ucx
    # is asked about); replica 1 (rank 2) is killed at its step 50 and the others finish.
    make_synthetic(tmp_path / "synth.h5", n_train=2000, n_test=200, input_shape=(16,),
                   num_classes=3, seed=1)
    (tmp_path / "run.toml").write_text(TOML)
    env = {**job_env(), FAULTS: "kill:2:50 delay:*:0:0.0005s", "DISTBELIEF_PS_TRANSPORT": "rma"}
    args = ["train", tmp_path / "run.toml", "--set", f'run.out_dir="{tmp_path / "out"}"']
    proc = run_mpi(3, [PROGRAMS / "cli_exit_status.py", *args], env=env,
                   launcher_options=survive_a_death())
    assert exit_statuses(proc) == [0, 0, 137], proc.stdout + proc.stderr[-3000:]
    assert "distbelief: the worker of rank 2 was killed by SIGKILL" in proc.stderr
    assert "osc_ucx_component" not in proc.stderr, proc.stderr[-3000:]


def test_a_rank_that_never_reaches_mpi_init_ends_the_others_within_the_bound(
        tmp_path: Path) -> None:
    # Under -disable-auto-cleanup hydra only notifies the others when rank 2's worker exits
    # before MPI_Init, and they would wait in MPI_Init for ever; their guardians end them
    # at the bound (DISTBELIEF_INIT_TIMEOUT) with one line each.
    make_synthetic(tmp_path / "synth.h5", n_train=2000, n_test=200, input_shape=(16,),
                   num_classes=3, seed=1)
    (tmp_path / "run.toml").write_text(TOML)
    env = {**job_env(), FAULTS: "noinit:2:0", "DISTBELIEF_INIT_TIMEOUT": "10"}
    args = ["train", tmp_path / "run.toml", "--set", f'run.out_dir="{tmp_path / "out"}"']
    t0 = time.monotonic()
    proc = run_mpi(3, [PROGRAMS / "cli_exit_status.py", *args], env=env, timeout=90,
                   launcher_options=survive_a_death())
    elapsed = time.monotonic() - t0
    assert exit_statuses(proc) == [1, 1, 1], proc.stdout + proc.stderr[-3000:]
    assert "test-only exit of rank 2 before MPI_Init" in proc.stderr
    for rank in (0, 1):
        assert (f"distbelief: rank {rank}: MPI_Init did not return within 10 s"
                in proc.stderr), proc.stderr[-3000:]
    assert elapsed < 80, f"the job took {elapsed:.0f} s to end"


def test_a_bad_init_bound_is_one_error_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(TOML)
    env = {**job_env(), "DISTBELIEF_INIT_TIMEOUT": "soon"}
    proc = run_mpi(2, [PROGRAMS / "cli_exit_status.py", "train", tmp_path / "run.toml"],
                   env=env, timeout=60)
    assert exit_statuses(proc) == [2, 2], proc.stdout + proc.stderr[-3000:]
    assert "DISTBELIEF_INIT_TIMEOUT must be a positive number of seconds, got 'soon'" \
        in proc.stderr


def _processes_naming(text: str) -> list[int]:
    """Process ids whose command line contains `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _start_training(cmd: list[str], env: dict[str, str], out: Path) -> subprocess.Popen:
    """The job, once it has written metrics.jsonl (or ended, or 90 s passed); launched
    again once if the launcher failed to start (conftest.PMIX_LISTENER_FAILED)."""
    for attempt in (1, 2):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        deadline = time.monotonic() + 90
        while (time.monotonic() < deadline and proc.poll() is None
               and not (out / "metrics.jsonl").is_file()):
            time.sleep(0.1)
        if proc.poll() is None:
            return proc
        proc.stdout_text, proc.stderr_text = proc.communicate()
        if attempt == 2 or not launcher_failed_to_start(proc.returncode, proc.stderr_text):
            return proc
        warnings.warn(f"the launcher failed to start ({PMIX_LISTENER_FAILED}); launched again")
    raise AssertionError("unreachable: the second launch always returns")


@pytest.mark.both_mpis
def test_the_ranks_end_when_the_launcher_is_killed(tmp_path: Path) -> None:
    # mpiexec and its helpers (hydra's proxy; under Open MPI, prterun is both) die of
    # SIGKILL while the job trains: nobody will ever signal the ranks. Each guardian sees
    # its parent gone and ends its worker, so nothing is left (seen under Open MPI before:
    # a hung worker and its guardian lived on for an hour).
    make_synthetic(tmp_path / "synth.h5", n_train=2000, n_test=200, input_shape=(16,),
                   num_classes=3, seed=1)
    (tmp_path / "run.toml").write_text(TOML)
    out = tmp_path / "out-launcher-killed"
    cmd = [*mpiexec(3), sys.executable, "-m", "distbelief", "train",
           str(tmp_path / "run.toml"), "--set", f'run.out_dir="{out}"', "--set",
           "run.max_steps=0", "--set", "run.max_seconds=120"]
    env = {**job_env(), FAULTS: "delay:*:0:0.002s"}
    proc = _start_training(cmd, env, out)
    try:
        if not (out / "metrics.jsonl").is_file():
            state = "ended" if proc.poll() is not None else "still ran"
            os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
            stdout, stderr = proc.communicate()
            stdout = getattr(proc, "stdout_text", stdout)
            stderr = getattr(proc, "stderr_text", stderr)
            pytest.fail(f"the run never wrote its metrics (the job {state}, exit "
                        f"{proc.returncode}):\n{stdout[-2000:]}\n{stderr[-4000:]}")
        ranks = _processes_naming(str(out))
        assert len(ranks) >= 6, ranks  # a guardian and a worker per rank
        helpers = [c for c in stuck_launcher.children(proc.pid) if c not in ranks]
        launcher = [proc.pid, *helpers]
        for pid in launcher:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _processes_naming(str(out)):
            time.sleep(0.2)
        left = _processes_naming(str(out))
        assert not left, f"still alive 15 s after the launcher was killed: {left}"
    finally:
        for pid in _processes_naming(str(out)):
            os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
        proc.communicate()


@pytest.mark.parametrize("environ, bound", [
    ({"PMI_SIZE": "4"}, 120.4),
    ({"PMI_SIZE": "1000"}, 220.0),  # a thousand ranks starting from a parallel file system
    ({"OMPI_COMM_WORLD_SIZE": "64", "DISTBELIEF_INIT_TIMEOUT": "30"}, 30.0),
])
def test_the_mpi_init_bound_grows_with_the_job(monkeypatch, environ, bound):
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "DISTBELIEF_INIT_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert guardian.init_timeout() == pytest.approx(bound)


@pytest.mark.both_mpis
def test_a_timed_out_job_is_ended_whole_and_its_ranks_stacks_are_shown(tmp_path: Path) -> None:
    # Hydra's proxies and ranks each call setsid, so a timeout that killed mpiexec's process
    # group left the ranks alive (CI at stop 47: a hung job's ranks spun on, and the next
    # four tests crawled). run_mpi follows the job's process tree and ends all of it, and
    # each rank prints its Python stack first, which names where it hung.
    program = tmp_path / "hang.py"
    program.write_text("from mpi4py import MPI\nimport time\n\n"
                       "def hang_here():\n    time.sleep(600)\n\n"
                       "MPI.COMM_WORLD.Barrier()\nprint('in', flush=True)\nhang_here()\n")
    launch, env = simulated_nodes_launch(2, job_env())
    shm_before = set(os.listdir(guardian.SHM_DIR))
    try:
        with pytest.raises(pytest.fail.Exception) as failed:
            run_mpi(3, [program], timeout=10, env=env, launcher_options=launch)
        message = str(failed.value)
        assert "timed out after 10s" in message
        assert message.count("in hang_here") == 3, message[-4000:]  # each rank's stack
        deadline = time.monotonic() + 10
        while _processes_naming(str(program)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _processes_naming(str(program))
    finally:
        # A raw MPI program has no guardian, so no node cleaner removes the shared-memory
        # segments of the ranks killed here (CI's /dev/shm check named them): this test
        # does, whether or not it passed.
        mapped = guardian.mapped_by_anyone()
        for name in set(os.listdir(guardian.SHM_DIR)) - shm_before:
            if f"{guardian.SHM_DIR}/{name}" not in mapped:
                Path(guardian.SHM_DIR, name).unlink(missing_ok=True)


def test_the_tests_know_a_guardians_cleaner_by_its_command_line() -> None:
    # run_mpi kills what outlives the launcher, but for the cleaners, which must outlive it
    # to remove the job's /dev/shm files: helpers.processes.CLEANER names them.
    import inspect

    from helpers.processes import CLEANER

    from distbelief.runtime.launching import guardian
    assert CLEANER in inspect.getsource(guardian.start_cleaner)
    assert CLEANER in inspect.getsource(guardian)  # the abort cleaner's too
    assert inspect.getsource(guardian).count(CLEANER) == 2
