"""Sandblaster L-BFGS with model-parallel replicas (`cluster.partitions = P > 1`), as MPI
jobs under timeouts: the assembled batch gradient against the single-process one (dense,
locally connected and mixed networks, P = 2 and 3, balanced and unequal blocks, with a
slowed partition so that backups fire and its whole replica drops), convergence on a
convex problem, the coordinator's bytes, idle ranks sleeping, and the command line with a
checkpoint and a resume onto another partition count."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from helpers import finished, set_args
from helpers.mpi_jobs import job_env, run_mpi
from helpers.sandblaster import (
    PROGRAMS,
    SOFTMAX,
    TIMEOUT,
    network_for,
    scipy_optimum,
    shard_bytes_per_iteration,
    toml,
    train,
    training_set,
    write,
)

from distbelief.algorithms.sandblaster.plan import RELAY_FANOUT
from distbelief.algorithms.sandblaster.replica import answer_slots
from distbelief.algorithms.sandblaster.roles import (
    BatchRows,
    decode_answer,
    encode_answer,
    shard_segments,
)
from distbelief.data.converters import make_synthetic
from distbelief.data.hdf5 import bytes_read, open_dataset
from distbelief.model.network import Network
from distbelief.model.partition import split_units
from distbelief.runtime.launching.faults import ENV as FAULTS

IMAGE = (10, 10, 1)
CLASSES = 4
NETWORKS = {
    "dense": [{"type": "dense", "units": 13, "activation": "relu"},
              {"type": "dense", "units": CLASSES, "activation": "softmax"}],
    # 10x10 -> 8x8x4 -> 3x3x3 (stride 2) -> 1x1x4: every layer locally connected.
    "local": [{"type": "local", "kernel": 3, "channels": 4, "activation": "relu"},
              {"type": "local", "kernel": 3, "stride": 2, "channels": 3, "activation": "relu"},
              {"type": "local", "kernel": 3, "channels": CLASSES, "activation": "softmax"}],
    "mixed": [{"type": "local", "kernel": 3, "channels": 4, "activation": "relu"},
              {"type": "local", "kernel": 3, "channels": 2, "activation": "tanh"},
              {"type": "dense", "units": 16, "activation": "relu"},
              {"type": "dense", "units": CLASSES, "activation": "softmax"}],
    # The paper's image stage: 10x10 -> 8x8x4 -> L2 pool 4x4x4 -> lcn -> softmax.
    "image": [{"type": "local", "kernel": 3, "channels": 4, "activation": "relu"},
              {"type": "pool", "mode": "l2", "kernel": 2},
              {"type": "lcn", "kernel": 3},
              {"type": "dense", "units": CLASSES, "activation": "softmax"}],
}


def inline_tables(layers: list[dict]) -> str:
    """A TOML list of inline tables."""
    def value(v: object) -> str:
        return f'"{v}"' if isinstance(v, str) else str(v)
    return "[" + ", ".join("{ " + ", ".join(f"{k} = {value(v)}" for k, v in layer.items())
                           + " }" for layer in layers) + "]"


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sandblaster_partitions")
    make_synthetic(folder / "img.h5", n_train=1200, n_test=300, input_shape=IMAGE,
                   num_classes=CLASSES, seed=4)
    return folder


@pytest.fixture(scope="module")
def flat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """test_sandblaster's convex problem (16 features, 4 classes)."""
    folder = tmp_path_factory.mktemp("sandblaster_partitions_flat")
    make_synthetic(folder / "synth.h5", n_train=3000, n_test=500, input_shape=(16,),
                   num_classes=4, seed=3)
    return folder


def skewed_splits(layers: list[dict], partitions: int) -> list[list[int]]:
    """Unequal blocks (weights 1, 2, .. rotated by the layer index), some maybe empty, as
    tests/mpi_programs/mp_gradients.py makes them."""
    net = Network(IMAGE, layers, CLASSES)
    splits = []
    for i, layer in enumerate(net.layers):
        units = split_units(layer)
        weights = np.roll(np.arange(1, partitions + 1), i)
        sizes = np.floor(units * weights / weights.sum()).astype(int)
        sizes[int(np.argmax(weights))] += units - sizes.sum()
        splits.append([0, *np.cumsum(sizes).tolist()])
    return splits


