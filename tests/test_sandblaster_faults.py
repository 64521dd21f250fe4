"""Sandblaster goes on without a lost replica (issue 15), end to end: kill -9 of a replica
(test-only faults, distbelief.runtime.launching.faults) at moments spread over a run, at 1 and 2
shards, with and without partitions, on one node and on simulated nodes, with MPICH's
launcher keeping the others alive (`-disable-auto-cleanup`). Each run finishes its
iterations; every other rank exits 0; summary.json, metrics.jsonl and the checkpoint
record the lost replica; the final loss is within 5% of the same run without the fault;
a rerun resumes with every replica; a hot spare (cluster.spare_replicas) takes a killed
replica's units over, and the next spare those of a killed spare.

The runs are full-batch L-BFGS on a small MLP (3000 rows, 60 work units per gradient
evaluation, 30 iterations, about 34 evaluations): every replica gets any unit, so a
replica's units near AT (AT counts the units it computed) land early, in the middle or
late in the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import exit_statuses
from helpers.mpi_jobs import (
    job_env,
    mpi_under_test,
    mpiexec,
    run_mpi,
    simulated_test_nodes,
    survive_a_death,
)

from distbelief.algorithms.sandblaster.coordinator import NOTICE_SLACK_S
from distbelief.records import checkpoint as ckpt
from distbelief.records.metrics import read_metrics
from distbelief.runtime.launching.faults import ENV as FAULTS

PROGRAM = Path(__file__).parent / "mpi_programs" / "cli_exit_status.py"
TIMEOUT = 240
ITERATIONS = 30
CONFIG = f"""
[model]
layers = [{{ type = "dense", units = 64, activation = "relu" }},
          {{ type = "dense", units = 4, activation = "softmax" }}]
