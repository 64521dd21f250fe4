"""Model parallelism: the partitioning (pure, in-process) and the partitioned network
against the unpartitioned one as MPI jobs at P = 1, 2, 3 and 4 ranks, under timeouts."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import set_args
from helpers.mpi_jobs import REPO, job_env, run_cli, run_mpi

from distbelief.errors import ConfigError
from distbelief.model.cost_model import Link, layer_flops, predict
from distbelief.model.network import Network
from distbelief.model.partition import (
    Partitioning,
    balanced_splits,
    input_window,
    needed_inputs,
    partition_pieces,
    split_units,
)
from distbelief.records import checkpoint as ckpt
from distbelief.records.metrics import read_metrics
from distbelief.runtime.launching.faults import ENV as FAULTS

PROGRAMS = REPO / "tests" / "mpi_programs"
TIMEOUT = 120

LOCAL = [{"type": "local", "kernel": 3, "channels": 4, "activation": "relu"},
         {"type": "local", "kernel": 3, "stride": 2, "channels": 3, "activation": "relu"},
         {"type": "dense", "units": 5, "activation": "softmax"}]


def local_network() -> Network:
    return Network((12, 10, 2), LOCAL, 5)


# -- the partitioning, in-process ---------------------------------------------------------


def test_balanced_splits_differ_by_at_most_one_and_may_be_empty():
    assert balanced_splits(10, 3) == [0, 4, 7, 10]
    assert balanced_splits(2, 4) == [0, 1, 2, 2, 2]


def test_local_layer_needs_only_the_rows_and_columns_its_windows_read():
    layer = local_network().layers[1]  # 10x8x4 in, kernel 3, stride 2 -> 4x3 out
    mask = needed_inputs(layer, 1, 3).reshape(layer.in_shape)
    rows = np.flatnonzero(mask.any(axis=(1, 2)))
    cols = np.flatnonzero(mask.any(axis=(0, 2)))
    assert rows.tolist() == [2, 3, 4, 5, 6]       # output rows 1, 2: input rows 2..6
    assert cols.tolist() == [0, 1, 2, 3, 4, 5, 6]  # column 7 is read by no window
    assert mask[rows][:, cols].all()
    row = 8 * 4
    assert input_window(layer, 1, 3) == (2 * row, 7 * row)
    assert not needed_inputs(layer, 2, 2).any()


def test_dense_layer_needs_every_input():
    layer = local_network().layers[2]
    assert needed_inputs(layer, 0, 1).all()


def test_messages_send_what_the_peer_receives_and_pieces_tile_the_vector():
    net = local_network()
    plan = Partitioning(net.layers, net.layout, 3)
    for i in range(1, len(net.layers)):
        for p in range(3):
            for m in plan.part(i, p).recv:
                sent = [s for s in plan.part(i, m.peer).send if s.peer == p]
                assert len(sent) == 1 and np.array_equal(sent[0].indices, m.indices)
    covered = np.zeros(net.layout.size, dtype=int)
    for p in range(3):
        for a, b in plan.pieces(p):
            covered[a:b] += 1
    assert (covered == 1).all()


@pytest.mark.parametrize("parts, splits", [
    (2, None), (3, None), (4, None), (3, [[0, 1, 3, 10], [0, 0, 1, 4], [0, 2, 5, 5]])])
def test_partition_pieces_are_partitionings_without_messages(parts, splits):
    # What a Sandblaster shard computes to know who pushes what into its range.
    net = local_network()
    plan = Partitioning(net.layers, net.layout, parts, splits)
    pieces = partition_pieces(net.layers, net.layout, parts, splits)
    assert pieces == [plan.pieces(p) for p in range(parts)]
    for own in pieces:  # ascending and disjoint: a partition's own-size vector in order
        assert all(a < b <= c for (a, b), (c, _) in zip(own, [*own[1:], (net.layout.size, 0)]))


def test_partition_owning_nothing_is_a_config_error():
    net = local_network()  # widest layer: 10 rows
    with pytest.raises(ConfigError, match="partition.*would own no units.*at most 10"):
        Partitioning(net.layers, net.layout, 11)


@pytest.mark.parametrize("splits, needle", [
    ([[0, 10], [0, 4], [0, 5]], "needs 3 non-decreasing boundaries"),
    ([[0, 6, 10], [0, 3, 2], [0, 2, 5]], "layer 1 needs 3 non-decreasing"),
    ([[0, 6, 10], [0, 2, 4]], "one list of boundaries per layer"),
])
def test_bad_splits_are_config_errors(splits, needle):
    net = local_network()
    with pytest.raises(ConfigError, match=needle):
        Partitioning(net.layers, net.layout, 2, splits)


# -- against the unpartitioned network, under MPI -----------------------------------------


@pytest.mark.both_mpis  # Open MPI once summed a freed buffer in the softmax's Iallreduce
@pytest.mark.parametrize("partitions", [1, 2, 3, 4])
def test_partitioned_loss_gradients_and_bytes_match(partitions):
    """Loss, gradient (own-size and whole-model vectors), evaluation equal the Network's;
    bytes per layer and direction == cut edges x batch x 4 (counted from the geometry in
    the program); dense, local, mixed and image (local, pool, lcn) networks, balanced,
    skewed and one-owner blocks; max pooling over ties ("image-ties"); and one batch of
    600 rows, where Open MPI reads a nonblocking collective's send buffer late."""
    proc = run_mpi(partitions, ["-m", "mpi4py", PROGRAMS / "mp_gradients.py"],
                   timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("OK ")]
    cases = {tuple(line.split()[1:3]) for line in lines}
    nets = ("dense", "local", "mixed", "image", "image-first", "image-ties")
    expected = {(net, "balanced") for net in nets}
    if partitions > 1:
        expected |= {(net, "one-owner") for net in nets}
        expected |= {(net, "skewed0") for net in nets}
    assert expected <= cases, lines
    assert "OK dense large-batch" in proc.stdout
    if partitions > 1:  # something really crossed
        assert any(int(b) > 0 for line in lines if "bytes/step" in line
                   for b in line.split("bytes/step")[1].strip(" []").split(","))