def lockstep_checks(summary: dict, replicas: int, partitions: int) -> None:
    """Every partition of a replica did the same units, pushes, fetches and drops, and every
    shard got a push of every commit from every partition that owns part of its range."""
    entries = summary["replicas"]
    assert [(r["replica"], r["partition"]) for r in entries] == [
        (r, p) for r in range(replicas) for p in range(partitions)]
    for r in range(replicas):
        mine = [e for e in entries if e["replica"] == r]
        for key in ("units", "examples", "pushes", "fetches", "abandoned", "evaluations",
                    "units_committed"):
            assert len({e[key] for e in mine}) == 1, (key, mine)
    for shard in summary["shards"]:
        assert shard["pushes"] == sum(e["pushes"] for e in entries
                                      if e["partition"] in shard["owners"]), shard


# -- pure pieces ------------------------------------------------------------------------------


def test_shard_segments_cut_pieces_at_shard_boundaries_in_order() -> None:
    pieces = [(0, 5), (8, 12), (20, 21)]
    ranges = [(0, 3), (3, 10), (10, 21)]
    segments = shard_segments(pieces, ranges)
    assert segments == [[(0, 3)], [(3, 5), (8, 10)], [(10, 12), (20, 21)]]
    # Shard after shard they are the pieces back to back (a partition's own vector).
    flat = [i for segs in segments for a, b in segs for i in range(a, b)]
    assert flat == [i for a, b in pieces for i in range(a, b)]


@pytest.mark.parametrize("answer", [
    ("hold", None), ("commit", None), ("drop", ("stop", 0, 0, 0)), ("drop", ("stop", 1, 1, 0)),
    ("commit", ("evaluate", 7)),
    ("hold", ("units", 12, 3, 41)), ("commit", ("units", 12, 3, 41, 40, 7, 2))])
def test_answers_survive_the_broadcast_encoding(answer: tuple) -> None:
    encoded = encode_answer(*answer, np.zeros(answer_slots(4), dtype=np.int64))
    assert decode_answer(encoded.copy()) == answer


# (network, partitions, shards, replicas, blocks, slowed (replica, partition) or None)
GRADIENT_CASES = [
    ("dense", 2, 2, 2, "balanced", (0, 1)),
    ("local", 3, 2, 1, "skewed", None),
    ("image", 2, 1, 1, "skewed", None),
    ("mixed", 3, 1, 2, "skewed", (1, 0)),
    ("mixed", 2, 3, 2, "skewed", (0, 0)),
]