[data]
path = "synth.h5"
batch_size = 3000
[optimizer]
algorithm = "sandblaster"
m = 5
work_unit_size = 50
[cluster]
ps_shards = 1
[run]
max_steps = {ITERATIONS}
eval_every_seconds = 0.5
progress_every_seconds = 0.5
threads = 1
heartbeat_timeout_seconds = 5
"""


@pytest.fixture(scope="module")
def data_dir(synthetic_folder) -> Path:
    return synthetic_folder("sandblaster_faults", {"sb.toml": CONFIG}, n_train=3000)


def job(n: int, folder: Path, out: Path, *overrides: str, faults: str = ""):
    env = {**job_env(), FAULTS: faults}
    args = ["train", folder / "sb.toml", "--set", f'run.out_dir="{out}"']
    for o in overrides:
        args += ["--set", o]
    return run_mpi(n, [PROGRAM, *args], timeout=TIMEOUT, env=env,
                   launcher_options=survive_a_death())


def summary_of(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def clean_loss(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> float:
    """The final loss of the run without a fault, on the fewest ranks (a shard, the
    coordinator, one replica): full-batch L-BFGS takes the same steps whatever the rank,
    shard or partition count, up to the order of float sums (measured: 4 layouts from 4 to
    8 ranks, with 2 shards or 2 partitions, agreed within 3e-6 of each other), so one clean
    run serves every case."""
    out = tmp_path_factory.mktemp("clean") / "out"
    proc = job(3, data_dir, out)
    assert exit_statuses(proc) == [0] * 3, proc.stderr[-3000:]
    return summary_of(out)["final_loss"]


# (id, ranks, overrides, fault, the replica's ranks); rank 0..S-1 shards, S coordinator.
CASES = [
    ("batch-1-shard", 5, (), "kill:3:60", [3]),
    ("early-2-shards", 5, ("cluster.ps_shards=2",), "kill:4:10", [4]),
    ("late", 5, (), "kill:2:450", [2]),
    ("checkpoint-every-iteration", 5, ("run.checkpoint_every_steps=1",), "kill:4:200", [4]),
    ("inside-a-push-2-shards", 5, ("cluster.ps_shards=2",), "killpush:3:30", [3]),
    ("partition-1", 6, ("cluster.partitions=2",), "kill:5:40", [4, 5]),
    ("partition-0", 6, ("cluster.partitions=2",), "kill:4:40", [4, 5]),
    # Replica 0 (ranks 2, 3) relays trial points to replica 2 (ranks 6, 7), partition by
    # partition: rank 7 finds its parent dead, rank 6 finds its parent gone once the lost
    # replica's surviving partition has ended; both fall back to the shards.
    ("partition-relay-parent", 8, ("cluster.partitions=2",), "kill:3:40", [2, 3]),
]
# "late": rank 2 (replica 0) is on the other simulated node from the coordinator, found by
# heartbeat only; it dies near the end, and nobody is told how to end before it is found.
NODES_CASES = {"batch-1-shard", "late", "partition-1", "partition-relay-parent"}


@pytest.mark.parametrize(
    "name, n, overrides, fault, ranks",
    [pytest.param(*case, marks=[pytest.mark.nodes] if case[0] in NODES_CASES else [],
                  id=case[0]) for case in CASES])
@pytest.mark.matrix
def test_a_killed_sandblaster_replica_leaves_the_others_to_finish(
        data_dir: Path, tmp_path: Path, name: str, n: int, overrides: tuple[str, ...],
        fault: str, ranks: list[int], clean_loss: float) -> None:
    out = tmp_path / "out"
    victim = int(fault.split(":")[1])
    proc = job(n, data_dir, out, *overrides, faults=fault)
    output = proc.stdout + proc.stderr[-3000:]
    assert exit_statuses(proc) == [137 if r == victim else 0 for r in range(n)], output
    shards = 2 if "cluster.ps_shards=2" in overrides else 1
    partitions = 2 if "cluster.partitions=2" in overrides else 1
    replica = (ranks[0] - shards - 1) // partitions
    assert f"replica {replica} (rank{'s' * (len(ranks) > 1)} " in proc.stdout, output
    summary = summary_of(out)
    assert summary["stop_reason"] == "max_steps" and summary["iterations"] == ITERATIONS
    lost = summary["lost_replicas"]
    assert [(x["replica"], x["ranks"]) for x in lost] == [(replica, ranks)], lost
    assert "is gone" in lost[0]["why"]
    assert all(r["replica"] != replica for r in summary["replicas"])
    if name == "partition-relay-parent":
        children = [r for r in summary["replicas"] if r["replica"] == 2]
        assert [r["relay_fallbacks"] for r in children] == [1, 1], children
    events = [line for line in read_metrics(out / "metrics.jsonl")
              if line.get("kind") == "replica_lost"]
    assert [(e["replica"], e["ranks"]) for e in events] == [(replica, ranks)]
    if fault.startswith("killpush"):
        # Its push reached shard 0 and not shard 1: that evaluation was run again.
        assert summary["restarted_evaluations"] >= 1, summary
    final = ckpt.find_latest(ckpt.checkpoint_root(out))[0]
    assert final.step == ITERATIONS
    # A death near the end, on another node, is found by heartbeat after the last
    # iteration's checkpoint, which then holds every unit it committed: no loss by then.
    lost_by_then = [[replica]] + ([[]] if name == "late" and simulated_test_nodes() else [])
    assert final.manifest["lost_replicas"] in lost_by_then, final.manifest["lost_replicas"]
    assert abs(summary["final_loss"] - clean_loss) <= 0.05 * clean_loss, (
        summary["final_loss"], clean_loss)


def test_a_rerun_after_a_lost_replica_resumes_with_every_replica(data_dir: Path,
                                                                 tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = job(5, data_dir, out, faults="kill:3:60")
    assert exit_statuses(proc) == [0, 0, 0, 137, 0], proc.stderr[-3000:]
    proc = job(5, data_dir, out, f"run.max_steps={ITERATIONS + 5}")
    assert exit_statuses(proc) == [0] * 5, proc.stderr[-3000:]
    resumed = summary_of(out)
    assert resumed["iterations"] == ITERATIONS + 5 and resumed["lost_replicas"] == []
    # The replica lost in the first run computes units again.
    assert [r["replica"] for r in resumed["replicas"]] == [0, 1, 2]
    assert all(r["units"] > 0 for r in resumed["replicas"]), resumed["replicas"]


@pytest.mark.nodes
def test_a_killed_relay_parent_leaves_its_children_to_fetch_from_the_shards(
        data_dir: Path, tmp_path: Path, clean_loss: float) -> None:
    """Six replicas: replica 1 (rank 3) relays trial points to replicas 4 and 5
    (plan.relay_parent). Killed in the middle of the run, its children find it gone in
    their next fetch and take the trial point from the shards; nothing waits for it.
    (Rank 3 shares the coordinator's simulated node; a replica lost on another node near
    the end is the "late" case of the test above.)"""
    out = tmp_path / "out"
    proc = job(8, data_dir, out, faults="kill:3:60")
    output = proc.stdout + proc.stderr[-3000:]
    assert exit_statuses(proc) == [0, 0, 0, 137, 0, 0, 0, 0], output
    summary = summary_of(out)
    assert summary["stop_reason"] == "max_steps" and summary["iterations"] == ITERATIONS
    assert [x["replica"] for x in summary["lost_replicas"]] == [1], (
        summary["lost_replicas"], output)
    children = {r["replica"]: r for r in summary["replicas"]}
    for child in (4, 5):
        assert children[child]["relay_fallbacks"] == 1, children[child]
        assert children[child]["shard_fetches"] > children[child]["evaluations"]
    assert children[2]["relay_fallbacks"] == children[3]["relay_fallbacks"] == 0
    assert abs(summary["final_loss"] - clean_loss) <= 0.05 * clean_loss, (
        summary["final_loss"], clean_loss)


def test_a_spare_takes_a_killed_replicas_units_and_a_killed_spare_hands_them_on(
        data_dir: Path, tmp_path: Path, clean_loss: float) -> None:
    """Hot spares (cluster.spare_replicas = 2; docs/sandblaster.md, "Spares"): 1 shard,
    the coordinator, replicas 0 and 1 (ranks 2, 3), spares 0 and 1 (ranks 4, 5). Replica 1
    dies after its unit 400 (mid-run); spare 0 reads replica 1's rows and computes its
    units; it dies after its own unit 100; spare 1 takes them over. Two replicas compute
    units to the end, and the final loss is the clean run's."""
    out = tmp_path / "out"
    proc = job(6, data_dir, out, "cluster.spare_replicas=2", faults="kill:3:400 kill:4:100")
    output = proc.stdout + proc.stderr[-3000:]
    assert exit_statuses(proc) == [0, 0, 0, 137, 137, 0], output
    assert "spare 0 (rank 4) takes its units over" in proc.stdout, output
    assert "spare 1 (rank 5) takes its units over" in proc.stdout, output
    summary = summary_of(out)
    assert summary["stop_reason"] == "max_steps" and summary["iterations"] == ITERATIONS
    assert [x["ranks"] for x in summary["lost_replicas"]] == [[3], [4]]
    spares = summary["spares"]
    assert [(t["spare"], t["replaced"], t["lost_group"]) for t in spares] == [
        (0, 1, 1), (1, 1, 2)], spares
    assert 0 < spares[1]["loss_to_first_unit_seconds"] < 5, spares
    assert spares[1]["units_committed"] > 0 and summary["training_replicas_at_end"] == 2
    spare = next(r for r in summary["replicas"] if r["rank"] == 5)
    assert spare["spare"] and spare["replaced"] == 1 and spare["own_rows"] == 1500, spare
    events = [e for e in read_metrics(out / "metrics.jsonl") if e.get("kind") ==
              "spare_took_over"]
    assert [(e["spare"], e["replaced"]) for e in events] == [(0, 1), (1, 1)], events
    # Replica 1's units are served again: no checkpoint lists it as lost.
    assert ckpt.find_latest(ckpt.checkpoint_root(out))[0].manifest["lost_replicas"] == []
    assert abs(summary["final_loss"] - clean_loss) <= 0.05 * clean_loss, (
        summary["final_loss"], clean_loss)


