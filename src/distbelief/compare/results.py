"""A comparison's results, read from its run folders: the table and the figures in the
style of Dean et al. 2012.

Every number is of the target's metric (METRIC below: accuracy, loss, r2, rmse or auc), on
the split the runs evaluated (validation when they hold one out, else test); a falling
metric (loss, rmse) reaches its target by falling to it.

    table.csv                     one row per group (algorithm, replicas, learning rate):
                                  seeds run, reached the target, failed; time and samples
                                  to the target (median, min, max over the seeds that
                                  reached it); the final test METRIC (median, min, max);
                                  the target's metric and value
    runs.csv                      one row per run, the numbers the table summarises
    METRIC_vs_time.png            the METRIC against wall time, one colour per group,
                                  every seed drawn (the paper's Figure 4)
    time_to_target_vs_cores.png   median time to the target against the ranks a run
                                  used, one line per algorithm, bars from the fastest to
                                  the slowest seed (the paper's Figure 5)
    METRIC_vs_bytes_sent.png      the METRIC against the bytes the replicas sent
                                  (summary.json's bytes_sent, issue 33), log scale: what
                                  a slow network pays for each algorithm's progress

So an accuracy comparison writes accuracy_vs_time.png and final_accuracy_* columns, as
before targets had metrics, and a loss comparison loss_vs_time.png and final_loss_*.
Only the runs of the current plan are read; a run that failed (or never ran) counts in
its group's `failed` column and draws nothing.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distbelief.compare.plan import PlannedRun
from distbelief.compare.running import (
    LOGS_DIR,
    RUNS_DIR,
    read_state,
    read_summary,
    value_format,
)
from distbelief.records.metrics import (
    METRICS_FILE,
    Target,
    eval_figures,
    read_metrics,
    summary_target,
)
from distbelief.records.report import import_pyplot, save_with_legend

TABLE_CSV = "table.csv"
RUNS_CSV = "runs.csv"
SCALING_FIGURE = "time_to_target_vs_cores.png"


def curve_figure(metric: str) -> str:
    """The file of the metric against time: accuracy_vs_time.png, loss_vs_time.png."""
    return f"{metric}_vs_time.png"


def bytes_figure(metric: str) -> str:
    """The file of the metric against bytes sent: accuracy_vs_bytes_sent.png, ..."""
    return f"{metric}_vs_bytes_sent.png"


ACCURACY_FIGURE = curve_figure("accuracy")
BYTES_FIGURE = bytes_figure("accuracy")


@dataclass
class RunResult:
    """One run's outcome, from compare.json, summary.json and metrics.jsonl."""

    run: PlannedRun
    state: str                       # finished, failed, interrupted, not run
    exit_status: int | None
    target: Target | None            # summary.json's, else the plan's
    time_to_target: float | None
    samples_to_target: int | None
    final: float | None               # the final test value of the target's metric
    wall_seconds: float | None
    curve: list[tuple[float, float]]  # (time, the metric) of each evaluation
    split: str = "test"               # what the evaluations ran on: test, or validation
    bytes_sent: int | None = None     # over all replicas (summary.json), None if unreported
    bytes_received: int | None = None
    bytes_sent_per_sample: float | None = None
    bytes_curve: list[tuple[float, float]] | None = None  # (bytes sent, the metric)