# -- training through the command line ----------------------------------------------------

TOML = """
[model]
layers = [
    { type = "local", kernel = 3, channels = 4, activation = "relu" },
    { type = "local", kernel = 3, stride = 2, channels = 4, activation = "relu" },
    { type = "dense", units = 4, activation = "softmax" },
]
[data]
path = "synth.h5"
batch_size = 32
[optimizer]
algorithm = "sgd"
learning_rate = 0.05
[run]
max_steps = 100
eval_every_seconds = 0.5
progress_every_seconds = 0.5
threads = 1
"""


@pytest.fixture(scope="module")
def data_dir(synthetic_folder) -> Path:
    return synthetic_folder("model_parallel", {"local.toml": TOML}, input_shape=(12, 12, 1))


def train_args(data_dir: Path, out: Path, *overrides: str) -> list:
    return ["train", data_dir / "local.toml", *set_args(f'run.out_dir="{out}"', *overrides)]


def finished(proc: subprocess.CompletedProcess, out: Path) -> dict:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def single_process(data_dir: Path) -> dict:
    """The unpartitioned single-process run every partitioned one is compared with."""
    out = data_dir / "single"
    return finished(run_cli(train_args(data_dir, out), timeout=TIMEOUT), out)


@pytest.mark.both_mpis
@pytest.mark.nodes  # also on simulated nodes (conftest.py: DISTBELIEF_TEST_NODES)
@pytest.mark.parametrize("partitions", [2, 3])
@pytest.mark.matrix
def test_partitioned_sgd_trains_like_the_single_process_trainer(data_dir, tmp_path,
                                                                 single_process, partitions):
    out = tmp_path / "out"
    proc = run_mpi(partitions, ["-m", "distbelief", *train_args(
        data_dir, out, f"cluster.partitions={partitions}")], timeout=TIMEOUT)
    summary = finished(proc, out)
    assert summary["steps"] == single_process["steps"] == 100
    assert summary["final_test_loss"] == pytest.approx(single_process["final_test_loss"],
                                                       rel=1e-5)
    assert summary["final_test_accuracy"] == single_process["final_test_accuracy"]
    traffic = summary["model_parallel"]
    assert traffic["partitions"] == partitions
    # Layer 0 reads the data, which every partition has; the others exchange both ways.
    assert traffic["forward_bytes_per_step"][0] == 0
    assert traffic["forward_bytes_per_step"] == traffic["backward_bytes_per_step"]
    assert all(b > 0 for b in traffic["forward_bytes_per_step"][1:])
    lines = read_metrics(out / "metrics.jsonl")
    marker = [line for line in lines if line["kind"] == "partitions"]
    assert len(marker) == 1
    assert marker[0]["forward_bytes_per_step"] == traffic["forward_bytes_per_step"]


