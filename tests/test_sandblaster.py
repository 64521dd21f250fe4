"""Sandblaster L-BFGS: the pure pieces in-process (two-loop recursion on dot products,
line search, work-unit settlement, L-BFGS over sliced vector stores against scipy), and
end to end as MPI jobs under timeouts at 4 to 6 ranks with 1 to 3 shards (odd splits):
the assembled batch gradient, convergence on a convex problem, a straggler, the
coordinator's traffic, metrics, and bad configurations.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import exit_statuses, finished, set_args
from helpers.mpi_jobs import job_env, mpiexec, run_mpi
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

from distbelief.algorithms.sandblaster import lbfgs
from distbelief.algorithms.sandblaster.plan import HEADER, owner_blocks, unit_owners
from distbelief.algorithms.sandblaster.roles import BatchRows
from distbelief.algorithms.sandblaster.unit_rows import UnitRows
from distbelief.algorithms.sandblaster.vector_shard import VectorShard
from distbelief.algorithms.sandblaster.work_units import (
    COMMIT,
    DROP,
    HOLD,
    WorkUnitTable,
    unit_ranges,
)
from distbelief.config import apply_overrides, config_from_dict
from distbelief.data.converters import make_synthetic
from distbelief.data.hdf5 import bytes_read, open_dataset, read_rows
from distbelief.errors import ConfigError
from distbelief.model.network import Network
from distbelief.records.metrics import REQUIRED_SUMMARY_KEYS
from distbelief.runtime.launching.faults import ENV as FAULTS

MLP_LAYERS = [{"type": "dense", "units": 64, "activation": "relu"},
              {"type": "dense", "units": 4, "activation": "softmax"}]
MLP = json.dumps(MLP_LAYERS)  # a JSON list of objects without nesting is not TOML ...
MLP = MLP.replace('": ', '" = ').replace('"type"', "type").replace('"units"', "units").replace(
    '"activation"', "activation")  # ... but becomes TOML inline tables this way


@pytest.fixture(scope="module")
def data_dir(synthetic_folder) -> Path:
    return synthetic_folder("sandblaster", n_train=3000)


# -- the two-loop recursion on dot products ----------------------------------------------------


def explicit_direction(g: np.ndarray, pairs: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Nocedal & Wright's Algorithm 7.4 on the vectors themselves."""
    q, alphas = g.copy(), []
    for s, y in reversed(pairs):
        alpha = (s @ q) / (s @ y)
        q -= alpha * y
        alphas.append(alpha)
    s, y = pairs[-1]
    r = (s @ y) / (y @ y) * q
    for (s, y), alpha in zip(pairs, reversed(alphas)):
        r += (alpha - (y @ r) / (s @ y)) * s
    return -r


@pytest.mark.parametrize("shards", [1, 3])
def test_direction_from_dot_products_equals_the_explicit_two_loop(shards: int) -> None:
    rng = np.random.default_rng(0)
    n, m = 50, 4
    ranges = [(int(c[0]), int(c[-1]) + 1) for c in np.array_split(np.arange(n), shards)]
    x = rng.normal(size=n)
    stores = [VectorShard(x[a:b], a, m) for a, b in ranges]
    gram = lbfgs.Gram(m)
    pairs = []
    # Six accepted steps with m = 4 slots: the ring wraps, the oldest pairs are dropped.
    for _ in range(6):
        step = rng.normal(size=n)
        y_true = step + 0.1 * rng.normal(size=n)  # positive curvature
        for store, (a, b) in zip(stores, ranges):
            store.d[:] = step[a:b]
            store.begin_trial(0, 1.0)
            store.add_gradient(store.g + y_true[a:b], 1)
            store.finish_trial(1)
        slot = gram.next_slot()
        kept = gram.update_pair(slot, sum(s.accept(slot) for s in stores))
        assert kept
        pairs.append((step, y_true))
    g = np.concatenate([s.g for s in stores])
    gtd, _ = sum(s.set_direction(lbfgs.direction_coefficients(gram)) for s in stores)
    d = np.concatenate([s.d for s in stores])
    expected = explicit_direction(g, pairs[-m:])
    np.testing.assert_allclose(d, expected, rtol=1e-9, atol=1e-9)
    assert gtd == pytest.approx(g @ expected)


def test_a_pair_without_positive_curvature_is_not_kept() -> None:
    gram = lbfgs.Gram(2)
    store = VectorShard(np.zeros(3), 0, 2)
    store.d[:] = [1.0, 0.0, 0.0]
    store.begin_trial(0, 1.0)
    store.add_gradient(np.array([-1.0, 0.0, 0.0]), 1)  # y = -s: negative curvature
    store.finish_trial(1)
    assert not gram.update_pair(0, store.accept(0))
    assert gram.order == []
    np.testing.assert_allclose(lbfgs.direction_coefficients(gram)[-1], -1.0)  # d = -g


