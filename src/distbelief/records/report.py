"""`distbelief report`: plot the curves of one or more runs from their metrics.jsonl.

Three PNG figures, every run on each (legend: the run folder's name):
    accuracy_vs_time.png     test accuracy against wall time (seconds)
    accuracy_vs_samples.png  test accuracy against training samples processed
    loss_vs_samples.png      training loss against training samples
and a table with one line per run (`summary_table`), which the command prints. When at
least one run is a Downpour run (summary.json with algorithm "downpour"), two more:
    staleness_histogram.png  share of pushes by staleness (updates the shard applied
                             between a replica's fetch and its push), one bar group per run
    replica_throughput.png   samples/s of each replica of each Downpour run, with the
                             single-process runs' samples/s as horizontal reference lines
When at least one run is a Sandblaster L-BFGS run (training lines with `grad_norm`), two
more, read from metrics.jsonl alone (so they work on a running job):
    sandblaster_iterations.png  per iteration: training loss, gradient norm, step size and
                                line-search evaluations
    sandblaster_units.png       work units committed by each replica (load balancing),
                                with the backup units issued and discarded in the legend

matplotlib is an optional dependency (`pip install 'distbelief[plot]'`); it is imported
only here, with the Agg backend, so reports work on headless cluster nodes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distbelief.errors import DataError, UserError
from distbelief.records.metrics import METRICS_FILE, SUMMARY_FILE, read_metrics

FIGURES = (
    # file name, x key, y key, which lines, x label, y label
    ("accuracy_vs_time.png", "time", "test_accuracy", "eval", "wall time (s)",
     "test accuracy"),
    ("accuracy_vs_samples.png", "samples", "test_accuracy", "eval", "training samples",
     "test accuracy"),
    ("loss_vs_samples.png", "samples", "loss", "train", "training samples", "training loss"),
)


@dataclass
class Run:
    """One run's curves, read from its folder."""

    name: str
    path: Path
    train: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    summary: dict[str, Any] | None


def load_run(path: str | Path) -> Run:
    """Read a run folder's metrics.jsonl (and summary.json when the run has finished)."""
    path = Path(path)
    metrics = path / METRICS_FILE
    if not metrics.is_file():
        what = "does not exist" if not path.exists() else f"has no {METRICS_FILE}"
        raise DataError(f"{path} {what}; give the run.out_dir of a training run")
    records = read_metrics(metrics)
    summary_path = path / SUMMARY_FILE
    summary = None
    if summary_path.is_file():
        try:
            summary = json.loads(summary_path.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{summary_path}: not valid JSON: {e}") from e
    return Run(path.resolve().name, path,
               [r for r in records if r.get("kind") == "train"],
               [r for r in records if r.get("kind") == "eval"], summary)


def import_pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or a UserError saying how to install it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("the report command needs matplotlib, which is not installed; "
                        "install it with: pip install 'distbelief[plot]'") from None
    return plt


def make_report(run_dirs: Sequence[str | Path], out_dir: str | Path) -> list[Path]:
    """Write the three figures for `run_dirs` into `out_dir`; returns the PNG paths."""
    return plot_runs([load_run(p) for p in run_dirs], out_dir)


def plot_runs(runs: Sequence[Run], out_dir: str | Path) -> list[Path]:
    """Write the three figures, all `runs` on each, into `out_dir`; returns the PNG paths."""
    plt = import_pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, x_key, y_key, kind, x_label, y_label in FIGURES:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for run in runs:
            lines = run.evals if kind == "eval" else run.train
            points = [(r[x_key], r[y_key]) for r in lines if r.get(y_key) is not None]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="." if len(points) < 50 else None, label=run.name)
        target = _common_target(runs)
        if y_key == "test_accuracy" and target is not None:
            ax.axhline(target, color="gray", linestyle=":", linewidth=1, label="target")
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / filename, dpi=100)
        plt.close(fig)
        written.append(out / filename)
    downpour = [r for r in runs if _is_downpour(r)]
    if downpour:
        written.append(_plot_staleness(plt, downpour, out / STALENESS_FIGURE))
        baselines = [r for r in runs if not _is_downpour(r)]
        written.append(_plot_throughput(plt, downpour, baselines, out / THROUGHPUT_FIGURE))
    sandblaster = [r for r in runs if _is_sandblaster(r)]
    if sandblaster:
        written.append(_plot_iterations(plt, sandblaster, out / ITERATIONS_FIGURE))
        written.append(_plot_units(plt, sandblaster, out / UNITS_FIGURE))
    return written


ITERATIONS_FIGURE = "sandblaster_iterations.png"
UNITS_FIGURE = "sandblaster_units.png"
ITERATION_PANELS = (("loss", "training loss", False), ("grad_norm", "gradient norm", True),
                    ("step_size", "step size", True),
                    ("line_search_evals", "line-search evaluations", False))


def _is_sandblaster(run: Run) -> bool:
    return any("grad_norm" in line for line in run.train)


