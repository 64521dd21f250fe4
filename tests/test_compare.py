"""`distbelief compare`: the plan (rank counts, lists expanded, the target of any metric),
the table from fake run folders (accuracy, a falling loss, r2), the launcher option, one
real tiny comparison with its resume, one of a regression to a loss target, and Ctrl-C."""

from __future__ import annotations

import csv
import json
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.configs import small_config_text
from helpers.mpi_jobs import REPO, job_env, run_cli

from distbelief.compare import plan, results, running
from distbelief.config import TARGET_METRICS
from distbelief.errors import ConfigError
from distbelief.records.metrics import Target

CONFIG = small_config_text(
    16, 3, data={"batch_size": 16}, optimizer={"algorithm": None}, cluster=None,
    run={"max_steps": None, "target_accuracy": 0.6, "max_seconds": 20, "threads": None})


@pytest.fixture(scope="module")
def config(synthetic_folder) -> Path:
    return synthetic_folder("compare", {"exp.toml": CONFIG}, n_train=2000, n_test=300,
                            input_shape=(8,), num_classes=3, seed=0) / "exp.toml"


ACCURACY = Target("accuracy", 0.88)  # the fake runs' target (fake_run)


@pytest.fixture(scope="module")
def regression_config(tmp_path_factory) -> Path:
    """examples/regression.toml (mse, validation split, run.target_loss) beside a small
    regression.h5 of the example's planted model (noise floor: a loss of 0.01)."""
    from distbelief.data.arrays import write_dataset

    folder = tmp_path_factory.mktemp("regression")
    planted = runpy.run_path(str(REPO / "examples" / "regression.py"))["planted"]
    x, y = planted(rows=4000)
    write_dataset(folder / "regression.h5", x[:3500], y[:3500], x[3500:], y[3500:])
    config = folder / "regression.toml"
    config.write_text((REPO / "examples" / "regression.toml").read_text())
    return config


def specs(*texts: str) -> list[plan.AlgorithmSpec]:
    return [plan.parse_algorithm(t) for t in texts]


# -- the plan ----------------------------------------------------------------------------


def test_plan_expands_the_lists_and_counts_the_ranks(config: Path) -> None:
    grid = plan.Grid(specs("sgd", "downpour", "sandblaster", "sync",
                           "sync:optimizer.backup_workers=1",
                           "averaging:optimizer.elastic_alpha=0.5", "hogwild", "diloco",
                           "diloco:optimizer.asynchronous=true"),
                     replicas=(1, 3), seeds=(0, 1), learning_rates=(0.01, 0.02),
                     max_seconds=30, target=0.7)
    runs = plan.plan_runs(config, grid)
    ranks = {(r.algorithm, r.replicas): r.ranks for r in runs}
    assert ranks == {
        ("sgd", 1): 1,                                   # one process, replicas ignored
        ("downpour", 1): 2, ("downpour", 3): 4,           # 1 shard + R
        ("sandblaster", 1): 3, ("sandblaster", 3): 5,     # 1 shard + coordinator + R
        ("sync", 1): 1, ("sync", 3): 3,                   # no shard
        ("sync:optimizer.backup_workers=1", 1): 2,        # backups go through a shard
        ("sync:optimizer.backup_workers=1", 3): 4,
        ("averaging:optimizer.elastic_alpha=0.5", 1): 2,  # EASGD's center on a shard
        ("averaging:optimizer.elastic_alpha=0.5", 3): 4,
        ("hogwild", 1): 1, ("hogwild", 3): 3,
        ("diloco", 1): 1, ("diloco", 3): 3,               # synchronous: no shard
        ("diloco:optimizer.asynchronous=true", 1): 2,     # the outer optimizer on a shard
        ("diloco:optimizer.asynchronous=true", 3): 4,
    }
    # 2 learning rates x 2 seeds at each point; sgd once per point, not per replica count.
    assert len(runs) == 4 * (1 + 8 * 2)
    assert len({r.folder for r in runs}) == len(runs)
    assert [r.uses_launcher for r in runs if r.name == "sgd"] == [False] * 4
    one = next(r for r in runs if r.algorithm.startswith("sync:") and r.replicas == 3
               and r.seed == 1 and r.learning_rate == 0.02)
    assert one.folder == "sync+backup_workers=1-r3-lr0.02-seed1"
    assert one.overrides == ('optimizer.algorithm="sync"', "cluster.ps_shards=1",
                             "run.seed=1", "optimizer.learning_rate=0.02",
                             "run.max_seconds=30", "run.target_accuracy=0.7",
                             "optimizer.backup_workers=1")


