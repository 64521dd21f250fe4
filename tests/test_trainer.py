"""Single-process training end to end on a small synthetic set, the stop rules, the run
recorder's files, and the BLAS thread setting."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import threadpoolctl
from helpers.configs import small_config_text

from distbelief.algorithms.sgd import StopRules, TrainingDiverged, train
from distbelief.config import Config, apply_overrides, config_from_dict
from distbelief.records.metrics import (
    REQUIRED_SUMMARY_KEYS,
    ResumePoint,
    RunRecorder,
    Target,
    read_metrics,
    target_text,
)
from distbelief.runtime import threads as threads_module
from distbelief.runtime.threads import get_blas_threads, set_blas_threads

CLASSES = 4
TOML = small_config_text(optimizer={"algorithm": None}, cluster=None,
                         run={"eval_every_seconds": 0.2, "progress_every_seconds": 0.1})


@pytest.fixture(scope="module")
def data_dir(synthetic_folder) -> Path:
    return synthetic_folder("trainer", num_classes=CLASSES)


def make_config(data_dir: Path, out_dir: Path, *overrides: str) -> Config:
    import tomllib

    raw = apply_overrides(tomllib.loads(TOML), [f'run.out_dir="{out_dir}"', *overrides])
    return config_from_dict(raw, data_dir / "exp.toml")


def run(data_dir: Path, out_dir: Path, *overrides: str) -> tuple[dict, list[dict], str]:
    """Train; returns (summary.json, metrics.jsonl lines, printed output)."""
    stream = io.StringIO()
    returned = train(make_config(data_dir, out_dir, *overrides), stream=stream)
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary == json.loads(json.dumps(returned))
    return summary, read_metrics(out_dir / "metrics.jsonl"), stream.getvalue()


# -- end to end ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def max_steps_run(data_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("run") / "out"
    return (out, *run(data_dir, out, "run.max_steps=1500"))


def test_max_steps_is_honoured_exactly(max_steps_run) -> None:
    _, summary, lines, _ = max_steps_run
    assert summary["steps"] == 1500
    assert summary["samples"] == 1500 * 32
    assert summary["stop_reason"] == "max_steps"
    assert max(line["step"] for line in lines) == 1500


def test_metrics_lines_have_the_required_keys(max_steps_run) -> None:
    _, _, lines, _ = max_steps_run
    train_lines = [x for x in lines if x["kind"] == "train"]
    eval_lines = [x for x in lines if x["kind"] == "eval"]
    assert train_lines and eval_lines
    for line in train_lines:
        assert {"time", "step", "samples", "loss"} <= set(line)
    for line in eval_lines:
        assert {"time", "step", "samples", "loss", "test_accuracy", "test_loss"} <= set(line)
    times = [x["time"] for x in lines]
    assert times == sorted(times) and times[0] >= 0
    # The run always ends with an evaluation of the final parameters, then its checkpoint.
    assert [(x["kind"], x["step"]) for x in lines[-2:]] == [("eval", 1500), ("checkpoint", 1500)]


def test_summary_is_complete(max_steps_run) -> None:
    out, summary, lines, _ = max_steps_run
    for key in (*REQUIRED_SUMMARY_KEYS, "stop_reason", "config_hash", "samples_per_second"):
        assert key in summary
    last_eval = [x for x in lines if x["kind"] == "eval"][-1]
    assert summary["final_test_accuracy"] == last_eval["test_accuracy"]
    assert summary["reached_target"] is False and summary["time_to_target"] is None
    assert summary["wall_seconds"] >= lines[-1]["time"]
    config = json.loads((out / "config.json").read_text())
    assert config["config_hash"] == summary["config_hash"]
    assert config["run"]["max_steps"] == 1500


def test_training_learns(max_steps_run) -> None:
    _, summary, lines, output = max_steps_run
    losses = [x["loss"] for x in lines if x["kind"] == "train"]
    first_eval = next(x for x in lines if x["kind"] == "eval")
    # Chance level is 1/4 accuracy and a loss of log(4) = 1.39.
    assert summary["final_test_accuracy"] > 0.5
    assert summary["final_test_loss"] < math.log(CLASSES) - 0.2
    assert losses[-1] < math.log(CLASSES) - 0.2
    assert summary["final_test_loss"] <= first_eval["test_loss"]
    assert "stopped (max_steps) after 1500 steps" in output


def test_same_seed_same_result(data_dir: Path, tmp_path: Path, max_steps_run) -> None:
    _, first, _, _ = max_steps_run
    again, _, _ = run(data_dir, tmp_path / "again", "run.max_steps=1500")
    assert again["final_test_loss"] == first["final_test_loss"]


def test_target_accuracy_stops_the_run(data_dir: Path, tmp_path: Path) -> None:
    summary, lines, output = run(data_dir, tmp_path / "t", "run.max_steps=0",
                                 "run.max_seconds=30", "run.target_accuracy=0.45",
                                 "run.eval_every_seconds=0.05")
    assert summary["reached_target"] is True
    assert summary["stop_reason"] == "target_accuracy"
    assert summary["final_test_accuracy"] >= 0.45
    hits = [x for x in lines if x["kind"] == "eval" and x["test_accuracy"] >= 0.45]
    assert summary["time_to_target"] == hits[0]["time"]
    # It stopped at the first evaluation that reached the target (then checkpointed).
    assert lines[-2] is hits[-1] and len(hits) == 1
    assert lines[-1]["kind"] == "checkpoint" and lines[-1]["step"] == hits[-1]["step"]
    assert summary["wall_seconds"] < 30
    # The reaching evaluation is reported as such (here it is also the final one).
    assert summary["target_reached_accuracy"] == hits[0]["test_accuracy"] >= 0.45
    assert summary["target_reached_step"] == hits[0]["step"] == summary["steps"]
    assert (f"reached 0.45 in {summary['time_to_target']:.1f}s "
            f"({hits[0]['test_accuracy']:.4f} at step {hits[0]['step']})") in output
    assert "final test accuracy" not in output  # said once, when it differs


def test_max_seconds_stops_the_run(data_dir: Path, tmp_path: Path) -> None:
    summary, lines, output = run(data_dir, tmp_path / "s", "run.max_steps=0",
                                 "run.max_seconds=0.6")
    assert summary["stop_reason"] == "max_seconds"
    # Not before its time (how soon after it the run ends is a timing, not asserted).
    assert lines[-1]["time"] >= 0.6
    assert summary["steps"] > 10  # thousands, even on a busy machine
    # Progress lines every 0.1 s: more than one in 0.6 s (about 6 on a quiet machine).
    assert sum("samples/s" in line for line in output.splitlines()) >= 2


def test_eval_samples_limits_the_test_set(data_dir: Path, tmp_path: Path) -> None:
    summary, _, _ = run(data_dir, tmp_path / "e", "run.max_steps=5", "run.eval_samples=7")
    assert summary["eval_samples"] == 7


def test_divergence_is_a_user_error(data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TrainingDiverged, match="learning_rate"):
        train(make_config(data_dir, tmp_path / "d", "optimizer.adagrad=false",
                          "optimizer.learning_rate=1e30"), stream=None)
    summary = json.loads((tmp_path / "d" / "summary.json").read_text())
    assert summary["stop_reason"] == "diverged"


def test_training_sets_the_configured_blas_threads(data_dir: Path, tmp_path: Path) -> None:
    before = get_blas_threads()
    try:
        set_blas_threads(2)
        run(data_dir, tmp_path / "th", "run.max_steps=3", "run.threads=1")
        assert get_blas_threads() == 1
    finally:
        set_blas_threads(before)


# -- stop rules -----------------------------------------------------------------------------------


def test_stop_rules() -> None:
    rules = StopRules(max_steps=10, max_seconds=2.0, target=Target("accuracy", 0.8))
    assert rules.budget_spent(9, 1.9) is None
    assert rules.budget_spent(10, 0.0) == "max_steps"
    assert rules.budget_spent(3, 2.0) == "max_seconds"
    assert rules.target_reached({"accuracy": 0.8})
    assert not rules.target_reached({"accuracy": 0.79})
    assert rules.target_reason == "target_accuracy"
    unlimited = StopRules(target=None)
    assert unlimited.budget_spent(10**9, 1e9) is None
    assert not unlimited.target_reached({"accuracy": 1.0})
    # A loss or an rmse is met by falling to its target; r2 and auc by rising.
    by_loss = StopRules(target=Target("loss", 0.3))
    assert by_loss.target_reached({"loss": 0.3}) and not by_loss.target_reached({"loss": 0.31})
    assert by_loss.target_reason == "target_loss"
    by_r2 = StopRules(target=Target("r2", 0.9))
    assert by_r2.target_reached({"r2": 0.95, "loss": 9.0})
    assert not by_r2.target_reached({"r2": float("nan")})  # an undefined r2 meets nothing


# -- the run recorder ------------------------------------------------------------------------------


def test_recorder_lines_are_readable_before_finish(tmp_path: Path) -> None:
    recorder = RunRecorder(tmp_path, stream=None)
    recorder.log(1, 32, 1.5, staleness=2)
    recorder.log_eval(2, 64, 1.2, {"loss": 1.1, "accuracy": 0.5})
    # Not closed, not finished: a run killed now still leaves both lines on disk.
    lines = read_metrics(tmp_path / "metrics.jsonl")
    assert [x["kind"] for x in lines] == ["train", "eval"]
    assert lines[0]["staleness"] == 2
    assert not (tmp_path / "summary.json").exists()
    recorder.close()


def test_truncated_last_line_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1}\n{"kind": "tra')
    assert read_metrics(path) == [{"kind": "train", "step": 1}]


def test_recorder_summary_and_time_to_target(tmp_path: Path) -> None:
    recorder = RunRecorder(tmp_path, stream=None, target_accuracy=0.7)
    recorder.log_eval(10, 320, 1.0, {"loss": 1.0, "accuracy": 0.6})
    recorder.log_eval(20, 640, 0.8, {"loss": 0.7, "accuracy": 0.75})
    recorder.log_eval(30, 960, 0.7, {"loss": 0.72, "accuracy": 0.72})
    summary = recorder.finish({"stop_reason": "test"})
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == summary
    lines = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["reached_target"] is True
    assert summary["time_to_target"] == lines[1]["time"]
    assert summary["final_test_accuracy"] == 0.72
    assert summary["best_test_accuracy"] == 0.75
    assert (summary["steps"], summary["samples"]) == (30, 960)
    assert summary["stop_reason"] == "test"
    assert not list(tmp_path.glob(".*tmp*"))  # the atomic write's temp file is gone
    # The evaluation that reached the target, apart from the final one under it.
    assert (summary["target_reached_accuracy"], summary["target_reached_step"]) == (0.75, 20)


def test_summary_line_tells_the_reaching_and_the_final_evaluation_apart() -> None:
    summary = {"target_accuracy": 0.88, "reached_target": True, "time_to_target": 92.21,
               "target_reached_accuracy": 0.8803, "target_reached_step": 4100,
               "final_test_accuracy": 0.8794}
    assert target_text(summary) == ("; reached 0.88 in 92.2s (0.8803 at step 4100); "
                                    "final test accuracy 0.8794")
    assert target_text({**summary, "final_test_accuracy": 0.8803}) == \
        "; reached 0.88 in 92.2s (0.8803 at step 4100)"
    missed = {"target_accuracy": 0.88, "reached_target": False, "final_test_accuracy": 0.7}
    assert target_text(missed) == "; target 0.88 not reached"
    assert target_text({"target_accuracy": None}) == ""


def test_no_target_no_reaching_evaluation(tmp_path: Path) -> None:
    recorder = RunRecorder(tmp_path, stream=None, target_accuracy=0.9)
    recorder.log_eval(10, 320, 1.0, {"loss": 1.0, "accuracy": 0.6})
    summary = recorder.finish({"stop_reason": "test"})
    assert summary["reached_target"] is False
    assert summary["target_reached_accuracy"] is None and summary["target_reached_step"] is None


def test_recorder_progress_is_rate_limited(tmp_path: Path) -> None:
    stream = io.StringIO()
    recorder = RunRecorder(tmp_path, progress_every_seconds=0.05, stream=stream, start=0.0)
    recorder.progress(1, 100, 0.5)  # start=0.0 is long ago: due at once
    for step in range(2, 1000):
        recorder.progress(step, step * 100, 0.5)  # within 0.05 s of the first: silent
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    assert "samples/s" in lines[0] and "loss 0.5000" in lines[0]
    recorder.close()


def test_progress_never_prints_nan_for_a_loss_the_metrics_hold(tmp_path: Path) -> None:
    # Downpour's shard 0 has no mean loss before its first training line (issue 31).
    stream = io.StringIO()
    recorder = RunRecorder(tmp_path, progress_every_seconds=0.0, stream=stream, start=0.0)
    recorder.progress(1, 64, float("nan"))
    recorder.log(2, 128, 9.0909)
    recorder.progress(3, 192, float("nan"))
    first, second = stream.getvalue().splitlines()
    assert "loss -  " in first and "loss 9.0909" in second and "nan" not in first + second
    recorder.close()


def test_a_resumed_recorder_continues_the_metrics(tmp_path: Path) -> None:
    with RunRecorder(tmp_path, stream=None, target_accuracy=0.5) as recorder:
        recorder.log_eval(10, 100, 1.0, {"loss": 1.0, "accuracy": 0.4})
        recorder.log_eval(20, 200, 0.9, {"loss": 0.9, "accuracy": 0.6})   # reaches the target
        recorder.log_event("checkpoint", 20, 200, at=recorder.elapsed())
        recorder.log(30, 300, 0.8)                   # after the checkpoint: retrained
    lines_before = (tmp_path / "metrics.jsonl").read_text().splitlines()
    elapsed = read_metrics(tmp_path / "metrics.jsonl")[2]["time"]
    # The killed run was writing a line when it died.
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "tr')

    point = ResumePoint(step=20, samples=200, elapsed=elapsed, checkpoint="ckpt-0000000020")
    recorder = RunRecorder(tmp_path, stream=None, target_accuracy=0.5, resume=point)
    assert recorder.elapsed() >= elapsed
    recorder.log_eval(40, 400, 0.7, {"loss": 0.8, "accuracy": 0.55})
    summary = recorder.finish({"stop_reason": "test"})
    lines = read_metrics(tmp_path / "metrics.jsonl")
    assert [(x["kind"], x["step"]) for x in lines] == [
        ("eval", 10), ("eval", 20), ("checkpoint", 20), ("resume", 20), ("eval", 40)]
    times = [x["time"] for x in lines]
    assert times == sorted(times)
    # What came from the earlier sessions counts in the summary.
    assert summary["best_test_accuracy"] == 0.6
    assert summary["time_to_target"] == lines[1]["time"]
    assert (summary["steps"], summary["samples"]) == (40, 400)
    assert summary["wall_seconds"] >= elapsed
    # The cut lines were moved, not lost.
    discarded = (tmp_path / "metrics.discarded.jsonl").read_text().splitlines()
    assert json.loads(discarded[0])["kind"] == "discarded"
    assert discarded[1:] == [lines_before[3], '{"kind": "tr']


def test_resuming_without_metrics_starts_a_file(tmp_path: Path) -> None:
    point = ResumePoint(step=5, samples=50, elapsed=1.5, checkpoint="ckpt-0000000005")
    with RunRecorder(tmp_path, stream=None, resume=point) as recorder:
        recorder.log(6, 60, 1.0)
    lines = read_metrics(tmp_path / "metrics.jsonl")
    assert [x["kind"] for x in lines] == ["resume", "train"]
    assert lines[0]["time"] >= 1.5 and not (tmp_path / "metrics.discarded.jsonl").exists()


def test_a_new_run_replaces_old_metrics(tmp_path: Path) -> None:
    with RunRecorder(tmp_path, stream=None) as recorder:
        recorder.log(1, 1, 1.0)
    with RunRecorder(tmp_path, stream=None) as recorder:
        recorder.log(7, 7, 1.0)
    assert [x["step"] for x in read_metrics(tmp_path / "metrics.jsonl")] == [7]


# -- BLAS threads ---------------------------------------------------------------------------------


def test_set_blas_threads_changes_the_thread_count() -> None:
    before = get_blas_threads()
    assert before is not None, "numpy's BLAS was not found"
    try:
        for n in (1, 2, 1):
            assert set_blas_threads(n) is True
            assert get_blas_threads() == n
    finally:
        set_blas_threads(before)


def test_set_blas_threads_reaches_the_blas_numpy_uses() -> None:
    # threadpoolctl's own report of every loaded BLAS, numpy's among them: the count we ask
    # for is the one the library runs with, not just what our getter says back.
    before = get_blas_threads()
    try:
        for n in (2, 1):
            set_blas_threads(n)
            blas = [info for info in threadpoolctl.threadpool_info() if info["user_api"] == "blas"]
            assert blas, "threadpoolctl found no BLAS in this process"
            assert {info["num_threads"] for info in blas} == {n}
    finally:
        set_blas_threads(before)


def test_no_blas_found_warns_once_and_returns_false(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # threadpoolctl's selection as it comes back from a process without any BLAS loaded.
    monkeypatch.setattr(threads_module, "_blas_controller",
                        lambda: threadpoolctl.ThreadpoolController().select(user_api="no-such-api"))
    threads_module._warn_not_found.cache_clear()
    assert get_blas_threads() is None
    assert set_blas_threads(2) is False
    assert set_blas_threads(3) is False
    err = capsys.readouterr().err
    assert err.count("no BLAS library found") == 1, err


def test_bad_thread_count() -> None:
    with pytest.raises(ValueError):
        set_blas_threads(0)
