"""`distbelief report`: plot the curves of one or more runs from their metrics.jsonl.

Three PNG figures, every run on each (legend: the run folder's name):
    accuracy_vs_time.png     test accuracy against wall time (seconds)
    accuracy_vs_samples.png  test accuracy against training samples processed
                             (named by the runs' score: r2_vs_time.png and
                             r2_vs_samples.png for regressions; the target's line where
                             the runs' common target is of that metric)
    loss_vs_samples.png      training loss against training samples: every trainer logs
                             the mean loss over the steps of each LOG_EVERY_SECONDS (0.5 s)
                             window, so the curves compare; Sandblaster logs the loss of
                             each L-BFGS iterate on its batch, and its legend says so
a table with one line per run (`summary_table`), which the command prints, and
metrics.csv, every run's training and evaluation lines as one table. When at
least one run is a Downpour, EASGD or asynchronous DiLoCo run (summary.json with
algorithm "downpour", "easgd" or "diloco" and a list of replicas), two more:
    staleness_histogram.png  share of pushes by staleness (updates the shard applied
                             between a replica's fetch and its push), one bar group per run;
                             not drawn when every push had staleness 0 (one replica)
    replica_throughput.png   samples/s of each replica of each Downpour run (on each bar;
                             the run's total in the legend), with the single-process
                             runs' samples/s as horizontal reference lines
When at least one run is a Sandblaster L-BFGS run (training lines with `grad_norm`), two
more, read from metrics.jsonl alone (so they work on a running job):
    sandblaster_iterations.png  per iteration: training loss, gradient norm, step size and
                                line-search evaluations
    sandblaster_units.png       work units committed by each replica (load balancing),
                                with the backup units issued and discarded in the legend

Every figure has a title naming its runs, its legend outside the data (below the axes)
and plain tick labels (no offset or 1e6 notation). `default_out_dir` is where the
command writes them without --out: a single run's own folder.

matplotlib is an optional dependency (`pip install 'distbelief[plot]'`); it is imported
only here, with the Agg backend, so reports work on headless cluster nodes.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distbelief.errors import DataError, UserError
from distbelief.records.metrics import (
    LOG_EVERY_SECONDS,
    METRICS_FILE,
    SUMMARY_FILE,
    accuracy_name,
    eval_accuracy,
    line_score,
    read_metrics,
    score_name,
    summary_target,
    write_text_atomic,
)

FIGURES = (
    # file name, x key, y key, which lines, x label, y label, title ("accuracy": on the
    # runs' eval split, named by accuracy_name: test, or validation)
    ("accuracy_vs_time.png", "time", "accuracy", "eval", "wall time (s)",
     "accuracy", "accuracy against time"),
    ("accuracy_vs_samples.png", "samples", "accuracy", "eval", "training samples",
     "accuracy", "accuracy against training samples"),
    ("loss_vs_samples.png", "samples", "loss", "train", "training samples",
     f"training loss (mean over each {LOG_EVERY_SECONDS:g} s of steps)",
     "Training loss against training samples"),
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
    evals = [{**r, "accuracy": eval_accuracy(r)} for r in records if r.get("kind") == "eval"]
    return Run(path.resolve().name, path,
               [r for r in records if r.get("kind") == "train"], evals, summary)


METRICS_CSV = "metrics.csv"
CSV_COLUMNS = ("run", "kind", "time", "step", "samples", "loss", "test_accuracy",
               "test_loss", "val_accuracy", "val_loss", "test_r2", "test_rmse", "test_auc",
               "val_r2", "val_rmse", "val_auc")


def write_metrics_csv(runs: Sequence[Run], out_dir: str | Path) -> Path:
    """The runs' training and evaluation lines as one CSV table (a spreadsheet's or
    pandas' view of metrics.jsonl): a row per line, CSV_COLUMNS, empty where a line has
    no value. Written atomically."""
    import csv
    import io

    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for run in runs:
        for line in sorted([*run.train, *run.evals], key=lambda r: (r["time"], r["kind"])):
            writer.writerow([run.name, *("" if line.get(key) is None else line[key]
                                         for key in CSV_COLUMNS[1:])])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / METRICS_CSV, text.getvalue())
    return out / METRICS_CSV


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


def default_out_dir(run_dirs: Sequence[str | Path]) -> Path:
    """Where `report` writes without --out: one run's own folder; for several, a
    `compare-A+B` folder beside the first (never a folder shared by unrelated reports)."""
    first = Path(run_dirs[0])
    if len(run_dirs) == 1:
        return first
    names = "+".join(Path(p).resolve().name for p in run_dirs)
    return first.resolve().parent / f"compare-{names}"


def make_report(run_dirs: Sequence[str | Path], out_dir: str | Path) -> list[Path]:
    """Write the three figures for `run_dirs` into `out_dir`; returns the PNG paths."""
    return plot_runs([load_run(p) for p in run_dirs], out_dir)


def plot_runs(runs: Sequence[Run], out_dir: str | Path,
              notes: list[str] | None = None) -> list[Path]:
    """Write the figures, all `runs` on each, into `out_dir`; returns the PNG paths.
    A figure left out (nothing to show) gets a line in `notes`, when given."""
    plt = import_pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    score = _common_score(runs)
    for filename, x_key, y_key, kind, x_label, y_label, title in FIGURES:
        if y_key == "accuracy":  # the score's figures: named by it
            filename = filename.replace("accuracy", score, 1)
        fig, ax = _figure(plt)
        for run in runs:
            lines = run.evals if kind == "eval" else run.train
            points = [(r[x_key], r[y_key]) for r in lines if r.get(y_key) is not None]
            if points:
                xs, ys = zip(*points)
                label = run.name
                if y_key == "loss" and _is_sandblaster(run) and len(runs) > 1:
                    label += " (Sandblaster: loss of each L-BFGS iterate on its batch)"
                ax.plot(xs, ys, marker="." if len(points) < 50 else None, label=label)
        target = _common_target(runs)
        if y_key == "accuracy":
            y_label = _accuracy_label(runs)
            title = f"{y_label.capitalize()} {title.removeprefix('accuracy ')}"
        if y_key == "accuracy" and target is not None and target["metric"] == score:
            ax.axhline(target["value"], color="gray", linestyle=":", linewidth=1,
                       label=f"target {target['value']:g}")
        if y_key == "loss" and all(_is_sandblaster(run) for run in runs):
            y_label = "training loss (each L-BFGS iterate, on its batch)"
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        ax.grid(True, alpha=0.3)
        written.append(_save(plt, fig, out / filename, title, runs))
    downpour = [r for r in runs if _is_downpour(r)]
    if downpour:
        if any(_staleness_bins(r) for r in downpour):
            written.append(_plot_staleness(plt, downpour, out / STALENESS_FIGURE))
        elif notes is not None:
            notes.append(f"{STALENESS_FIGURE} not drawn: every push had staleness 0 "
                         "(one replica)")
        baselines = [r for r in runs if (r.summary or {}).get("algorithm") == "sgd"]
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
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5), layout="constrained")
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
        ax.xaxis.get_major_locator().set_params(integer=True)
        if key == "line_search_evals":
            ax.yaxis.get_major_locator().set_params(integer=True)
    return _save(plt, fig, path, "Sandblaster L-BFGS iterations", runs,
                 legend_from=axes.flat[0])


def _plot_units(plt: Any, runs: Sequence[Run], path: Path) -> Path:
    """Units each replica committed over the run, one bar group per replica."""
    fig, ax = _figure(plt)
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
    return _save(plt, fig, path, "Sandblaster work units per replica", runs)


STALENESS_FIGURE = "staleness_histogram.png"
THROUGHPUT_FIGURE = "replica_throughput.png"


def _is_downpour(run: Run) -> bool:
    s = run.summary or {}
    # EASGD and asynchronous DiLoCo run on Downpour's shards and replicas: the same
    # figures (synchronous DiLoCo's `replicas` is a count, not a list).
    return s.get("algorithm") in ("downpour", "easgd", "diloco") \
        and isinstance(s.get("replicas"), list)


def _bar_offsets(n_runs: int) -> tuple[list[float], float]:
    """x offsets and width of each run's bars inside a group, so groups do not overlap."""
    width = 0.8 / n_runs
    return [(i - (n_runs - 1) / 2) * width for i in range(n_runs)], width