def test_line_search_accepts_wolfe_points_and_brackets_otherwise() -> None:
    # f(t) = (t - 3)^2 along the direction: f0 = 9, slope -6.
    search = lbfgs.LineSearch(f0=9.0, gtd0=-6.0, t=1.0)
    while not search.done:
        t = search.t
        search.tell(t, (t - 3) ** 2, 2 * (t - 3))
    assert search.accepted and 1.0 <= t <= 5.9  # curvature needs slope >= 0.9 * -6
    armijo = lbfgs.LineSearch(f0=9.0, gtd0=-6.0, t=64.0, wolfe=False)
    while not armijo.done:
        t = armijo.t
        armijo.tell(t, (t - 3) ** 2, 2 * (t - 3))
    assert armijo.accepted and t == 4.0  # 64 -> 32 -> 16 -> 8 -> 4
    hopeless = lbfgs.LineSearch(f0=1.0, gtd0=-1.0, t=1.0, max_evals=3)
    while not hopeless.done:
        hopeless.tell(hopeless.t, 2.0, 0.0)
    assert hopeless.evals == 3 and not hopeless.accepted


# -- L-BFGS over sliced vector stores, in one process ------------------------------------------


class LocalBackend:
    """sandblaster.lbfgs.Backend over VectorShards in this process: what the MPI coordinator
    does, without MPI (the gradient comes from the network on the whole set)."""

    def __init__(self, net: Network, x: np.ndarray, y: np.ndarray, shards: int, m: int):
        self.net, self.x, self.y = net, x, y
        bounds = net.layout.shard_ranges(shards)
        init = net.init_params(0)
        self.stores = [VectorShard(init[a:b], a, m) for a, b in bounds]
        self.grad = np.zeros(net.layout.size, dtype=np.float32)
        self.evaluations = 0

    def evaluate(self, t: float, batch: int) -> tuple[float, float]:
        for store in self.stores:
            store.begin_trial(self.evaluations, t)
        point = np.concatenate([s.trial32 for s in self.stores])
        loss = self.net.loss_and_grad(point, self.x, self.y, self.grad)
        self.evaluations += 1
        for store in self.stores:
            store.add_gradient(self.grad[store.start:store.stop] * len(self.y), 1)
        return loss, float(sum(s.finish_trial(len(self.y)) for s in self.stores)[0])

    def accept(self, slot: int) -> np.ndarray:
        return sum(s.accept(slot) for s in self.stores)

    def take_gradient(self) -> np.ndarray:
        return sum(s.take_gradient() for s in self.stores)

    def set_direction(self, coefficients: np.ndarray) -> tuple[float, float]:
        gtd, dd = sum(s.set_direction(coefficients) for s in self.stores)
        return float(gtd), float(dd)


@pytest.mark.parametrize("shards,wolfe", [(1, True), (3, True), (2, False)])
def test_lbfgs_on_sliced_vectors_reaches_scipys_optimum(data_dir: Path, shards: int,
                                                         wolfe: bool) -> None:
    net = network_for(data_dir / "synth.h5", [{"type": "dense", "units": 4,
                                               "activation": "softmax"}])
    x, y = training_set(data_dir / "synth.h5")
    backend = LocalBackend(net, x, y, shards, m=5)
    losses = []
    options = lbfgs.LbfgsOptions(m=5, wolfe=wolfe, max_iterations=150,
                                 gradient_tolerance=1e-5)
    reason = lbfgs.minimize(backend, options, lambda it: losses.append(it.loss))
    assert reason in ("max_steps", "converged", "line_search_failed")  # float32 floor
    assert all(b <= a + 1e-7 for a, b in itertools.pairwise(losses))  # monotone decrease
    assert losses[-1] == pytest.approx(scipy_optimum(net, x, y), abs=2e-5)


# -- work units: exactly once, whatever the order ----------------------------------------------


def test_work_units_commit_every_unit_exactly_once_under_random_schedules() -> None:
    rng = random.Random(1)
    for trial in range(200):
        n_units, replicas = rng.randint(1, 30), rng.randint(1, 5)
        owners = unit_owners(n_units, replicas) if trial % 2 else None
        table = WorkUnitTable(n_units, push_every=rng.randint(1, 4),
                              backup_copies=rng.randint(1, 3), owners=owners)
        pending = {r: [] for r in range(replicas)}
        working = {r: table.next_unit(r) for r in range(replicas)}
        committed = []
        for _ in range(10000):
            if table.complete:
                break
            busy = [r for r in range(replicas) if working[r] is not None or pending[r]]
            if not busy:
                working = {r: table.next_unit(r) for r in range(replicas)}
                continue
            r = rng.choice(busy)
            if working[r] is not None:
                pending[r].append(working[r])
            decision = table.settle(r, pending[r])
            if decision == COMMIT:
                committed += pending[r]
            if decision in (COMMIT, DROP):
                pending[r] = []
            working[r] = table.next_unit(r)
            assert decision != HOLD or not pending[r] or working[r] is not None
        assert table.complete, f"schedule {trial} did not finish"
        assert sorted(committed) == list(range(n_units))


