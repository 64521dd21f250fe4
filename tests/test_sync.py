"""Synchronous SGD (`optimizer.algorithm = "sync"`, issue 14 item 1), as MPI jobs under
timeouts on tiny synthetic data:

- the replicas end bit for bit identical, and equal to a single-process computation of
  the same averaged-gradient steps (R = 2 exactly, R = 3 to float32 rounding: MPI may sum
  three gradients in another order); a resumed run continues that computation exactly;
- backup workers (R = 3, k = 1): every step takes the first 2 gradients and the late ones
  are counted as dropped;
- a killed replica without backup workers ends the job with one line and a non-zero
  status, never a hang; with a backup worker the run goes on without it;
- configurations that cannot work are refused with one line naming the numbers;
- the step's stop decision (StopDecision, which averaging and partitioned sgd share)
  decodes what it encoded, and a MAX over the ranks' votes keeps the highest stop code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import exit_statuses, set_args
from helpers.mpi_jobs import REPO, job_env, run_mpi, survive_a_death

from distbelief.algorithms.common import STOP_CODES, StopDecision
from distbelief.algorithms.sync import check_configuration
from distbelief.config import build_network, load_config
from distbelief.data.hdf5 import TrainShard, open_dataset
from distbelief.errors import ConfigError
from distbelief.model.optimizers import make_optimizer
from distbelief.records import checkpoint as ckpt
from distbelief.runtime.launching.faults import ENV as FAULTS

PROGRAM = REPO / "tests" / "mpi_programs" / "cli_exit_status.py"
TIMEOUT = 90
LOST_LINE = ('is gone: algorithm = "sync" without backup_workers cannot go on, as every '
             'step\'s allreduce needs every replica. Set optimizer.backup_workers = k')


@pytest.fixture(scope="module")
def data_dir(synthetic_folder, small_config) -> Path:
    return synthetic_folder("sync", {"sync.toml": small_config(
        16, optimizer={"algorithm": "sync"}, cluster=None,
        run={"max_steps": 100, "eval_every_seconds": 0.5, "progress_every_seconds": 1})},
        n_train=3000, n_test=600, input_shape=(24,), seed=7)


def job(n: int, data_dir: Path, out: Path, *overrides: str, faults: str = ""):
    """The real command line on every rank (each printing its exit status); a dead rank
    does not end the job by itself (survive_a_death), so what the others do is seen."""
    env = {**job_env(), FAULTS: faults}
    args = ["train", data_dir / "sync.toml",
            *set_args(f'run.out_dir="{out}"', "run.heartbeat_timeout_seconds=5", *overrides)]
    return run_mpi(n, [PROGRAM, *args], timeout=TIMEOUT, env=env,
                   launcher_options=survive_a_death())


def summary_of(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def final_params(out: Path) -> np.ndarray:
    found = ckpt.find_latest(ckpt.checkpoint_root(out))[0]
    return found.read_state()[0]


def reference(data_dir: Path, replicas: int, steps: int) -> np.ndarray:
    """The same synchronous steps in this process: each replica's batch from its own
    TrainShard, the gradients summed and scaled by 1/R in float32, one Adagrad step."""
    config = load_config(data_dir / "sync.toml")
    info = open_dataset(config.data.path)
    network = build_network(config, info)
    params = network.init_params(config.run.seed)
    optimizer = make_optimizer(True, config.optimizer.learning_rate, params.size)
    shards = [TrainShard(info, r, replicas, config.run.seed) for r in range(replicas)]
    grad, total = np.zeros_like(params), np.zeros_like(params)
    for _ in range(steps):
        total[:] = 0
        for shard in shards:
            network.loss_and_grad(params, *shard.next_batch(config.data.batch_size), grad)
            total += grad
        total *= np.float32(1.0 / replicas)
        optimizer.step(params, total)
    return params


@pytest.mark.parametrize("replicas", [2, pytest.param(3, marks=pytest.mark.both_mpis)])
def test_replicas_stay_identical_and_compute_the_reference_steps(
        data_dir: Path, tmp_path: Path, replicas: int) -> None:
    out = tmp_path / "out"
    proc = job(replicas, data_dir, out, "run.max_steps=60")
    assert exit_statuses(proc) == [0] * replicas, proc.stdout + proc.stderr[-3000:]
    summary = summary_of(out)
    assert summary["algorithm"] == "sync" and summary["stop_reason"] == "max_steps"
    assert summary["steps"] == 60 and summary["samples"] == 60 * 32 * replicas
    assert summary["replicas_identical"] is True  # SHA-256 of every replica's state
    assert summary["final_test_accuracy"] is not None
    # Bytes on the wire: each step's all-reduces take [gradient, loss] (float32) and three
    # int32 decisions from every replica and give as much back; each evaluation 24 bytes
    # (cross-entropy's tally: rows, the loss's sum, hits, as float64; model.losses).
    n, per_step = summary["num_params"], 4 * (summary["num_params"] + 1) + 12
    for entry in summary["replica_bytes"]:
        evaluations, rest = divmod(entry["bytes_sent"] - 60 * per_step, 24)
        assert rest == 0 and evaluations >= 1, (entry, n)
        assert entry["bytes_received"] == entry["bytes_sent"]
    assert summary["bytes_sent"] == sum(e["bytes_sent"] for e in summary["replica_bytes"])
    assert summary["bytes_sent_per_sample"] == pytest.approx(
        summary["bytes_sent"] / summary["samples"])
    expected = reference(data_dir, replicas, 60)
    if replicas == 2:  # a + b == b + a: the same bits as the reference
        np.testing.assert_array_equal(final_params(out), expected)
    else:
        np.testing.assert_allclose(final_params(out), expected, rtol=1e-5, atol=1e-6)
    if replicas != 2:
        return
    # Resumed to 100 steps: each replica's batch sequence and the Adagrad state continue,
    # so the result is the uninterrupted computation's, bit for bit.
    proc = job(replicas, data_dir, out, "run.max_steps=100")
    assert exit_statuses(proc) == [0] * replicas, proc.stdout + proc.stderr[-3000:]
    assert "resuming from" in proc.stdout and summary_of(out)["steps"] == 100
    np.testing.assert_array_equal(final_params(out), reference(data_dir, replicas, 100))


def test_each_replica_reads_its_shard_and_its_slice_of_the_evaluation_set(
        data_dir: Path, tmp_path: Path) -> None:
    """Data by role (issue 32): at 3 replicas, each rank reads from the file its third of
    the training rows, its third of the test set (it evaluates only that), and its third
    of the labels the ranks check together at start: nothing of the others' shares."""
    from distbelief.data.hdf5 import bytes_read

    before = bytes_read()
    info = open_dataset(data_dir / "synth.h5", part=(0, 3))
    labels = bytes_read() - before  # 3000 and 600 rows: every third the same size
    row = int(np.prod(info.input_shape)) * np.dtype(info.stored_dtype).itemsize + 4
    out = tmp_path / "out"
    proc = run_mpi(3, [REPO / "tests" / "mpi_programs" / "rank_bytes_read.py", "train",
                       data_dir / "sync.toml",
                       *set_args(f'run.out_dir="{out}"', "run.max_steps=5")], timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    read = {int(m[1]): int(m[2])
            for m in re.finditer(r"rank (\d+) bytes_read (\d+)", proc.stdout)}
    assert read == {r: labels + (1000 + 200) * row for r in range(3)}, proc.stdout
    assert summary_of(out)["eval_samples"] == 600


def test_backup_workers_take_the_first_gradients_and_count_the_dropped(
        data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = job(4, data_dir, out, "optimizer.backup_workers=1", "run.max_steps=150")
    assert exit_statuses(proc) == [0] * 4, proc.stdout + proc.stderr[-3000:]
    summary = summary_of(out)
    assert summary["stop_reason"] == "max_steps" and summary["steps"] == 150
    assert summary["backup_workers"] == 1 and summary["lost_replicas"] == []
    # Every step takes 2 of the 3 gradients: the third arrives late and is dropped.
    assert summary["samples"] == 150 * 2 * 32
    assert 140 <= summary["dropped_gradients"] <= 150
    # Bytes, counted by the shard: a gradient and its 5-value header from each replica per
    # gradient it sent, the parameters and a 2-value header to it per step.
    gradient = 4 * summary["num_params"] + 5 * 8
    assert len(summary["replica_bytes"]) == 3
    sent = [e["bytes_sent"] for e in summary["replica_bytes"]]
    assert all(b % gradient == 0 for b in sent), sent
    assert sum(sent) >= 300 * gradient
    assert all(e["bytes_received"] >= 150 * 4 * summary["num_params"]
               for e in summary["replica_bytes"])
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = sum(line.get("dropped", 0) for line in lines if line["kind"] == "train")
    assert 0 < logged <= summary["dropped_gradients"]


def test_a_lost_replica_without_backup_workers_stops_the_job_with_one_line(
        data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    # Without the loss the run would go on for minutes: only the detection ends it.
    proc = job(3, data_dir, out, "run.max_steps=1000000", faults="kill:1:40")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert f"replica 1 (rank 1) {LOST_LINE}" in proc.stderr, output[-3000:]
    assert not (out / "summary.json").exists()  # no summary claims a run that broke


@pytest.mark.nodes  # a dead rank on another node is found by its heartbeat
def test_a_lost_replica_with_a_backup_worker_leaves_the_others_to_finish(
        data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = job(4, data_dir, out, "optimizer.backup_workers=1", "run.max_steps=600",
               "run.checkpoint_every_steps=100000", faults="kill:2:50 delay:*:0:0.001s")
    assert exit_statuses(proc) == [0, 0, 137, 0], proc.stdout + proc.stderr[-3000:]
    summary = summary_of(out)
    assert summary["stop_reason"] == "max_steps" and summary["steps"] == 600
    assert [(x["replica"], x["ranks"]) for x in summary["lost_replicas"]] == [(1, [2])]
    assert "replica 1 (rank 2) lost at step" in proc.stdout
    final = ckpt.find_latest(ckpt.checkpoint_root(out))[0]
    assert final.step == 600 and final.manifest["lost_replicas"] == [1]


@pytest.mark.parametrize("ranks, overrides, needle", [
    (3, ["optimizer.backup_workers=2"],
     "backup_workers = 2 needs more replicas than that: 3 MPI ranks give 2 replica(s)"),
    (4, ["optimizer.backup_workers=1", "cluster.ps_shards=2"], "set cluster.ps_shards = 1"),
    (2, ["cluster.partitions=2"], "cluster.partitions = 2 is not supported"),
])
def test_a_configuration_that_cannot_work_is_one_clear_error(
        data_dir: Path, ranks: int, overrides: list[str], needle: str) -> None:
    config = load_config(data_dir / "sync.toml", overrides)
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        check_configuration(config, ranks)


def test_a_refused_configuration_exits_2_on_every_rank(data_dir: Path,
                                                       tmp_path: Path) -> None:
    proc = job(3, data_dir, tmp_path / "out", "optimizer.backup_workers=2")
    assert exit_statuses(proc) == [2, 2, 2], proc.stdout + proc.stderr[-3000:]
    assert proc.stderr.count("backup_workers = 2 needs more replicas") >= 1


def test_a_stop_decision_decodes_what_it_encoded_and_a_max_keeps_the_highest_vote() -> None:
    decision = StopDecision()
    assert (decision.reason, decision.eval_due, decision.save_due) == (None, False, False)
    for reason in STOP_CODES.values():
        for eval_due, save_due in ((False, True), (True, False)):
            decision.encode(reason, eval_due, save_due)
            assert (decision.reason, decision.eval_due, decision.save_due) == (
                reason, eval_due, save_due)
    # Rank 0's clock votes max_seconds and evaluate; another rank got a SIGTERM.
    votes = [StopDecision(), StopDecision()]
    votes[0].encode("max_seconds", eval_due=True)
    votes[1].encode()
    votes[1].merge("SIGTERM")
    votes[1].merge(None)  # no signal changes nothing
    agreed = StopDecision()
    agreed.flags[:] = np.maximum(votes[0].flags, votes[1].flags)  # what MPI.MAX gives
    assert (agreed.reason, agreed.eval_due, agreed.save_due) == ("SIGTERM", True, False)
    votes[1].merge("max_steps")  # a lower code does not replace a higher one
    assert votes[1].reason == "SIGTERM"