def _staleness_bins(run: Run) -> list[int]:
    """The run's push counts by staleness, up to the largest staleness seen; empty when
    every push had staleness 0 (nothing worth a histogram)."""
    counts = list((run.summary.get("staleness") or {}).get("histogram") or [])
    while counts and counts[-1] == 0:
        counts.pop()
    return counts if len(counts) > 1 else []


def _plot_staleness(plt: Any, runs: Sequence[Run], path: Path) -> Path:
    """Share of pushes at each staleness; shares, not counts, so runs of any length compare.
    The axis ends at the largest staleness any run saw, with integer ticks."""
    fig, ax = _figure(plt)
    offsets, width = _bar_offsets(len(runs))
    top = 1
    for run, dx in zip(runs, offsets):
        stale = run.summary.get("staleness") or {}
        counts = list(stale.get("histogram") or [])
        while len(counts) > 1 and counts[-1] == 0:
            counts.pop()
        total = sum(counts)
        if total:
            top = max(top, len(counts))
            label = f"{run.name} (mean {stale.get('mean', 0):.2f}, max {stale.get('max')})"
            cap = stale.get("histogram_cap")
            if cap is not None and len(counts) > cap:
                label += f"; the bar at {cap} counts {cap} or more"
            ax.bar([k + dx for k in range(len(counts))], [c / total for c in counts], width,
                   label=label)
    ax.set_xlabel("staleness (updates applied between fetch and push)")
    ax.set_ylabel("share of pushes")
    _finish_figure(ax)
    ax.set_xlim(-0.5, top - 0.5)
    if top <= 20:
        ax.set_xticks(range(top))
    return _save(plt, fig, path, "Staleness of the pushes", runs)