def test_partitioned_sgd_reads_the_data_once_per_replica(data_dir, tmp_path):
    """Data by role (issue 32): partition 0 reads the training rows and the evaluation set
    and sends them to its partners, which read from the file only their part of the labels
    the ranks check together at start; the run trains as the single-process one does (the
    test above)."""
    from distbelief.data.hdf5 import bytes_read, open_dataset

    labels = {}
    for rank in range(3):
        before = bytes_read()
        info = open_dataset(data_dir / "synth.h5", part=(rank, 3))
        labels[rank] = bytes_read() - before
    row = int(np.prod(info.input_shape)) * np.dtype(info.stored_dtype).itemsize + 4
    out = tmp_path / "out"
    proc = run_mpi(3, [PROGRAMS / "rank_bytes_read.py", *train_args(
        data_dir, out, "cluster.partitions=3", "run.max_steps=5")], timeout=TIMEOUT)
    finished(proc, out)
    read = {int(m[1]): int(m[2])
            for m in re.finditer(r"rank (\d+) bytes_read (\d+)", proc.stdout)}
    assert sorted(read) == [0, 1, 2], proc.stdout
    assert (read[1], read[2]) == (labels[1], labels[2])
    assert read[0] >= labels[0] + info.n_train * row


def test_partitioned_sgd_target_stop_names_the_reaching_evaluation(data_dir, tmp_path):
    out = tmp_path / "out"
    proc = run_mpi(3, ["-m", "distbelief", *train_args(
        data_dir, out, "cluster.partitions=3", "run.max_steps=0", "run.max_seconds=60",
        "run.target_accuracy=0.6", "run.eval_every_seconds=0.05")], timeout=TIMEOUT)
    summary = finished(proc, out)
    assert summary["stop_reason"] == "target_accuracy" and summary["reached_target"]
    evals = [x for x in read_metrics(out / "metrics.jsonl") if x["kind"] == "eval"]
    hit = next(x for x in evals if x["test_accuracy"] >= 0.6)
    assert (summary["target_reached_accuracy"], summary["target_reached_step"]) == (
        hit["test_accuracy"], hit["step"])
    line = next(x for x in proc.stdout.splitlines() if x.startswith("distbelief: stopped"))
    assert f"reached 0.6 in {summary['time_to_target']:.1f}s " \
           f"({hit['test_accuracy']:.4f} at step {hit['step']})" in line
    # The partitions gathered the best evaluation's vector for rank 0 (run.keep_best), and
    # `evaluate` scores that model by default, at the figure recorded for it.
    best = summary["best"]
    assert best["accuracy"] == max(x["test_accuracy"] for x in evals)
    scored = run_cli(["evaluate", out, "--json"], timeout=TIMEOUT)
    assert scored.returncode == 0, scored.stderr
    result = json.loads(scored.stdout)
    assert (result["which"], result["step"]) == ("best", best["step"])
    assert result["accuracy"] == pytest.approx(best["accuracy"], abs=1e-9)