def collect(out_dir: str | Path, runs: Sequence[PlannedRun]) -> list[RunResult]:
    """Each planned run's result, in plan order: its target's metric from its evaluations
    (the validation split's when it has one) and its summary (final_test_<metric>)."""
    out = Path(out_dir)
    records = {r.get("folder"): r for r in read_state(out).get("runs", [])}
    results = []
    for run in runs:
        record = records.get(run.folder) or {}
        state = record.get("state") or "not run"
        summary = _summary(out / RUNS_DIR / run.folder) if state == "finished" else {}
        target = _target(summary, run)
        metric = _metric(target)
        evals = _evals(out / RUNS_DIR / run.folder, metric) if state != "not run" else []
        reached = summary.get("time_to_target")
        hit = next((e for e in evals if target is not None and target.met(e)), None)
        per_sample = summary.get("bytes_sent_per_sample")
        results.append(RunResult(
            run, state, record.get("exit_status"), target, reached,
            hit["samples"] if hit is not None and reached is not None else None,
            summary.get(f"final_test_{metric}"), summary.get("wall_seconds"),
            [(e["time"], e[metric]) for e in evals],
            "validation" if any(e["split"] == "val" for e in evals) else "test",
            summary.get("bytes_sent"), summary.get("bytes_received"), per_sample,
            _bytes_curve(evals, per_sample, metric)))
    return results


def _target(summary: dict[str, Any], run: PlannedRun) -> Target | None:
    """The target the run recorded (summary.json), else the one its settings give it."""
    found = summary_target(summary)
    if found is None or found.get("value") is None:
        return run.target
    return Target(str(found["metric"]), float(found["value"]))


def _bytes_curve(evals: list[dict[str, Any]], per_sample: float | None,
                 metric: str) -> list[tuple[float, float]] | None:
    """(bytes sent, the metric) of each evaluation: the bytes its metrics line logged, or
    where it logged none (Downpour's shards count them only at the end), its samples times
    the run's bytes sent per sample (each step or round of a run moves the same payload)."""
    if per_sample is None and not any("bytes_sent" in e for e in evals):
        return None
    return [(float(e["bytes_sent"]) if "bytes_sent" in e else e["samples"] * per_sample,
             e[metric]) for e in evals
            if "bytes_sent" in e or per_sample is not None]


def _evals(run_dir: Path, metric: str) -> list[dict[str, Any]]:
    """The run's evaluations that have the metric: each line's time, samples and
    bytes_sent, with its figures unprefixed (eval_figures: {"loss": ..., "r2": ...}) and
    `split` the prefix they had ("val" or "test")."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return []
    evals = []
    for line in read_metrics(path):
        if line.get("kind") != "eval":
            continue
        figures = eval_figures(line)
        if figures.get(metric) is not None and math.isfinite(figures[metric]):
            split = "val" if any(key.startswith("val_") for key in line) else "test"
            evals.append({**{k: line[k] for k in ("time", "samples", "bytes_sent")
                             if k in line}, **figures, "split": split})
    return evals


def _summary(run_dir: Path) -> dict[str, Any]:
    return read_summary(run_dir) or {}


@dataclass
class Group:
    """The runs of one algorithm at one replica count and learning rate (its seeds)."""

    algorithm: str
    replicas: int
    ranks: int
    learning_rate: float | None
    results: list[RunResult]

    @property
    def finished(self) -> list[RunResult]:
        return [r for r in self.results if r.state == "finished"]

    @property
    def reached(self) -> list[RunResult]:
        return [r for r in self.finished if r.time_to_target is not None]

    @property
    def failed(self) -> int:
        return sum(r.state != "finished" for r in self.results)

    @property
    def target(self) -> Target | None:
        return comparison_target(self.results)


def comparison_target(results: Sequence[RunResult]) -> Target | None:
    """The target the runs are measured against: the first run's that has one (plan_runs
    gives every run's target one metric)."""
    return next((r.target for r in results if r.target is not None), None)


def _groups_target(groups: Sequence[Group]) -> Target | None:
    return comparison_target([r for g in groups for r in g.results])


def _metric(target: Target | None) -> str:
    return "accuracy" if target is None else target.metric


def group_results(results: Sequence[RunResult]) -> list[Group]:
    """Results grouped over seeds, in plan order."""
    groups: dict[tuple, Group] = {}
    for result in results:
        run = result.run
        key = (run.algorithm, run.replicas, run.learning_rate)
        if key not in groups:
            groups[key] = Group(run.algorithm, run.replicas, run.ranks, run.learning_rate, [])
        groups[key].results.append(result)
    return list(groups.values())


