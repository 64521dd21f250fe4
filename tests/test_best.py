"""The best model beside the last (run.keep_best): kept at each evaluation that beats the
run's best, past the pruning of old checkpoints and a resume, and read by `evaluate`,
`export` and load_model by default; `--which last` reads the newest checkpoint.

One single-process sgd run (no MPI) is shared by most tests. To make it peak before its
stop on purpose, its optimizer zeroes the parameters after every step past DEGRADE_AT: the
later evaluations score a model at chance, as a run that overfits or diverges late would.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from helpers.configs import small_config_text

import distbelief
from distbelief.algorithms import sgd
from distbelief.algorithms.checkpointer import BestKeeper
from distbelief.cli import main
from distbelief.config import apply_overrides, config_from_dict
from distbelief.errors import UserError
from distbelief.records import checkpoint as ckpt
from distbelief.records.export import read_trained
from distbelief.records.metrics import read_metrics

TOML = small_config_text(optimizer={"algorithm": None, "update": "sgd",
                                    "learning_rate": 0.2},
                         cluster=None,
                         run={"eval_every_seconds": 0.05, "progress_every_seconds": 10.0,
                              "checkpoint_every_steps": 100, "keep_checkpoints": 2})
STEPS, DEGRADE_AT = 1200, 900


def make_config(data_dir: Path, out: Path, *overrides: str):
    import tomllib

    raw = apply_overrides(tomllib.loads(TOML), [f'run.out_dir="{out}"', *overrides])
    return config_from_dict(raw, data_dir / "exp.toml")


def degrading(build):
    """build_optimizer's optimizer, whose steps past DEGRADE_AT leave the parameters zero."""
    def make(config, size):
        optimizer = build(config, size)
        step = optimizer.step

        def degraded(params, grad, update):
            step(params, grad, update=update)
            if update >= DEGRADE_AT:
                params[:] = 0.0
        optimizer.step = degraded
        return optimizer
    return make


@pytest.fixture(scope="module")
def data_dir(synthetic_folder) -> Path:
    return synthetic_folder("best")


@pytest.fixture(scope="module")
def peaked(data_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """(out_dir, summary, metrics lines, output) of a run that peaks before its stop."""
    out = tmp_path_factory.mktemp("peaked") / "out"
    stream = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sgd, "build_optimizer", degrading(sgd.build_optimizer))
        summary = sgd.train(make_config(data_dir, out, f"run.max_steps={STEPS}"), stream)
    return out, summary, read_metrics(out / "metrics.jsonl"), stream.getvalue()


