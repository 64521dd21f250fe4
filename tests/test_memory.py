"""Memory (issue 31): a shard's slice built alone, a resume that reads only its slice, peak
RSS per rank in summary.json, the node's memory from the environment."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import set_args
from helpers.mpi_jobs import run_cli, run_mpi

from distbelief.algorithms.downpour.plan import plan_run
from distbelief.algorithms.downpour.run import Start, shard_initial
from distbelief.config import config_from_dict
from distbelief.errors import ConfigError
from distbelief.model.layout import balanced_ranges
from distbelief.model.network import Network
from distbelief.runtime import memory

NETWORKS = {
    # odd sizes, so slices start at odd stream positions
    "dense": ((7,), [{"type": "dense", "units": 13, "activation": "relu"},
                     {"type": "dense", "units": 5, "activation": "tanh"},
                     {"type": "dense", "units": 3, "activation": "softmax"}], 3),
    "image": ((9, 9, 3), [{"type": "local", "kernel": 3, "channels": 5, "activation": "relu"},
                          {"type": "pool", "mode": "l2", "kernel": 2},
                          {"type": "lcn", "kernel": 3},
                          {"type": "dense", "units": 11, "activation": "sigmoid"},
                          {"type": "dense", "units": 4, "activation": "softmax"}], 4),
}


@pytest.mark.parametrize("name", sorted(NETWORKS))
@pytest.mark.parametrize("seed", [0, 7])
def test_a_slice_built_alone_equals_that_slice_of_the_full_vector(name, seed):
    net = Network(*NETWORKS[name])
    full = net.init_params(seed)
    for shards in (1, 2, 3, 5):
        for start, stop in balanced_ranges(net.layout.size, shards):
            got = net.init_slice(seed, start, stop)
            assert got.dtype == np.float32 and got.shape == (stop - start,)
            assert np.array_equal(got, full[start:stop]), (name, shards, start, stop)
    # Any range, not only balanced ones: every odd and even starting point.
    for start in range(0, net.layout.size, 17):
        stop = min(net.layout.size, start + 29)
        assert np.array_equal(net.init_slice(seed, start, stop), full[start:stop])
    assert not np.array_equal(net.init_slice(seed + 1, 0, 50), full[:50])


def test_init_slice_refuses_a_range_outside_the_vector():
    net = Network(*NETWORKS["dense"])
    with pytest.raises(ValueError, match="outside"):
        net.init_slice(0, 0, net.layout.size + 1)


def _plan(rank: int, shards: int = 2, world: int = 3):
    config = config_from_dict({
        "model": {"layers": [{"type": "dense", "units": 8, "activation": "relu"},
                             {"type": "dense", "units": 3, "activation": "softmax"}]},
        "data": {"path": "unused.h5", "batch_size": 4},
        "optimizer": {"algorithm": "downpour"}, "cluster": {"ps_shards": shards},
        "run": {"out_dir": "unused", "max_steps": 1}})
    return plan_run(config, world, rank, 1000)


def test_a_fresh_shard_builds_only_its_slice(monkeypatch):
    net = Network((5,), [{"type": "dense", "units": 8, "activation": "relu"},
                         {"type": "dense", "units": 3, "activation": "softmax"}], 3)
    full = net.init_params(3)
    monkeypatch.setattr(Network, "init_params", lambda *a: pytest.fail("built it all"))
    for rank in (0, 1):
        start, stop = balanced_ranges(net.layout.size, 2)[rank]
        got = shard_initial(net, 3, _plan(rank), Start())
        assert np.array_equal(got, full[start:stop])


def test_a_resuming_shard_reads_only_its_slice_and_builds_nothing(monkeypatch):
    from distbelief.algorithms.downpour import run as downpour_run

    net = Network((5,), [{"type": "dense", "units": 8, "activation": "relu"},
                         {"type": "dense", "units": 3, "activation": "softmax"}], 3)
    monkeypatch.setattr(Network, "init_params", lambda *a: pytest.fail("built it all"))
    monkeypatch.setattr(Network, "init_slice", lambda *a: pytest.fail("built a slice"))
    reads = []

    class Found:  # what _read_start uses of a Checkpoint
        path, num_replicas, manifest = Path("ckpt"), 1, {}

        def read_range(self, start, stop):
            reads.append((start, stop))
            return np.full(stop - start, 2.5, np.float32), {"accum": np.ones(stop - start,
                                                                            np.float32)}

        def shard_counters(self, start, stop):
            return [{"gradients_applied": 4}]

    plan = _plan(1)
    optimizer = SimpleNamespace(load_state=lambda state: None)
    start = downpour_run._read_start(None, plan, net, None, None, "ckpt", Found(), None,
                                     lambda n: optimizer)
    own = balanced_ranges(net.layout.size, 2)[1]
    assert reads == [own], "a shard reads its own range and nothing else"
    got = shard_initial(net, 3, plan, start)
    assert got.shape == (own[1] - own[0],) and (got == 2.5).all()


# -- peak RSS in summary.json --------------------------------------------------------------


def test_one_process_summary_has_its_peak_rss(synthetic_folder, small_config, tmp_path):
    folder = synthetic_folder("mem1", {"synth.toml": small_config()})
    out = tmp_path / "out"
    proc = run_cli(["train", folder / "synth.toml",
                    *set_args(f'run.out_dir="{out}"', 'optimizer.algorithm="sgd"',
                              "run.max_steps=20")], cwd=folder)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    (figure,) = summary["peak_rss"]
    assert figure["role"] == "the one process" and figure["peak_rss_mb"] > 10
    assert summary["peak_rss_largest"]["mb"] == figure["peak_rss_mb"]
    # The memory model's figure beside it, and in the log: a formula far off fails.
    assert 0.5 < figure["peak_rss_mb"] / figure["predicted_mb"] < 2, figure
    assert re.search(r"^distbelief: peak memory, the largest of each role: the one process "
                     r"[\d,]+ MB \(predicted [\d,]+\); every rank's in summary.json",
                     proc.stdout, re.MULTILINE), proc.stdout


def test_every_rank_of_a_downpour_run_reports_its_peak_rss(synthetic_folder, small_config,
                                                           tmp_path):
    folder = synthetic_folder("mem3", {"synth.toml": small_config()})
    out = tmp_path / "out"
    proc = run_mpi(4, ["-m", "distbelief", "train", folder / "synth.toml",
                       *set_args(f'run.out_dir="{out}"', "cluster.ps_shards=2",
                                 "run.max_steps=40")], cwd=folder)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    figures = summary["peak_rss"]
    assert [f["rank"] for f in figures] == [0, 1, 2, 3]
    assert [f["role"] for f in figures] == ["shard 0", "shard 1", "replica 0", "replica 1"]
    assert all(f["peak_rss_mb"] > 10 for f in figures)
    largest = max(figures, key=lambda f: f["peak_rss_mb"])
    assert summary["peak_rss_largest"] == {"role": largest["role"],
                                           "mb": largest["peak_rss_mb"]}
    # Each rank's prediction beside its peak; shard 0 also holds the evaluation snapshot.
    assert all(0.5 < f["peak_rss_mb"] / f["predicted_mb"] < 2 for f in figures), figures
    assert figures[0]["predicted_mb"] > figures[1]["predicted_mb"]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("distbelief: peak memory")]
    big = {kind: max((f for f in figures if f["role"].startswith(kind)),
                     key=lambda f: f["peak_rss_mb"]) for kind in ("shard", "replica")}
    assert line == ("distbelief: peak memory, the largest of each role: "
                    + ", ".join(f"{f['role']} {f['peak_rss_mb']:,.0f} MB (predicted "
                                f"{f['predicted_mb']:,.0f})" for f in big.values())
                    + "; every rank's in summary.json (peak_rss)"), line


@pytest.mark.parametrize("n, overrides, roles", [
    (4, ['optimizer.algorithm="sandblaster"', "data.batch_size=400", "run.max_steps=2"],
     ["shard 0", "coordinator", "replica 0", "replica 1"]),
    (2, ['optimizer.algorithm="sgd"', "cluster.partitions=2"],
     ["replica 0, partition 0", "replica 0, partition 1"]),
    (2, ['optimizer.algorithm="sync"', "cluster.ps_shards=0"], ["replica 0", "replica 1"]),
    (2, ['optimizer.algorithm="hogwild"', "cluster.ps_shards=0"], ["replica 0", "replica 1"]),
])
@pytest.mark.matrix
def test_other_algorithms_report_every_ranks_peak_rss(synthetic_folder, small_config,
                                                      tmp_path, n, overrides, roles):
    folder = synthetic_folder("memalg", {"synth.toml": small_config()})
    out = tmp_path / "out"
    proc = run_mpi(n, ["-m", "distbelief", "train", folder / "synth.toml",
                       *set_args(f'run.out_dir="{out}"', "run.max_steps=20", *overrides)],
                   cwd=folder)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [f["role"] for f in summary["peak_rss"]] == roles
    assert all(f["peak_rss_mb"] > 10 for f in summary["peak_rss"])
    # A coordinator's rank is not in the formulas: no prediction rather than a wrong one.
    predicted = ["predicted_mb" in f for f in summary["peak_rss"]]
    assert predicted == [not any("coordinator" in role for role in roles)] * n


def test_peak_rss_grows_with_what_the_process_touches():
    before = memory.peak_rss_bytes()
    block = np.ones(64 << 20, dtype=np.uint8)  # 64 MB, touched
    assert memory.peak_rss_bytes() >= before + (48 << 20) or before > (64 << 20)
    del block


# -- the node's memory ---------------------------------------------------------------------


@pytest.mark.parametrize("env, expected", [
    ({"DISTBELIEF_NODE_MEMORY": "3G", "SLURM_MEM_PER_NODE": "1000"}, 3 << 30),
    ({"SLURM_MEM_PER_NODE": "1000"}, 1000 << 20),
    ({"SLURM_MEM_PER_NODE": "64G"}, 64 << 30),
    ({"SLURM_MEM_PER_CPU": "2000", "SLURM_CPUS_ON_NODE": "16"}, 16 * 2000 << 20),
    ({"DISTBELIEF_NODE_MEMORY": "1.5T"}, int(1.5 * (1 << 40))),
    ({"DISTBELIEF_NODE_MEMORY": "512MiB"}, 512 << 20),
])
def test_node_memory_from_the_environment(env, expected):
    assert memory.node_memory_bytes(env)[0] == expected


def test_node_memory_falls_back_to_memavailable(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 8000000 kB\nMemAvailable: 6000000 kB\n")
    size, source = memory.node_memory_bytes({}, str(meminfo))
    assert size == 6000000 * 1024 and "MemAvailable" in source


@pytest.mark.parametrize("text", ["", "lots", "-3G", "0"])
def test_a_bad_node_memory_is_refused_in_words(text):
    with pytest.raises(ConfigError, match="positive number"):
        memory.parse_size(text)


# -- the prediction and the refusal before launch ------------------------------------------

SPEECH = ((440,), [{"type": "dense", "units": 2560, "activation": "sigmoid"}] * 4
          + [{"type": "dense", "units": 8192, "activation": "softmax"}], 8192)


def test_the_memory_model_knows_the_transport_constants():
    from distbelief.algorithms.common import EVAL_BATCH_SIZE
    from distbelief.model import memory_model
    from distbelief.ps import rma_windows

    assert memory_model.PUBLISH_BUFFERS == rma_windows.BUFFERS
    for name in ("PUSH_SLOTS_ANY_SIZE", "PUSH_SLOT_MEMORY", "MAX_PUSH_SLOTS"):
        assert getattr(memory_model, name) == getattr(rma_windows, name), name
    assert memory_model.EVAL_BATCH == EVAL_BATCH_SIZE
    for clients in (1, 2, 3, 4, 9, 24, 1000):
        for slot_bytes in (4, 4 << 10, 1 << 20, 4 << 20, 84 << 20):
            assert memory_model.push_slots(clients, slot_bytes) == \
                rma_windows.push_slots(clients, slot_bytes)


@pytest.mark.parametrize("clients, slot_bytes, slots", [
    (3, 4 << 10, 6),          # two per client
    (24, 4 << 10, 48),        # small slices: two per client beyond 8 (no claim retries)
    (1000, 4 << 10, 64),      # never more than a poll reads
    (24, 4 << 20, 16),        # 64 MiB of 4 MiB slots
    (24, 84 << 20, 8),        # large slices: 8 whatever their size
    (2, 84 << 20, 4),
])
def test_push_slots_are_two_per_client_within_a_memory_budget(clients, slot_bytes, slots):
    from distbelief.ps import rma_windows

    assert rma_windows.push_slots(clients, slot_bytes) == slots


def test_the_rma_shard_formula_in_slices():
    from distbelief.model.memory_model import BASE_BYTES, Workload, predict_memory

    net = Network(*SPEECH)
    n = -(-net.layout.size // 2)
    for replicas, slots in ((1, 2), (2, 4), (4, 8), (16, 8)):
        roles = predict_memory(net, 2, replicas, 1, Workload(transport="rma"))
        shard = next(r for r in roles if r.role == "shard")
        # master + Adagrad + 2 publish buffers + push slots, whatever the replica count
        assert shard.bytes - BASE_BYTES == 4 * n * (1 + 1 + 2 + slots)
        assert roles[0].role == "shard 0" and roles[0].bytes > shard.bytes  # it evaluates
    shared = predict_memory(net, 2, 4, 1, Workload(transport="shared"))
    assert next(r for r in shared if r.role == "shard").bytes - BASE_BYTES == 4 * n * 2
    # Periodic checkpoints: parameters and state copied, written after the release.
    for transport in ("rma", "shared"):
        plain, copying = (next(r for r in predict_memory(net, 2, 4, 1, Workload(
            transport=transport, checkpoint_copy=copy)) if r.role == "shard")
            for copy in (False, True))
        assert copying.bytes - plain.bytes == copying.parts["checkpoint copy"] == 4 * n * 2


def test_partitions_and_shards_shrink_the_ranks_that_need_most():
    from distbelief.model.memory_model import Workload, largest, predict_memory

    net = Network(*SPEECH)
    work = Workload(transport="rma")
    replica = [largest([r for r in predict_memory(net, 1, 1, p, work)
                        if r.role.startswith("replica")]).bytes for p in (1, 2, 4)]
    assert replica[0] > replica[1] > replica[2]
    shard = [next(r for r in predict_memory(net, s, 2, 1, work) if r.role == "shard 0").bytes
             for s in (1, 2, 4)]
    assert shard[0] > shard[1] > shard[2]


def _speech_folder(synthetic_folder, small_config, name, units=512):
    """Two sigmoid layers of `units` over 64 features, 64 classes (4096 units: 17M
    parameters, a shard 0 of about 0.9 GB over RMA)."""
    text = small_config(hidden=None, classes=64).replace(
        '[model]\nlayers = [', "[model]\nlayers = [" + ", ".join(
            f'{{ type = "dense", units = {units}, activation = "sigmoid" }}'
            for _ in range(2)) + ", ")
    return synthetic_folder(name, {"synth.toml": text}, num_classes=64, input_shape=(64,))


def test_a_layout_that_does_not_fit_is_refused_on_every_rank(synthetic_folder, small_config,
                                                             tmp_path):
    from helpers import exit_statuses
    from helpers.mpi_jobs import every_rank_exited, job_env

    folder = _speech_folder(synthetic_folder, small_config, "refuse", units=4096)
    out = tmp_path / "out"
    env = {**job_env(), "DISTBELIEF_NODE_MEMORY": "1G", "DISTBELIEF_PS_TRANSPORT": "rma"}
    proc = run_mpi(3, [Path(__file__).parent / "mpi_programs" / "cli_exit_status.py", "train",
                       folder / "synth.toml", *set_args(f'run.out_dir="{out}"',
                                                        "cluster.ps_shards=1")],
                   cwd=folder, env=env, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert every_rank_exited(exit_statuses(proc), 3, 2), proc.stdout
    errors = [line for line in proc.stderr.splitlines() if "distbelief: error:" in line]
    assert len(errors) == 1, proc.stderr
    assert "needs" in errors[0] and "which has 1.00 GB ($DISTBELIEF_NODE_MEMORY)" in errors[0]
    assert "The largest role is shard 0" in errors[0]
    assert "A layout that fits: " in errors[0] and "mpiexec -n" in errors[0]
    assert not (out / "summary.json").exists() and not (out / "checkpoints").exists()


def test_the_same_layout_runs_when_the_node_is_big_enough(synthetic_folder, small_config,
                                                          tmp_path):
    from helpers.mpi_jobs import job_env

    folder = _speech_folder(synthetic_folder, small_config, "fits")
    out = tmp_path / "out"
    env = {**job_env(), "DISTBELIEF_NODE_MEMORY": "64G"}
    proc = run_mpi(3, ["-m", "distbelief", "train", folder / "synth.toml",
                       *set_args(f'run.out_dir="{out}"', "run.max_steps=5")],
                   cwd=folder, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_suggested_layout_fits_and_the_refused_one_does_not():
    from distbelief.algorithms.memory_plan import (
        Layout,
        block_nodes,
        fits,
        placed_nodes,
        suggest_layout,
    )
    from distbelief.model.memory_model import Workload

    net = Network(*SPEECH)
    work = Workload(transport="rma", train_rows=20000, row_bytes=440 * 4 + 8, eval_rows=2000)
    node = 1200 << 20
    current = Layout(1, 2, 1)
    assert not fits(net, current, work, node, per_node=3)
    better = suggest_layout(net, current, work, node, per_node=3, nodes=1)
    assert better is not None and fits(net, better, work, node, per_node=3)
    assert better.ranks % 3 == 0 or better.ranks == 3
    assert len(block_nodes(7, 3)) == 7 and block_nodes(7, 3)[-1] == 2
    # The shards (the job's first ranks) spread over the nodes, as train places them.
    assert placed_nodes(7, 3, 2) == [0, 1, 0, 0, 1, 1, 2]
    assert placed_nodes(6, 3, 0) == block_nodes(6, 3)


def test_each_node_is_checked_with_its_own_ranks():
    from distbelief.algorithms.memory_plan import Layout, refusal
    from distbelief.model.memory_model import Workload, predict_memory

    net = Network(*SPEECH)
    work = Workload(transport="rma")
    layout = Layout(2, 2, 1)  # ranks: shard 0, shard 1, replica 0, replica 1
    roles = predict_memory(net, 2, 2, 1, work)
    shard0, shard, replica = (r.bytes for r in roles)
    node_of = [0, 1, 0, 1]  # the shards spread over two nodes
    between = shard + replica + (shard0 - shard) // 2  # node 1 fits, node 0 does not
    assert refusal(net, layout, work, node_of, 1, between, "test") is None
    message = refusal(net, layout, work, node_of, 0, between, "test")
    assert message is not None and "on node 0 (2 rank(s))" in message
    assert f"needs {(shard0 + replica) / 2**30:.2f} GB" in message