def spread(values: Sequence[float]) -> tuple[float, float, float] | None:
    """(median, min, max), or None for no values."""
    if not values:
        return None
    return statistics.median(values), min(values), max(values)


def table_columns(metric: str) -> tuple[str, ...]:
    """table.csv's columns; the final figure's are named by the metric (final_accuracy_*,
    as before targets had metrics; final_loss_*), and the target's two are last, so a
    reader of the older columns finds them where they were."""
    spread_of = ("time_to_target", "samples_to_target", f"final_{metric}",
                 "bytes_sent_per_sample")
    return ("algorithm", "replicas", "ranks", "learning_rate", "seeds", "reached", "failed",
            *(f"{name}_{stat}" for name in spread_of for stat in ("median", "min", "max")),
            "target_metric", "target_value")


TABLE_COLUMNS = table_columns("accuracy")


def table_rows(groups: Sequence[Group]) -> list[dict[str, Any]]:
    """One dict per group, keyed by table_columns of the comparison's metric (None where
    there is nothing to show)."""
    metric = _metric(_groups_target(groups))
    rows = []
    for g in groups:
        row: dict[str, Any] = {"algorithm": g.algorithm, "replicas": g.replicas,
                               "ranks": g.ranks, "learning_rate": g.learning_rate,
                               "seeds": len(g.results), "reached": len(g.reached),
                               "failed": g.failed,
                               "target_metric": None if g.target is None else g.target.metric,
                               "target_value": None if g.target is None else g.target.value}
        for name, values in (
                ("time_to_target", [r.time_to_target for r in g.reached]),
                ("samples_to_target", [r.samples_to_target for r in g.reached
                                       if r.samples_to_target is not None]),
                (f"final_{metric}", [r.final for r in g.finished if r.final is not None]),
                ("bytes_sent_per_sample", [r.bytes_sent_per_sample for r in g.finished
                                           if r.bytes_sent_per_sample is not None])):
            stats = spread(values) or (None, None, None)
            for suffix, value in zip(("median", "min", "max"), stats):
                row[f"{name}_{suffix}"] = value
        rows.append(row)
    return rows


def format_table(rows: Sequence[dict[str, Any]], target: Target | None) -> str:
    """The table as text: medians over seeds with [min-max] beside them; a learning-rate
    column only when the comparison gave learning rates. Columns say the target's metric
    ("time to 0.88", "final accuracy"; "time to loss 0.0105", "final loss")."""
    metric = _metric(target)
    named = "" if metric == "accuracy" else f"{metric} "
    to = f"to {named}{target.value:g}" if target is not None else "to target"
    with_lr = any(row["learning_rate"] is not None for row in rows)
    lr_head = f" {'lr':>7}" if with_lr else ""
    names = [_row_name(row) for row in rows]
    width = max([len("algorithm"), *map(len, names)])
    columns = (("time " + to + " (s)", "time_to_target", ".1f", 22),
               ("samples " + to, "samples_to_target", ",.0f", 26),
               (f"final {metric}", f"final_{metric}", value_format(metric), 24))
    cells = [[_cell(row, key, spec) for _, key, spec, _ in columns] for row in rows]
    widths = [max([least, len(head), *(len(c[k]) for c in cells)])
              for k, (head, _, _, least) in enumerate(columns)]
    header = (f"{'algorithm':<{width}} {'ranks':>5}{lr_head} {'reached':>8} {'failed':>6}  "
              + "".join(f"{head:<{w}} " for (head, *_), w in zip(columns, widths))
              + "bytes sent/sample")
    lines = [header]
    for row, name, texts in zip(rows, names, cells):
        lr = ""
        if with_lr:
            lr = " " + (f"{row['learning_rate']:>7g}" if row["learning_rate"] is not None
                        else f"{'-':>7}")
        lines.append((
            f"{name:<{width}} {row['ranks']:>5}{lr} {row['reached']:>4}/{row['seeds']:<3} "
            f"{row['failed']:>6}  " + "".join(f"{t:<{w}} " for t, w in zip(texts, widths))
            + _cell(row, "bytes_sent_per_sample", ",.0f")).rstrip())
    # A falling metric's target is reached from above: say so where a reader may not guess.
    falls = "" if target is None or target.rises else \
        f" (a {target.metric} at or below {target.value:g})"
    lines.append("median over the seeds [min-max]; times and samples over the seeds that "
                 f"reached the target{falls}")
    return "\n".join(lines)