@pytest.mark.nodes  # also on simulated nodes (conftest.py: DISTBELIEF_TEST_NODES)
@pytest.mark.parametrize("transport", ["shared", "rma"])
@pytest.mark.parametrize("shards, partitions", [(2, 2), (1, 3)])
@pytest.mark.matrix
def test_downpour_one_partitioned_replica_is_sequential_sgd(data_dir, tmp_path,
                                                            single_process, shards,
                                                            partitions, transport):
    # S shards + 1 replica x P partitions: each partition pulls and pushes only its own
    # pieces (with 2 shards they straddle the shard boundary); with read-your-writes that
    # is exactly the single-process run. On RMA the partitions' pushes land in slots of
    # their own that a shard's fold sums (a slot must not keep another's values).
    out = tmp_path / "out"
    proc = run_mpi(shards + partitions, ["-m", "distbelief", *train_args(
        data_dir, out, 'optimizer.algorithm="downpour"', f"cluster.ps_shards={shards}",
        f"cluster.partitions={partitions}")], timeout=TIMEOUT,
        env={**job_env(), "DISTBELIEF_PS_TRANSPORT": transport})
    summary = finished(proc, out)
    assert summary["steps"] == 100
    assert summary["final_test_loss"] == pytest.approx(single_process["final_test_loss"],
                                                       rel=1e-5)
    replicas = summary["replicas"]
    assert [(r["replica"], r["partition"]) for r in replicas] == [
        (0, p) for p in range(partitions)]
    assert [r["steps"] for r in replicas] == [100] * partitions
    for shard in summary["shards"]:  # every push of both partitions reached both shards
        assert shard["pushes"] == sum(r["pushes"] for r in replicas)


# The target is 0.5: the first evaluations see 0.24-0.34, and 13 runs (both MPIs) reached
# 0.5 by step 314-821. It was 0.6, this setup's peak: test accuracy tops out at 0.58-0.66
# around steps 1,600-3,700, then the 4,000 training samples are overfitted (test loss 1.32
# after 40,000 steps), so a run whose evaluations missed the peak never got there. That
# was the Open MPI failure in CI (39,875 steps, test loss 1.40): a trained, overfitted
# model, not an untrained one (the initial test loss is 1.64 at accuracy 0.25).
@pytest.mark.both_mpis
@pytest.mark.nodes  # also on simulated nodes (conftest.py: DISTBELIEF_TEST_NODES)
def test_downpour_two_replicas_of_two_partitions_reach_the_target(data_dir, tmp_path):
    out = tmp_path / "out"
    proc = run_mpi(5, ["-m", "distbelief", *train_args(
        data_dir, out, 'optimizer.algorithm="downpour"', "cluster.partitions=2",
        "run.max_steps=0", "run.max_seconds=60", "run.target_accuracy=0.5",
        "run.eval_every_seconds=0.2")], timeout=TIMEOUT)
    summary = finished(proc, out)
    assert summary["stop_reason"] == "target_accuracy" and summary["reached_target"]
    replicas = summary["replicas"]
    assert sorted((r["replica"], r["partition"]) for r in replicas) == [
        (0, 0), (0, 1), (1, 0), (1, 1)]
    for replica in (0, 1):  # the partitions of a replica take the same steps
        steps = {r["steps"] for r in replicas if r["replica"] == replica}
        assert len(steps) == 1 and steps.pop() > 0
    assert sum(r["steps"] for r in replicas if r["partition"] == 0) == summary["steps"]
    for r in replicas:
        assert sum(r["model_parallel"]["forward"]) > 0
    # Every partition's pushes reached the shard the evaluations read.
    assert summary["shards"][0]["pushes"] == sum(r["pushes"] for r in replicas)
    # Partition 0 read its replica's rows and sent them to partition 1, which read from
    # the file only its part of the labels the ranks check at start (data by role).
    from distbelief.data.hdf5 import bytes_read, open_dataset

    control = {c["rank"]: c for c in summary["control_plane"]}
    for r in replicas:
        before = bytes_read()
        open_dataset(data_dir / "synth.h5", part=(r["rank"], 5))
        labels = bytes_read() - before
        read = control[r["rank"]]["data_bytes_read"]
        assert read == labels if r["partition"] == 1 else read > 10 * labels, (r, read)


def exit_statuses(proc: subprocess.CompletedProcess) -> list[int]:
    found = sorted((int(r), int(s)) for r, s in re.findall(r"rank (\d+) exit (\d+)", proc.stdout))
    return [status for _, status in found]


