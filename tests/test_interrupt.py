"""Ctrl-C never loses a run: a first SIGINT, to a run alone or to mpiexec (which forwards it
to every rank), finishes the step, writes a checkpoint and the summary and exits 130; the
rerun resumes from that step and says so in its first line. A second SIGINT stops at once.
Also: a run that finds metrics but no checkpoint moves them aside instead of overwriting
them, and a rerun of a finished run says it has nothing left to do, names --fresh and
changes no record."""

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
from helpers import set_args
from helpers.mpi_jobs import (
    REPO,
    job_env,
    mpiexec,
    run_cli,
    run_mpi,
    start_in_background,
    wait_for_training,
    wait_or_kill,
)

from distbelief.algorithms.common import announces_signals
from distbelief.records import checkpoint as ckpt
from distbelief.records.metrics import read_metrics

PROGRAMS = REPO / "tests" / "mpi_programs"


@pytest.fixture(scope="module")
def data_dir(synthetic_folder, small_config) -> Path:
    return synthetic_folder("interrupt", {"synth.toml": small_config()})


def train_args(data_dir: Path, out: Path, *overrides: str) -> list[str]:
    return [str(a) for a in ["train", data_dir / "synth.toml",
                             *set_args(f'run.out_dir="{out}"', *overrides)]]


SINGLE = ['optimizer.algorithm="sgd"']


@pytest.mark.parametrize("launcher", ["alone", "mpiexec x3", "mpiexec x4 2 shards",
                                      "mpiexec x4 sandblaster", "mpiexec x3 partitions",
                                      "mpiexec x3 terminal"])
@pytest.mark.matrix
def test_ctrl_c_checkpoints_exits_130_and_the_rerun_resumes(data_dir: Path, tmp_path: Path,
                                                             launcher: str) -> None:
    out, log = tmp_path / "out", tmp_path / "log"
    budget = ["run.max_steps=0", "run.max_seconds=60"]
    # A validation split: the test set is then evaluated at a run's end, never on a stop.
    held_out = "data.validation=0.1"
    if launcher == "alone":
        extra, n = [*SINGLE, held_out], 1
        cmd = [sys.executable, "-m", "distbelief", *train_args(data_dir, out, *extra, *budget)]
    else:
        n = int(launcher.split()[1][1:])
        extra = {"shards": ["cluster.ps_shards=2"],
                 "sandblaster": ['optimizer.algorithm="sandblaster"'],
                 "partitions": [*SINGLE, "cluster.partitions=3"]}.get(launcher.split()[-1], [])
        extra = [*extra, held_out]
        cmd = [*mpiexec(n), sys.executable, str(PROGRAMS / "cli_exit_status.py"),
               *train_args(data_dir, out, *extra, *budget)]
    proc = start_in_background(cmd, log)
    wait_for_training(proc, out, log)
    time.sleep(0.3)  # every rank past its set-up
    if "terminal" in launcher:  # a terminal signals its whole foreground process group
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGINT)
    status = wait_or_kill(proc)
    output = log.read_text()
    assert status == 130, output
    if n > 1:
        statuses = sorted(int(s) for s in re.findall(r"rank \d+ exit (\d+)", output))
        assert statuses == [130] * n, output
    # One line for the job, from one rank, naming the signal; the closing line names it too.
    assert output.count("distbelief: SIGINT received: stopping after this step") == 1, output
    assert "distbelief: interrupted" not in output, output  # the old line, once per rank
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "SIGINT", summary
    assert "stopped (SIGINT)" in output, output
    # The test set stays unseen: no figure printed, none in the records.
    assert "test set, evaluated once" not in output and "test accuracy" not in output, output
    assert "the test set was not evaluated: SIGINT interrupted the run" in output, output
    assert summary["final_test_accuracy"] is None and "test_step" not in summary, summary
    assert not [x for x in read_metrics(out / "metrics.jsonl") if x["kind"] == "test"]
    step = summary["steps"]
    if "partitions" in launcher:  # partitioned runs write no checkpoints: the summary only
        assert step > 0
        return
    found, _ = ckpt.find_latest(ckpt.checkpoint_root(out))
    assert step > 0 and found is not None and found.step == step

    rerun_args = train_args(data_dir, out, *extra, f"run.max_steps={step + 100}")
    if n == 1:
        rerun = run_cli(rerun_args, timeout=60)
    else:
        rerun = run_mpi(n, ["-m", "distbelief", *rerun_args], timeout=90)
    assert rerun.returncode == 0, rerun.stderr
    first_line = rerun.stdout.splitlines()[0]
    assert first_line.startswith(f"distbelief: resuming from {found.path} at step {step},"), \
        rerun.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == step + 100
    # Ended by its own stop rule: now, and only now, the test set is evaluated, once.
    # It scores the best model the run kept (run.keep_best), at the best's step; the last
    # where the run kept none (Sandblaster keeps no best).
    assert summary["final_test_accuracy"] is not None
    if summary["best"] is None:
        assert summary["test_model"] == "last" and summary["test_step"] == step + 100
    else:
        assert summary["test_model"] == "best"
        assert summary["test_step"] == summary["best"]["step"] <= step + 100
    assert len([x for x in read_metrics(out / "metrics.jsonl") if x["kind"] == "test"]) == 1
    assert rerun.stdout.count("test set, evaluated once at the end") == 1, rerun.stdout