def _row_name(row: dict[str, Any]) -> str:
    if row["algorithm"].startswith("sgd"):
        return row["algorithm"]
    return f"{row['algorithm']}, {row['replicas']} repl."


def _cell(row: dict[str, Any], name: str, spec: str) -> str:
    median, low, high = row[f"{name}_median"], row[f"{name}_min"], row[f"{name}_max"]
    if median is None:
        return "-"
    text, low_text, high_text = (f"{v:{spec}}" for v in (median, low, high))
    return text if low_text == high_text else f"{text} [{low_text}-{high_text}]"


def write_tables(out_dir: str | Path, results: Sequence[RunResult],
                 rows: Sequence[dict[str, Any]]) -> list[Path]:
    """table.csv (the groups) and runs.csv (each run), their final figure's columns named
    by the comparison's metric (table_columns); returns their paths."""
    out = Path(out_dir)
    metric = _metric(comparison_target(results))
    table = out / TABLE_CSV
    _write_csv(table, table_columns(metric), rows)
    per_run = out / RUNS_CSV
    columns = ("algorithm", "replicas", "ranks", "learning_rate", "seed", "state",
               "exit_status", "time_to_target", "samples_to_target", f"final_{metric}",
               "wall_seconds", "bytes_sent", "bytes_received", "bytes_sent_per_sample",
               "run_dir", "log", "target_metric", "target_value")
    _write_csv(per_run, columns, [{
        "algorithm": r.run.algorithm, "replicas": r.run.replicas, "ranks": r.run.ranks,
        "learning_rate": r.run.learning_rate, "seed": r.run.seed, "state": r.state,
        "exit_status": r.exit_status, "time_to_target": r.time_to_target,
        "samples_to_target": r.samples_to_target, f"final_{metric}": r.final,
        "wall_seconds": r.wall_seconds, "bytes_sent": r.bytes_sent,
        "bytes_received": r.bytes_received,
        "bytes_sent_per_sample": r.bytes_sent_per_sample,
        "run_dir": f"{RUNS_DIR}/{r.run.folder}",
        "log": f"{LOGS_DIR}/{r.run.folder}.log",
        "target_metric": None if r.target is None else r.target.metric,
        "target_value": None if r.target is None else r.target.value} for r in results])
    return [table, per_run]


def _write_csv(path: Path, columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> None:
    temp = path.with_name(path.name + ".tmp")
    with temp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else row[k] for k in columns})
    temp.replace(path)


# ---------------------------------------------------------------------------------------
# Figures


def plot(out_dir: str | Path, groups: Sequence[Group], target: Target | None,
         title: str) -> list[Path]:
    """The three figures into out_dir, of the target's metric (curve_figure,
    SCALING_FIGURE, bytes_figure); returns their paths."""
    plt = import_pyplot()
    out = Path(out_dir)
    metric = _metric(target)
    return [_plot_curves(plt, groups, target, title, out / curve_figure(metric)),
            _plot_scaling(plt, groups, target, title, out / SCALING_FIGURE),
            _plot_bytes(plt, groups, target, title, out / bytes_figure(metric))]


