"""Hogwild (algorithms/hogwild/trainer.py) end to end, as MPI jobs under timeouts: it trains at 2
and 3 replicas with max_steps split exactly, resumes exactly, equals the single-process
trainer bit for bit at one replica, refuses ranks on several nodes with one line and exit
2 on every rank, survives a killed replica, stops with one line when rank 0 dies, and
stops every replica with a checkpoint on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import exit_statuses, set_args
from helpers.mpi_jobs import (
    REPO,
    TEST_NODES,
    job_env,
    mpi_under_test,
    mpiexec,
    run_cli,
    run_mpi,
    start_in_background,
    survive_a_death,
    wait_for_training,
    wait_or_kill,
)

from distbelief.records import checkpoint as ckpt
from distbelief.runtime.launching.faults import ENV as FAULTS

EXIT_STATUS = REPO / "tests" / "mpi_programs" / "cli_exit_status.py"
TIMEOUT = 90
DELAY = "delay:*:0:0.0002s"  # a kill at step 300 lands early in a 3000-step run


@pytest.fixture(scope="module")
def data_dir(synthetic_folder, small_config) -> Path:
    return synthetic_folder("hogwild", {f"{algorithm}.toml": small_config(
        optimizer={"algorithm": algorithm}, cluster=None,
        run={"max_steps": None, "eval_every_seconds": 0.5, "progress_every_seconds": None})
        for algorithm in ("hogwild", "sgd")}, n_train=8000, n_test=1000, input_shape=(32,))


def hogwild(n: int, data_dir: Path, out: Path, *overrides: str, faults: str = "",
            env: dict | None = None, survive: bool = False):
    """The real command line on every rank, each printing its exit status."""
    env = {**(env or job_env()), FAULTS: faults}
    args = ["train", data_dir / "hogwild.toml", *set_args(f'run.out_dir="{out}"', *overrides)]
    return run_mpi(n, [EXIT_STATUS, *args], timeout=TIMEOUT, env=env,
                   launcher_options=survive_a_death() if survive else ())


def summary_of(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.mark.both_mpis  # the shared window and its memory barrier, under Open MPI too
@pytest.mark.parametrize("n", [2, 3])
def test_replicas_share_max_steps_exactly_learn_and_resume(data_dir: Path, tmp_path: Path,
                                                           n: int) -> None:
    out = tmp_path / "out"
    proc = hogwild(n, data_dir, out, "run.max_steps=1501", "run.checkpoint_every_steps=500")
    assert exit_statuses(proc) == [0] * n, proc.stdout + proc.stderr
    summary = summary_of(out)
    assert summary["algorithm"] == "hogwild" and summary["stop_reason"] == "max_steps"
    assert summary["steps"] == 1501 and summary["lost_replicas"] == []
    # Quotas: 1501 // n each, one more for the first 1501 % n replicas.
    assert [r["steps"] for r in summary["replicas"]] == [
        1501 // n + (i < 1501 % n) for i in range(n)]
    assert summary["samples"] == 1501 * 32
    # No network: each step reads the shared parameters and writes its update into them.
    vector = 4 * summary["num_params"]
    assert [e["bytes_sent"] for e in summary["replica_bytes"]] == [
        r["steps"] * vector for r in summary["replicas"]]
    assert summary["bytes_sent"] == summary["bytes_received"] == 1501 * vector
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [line for line in lines if line["kind"] in ("train", "eval")]
    assert logged and all(line["bytes_sent"] == line["step"] * vector for line in logged)
    assert summary["final_test_accuracy"] >= 0.7  # one replica alone: ~0.8 (measured)
    final = ckpt.find_latest(ckpt.checkpoint_root(out))[0]
    assert final.step == 1501 and final.num_replicas == n
    assert len(ckpt.list_checkpoints(ckpt.checkpoint_root(out))) >= 2  # periodic ones too
    if n != 3:
        return
    # A rerun with a larger budget resumes from the final checkpoint and stops exactly.
    proc = hogwild(n, data_dir, out, "run.max_steps=1800")
    assert exit_statuses(proc) == [0] * n, proc.stdout + proc.stderr
    resumed = summary_of(out)
    assert resumed["resumed_at_step"] == 1501 and resumed["steps"] == 1800
    assert sum(r["steps"] for r in resumed["replicas"]) == 1800


def test_one_replica_computes_what_the_single_process_trainer_does(data_dir: Path,
                                                                   tmp_path: Path) -> None:
    steps = ["run.max_steps=400", "run.checkpoint_every_steps=0"]
    reference = run_cli(["train", data_dir / "sgd.toml",
                         *set_args(f'run.out_dir="{tmp_path / "sgd"}"', *steps)])
    assert reference.returncode == 0, reference.stderr
    proc = hogwild(1, data_dir, tmp_path / "hogwild", *steps)
    assert exit_statuses(proc) == [0], proc.stdout + proc.stderr
    ours = ckpt.find_latest(ckpt.checkpoint_root(tmp_path / "hogwild"))[0]
    theirs = ckpt.find_latest(ckpt.checkpoint_root(tmp_path / "sgd"))[0]
    assert ours.step == theirs.step == 400
    (p1, s1), (p2, s2) = ours.read_state(), theirs.read_state()
    assert np.array_equal(p1, p2) and np.array_equal(s1["accum"], s2["accum"])
    assert ours.read_replica(0).data_state == theirs.read_replica(0).data_state
    assert (summary_of(tmp_path / "hogwild")["final_test_accuracy"]
            == summary_of(tmp_path / "sgd")["final_test_accuracy"])


@pytest.mark.nodes
def test_ranks_on_several_nodes_are_refused_on_every_rank(data_dir: Path,
                                                          tmp_path: Path) -> None:
    env = {**job_env(), TEST_NODES: "2"}
    proc = hogwild(3, data_dir, tmp_path / "out", "run.max_steps=100", env=env)
    assert exit_statuses(proc) == [2, 2, 2], proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr
    assert "needs every rank on one node" in errors[0]
    assert "ranks 0,2 on node 0" in errors[0] and "rank 1 on node 1" in errors[0]
    assert 'use algorithm = "downpour"' in errors[0]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.both_mpis
def test_a_killed_replica_is_lost_and_the_others_finish(data_dir: Path,
                                                        tmp_path: Path) -> None:
    out = tmp_path / "out"
    common = ("run.max_steps=3000", "run.checkpoint_every_steps=1000")
    proc = hogwild(3, data_dir, out, *common, faults=f"kill:2:300 {DELAY}", survive=True)
    assert exit_statuses(proc) == [0, 0, 137], proc.stdout + proc.stderr
    assert "replica 2 (rank 2) lost at step" in proc.stdout
    summary = summary_of(out)
    assert summary["stop_reason"] == "max_steps"
    assert [x["replica"] for x in summary["lost_replicas"]] == [2]
    # The survivors did their quotas; the lost one's unfinished share is not trained.
    assert [r["steps"] for r in summary["replicas"]] == [1000, 1000]
    assert 2300 <= summary["steps"] < 3000
    final = ckpt.find_latest(ckpt.checkpoint_root(out))[0]
    assert final.manifest["lost_replicas"] == [2] and final.step == summary["steps"]
    # A rerun resumes; the lost replica starts a fresh pass, and the budget is exact.
    proc = hogwild(3, data_dir, out, "run.max_steps=3300")
    assert exit_statuses(proc) == [0, 0, 0], proc.stdout + proc.stderr
    assert summary_of(out)["steps"] == 3300


@pytest.mark.both_mpis
def test_losing_rank_0_stops_the_others_with_one_line(data_dir: Path,
                                                      tmp_path: Path) -> None:
    # 3 ranks: under Open MPI 5.0.11, PRRTE ended a 2-rank job at the death of either rank,
    # --enable-recovery notwithstanding (the survivor was killed before it wrote a line).
    proc = hogwild(3, data_dir, tmp_path / "out", "run.max_steps=3000",
                   faults=f"kill:0:200 {DELAY}", survive=True)
    assert proc.returncode != 0
    assert "rank 0 (Hogwild's replica 0, which evaluates, records and checkpoints) is " \
           "gone" in proc.stderr, proc.stdout + proc.stderr


@pytest.mark.skipif(mpi_under_test() == "openmpi",
                    reason="seen: a SIGINT to PRRTE's mpirun ends the job (status 1) first")
def test_ctrl_c_stops_every_replica_with_a_checkpoint(data_dir: Path, tmp_path: Path) -> None:
    out, log = tmp_path / "out", tmp_path / "log"
    cmd = [*mpiexec(3), sys.executable, EXIT_STATUS, "train", data_dir / "hogwild.toml",
           *set_args(f'run.out_dir="{out}"', "run.max_seconds=60")]
    proc = start_in_background(cmd, log)
    wait_for_training(proc, out, log)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGINT)  # mpiexec forwards it to every rank
    assert wait_or_kill(proc) == 130, log.read_text()
    assert sorted(exit_statuses_of(log.read_text())) == [130] * 3, log.read_text()
    summary = summary_of(out)
    assert summary["stop_reason"] == "SIGINT" and summary["steps"] > 0
    final = ckpt.find_latest(ckpt.checkpoint_root(out))[0]
    assert final.step == summary["steps"]


def exit_statuses_of(text: str) -> list[int]:
    return [int(s) for s in re.findall(r"rank \d+ exit (\d+)", text)]
