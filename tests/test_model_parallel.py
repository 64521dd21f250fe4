"""Model parallelism: the partitioning (pure, in-process) and the partitioned network
against the unpartitioned one as MPI jobs at P = 1, 2, 3 and 4 ranks, under timeouts."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import REPO, run_mpi

from distbelief.errors import ConfigError
from distbelief.model import Network
from distbelief.partition import Partitioning, balanced_splits, input_window, needed_inputs

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


@pytest.mark.parametrize("partitions", [1, 2, 3, 4])
def test_partitioned_loss_gradients_and_bytes_match(partitions):
    """Loss, gradient (own-size and whole-model vectors), evaluation equal the Network's;
    bytes per layer and direction == cut edges x batch x 4 (counted from the geometry in
    the program); dense, local and mixed networks, balanced, skewed and one-owner blocks."""
    proc = run_mpi(partitions, ["-m", "mpi4py", PROGRAMS / "mp_gradients.py"],
                   timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("OK ")]
    cases = {tuple(line.split()[1:3]) for line in lines}
    expected = {(net, "balanced") for net in ("dense", "local", "mixed")}
    if partitions > 1:
        expected |= {(net, "one-owner") for net in ("dense", "local", "mixed")}
        expected |= {(net, "skewed0") for net in ("dense", "local", "mixed")}
    assert expected <= cases, lines
    if partitions > 1:  # something really crossed
        assert any(int(b) > 0 for line in lines
                   for b in line.split("bytes/step")[1].strip(" []").split(","))