def _group_label(g: Group, show_lr: bool) -> str:
    label = g.algorithm if g.algorithm.startswith("sgd") \
        else f"{g.algorithm}, {g.replicas} replica{'s' if g.replicas != 1 else ''}"
    label += f" ({g.ranks} rank{'s' if g.ranks != 1 else ''})"
    if show_lr and g.learning_rate is not None:
        label += f", lr {g.learning_rate:g}"
    return label


def _plot_curves(plt: Any, groups: Sequence[Group], target: Target | None, title: str,
                 path: Path) -> Path:
    """The metric against wall time (Figure 4)."""
    fig, ax = plt.subplots(figsize=(7, 5), layout="constrained")
    show_lr = len({g.learning_rate for g in groups}) > 1
    colors = _algorithm_colors(plt, groups)
    drawn: dict[str, int] = {}  # groups of each algorithm so far: one line style each
    for g in groups:
        style = LINE_STYLES[drawn.get(g.algorithm, 0) % len(LINE_STYLES)]
        drawn[g.algorithm] = drawn.get(g.algorithm, 0) + 1
        curves = [r.curve for r in g.results if r.curve]
        label = _group_label(g, show_lr)
        if len(curves) > 1:
            label += f", {len(curves)} seeds"
        if g.failed:
            label += f"; {g.failed} of {len(g.results)} failed"
        for k, curve in enumerate(curves):
            xs, ys = zip(*curve)
            ax.plot(xs, ys, color=colors[g.algorithm], linestyle=style, linewidth=1.2,
                    alpha=0.85, marker="." if len(curve) < 50 else None,
                    label=label if k == 0 else None)
        if not curves:  # keep the failed group in the legend
            ax.plot([], [], color=colors[g.algorithm], linestyle=style,
                    label=f"{label} (no curve)")
    ylabel = _value_axis(ax, groups, target)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    return _save(plt, fig, ax, path, f"{_measure(groups, target).capitalize()} against "
                                     f"time\n{title}")


LINE_STYLES = ("-", "--", ":", "-.")


def _measure(groups: Sequence[Group], target: Target | None) -> str:
    """"test accuracy", "validation loss": what the figures draw."""
    return f"{_split(groups)} {_metric(target)}"


def _value_axis(ax: Any, groups: Sequence[Group], target: Target | None) -> str:
    """With a target, its line and an axis zoomed on it: a rising metric's (accuracy, r2,
    AUC) from accuracy_axis_floor to just above the target (rising_axis_top), a falling
    metric's (loss, rmse) logarithmic over falling_axis_range; returns the axis's label."""
    ylabel = _measure(groups, target)
    if target is None:
        return ylabel
    ax.axhline(target.value, color="gray", linestyle=":", linewidth=1,
               label=f"target {target.value:g}")
    if target.rises:
        lowest = 0.0 if target.metric in ("accuracy", "auc") else -math.inf
        floor = accuracy_axis_floor(groups, target.value, lowest)
        ax.set_ylim(floor, rising_axis_top(groups, target.value))
        return f"{ylabel} (axis from {floor:g})"
    ax.set_yscale("log")
    ax.set_ylim(*falling_axis_range(groups, target.value))
    _plain_log_labels(ax.yaxis)
    return f"{ylabel} (log scale)"


def _plain_log_labels(axis: Any) -> None:
    """A log axis labelled with plain numbers (0.02, not 2x10^-2), as _save makes every
    other axis, on the ticks matplotlib's own log labels choose (fewer minor ones as the
    axis spans more decades, so they never overlap)."""
    from matplotlib import ticker

    class PlainLogFormatter(ticker.LogFormatterSciNotation):
        def __call__(self, x: float, pos: Any = None) -> str:
            return f"{x:g}" if super().__call__(x, pos) else ""

    axis.set_major_formatter(PlainLogFormatter())
    axis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False))


