"""`distbelief report`: PNG figures for several runs, the summary table, clear errors for a
missing run folder or a missing matplotlib."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from distbelief.errors import DataError, UserError
from distbelief.records.metrics import RunRecorder
from distbelief.records.report import (
    FIGURES,
    STALENESS_FIGURE,
    THROUGHPUT_FIGURE,
    default_out_dir,
    load_run,
    make_report,
    plot_runs,
    summary_table,
    write_metrics_csv,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def fake_run(folder: Path, accuracies: list[float], finish: bool = True) -> Path:
    """A run folder with metrics written through the real recorder (no training needed)."""
    recorder = RunRecorder(folder, stream=None, target_accuracy=0.8, start=0.0)
    for i, accuracy in enumerate(accuracies, 1):
        recorder.log(i * 10, i * 640, 2.0 / i)
        recorder.log_eval(i * 10, i * 640, 2.0 / i, {"loss": 1.5 / i, "accuracy": accuracy})
    if finish:
        recorder.finish({"stop_reason": "max_steps"})
    else:
        recorder.close()
    return folder


def test_report_writes_three_pngs_for_several_runs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    a = fake_run(tmp_path / "sgd", [0.3, 0.6, 0.85])
    b = fake_run(tmp_path / "downpour", [0.5, 0.7], finish=False)  # still running
    paths = make_report([a, b], tmp_path / "plots")
    assert sorted(p.name for p in paths) == sorted(f[0] for f in FIGURES)
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 5000


def record_figures(plt, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """What each figure shows a person, captured as it is closed after saving."""
    figures: list[dict] = []
    close = plt.close

    def record_then_close(fig) -> None:
        fig.canvas.draw()
        ax = fig.axes[0]
        figures.append({
            "title": fig._suptitle.get_text() if fig._suptitle else "",
            "legend": [t.get_text() for t in fig.legends[0].get_texts()] if fig.legends else [],
            "axes_legend": ax.get_legend(),
            "offsets": [a.xaxis.get_offset_text().get_text() + a.yaxis.get_offset_text().get_text()
                        for a in fig.axes],
            "xticks": [t.get_text() for t in ax.get_xticklabels()],
            "xlim": ax.get_xlim(), "ylabel": ax.get_ylabel(),
            "texts": [text.get_text() for text in ax.texts],
        })
        close(fig)

    monkeypatch.setattr(plt, "close", record_then_close)
    return figures


def test_report_figures_hold_one_curve_per_run(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    a = fake_run(tmp_path / "first", [0.3, 0.6])
    b = fake_run(tmp_path / "second", [0.4, 0.5, 0.9])
    figures = record_figures(plt, monkeypatch)
    make_report([a, b], tmp_path / "plots")
    assert len(figures) == 3
    for figure in figures:
        assert figure["legend"][:2] == ["first", "second"]
        assert figure["axes_legend"] is None  # below the axes, never over the data
        assert figure["title"].endswith("\nfirst, second")
        assert figure["offsets"] == [""]
    accuracy = [f for f in figures if f["ylabel"] == "test accuracy"]
    assert len(accuracy) == 2 and all("target 0.8" in f["legend"] for f in accuracy)
    loss = [f for f in figures if f["ylabel"].startswith("training loss")]
    assert loss[0]["ylabel"] == "training loss (mean over each 0.5 s of steps)"


def test_large_sample_counts_have_no_offset_notation(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    recorder = RunRecorder(tmp_path / "long", stream=None, start=0.0)
    for i in range(1, 6):  # samples near 3e6: matplotlib would write "1e6" by the axis
        recorder.log(10_000 + i, 3_000_000 + i * 640, 0.5)
        recorder.log_eval(10_000 + i, 3_000_000 + i * 640, 0.5, {"loss": 0.5, "accuracy": 0.8 + i / 100})
    recorder.finish()
    figures = record_figures(plt, monkeypatch)
    make_report([tmp_path / "long"], tmp_path / "plots")
    samples = [f for f in figures if f["title"].startswith("Test accuracy against training")]
    assert samples[0]["offsets"] == [""]
    assert all(t.replace(",", "").isdigit() for t in samples[0]["xticks"] if t)
    assert any("," in t for t in samples[0]["xticks"])


def fake_downpour(folder: Path, histogram: list[int], replicas: int) -> Path:
    """A finished Downpour run folder with the summary fields the report reads."""
    recorder = RunRecorder(folder, stream=None, target_accuracy=0.8, start=0.0)
    recorder.log(10, 640, 1.0)
    recorder.log_eval(10, 640, 1.0, {"loss": 1.0, "accuracy": 0.5})
    mean = sum(k * c for k, c in enumerate(histogram)) / sum(histogram)
    recorder.finish({"algorithm": "downpour",
                     "replicas": [{"replica": r, "samples_per_second": 100.0 + r}
                                  for r in range(replicas)],
                     "staleness": {"histogram": histogram, "histogram_cap": len(histogram) - 1,
                                   "mean": mean,
                                   "max": max(k for k, c in enumerate(histogram) if c)}})
    return folder


def test_staleness_axis_has_integer_bins_up_to_the_largest_seen(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    run = fake_downpour(tmp_path / "two", [5, 30, 10, 3, 1] + [0] * 59, replicas=2)
    figures = record_figures(plt, monkeypatch)
    written = {p.name for p in make_report([run], tmp_path / "plots")}
    assert {STALENESS_FIGURE, THROUGHPUT_FIGURE} <= written
    stale = next(f for f in figures if f["title"].startswith("Staleness"))
    assert stale["xticks"] == ["0", "1", "2", "3", "4"]  # not -0.4 .. 0.4, not up to 63
    assert stale["xlim"] == (-0.5, 4.5)


def test_throughput_shows_each_replicas_rate_and_the_runs_total(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The README's quick start (1 shard, 2 replicas): a person reads both replicas' figures.
    plt = pytest.importorskip("matplotlib.pyplot")
    run = fake_downpour(tmp_path / "quick", [5, 30, 10], replicas=2)  # 100 and 101 samples/s
    figures = record_figures(plt, monkeypatch)
    make_report([run], tmp_path / "plots")
    throughput = next(f for f in figures if f["title"].startswith("Training throughput"))
    assert throughput["xticks"] == ["0", "1"]
    assert throughput["texts"] == ["100", "101"]
    assert throughput["legend"] == ["quick (total 201 samples/s over 2 replicas)"]


def test_no_staleness_histogram_when_every_push_was_fresh(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run = fake_downpour(tmp_path / "one", [100] + [0] * 63, replicas=1)
    notes: list[str] = []
    written = {p.name for p in plot_runs([load_run(run)], tmp_path / "plots", notes)}
    assert STALENESS_FIGURE not in written and THROUGHPUT_FIGURE in written
    assert notes == [f"{STALENESS_FIGURE} not drawn: every push had staleness 0 (one replica)"]


def test_default_out_dir_is_the_runs_own_folder(tmp_path: Path) -> None:
    assert default_out_dir([tmp_path / "runs" / "a"]) == tmp_path / "runs" / "a"
    several = default_out_dir([tmp_path / "runs" / "a", tmp_path / "other" / "b"])
    assert several == (tmp_path / "runs" / "compare-a+b").resolve()


def test_metrics_csv_holds_every_training_and_evaluation_line(tmp_path: Path) -> None:
    import csv

    runs = [load_run(fake_run(tmp_path / "sgd", [0.3, 0.6])),
            load_run(fake_run(tmp_path / "downpour", [0.5], finish=False))]
    path = write_metrics_csv(runs, tmp_path / "out")
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["run"], r["kind"], r["step"]) for r in rows] == [
        ("sgd", "train", "10"), ("sgd", "eval", "10"), ("sgd", "train", "20"),
        ("sgd", "eval", "20"), ("downpour", "train", "10"), ("downpour", "eval", "10")]
    assert rows[1]["test_accuracy"] == "0.3" and rows[0]["test_accuracy"] == ""
    assert float(rows[2]["loss"]) == 1.0


def test_summary_table(tmp_path: Path) -> None:
    runs = [load_run(fake_run(tmp_path / "done", [0.5, 0.9])),
            load_run(fake_run(tmp_path / "running", [0.4], finish=False))]
    lines = summary_table(runs).splitlines()
    assert len(lines) == 3
    assert lines[1].split()[:2] == ["done", "0.9000"]
    assert lines[2].split()[:2] == ["running", "0.4000"]


def test_missing_run_folder_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_run(tmp_path / "nope")
    with pytest.raises(DataError, match="has no metrics.jsonl"):
        load_run(tmp_path)


def test_corrupt_metrics_line_is_a_data_error(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"kind": "eval"}\nnot json\n{"kind": "eval"}\n')
    with pytest.raises(DataError, match="line 2"):
        load_run(tmp_path)


def test_without_matplotlib_one_clear_message(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    run = fake_run(tmp_path / "r", [0.5])
    # None in sys.modules makes `import matplotlib` raise ImportError.
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(UserError) as info:
        make_report([run], tmp_path / "plots")
    assert "matplotlib" in str(info.value)
    assert "pip install 'distbelief[plot]'" in str(info.value)
    assert not (tmp_path / "plots").exists()


def test_metrics_and_summary_are_strict_json_after_divergence(tmp_path: Path) -> None:
    recorder = RunRecorder(tmp_path / "nan", stream=None, start=0.0)
    recorder.log(1, 64, 0.5)
    recorder.log(2, 128, float("nan"), grad_norm=float("inf"))
    recorder.finish({"stop_reason": "diverged", "final_loss": float("nan")})

    def reject(token: str) -> None:
        raise AssertionError(f"non-standard JSON token {token}")

    lines = [json.loads(t, parse_constant=reject)
             for t in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    assert lines[1]["loss"] is None and lines[1]["grad_norm"] is None
    summary = json.loads((tmp_path / "nan" / "summary.json").read_text(), parse_constant=reject)
    assert summary["final_loss"] is None and summary["stop_reason"] == "diverged"


def test_a_regressions_score_figures_are_named_by_r2_with_its_target(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    from distbelief.records.metrics import Target

    runs = []
    for name in ("sgd", "hogwild"):
        recorder = RunRecorder(tmp_path / name, stream=None, target=Target("r2", 0.95),
                               score="r2", start=0.0)
        for i, r2 in enumerate([0.5, 0.9, 0.97], 1):
            recorder.log(i * 10, i * 640, 1.0 / i)
            recorder.log_eval(i * 10, i * 640, 0.1 / i, {"loss": 0.1 / i, "r2": r2,
                                                          "rmse": 0.3 / i})
        recorder.finish({"stop_reason": "target_r2"})
        runs.append(tmp_path / name)
    figures = record_figures(plt, monkeypatch)
    paths = make_report(runs, tmp_path / "plots")
    assert sorted(p.name for p in paths) == ["loss_vs_samples.png", "r2_vs_samples.png",
                                             "r2_vs_time.png"]
    scored = [f for f in figures if f["ylabel"] == "test r2"]
    assert len(scored) == 2 and all("target 0.95" in f["legend"] for f in scored)
