"""A sparse model on a replica's row cache (model.sparse_rows): the same loss and gradient
as the whole-vector computation, for every first layer and combine; the cache's pieces;
gradients merged over caches."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import sparse
from helpers.mpi_jobs import REPO
from helpers.sparse import MODELS

from distbelief.model.losses import make_loss
from distbelief.model.sparse_network import SparseNetwork
from distbelief.model.sparse_rows import RowCache, RowsView, merged, sorted_distinct
from distbelief.ps.endpoint import PieceMap


def model_and_batches(name: str, batches: int = 2):
    return sparse.model_and_batches(name, np.random.default_rng(1), batches, scale=10)


@pytest.mark.parametrize("name", MODELS)
def test_the_row_cache_gives_the_whole_vectors_loss_and_gradient(name: str) -> None:
    net, batches = model_and_batches(name)
    params = net.init_params(5)
    params += np.random.default_rng(2).normal(scale=0.3, size=params.size).astype(np.float32)
    view = RowsView(net)
    # A cache of both batches (a fetch for n_fetch = 2), used for the first.
    view.cache = cache = RowCache.for_batches(net, [x for x, _ in batches])
    assert cache.size <= net.layout.size  # (the hashed table of 4 rows is all touched)
    (x, y), _ = batches
    whole = np.zeros(net.layout.size, np.float32)
    expected = net.loss_and_grad(params, x, y, whole)
    compact = cache.gather(params)
    grad = np.full(cache.size, np.nan, np.float32)  # every value must be written
    loss = view.loss_and_grad(compact, x, y, grad)
    assert loss == pytest.approx(expected, rel=1e-6)
    np.testing.assert_allclose(grad, cache.gather(whole), rtol=1e-5, atol=1e-7)
    back = np.zeros_like(whole)
    cache.scatter(grad, back)  # nothing of the gradient lies outside the cache
    np.testing.assert_allclose(back, whole, rtol=1e-5, atol=1e-7)


def test_pieces_coalesce_consecutive_rows_and_end_with_the_dense_part() -> None:
    net = SparseNetwork("ids", (2,), [{"type": "embedding", "dim": 4, "combine": "dot"}], 1,
                        loss=make_loss("mse", 1), id_rows=(10, 6))
    cache = RowCache(net, [np.array([1, 2, 3, 7]), np.array([0, 5])])
    users, items = (net.layout.entry(0, f"table_{f}").offset for f in range(2))
    bias = net.layout.entry(0, "bias").offset
    assert cache.pieces.tolist() == [[users + 4, users + 16], [users + 28, users + 32],
                                     [items, items + 4], [items + 20, items + 24],
                                     [bias, net.layout.size]]
    assert cache.size == sum(b - a for a, b in cache.pieces.tolist()) == 4 * 6 + 1
    with pytest.raises(ValueError, match="not in the row cache"):
        cache.positions(0, np.array([4]))
    with pytest.raises(ValueError, match="sorted, distinct"):
        RowCache(net, [np.array([2, 1]), np.array([0])])


def test_gradients_of_two_caches_merge_into_their_union() -> None:
    net, batches = model_and_batches("fields concat")
    params = net.init_params(5)
    view, parts, whole = RowsView(net), [], np.zeros(net.layout.size, np.float32)
    for x, y in batches:
        view.cache = RowCache.for_batches(net, [x])
        grad = np.empty(view.cache.size, np.float32)
        view.loss_and_grad(view.cache.gather(params), x, y, grad)
        parts.append((view.cache, grad))
        step = np.zeros_like(whole)
        net.loss_and_grad(params, x, y, step)
        whole += step
    union, total = merged(net, parts)
    assert union.rows >= max(c.rows for c, _ in parts)
    np.testing.assert_allclose(total, union.gather(whole), rtol=1e-5, atol=1e-6)


def test_a_row_replicas_predicted_memory_follows_the_batch_not_the_table() -> None:
    # The memory plan's replica line (model.memory_model) for table_pulls = "rows": two
    # table sizes 100x apart, the same prediction; the whole vector's grows with the table.
    from distbelief.model.memory_model import Workload, predict_memory

    def replica_bytes(users: int, row_ids: tuple) -> int:
        net = SparseNetwork("ids", (2,), [{"type": "embedding", "dim": 8, "combine": "dot"}],
                            1, loss=make_loss("mse", 1), id_rows=(users, 1000))
        work = Workload(batch=64, transport="rma", row_ids=row_ids, n_fetch=2)
        return next(r for r in predict_memory(net, 1, 2, 1, work)
                    if r.role == "replica").bytes

    rows = [replica_bytes(users, (1.0, 1.0)) for users in (20_000, 2_000_000)]
    whole = [replica_bytes(users, ()) for users in (20_000, 2_000_000)]
    assert rows[0] == rows[1] < whole[0] < whole[1]
    assert whole[1] - whole[0] == 2 * 4 * 1_980_000 * 8  # parameters and gradient


@pytest.mark.parametrize("algorithm, cached", [("downpour", True), ("hogwild", False),
                                                ("averaging", False), ("sync", False)])
def test_only_downpours_replicas_are_planned_as_row_caches(algorithm: str,
                                                           cached: bool) -> None:
    # Every algorithm's configuration says table_pulls = "rows" by default, but only
    # Downpour's replicas move rows: the others' hold the table, and must be planned so.
    from types import SimpleNamespace

    from distbelief.algorithms.memory_plan import row_ids
    from distbelief.config import config_from_dict, read_toml

    raw = read_toml(REPO / "examples" / "matrix_factorisation.toml")
    raw["optimizer"]["algorithm"] = algorithm
    info = SimpleNamespace(features="ids", id_rows=(2_000, 1_000))
    assert row_ids(config_from_dict(raw), info) == ((1.0, 1.0) if cached else ())


def test_sorted_distinct_ids_are_np_uniques() -> None:
    rng = np.random.default_rng(4)
    for ids in (np.array([], np.int32), np.array([7], np.int32), rng.integers(0, 50, 300),
                rng.integers(0, 10**9, 2_000).astype(np.int32)):
        got = sorted_distinct(ids)
        assert got.dtype == np.int64 and np.array_equal(got, np.unique(ids))


def test_a_piece_map_gives_each_shard_its_part_of_the_compact_buffer() -> None:
    # Random pieces and shard boundaries, some inside a piece: each shard's part of the
    # compact buffer holds exactly the vector's values at its positions, in order.
    rng = np.random.default_rng(5)
    for _ in range(200):
        total = int(rng.integers(2, 300))
        bounds = np.unique(np.r_[0, rng.integers(1, total, rng.integers(0, 5)), total])
        ranges = list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
        ends = np.sort(rng.choice(total + 1, 2 * int(rng.integers(0, total // 2 + 1)),
                                  replace=False)).reshape(-1, 2)
        whole = rng.random(total).astype(np.float32)
        compact = np.concatenate([whole[a:b] for a, b in ends] + [np.empty(0, np.float32)])
        plan = PieceMap(ends, ranges)
        assert plan.size == len(compact)
        seen = []
        for s, (low, high) in enumerate(ranges):
            inside = [(max(a, low), min(b, high)) for a, b in ends if max(a, low) < min(b, high)]
            assert (s in plan.shards) == bool(inside)
            if inside:
                assert np.array_equal(plan.part(compact, s), whole[low + plan.index(s)])
                assert np.array_equal(low + plan.index(s),
                                      np.concatenate([np.arange(a, b) for a, b in inside]))
                seen.append(np.arange(plan.at[s], plan.at[s] + plan.count[s]))
        assert np.array_equal(np.concatenate(seen + [np.empty(0, int)]), np.arange(plan.size))