def _plot_bytes(plt: Any, groups: Sequence[Group], target: Target | None, title: str,
                path: Path) -> Path:
    """The metric against the bytes the replicas sent, log scale (the algorithms differ by
    orders of magnitude), in MB; a group whose runs report no bytes says so in the legend."""
    fig, ax = plt.subplots(figsize=(7, 5), layout="constrained")
    show_lr = len({g.learning_rate for g in groups}) > 1
    colors = _algorithm_colors(plt, groups)
    drawn: dict[str, int] = {}
    any_curve = False
    for g in groups:
        style = LINE_STYLES[drawn.get(g.algorithm, 0) % len(LINE_STYLES)]
        drawn[g.algorithm] = drawn.get(g.algorithm, 0) + 1
        curves = [[(b / 1e6, y) for b, y in r.bytes_curve if b > 0]
                  for r in g.results if r.bytes_curve]
        curves = [c for c in curves if c]
        label = _group_label(g, show_lr)
        rates = [r.bytes_sent_per_sample for r in g.finished
                 if r.bytes_sent_per_sample is not None]
        if rates:
            label += f", {statistics.median(rates):,.0f} B/sample"
        for k, curve in enumerate(curves):
            xs, ys = zip(*curve)
            ax.plot(xs, ys, color=colors[g.algorithm], linestyle=style, linewidth=1.2,
                    alpha=0.85, marker="." if len(curve) < 50 else None,
                    label=label if k == 0 else None)
            any_curve = True
        if not curves:
            ax.plot([], [], color=colors[g.algorithm], linestyle=style,
                    label=f"{label} (no bytes reported)")
    ylabel = _value_axis(ax, groups, target)
    if any_curve:
        ax.set_xscale("log")
        _plain_log_labels(ax.xaxis)
    ax.set_xlabel("bytes sent by all replicas (MB, log scale)")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    return _save(plt, fig, ax, path, f"{_measure(groups, target).capitalize()} against "
                                     f"bytes sent\n{title}")

ZOOM_BELOW_TARGET = 0.1
"""With a target, the accuracy figure's axis starts this far below it (the runs differ near
the target, where a full 0-1 axis squeezes them together), or lower: accuracy_axis_floor."""


def accuracy_axis_floor(groups: Sequence[Group], target: float,
                        lowest: float = 0.0) -> float:
    """Where a rising metric's axis (accuracy, r2, AUC) starts: ZOOM_BELOW_TARGET under
    the target, or lower, so that every run's best evaluation is on the figure (a run stuck
    at chance included), but not under `lowest` (0 for an accuracy)."""
    bests = [max(y for _, y in r.curve) for g in groups for r in g.results if r.curve]
    floor = min([target - ZOOM_BELOW_TARGET, *(best - 0.02 for best in bests)])
    return max(lowest, round(floor, 2))


def rising_axis_top(groups: Sequence[Group], target: float) -> float:
    """Where a rising metric's axis ends: just above the target, or above every run's best
    evaluation (a run whose first evaluation is far past the target was drawn off the
    axis), at most 1."""
    bests = [max(y for _, y in r.curve) for g in groups for r in g.results if r.curve]
    return min(1.0, max([target + 0.03, *(best + 0.01 for best in bests)]))


ZOOM_ABOVE_TARGET = 100.0
"""A falling metric's axis (loss, rmse) is logarithmic and reaches up to this many times
the target: its evaluations' start, far above, is cut off as chance is on an accuracy
axis, while a run stuck far above the target stays on it (falling_axis_range)."""


def falling_axis_range(groups: Sequence[Group], target: float) -> tuple[float, float]:
    """(bottom, top) of a falling metric's log axis: from a little under the target (or
    the lowest evaluation) to the highest evaluation, at most ZOOM_ABOVE_TARGET times the
    target, but at least high enough for every run's best (lowest) evaluation."""
    curves = [[y for _, y in r.curve if y > 0] for g in groups for r in g.results]
    curves = [c for c in curves if c]
    if not curves:
        return target / 2, target * 2
    bottom = min([target, *(min(c) for c in curves)]) / 1.25
    highest = max(max(c) for c in curves)
    top = max(min(highest * 1.25, target * ZOOM_ABOVE_TARGET), target * 1.25,
              *(min(c) * 1.25 for c in curves))
    return bottom, top


