"""Sparse models (model.sparse_network): gradients against finite differences for every
first layer and combine, the init stream, and the configuration's errors."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.sparse import MODELS, SOFTMAX_3, model_and_batches

from distbelief.data.sparse import SparseRows
from distbelief.errors import ConfigError, DataError
from distbelief.model.losses import make_loss
from distbelief.model.sparse_network import SparseNetwork


def worst_gradient_error(net: SparseNetwork, x, y, rng: np.random.Generator) -> float:
    """The largest relative difference between the gradient and central differences, over
    the touched coordinates and random ones (untouched table rows must be exactly 0)."""
    params = net.init_params(3) + rng.normal(scale=0.3, size=net.layout.size).astype(np.float32)
    grad = np.full(net.layout.size, np.nan, np.float32)  # every value must be written
    net.loss_and_grad(params, x, y, grad)
    worst = 0.0
    for i in np.r_[np.flatnonzero(grad)[:40], rng.integers(0, params.size, 40)]:
        up, down = params.copy(), params.copy()
        up[i] += 1e-2
        down[i] -= 1e-2
        numeric = (net.loss(up, x, y) - net.loss(down, x, y)) / 2e-2
        worst = max(worst, abs(numeric - grad[i]) / max(1e-2, abs(numeric) + abs(grad[i])))
    return worst


@pytest.mark.parametrize("name", MODELS)
def test_the_gradient_matches_central_differences(name: str) -> None:
    rng = np.random.default_rng(0)
    net, [(x, y)] = model_and_batches(name, rng)
    assert worst_gradient_error(net, x, y, rng) < 2e-3


def test_untouched_table_rows_get_no_gradient_and_no_update_from_a_batch() -> None:
    rng = np.random.default_rng(1)
    net = SparseNetwork("ids", (2,), [{"type": "embedding", "dim": 4, "combine": "dot"}], 1,
                        loss=make_loss("mse", 1), id_rows=(50, 60))
    x = np.array([[3, 7], [3, 9], [11, 7]])
    params = net.init_params(0)
    grad = np.empty_like(params)
    net.loss_and_grad(params, x, rng.normal(size=3).astype(np.float32), grad)
    (users, _, _), (items, _, _) = net.tables
    touched_users = np.flatnonzero(np.abs(grad[users:users + 200].reshape(50, 4)).sum(1))
    touched_items = np.flatnonzero(np.abs(grad[items:items + 240].reshape(60, 4)).sum(1))
    assert touched_users.tolist() == [3, 11] and touched_items.tolist() == [7, 9]


def test_a_slice_of_the_initial_vector_is_drawn_alone_bit_for_bit() -> None:
    net = SparseNetwork("ids", (3,), [{"type": "embedding", "dim": 3},
                                      {"type": "dropout", "rate": 0.5}, SOFTMAX_3], 3,
                        id_rows=(7, 5, 9))
    whole = net.init_params(11)
    assert not np.array_equal(whole, net.init_params(12))
    for start, stop in [(0, whole.size), (3, 40), (20, 80), (60, whole.size), (5, 5)]:
        assert np.array_equal(net.init_slice(11, start, stop), whole[start:stop])


@pytest.mark.parametrize("kind, layers, message", [
    ("ids", [{"type": "sparse_linear", "units": 3, "activation": "softmax"}],
     "needs sparse features"),
    ("sparse", [{"type": "embedding", "dim": 3, "combine": "concat"}, SOFTMAX_3],
     'combine = "sum" or "mean"'),
    ("ids", [{"type": "embedding", "dim": 3, "combine": "dot", "activation": "softmax"}],
     "takes two id fields"),
    ("ids", [{"type": "embedding", "dim": 3, "combine": "max"}, SOFTMAX_3],
     "key 'combine' must be one of"),
    ("ids", [{"type": "embedding", "dim": 0}, SOFTMAX_3], "key 'dim' must be a positive"),
    ("ids", [{"type": "embedding", "dim": 2, "size": 3}, SOFTMAX_3], "unknown key 'size'"),
    ("ids", [{"type": "embedding", "dim": 2, "activation": "softmax"}],
     "the output layer has 6 outputs"),
    ("sparse", [{"type": "sparse_linear", "units": 3, "activation": "relu"}],
     "of the output layer must be 'softmax'"),
])
def test_a_wrong_sparse_layer_is_one_config_error(kind: str, layers: list, message: str):
    shape = (30,) if kind == "sparse" else (3,)
    with pytest.raises(ConfigError, match=message):
        SparseNetwork(kind, shape, layers, 3, id_rows=(7, 5, 9))


def test_input_of_the_wrong_kind_is_a_data_error() -> None:
    net = SparseNetwork("sparse", (30,), [{"type": "sparse_linear", "units": 3,
                                           "activation": "softmax"}], 3)
    params = net.init_params(0)
    with pytest.raises(DataError, match="sparse rows of 30 features"):
        net.logits(params, np.zeros((2, 30), np.float32))
    with pytest.raises(DataError, match="sparse rows of 30 features"):
        net.logits(params, SparseRows.from_dense(np.ones((2, 29), np.float32)))


@pytest.mark.parametrize("rule", ["adagrad", "sgd", "momentum", "adam", "dcasgd"])
def test_step_at_updates_the_touched_coordinates_as_step_does_and_no_others(rule: str):
    from distbelief.model import optimizers

    rng = np.random.default_rng(2)
    make = {"adagrad": lambda: optimizers.Adagrad(50, 0.1),
            "sgd": lambda: optimizers.SGD(0.1),
            "momentum": lambda: optimizers.Momentum(50, 0.1),
            "adam": lambda: optimizers.Adam(50, 0.1),
            "dcasgd": lambda: optimizers.DCASGD(50, 0.1, dc_lambda=0.5)}[rule]
    whole, part = make(), make()
    params = rng.normal(size=50).astype(np.float32)
    index = np.array([3, 17, 18, 40])
    for update in range(3):
        grad = rng.normal(size=50).astype(np.float32)
        masked = np.zeros_like(grad)
        masked[index] = grad[index]
        expected = params.copy()
        whole.step(expected, masked, update=update)
        before = params.copy()
        part.step_at(params, grad, index, update=update)  # grad elsewhere is ignored
        assert np.allclose(params[index], expected[index], rtol=1e-6)
        untouched = np.setdiff1d(np.arange(50), index)
        assert np.array_equal(params[untouched], before[untouched])
        for name, array in part.state().items():
            assert np.allclose(array[index], whole.state()[name][index], rtol=1e-6)
            assert len(array) == 50  # the live state is bound back after the update


def test_touched_names_the_batch_rows_and_everything_outside_the_tables() -> None:
    net = SparseNetwork("ids", (2,), [{"type": "embedding", "dim": 2, "combine": "dot"}], 1,
                        loss=make_loss("mse", 1), id_rows=(5, 6))
    params, grad = net.init_params(0), np.empty(net.layout.size, np.float32)
    net.loss_and_grad(params, np.array([[1, 4], [3, 4]]), np.zeros(2, np.float32), grad)
    (users, _, _), (items, _, _) = net.tables
    bias = net.layout.entry(0, "bias").offset
    assert sorted(net.touched()) == [users + 2, users + 3, users + 6, users + 7,
                                     items + 8, items + 9, bias]
    assert np.array_equal(np.flatnonzero(grad), np.flatnonzero(
        np.isin(np.arange(net.layout.size), net.touched()) & (grad != 0)))


@pytest.mark.parametrize("rows", [50, 2**24 + 1], ids=["scattered", "sorted"])
def test_a_lookup_numbers_each_distinct_id_once(rows: int) -> None:
    from distbelief.model.sparse_kernels import Lookup

    look = Lookup(rows)
    rng = np.random.default_rng(3)
    for _ in range(3):  # the scratch is reused: nothing of the last batch leaks in
        ids = rng.integers(0, min(rows, 50), 200)
        unique, position = look(ids)
        assert sorted(unique) == sorted(set(ids.tolist())) and len(unique) == len(set(unique))
        assert np.array_equal(unique[position], ids)