def _plot_throughput(plt: Any, runs: Sequence[Run], baselines: Sequence[Run],
                     path: Path) -> Path:
    """Each replica's samples/s, written on its bar, and the run's total over its replicas
    in the legend; single-process runs as reference lines."""
    fig, ax = _figure(plt)
    offsets, width = _bar_offsets(len(runs))
    for run, dx in zip(runs, offsets):
        replicas = run.summary["replicas"]
        rates = [r.get("samples_per_second") or 0 for r in replicas]
        label = run.name
        if len(replicas) > 1:
            label += f" (total {sum(rates):,.0f} samples/s over {len(replicas)} replicas)"
        bars = ax.bar([r.get("replica", i) + dx for i, r in enumerate(replicas)],
                      rates, width, label=label)
        if len(replicas) <= 16:  # more would crowd the bars' labels into each other
            ax.bar_label(bars, labels=[f"{rate:,.0f}" for rate in rates], fontsize="small")
    shown = list(runs)
    for run, style in zip(baselines, itertools.cycle(("--", ":", "-.", (0, (5, 1, 1, 1))))):
        rate = (run.summary or {}).get("samples_per_second")
        if rate:
            shown.append(run)
            ax.axhline(rate, linestyle=style, linewidth=1.2, color="black",
                       label=f"{run.name} (single process, {rate:,.0f} samples/s)")
    ax.set_xlabel("replica")
    ax.set_ylabel("training samples/s")
    _finish_figure(ax)
    ax.set_xticks(range(max(len(run.summary["replicas"]) for run in runs)))
    return _save(plt, fig, path, "Training throughput of each replica", shown)


def _figure(plt: Any) -> tuple[Any, Any]:
    """One figure with one axes; constrained layout keeps the legend below it clear."""
    return plt.subplots(figsize=(7, 5), layout="constrained")