def _algorithm_colors(plt: Any, groups: Sequence[Group]) -> dict[str, str]:
    """One colour per algorithm, the same in every figure."""
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = list(dict.fromkeys(g.algorithm for g in groups))
    return {name: cycle[i % len(cycle)] for i, name in enumerate(names)}


def _plot_scaling(plt: Any, groups: Sequence[Group], target: Target | None, title: str,
                  path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 5), layout="constrained")
    lines: dict[tuple[str, float | None], list[Group]] = {}
    for g in groups:
        lines.setdefault((g.algorithm, g.learning_rate), []).append(g)
    show_lr = len({g.learning_rate for g in groups}) > 1
    colors = _algorithm_colors(plt, groups)
    ranks_seen: set[int] = set()
    for (algorithm, rate), members in lines.items():
        xs, ys, low, high = [], [], [], []
        missed: dict[str, list[str]] = {"failed": [], "target not reached": []}
        for g in sorted(members, key=lambda g: g.ranks):
            stats = spread([r.time_to_target for r in g.reached])
            if stats is None:
                why = "target not reached" if g.finished else "failed"
                missed[why].append(str(g.ranks))
                continue
            xs.append(g.ranks)
            ys.append(stats[0])
            low.append(stats[0] - stats[1])
            high.append(stats[2] - stats[0])
        ranks_seen.update(xs)
        label = algorithm + (f", lr {rate:g}" if show_lr and rate is not None else "")
        notes = [f"{why} at {', '.join(ranks)} rank{'s' if ranks != ['1'] else ''}"
                 for why, ranks in missed.items() if ranks]
        if notes:
            label += f" ({'; '.join(notes)})"
        # An errorbar even when empty, so the legend keeps the algorithms' order.
        ax.errorbar(xs, ys, yerr=[low, high], marker="o", capsize=3, label=label,
                    color=colors[algorithm])
    ax.set_xlabel("cores used (MPI ranks)")
    to = f"{target.value:g}" if target is not None else "the target"
    measure = _measure(groups, target)
    ax.set_ylabel(f"time to {to} {measure} (s)")
    ax.set_ylim(bottom=0)
    if not ranks_seen:  # say so, on an axis that still spans the rank counts that ran
        ax.text(0.5, 0.5, f"no run reached {to} {measure}", transform=ax.transAxes,
                ha="center", va="center", fontsize="large", color="dimgray")
        ax.set_ylim(0, 1)
        ranks_seen = {g.ranks for g in groups}
    if ranks_seen:
        ax.set_xticks(sorted(ranks_seen))
        ax.set_xlim(min(ranks_seen) - 0.5, max(ranks_seen) + 0.5)
    ax.grid(True, alpha=0.3)
    return _save(plt, fig, ax, path,
                 f"Time to {to} {measure} against cores\n{title}\n"
                 "median over seeds; bars: fastest to slowest seed")


def _split(groups: Sequence[Group]) -> str:
    """"validation" when the runs evaluated a validation split, else "test"."""
    splits = {r.split for g in groups for r in g.results}
    return "validation" if "validation" in splits else "test"


def _save(plt: Any, fig: Any, ax: Any, path: Path, title: str) -> Path:
    """Title, the legend below the axes, plain tick labels; write the PNG."""
    fig.suptitle(title, fontsize="medium")
    for axis in (ax.xaxis, ax.yaxis):
        formatter = axis.get_major_formatter()
        if hasattr(formatter, "set_useOffset"):
            formatter.set_useOffset(False)
            formatter.set_scientific(False)
    return save_with_legend(plt, fig, path, ax)