def _plot_iterations(plt: Any, runs: Sequence[Run], path: Path) -> Path:
    """Four panels against the L-BFGS iteration."""
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, label, log) in zip(axes.flat, ITERATION_PANELS):
        for run in runs:
            points = [(r["step"], r[key]) for r in run.train if r.get(key) is not None]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="." if len(points) < 50 else None, label=run.name)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("L-BFGS iteration")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes.flat[0].legend(fontsize="small")
    return _save(plt, fig, path)


def _plot_units(plt: Any, runs: Sequence[Run], path: Path) -> Path:
    """Units each replica committed over the run, one bar group per replica."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    offsets, width = _bar_offsets(len(runs))
    most = 1
    for run, dx in zip(runs, offsets):
        lines = [r for r in run.train if "units_per_replica" in r]
        if not lines:
            continue
        totals = [sum(col) for col in zip(*(r["units_per_replica"] for r in lines))]
        most = max(most, len(totals))
        issued = sum(r.get("backup_units_issued", 0) for r in lines)
        discarded = sum(r.get("backup_units_discarded", 0) for r in lines)
        ax.bar([i + dx for i in range(len(totals))], totals, width,
               label=f"{run.name} (backups: {issued} issued, {discarded} discarded)")
    ax.set_xlabel("replica")
    ax.set_ylabel("work units committed")
    _finish_figure(ax)
    ax.set_xticks(range(most))
    return _save(plt, fig, path)


STALENESS_FIGURE = "staleness_histogram.png"
THROUGHPUT_FIGURE = "replica_throughput.png"


def _is_downpour(run: Run) -> bool:
    s = run.summary or {}
    return s.get("algorithm") == "downpour" and isinstance(s.get("replicas"), list)


def _bar_offsets(n_runs: int) -> tuple[list[float], float]:
    """x offsets and width of each run's bars inside a group, so groups do not overlap."""
    width = 0.8 / n_runs
    return [(i - (n_runs - 1) / 2) * width for i in range(n_runs)], width


def _plot_staleness(plt: Any, runs: Sequence[Run], path: Path) -> Path:
    """Share of pushes at each staleness; shares, not counts, so runs of any length compare."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    offsets, width = _bar_offsets(len(runs))
    for run, dx in zip(runs, offsets):
        stale = run.summary.get("staleness") or {}
        counts = stale.get("histogram") or []
        total = sum(counts)
        if total:
            label = f"{run.name} (mean {stale.get('mean', 0):.2f}, max {stale.get('max')})"
            cap = stale.get("histogram_cap")
            if cap is not None and len(counts) > cap:
                label += f"; the bar at {cap} counts {cap} or more"
            ax.bar([k + dx for k in range(len(counts))], [c / total for c in counts], width,
                   label=label)
    ax.set_xlabel("staleness (updates applied between fetch and push)")
    ax.set_ylabel("share of pushes")
    _finish_figure(ax)
    return _save(plt, fig, path)


def _plot_throughput(plt: Any, runs: Sequence[Run], baselines: Sequence[Run],
                     path: Path) -> Path:
    """Each replica's samples/s; single-process runs as reference lines."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    offsets, width = _bar_offsets(len(runs))
    for run, dx in zip(runs, offsets):
        replicas = run.summary["replicas"]
        ax.bar([r.get("replica", i) + dx for i, r in enumerate(replicas)],
               [r.get("samples_per_second") or 0 for r in replicas], width, label=run.name)
    for run in baselines:
        rate = (run.summary or {}).get("samples_per_second")
        if rate:
            ax.axhline(rate, linestyle="--", linewidth=1, color="gray",
                       label=f"{run.name} (single process)")
    ax.set_xlabel("replica")
    ax.set_ylabel("training samples/s")
    _finish_figure(ax)
    ax.set_xticks(range(max(len(run.summary["replicas"]) for run in runs)))
    return _save(plt, fig, path)


def _finish_figure(ax: Any) -> None:
    ax.grid(True, axis="y", alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize="small")


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _common_target(runs: Sequence[Run]) -> float | None:
    targets = {(r.summary or {}).get("target_accuracy") for r in runs}
    return targets.pop() if len(targets) == 1 else None


def summary_table(runs: Sequence[Run]) -> str:
    """One line per run: final accuracy, time to target, steps, samples/s."""
    lines = [f"{'run':<24} {'final acc':>9} {'to target':>10} {'steps':>8} {'samples/s':>10}"]
    for run in runs:
        s = run.summary or {}
        final = s.get("final_test_accuracy")
        final = final if final is not None else (run.evals[-1]["test_accuracy"]
                                                 if run.evals else None)
        to_target = s.get("time_to_target")
        rate = s.get("samples_per_second")
        lines.append(f"{run.name:<24} {_fmt(final, '.4f'):>9} "
                     f"{_fmt(to_target, '.1f', 's'):>10} {_fmt(s.get('steps'), 'd'):>8} "
                     f"{_fmt(rate, '.0f'):>10}")
    return "\n".join(lines)


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"