def _finish_figure(ax: Any) -> None:
    ax.grid(True, axis="y", alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)


def _plain_ticks(ax: Any) -> None:
    """Tick labels as numbers a person reads: no offset, no 1e6 factor, thousands
    separated on large axes."""
    from matplotlib.ticker import FuncFormatter

    for axis in (ax.xaxis, ax.yaxis):
        if axis.get_scale() == "log":  # 0.5, 1, 2 rather than 5 x 10^-1
            low, high = axis.get_view_interval()
            few_decades = high <= 100 * low
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(FuncFormatter(
                lambda v, _, few=few_decades: f"{v:g}" if few and _mantissa(v) in (2, 5) else ""))
            continue
        low, high = axis.get_view_interval()
        if max(abs(low), abs(high)) >= 10_000:
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        else:
            axis.get_major_formatter().set_useOffset(False)
            axis.get_major_formatter().set_scientific(False)


def _mantissa(value: float) -> int:
    """The leading digit of a positive number (2 for 0.2, 20 and 2000)."""
    return int(round(value / 10 ** math.floor(math.log10(value)), 6)) if value > 0 else 0


def _save(plt: Any, fig: Any, path: Path, title: str, runs: Sequence[Run],
          legend_from: Any = None) -> Path:
    """Title (naming the runs), the legend below the axes, plain ticks; write the PNG."""
    fig.suptitle(f"{title}\n{', '.join(run.name for run in runs)}", fontsize="medium")
    for ax in fig.axes:
        _plain_ticks(ax)
    return save_with_legend(plt, fig, path, legend_from or fig.axes[0])


def save_with_legend(plt: Any, fig: Any, path: Path, legend_from: Any) -> Path:
    """The legend of `legend_from`'s lines below the axes (one column when a label is
    long); write the PNG and close the figure."""
    handles, labels = legend_from.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", fontsize="small",
                   ncols=1 if max(len(label) for label in labels) > 40 else 2)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _accuracy_label(runs: Sequence[Run]) -> str:
    """What the accuracy figures' axis shows: test or validation accuracy, or both."""
    names = {accuracy_name(run.evals) for run in runs if run.evals}
    return names.pop() if len(names) == 1 else "accuracy (validation or test, by run)"


def _common_score(runs: Sequence[Run]) -> str:
    """The score every run's evaluations carry (accuracy, or r2), "accuracy" when they
    differ: what the score's figures are named by."""
    scores = {line_score(run.evals[-1]) for run in runs if run.evals}
    return scores.pop() if len(scores) == 1 else "accuracy"


def _common_target(runs: Sequence[Run]) -> dict[str, Any] | None:
    """The runs' target ({"metric", "value"}) when they all have the same one."""
    targets = {tuple(sorted((summary_target(r.summary or {}) or {}).items())) for r in runs}
    target = targets.pop() if len(targets) == 1 else ()
    return dict(target) or None


def summary_table(runs: Sequence[Run]) -> str:
    """One line per run: final score (test accuracy, or r2), time to target, steps,
    samples/s."""
    scores = {score_name(run.summary or {}) for run in runs}
    head = "final acc" if scores == {"accuracy"} else "final " + "/".join(sorted(scores))
    lines = [f"{'run':<24} {head:>9} {'to target':>10} {'steps':>8} {'samples/s':>10}"]
    for run in runs:
        s = run.summary or {}
        final = s.get(f"final_test_{score_name(s)}")
        final = final if final is not None else (run.evals[-1]["accuracy"]
                                                 if run.evals else None)
        to_target = s.get("time_to_target")
        rate = s.get("samples_per_second")
        lines.append(f"{run.name:<24} {_fmt(final, '.4f'):>9} "
                     f"{_fmt(to_target, '.1f', 's'):>10} {_fmt(s.get('steps'), 'd'):>8} "
                     f"{_fmt(rate, '.0f'):>10}")
    return "\n".join(lines)


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"