# -- what cannot be survived: a lost shard or coordinator, a lost partition of sgd ----------


@pytest.mark.parametrize("name, overrides, fault, needle", [
    # Shard 1 dies after it received 300 pushes (about iteration 8; 2 shards).
    pytest.param("shard", ("cluster.ps_shards=2",), "kill:1:300", "rank 1 (shard 1) is gone",
                 marks=pytest.mark.nodes, id="shard"),
    # The coordinator (rank 1 with one shard) dies after iteration 7.
    pytest.param("coordinator", (), "kill:1:7", "rank 1 (coordinator) is gone",
                 id="coordinator"),
])
def test_a_lost_shard_or_coordinator_ends_the_job_with_a_message_and_a_rerun_resumes(
        data_dir: Path, tmp_path: Path, name: str, overrides: tuple[str, ...], fault: str,
        needle: str) -> None:
    out = tmp_path / "out"
    t0 = time.monotonic()
    proc = job(5, data_dir, out, *overrides, "run.checkpoint_every_steps=2", faults=fault)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert elapsed < 60, f"{elapsed:.1f} s to end the job"  # start-up included
    assert needle in proc.stderr and "Run the same command again to resume" in proc.stderr, (
        proc.stderr[-3000:])
    assert not (out / "summary.json").exists()
    saved = [step for step, _ in ckpt.list_checkpoints(ckpt.checkpoint_root(out))]
    assert saved, "checkpoints were written before the kill"
    proc = job(5, data_dir, out, *overrides)
    assert exit_statuses(proc) == [0] * 5, proc.stderr[-3000:]
    assert f"at step {max(saved)}," in proc.stdout, proc.stdout
    assert summary_of(out)["iterations"] == ITERATIONS


