"""The sbatch scripts of slurm/, run without a cluster.

bash runs a script as sbatch would: the SLURM variables of a job set, its output appended
to one log (--open-mode=append), and tests/slurm_shims/ first on PATH, where `srun` runs
the ranks with the local mpiexec and `scontrol requeue` is only written down. A SIGUSR1
to the script, as `--signal=B:USR1@...` sends it, must make the run checkpoint and exit 0
and the script ask for a requeue; running the script again as the requeued job
(SLURM_RESTART_COUNT=1) must resume from that checkpoint and stop at exactly max_steps,
for the single-process trainer, Downpour and Sandblaster alike.
Also: a failed run is never requeued and keeps its exit status, the requeue cap, SIGTERM,
the scripts' one copy of that code (slurm/common.sh, found from sbatch's spool copy of a
script), and every script passing `bash -n` and shellcheck (a `system` test: the package
shellcheck).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.slurm import COMMON, JOB_ID, SCRIPTS, SHIMS, TIMEOUT, Job, kill_session

from distbelief.runtime.launching.faults import ENV as FAULTS

FIND_BEGIN = "# ---- Find slurm/common.sh"
FIND_END = "# ---- End of finding slurm/common.sh"

# About 3 s of training each on a quiet machine (sgd; Downpour at 3 to 5 ranks): USR1, sent
# once the first steps are logged (0.5 s in), comes well before the end. Downpour's toy
# steps take ~0.1 ms on shared memory, so its replicas are slowed to 2 ms per step (a
# test-only fault, distbelief.runtime.launching.faults): 3000 steps then take 2-3 s
# however fast the machine.
SGD_STEPS = 30000
DOWNPOUR_STEPS = 3000
DOWNPOUR_STEP_DELAY = {FAULTS: "delay:*:0:0.002s"}
SANDBLASTER_STEPS = 150  # about 25 iterations/s at 4 ranks


@pytest.fixture(scope="module")
def data_dir(synthetic_folder, small_config) -> Path:
    return synthetic_folder("slurm", {"synth.toml": small_config(
        128, optimizer={"algorithm": "sgd"},
        run={"max_steps": None, "eval_every_seconds": 0.5, "eval_samples": 200})},
        input_shape=(32,))


def test_scripts_are_there():
    assert {"one_node", "multi_node"} <= set(SCRIPTS)


# -- running a script as a SLURM job ------------------------------------------------------


def check_preempted_then_resumed(job: Job, max_steps: int) -> int:
    """USR1 mid-run: checkpoint, exit 0, requeue asked for; the requeued run resumes from
    that checkpoint and ends at exactly max_steps, and asks for nothing more. Returns the
    step the first run stopped at."""
    status = job.run_and_signal(signal.SIGUSR1)
    assert status == 0, job.text()[-4000:]
    assert job.shim_calls("scontrol") == [f"scontrol requeue {JOB_ID}"]
    stopped_at = job.latest_checkpoint_step()
    assert 0 < stopped_at < max_steps, "the run was meant to be stopped mid-way"
    first = job.text()
    assert "SIGUSR1 received" in first and "requeuing job 4242" in first

    status = job.run(restarts=1)
    second = job.text()[len(first):]
    assert status == 0, second[-4000:]
    assert "resuming from" in second and f"ckpt-{stopped_at:010d}" in second
    assert "distbelief-slurm: the run finished" in second
    assert job.shim_calls("scontrol") == [f"scontrol requeue {JOB_ID}"]  # no second one
    summary = job.summary()
    assert summary["steps"] == max_steps
    assert summary["stop_reason"] == "max_steps"
    assert job.latest_checkpoint_step() == max_steps
    # One log for both runs, as --open-mode=append keeps it.
    assert "restart 0" in first and "restart 1" in second
    return stopped_at


@pytest.mark.parametrize("script", ["one_node", "multi_node"])
@pytest.mark.matrix
def test_sgd_checkpoints_on_usr1_requeues_and_resumes(data_dir, tmp_path, script):
    job = Job(script, tmp_path, 1, data_dir / "synth.toml", f"run.max_steps={SGD_STEPS}")
    stopped_at = check_preempted_then_resumed(job, SGD_STEPS)
    assert job.summary()["resumed_from"].endswith(f"ckpt-{stopped_at:010d}")
    if script == "multi_node":
        assert all(re.search(r"--mpi=(pmix|pmi2)\b", call) for call in job.shim_calls("srun"))
        assert len(job.shim_calls("srun")) == 2


@pytest.mark.both_mpis
@pytest.mark.parametrize("script, ntasks, shards", [("one_node", 3, 1), ("multi_node", 5, 2)])
@pytest.mark.matrix
def test_downpour_checkpoints_on_usr1_requeues_and_resumes(data_dir, tmp_path, script,
                                                           ntasks, shards):
    job = Job(script, tmp_path, ntasks, data_dir / "synth.toml",
              'optimizer.algorithm="downpour"', f"cluster.ps_shards={shards}",
              f"run.max_steps={DOWNPOUR_STEPS}", env=DOWNPOUR_STEP_DELAY)
    check_preempted_then_resumed(job, DOWNPOUR_STEPS)


@pytest.mark.both_mpis
@pytest.mark.parametrize("script", ["one_node", "multi_node"])
@pytest.mark.matrix
def test_a_run_that_lost_a_replica_is_still_requeued_and_resumed(data_dir, tmp_path, script):
    """1 shard + 3 replicas + 1 spare (cluster.spare_replicas = 1: --ntasks counts it);
    replica 2 (rank 3) is killed at its step 100, the others go on (one_node: hydra's
    -disable-auto-cleanup; multi_node: srun --kill-on-bad-exit=0, which the shim turns into
    the same) and the spare (rank 4) takes its part over. USR1 then stops the run with a
    checkpoint: the launcher ends with the dead rank's status 137, yet the script requeues,
    from what the run wrote in DISTBELIEF_OUTCOME_FILE, and the requeued job resumes to the
    end, with its own spare again."""
    steps = 2 * DOWNPOUR_STEPS  # about 6 s
    job = Job(script, tmp_path, 5, data_dir / "synth.toml", 'optimizer.algorithm="downpour"',
              f"run.max_steps={steps}", "cluster.spare_replicas=1",
              env={FAULTS: f"kill:3:100 {DOWNPOUR_STEP_DELAY[FAULTS]}"})
    proc = job.start()
    deadline = time.monotonic() + 60
    while "spare replica 0 (rank 4) takes over replica 2's part" not in job.text():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_session(proc)
            pytest.fail(f"no takeover reported\n{job.text()[-4000:]}")
        time.sleep(0.05)
    assert "replica 2 (rank 3) lost" in job.text()
    # Later than hydra's own SIGUSR1s about the death, which the run ignores (a SIGUSR1
    # within about a second of a death found is taken for one of them).
    time.sleep(2)
    os.kill(proc.pid, signal.SIGUSR1)
    assert job.wait(proc) == 0, job.text()[-4000:]
    first = job.text()
    assert "a rank was lost (launcher status 137), but the run ended cleanly" in first
    assert '"stop_reason": "SIGUSR1"' in first and '"lost_replicas": 1' in first
    summary = job.summary()
    assert [(t["spare"], t["replaced"]) for t in summary["spares"]] == [(0, 2)], summary
    assert summary["spares"][0]["pushes"] > 0 and summary["training_replicas_at_end"] == 3
    assert job.shim_calls("scontrol") == [f"scontrol requeue {JOB_ID}"]
    stopped_at = job.latest_checkpoint_step()
    assert 0 < stopped_at < steps
    assert not list(tmp_path.glob(".distbelief-outcome-*")), "the outcome file is removed"

    job.extra_env = dict(DOWNPOUR_STEP_DELAY)  # the requeued job: nothing fails any more
    assert job.run(restarts=1) == 0, job.text()[len(first):][-4000:]
    second = job.text()[len(first):]
    assert "resuming from" in second and "distbelief-slurm: the run finished" in second
    # The checkpoint held replica 2's part as the spare trained it: nothing is lost.
    assert job.summary()["steps"] == steps and job.summary()["lost_replicas"] == []


@pytest.mark.both_mpis
def test_sandblaster_checkpoints_on_usr1_requeues_and_resumes(data_dir, tmp_path):
    """Sandblaster needs no script of its own: the algorithm comes from the config.
    4 ranks: 1 shard, the coordinator, 2 replicas; a step is one L-BFGS iteration."""
    job = Job("multi_node", tmp_path, 4, data_dir / "synth.toml",
              'optimizer.algorithm="sandblaster"',
              "optimizer.m=5", "optimizer.work_unit_size=100", "data.batch_size=500",
              f"run.max_steps={SANDBLASTER_STEPS}")
    check_preempted_then_resumed(job, SANDBLASTER_STEPS)


# -- runs that must not come back ---------------------------------------------------------


@pytest.mark.parametrize("script, ntasks, overrides", [
    ("one_node", 1, ['data.path="missing.h5"']),
    ("multi_node", 2, ['optimizer.algorithm="downpour"', "cluster.ps_shards=2"]),
])
def test_failed_run_keeps_its_exit_status_and_is_not_requeued(data_dir, tmp_path, script,
                                                              ntasks, overrides):
    job = Job(script, tmp_path, ntasks, data_dir / "synth.toml", "run.max_steps=100",
              *overrides)
    status = job.run()
    assert status == 2, job.text()  # distbelief's status for bad input
    assert "distbelief: error:" in job.text()
    assert "the run failed (exit status 2); not requeuing" in job.text()
    assert job.shim_calls("scontrol") == []


@pytest.mark.parametrize("case, script", [
    ("requeue cap reached", "one_node"), ("scontrol fails", "one_node"),
    ("SIGTERM", "one_node"), ("SIGTERM", "multi_node"),  # srun kills its tasks on SIGTERM
])
@pytest.mark.matrix
def test_stopped_run_that_is_not_requeued_says_so_in_its_status(data_dir, tmp_path, case,
                                                                 script):
    job = Job(script, tmp_path, 1, data_dir / "synth.toml", f"run.max_steps={SGD_STEPS}")
    if case == "requeue cap reached":
        status = job.run_and_signal(signal.SIGUSR1, restarts=50)
        expected, calls, message = 1, [], "requeued 50 times already"
    elif case == "scontrol fails":
        status = job.run_and_signal(signal.SIGUSR1, SCONTROL_SHIM_STATUS="1")
        expected, calls, message = 1, [f"scontrol requeue {JOB_ID}"], "scontrol requeue failed"
    else:
        status = job.run_and_signal(signal.SIGTERM)
        expected, calls, message = 143, [], "stopped by SIGTERM after a checkpoint"
    assert status == expected, job.text()[-4000:]
    assert job.shim_calls("scontrol") == calls
    assert message in job.text()
    # Nothing lost: the run checkpointed where it stopped.
    assert 0 < job.latest_checkpoint_step() < SGD_STEPS
    assert job.summary()["steps"] == job.latest_checkpoint_step()


def test_missing_config_argument_is_a_usage_error(tmp_path):
    job = Job("one_node", tmp_path, 1, tmp_path / "unused.toml")
    assert job.run(args=[]) == 2
    assert "usage: sbatch" in job.text()
    assert job.shim_calls("scontrol") == []


# -- the scripts themselves ---------------------------------------------------------------

SHELL_FILES = [*SCRIPTS.values(), COMMON, SHIMS / "scontrol"]  # the srun shim is Python


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: p.name)
def test_script_passes_bash_n(path):
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True,
                            timeout=30, check=False)
    assert syntax.returncode == 0, syntax.stderr


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: p.name)
def test_script_passes_shellcheck(path, shellcheck):
    # -x: follow the scripts' `. "$common"` into slurm/common.sh (its source= directive).
    lint = subprocess.run([shellcheck, "-x", "--shell=bash", str(path)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def find_block(path: Path) -> str:
    text = path.read_text()
    begin, end = text.find(FIND_BEGIN), text.find(FIND_END)
    assert 0 <= begin < end, f"{path.name}: the markers of its common.sh lookup are missing"
    return text[begin:end]


def test_the_signal_code_lives_once_in_common_sh():
    """The signal, requeue and exit-status code is slurm/common.sh's alone; each script
    only finds and sources it, with the same lookup."""
    common = COMMON.read_text()
    assert "trap 'forward USR1' USR1" in common and "scontrol requeue" in common
    blocks = {name: find_block(path) for name, path in SCRIPTS.items()}
    assert len(set(blocks.values())) == 1, "the scripts' common.sh lookups differ"
    assert '. "$common"' in next(iter(blocks.values()))
    for name, path in SCRIPTS.items():
        text = path.read_text()
        assert "trap " not in text and "finish() {" not in text, name
        calls = re.findall(r"^finish ", text, flags=re.MULTILINE)
        assert len(calls) == 1, f"{name}.sbatch must call finish PID once"


@pytest.mark.parametrize("name", SCRIPTS)
def test_common_sh_is_found_from_sbatchs_spool_copy(tmp_path, name):
    """sbatch runs a copy of the script (slurmd's spool/job<id>/slurm_script), away from
    common.sh: it is found through SLURM_SUBMIT_DIR (submitted from the repository) or
    DISTBELIEF_SLURM_DIR, and otherwise the job ends at once saying how to fix it. Run
    without arguments, a script that found common.sh stops at its usage line."""
    spool = tmp_path / "spool" / "job4242"
    spool.mkdir(parents=True)
    copy = spool / "slurm_script"
    copy.write_text(SCRIPTS[name].read_text())
    elsewhere = tmp_path / "submitted_here"
    elsewhere.mkdir()

    def run(**env: str) -> subprocess.CompletedProcess:
        environ = {k: v for k, v in os.environ.items()
                   if not k.startswith("SLURM_") and k != "DISTBELIEF_SLURM_DIR"}
        return subprocess.run(["bash", str(copy)], env={**environ, "SLURM_JOB_ID": JOB_ID,
                                                        **env},
                              cwd=elsewhere, capture_output=True, text=True, timeout=30,
                              check=False)

    repo = SCRIPTS[name].parent.parent
    for found in (run(SLURM_SUBMIT_DIR=str(repo)),
                  run(SLURM_SUBMIT_DIR=str(elsewhere), DISTBELIEF_SLURM_DIR=str(COMMON.parent))):
        assert found.returncode == 2 and "usage: sbatch" in found.stderr, found.stderr
    for lost in (run(SLURM_SUBMIT_DIR=str(elsewhere)),
                 run(SLURM_SUBMIT_DIR=str(repo), DISTBELIEF_SLURM_DIR=str(elsewhere))):
        assert lost.returncode == 2, lost.stderr
        assert "common.sh not found" in lost.stderr and "DISTBELIEF_SLURM_DIR" in lost.stderr
        assert "usage: sbatch" not in lost.stderr
        assert lost.stderr.count("\n") == 1, lost.stderr  # one line, nothing else


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_asks_slurm_for_signal_requeue_and_appending_log(name):
    text = SCRIPTS[name].read_text()
    directives = re.findall(r"^#SBATCH (\S+)", text, flags=re.MULTILINE)
    assert "--requeue" in directives
    assert "--open-mode=append" in directives
    margins = [re.fullmatch(r"--signal=B:USR1@(\d+)", d) for d in directives]
    margins = [int(m.group(1)) for m in margins if m]
    assert len(margins) == 1 and margins[0] >= 60, directives
    assert "export HDF5_USE_FILE_LOCKING=FALSE" in text
    assert "# module load" in text
    # --mem, with the command that prints the memory plan's figure beside it.
    assert len([d for d in directives if re.fullmatch(r"--mem=\d+[KMGT]", d)]) == 1, directives
    assert "#   distbelief costmodel CONFIG --layouts S:R:P" in text
    # #SBATCH lines after the first command are ignored by sbatch.
    first_command = re.search(r"^[^#\n]", text, flags=re.MULTILINE).start()
    assert text.rfind("#SBATCH") < first_command


@pytest.mark.parametrize("name", ["multi_node", "compare"])
def test_scripts_over_several_nodes_have_an_infiniband_section(name):
    text = SCRIPTS[name].read_text()
    section = text[text.index("# ---- InfiniBand"):]
    section = section[:section.index("# ------")]
    for setting in ("UCX_NET_DEVICES=", "UCX_TLS=", "MPIR_CVAR_CH4_NETMOD=ucx",
                    "Open MPI 5: SRUN_MPI=pmix", "Open MPI 4.x"):
        assert setting in section, setting
    assert "Nothing here has run on InfiniBand" in section


# -- one live run per run.out_dir (distbelief.runtime.health.ownership) -------------------------------------------


@pytest.mark.parametrize("script, ntasks, overrides", [
    ("one_node", 1, []),
    ("multi_node", 3, ['optimizer.algorithm="downpour"']),
])
@pytest.mark.matrix
def test_a_job_submitted_twice_is_refused_while_the_first_runs(data_dir, tmp_path, script,
                                                               ntasks, overrides):
    # Long enough to outlive the second submission by far (SGD_STEPS took 1.3 s here, and
    # the second job once came after the first had finished); SIGUSR1 ends it.
    first = Job(script, tmp_path, 1, data_dir / "synth.toml",
                f"run.max_steps={20 * SGD_STEPS}")
    proc = first.start()
    try:
        first.wait_for_training(proc)
        (tmp_path / "second").mkdir()
        second = Job(script, tmp_path / "second", ntasks, data_dir / "synth.toml",
                     *overrides, "run.max_steps=100")
        second.out = first.out
        second.args[2] = f'run.out_dir="{first.out}"'
        env = {**second.env(0), "SLURM_JOB_ID": "4243", "SLURM_JOBID": "4243"}
        refused = subprocess.run(["bash", str(SCRIPTS[script]), *second.args], env=env,
                                 cwd=tmp_path / "second", capture_output=True, text=True,
                                 timeout=TIMEOUT, check=False)
        assert proc.poll() is None, "the first job was meant to be alive"
    finally:
        os.kill(proc.pid, signal.SIGUSR1)  # checkpoint and stop the first job
        status = first.wait(proc)
    text = refused.stdout + refused.stderr
    assert refused.returncode == 2, text
    assert re.search(rf"belongs to a live run: host \S+, process \d+, SLURM job {JOB_ID}, "
                     r"running since", text), text
    assert len(re.findall("distbelief: error:", text)) == 1, text
    assert second.shim_calls("scontrol") == []  # a refusal is not requeued
    assert status == 0, first.text()[-4000:]
    assert first.summary()["stop_reason"] == "SIGUSR1"


@pytest.mark.parametrize("script", ["one_node", "multi_node"])
@pytest.mark.matrix
def test_a_requeue_takes_over_from_its_instance_on_a_lost_node(data_dir, tmp_path, script):
    """The earlier instance's owner file names another node with a fresh heartbeat (the
    node was lost a moment ago): only the requeue rule lets the requeued job start."""
    from distbelief.runtime.health import ownership

    job = Job(script, tmp_path, 1, data_dir / "synth.toml", "run.max_steps=50")
    job.out.mkdir()
    record = {**ownership.this_process(), "host": "node-lost", "pid": 1,
              "slurm_job_id": JOB_ID, "restart_count": 0}
    (job.out / ownership.OWNER_FILE).write_text(json.dumps(record))
    assert job.run(restarts=0) == 2  # the same instance cannot take over from itself
    assert "belongs to a live run: host node-lost" in job.text()
    assert job.run(restarts=1) == 0, job.text()[-4000:]
    assert f"SLURM job {JOB_ID}'s restart 0 and this is restart 1" in job.text()
    assert job.summary()["steps"] == 50
    assert not (job.out / ownership.OWNER_FILE).exists()


def test_a_launcher_stuck_after_its_ranks_ended_is_ended_by_the_script(data_dir, tmp_path):
    # A stand-in mpiexec that says it is Open MPI's, starts a "rank" that ends at once and
    # never collects it, then hangs (as prterun 5.0.11 did after a lost shard's abort): the
    # script's watch ends it after DISTBELIEF_STUCK_LAUNCHER_SECONDS, and the job fails with
    # the launcher's status instead of waiting out its time limit.
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "mpiexec").write_text(
        f"#!{sys.executable}\n"
        "import subprocess, sys, time\n"
        "if '--version' in sys.argv:\n"
        "    print('mpiexec (Open MPI) 5.0.11')\n"
        "    sys.exit(0)\n"
        "rank = subprocess.Popen([sys.executable, '-c', 'pass'])\n"
        "time.sleep(600)\n")
    (shims / "mpiexec").chmod(0o755)
    job = Job("one_node", tmp_path, 2, data_dir / "synth.toml")
    env = job.env(0, DISTBELIEF_STUCK_LAUNCHER_SECONDS="2")
    env["PATH"] = os.pathsep.join([str(shims), env["PATH"]])
    t0 = time.monotonic()
    done = subprocess.run(["bash", str(SCRIPTS["one_node"]), *job.args], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT,
                          check=False)
    text = done.stdout + done.stderr
    assert time.monotonic() - t0 < 60, text
    assert "has not collected its ranks for 2 s after they all ended" in text, text
    assert done.returncode == 137, text
    assert "the run failed (exit status 137); not requeuing" in text, text