def evaluate_json(capsys, *args: str) -> dict:
    capsys.readouterr()
    assert main(["evaluate", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_best_is_the_peak_and_beats_the_last(peaked) -> None:
    out, summary, lines, output = peaked
    evals = [x for x in lines if x["kind"] == "eval"]
    peak = max(evals, key=lambda x: x["test_accuracy"])
    best, last = summary["best"], summary["last"]
    assert peak["step"] < DEGRADE_AT  # the run peaked before its stop
    assert (best["step"], best["accuracy"]) == (peak["step"], peak["test_accuracy"])
    assert last["step"] == STEPS and last["accuracy"] == evals[-1]["test_accuracy"]
    assert best["accuracy"] > last["accuracy"]
    # Pruning kept 2 of the periodic checkpoints, and the best beside them.
    root = ckpt.checkpoint_root(out)
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [STEPS, STEPS - 100]
    assert [s for s, _ in ckpt.list_best(root)] == [best["step"]]
    assert not ckpt.list_leftovers(root)
    assert (f"best: step {best['step']:,d}, test accuracy {best['accuracy']:.4f}"
            in output)
    assert f"last: step {STEPS:,d}, test accuracy {last['accuracy']:.4f}" in output


def test_evaluate_scores_the_best_by_default_and_the_last_on_request(peaked, capsys) -> None:
    out, summary, _, _ = peaked
    best = evaluate_json(capsys, out)
    assert (best["which"], best["step"]) == ("best", summary["best"]["step"])
    assert best["accuracy"] == pytest.approx(summary["best"]["accuracy"], abs=1e-9)
    last = evaluate_json(capsys, out, "--which", "last")
    assert (last["which"], last["step"]) == ("last", STEPS)
    assert last["accuracy"] == pytest.approx(summary["last"]["accuracy"], abs=1e-9)
    assert best["accuracy"] > last["accuracy"]


def test_load_model_and_export_take_which(peaked, tmp_path: Path, capsys) -> None:
    out, summary, _, _ = peaked
    assert distbelief.load_model(out).source["step"] == summary["best"]["step"]
    assert distbelief.load_model(out, which="last").source["step"] == STEPS
    # The best has no optimizer state: --with-optimizer reads the last, and refuses best.
    assert read_trained(out, with_optimizer=True).source["step"] == STEPS
    with pytest.raises(UserError, match="best model holds no optimizer state"):
        read_trained(out, with_optimizer=True, which="best")
    assert main(["export", str(out), "--out", str(tmp_path / "best.h5")]) == 0
    assert "(best)" in capsys.readouterr().out
    exported = distbelief.load_model(tmp_path / "best.h5")
    np.testing.assert_array_equal(next(exported.named_parameters())[1],
                                  next(distbelief.load_model(out).named_parameters())[1])
    with pytest.raises(UserError, match="is one model"):
        read_trained(tmp_path / "best.h5", which="last")


def test_status_names_both(peaked, capsys) -> None:
    out, summary, _, _ = peaked
    capsys.readouterr()
    assert main(["status", str(out)]) == 0
    text = capsys.readouterr().out
    assert (f"best checkpoint:   {summary['best']['path']} (step "
            f"{summary['best']['step']:,d}, test accuracy "
            f"{summary['best']['accuracy']:.4f})") in text
    assert f"(step {STEPS:,d}," in text


def test_a_resumed_run_keeps_the_best_and_knows_its_figure(peaked, data_dir: Path,
                                                          tmp_path: Path) -> None:
    import shutil

    out, summary, _, _ = peaked
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    config = make_config(data_dir, copy, f"run.max_steps={STEPS + 30}")
    assert BestKeeper(config, None, "sgd").best["accuracy"] == summary["best"]["accuracy"]
    resumed = sgd.train(config, None)  # from the zeroed parameters: 30 steps beat no best
    assert resumed["steps"] == STEPS + 30 and resumed["resumed_from"]
    assert resumed["best"]["step"] == summary["best"]["step"]
    assert resumed["best"]["accuracy"] == summary["best"]["accuracy"]
    assert resumed["last"]["step"] == STEPS + 30
    assert [s for s, _ in ckpt.list_best(ckpt.checkpoint_root(copy))] == \
        [summary["best"]["step"]]


def test_without_keep_best_there_is_none(data_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    summary = sgd.train(make_config(data_dir, out, "run.max_steps=200",
                                    "run.keep_best=false"), None)
    assert summary["best"] is None and summary["last"]["step"] == 200
    assert not ckpt.list_best(ckpt.checkpoint_root(out))
    assert evaluate_json(capsys, out)["which"] == "last"
    assert main(["evaluate", str(out), "--which", "best"]) != 0
    assert "has no best model" in capsys.readouterr().err


def test_a_crash_between_two_bests_leaves_the_newer(tmp_path: Path, data_dir: Path) -> None:
    """A best is committed before the older one is removed: two on disk read as the newer."""
    config = make_config(data_dir, tmp_path / "out")
    from distbelief.config import build_network
    from distbelief.data.hdf5 import open_dataset

    layout = build_network(config, open_dataset(config.data.path)).layout
    keeper = BestKeeper(config, layout, "sgd")
    params = np.zeros(layout.size, dtype=np.float32)
    line = {"step": 10, "samples": 320, "time": 1.0, "split": "test", "accuracy": 0.5,
            "loss": 1.0}
    first = keeper.offer(line, params)
    assert keeper.offer({**line, "step": 20, "accuracy": 0.5}, params) is None  # not higher
    older = first.with_name("kept-aside")
    first.rename(older)  # as if the removal of this one had not happened yet
    newer = keeper.offer({**line, "step": 30, "accuracy": 0.7}, params + 1)
    older.rename(first)
    found, _ = ckpt.find_best(keeper.root)
    assert found.path == newer and found.best["accuracy"] == 0.7
    assert BestKeeper(config, layout, "sgd").best["step"] == 30


def test_a_damaged_best_is_named_and_the_last_read(peaked, tmp_path: Path) -> None:
    import shutil

    from helpers import flip_bytes

    out, summary, _, _ = peaked
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    best = Path(summary["best"]["path"].replace(str(out), str(copy)))
    flip_bytes(best / ckpt.shard_part_name(0))
    with pytest.warns(UserWarning, match=f"skipped a damaged checkpoint: .*{best.name}"):
        model = distbelief.load_model(copy)
    assert (model.source["which"], model.source["step"]) == ("last", STEPS)
    with pytest.raises(UserError, match="its best model is damaged"):
        read_trained(copy, which="best")


def test_a_target_stop_reports_the_figure_that_met_it() -> None:
    from distbelief.records.metrics import accuracy_text

    summary = {"stop_reason": "target_accuracy", "eval_split": "test",
               "target_reached_accuracy": 0.8803, "final_test_accuracy": 0.8767}
    assert accuracy_text(summary) == "test accuracy 0.8803"
    assert accuracy_text({**summary, "stop_reason": "max_steps"}) == "test accuracy 0.8767"


def test_a_best_that_cannot_be_written_is_said_once_and_the_run_goes_on(
        data_dir: Path, tmp_path: Path) -> None:
    # Only the evaluating rank writes a best, so a failure there must not raise: the other
    # ranks would wait for it. The run goes on keeping none, and says why once.
    from distbelief.config import build_network
    from distbelief.data.hdf5 import open_dataset

    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoints").write_text("a file where the checkpoints folder should be\n")
    config = make_config(data_dir, out)
    network = build_network(config, open_dataset(config.data.path, labels=False))
    stream = io.StringIO()
    keeper = BestKeeper(config, network.layout, "sgd", stream)
    evaluation = {"step": 5, "samples": 50, "time": 1.0, "split": "test", "accuracy": 0.5,
                  "loss": 1.0}
    params = np.zeros(network.layout.size, np.float32)
    assert keeper.offer(evaluation, params) is None
    assert keeper.offer({**evaluation, "step": 9, "accuracy": 0.9}, params) is None
    said = [line for line in stream.getvalue().splitlines() if "best checkpoint" in line]
    assert len(said) == 1 and "not written" in said[0], stream.getvalue()
    assert keeper.failed and keeper.summary() is None