def test_plan_with_partitions_and_shards(config: Path) -> None:
    grid = plan.Grid(specs("sgd", "downpour", "sandblaster", "sync",
                           "downpour:cluster.ps_shards=3"), replicas=(2,),
                     overrides=("cluster.partitions=2", "cluster.ps_shards=2"))
    ranks = {r.algorithm: (r.ranks, r.uses_launcher)
             for r in plan.plan_runs(config, grid, check=False)}
    assert ranks == {"sgd": (2, True), "downpour": (2 + 4, True),
                     "sandblaster": (2 + 1 + 4, True), "sync": (4, True),
                     "downpour:cluster.ps_shards=3": (3 + 4, True)}


def test_the_target_of_any_metric(config: Path, regression_config: Path,
                                  tmp_path: Path) -> None:
    """A file's own target is used as it is; --target is a value of the score (accuracy, r2
    for mse) or of --target-metric's metric, and replaces the file's target whatever key
    gave it; a metric the loss does not report, a value out of its range or a comparison
    of two metrics is one ConfigError before any run."""
    def targets(path: Path, grid: plan.Grid, check: bool = False) -> list:
        return [(r.target, r.overrides[-1]) for r in plan.plan_runs(path, grid, check=check)]

    assert targets(regression_config, plan.Grid(specs("sgd"))) == [
        (Target("loss", 0.0105), "run.seed=0")]                       # the file's own
    assert targets(regression_config, plan.Grid(specs("sgd"), target=0.95)) == [
        (Target("r2", 0.95), "run.target_value=0.95")]               # mse's score
    assert targets(regression_config, plan.Grid(specs("sgd"), target=0.2,
                                                target_metric="rmse")) == [
        (Target("rmse", 0.2), "run.target_value=0.2")]
    # The file's target_accuracy replaced by a loss target, as train loads it.
    assert targets(config, plan.Grid(specs("sgd"), target=0.5, target_metric="loss"),
                   check=True) == [(Target("loss", 0.5), "run.target_loss=0.5")]
    for path, grid, message in [
            (regression_config, plan.Grid(specs("sgd"), target=0.9, target_metric="auc"),
             'model.loss = "mse" reports loss, r2, rmse'),
            (regression_config, plan.Grid(specs("sgd"), target=1.5), "an r2, at most 1"),
            (config, plan.Grid(specs("sgd"), target=1.5), "an accuracy, between 0 and 1"),
            (config, plan.Grid(specs("sgd"), target_metric="loss"), "give --target VALUE"),
            (config, plan.Grid(specs("sgd", "downpour:run.target_loss=0.1")),
             "measures every run by one metric")]:
        with pytest.raises(ConfigError, match=message):
            plan.plan_runs(path, grid, check=False)
    untargeted = tmp_path / "untargeted.toml"
    untargeted.write_text(config.read_text().replace("target_accuracy = 0.6", ""))
    with pytest.raises(ConfigError) as raised:
        plan.plan_runs(untargeted, plan.Grid(specs("sgd")))
    assert all(way in str(raised.value) for way in (
        "--target VALUE", "--target-metric loss|accuracy|r2|rmse|auc", "run.target_accuracy",
        "run.target_loss", "run.target_metric with run.target_value"))


def test_algorithm_specs() -> None:
    spec = plan.parse_algorithm("sandblaster:data.batch_size=600,optimizer.m=5")
    assert (spec.name, spec.overrides) == ("sandblaster", ("data.batch_size=600",
                                                           "optimizer.m=5"))
    # a comma inside a value (a TOML list) stays in its override
    spec = plan.parse_algorithm('downpour:run.seed=1,model.layers=[{type="dense", units=3}]')
    assert len(spec.overrides) == 2
    with pytest.raises(ConfigError, match="unknown algorithm 'downpur'"):
        plan.parse_algorithm("downpur")
    with pytest.raises(ConfigError, match="unknown key"):
        plan.parse_algorithm("downpour:optimizer.nfetch=2")
    with pytest.raises(ConfigError, match="set by compare"):
        plan.parse_algorithm("downpour:run.out_dir=x")


