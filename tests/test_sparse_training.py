"""Sparse models trained end to end (issue 44): the three workloads of the examples
(sparse logistic regression, matrix factorisation, embeddings feeding a dense tower) on
synthetic data with a planted model, with sgd in this process and with Downpour and
Hogwild under mpiexec; then evaluated, exported and loaded back. The floors are the
planted models' own test losses, printed by the generator."""

from __future__ import annotations

import json
import shutil
import signal
import tomllib
from pathlib import Path

import numpy as np
import pytest
from helpers import DELAY, exit_statuses
from helpers.mpi_jobs import REPO, job_env, run_mpi, survive_a_death

import distbelief
from distbelief.cli import main
from distbelief.data import write_dataset
from distbelief.data.hdf5 import load_test, open_dataset
from distbelief.data.sparse import SparseRows
from distbelief.data.synthetic_sparse import Options, make_sparse_synthetic
from distbelief.errors import ConfigError
from distbelief.records import checkpoint as ckpt
from distbelief.runtime.launching.faults import ENV as FAULTS

TIMEOUT = 120
EXAMPLES = REPO / "examples"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Small versions of the examples' data, and their configs beside them."""
    folder = tmp_path_factory.mktemp("sparse")
    made = {
        "sparse_logistic": make_sparse_synthetic("logistic", folder / "sparse_logistic.h5",
                                                 Options(train=60_000, test=4_000,
                                                         features=2_000, nnz=20)),
        "matrix_factorisation": make_sparse_synthetic(
            "mf", folder / "matrix_factorisation.h5",
            Options(train=100_000, test=4_000, users=300, items=200)),
        "embeddings_tower": make_sparse_synthetic(
            "fields", folder / "embeddings_tower.h5",
            Options(train=60_000, test=4_000, fields=4, field_rows=100)),
    }
    for name, synthetic in made.items():
        shutil.copy(EXAMPLES / f"{name}.toml", folder)
        FLOORS[name] = (synthetic.floor, synthetic.baseline)
    return folder


FLOORS: dict[str, tuple[float, float]] = {}
"""Each workload's (planted model's test loss, a constant predictor's), as generated."""


@pytest.fixture
def keep_sigint():
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


def config_of(folder: Path, name: str, out: Path, **changes) -> dict:
    config = tomllib.loads((folder / f"{name}.toml").read_text())
    config["data"]["path"] = str(folder / f"{name}.h5")
    for section, values in changes.items():
        config[section] = {**config.get(section, {}), **values}
    config["run"]["out_dir"] = str(out)
    return config


def test_matrix_factorisation_reaches_its_floor_and_loads_back(data: Path, tmp_path: Path,
                                                               keep_sigint) -> None:
    floor, constant = FLOORS["matrix_factorisation"]
    out = tmp_path / "mf"
    summary = distbelief.train(config_of(data, "matrix_factorisation", out,
                                         run={"target_loss": 1.5 * floor,
                                              "max_seconds": 60}))
    assert summary["stop_reason"] == "target_loss", summary["stop_reason"]
    assert summary["final_test_loss"] < 1.7 * floor < constant / 10
    model = distbelief.load_model(out)
    x, y = load_test(open_dataset(data / "matrix_factorisation.h5"))
    assert x.dtype == np.int64 and x.shape[1] == 2
    assert model.evaluate(x, y).loss == pytest.approx(summary["final_test_loss"], rel=1e-5)
    exported = tmp_path / "mf.safetensors"
    assert main(["export", str(out), "--out", str(exported)]) == 0
    again = distbelief.load_model(exported)
    assert np.array_equal(again.predict(x[:100]), model.predict(x[:100]))
    names = dict(again.named_parameters())
    assert names["layers.0.table_0"].shape == (300, 8)
    assert names["layers.0.table_1"].shape == (200, 8)


def test_embeddings_feed_a_dense_tower_in_one_process(data: Path, tmp_path: Path,
                                                      keep_sigint) -> None:
    floor, constant = FLOORS["embeddings_tower"]
    summary = distbelief.train(config_of(data, "embeddings_tower", tmp_path / "fields",
                                         optimizer={"algorithm": "sgd"},
                                         run={"max_steps": 2500}))
    # Half way from the constant predictor down to the floor, in 2,500 steps.
    assert summary["final_test_loss"] < (floor + constant) / 2, summary["final_test_loss"]
    assert summary["final_test_auc"] > 0.75