SGD = """
[model]
layers = [{ type = "dense", units = 64, activation = "relu" },
          { type = "dense", units = 4, activation = "softmax" }]
[data]
path = "synth.h5"
batch_size = 32
[optimizer]
algorithm = "sgd"
learning_rate = 0.05
[cluster]
partitions = 2
[run]
max_steps = 0
max_seconds = 60
eval_every_seconds = 0.5
progress_every_seconds = 0.5
threads = 1
heartbeat_timeout_seconds = 5
"""


@pytest.mark.nodes  # the partitions on two simulated nodes: found by heartbeat, not /proc
@pytest.mark.parametrize("every", [0, 100], ids=["between-checkpoints", "in-a-checkpoint"])
@pytest.mark.matrix
def test_a_lost_partition_of_partitioned_sgd_ends_the_run_with_one_line(
        data_dir: Path, tmp_path: Path, every: int) -> None:
    # One replica over 2 ranks cannot go on without one: rank 1 dies after step 200, rank 0
    # finds it gone in its next wait on it (the step's exchange, or with checkpoints every
    # 100 steps the Gatherv of step 200's checkpoint) and aborts the job with one line.
    # Nothing is left half written: no summary, metrics.jsonl whole lines only, and only
    # committed checkpoints, from which a rerun resumes.
    (data_dir / "sgd.toml").write_text(SGD)
    out = tmp_path / "out"
    t0 = time.monotonic()
    env = {**job_env(), FAULTS: "kill:1:200"}
    sets = ["--set", f'run.out_dir="{out}"', "--set", f"run.checkpoint_every_steps={every}"]
    proc = run_mpi(2, [PROGRAM, "train", data_dir / "sgd.toml", *sets], timeout=TIMEOUT,
                   env=env, launcher_options=survive_a_death())
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0 and elapsed < 40, (proc.returncode, elapsed)
    lines = [line for line in proc.stderr.splitlines() if "is gone while" in line]
    assert len(lines) == 1 and "rank 1 (partition 1) is gone" in lines[0], proc.stderr[-3000:]
    assert "Run the same command again" in lines[0]
    assert not (out / "summary.json").exists()
    assert read_metrics(out / "metrics.jsonl")  # whole lines, readable
    assert not list(out.glob("**/*.partial*"))
    saved = [step for step, _ in ckpt.list_checkpoints(ckpt.checkpoint_root(out))]
    assert saved == ([100] if every else []), saved
    if every:
        proc = run_mpi(2, [PROGRAM, "train", data_dir / "sgd.toml", *sets, "--set",
                           "run.max_seconds=0", "--set", "run.max_steps=150"],
                       timeout=TIMEOUT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "at step 100," in proc.stdout


def sigusr1_after_a_death(data_dir: Path, out: Path, logged: tuple[str, ...],
                          then_wait_s: float = 0.0) -> tuple[str, str]:
    """Run Sandblaster (1 shard, coordinator, 3 replicas) where replica 1 (rank 3) dies
    after its unit 60; once metrics.jsonl holds every string of `logged`, wait
    `then_wait_s` and send SIGUSR1 to the launcher. Returns its (stdout, stderr)."""
    cmd = [*mpiexec(5, *survive_a_death()), sys.executable, str(PROGRAM), "train",
           str(data_dir / "sb.toml"), "--set", f'run.out_dir="{out}"', "--set",
           "run.max_steps=0", "--set", "run.max_seconds=90", "--set",
           "optimizer.gradient_tolerance=0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**job_env(), FAULTS: "kill:3:60"}, start_new_session=True)
    metrics = out / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (
                metrics.is_file() and all(x in metrics.read_text() for x in logged)):
            time.sleep(0.05)
        time.sleep(then_wait_s)
        os.kill(proc.pid, signal.SIGUSR1)
        return proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def test_hydras_notice_of_a_death_goes_on_and_a_real_sigusr1_later_stops(
        data_dir: Path, tmp_path: Path) -> None:
    # Replica 1 (rank 3) dies after its unit 60: hydra (-disable-auto-cleanup) sends every
    # rank SIGUSR1, which the coordinator takes for the notice of the death it found.
    # Later, once iteration 15 is logged, a SIGUSR1 to mpiexec is a stop request. (One
    # within NOTICE_SLACK_S of the death being found is taken for hydra's notice by design,
    # and was, once, when iteration 15 came that soon after it: hence the wait.)
    out = tmp_path / "out"
    stdout, stderr = sigusr1_after_a_death(data_dir, out, ('"step": 15,', '"replica_lost"'),
                                           then_wait_s=NOTICE_SLACK_S + 1.0)
    assert "SIGUSR1 taken as the launcher's notice" in stdout, stdout + stderr[-3000:]
    summary = summary_of(out)
    assert summary["stop_reason"] == "SIGUSR1", summary["stop_reason"]
    assert [x["replica"] for x in summary["lost_replicas"]] == [1]
    assert summary["iterations"] >= 15  # stopped by the SIGUSR1 sent after iteration 15


@pytest.mark.both_mpis
def test_without_hydra_a_sigusr1_right_after_a_death_stops_the_run(
        data_dir: Path, tmp_path: Path) -> None:
    # Open MPI's mpirun (like srun) sends no notice when a rank dies, so a SIGUSR1 just
    # after a death is a stop request there (runtime.launching.launcher.sends_death_notices); under
    # hydra the same signal would be taken for its notice (the test above).
    if mpi_under_test() != "openmpi":
        pytest.skip("hydra sends notices of a death; this is the launcher that does not")
    out = tmp_path / "out"
    stdout, stderr = sigusr1_after_a_death(data_dir, out, ('"replica_lost"',))
    assert "taken as the launcher's notice" not in stdout, stdout + stderr[-3000:]
    summary = summary_of(out)
    assert summary["stop_reason"] == "SIGUSR1", summary["stop_reason"]
    assert [x["replica"] for x in summary["lost_replicas"]] == [1]
