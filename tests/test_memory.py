"""Memory (issue 31): a shard's slice built alone, a resume that reads only its slice, peak
RSS per rank in summary.json, the node's memory from the environment."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import run_cli, run_mpi
from helpers import set_args

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