@pytest.mark.parametrize("n, overrides, needle", [
    (3, ["cluster.partitions=2"], "exactly 2 MPI ranks, but 3 were started"),
    (2, ["cluster.partitions=11"], "cluster.partitions = 11: partition(s) [10]"),
    (4, ['optimizer.algorithm="downpour"', "cluster.partitions=2"],
     "not a multiple of partitions=2"),
])
def test_partitions_that_do_not_fit_exit_2_on_every_rank(data_dir, tmp_path, n, overrides,
                                                          needle):
    out = tmp_path / "out"
    proc = run_mpi(n, [PROGRAMS / "cli_exit_status.py", *train_args(data_dir, out,
                                                                     *overrides)],
                   timeout=TIMEOUT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert exit_statuses(proc) == [2] * n, proc.stdout
    errors = [line for line in proc.stderr.splitlines() if "distbelief: error:" in line]
    assert len(errors) == 1 and needle in errors[0], proc.stderr
    assert not out.exists(), "nothing is written before the checks pass"


# -- the cost model -----------------------------------------------------------------------


def test_cost_model_one_partition_is_pure_compute():
    net = local_network()
    p = predict(net, 1, 32, 1e9, Link(1e9, 1e-6))
    assert p.speedup == 1.0 and p.communication_seconds == 0 and p.bytes_per_step == 0
    flops = sum(layer_flops(layer, 0, split_units(layer), 32, i == 0)
                for i, layer in enumerate(net.layers))
    assert p.step_seconds == pytest.approx(flops / 1e9)


def test_cost_model_hand_computed_two_partitions():
    # One dense layer 8 -> 4: each partition 2 units, forward + weight gradient only
    # (2 passes x 2 flops x N x 8 inputs x 2 units); no activations cross, but the loss
    # takes 3 Allreduces of 2 rounds each at P = 2.
    net = Network((8,), [{"type": "dense", "units": 4, "activation": "softmax"}], 4)
    n, flops, link = 10, 1e6, Link(1e5, 1e-3)
    p = predict(net, 2, n, flops, link)
    compute = 2 * 2 * n * 8 * 2 / flops
    comm = 3 * 2 * (link.latency + n * 4 / link.bandwidth)
    assert p.step_seconds == pytest.approx(compute + comm)
    assert p.compute_seconds == pytest.approx(compute)
    assert p.speedup == pytest.approx(2 * compute / (compute + comm))


def test_cost_model_bytes_match_the_partitioning():
    net = local_network()
    for parts in (2, 3, 4):
        plan = Partitioning(net.layers, net.layout, parts)
        values = sum(plan.exchanged_values(i) for i in range(len(net.layers)))
        p = predict(net, parts, 16, 1e9, Link(1e9, 0.0))
        assert p.bytes_per_step == 2 * values * 16 * 4 + 3 * parts * 16 * 4


def test_cost_model_free_links_give_linear_speedup_and_slow_links_less():
    net = Network((16,), [{"type": "dense", "units": 32, "activation": "relu"},
                          {"type": "dense", "units": 8, "activation": "softmax"}], 8)
    free = predict(net, 4, 64, 1e9, Link(1e30, 0.0))
    assert free.speedup == pytest.approx(4.0)
    speedups = [predict(net, 4, 64, 1e9, Link(bw, 1e-5)).speedup for bw in (1e10, 1e8, 1e6)]
    assert speedups == sorted(speedups, reverse=True) and speedups[-1] < 1


def test_costmodel_command_prints_one_row_per_partition_count(data_dir):
    proc = run_cli(["costmodel", data_dir / "local.toml", "--partitions", "1,2,5",
                    "--gflops", "5", "--bandwidth", "10", "--latency", "2"], timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()
            if line.strip() and line.split()[0].isdigit()]
    assert [row[0] for row in rows] == ["1", "2", "5"]
    assert rows[0][-1] == "1.00x" and float(rows[1][-1].rstrip("x")) > 1
    assert "5 GFLOP/s, link 10 GB/s, 2 us" in proc.stdout


@pytest.mark.parametrize("args, needle", [
    (["--partitions", "1,11"], "11 partitions: the widest layer splits into at most 10"),
    (["--input-shape", "12,12,1"], "give --input-shape and --classes together"),
])
def test_costmodel_command_errors_are_one_line(data_dir, args, needle):
    proc = run_cli(["costmodel", data_dir / "local.toml", *args], timeout=TIMEOUT)
    assert proc.returncode == 2
    assert proc.stderr.count("distbelief: error:") == 1 and needle in proc.stderr


def test_costmodel_command_without_data_file():
    proc = run_cli(["costmodel", REPO / "configs" / "paper_speech_42m.toml",
                    "--input-shape", "440", "--classes", "8192", "--partitions", "1,8"],
                   timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    assert "41,777,152 parameters" in proc.stdout


@pytest.mark.both_mpis
@pytest.mark.nodes  # also on simulated nodes (conftest.py: DISTBELIEF_TEST_NODES)
@pytest.mark.parametrize("fetch, transport", [("own_pushes", None), ("overlapped", "rma")])
@pytest.mark.matrix
def test_downpour_partitioned_replicas_checkpoint_and_resume(data_dir, tmp_path, fetch,
                                                             transport):
    # Agreement rounds and checkpoints with replicas of 2 partitions: the partitions act on
    # a round together (else a checkpoint barrier would wait on a partition that waits for
    # activations), partition 0 writes the replica's part; a second job resumes. Overlapped,
    # each partition's push is still in flight when the lead pauses for a checkpoint.
    out = tmp_path / "out"
    common = ['optimizer.algorithm="downpour"', "cluster.partitions=2",
              "run.checkpoint_every_steps=40", f'optimizer.fetch="{fetch}"']
    env = None if transport is None else {**job_env(), "DISTBELIEF_PS_TRANSPORT": transport}
    first = finished(run_mpi(5, ["-m", "distbelief", *train_args(
        data_dir, out, *common, "run.max_steps=120")], timeout=TIMEOUT, env=env), out)
    assert first["steps"] == 120 and first["checkpoint"]
    # Every step's push from both partitions is in each checkpoint's shard counters
    # (overlapped: completed by both before the lead acked the pause).
    steps_and_pushes = [
        (int(d.name.split("-")[-1]),
         int(h5py.File(d / "shard-0000.h5", "r")["counters"].attrs["pushes"]))
        for d in sorted((out / "checkpoints").glob("ckpt-*"))]
    assert len(steps_and_pushes) >= 2
    assert all(pushes == 2 * step for step, pushes in steps_and_pushes), steps_and_pushes
    inspect = run_cli(["inspect", out], timeout=TIMEOUT)
    assert inspect.returncode == 0, inspect.stdout + inspect.stderr
    second = finished(run_mpi(5, ["-m", "distbelief", *train_args(
        data_dir, out, *common, "run.max_steps=200")], timeout=TIMEOUT, env=env), out)
    assert second["resumed_from"] and second["resumed_at_step"] == 120
    assert second["steps"] == 200


def test_partitioned_sgd_divergence_and_resume_exit_2_on_every_rank(data_dir, tmp_path):
    out = tmp_path / "out"
    diverge = run_mpi(2, [PROGRAMS / "cli_exit_status.py", *train_args(
        data_dir, out, "cluster.partitions=2", "optimizer.adagrad=false",
        "optimizer.learning_rate=1e6")], timeout=TIMEOUT)
    assert exit_statuses(diverge) == [2, 2], diverge.stdout + diverge.stderr
    assert "training diverged" in diverge.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "diverged"
    resume = run_mpi(2, [PROGRAMS / "cli_exit_status.py", *train_args(
        data_dir, tmp_path / "other", "cluster.partitions=2"), "--resume"], timeout=TIMEOUT)
    assert exit_statuses(resume) == [2, 2], resume.stdout + resume.stderr
    assert "train --resume: there is no checkpoint in" in resume.stderr


@pytest.mark.both_mpis
@pytest.mark.parametrize("update", ["adagrad", "adam"])
def test_partitioned_sgd_resumes_as_if_never_stopped(data_dir, tmp_path, update):
    # 3 partitions, stopped at step 60 (checkpoint), resumed to 100: the same parameters
    # and optimizer state as one uninterrupted 100-step run, bit for bit.
    sets = ("cluster.partitions=3", f'optimizer.update="{update}"',
            "optimizer.learning_rate=0.01")
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    finished(run_mpi(3, ["-m", "distbelief", *train_args(data_dir, whole, *sets)],
                     timeout=TIMEOUT), whole)
    first = finished(run_mpi(3, ["-m", "distbelief", *train_args(
        data_dir, cut, *sets, "run.max_steps=60")], timeout=TIMEOUT), cut)
    assert first["checkpoint"] and first["steps"] == 60
    proc = run_mpi(3, ["-m", "distbelief", *train_args(data_dir, cut, *sets), "--resume"],
                   timeout=TIMEOUT)
    second = finished(proc, cut)
    assert second["resumed_from"] and "at step 60," in proc.stdout and second["steps"] == 100
    a = ckpt.find_latest(ckpt.checkpoint_root(whole))[0]
    b = ckpt.find_latest(ckpt.checkpoint_root(cut))[0]
    assert a.step == b.step == 100
    (pa, sa), (pb, sb) = a.read_state(), b.read_state()
    assert np.array_equal(pa, pb)
    assert sorted(sa) == sorted(sb) and sa
    for name in sa:
        assert np.array_equal(sa[name], sb[name]), name
    assert second["final_test_accuracy"] == json.loads(
        (whole / "summary.json").read_text())["final_test_accuracy"]


def test_a_partitioned_checkpoint_resumes_at_another_partition_count(data_dir, tmp_path,
                                                                     single_process):
    # A partitioned run's checkpoint holds the whole model, as a one-process run's does: a
    # P = 2 run stopped at step 50 finishes in one process (and the reverse), matching
    # the single-process run to float rounding.
    out = tmp_path / "out"
    finished(run_mpi(2, ["-m", "distbelief", *train_args(
        data_dir, out, "cluster.partitions=2", "run.max_steps=50")], timeout=TIMEOUT), out)
    proc = run_cli(train_args(data_dir, out), timeout=TIMEOUT)
    summary = finished(proc, out)
    assert "at step 50," in proc.stdout and summary["steps"] == 100
    assert summary["final_test_loss"] == pytest.approx(single_process["final_test_loss"],
                                                       rel=1e-4)
    back = tmp_path / "back"
    finished(run_cli(train_args(data_dir, back, "run.max_steps=50"), timeout=TIMEOUT), back)
    proc = run_mpi(3, ["-m", "distbelief", *train_args(data_dir, back, "cluster.partitions=3")],
                   timeout=TIMEOUT)
    summary = finished(proc, back)
    assert "at step 50," in proc.stdout and summary["steps"] == 100
    assert summary["final_test_loss"] == pytest.approx(single_process["final_test_loss"],
                                                       rel=1e-4)


def test_bad_gradients_on_one_partition_stop_the_whole_replica_together(data_dir, tmp_path):
    # Rank 2 is partition 1 of replica 0: only its pieces turn non-finite. Its partner must
    # drop the same steps and stop at the same one, or it would wait for activations that
    # never come (the test's timeout would catch that).
    out = tmp_path / "out"
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env[FAULTS] = "poison:2:30+"
    proc = run_mpi(5, [PROGRAMS / "cli_exit_status.py", *train_args(
        data_dir, out, 'optimizer.algorithm="downpour"', "cluster.partitions=2",
        "run.max_steps=0", "run.max_seconds=60", "run.max_bad_gradients_in_a_row=5")],
        timeout=TIMEOUT, env=env)
    assert exit_statuses(proc) == [2] * 5, proc.stdout + proc.stderr
    assert "replica 0 computed 5 non-finite gradients in a row" in proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "bad_gradients"
    bad = {r["partition"]: r["bad_gradients"] for r in summary["replicas"] if r["replica"] == 0}
    assert bad == {0: 5, 1: 5}