@pytest.mark.parametrize("name,partitions,shards,replicas,blocks,slowed", GRADIENT_CASES)
@pytest.mark.matrix
def test_partitioned_gradient_equals_the_single_process_gradient(
        image_dir: Path, tmp_path: Path, name: str, partitions: int, shards: int,
        replicas: int, blocks: str, slowed: tuple[int, int] | None) -> None:
    """One gradient evaluation over the whole set in units of 70 (the last one shorter).
    With one partition of a replica 30x slower per unit its whole replica is slow: backups
    fire, and the duplicates it reports must be dropped by all of its partitions (a
    partition that pushed a dropped sum would double its pieces of the gradient, and the
    shards would count its units twice and stop with a protocol error)."""
    layers = NETWORKS[name]
    config = write(tmp_path, "c.toml",
                   toml(inline_tables(layers), 100000, work_unit_size=70,
                        push_every_units=2).replace(
                       'path = "synth.h5"', f'path = "{image_dir / "img.h5"}"').replace(
                       "ps_shards = 1", f"ps_shards = {shards}\npartitions = {partitions}")
                   .replace("[run]", f'[run]\nout_dir = "{tmp_path / "out"}"'))
    splits = skewed_splits(layers, partitions) if blocks == "skewed" else None
    env = None
    if slowed is not None:
        rank = shards + 1 + slowed[0] * partitions + slowed[1]
        env = {**job_env(), FAULTS: f"delay:{rank}:0:30x"}
    out = tmp_path / "g.npz"
    proc = run_mpi(shards + 1 + replicas * partitions,
                   [PROGRAMS / "sandblaster_gradient.py", config, out, 0, json.dumps(splits)],
                   timeout=TIMEOUT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assembled = np.load(out)["gradient"]

    net = Network(IMAGE, layers, CLASSES)
    x, y = training_set(image_dir / "img.h5")
    rows = BatchRows(len(y), len(y), 0).rows(0)
    grad = np.zeros(net.layout.size, dtype=np.float32)
    loss = net.loss_and_grad(net.init_params(0), x[rows], y[rows], grad)
    np.testing.assert_allclose(assembled, grad, rtol=2e-4, atol=2e-6 * np.abs(grad).max())
    assert summary["final_loss"] == pytest.approx(loss, rel=1e-5)
    assert summary["partitions"] == partitions
    assert summary["units_issued"] - summary["backup_units_issued"] == -(-len(rows) // 70)
    lockstep_checks(summary, replicas, partitions)
    if slowed is not None:
        assert summary["backup_units_issued"] > 0
        assert summary["backup_units_discarded"] > 0
        slow = [e for e in summary["replicas"] if e["replica"] == slowed[0]]
        fast = [e for e in summary["replicas"] if e["replica"] != slowed[0]]
        assert slow[0]["units_committed"] < fast[0]["units_committed"]


@pytest.mark.parametrize("n,shards,partitions", [(5, 2, 2), (8, 1, 3), (9, 2, 2)])
@pytest.mark.matrix
def test_partitioned_convex_problem_converges_to_scipys_loss(
        flat_dir: Path, tmp_path: Path, n: int, shards: int, partitions: int) -> None:
    """Softmax regression, its 4 classes split 2/2 (1 replica, 2 shards; 3 replicas, 2
    shards: replica 2 gets trial points from replica 0, partition by partition) or 2/1/1
    (2 replicas, 1 shard): the same optimum as scipy's L-BFGS-B, as without partitions.
    Units of 1000 examples: every unit costs the partitions a few synchronisations, which
    on 2 oversubscribed cores cost milliseconds each, far more than these units' compute."""
    config = write(flat_dir, "convex.toml", toml(gradient_tolerance=1e-5, work_unit_size=1000))
    proc = train(n, config, tmp_path / "out", f"cluster.ps_shards={shards}",
                 f"cluster.partitions={partitions}", "run.max_steps=150")
    summary, metrics = finished(proc, tmp_path / "out")
    net = network_for(flat_dir / "synth.h5", [{"type": "dense", "units": 4,
                                               "activation": "softmax"}])
    x, y = training_set(flat_dir / "synth.h5")
    assert summary["final_loss"] == pytest.approx(scipy_optimum(net, x, y), abs=5e-5)
    assert summary["stop_reason"] in ("max_steps", "converged", "line_search_failed")
    replicas = (n - shards - 1) // partitions
    assert summary["num_replicas"] == replicas and summary["partitions"] == partitions
    lines = [m for m in metrics if m["kind"] == "train"]
    for m in lines:  # per replica, as without partitions
        assert len(m["units_per_replica"]) == replicas
        assert sum(m["units_per_replica"]) == 3 * len(m["evaluation_seconds"])
    evals = [m for m in metrics if m["kind"] == "eval"]
    assert evals and evals[-1]["step"] == summary["iterations"]
    assert summary["final_test_accuracy"] > 0.6
    if replicas > RELAY_FANOUT:  # every partition of replica 2 relayed by replica 0's
        entries = summary["replicas"]
        assert all(e["relayed"] > 0 for e in entries if e["replica"] == 0), entries
        assert all(e["shard_fetches"] == e["evaluations"] and e["units"] > 0
                   for e in entries if e["replica"] == 2), entries


def test_partition_zero_reads_the_replicas_rows_for_its_partners(flat_dir: Path,
                                                                 tmp_path: Path) -> None:
    """Data by role (issue 32): 2 replicas x 2 partitions; partition 0 of each replica
    reads its block of rows (half the set) and broadcasts it to partition 1, which reads
    from the file only its part of the labels, the rows of units it takes over and
    the evaluation set if it evaluated."""
    config = write(flat_dir, "roles.toml", toml(work_unit_size=100))
    proc = train(6, config, tmp_path / "out", "cluster.partitions=2", "run.max_steps=4",
                 "run.eval_every_seconds=100")
    summary, _ = finished(proc, tmp_path / "out")
    labels = {}  # each rank's part of the labels the 6 ranks check together at start
    for rank in range(6):
        before = bytes_read()
        info = open_dataset(flat_dir / "synth.h5", part=(rank, 6))
        labels[rank] = bytes_read() - before
    row = int(np.prod(info.input_shape)) * np.dtype(info.stored_dtype).itemsize + 4
    entries = summary["replicas"]
    assert sorted((r["replica"], r["partition"]) for r in entries) == [(0, 0), (0, 1),
                                                                       (1, 0), (1, 1)]
    for r in entries:
        assert r["own_rows"] == 1500
        evaluated = info.n_test * row if r["evaluations"] else 0
        own = r["own_rows"] * row if r["partition"] == 0 else 0
        assert r["data_bytes_read"] == (labels[r["rank"]] + own + r["foreign_bytes"]
                                        + evaluated), r


def test_coordinator_traffic_with_partitions_is_still_o_of_m(flat_dir: Path,
                                                             tmp_path: Path) -> None:
    """Partitions change nothing the coordinator sees: the same bytes per iteration as one
    rank per replica, growing with m, far below one vector; replicas' bytes are units and
    decisions (partition 0's), never gradients."""
    big = ('[{ type = "dense", units = 256, activation = "relu" }, '
           '{ type = "dense", units = 4, activation = "softmax" }]')
    runs = {}
    for name, layers, m, partitions in [("p1_m3", big, 3, 1), ("p2_m3", big, 3, 2),
                                        ("p2_m12", big, 12, 2), ("small", SOFTMAX, 3, 2)]:
        config = write(flat_dir, f"bytes_{name}.toml", toml(layers, m=m, work_unit_size=500))
        proc = train(3 + partitions, config, tmp_path / name, "run.max_steps=12",
                     "cluster.ps_shards=2", f"cluster.partitions={partitions}",
                     "run.eval_every_seconds=100")
        summary, metrics = finished(proc, tmp_path / name)
        runs[name] = (summary, max(shard_bytes_per_iteration(metrics)))
    params = runs["p2_m3"][0]["num_params"]
    p1, p2, p2_m12 = (runs[k][1] for k in ("p1_m3", "p2_m3", "p2_m12"))
    assert abs(p2 - p1) <= 0.05 * p1
    assert abs(runs["small"][1] - p2) <= 0.05 * p2  # 68 or 5,000 parameters: the same
    assert p2 < p2_m12 < 4 * p2 and p2_m12 < params * 4 / 2
    replica_p1 = runs["p1_m3"][0]["coordinator_traffic"]["replica_bytes"]
    replica_p2 = runs["p2_m3"][0]["coordinator_traffic"]["replica_bytes"]
    assert replica_p2 < 2 * replica_p1


def test_idle_partitions_sleep_instead_of_spinning(flat_dir: Path, tmp_path: Path) -> None:
    """After one gradient the coordinator waits 3 s: parked partition 0s wait for the
    coordinator, their partners for partition 0's broadcast; all must sleep."""
    config = write(tmp_path, "c.toml", toml().replace(
        'path = "synth.h5"', f'path = "{flat_dir / "synth.h5"}"').replace(
        "ps_shards = 1", "ps_shards = 1\npartitions = 2").replace(
        "[run]", f'[run]\nout_dir = "{tmp_path / "out"}"'))
    out = tmp_path / "idle.npz"
    proc = run_mpi(6, [PROGRAMS / "sandblaster_gradient.py", config, out, 3.0],
                   timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    usage = np.load(out)
    assert min(usage["wall_seconds"]) >= 3.0
    assert max(usage["cpu_seconds"]) < 0.15 * min(usage["wall_seconds"]), usage["cpu_seconds"]


# -- the command line -------------------------------------------------------------------------


def exit_statuses(proc: subprocess.CompletedProcess) -> list[int]:
    found = sorted((int(r), int(s)) for r, s in re.findall(r"rank (\d+) exit (\d+)", proc.stdout))
    return [status for _, status in found]


@pytest.mark.nodes  # also on simulated nodes (conftest.py: DISTBELIEF_TEST_NODES)
def test_command_line_trains_partitioned_replicas_and_every_rank_exits_0(
        image_dir: Path, tmp_path: Path) -> None:
    """`mpiexec -n 6 python -m distbelief train` with 1 shard, the coordinator and 2
    replicas x 2 partitions of a locally connected network."""
    config = write(image_dir, "local.toml", toml(inline_tables(NETWORKS["local"]), 600,
                                                 work_unit_size=50).replace(
        'path = "synth.h5"', 'path = "img.h5"'))
    out = tmp_path / "out"
    proc = run_mpi(6, [PROGRAMS / "cli_exit_status.py", "train", config,
                       *set_args(f'run.out_dir="{out}"', "cluster.partitions=2",
                             "run.max_steps=6")], timeout=TIMEOUT)
    assert exit_statuses(proc) == [0] * 6, proc.stdout + proc.stderr[-3000:]
    summary, metrics = finished(proc, out)
    assert summary["iterations"] == 6 and summary["stop_reason"] == "max_steps"
    assert "2 replica(s) x 2 partition(s)" in proc.stdout
    lockstep_checks(summary, 2, 2)
    for entry in summary["replicas"]:  # activations (or their gradients) crossed
        traffic = entry["model_parallel"]
        assert sum(traffic["forward"]) + sum(traffic["backward"]) > 0
    lines = [m for m in metrics if m["kind"] == "train"]
    assert lines[-1]["loss"] < lines[0]["loss"]
    assert summary["final_test_accuracy"] is not None


def test_checkpoint_with_partitions_resumes_on_another_partition_count(
        flat_dir: Path, tmp_path: Path) -> None:
    """8 iterations with replicas of 2 partitions (2 shards), then 8 more from the
    checkpoint with replicas of 3 (1 shard), against 16 straight ones without partitions:
    the partitioned gradient is the same sum, so the same steps and losses follow (up to
    the run-to-run noise of summing in arrival order, as in test_sandblaster)."""
    config = write(flat_dir, "resume.toml", toml(m=4, work_unit_size=500))
    half = train(5, config, tmp_path / "resumed", "run.max_steps=8", "cluster.ps_shards=2",
                 "cluster.partitions=2")
    finished(half, tmp_path / "resumed")
    assert (tmp_path / "resumed" / "checkpoints" / f"ckpt-{8:010d}").is_dir()
    rest = train(5, config, tmp_path / "resumed", "run.max_steps=16", "cluster.partitions=3")
    summary, metrics = finished(rest, tmp_path / "resumed")
    assert "resuming from" in rest.stdout
    assert summary["iterations"] == 16 and summary["partitions"] == 3
    _, straight_metrics = finished(
        train(4, config, tmp_path / "straight", "run.max_steps=16"), tmp_path / "straight")
    resumed = {m["step"]: m for m in metrics if m["kind"] == "train"}
    reference = {m["step"]: m for m in straight_metrics if m["kind"] == "train"}
    for step in range(1, 17):
        assert resumed[step]["step_size"] == reference[step]["step_size"]
        assert resumed[step]["loss"] == pytest.approx(reference[step]["loss"], rel=1e-4)
    assert [m["step"] for m in metrics if m["kind"] == "resume"] == [8]
