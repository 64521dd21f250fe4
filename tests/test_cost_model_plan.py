"""The cost model's data parallelism, its paper-shape parameters, --measure and --plan
(issue 31 item 5). The partitioned model's own tests are in test_model_parallel.py."""

from __future__ import annotations

import re

import pytest
from helpers.mpi_jobs import REPO, run_cli

from distbelief.model.cost_model import (
    Link,
    Machine,
    block_efficiency,
    predict,
    predict_layout,
)
from distbelief.model.network import Network

SPEECH = ((440,), [{"type": "dense", "units": 2560, "activation": "sigmoid"}] * 4
          + [{"type": "dense", "units": 8192, "activation": "softmax"}], 8192)
PAPER = {"flops": 100e9, "link": Link(1.25e9, 50e-6, 300e-6), "half_width": 1024}
"""The parameters docs/model-parallelism.md gives for the paper's Figure 3 shape."""
SPEECH_ARGS = ["--input-shape", "440", "--classes", "8192"]


def test_the_paper_parameters_give_figure_3s_shape():
    net = Network(*SPEECH)
    speedups = {p: predict(net, p, 128, PAPER["flops"], PAPER["link"],
                           PAPER["half_width"]).speedup for p in (1, 2, 4, 8, 16, 32)}
    assert max(speedups, key=speedups.get) == 8  # fastest on 8 machines
    assert 2.0 <= speedups[8] <= 2.4  # the paper's 2.2x
    assert speedups[16] < speedups[8] and speedups[32] < speedups[16]  # slower beyond
    # Without the per-message cost and the small-block penalty the curve keeps rising.
    plain = [predict(net, p, 128, PAPER["flops"], Link(1.25e9, 50e-6)).speedup
             for p in (4, 8, 16)]
    assert plain[0] < plain[1] < plain[2]


def test_block_efficiency():
    assert block_efficiency(100, 100, 0) == 1.0
    assert block_efficiency(100, 100, 50) == pytest.approx(1.0)
    assert block_efficiency(10, 100, 10) == pytest.approx(0.5 / (100 / 110))


def test_more_replicas_add_throughput_until_the_shard_folds_are_the_limit():
    net = Network(*SPEECH)
    machine = Machine(50e9, Link(10e9, 2e-6), fold_rate=1e9)
    rates = [predict_layout(net, 1, r, 1, 128, machine).samples_per_second
             for r in (1, 2, 4, 8, 16, 32)]
    assert rates[1] == pytest.approx(2 * rates[0])
    last = predict_layout(net, 1, 32, 1, 128, machine)
    assert last.bottleneck == "shard fold"
    # More shards split the fold: the same replicas go faster, as fast as they compute.
    four = predict_layout(net, 4, 32, 1, 128, machine)
    assert four.shard_seconds == pytest.approx(last.shard_seconds / 4)
    assert four.bottleneck == "compute" and four.samples_per_second > 1.9 * \
        last.samples_per_second


def test_ranks_beyond_the_cores_share_them():
    net = Network(*SPEECH)
    alone = predict_layout(net, 1, 2, 1, 128, Machine(50e9, Link(10e9, 2e-6), cores=0))
    shared = predict_layout(net, 1, 4, 1, 128, Machine(50e9, Link(10e9, 2e-6), cores=2))
    assert shared.compute_seconds == pytest.approx(2 * alone.compute_seconds)
    assert shared.samples_per_second == pytest.approx(alone.samples_per_second, rel=0.01)


def test_layouts_print_throughput_and_memory_per_rank():
    proc = run_cli(["costmodel", REPO / "configs" / "paper_speech_42m.toml", *SPEECH_ARGS,
                    "--layouts", "0:1:1,2:1:1,1:2:1,2:2:2", "--memory", "4G"])
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines()
            if re.match(r"\s+\d+ x \d+ x \d+\s+\d+", line)]
    assert len(rows) == 4
    assert [int(r.split()[5]) for r in rows] == [1, 3, 3, 6]  # ranks = S + R x P
    assert "publish buffers" in proc.stdout and "shard 0" in proc.stdout
    assert rows[0].rstrip().endswith("fits")


def test_plan_suggests_a_layout_that_fits_and_uses_the_ranks():
    proc = run_cli(["costmodel", REPO / "configs" / "paper_speech_42m.toml", *SPEECH_ARGS,
                    "--plan", "--nodes", "4", "--cores", "8", "--memory", "16G",
                    "--bandwidth", "12.5", "--gflops", "50"])
    assert proc.returncode == 0, proc.stderr
    found = re.search(r"suggested: (\d+) shard\(s\) \+ (\d+) replica\(s\) x (\d+) "
                      r"partition\(s\) = (\d+) ranks", proc.stdout)
    assert found, proc.stdout
    shards, replicas, partitions, ranks = map(int, found.groups())
    assert shards + replicas * partitions == ranks <= 32 and ranks > 16
    # The suggestion is the first (fastest) row of the table.
    first = next(line for line in proc.stdout.splitlines()
                 if re.match(r"\s+\d+ x \d+ x \d+", line))
    assert first.split()[:5] == [str(shards), "x", str(replicas), "x", str(partitions)]


def test_plan_says_so_when_nothing_fits():
    proc = run_cli(["costmodel", REPO / "configs" / "paper_speech_42m.toml", *SPEECH_ARGS,
                    "--plan", "--nodes", "1", "--cores", "4", "--memory", "300M"])
    assert proc.returncode == 1 and "no layout of 4 ranks fits" in proc.stdout


def test_plan_needs_the_node_figures():
    proc = run_cli(["costmodel", REPO / "configs" / "paper_speech_42m.toml", *SPEECH_ARGS,
                    "--plan", "--nodes", "2"])
    assert proc.returncode == 2 and "--plan needs --cores" in proc.stderr


def test_measure_times_this_machine(synthetic_folder, small_config):
    folder = synthetic_folder("measure", {"synth.toml": small_config(hidden=256)})
    proc = run_cli(["costmodel", folder / "synth.toml", "--measure", "--layouts", "1:1:1"],
                   cwd=folder)
    assert proc.returncode == 0, proc.stderr
    found = re.search(r"measured here: a step [\d.]+ ms = ([\d.]+) GFLOP/s, .* transport "
                      r"([\d.]+) GB/s and [\d.]+ us, fold ([\d.]+) Gparam/s", proc.stdout)
    assert found, proc.stdout
    assert all(float(v) > 0 for v in found.groups())
