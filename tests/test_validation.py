"""A held-out validation split (data.validation, or a /val group in the file): evaluations
and stop rules use it, the test set is evaluated once at the end, and both are kept apart
in metrics.jsonl, summary.json, `status`, `evaluate` and the report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import finished, set_args
from helpers.configs import small_config_text
from helpers.mpi_jobs import run_cli, run_mpi

from distbelief.config import config_from_dict, config_hash, hashed_settings, load_config
from distbelief.data.hdf5 import (
    DatasetWriter,
    TrainShard,
    load_split,
    open_dataset,
    read_rows,
    with_validation,
)
from distbelief.errors import DataError
from distbelief.records.metrics import read_metrics


def _sgd_config(**run: object) -> str:
    return small_config_text(32, data={"validation": 0.1}, optimizer={"algorithm": "sgd"},
                             cluster=None, run={"max_steps": 300, **run})


# -- the data layer ------------------------------------------------------------------------

def test_the_held_out_rows_are_the_end_of_train_and_no_shard_reads_them(synthetic_folder):
    path = synthetic_folder("held") / "synth.h5"
    whole = open_dataset(path)
    info = with_validation(whole, 0.1)
    assert (info.n_train, info.n_val, info.held_out) == (3600, 400, 400)
    x_all, y_all = read_rows(whole, "train", 0, whole.n_train)
    x_val, y_val = load_split(info, "validation")
    scale = np.float32(whole.scale)
    np.testing.assert_array_equal(x_val, x_all[3600:].astype(np.float32) * scale)
    np.testing.assert_array_equal(y_val, y_all[3600:])
    shards = [TrainShard(info, r, 3) for r in range(3)]
    assert [s.start for s in shards] == [0, 1200, 2400] and shards[-1].stop == 3600
    assert with_validation(whole, 0.0) is whole


@pytest.mark.parametrize(("rows", "fraction"), [(2, 0.1), (1, 0.5)])
def test_a_fraction_that_holds_out_no_row_is_refused(tmp_path, rows, fraction):
    path = tmp_path / "tiny.h5"
    with DatasetWriter(path, input_shape=(2,), num_classes=2, n_train=rows, n_test=1,
                       stored_dtype="float32", scale=1.0, source="test") as w:
        w.append("train", np.zeros((rows, 2), np.float32), np.arange(rows) % 2)
        w.append("test", np.zeros((1, 2), np.float32), np.array([0]))
        w.commit()
    with pytest.raises(DataError, match="at least one row on each side"):
        with_validation(open_dataset(path), fraction)


def _with_val_group(path: Path, n_val: int = 300, shape: tuple[int, ...] = (16,)) -> Path:
    rng = np.random.default_rng(0)
    with DatasetWriter(path, input_shape=shape, num_classes=4, n_train=2000, n_test=400,
                       stored_dtype="float32", scale=1.0, source="test", n_val=n_val) as w:
        for split, n in (("train", 2000), ("test", 400), ("val", n_val)):
            w.append(split, rng.normal(size=(n, *shape)).astype(np.float32),
                     rng.integers(0, 4, n))
        w.commit()
    return path


def test_a_val_group_is_the_validation_split_and_refuses_a_fraction_too(tmp_path):
    info = open_dataset(_with_val_group(tmp_path / "v.h5"))
    assert (info.n_train, info.n_val, info.held_out) == (2000, 300, 0)
    x, y = load_split(info, "validation", limit=50)
    assert x.shape == (50, 16) and y.shape == (50,)
    with pytest.raises(DataError, match="has a validation split of its own"):
        with_validation(info, 0.1)


def test_a_file_without_a_validation_split_says_how_to_get_one(synthetic_folder):
    info = open_dataset(synthetic_folder("noval") / "synth.h5")
    with pytest.raises(DataError, match="data.validation"):
        load_split(info, "validation")


def test_the_setting_is_validated_and_hashed_only_when_set(tmp_path):
    raw = {"model": {"layers": [{"type": "dense", "units": 4, "activation": "softmax"}]},
           "data": {"path": "d.h5"}, "run": {"max_steps": 1}}
    plain = config_from_dict(raw)
    held = config_from_dict({**raw, "data": {"path": "d.h5", "validation": 0.2}})
    assert "validation" not in hashed_settings(plain)["data"]  # old checkpoints still load
    assert hashed_settings(held)["data"]["validation"] == 0.2
    assert config_hash(plain) != config_hash(held)
    from distbelief.errors import ConfigError
    with pytest.raises(ConfigError, match=r"data\.validation"):
        config_from_dict({**raw, "data": {"path": "d.h5", "validation": 0.7}})


def test_eval_samples_is_checked_against_the_validation_split(synthetic_folder):
    folder = synthetic_folder("evalsamples", {"c.toml": _sgd_config(eval_samples=450)})
    with pytest.raises(DataError, match="400 validation samples"):
        load_config(folder / "c.toml")


# -- runs ----------------------------------------------------------------------------------

def test_sgd_evaluates_on_validation_and_tests_once_at_the_end(synthetic_folder):
    folder = synthetic_folder("sgdval", {"c.toml": _sgd_config(target_accuracy=0.45)})
    out = folder / "runs" / "c"
    proc = run_cli(["train", folder / "c.toml"], cwd=folder)
    summary, lines = finished(proc, out)
    evals = [x for x in lines if x["kind"] == "eval"]
    assert evals and all("val_accuracy" in x and "test_accuracy" not in x for x in evals)
    tests = [x for x in lines if x["kind"] == "test"]
    assert len(tests) == 1 and tests[0]["step"] == summary["steps"]
    assert summary["eval_split"] == "validation"
    assert summary["final_val_accuracy"] == evals[-1]["val_accuracy"]
    assert summary["best_val_accuracy"] == max(x["val_accuracy"] for x in evals)
    assert summary["final_test_accuracy"] == tests[0]["test_accuracy"]
    assert summary["test_samples"] == 500
    # The target is judged on validation accuracy.
    assert summary["reached_target"]
    hit = next(x for x in evals if x["val_accuracy"] >= 0.45)
    assert summary["target_reached_accuracy"] == hit["val_accuracy"]
    assert "validation accuracy" in proc.stdout and "test set, evaluated once" in proc.stdout
    # `evaluate` on the same checkpoint gives the same figures, on either split.
    test = json.loads(run_cli(["evaluate", out, "--json"]).stdout)
    val = json.loads(run_cli(["evaluate", out, "--split", "validation", "--json"]).stdout)
    assert test["accuracy"] == pytest.approx(summary["final_test_accuracy"], abs=1e-9)
    assert val["samples"] == 400
    assert val["accuracy"] == pytest.approx(summary["final_val_accuracy"], abs=1e-12)
    status = run_cli(["status", out])
    assert "last evaluation:   validation accuracy" in status.stdout


def test_resume_keeps_the_split_and_another_split_is_refused(synthetic_folder):
    folder = synthetic_folder("resumeval", {"c.toml": _sgd_config()})
    out = folder / "runs" / "c"
    first, _ = finished(run_cli(["train", folder / "c.toml", *set_args("run.max_steps=150")],
                                cwd=folder), out)
    assert first["steps"] == 150
    summary, lines = finished(run_cli(["train", folder / "c.toml"], cwd=folder), out)
    assert summary["steps"] == 300 and summary["eval_split"] == "validation"
    assert [x["step"] for x in lines if x["kind"] == "test"][-1] == 300
    other = run_cli(["train", folder / "c.toml", *set_args("data.validation=0.2")], cwd=folder)
    assert other.returncode == 2 and "data.validation" in other.stderr


@pytest.mark.parametrize("n", [3, 4])
def test_downpour_evaluates_on_validation_and_tests_at_the_end(synthetic_folder, n):
    config = small_config_text(32, data={"validation": 0.15}, run={"max_steps": 600})
    folder = synthetic_folder(f"dpval{n}", {"c.toml": config})
    out = folder / "runs" / "c"
    proc = run_mpi(n, ["-m", "distbelief", "train", folder / "c.toml"], cwd=folder,
                   timeout=180)
    summary, lines = finished(proc, out)
    assert summary["eval_split"] == "validation" and summary["final_val_accuracy"] > 0.4
    assert summary["final_test_accuracy"] is not None
    evals = [x for x in lines if x["kind"] == "eval"]
    assert evals and all("val_accuracy" in x and "test_accuracy" not in x for x in evals)
    # The test set scores the model the validation split chose: the best one.
    assert summary["test_model"] == "best"
    assert summary["test_step"] == summary["best"]["step"]
    assert summary["best"]["accuracy"] == max(x["val_accuracy"] for x in evals)
    assert proc.stdout.count("test set, evaluated once") == 1


def test_report_names_the_validation_axis(synthetic_folder, tmp_path):
    pytest.importorskip("matplotlib")
    folder = synthetic_folder("reportval", {"c.toml": _sgd_config()})
    out = folder / "runs" / "c"
    finished(run_cli(["train", folder / "c.toml"], cwd=folder), out)
    from distbelief.records.report import load_run, write_metrics_csv

    run = load_run(out)
    assert run.evals and all(x["accuracy"] == x["val_accuracy"] for x in run.evals)
    from distbelief.records.report import _accuracy_label

    assert _accuracy_label([run]) == "validation accuracy"
    csv = write_metrics_csv([run], tmp_path).read_text().splitlines()
    header = csv[0].split(",")
    assert "val_accuracy" in header
    assert any(row.split(",")[header.index("val_accuracy")] for row in csv[1:])
    assert read_metrics(out / "metrics.jsonl")[-1]["kind"] == "test"


def test_the_final_test_reads_the_split_in_blocks_and_gets_the_whole_set_figures(
        synthetic_folder, monkeypatch):
    from distbelief.algorithms import common
    from distbelief.config import build_network

    folder = synthetic_folder("blocks", {"c.toml": _sgd_config()})
    config = load_config(folder / "c.toml")
    info = with_validation(open_dataset(config.data.path), 0.1)
    network = build_network(config, info)
    params = network.init_params(1)
    x, y = load_split(info, "test")
    whole = network.evaluate(params, x, y, batch_size=common.EVAL_BATCH_SIZE)
    monkeypatch.setattr(common, "EVAL_BLOCK_BYTES", 1)  # one batch of 1000 rows per block
    blocks = common.evaluate_split(network, params, info, "test")
    assert blocks.rows == 500
    assert blocks.figures == pytest.approx(whole.figures, abs=1e-9)
    monkeypatch.setattr(common, "EVAL_BATCH_SIZE", 64)  # 8 blocks, the last one short
    blocks = common.evaluate_split(network, params, info, "validation")
    xv, yv = load_split(info, "validation")
    assert blocks.figures == pytest.approx(
        network.evaluate(params, xv, yv, batch_size=64).figures, abs=1e-9)


def test_a_streamed_run_refuses_an_evaluation_set_larger_than_its_memory(synthetic_folder):
    config = small_config_text(32, data={"in_memory": False, "stream_memory_mb": 4},
                               optimizer={"algorithm": "sgd"}, cluster=None,
                               run={"max_steps": 10})
    folder = synthetic_folder("bigeval", {"c.toml": config}, input_shape=(64, 64, 1),
                              n_train=600, n_test=400)
    # 400 test rows of 64x64 float32 are 6.25 MB, above the 4 MB the run may hold.
    with pytest.raises(DataError, match=r"run.eval_samples = 256 or fewer"):
        load_config(folder / "c.toml")
    assert load_config(folder / "c.toml", ["run.eval_samples=256"]).run.eval_samples == 256


def test_a_streamed_downpour_run_holds_out_its_validation_rows(synthetic_folder):
    config = small_config_text(32, data={"validation": 0.1, "in_memory": False,
                                         "stream_memory_mb": 4}, run={"max_steps": 600})
    folder = synthetic_folder("streamval", {"c.toml": config})
    out = folder / "runs" / "c"
    proc = run_mpi(3, ["-m", "distbelief", "train", folder / "c.toml"], cwd=folder,
                   timeout=180)
    summary, _ = finished(proc, out)
    assert summary["eval_split"] == "validation" and summary["eval_samples"] == 400
    assert summary["final_val_accuracy"] > 0.4 and summary["final_test_accuracy"] > 0.4
    from distbelief.data.stream import StreamingTrainShard

    info = with_validation(open_dataset(folder / "synth.h5"), 0.1)
    shards = [StreamingTrainShard(info, r, 2, memory_bytes=4 << 20) for r in range(2)]
    assert max(stop for s in shards for _, stop in s.blocks) == 3600


def test_a_partitioned_run_evaluates_its_test_set_from_its_checkpoint(synthetic_folder):
    # Model-parallel sgd checkpoints the whole model on rank 0, so its test set is
    # evaluated once at the end like any other run's.
    config = small_config_text(32, data={"validation": 0.1}, optimizer={"algorithm": "sgd"},
                               cluster={"partitions": 2, "ps_shards": None},
                               run={"max_steps": 100})
    folder = synthetic_folder("partval", {"c.toml": config})
    out = folder / "runs" / "c"
    proc = run_mpi(2, ["-m", "distbelief", "train", folder / "c.toml"], cwd=folder)
    summary, _ = finished(proc, out)
    assert summary["final_val_accuracy"] > 0 and summary["final_test_accuracy"] > 0
    assert "test_not_evaluated" not in summary
    assert "the test set was not evaluated" not in proc.stdout