def test_a_second_ctrl_c_stops_at_once() -> None:
    """SIGINTs in a row: the first only asks for a stop; one within a second of it is the
    same Ctrl-C arriving twice (terminal and mpiexec); a later one ends the process with
    130 at once."""
    code = ("import os, signal, time\n"
            "from distbelief.algorithms.common import StopSignals\n"
            "with StopSignals() as s:\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(0.2)\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(1.2)\n"
            "    print('first:', s.received, s.counts['SIGTERM'], flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(10)\n"
            "    print('not stopped', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=30, check=False)
    assert proc.returncode == 130, proc.stderr
    assert proc.stdout == "first: SIGINT 1\n"
    assert proc.stderr.count("SIGINT received: stopping after this step") == 1, proc.stderr
    assert "SIGINT again: stopping now" in proc.stderr


def test_only_the_first_rank_announces_a_signal() -> None:
    """A launcher's signal reaches every rank: rank 0 (or a process without a launcher)
    says so, the others keep quiet."""
    assert announces_signals({}) and announces_signals({"PMI_RANK": "0"})
    assert not announces_signals({"PMI_RANK": "2"})
    assert not announces_signals({"OMPI_COMM_WORLD_RANK": "1"})


# -- resuming is visible; nothing a run wrote is overwritten -------------------------------------


def previous_folders(out: Path) -> list[Path]:
    return sorted(p for p in out.iterdir() if p.name.startswith("previous-"))


@pytest.mark.parametrize("launcher", ["alone", "mpiexec x2 partitions"])
def test_metrics_without_a_checkpoint_are_moved_aside_not_overwritten(
        data_dir: Path, tmp_path: Path, launcher: str) -> None:
    out = tmp_path / "out"
    args = train_args(data_dir, out, *SINGLE, "run.max_steps=30",
                      *(["cluster.partitions=2"] if "partitions" in launcher else []))

    def run() -> subprocess.CompletedProcess:
        if launcher == "alone":
            return run_cli(args, timeout=60)
        return run_mpi(2, ["-m", "distbelief", *args], timeout=90)

    assert run().returncode == 0
    # A run whose checkpoints were lost (or never written: killed before the first one).
    for path in (out / "checkpoints").iterdir():
        for part in sorted(path.rglob("*"), reverse=True):
            part.unlink() if part.is_file() else part.rmdir()
        path.rmdir()
    before = (out / "metrics.jsonl").read_bytes(), (out / "summary.json").read_bytes()
    proc = run()
    assert proc.returncode == 0, proc.stderr
    [moved] = previous_folders(out)
    assert f"held a previous run's metrics but no checkpoint to resume from; moved its files " \
           f"to {moved}" in proc.stdout
    assert ((moved / "metrics.jsonl").read_bytes(), (moved / "summary.json").read_bytes()) \
        == before
    assert read_metrics(out / "metrics.jsonl")[0]["step"] <= 30  # the new run's own


def run_folder_bytes(out: Path) -> dict[str, bytes]:
    """Every file under a run folder, by relative path: what a rerun must leave as it was."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file()}


# (ranks of the first run, ranks of the rerun, overrides): a finished run reruns with its
# own rank count or another one (the README: "e.g. when you try another rank count").
FINISHED_RUNS = {
    "alone": (1, 1, SINGLE),
    "downpour x3": (3, 3, []),
    "downpour x3, rerun x4": (3, 4, []),
    "sandblaster x3": (3, 3, ['optimizer.algorithm="sandblaster"']),
    "hogwild x2": (2, 2, ['optimizer.algorithm="hogwild"', "cluster.ps_shards=0"]),
    "sync x2": (2, 2, ['optimizer.algorithm="sync"', "cluster.ps_shards=0"]),
}


@pytest.mark.parametrize("case", FINISHED_RUNS)
@pytest.mark.matrix
def test_rerunning_a_finished_run_changes_no_record_and_names_fresh(
        data_dir: Path, tmp_path: Path, case: str) -> None:
    first, again, extra = FINISHED_RUNS[case]
    out = tmp_path / "out"
    args = train_args(data_dir, out, *extra, "run.max_steps=40")

    def run(n: int, *more: str) -> subprocess.CompletedProcess:
        if n == 1:
            return run_cli([*args, *more], timeout=60)
        return run_mpi(n, ["-m", "distbelief", *args, *more], timeout=90)

    assert run(first).returncode == 0
    summary = json.loads((out / "summary.json").read_text())
    before = run_folder_bytes(out)
    proc = run(again)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == (
        f"distbelief: {out} holds a finished run (run.max_steps = 40; its checkpoint is at "
        f"step 40): nothing to train, and its records are left as they are. Raise "
        f"run.max_steps to train on, or pass --fresh to start over")
    # Not a byte of summary.json, metrics.jsonl, config.json or the checkpoints changed.
    assert run_folder_bytes(out) == before
    assert summary["stop_reason"] == "max_steps"
    # A higher budget trains on from the checkpoint, as before.
    proc = run(first, "--set", "run.max_steps=60")
    assert proc.returncode == 0, proc.stderr
    assert "resuming from" in proc.stdout
    assert json.loads((out / "summary.json").read_text())["stop_reason"] == "max_steps"
    assert run_folder_bytes(out) != before


def test_a_reader_that_leaves_stops_the_printing_not_the_run(data_dir: Path,
                                                              tmp_path: Path) -> None:
    """`distbelief train ... | head -1`: the pipe closes after the first line; the run
    finishes as it would have (summary and checkpoint), with one note on stderr. Alone only:
    under mpiexec the launcher itself dies of the closed pipe, which no rank can prevent
    (docs/checkpoints-and-reliability.md says so)."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "distbelief",
           *train_args(data_dir, out, *SINGLE, "run.max_steps=0", "run.max_seconds=4")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=job_env(), start_new_session=True)
    assert proc.stdout.readline()  # the first line, then the reader leaves
    proc.stdout.close()
    try:
        status = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        pytest.fail("the run did not end after its reader left")
    err = proc.stderr.read()
    assert status == 0, err
    assert err.count("the reader of the output left") == 1, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "max_seconds", summary
    assert ckpt.list_checkpoints(ckpt.checkpoint_root(out)), "no checkpoint at the end"
