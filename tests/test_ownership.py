"""One live run per run directory (distbelief.runtime.health.ownership): the rules that decide
whether an owner is dead, each one tested on a faked owner file (another host, a dead pid, a reused
pid, a SLURM requeue, an unreadable file), and end to end: a second run, `--fresh`
included, on a live run's folder is refused at once with one line naming the owner (alone
and under mpiexec, every rank exit 2) and the first run's files are its own; a kill -9'd
owner never blocks the rerun."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import exit_statuses, set_args
from helpers.mpi_jobs import (
    REPO,
    job_env,
    run_cli,
    run_mpi,
    start_in_background,
    wait_for_training,
    wait_or_kill,
)

from distbelief.records.metrics import read_metrics
from distbelief.records.status import describe, run_status
from distbelief.runtime.health import ownership

PROGRAMS = REPO / "tests" / "mpi_programs"


# -- the rules, on faked owner files ---------------------------------------------------------------


def fake_owner(out: Path, **fields) -> dict:
    """Write an owner.json as another run would have, with `fields` changed."""
    record = ownership.this_process()
    record.update(fields)
    out.mkdir(parents=True, exist_ok=True)
    (out / ownership.OWNER_FILE).write_text(json.dumps(record))
    return record


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_claim_writes_the_owner_and_release_removes_it(tmp_path: Path) -> None:
    out = tmp_path / "run"
    owner = ownership.claim(out, timeout_s=60)
    try:
        record = ownership.read_owner(out)
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        assert record["token"] == owner.record["token"]
    finally:
        owner.release()
    assert ownership.read_owner(out) is None
    assert not out.exists()  # created by the claim and nothing written: removed again


def test_a_live_owner_refuses_a_second_claim_naming_it(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    owner = ownership.claim(tmp_path, timeout_s=60)
    try:
        before = (tmp_path / ownership.OWNER_FILE).read_bytes()
        with pytest.raises(ownership.RunDirBusy) as refused:
            ownership.claim(tmp_path, timeout_s=60)
        message = str(refused.value)
        assert f"host {socket.gethostname()}" in message
        assert f"process {os.getpid()}" in message
        assert "SLURM job 4242" in message and "running since" in message
        assert (tmp_path / ownership.OWNER_FILE).read_bytes() == before
    finally:
        owner.release()


def test_a_dead_process_on_this_host_is_taken_over_at_once(tmp_path: Path) -> None:
    fake_owner(tmp_path, pid=dead_pid())  # heartbeat fresh: only /proc says it is dead
    owner = ownership.claim(tmp_path, timeout_s=600)
    try:
        assert owner.took_over and "is gone" in owner.took_over
        assert ownership.read_owner(tmp_path)["token"] == owner.record["token"]
    finally:
        owner.release()


def test_a_reused_pid_is_not_the_owner(tmp_path: Path) -> None:
    me = ownership.this_process()
    fake_owner(tmp_path, pid=os.getppid(), start_ticks=12345)  # alive, other start time
    assert ownership.is_dead(ownership.read_owner(tmp_path), me, 600) is not None
    real = ownership.process_start_time(os.getppid())
    fake_owner(tmp_path, pid=os.getppid(), start_ticks=real)
    assert ownership.is_dead(ownership.read_owner(tmp_path), me, 600) is None


def test_another_host_is_dead_only_once_its_heartbeat_is_older_than_the_bound(
        tmp_path: Path) -> None:
    fake_owner(tmp_path, host="node-b", pid=1, heartbeat=time.time() - 30)
    with pytest.raises(ownership.RunDirBusy, match="host node-b, process 1"):
        ownership.claim(tmp_path, timeout_s=60)
    with pytest.raises(ownership.RunDirBusy):  # 0: never taken over
        ownership.claim(tmp_path, timeout_s=0)
    owner = ownership.claim(tmp_path, timeout_s=20)
    try:
        assert "heartbeat is 30s old" in owner.took_over
    finally:
        owner.release()


def test_a_slurm_requeue_takes_over_from_its_earlier_instance(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_owner(tmp_path, host="node-b", pid=1, slurm_job_id="77", restart_count=0)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    with pytest.raises(ownership.RunDirBusy, match="SLURM job 77"):  # the same instance
        ownership.claim(tmp_path, timeout_s=600)
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with pytest.raises(ownership.RunDirBusy):  # another job's restart is not a requeue
        ownership.claim(tmp_path, timeout_s=600)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    owner = ownership.claim(tmp_path, timeout_s=600)
    try:
        assert "restart 0" in owner.took_over and "restart 1" in owner.took_over
    finally:
        owner.release()


def test_an_unreadable_owner_file_is_dead_once_older_than_the_bound(tmp_path: Path) -> None:
    path = tmp_path / ownership.OWNER_FILE
    path.write_text('{"host": "node-b", "pi')  # a torn write
    with pytest.raises(ownership.RunDirBusy, match="cannot be read"):
        ownership.claim(tmp_path, timeout_s=60)
    os.utime(path, (time.time() - 100, time.time() - 100))
    ownership.claim(tmp_path, timeout_s=60).release()


def test_the_heartbeat_is_refreshed_while_the_owner_runs(tmp_path: Path) -> None:
    owner = ownership.claim(tmp_path, timeout_s=1.0)  # beats every 0.1 s
    try:
        first = ownership.read_owner(tmp_path)["heartbeat"]
        time.sleep(0.5)
        assert ownership.read_owner(tmp_path)["heartbeat"] > first
    finally:
        owner.release()


def test_an_owner_whose_file_was_taken_over_stops_without_writing(tmp_path: Path) -> None:
    code = ("import time, sys\nfrom distbelief.runtime.health import ownership\n"
            f"o = ownership.claim({str(tmp_path)!r}, timeout_s=1.0)\n"
            "print('claimed', flush=True)\ntime.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "claimed"
        fake_owner(tmp_path, host="node-b", pid=1)  # as a takeover from another node
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == ownership.LOST_EXIT_STATUS
    assert "was taken over by host node-b" in err
    assert ownership.read_owner(tmp_path)["host"] == "node-b"


# -- end to end --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_dir(synthetic_folder, small_config) -> Path:
    return synthetic_folder("ownership", {"synth.toml": small_config()})


def train_args(data_dir: Path, out: Path, *overrides: str) -> list:
    return ["train", data_dir / "synth.toml", *set_args(f'run.out_dir="{out}"', *overrides)]


def start_sgd(data_dir: Path, out: Path, log: Path, *overrides: str) -> subprocess.Popen:
    """A single-process run in the background, with its output in `log`."""
    return start_in_background(
        [sys.executable, "-m", "distbelief",
         *train_args(data_dir, out, 'optimizer.algorithm="sgd"', *overrides)], log)


def snapshot(out: Path) -> set[str]:
    return {str(p.relative_to(out)) for p in out.rglob("*")}


REFUSED = re.compile(r"^distbelief: error: run\.out_dir .* belongs to a live run: host "
                     r"\S+, process \d+, running since .*UTC")


@pytest.mark.parametrize("second", ["sgd", "sgd --fresh", "downpour x3", "downpour x4 --fresh",
                                    "sandblaster x4", "partitioned x2 --fresh"])
@pytest.mark.matrix
def test_a_second_run_on_a_live_runs_folder_is_refused_and_the_first_is_untouched(
        data_dir: Path, tmp_path: Path, second: str) -> None:
    out, log = tmp_path / "out", tmp_path / "log"
    # The first run has time to spare (60 s) and is stopped by Ctrl-C once the refusal
    # is seen: whether it was refused while alive does not hang on a race with its budget.
    first = start_sgd(data_dir, out, log, "run.max_steps=0", "run.max_seconds=60",
                      "run.checkpoint_every_seconds=1")
    try:
        wait_for_training(first, out, log)
        owner = ownership.read_owner(out)
        assert owner["pid"] == first.pid
        extra = ["--fresh"] if "--fresh" in second else []
        began = time.monotonic()
        if second.startswith("sgd"):
            proc = run_cli([*train_args(data_dir, out, 'optimizer.algorithm="sgd"'), *extra],
                           timeout=60)
            n = 1
        else:
            n = int(second.split()[1][1:])
            algorithm = {"downpour": [], "sandblaster": ['optimizer.algorithm="sandblaster"'],
                         "partitioned": ['optimizer.algorithm="sgd"', "cluster.partitions=2"]}
            proc = run_mpi(n, [PROGRAMS / "cli_exit_status.py",
                               *train_args(data_dir, out, *algorithm[second.split()[0]]),
                               *extra], timeout=60)
            assert exit_statuses(proc) == [2] * n, proc.stdout + proc.stderr
        refused_in = time.monotonic() - began
        assert proc.returncode == 2
        errors = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(errors) == 1 and REFUSED.match(errors[0]), proc.stderr
        assert f"process {first.pid}," in errors[0]
        assert refused_in < 30  # seconds, with MPI start-up on a loaded 2-core machine
        assert not [p for p in out.iterdir() if p.name.startswith("previous-")]
        assert first.poll() is None  # still running: the refusal came while it was alive
        os.killpg(first.pid, signal.SIGINT)
    finally:
        status = wait_or_kill(first)
    assert status == 130, log.read_text()
    summary = json.loads((out / "summary.json").read_text())
    lines = read_metrics(out / "metrics.jsonl")
    steps = [x["step"] for x in lines if x["kind"] == "train"]
    assert steps == sorted(steps) and summary["steps"] == steps[-1]
    assert summary["stop_reason"] == "SIGINT"
    assert not (out / ownership.OWNER_FILE).exists()  # released after the last write
    assert "belongs to a live run" not in log.read_text()


@pytest.mark.parametrize("launcher", ["alone", "mpiexec x3"])
def test_a_kill_9_owner_does_not_block_the_rerun(data_dir: Path, tmp_path: Path,
                                                 launcher: str) -> None:
    out, log = tmp_path / "out", tmp_path / "log"
    first = start_sgd(data_dir, out, log, "run.max_steps=0", "run.max_seconds=60",
                      "run.checkpoint_every_seconds=0.5")
    try:
        wait_for_training(first, out, log)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    finally:
        wait_or_kill(first)
    assert ownership.read_owner(out)["pid"] == first.pid  # left behind
    if launcher == "alone":
        proc = run_cli(train_args(data_dir, out, 'optimizer.algorithm="sgd"',
                                  "run.max_steps=50"), timeout=60)
    else:
        proc = run_mpi(3, ["-m", "distbelief", *train_args(data_dir, out, "run.max_steps=50",
                                                          "run.replica_timeout_seconds=0"), "--fresh"],
                       timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert f"took run.out_dir over from a run taken for dead: process {first.pid} on this " \
           f"host is gone" in proc.stdout
    assert not (out / ownership.OWNER_FILE).exists()


def test_a_requeued_job_takes_over_from_its_earlier_instance_end_to_end(
        data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    fake_owner(out, host="node-b", pid=1, slurm_job_id="901", restart_count=0)
    env = {**job_env(), "SLURM_JOB_ID": "901", "SLURM_RESTART_COUNT": "1"}
    proc = run_cli(train_args(data_dir, out, 'optimizer.algorithm="sgd"', "run.max_steps=20"),
                   timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "SLURM job 901's restart 0 and this is restart 1" in proc.stdout


# -- distbelief status ------------------------------------------------------------------------------


STATUS_NO_MPI = ("import json, sys\nfrom distbelief.cli import main\n"
                 "status = main(['status', sys.argv[1], '--json'])\n"
                 "assert 'mpi4py.MPI' not in sys.modules, 'status imported MPI'\n"
                 "sys.exit(status)\n")


def status_json(out: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", STATUS_NO_MPI, str(out)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_status_of_a_live_run_then_of_the_ended_run(data_dir: Path, tmp_path: Path) -> None:
    out, log = tmp_path / "out", tmp_path / "log"
    first = start_sgd(data_dir, out, log, "run.max_steps=0", "run.max_seconds=60",
                      "run.checkpoint_every_seconds=0.5", "run.eval_every_seconds=0.3")
    try:
        wait_for_training(first, out, log)
        time.sleep(1.0)  # an evaluation and a checkpoint
        live = status_json(out)
        text = run_cli(["status", out]).stdout
        os.killpg(first.pid, signal.SIGINT)  # ends it with a checkpoint, as Ctrl-C does
    finally:
        status = wait_or_kill(first)
    assert live["alive"] is True and live["owner"]["pid"] == first.pid
    assert live["last_step"] > 0 and live["last_eval"]["test_accuracy"] > 0
    assert live["last_checkpoint"]["step"] > 0
    assert time.time() - live["last_sign_of_life"] < 10
    assert text.startswith(f"{out}: running: host {socket.gethostname()}, process "
                           f"{first.pid}, running since"), text
    for label in ("last step:", "last evaluation:   test accuracy", "last checkpoint:",
                  "last sign of life:"):
        assert label in text
    assert status == 130, log.read_text()
    summary = json.loads((out / "summary.json").read_text())
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "ti')  # a line caught half way, as a reader may see it
    ended = status_json(out)
    assert ended["alive"] is False and ended["owner"] is None
    assert ended["stop_reason"] == "SIGINT"
    assert ended["last_step"] == ended["last_checkpoint"]["step"] == summary["steps"]
    assert run_cli(["status", out]).stdout.startswith(f"{out}: ended (SIGINT)")


def test_status_says_the_last_sign_of_life_once_and_where_it_came_from(tmp_path: Path) -> None:
    """A live run's two signs of life (the owner's heartbeat, refreshed every few seconds,
    and metrics.jsonl, written every half second) are named apart, on one line, so they
    never read as two answers to one question (in process, on a folder faked by hand)."""
    out = tmp_path / "run"
    now = time.time()
    fake_owner(out, heartbeat=now - 4.0)  # this process: alive
    (out / "metrics.jsonl").write_text('{"kind": "train", "time": 1.0, "step": 5, '
                                       '"samples": 160, "loss": 1.0}\n')
    os.utime(out / "metrics.jsonl", (now, now))
    state = run_status(out)
    assert state["alive"] and state["sign_of_life"] == "metrics.jsonl written"
    assert state["last_sign_of_life"] == pytest.approx(now, abs=0.01)
    assert state["heartbeat"] == pytest.approx(now - 4.0)
    text = describe({**state, "checked_at": now})
    assert text.count("heartbeat") == 1, text
    assert "  last sign of life: 0s ago (metrics.jsonl written; owner heartbeat 4s ago)" \
        in text.splitlines(), text
    # Metrics older than the heartbeat (a run evaluating, or between two lines): the
    # heartbeat is the last sign, and said once.
    os.utime(out / "metrics.jsonl", (now - 30.0, now - 30.0))
    state = run_status(out)
    text = describe({**state, "checked_at": now})
    assert text.splitlines()[-1] == "  last sign of life: 4s ago (owner heartbeat)", text
    assert text.count("heartbeat") == 1, text


def test_status_of_a_run_whose_owner_died(data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    fake_owner(out, pid=dead_pid())
    state = status_json(out)
    assert state["alive"] is False and "is gone" in state["dead_because"]
    text = run_cli(["status", out]).stdout
    assert "is taken for dead" in text and "the next run takes over" in text
    proc = run_cli(["status", tmp_path / "missing"])
    assert proc.returncode == 2 and "no such folder" in proc.stderr