def test_backups_go_to_idle_replicas_only_in_the_tail() -> None:
    table = WorkUnitTable(3, push_every=1, backup_copies=2)
    assert [table.next_unit(0), table.next_unit(1), table.next_unit(1)] == [0, 1, 2]
    assert table.stats.backups_issued == 0
    assert table.next_unit(2) == 0  # the longest outstanding unit held by one replica
    assert table.stats.backups_issued == 1
    assert table.settle(2, [0]) == COMMIT
    assert table.settle(0, [0]) == DROP and table.stats.discarded == 1
    assert table.next_unit(0) in (1, 2)


def test_batch_rows_cover_each_epoch_once() -> None:
    rows = BatchRows(n_train=10, batch_size=4, seed=0)
    seen = np.concatenate([rows.rows(k) for k in range(5)])
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    np.testing.assert_array_equal(BatchRows(10, 10, 0).rows(3), np.arange(10))


def test_owned_units_come_first_and_the_rest_is_taken_from_the_back() -> None:
    """Replica 0 owns units 0..2, replica 1 units 3..5: each gets its own in order; once
    replica 0's are out it takes replica 1's last queued unit (counted as stolen)."""
    table = WorkUnitTable(6, push_every=1, owners=unit_owners(6, 2))
    assert table.owners == [0, 0, 0, 1, 1, 1]
    assert [table.next_unit(0, now=1.0) for _ in range(3)] == [0, 1, 2]
    assert table.next_unit(1, now=1.0) == 3 and table.stolen == 0
    assert table.next_unit(0, now=1.0) == 5 and table.stolen == 1
    assert table.next_unit(1, now=1.0) == 4 and table.tail
    assert table.release(1) == [3, 4] and not table.tail     # replica 1 lost
    assert table.next_unit(0, now=1.0) == 4 and table.stolen == 2  # from the back


@pytest.mark.parametrize("n_train,batch,unit,replicas", [(100, 100, 7, 3), (100, 40, 7, 3),
                                                         (1000, 999, 32, 4), (50, 20, 10, 4)])
def test_a_replicas_units_draw_only_from_its_own_rows(n_train: int, batch: int, unit: int,
                                                     replicas: int) -> None:
    """Stratified batches: the rows of a replica's units lie in its own block of rows,
    the blocks tile the set, and each block's stream visits each of its rows once an epoch
    (the full batch is every row in order)."""
    units = unit_ranges(batch, unit)
    owners = unit_owners(len(units), replicas)
    blocks = owner_blocks(units, owners, replicas, n_train, batch)
    owned = [(p, q, lo, hi) for p, q, lo, hi in blocks if q > p]
    assert [b[2] for b in owned[1:]] == [b[3] for b in owned[:-1]]
    assert owned[0][2] == 0 and owned[-1][3] == n_train
    rows = BatchRows(n_train, batch, 5, blocks)
    for k in range(3):
        batch_rows = rows.rows(k)
        fresh = BatchRows(n_train, batch, 5, blocks)  # computes only the blocks asked for
        for (start, stop), owner in zip(units, owners):
            _, _, lo, hi = blocks[owner]
            assert lo <= batch_rows[start:stop].min() and batch_rows[start:stop].max() < hi
            np.testing.assert_array_equal(fresh.rows_at(k, start, stop),
                                          batch_rows[start:stop])
        np.testing.assert_array_equal(fresh.rows_at(k, 3, batch - 2), batch_rows[3:-2])
    if batch == n_train:
        np.testing.assert_array_equal(rows.rows(2), np.arange(n_train))
    p, q, lo, hi = owned[0]
    per_epoch = (hi - lo) // (q - p)  # whole batches within the block's first epoch
    seen = np.concatenate([rows.rows(k)[p:q] for k in range(per_epoch)])
    assert len(set(seen.tolist())) == len(seen)


# -- end to end under MPI -------------------------------------------------------------------


def slow_env(shards: int, replica: int, factor: float = 10.0) -> dict:
    """Replica `replica` `factor` times slower per unit (world rank: shards, coordinator,
    then the replicas)."""
    return {**job_env(), FAULTS: f"delay:{shards + 1 + replica}:0:{factor}x"}