def test_a_model_that_does_not_fit_the_features_is_one_config_error(data: Path,
                                                                   tmp_path: Path) -> None:
    dense = {"type": "dense", "units": 1, "activation": "sigmoid"}
    config = config_of(data, "sparse_logistic", tmp_path / "a")
    config["model"]["layers"] = [dense]
    with pytest.raises(ConfigError, match="sparse features .CSR rows.: the first layer must"):
        distbelief.train(config)
    config = config_of(data, "matrix_factorisation", tmp_path / "b")
    config["model"]["layers"] = [{"type": "sparse_linear", "units": 1,
                                  "activation": "linear"}]
    with pytest.raises(ConfigError, match="needs sparse features .CSR rows., but the data"):
        distbelief.train(config)
    rng = np.random.default_rng(0)
    x = rng.random((300, 30), dtype=np.float32) * (rng.random((300, 30)) < 0.2)
    write_dataset(tmp_path / "classes.h5", SparseRows.from_dense(x),
                  rng.integers(0, 3, 300), test_fraction=0.2)
    config = config_of(data, "sparse_logistic", tmp_path / "c",
                       cluster={"partitions": 2}, optimizer={"algorithm": "sgd"},
                       model={"loss": "cross_entropy", "layers": [
                           {"type": "sparse_linear", "units": 3, "activation": "softmax"}]})
    config["data"]["path"] = str(tmp_path / "classes.h5")
    with pytest.raises(ConfigError, match="a sparse model trains with partitions = 1"):
        distbelief.train(config)
    assert not any((tmp_path / name).exists() for name in "abc")


