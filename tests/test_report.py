"""`distbelief report`: PNG figures for several runs, the summary table, clear errors for a
missing run folder or a missing matplotlib."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from distbelief.errors import DataError, UserError
from distbelief.records.metrics import RunRecorder
from distbelief.records.report import FIGURES, load_run, make_report, summary_table

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def fake_run(folder: Path, accuracies: list[float], finish: bool = True) -> Path:
    """A run folder with metrics written through the real recorder (no training needed)."""
    recorder = RunRecorder(folder, stream=None, target_accuracy=0.8, start=0.0)
    for i, accuracy in enumerate(accuracies, 1):
        recorder.log(i * 10, i * 640, 2.0 / i)
        recorder.log_eval(i * 10, i * 640, 2.0 / i, accuracy, 1.5 / i)
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


def test_report_figures_hold_one_curve_per_run(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    a = fake_run(tmp_path / "first", [0.3, 0.6])
    b = fake_run(tmp_path / "second", [0.4, 0.5, 0.9])
    legends = []
    close = plt.close

    def record_then_close(fig) -> None:
        legends.append([t.get_text() for t in fig.axes[0].get_legend().get_texts()])
        close(fig)

    monkeypatch.setattr(plt, "close", record_then_close)
    make_report([a, b], tmp_path / "plots")
    assert len(legends) == 3
    for labels in legends:
        assert labels[:2] == ["first", "second"]


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