@pytest.mark.parametrize("n,shards,batch,slow", [(4, 1, 100000, False), (5, 2, 100000, True),
                                                 (6, 3, 1000, True)])
def test_assembled_gradient_equals_the_single_process_gradient(
        data_dir: Path, tmp_path: Path, n: int, shards: int, batch: int, slow: bool) -> None:
    """Units of 70 examples (the last one shorter), so sums of unequal units must add up;
    with a 10x slower replica, backup copies fire and duplicates must be dropped."""
    config = write(tmp_path, "c.toml",
                   toml(MLP, batch, work_unit_size=70, push_every_units=2).replace(
                       'path = "synth.h5"', f'path = "{data_dir / "synth.h5"}"').replace(
                       "ps_shards = 1", f"ps_shards = {shards}").replace(
                       "[run]", f'[run]\nout_dir = "{tmp_path / "out"}"'))
    out = tmp_path / "g.npz"
    proc = run_mpi(n, [PROGRAMS / "sandblaster_gradient.py", config, out], timeout=TIMEOUT,
                   env=slow_env(shards, 0, 30.0) if slow else None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assembled = np.load(out)["gradient"]

    net = network_for(data_dir / "synth.h5", MLP_LAYERS)
    x, y = training_set(data_dir / "synth.h5")
    batch = min(batch, len(y))
    units = unit_ranges(batch, 70)
    owners = unit_owners(len(units), n - shards - 1)
    rows = BatchRows(len(y), batch, 0,
                     owner_blocks(units, owners, n - shards - 1, len(y), batch)).rows(0)
    grad = np.zeros(net.layout.size, dtype=np.float32)
    loss = net.loss_and_grad(net.init_params(0), x[rows], y[rows], grad)
    np.testing.assert_allclose(assembled, grad, rtol=2e-4, atol=2e-6 * np.abs(grad).max())
    assert summary["final_loss"] == pytest.approx(loss, rel=1e-5)
    assert summary["units_issued"] - summary["backup_units_issued"] == -(-len(rows) // 70)
    if slow:
        assert summary["backup_units_issued"] > 0


# Under Open MPI, Sandblaster's messages are test_checkpoint_holds_the_history...'s to check:
# it trains, checkpoints and resumes on other shards, every path this one takes.
@pytest.mark.nodes  # also on simulated nodes (conftest.py: DISTBELIEF_TEST_NODES)
@pytest.mark.parametrize("n,shards", [(4, 1), (5, 2), (6, 3), (6, 1)])
@pytest.mark.matrix
def test_convex_problem_converges_to_scipys_loss(data_dir: Path, tmp_path: Path, n: int,
                                                 shards: int) -> None:
    config = write(data_dir, f"convex{n}{shards}.toml", toml(gradient_tolerance=1e-5))
    proc = train(n, config, tmp_path / "out", f"cluster.ps_shards={shards}",
                 "run.max_steps=150")
    summary, metrics = finished(proc, tmp_path / "out")
    net = network_for(data_dir / "synth.h5", [{"type": "dense", "units": 4,
                                               "activation": "softmax"}])
    x, y = training_set(data_dir / "synth.h5")
    assert summary["final_loss"] == pytest.approx(scipy_optimum(net, x, y), abs=5e-5)
    assert summary["stop_reason"] in ("max_steps", "converged", "line_search_failed")
    # Metrics: one training line per iteration with the Sandblaster figures.
    lines = [m for m in metrics if m["kind"] == "train"]
    assert [m["step"] for m in lines] == list(range(1, summary["iterations"] + 1))
    for m in lines:
        assert m["grad_norm"] >= 0 and m["step_size"] > 0 and m["line_search_evals"] >= 1
        assert len(m["units_per_replica"]) == n - shards - 1
        assert sum(m["units_per_replica"]) == 30 * len(m["evaluation_seconds"])
    assert lines[-1]["loss"] < lines[0]["loss"]
    evals = [m for m in metrics if m["kind"] == "eval"]
    assert evals and evals[-1]["step"] == summary["iterations"]
    for key in (*REQUIRED_SUMMARY_KEYS, "backup_units_issued", "backup_units_discarded",
                "coordinator_traffic", "replicas"):
        assert key in summary
    assert summary["final_test_accuracy"] > 0.6
    assert len(summary["replicas"]) == n - shards - 1
    if n == 5:  # the report draws the Sandblaster figures from these metrics
        from distbelief.records.report import ITERATIONS_FIGURE, UNITS_FIGURE, make_report

        written = {p.name for p in make_report([tmp_path / "out"], tmp_path / "report")}
        assert {ITERATIONS_FIGURE, UNITS_FIGURE} <= written
        assert all((tmp_path / "report" / name).stat().st_size > 10000 for name in written)


def test_target_accuracy_stops_the_run_and_the_summary_names_the_reaching_evaluation(
        data_dir: Path, tmp_path: Path) -> None:
    config = write(data_dir, "target.toml", toml())
    proc = train(4, config, tmp_path / "out", "run.max_steps=0", "run.max_seconds=60",
                 "run.target_accuracy=0.6", "run.eval_every_seconds=0.05")
    summary, metrics = finished(proc, tmp_path / "out")
    assert summary["stop_reason"] == "target_accuracy" and summary["reached_target"]
    evals = [m for m in metrics if m["kind"] == "eval"]
    hit = next(m for m in evals if m["test_accuracy"] >= 0.6)
    assert summary["target_reached_accuracy"] == hit["test_accuracy"] >= 0.6
    assert summary["target_reached_step"] == hit["step"]
    assert summary["time_to_target"] == pytest.approx(hit["time"])
    # The final evaluation (of the last iterate) is the summary's final accuracy.
    assert summary["final_test_accuracy"] == evals[-1]["test_accuracy"]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("distbelief: stopped"))
    assert f"({hit['test_accuracy']:.4f} at step {hit['step']})" in line
    assert ("final test accuracy" in line) == (evals[-1]["test_accuracy"] != hit["test_accuracy"])


def test_idle_ranks_sleep_instead_of_spinning(data_dir: Path, tmp_path: Path) -> None:
    """After one gradient the coordinator waits 3 s with nothing to hand out: parked
    replicas, idle shards and the coordinator itself must poll with sleeps (MPICH's
    blocking calls would burn a core each)."""
    config = write(tmp_path, "c.toml", toml().replace(
        'path = "synth.h5"', f'path = "{data_dir / "synth.h5"}"').replace(
        "[run]", f'[run]\nout_dir = "{tmp_path / "out"}"'))
    out = tmp_path / "idle.npz"
    proc = run_mpi(5, [PROGRAMS / "sandblaster_gradient.py", config, out, 3.0],
                   timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    usage = np.load(out)
    assert min(usage["wall_seconds"]) >= 3.0
    assert max(usage["cpu_seconds"]) < 0.15 * min(usage["wall_seconds"]), usage["cpu_seconds"]


@pytest.fixture(scope="module")
def heavy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Units that take about a millisecond to compute, so that the per-unit delay, not the
    messages, is what slows a replica down."""
    folder = tmp_path_factory.mktemp("straggler")
    make_synthetic(folder / "synth.h5", n_train=6000, n_test=200, input_shape=(256,),
                   num_classes=4, seed=5)
    return folder


def test_a_ten_times_slower_replica_gets_fewer_units_and_backups(heavy_dir: Path,
                                                                  tmp_path: Path) -> None:
    """Five replicas (7 ranks), replica 1 ten times slower per unit: units are handed out on
    request, so it commits far fewer than each of the others (an even split would give it
    as many), and the units it holds at the end of a batch are re-issued as backups. What
    it costs in batch time, against a run without it, is a ratio of timings:
    benchmarks/bench_sandblaster.py --only straggler measures it."""
    layers = ('[{ type = "dense", units = 256, activation = "relu" }, '
              '{ type = "dense", units = 4, activation = "softmax" }]')
    config = write(heavy_dir, "heavy.toml", toml(layers, work_unit_size=100))
    slow, _ = finished(train(7, config, tmp_path / "slow", "run.max_steps=6",
                             "run.eval_every_seconds=100", env=slow_env(1, 1)),
                       tmp_path / "slow")
    units = {r["replica"]: r["units_committed"] for r in slow["replicas"]}
    assert sorted(units) == [0, 1, 2, 3, 4], units
    assert units[1] < min(u for r, u in units.items() if r != 1) / 2, units
    assert slow["backup_units_issued"] > 0


def test_unit_rows_read_a_block_once_and_other_units_on_demand(tmp_path: Path) -> None:
    """In-process: a replica's own units come from memory (no read), another's unit is
    read once (exactly its rows) and then served from the cache."""
    make_synthetic(tmp_path / "s.h5", n_train=120, n_test=10, input_shape=(5,),
                   num_classes=3, seed=0)
    info = open_dataset(tmp_path / "s.h5")
    row, _, _ = stored_row_bytes(tmp_path / "s.h5")
    for batch in (120, 60):
        units = unit_ranges(batch, 10)
        blocks = owner_blocks(units, unit_owners(len(units), 3), 3, 120, batch)
        batches = BatchRows(120, batch, 1, blocks)
        before = bytes_read()
        rows = UnitRows(info, batches, blocks[1])
        assert bytes_read() - before == 40 * row and (rows.lo, rows.hi) == (40, 80)
        expected_x, expected_y = read_rows(info, "train", 0, 120)
        p = blocks[1][0]
        for k in range(2):
            before = bytes_read()
            x, y = rows.unit(k, p, p + 10)  # its own unit
            assert bytes_read() == before
            picked = batches.rows(k)[p:p + 10]
            np.testing.assert_array_equal(x, expected_x[picked])
            np.testing.assert_array_equal(y, expected_y[picked])
            x, y = rows.unit(k, 0, 10)      # replica 0's first unit
            np.testing.assert_array_equal(x, expected_x[batches.rows(k)[:10]])
            again = bytes_read()
            rows.unit(k, 0, 10)
            assert bytes_read() == again    # cached
        full = batch == 120
        assert rows.foreign_units == 4 and rows.foreign_reads == (1 if full else 2)
        assert rows.foreign_bytes == rows.foreign_reads * 10 * row


def stored_row_bytes(path: Path) -> tuple[int, int, int]:
    """(bytes of one stored training row, x and y; bytes of one stored label; test rows)."""
    with h5py.File(path, "r") as f:
        x, y = f["train/x"], f["train/y"]
        row = int(np.prod(x.shape[1:])) * x.dtype.itemsize
        return row + y.dtype.itemsize, y.dtype.itemsize, f["test/y"].shape[0]


@pytest.mark.parametrize("replicas,batch,slow", [(2, 100000, False), (4, 100000, True),
                                                 (4, 1000, False)])
def test_each_replica_reads_its_own_rows_and_what_it_was_given(
        data_dir: Path, tmp_path: Path, replicas: int, batch: int, slow: bool) -> None:
    """Data by role (issue 32): a replica reads, from the dataset file, its own block of
    about 1/R of the training rows, the rows of the other replicas' units it was given
    (load balancing, backups), its part of the labels the ranks check at start, and the evaluation
    set only if it evaluated (and evaluations stay with one replica): nothing else. With
    a 10x slower replica, the others take some of its units and read their rows."""
    config = write(tmp_path, "c.toml", toml(SOFTMAX, batch, work_unit_size=100).replace(
        'path = "synth.h5"', f'path = "{data_dir / "synth.h5"}"'))
    summary, _ = finished(train(replicas + 2, config, tmp_path / "out", "run.max_steps=4",
                                "run.eval_every_seconds=100",
                                env=slow_env(1, 1) if slow else None), tmp_path / "out")
    row, label, n_test = stored_row_bytes(data_dir / "synth.h5")
    n_train = 3000
    ranks = replicas + 2

    def checked_labels(rank: int) -> int:  # the rank's part of the labels checked at start
        return sum(n * (rank + 1) // ranks - n * rank // ranks for n in (n_train, n_test)) * label
    batch = min(batch, n_train)
    units = unit_ranges(batch, 100)
    blocks = owner_blocks(units, unit_owners(len(units), replicas), replicas, n_train, batch)
    entries = sorted(summary["replicas"], key=lambda r: r["replica"])
    assert [r["own_rows"] for r in entries] == [hi - lo for _, _, lo, hi in blocks]
    assert sum(r["own_rows"] for r in entries) == n_train
    for r in entries:
        evaluated = n_test * row if r["evaluations"] else 0
        assert r["data_bytes_read"] == (checked_labels(r["rank"]) + r["own_rows"] * row
                                        + r["foreign_bytes"] + evaluated), r
        assert r["foreign_reads"] <= r["foreign_units"]
        assert r["foreign_bytes"] <= r["foreign_reads"] * 100 * row
        assert r["own_rows"] * row < n_train * row * 0.6  # not the whole set, as before
    assert [r["evaluations"] > 0 for r in entries].count(True) == 1, entries
    assert sum(r["evaluations"] for r in entries) >= 2  # x0's and the final one
    if slow:
        assert sum(r["foreign_units"] for r in entries if r["replica"] != 1) > 0, entries


def test_coordinator_traffic_is_o_of_m_not_of_the_parameters(data_dir: Path,
                                                             tmp_path: Path) -> None:
    big = ('[{ type = "dense", units = 256, activation = "relu" }, '
           '{ type = "dense", units = 4, activation = "softmax" }]')
    runs = {}
    for name, layers, m in [("small3", SOFTMAX, 3), ("big3", big, 3), ("big12", big, 12)]:
        config = write(data_dir, f"bytes_{name}.toml", toml(layers, m=m))
        proc = train(4, config, tmp_path / name, "run.max_steps=12",
                     "cluster.ps_shards=2", "run.eval_every_seconds=100")
        summary, metrics = finished(proc, tmp_path / name)
        runs[name] = (summary, shard_bytes_per_iteration(metrics))
    params_small, params_big = runs["small3"][0]["num_params"], runs["big3"][0]["num_params"]
    assert params_big > 60 * params_small
    small, big3, big12 = (max(runs[k][1]) for k in ("small3", "big3", "big12"))
    # The same bytes per iteration for 68 and 5,000 parameters ...
    assert abs(big3 - small) <= 0.05 * small
    # ... growing with m (6m+1 + 2m+1 numbers per shard), far below one vector.
    assert big3 < big12 < 4 * big3
    assert big12 < params_big * 4 / 2
    per_scalar = (big12 - big3) / (2 * 8 * (12 - 3))  # 2 shards, 8 numbers per slot
    assert 8 <= per_scalar <= 12  # a float64 plus pickling
    replica_small = runs["small3"][0]["coordinator_traffic"]["replica_bytes"]
    replica_big = runs["big3"][0]["coordinator_traffic"]["replica_bytes"]
    assert replica_big < 2 * replica_small  # units and decisions, never gradients
    # The vectors are the replicas': each push sends, each fetch receives, the parameters
    # plus a HEADER of 4 floats per shard (2 shards here).
    summary = runs["big3"][0]
    vector = 4 * (summary["num_params"] + 2 * HEADER)
    for replica in summary["replicas"]:
        assert replica["bytes_sent"] == replica["pushes"] * vector > 0, replica
        assert replica["bytes_received"] == replica["fetches"] * vector > 0, replica
    assert summary["bytes_sent"] == sum(r["bytes_sent"] for r in summary["replicas"])


# -- configuration errors --------------------------------------------------------------------


def every_rank_exits_2(n: int, config: Path, out: Path, *overrides: str):
    """The real command line on n ranks, each printing its exit status: every one is 2
    (mpiexec reports only one), with one error line."""
    proc = run_mpi(n, [PROGRAMS / "cli_exit_status.py", "train", config,
                       *set_args(f'run.out_dir="{out}"', *overrides)], timeout=TIMEOUT)
    assert proc.returncode == 2, proc.stderr
    assert exit_statuses(proc) == [2] * n, proc.stdout + proc.stderr
    assert proc.stderr.count("distbelief: error:") == 1, proc.stderr
    return proc


@pytest.mark.parametrize("n, shards", [(3, 2), (2, 1)])  # no replica left
def test_rank_counts_that_do_not_fit_fail_on_every_rank(data_dir: Path, tmp_path: Path,
                                                        n: int, shards: int) -> None:
    config = write(data_dir, "ranks.toml", toml())
    proc = every_rank_exits_2(n, config, tmp_path / "out", f"cluster.ps_shards={shards}")
    assert "coordinator" in proc.stderr and f"mpiexec -n {shards + 2}" in proc.stderr
    assert not (tmp_path / "out" / "summary.json").exists()


@pytest.mark.parametrize("n", [4, 5])
def test_work_unit_larger_than_the_batch_fails_on_every_rank(data_dir: Path, tmp_path: Path,
                                                             n: int) -> None:
    config = write(data_dir, "unit.toml", toml(work_unit_size=5000, batch=1000))
    proc = every_rank_exits_2(n, config, tmp_path / "out")
    assert "work_unit_size = 5000" in proc.stderr


@pytest.mark.parametrize("override,message", [
    ("optimizer.m=0", "optimizer.m = 0 is invalid"),
    ('optimizer.line_search="newton"', "optimizer.line_search"),
    ("optimizer.wolfe_c2=1.0", "wolfe_c2"),
    ("optimizer.backup_copies=0", "optimizer.backup_copies = 0 is invalid"),
])
def test_bad_sandblaster_options(override: str, message: str) -> None:
    # A bad value given with --set is refused as a --set error (apply_overrides) or, when
    # it only fails against the rest of the configuration, by config_from_dict.
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        raw = apply_overrides({"model": {"layers": [{"type": "dense", "units": 2}]},
                               "data": {"path": "x.h5"},
                               "optimizer": {"algorithm": "sandblaster"},
                               "run": {"max_steps": 1}}, [override])
        config_from_dict(raw, Path("exp.toml"))


def test_hash_follows_what_sandblaster_trains_not_how_units_are_dealt() -> None:
    from distbelief.config import config_hash

    def hashed(*overrides: str) -> str:
        raw = apply_overrides({"model": {"layers": [{"type": "dense", "units": 2}]},
                               "data": {"path": "x.h5"},
                               "optimizer": {"algorithm": "sandblaster"},
                               "run": {"max_steps": 1}}, overrides)
        return config_hash(config_from_dict(raw, Path("exp.toml")))

    base = hashed()
    assert hashed("optimizer.m=3") != base and hashed("optimizer.wolfe_c2=0.5") != base
    assert hashed("optimizer.work_unit_size=7", "optimizer.push_every_units=1",
                  "optimizer.backup_copies=3", "optimizer.gradient_tolerance=0") == base


# -- checkpoints --------------------------------------------------------------------------------


@pytest.mark.both_mpis
@pytest.mark.nodes  # also on simulated nodes (conftest.py: DISTBELIEF_TEST_NODES)
def test_checkpoint_holds_the_history_and_a_resume_on_other_shards_continues(
        data_dir: Path, tmp_path: Path) -> None:
    from distbelief.records.checkpoint import checkpoint_root, find_latest

    config = write(data_dir, "resume.toml", toml(m=4))
    half = train(5, config, tmp_path / "resumed", "run.max_steps=8", "cluster.ps_shards=2")
    finished(half, tmp_path / "resumed")
    found, damaged = find_latest(checkpoint_root(tmp_path / "resumed"))
    assert found is not None and not damaged and found.step == 8
    assert found.manifest["algorithm"] == "sandblaster"
    names = found.manifest["optimizer_state"]
    assert {"s000", "s000_lo", "y003", "y003_lo", "x_lo"} <= set(names)  # m = 4 pairs
    params, state = found.read_state()
    assert params.dtype == np.float32 and state["s003"].shape == params.shape
    assert np.abs(state["s003"]).max() > 0 and np.abs(state["x_lo"]).max() > 0

    rest = train(6, config, tmp_path / "resumed", "run.max_steps=16", "cluster.ps_shards=3")
    summary, metrics = finished(rest, tmp_path / "resumed")
    assert "resuming from" in rest.stdout
    straight, straight_metrics = finished(
        train(4, config, tmp_path / "straight", "run.max_steps=16"), tmp_path / "straight")
    assert summary["iterations"] == straight["iterations"] == 16
    # The resumed iterations follow the straight run's: same steps (the history was
    # restored: without it the first step would be a short steepest-descent one) and the
    # same losses, up to the run-to-run noise of summing unit gradients in arrival order
    # (about 1e-7 relative per iteration; float64 vectors are stored as float32 hi + lo).
    resumed = {m["step"]: m for m in metrics if m["kind"] == "train"}
    reference = {m["step"]: m for m in straight_metrics if m["kind"] == "train"}
    assert resumed[9]["loss"] == pytest.approx(reference[9]["loss"], rel=2e-6)
    for step in range(9, 17):
        assert resumed[step]["step_size"] == reference[step]["step_size"]
        assert resumed[step]["loss"] == pytest.approx(reference[step]["loss"], rel=1e-4)
    assert [m["step"] for m in metrics if m["kind"] == "resume"] == [8]


def test_sigterm_stops_with_a_checkpoint_and_the_job_resumes(data_dir: Path,
                                                              tmp_path: Path) -> None:
    """SLURM's time limit: mpiexec forwards SIGTERM to every rank; the run ends at the end
    of the iteration with a checkpoint and exit 0, and `train --resume` continues it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    config = write(data_dir, "sigterm.toml", toml(batch=500))
    out = tmp_path / "out"
    cmd = [*mpiexec(5), sys.executable, "-m", "distbelief", "train", str(config),
           *set_args(f'run.out_dir="{out}"', "run.max_steps=0", "run.max_seconds=90",
                 "optimizer.gradient_tolerance=0")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=job_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (
                (out / "metrics.jsonl").is_file()
                and '"step": 3' in (out / "metrics.jsonl").read_text()):
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "SIGTERM" and summary["wall_seconds"] < 60
    stopped_at = summary["iterations"]
    assert (out / "checkpoints" / f"ckpt-{stopped_at:010d}").is_dir()
    more = run_mpi(4, ["-m", "distbelief", "train", config, "--resume",
                       *set_args(f'run.out_dir="{out}"', f"run.max_steps={stopped_at + 3}")],
                   timeout=TIMEOUT)
    summary, _ = finished(more, out)
    assert summary["iterations"] == stopped_at + 3 and summary["stop_reason"] == "max_steps"


def test_backups_wait_until_a_unit_is_late() -> None:
    table = WorkUnitTable(2, push_every=1, backup_copies=2, backup_after=1.0)
    assert table.next_unit(0, now=10.0) == 0 and table.next_unit(1, now=10.0) == 1
    assert table.settle(1, [1], now=10.5) == COMMIT and table.unit_seconds == [0.5]
    assert table.next_unit(1, now=10.75) is None  # unit 0 is out for 0.75 s only: no copy
    assert table.next_unit(1, now=11.2) == 0  # now it is late
    assert table.stats.backups_issued == 1