@pytest.mark.parametrize("algorithm, ranks, name, locked", [
    ("downpour", 3, "sparse_logistic", False),
    ("hogwild", 2, "matrix_factorisation", False),
    ("hogwild", 2, "sparse_logistic", True),
], ids=["downpour-logistic", "hogwild-mf", "locked-hogwild-logistic"])
def test_sparse_models_train_under_mpiexec(data: Path, tmp_path: Path, algorithm: str,
                                           ranks: int, name: str, locked: bool) -> None:
    floor, constant = FLOORS[name]
    out = tmp_path / "out"
    target = floor + (constant - floor) / 5 if name == "sparse_logistic" else 1.5 * floor
    overrides = [f'run.out_dir="{out}"', f'optimizer.algorithm="{algorithm}"',
                 f"run.target_loss={target}", "run.max_seconds=60",
                 f'data.path="{data / name}.h5"']
    if algorithm == "hogwild":
        overrides += ["cluster.ps_shards=0", f"optimizer.locked_updates={str(locked).lower()}"]
    args = ["-m", "distbelief", "train", data / f"{name}.toml"]
    for override in overrides:
        args += ["--set", override]
    proc = run_mpi(ranks, args, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "target_loss"
    assert summary["final_test_loss"] < target * 1.1
    assert len(summary["peak_rss"]) == ranks
    assert not (out / ".hogwild-update.lock").exists()  # the lock's file goes with the run


def test_easgd_on_a_sparse_model_moves_the_whole_vector_over_rma(data: Path,
                                                              tmp_path: Path) -> None:
    # EASGD runs on Downpour's machinery but its replicas push whole vectors: the default
    # table_pulls = "rows" must not open a row-sharded server under them (RMA failed).
    name, out = "sparse_logistic", tmp_path / "out"
    floor, constant = FLOORS[name]
    target = floor + (constant - floor) / 5
    args = ["-m", "distbelief", "train", data / f"{name}.toml"]
    for override in (f'run.out_dir="{out}"', 'optimizer.algorithm="averaging"',
                     "optimizer.elastic_alpha=0.3", "cluster.ps_shards=1",
                     f"run.target_loss={target}", "run.max_seconds=60",
                     f'data.path="{data / name}.h5"'):
        args += ["--set", override]
    proc = run_mpi(3, args, timeout=TIMEOUT, env={**job_env(), "DISTBELIEF_PS_TRANSPORT": "rma"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "target_loss", summary["stop_reason"]
    assert [s["transport"] for s in summary["shards"]] == ["rma"]


@pytest.mark.parametrize("transport", ["shared", pytest.param("rma", marks=pytest.mark.matrix)])
def test_a_staleness_bound_holds_while_replicas_move_rows(data: Path, tmp_path: Path,
                                                          transport: str) -> None:
    # optimizer.max_staleness = 1 with table_pulls = "rows" (the default), 1 shard + 2
    # replicas on one node (RMA too in the matrix), fetching every 2 steps and pushing
    # every step: the bound's gate lets blocks start on the rows held and fetches the next
    # steps' rows itself. Replica 1 (rank 2) takes 1 ms longer a step: replica 0 waits for
    # it, never more than 1 clock ahead, and the model still trains to its target.
    name, out = "sparse_logistic", tmp_path / "out"
    floor, constant = FLOORS[name]
    target = floor + (constant - floor) / 3
    args = ["-m", "distbelief", "train", data / f"{name}.toml"]
    for override in (f'run.out_dir="{out}"', 'optimizer.algorithm="downpour"',
                     "optimizer.max_staleness=1", "optimizer.n_fetch=2", "optimizer.n_push=1",
                     "cluster.ps_shards=1", f"run.target_loss={target}", "run.max_seconds=60",
                     f'data.path="{data / name}.h5"'):
        args += ["--set", override]
    env = {**job_env(), FAULTS: "delay:2:0:0.001s", "DISTBELIEF_PS_TRANSPORT": transport}
    proc = run_mpi(3, args, timeout=TIMEOUT, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "target_loss", summary["stop_reason"]
    assert summary["final_test_loss"] < target * 1.1
    fast, slow = summary["replicas"]
    assert fast["rows_pulled"] > 0 and slow["rows_pulled"] > 0  # they moved rows
    lead = summary["clock_lead"]
    assert lead["bound"] == 1 and lead["max"] == 1, lead  # reached, never passed
    assert fast["clock_bound"]["waits"] > 0, fast["clock_bound"]
    assert fast["pushes"] <= slow["pushes"] + 2, (fast["pushes"], slow["pushes"])
    assert [s["transport"] for s in summary["shards"]] == [transport]


@pytest.mark.matrix
@pytest.mark.parametrize("transport", ["rma", "shared"])
def test_a_replica_killed_while_moving_rows_leaves_the_others_to_finish(
        data: Path, tmp_path: Path, transport: str) -> None:
    # table_pulls = "rows" (the default): replica 1 (rank 3) of 3 is killed -9 after its
    # 100th step; the others finish the steps, the shard writes the lost one off, the run
    # ends cleanly and its final checkpoint says who was lost. 2 shards: the evaluation
    # rows come from both.
    out, steps = tmp_path / "out", 600
    args = [REPO / "tests" / "mpi_programs" / "cli_exit_status.py", "train",
            data / "sparse_logistic.toml"]
    for override in (f'run.out_dir="{out}"', 'optimizer.algorithm="downpour"',
                     "cluster.ps_shards=2",
                     f'data.path="{data / "sparse_logistic.h5"}"', f"run.max_steps={steps}",
                     "run.max_seconds=0", "run.heartbeat_timeout_seconds=5",
                     "run.stall_warn_seconds=5", "run.stall_abort_seconds=20"):
        args += ["--set", override]
    env = {**job_env(), FAULTS: f"kill:3:100 {DELAY}", "DISTBELIEF_PS_TRANSPORT": transport}
    proc = run_mpi(5, args, timeout=TIMEOUT, env=env, launcher_options=survive_a_death())
    output = proc.stdout + proc.stderr
    assert exit_statuses(proc) == [0, 0, 0, 137, 0], output[-3000:]
    assert "stall:" not in output, output[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "max_steps", output[-3000:]
    assert steps - 1 <= summary["steps"] <= steps
    assert [(x["replica"], x["ranks"]) for x in summary["lost_replicas"]] == [(1, [3])]
    assert [r["replica"] for r in summary["replicas"]] == [0, 2]
    assert all(r["rows_pulled"] > 0 for r in summary["replicas"])  # they moved rows
    final = ckpt.find_latest(ckpt.checkpoint_root(out))[0]
    assert final.step == summary["steps"] and final.manifest["lost_replicas"] == [1]
    # Shard 0 evaluated the evaluation set's rows alone, gathered from the shards; the same
    # figure as the whole final vector's, and no best model (it would be the whole vector).
    x, y = load_test(open_dataset(data / "sparse_logistic.h5"))
    assert distbelief.load_model(out).evaluate(x, y).loss == pytest.approx(
        summary["final_test_loss"], rel=1e-5)
    assert ckpt.find_best(ckpt.checkpoint_root(out)) == (None, [])