def test_bad_input_is_one_line_before_any_run(config: Path, tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    # an implemented algorithm is checked as train would check it
    result = run_cli(["compare", config, "--algorithm", "sgd",
                      "--algorithm", "downpour:optimizer.backup_workers=1", "--out", out])
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "backup_workers applies only" in result.stderr
    result = run_cli(["compare", config, "--algorithm", "sgd", "--launcher", "srun -n 4",
                      "--out", out])
    assert result.returncode == 2 and "has no {n}" in result.stderr
    result = run_cli(["compare", config, "--algorithm", "sgd", "--target-metric", "auc",
                      "--target", "0.9", "--out", out])
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert 'model.loss = "cross_entropy" reports loss, accuracy' in result.stderr
    # a value the rank counts need is checked before they use it
    result = run_cli(["compare", config, "--algorithm", "downpour", "--set",
                      'cluster.partitions="two"', "--out", out])
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "cluster.partitions" in result.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text(config.read_text() + '\n[cluster]\npartitions = "two"\n')
    result = run_cli(["compare", bad, "--algorithm", "downpour", "--out", out])
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "cluster.partitions = 'two' is invalid" in result.stderr
    assert not (out / running.STATE_FILE).exists()


# -- the table and figures from fake run folders ------------------------------------------


def fake_run(out: Path, run: plan.PlannedRun, state: str, time_to_target: float | None,
             final: float | None, records: list, key: str = "test_accuracy",
             bytes_per_sample: float | None = None, target: Target | None = None,
             values: tuple[float, float] = (0.5, 0.9)) -> None:
    """A run's folder as train leaves it: an evaluation (key: values[0]) at 1 s, another
    (values[1]) at time_to_target when it reached the target; a finished run's summary
    names `target` (without one: the summary of an accuracy run from before targets had
    metrics, target_accuracy 0.88)."""
    folder = out / running.RUNS_DIR / run.folder
    folder.mkdir(parents=True)
    evals = [(1.0, values[0], 1000)]
    if time_to_target is not None:
        evals.append((time_to_target, values[1], int(time_to_target * 1000)))
    with (folder / "metrics.jsonl").open("w") as f:
        for t, value, samples in evals:
            f.write(json.dumps({"kind": "eval", "time": t, "step": 1, "samples": samples,
                                "loss": 1.0, key: value}) + "\n")
    own = ({"target_accuracy": 0.88, "final_test_accuracy": final} if target is None else
           {"target": target.to_dict(), f"final_test_{target.metric}": final})
    if state == "finished":
        (folder / "summary.json").write_text(json.dumps({
            **own, "time_to_target": time_to_target, "wall_seconds": 60.0,
            **({"bytes_sent": 1000 * bytes_per_sample, "bytes_received": 0,
                "bytes_sent_per_sample": bytes_per_sample} if bytes_per_sample else {})}))
    records.append({"folder": run.folder, "state": state, "exit_status": 0
                    if state == "finished" else 1})


def test_table_median_spread_failed_and_unreached(config: Path, tmp_path: Path) -> None:
    grid = plan.Grid(specs("downpour", "sync"), replicas=(2,), seeds=(0, 1, 2))
    runs = plan.plan_runs(config, grid, check=False)
    records: list = []
    down = [r for r in runs if r.name == "downpour"]
    fake_run(tmp_path, down[0], "finished", 40.0, 0.89, records)
    fake_run(tmp_path, down[1], "finished", 10.0, 0.90, records)
    fake_run(tmp_path, down[2], "finished", 20.0, 0.88, records)
    sync = [r for r in runs if r.name == "sync"]
    fake_run(tmp_path, sync[0], "finished", None, 0.85, records)  # never reached
    fake_run(tmp_path, sync[1], "failed", None, None, records)
    # sync[2] never ran
    (tmp_path / running.STATE_FILE).write_text(json.dumps({"runs": records}))

    collected = results.collect(tmp_path, runs)
    rows = results.table_rows(results.group_results(collected))
    downpour, synchronous = rows
    assert (downpour["reached"], downpour["seeds"], downpour["failed"]) == (3, 3, 0)
    assert (downpour["time_to_target_median"], downpour["time_to_target_min"],
            downpour["time_to_target_max"]) == (20.0, 10.0, 40.0)
    assert downpour["samples_to_target_median"] == 20000
    assert downpour["final_accuracy_median"] == 0.89
    assert (synchronous["reached"], synchronous["failed"]) == (0, 2)
    assert synchronous["time_to_target_median"] is None
    assert synchronous["final_accuracy_median"] == 0.85
    text = results.format_table(rows, ACCURACY)
    assert "20.0 [10.0-40.0]" in text and "20,000 [10,000-40,000]" in text
    assert "0/3" in text

    paths = results.write_tables(tmp_path, collected, rows)
    with paths[1].open() as f:
        states = [row["state"] for row in csv.DictReader(f)]
    assert states == ["finished"] * 4 + ["failed", "not run"]
    pytest.importorskip("matplotlib")
    for png in results.plot(tmp_path, results.group_results(collected), ACCURACY, "exp.toml"):
        assert png.stat().st_size > 10_000


def test_bytes_sent_are_in_the_table_and_drawn_against_accuracy(
        config: Path, tmp_path: Path, monkeypatch) -> None:
    """summary.json's bytes sent per sample go to the table (median over seeds) and runs.csv;
    the bytes figure puts each evaluation at its samples times that rate, on a log axis,
    and names a group whose runs reported no bytes."""
    grid = plan.Grid(specs("downpour", "sync"), replicas=(2,), seeds=(0, 1))
    runs = plan.plan_runs(config, grid, check=False)
    records: list = []
    for run, rate in zip(runs, (100.0, 300.0, None, None), strict=True):
        fake_run(tmp_path, run, "finished", 20.0, 0.9, records, bytes_per_sample=rate)
    (tmp_path / running.STATE_FILE).write_text(json.dumps({"runs": records}))
    collected = results.collect(tmp_path, runs)
    assert collected[0].bytes_curve == [(1000 * 100.0, 0.5), (20000 * 100.0, 0.9)]
    assert collected[2].bytes_curve is None
    rows = results.table_rows(results.group_results(collected))
    assert rows[0]["bytes_sent_per_sample_median"] == 200.0
    assert rows[1]["bytes_sent_per_sample_median"] is None
    text = results.format_table(rows, ACCURACY)
    assert "bytes sent/sample" in text.splitlines()[0] and "200 [100-300]" in text
    paths = results.write_tables(tmp_path, collected, rows)
    with paths[1].open() as f:
        assert [row["bytes_sent_per_sample"] for row in csv.DictReader(f)] == [
            "100.0", "300.0", "", ""]
    pytest.importorskip("matplotlib")
    drawn: dict[str, Any] = {}

    def keep_axes(plt: Any, fig: Any, ax: Any, path: Path, title: str) -> Path:
        _, labels = ax.get_legend_handles_labels()
        drawn[path.name] = (ax.get_xscale(), labels, [line.get_xdata() for line in ax.lines])
        plt.close(fig)
        return path

    monkeypatch.setattr(results, "_save", keep_axes)
    results.plot(tmp_path, results.group_results(collected), ACCURACY, "exp.toml")
    scale, labels, xs = drawn[results.BYTES_FIGURE]
    assert scale == "log"
    assert any(label.startswith("downpour") and "200 B/sample" in label for label in labels)
    assert any(label.startswith("sync") and "no bytes reported" in label for label in labels)
    assert list(xs[0]) == [0.1, 2.0]  # MB


def test_the_figures_show_every_run_and_say_when_none_reached_the_target(
        config: Path, tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    grid = plan.Grid(specs("downpour", "sync"), replicas=(1, 2))
    runs = plan.plan_runs(config, grid, check=False)
    records: list = []
    for run in runs:  # none reaches 0.88; their best evaluation is 0.5
        fake_run(tmp_path, run, "finished", None, 0.5, records)
    (tmp_path / running.STATE_FILE).write_text(json.dumps({"runs": records}))
    groups = results.group_results(results.collect(tmp_path, runs))
    # The accuracy axis reaches down to the lowest run's best (0.5), not just 0.78.
    assert results.accuracy_axis_floor(groups, 0.88) == 0.48
    assert results.accuracy_axis_floor(groups[:0], 0.88) == 0.78
    drawn: dict[str, Any] = {}

    def keep_axes(plt: Any, fig: Any, ax: Any, path: Path, title: str) -> Path:
        drawn[path.name] = ([t.get_text() for t in ax.texts], ax.get_xlim(), ax.get_ylim())
        plt.close(fig)
        return path

    monkeypatch.setattr(results, "_save", keep_axes)
    results.plot(tmp_path, groups, ACCURACY, "exp.toml")
    texts, xlim, ylim = drawn[results.SCALING_FIGURE]
    assert texts == ["no run reached 0.88 test accuracy"]
    ranks = sorted({run.ranks for run in runs})
    assert xlim == (ranks[0] - 0.5, ranks[-1] + 0.5) and ylim == (0, 1)
    assert drawn[results.ACCURACY_FIGURE][2][0] == 0.48


def test_runs_with_a_validation_split_are_compared_on_it(config: Path, tmp_path: Path,
                                                         monkeypatch) -> None:
    grid = plan.Grid(specs("downpour"), replicas=(1, 2))
    runs = plan.plan_runs(config, grid, check=False)
    records: list = []
    fake_run(tmp_path, runs[0], "finished", 30.0, 0.87, records, key="val_accuracy")
    fake_run(tmp_path, runs[1], "finished", None, 0.86, records, key="val_accuracy")
    (tmp_path / running.STATE_FILE).write_text(json.dumps({"runs": records}))
    collected = results.collect(tmp_path, runs)
    assert [r.split for r in collected] == ["validation", "validation"]
    assert collected[0].curve == [(1.0, 0.5), (30.0, 0.9)]
    assert collected[0].samples_to_target == 30000
    assert collected[0].final == 0.87  # the summary's test accuracy
    pytest.importorskip("matplotlib")
    labels: dict[str, str] = {}

    def keep_label(plt: Any, fig: Any, ax: Any, path: Path, title: str) -> Path:
        labels[path.name] = ax.get_ylabel()
        plt.close(fig)
        return path

    monkeypatch.setattr(results, "_save", keep_label)
    results.plot(tmp_path, results.group_results(collected), ACCURACY, "exp.toml")
    assert labels[results.ACCURACY_FIGURE].startswith("validation accuracy")
    assert labels[results.SCALING_FIGURE] == "time to 0.88 validation accuracy (s)"


def keep_figures(monkeypatch) -> dict[str, Any]:
    """results._save replaced: each figure's title, axis labels, y scale and limits, by
    file name, instead of a PNG."""
    drawn: dict[str, Any] = {}

    def keep(plt: Any, fig: Any, ax: Any, path: Path, title: str) -> Path:
        drawn[path.name] = {"title": title, "ylabel": ax.get_ylabel(),
                            "yscale": ax.get_yscale(), "ylim": ax.get_ylim()}
        plt.close(fig)
        return path

    monkeypatch.setattr(results, "_save", keep)
    return drawn


def test_a_loss_target_is_reached_by_falling_to_it(regression_config: Path, tmp_path: Path,
                                                    monkeypatch) -> None:
    """A loss target: time and samples to the first validation loss at or below it, the
    final test loss, columns and figures named by the loss, a log axis that holds the
    target and every run's curve."""
    loss = Target("loss", 0.02)
    grid = plan.Grid(specs("sgd", "sync"), seeds=(0, 1), target=0.02, target_metric="loss")
    runs = plan.plan_runs(regression_config, grid, check=False)
    assert "run.target_loss=0.02" in runs[0].overrides
    records: list = []
    for run, reached, final in zip(runs[:3], (3.0, 5.0, None), (0.014, 0.016, 0.05)):
        fake_run(tmp_path, run, "finished", reached, final, records, key="val_loss",
                 target=loss, values=(0.5, 0.015))
    fake_run(tmp_path, runs[3], "failed", None, None, records, key="val_loss")
    (tmp_path / running.STATE_FILE).write_text(json.dumps({"runs": records}))
    collected = results.collect(tmp_path, runs)
    assert [r.target for r in collected] == [loss] * 4  # the failed one's from the plan
    assert collected[0].curve == [(1.0, 0.5), (3.0, 0.015)]
    assert collected[1].samples_to_target == 5000 and collected[1].final == 0.016
    assert collected[2].time_to_target is None and collected[2].split == "validation"
    groups = results.group_results(collected)
    sgd, sync = results.table_rows(groups)
    assert (sgd["reached"], sgd["time_to_target_median"], sgd["final_loss_median"]) == (
        2, 4.0, 0.015)
    assert (sync["reached"], sync["failed"], sync["target_metric"]) == (0, 1, "loss")
    text = results.format_table([sgd, sync], loss)
    assert "time to loss 0.02 (s)" in text and "samples to loss 0.02" in text
    assert "final loss" in text and "0.015 [0.014-0.016]" in text
    assert "(a loss at or below 0.02)" in text.splitlines()[-1]
    table, per_run = results.write_tables(tmp_path, collected, [sgd, sync])
    with table.open() as f:
        row = next(csv.DictReader(f))
    assert row["final_loss_median"] == "0.015" and "final_accuracy_median" not in row
    assert (row["target_metric"], row["target_value"]) == ("loss", "0.02")
    with per_run.open() as f:
        assert [r["final_loss"] for r in csv.DictReader(f)] == ["0.014", "0.016", "0.05", ""]
    pytest.importorskip("matplotlib")
    drawn = keep_figures(monkeypatch)
    results.plot(tmp_path, groups, loss, "regression.toml")
    assert sorted(drawn) == ["loss_vs_bytes_sent.png", "loss_vs_time.png",
                             results.SCALING_FIGURE]
    curves = drawn["loss_vs_time.png"]
    assert curves["title"].startswith("Validation loss against time")
    assert curves["ylabel"] == "validation loss (log scale)" and curves["yscale"] == "log"
    bottom, top = curves["ylim"]
    assert bottom < 0.015 and 0.5 < top < 1  # the lowest evaluation and the highest
    assert drawn[results.SCALING_FIGURE]["ylabel"] == "time to 0.02 validation loss (s)"
    # Evaluations far above the target are cut off (sgd: from 0.5 to 0.015), but not a
    # run's best (sync's first run: 0.5, the best it got).
    assert results.falling_axis_range(groups[:1], 0.001)[1] == pytest.approx(0.1)
    assert results.falling_axis_range(groups[:1], 0.0001)[1] == pytest.approx(0.015 * 1.25)
    assert results.falling_axis_range(groups, 0.001)[1] == pytest.approx(0.5 * 1.25)


def test_an_r2_target_is_the_score_of_a_regression(regression_config: Path, tmp_path: Path,
                                                   monkeypatch) -> None:
    runs = plan.plan_runs(regression_config, plan.Grid(specs("sgd"), target=0.95),
                          check=False)
    records: list = []
    fake_run(tmp_path, runs[0], "finished", 2.0, 0.97, records, key="test_r2",
             target=Target("r2", 0.95), values=(0.5, 0.985))
    (tmp_path / running.STATE_FILE).write_text(json.dumps({"runs": records}))
    collected = results.collect(tmp_path, runs)
    assert (collected[0].samples_to_target, collected[0].final) == (2000, 0.97)
    rows = results.table_rows(results.group_results(collected))
    assert rows[0]["final_r2_median"] == 0.97
    text = results.format_table(rows, Target("r2", 0.95))
    assert "time to r2 0.95 (s)" in text and "final r2" in text and "0.9700" in text
    pytest.importorskip("matplotlib")
    drawn = keep_figures(monkeypatch)
    results.plot(tmp_path, results.group_results(collected), Target("r2", 0.95), "r.toml")
    assert drawn["r2_vs_time.png"]["ylabel"] == "test r2 (axis from 0.85)"
    assert drawn["r2_vs_time.png"]["yscale"] == "linear"
    # The axis reaches above the best evaluation, past the target's 0.98.
    assert drawn["r2_vs_time.png"]["ylim"] == (0.85, pytest.approx(0.995))


def test_a_finished_run_is_one_with_the_same_settings(config: Path, tmp_path: Path) -> None:
    run = plan.plan_runs(config, plan.Grid(specs("sgd")))[0]
    key = running.settings_key(config, run)
    record = {"state": "finished", "key": key}
    assert not running.is_finished(tmp_path, run, record, key)  # no summary.json
    (tmp_path / running.RUNS_DIR / run.folder).mkdir(parents=True)
    (tmp_path / running.RUNS_DIR / run.folder / "summary.json").write_text("{}")
    assert running.is_finished(tmp_path, run, record, key)
    assert not running.is_finished(tmp_path, run, {**record, "state": "interrupted"}, key)
    other = plan.plan_runs(config, plan.Grid(specs("sgd"), max_seconds=5))[0]
    assert running.settings_key(config, other) != key
    assert running.run_state(0, {"stop_reason": "SIGTERM"}, False) == "interrupted"
    assert running.run_state(0, {"stop_reason": "target_accuracy"}, False) == "finished"
    assert running.run_state(0, None, False) == "failed"


# -- the launcher ------------------------------------------------------------------------


def test_launcher_gets_the_rank_count_and_a_failed_run_is_reported(config: Path,
                                                                    tmp_path: Path) -> None:
    calls = tmp_path / "calls.txt"
    launcher = tmp_path / "fake-srun"
    launcher.write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho "fake-srun: no job"\n'
                        'exit 3\n')
    launcher.chmod(0o755)
    out = tmp_path / "cmp"
    result = run_cli(["compare", config, "--algorithm", "downpour", "--algorithm",
                      "sandblaster:data.batch_size=300", "--replicas", "1,2",
                      "--launcher", f"{launcher} --mpi=pmix -n {{n}}", "--out", out])
    assert result.returncode == 0, result.stderr
    lines = calls.read_text().splitlines()
    assert [line.split(" -m distbelief")[0].split()[:3] for line in lines] == [
        ["--mpi=pmix", "-n", "2"], ["--mpi=pmix", "-n", "3"],
        ["--mpi=pmix", "-n", "3"], ["--mpi=pmix", "-n", "4"]]
    assert all(f"run.out_dir=\"{out}/runs/" in line for line in lines)
    assert result.stdout.count("FAILED after") == 4
    assert "fake-srun: no job" in (out / "logs" / "downpour-r1-seed0.log").read_text()
    state = json.loads((out / running.STATE_FILE).read_text())
    assert [r["exit_status"] for r in state["runs"]] == [3] * 4
    assert (out / "table.csv").is_file()


def test_a_hung_run_is_ended_and_the_comparison_goes_on(config: Path, tmp_path: Path) -> None:
    launcher = tmp_path / "hung-mpiexec"
    launcher.write_text("#!/bin/sh\necho 'started, now hanging'\nsleep 600\n")
    launcher.chmod(0o755)
    out = tmp_path / "cmp"
    started = time.monotonic()
    result = run_cli(["compare", config, "--algorithm", "downpour", "--replicas", "1,2",
                      "--launcher", f"{launcher} {{n}}", "--run-timeout", "2", "--out", out],
                     timeout=120)
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 60  # each run ended after 2 s, not 600
    assert result.stdout.count("TIMED OUT after") == 2
    state = json.loads((out / running.STATE_FILE).read_text())
    assert [r["state"] for r in state["runs"]] == ["timed out", "timed out"]
    log = (out / "logs" / "downpour-r1-seed0.log").read_text()
    assert "started, now hanging" in log and "ended its processes" in log
    with (out / "runs.csv").open() as f:
        assert [row["state"] for row in csv.DictReader(f)] == ["timed out", "timed out"]


def test_a_launcher_stuck_after_its_ranks_ended_is_ended_before_the_run_timeout(
        config: Path, tmp_path: Path) -> None:
    # A stand-in prterun that starts a rank which ends at once, never collects it, and
    # hangs (distbelief.runtime.launching.stuck_launcher): ended after the stuck-launcher grace (2 s
    # here), not the run's 300 s timeout.
    launcher = tmp_path / "stuck-mpiexec"
    launcher.write_text(f"#!{sys.executable}\n"
                        "import subprocess, sys, time\n"
                        "rank = subprocess.Popen([sys.executable, '-c', 'pass'])\n"
                        "print('started, rank ended', flush=True)\n"
                        "time.sleep(600)\n")
    launcher.chmod(0o755)
    out = tmp_path / "cmp"
    started = time.monotonic()
    result = run_cli(["compare", config, "--algorithm", "downpour", "--replicas", "1",
                      "--launcher", f"{launcher} {{n}}", "--run-timeout", "300", "--out", out],
                     timeout=120, env={**job_env(), "DISTBELIEF_STUCK_LAUNCHER_SECONDS": "2"})
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 60, result.stdout
    log = (out / "logs" / "downpour-r1-seed0.log").read_text()
    assert "started, rank ended" in log
    assert "has not collected its ranks for 2 s after they all ended" in log, log
    assert "has not collected its ranks" in result.stdout
    state = json.loads((out / running.STATE_FILE).read_text())
    assert [r["exit_status"] for r in state["runs"]] == [-9], state


def test_each_run_may_take_its_budget_and_a_grace(config: Path) -> None:
    [run] = plan.plan_runs(config, plan.Grid(specs("sgd"), max_seconds=100), check=False)
    assert running.run_time_limit(config, run) == 100 + running.GRACE_S
    [run] = plan.plan_runs(config, plan.Grid(specs("sgd"), max_seconds=600), check=False)
    assert running.run_time_limit(config, run) == 900
    [run] = plan.plan_runs(config, plan.Grid(specs("sgd")), check=False)  # the file's 20 s
    assert running.run_time_limit(config, run) == 20 + running.GRACE_S
    [run] = plan.plan_runs(config, plan.Grid(specs("sgd"), overrides=("run.max_seconds=0",)),
                           check=False)
    assert running.run_time_limit(config, run) is None


# -- a real comparison -------------------------------------------------------------------


def test_tiny_comparison_end_to_end_and_resume(config: Path, tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    args = ["compare", config, "--algorithm", "sgd", "--algorithm", "downpour",
            "--algorithm", "sync:optimizer.learning_rate=1e30", "--replicas", "2", "--out", out]
    result = run_cli(args, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[1/3] sgd, seed 0 (1 rank): starting" in result.stdout
    assert "[2/3] downpour, 2 replicas, seed 0 (3 ranks): finished" in result.stdout
    assert "step " in result.stdout  # the runs' own progress lines
    # this sync run diverges: it fails, the table says so, the comparison goes on
    assert ("[3/3] sync:optimizer.learning_rate=1e30, 2 replicas, seed 0 (2 ranks): FAILED"
            in result.stdout), result.stdout
    with (out / "table.csv").open() as f:
        rows = {(r["algorithm"], r["replicas"]): r for r in csv.DictReader(f)}
    for key in [("sgd", "1"), ("downpour", "2")]:
        assert rows[key]["reached"] == "1" and float(rows[key]["time_to_target_median"]) > 0
    assert rows[("sync:optimizer.learning_rate=1e30", "2")]["failed"] == "1"
    for png in ("accuracy_vs_time.png", "time_to_target_vs_cores.png"):
        assert (out / png).stat().st_size > 10_000
    summary = out / "runs" / "downpour-r2-seed0" / "summary.json"
    assert json.loads(summary.read_text())["algorithm"] == "downpour"
    written = summary.stat().st_mtime_ns
    # a single run's folder is an ordinary run folder
    assert run_cli(["report", out / "runs" / "downpour-r2-seed0"]).returncode == 0

    again = run_cli(args, timeout=120)
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("finished earlier, not run again") == 2
    assert again.stdout.count("FAILED") == 1  # the failed run is tried again
    assert summary.stat().st_mtime_ns == written


def test_a_regression_compared_by_its_time_to_a_loss(regression_config: Path,
                                                    tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    result = run_cli(["compare", regression_config, "--algorithm", "sgd", "--algorithm",
                      "sync", "--target-metric", "loss", "--target", "0.03",
                      "--max-seconds", "8", "--set", "run.eval_every_seconds=0.25",
                      "--out", out], timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": reached loss 0.03 in ") == 2, result.stdout
    assert "time to loss 0.03 (s)" in result.stdout and "final loss" in result.stdout
    with (out / "table.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["reached"] for r in rows] == ["1", "1"]
    assert all(0 < float(r["time_to_target_median"]) < 8 for r in rows)
    assert all(0 < float(r["final_loss_median"]) < 0.1 for r in rows)
    assert (out / "loss_vs_time.png").stat().st_size > 10_000


def test_ctrl_c_stops_the_run_with_a_checkpoint_and_resume_continues(
        config: Path, tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    args = [sys.executable, "-m", "distbelief", "compare", str(config), "--algorithm", "sgd",
            "--algorithm", "downpour", "--target", "0.99", "--max-seconds", "3",
            "--out", str(out)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=job_env())
    try:
        for line in proc.stdout:  # wait for the sgd run's first progress line
            if line.strip().startswith("step "):
                break
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, rest
    assert "sgd, seed 0 (1 rank): interrupted" in rest
    assert "[2/2]" not in rest  # no other run started
    state = json.loads((out / running.STATE_FILE).read_text())
    assert [r["state"] for r in state["runs"]] == ["interrupted"]
    assert list((out / "runs" / "sgd-seed0" / "checkpoints").glob("ckpt-*"))

    started = time.monotonic()
    resumed = run_cli(args[3:], timeout=120)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resum" in resumed.stdout.lower()
    kinds = [json.loads(line)["kind"] for line in
             (out / "runs" / "sgd-seed0" / "metrics.jsonl").read_text().splitlines()]
    assert "resume" in kinds
    assert time.monotonic() - started < 100
    state = json.loads((out / running.STATE_FILE).read_text())
    assert [r["state"] for r in state["runs"]] == ["finished", "finished"]


def test_a_second_comparison_on_the_same_folder_is_refused(config: Path,
                                                           tmp_path: Path) -> None:
    from distbelief.runtime.health.ownership import claim

    out = tmp_path / "cmp"
    owner = claim(out)  # a live comparison (this process) owns the folder
    try:
        result = run_cli(["compare", config, "--algorithm", "sgd", "--out", out])
    finally:
        owner.release()
    assert result.returncode == 2
    assert "belongs to a live run" in result.stderr
    assert not (out / running.STATE_FILE).exists()


def test_compare_sbatch_requeues_on_usr1_and_resumes(config: Path, tmp_path: Path) -> None:
    """slurm/compare.sbatch under the SLURM shims: SIGUSR1 to the batch shell reaches the
    current run through compare and srun; the run checkpoints, the job requeues, and the
    requeued job skips nothing it should run and reruns nothing that finished."""
    from helpers.slurm import JOB_ID, Job

    out = tmp_path / "cmp"
    job = Job("compare", tmp_path, 3, config)
    args = [str(config), "--algorithm", "sgd", "--algorithm", "downpour", "--target", "0.99",
            "--max-seconds", "3", "--out", str(out)]
    proc = job.start(args=args)
    metrics = out / "runs" / "downpour-r1-seed0" / "metrics.jsonl"
    deadline = time.monotonic() + 90
    while not (metrics.is_file() and '"kind": "train"' in metrics.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, job.text()[-3000:]
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGUSR1)
    assert job.wait(proc) == 0, job.text()[-3000:]
    assert job.shim_calls("scontrol") == [f"scontrol requeue {JOB_ID}"]
    state = json.loads((out / running.STATE_FILE).read_text())
    assert [r["state"] for r in state["runs"]] == ["finished", "interrupted"]

    assert job.run(restarts=1, args=args) == 0, job.text()[-3000:]
    second = job.text().split("restart 1", 1)[1]
    assert "sgd, seed 0 (1 rank): finished earlier, not run again" in second
    assert "resuming from" in second
    state = json.loads((out / running.STATE_FILE).read_text())
    assert [r["state"] for r in state["runs"]] == ["finished", "finished"]
    assert all(" -n 2 " in call for call in job.shim_calls("srun"))
    assert len(job.shim_calls("srun")) == 2


def test_help_says_how_to_use_it() -> None:
    result = run_cli(["compare", "--help"])
    assert result.returncode == 0
    for fragment in ("--algorithm", "--replicas", "--seeds", "--learning-rates", "--launcher",
                     "{n}", "resume", "Ctrl-C", "examples:", "slurm/compare.sbatch",
                     "--target-metric", *TARGET_METRICS):
        assert fragment in result.stdout
    assert "compare" in run_cli(["--help"]).stdout
