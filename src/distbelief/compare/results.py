"""A comparison's results, read from its run folders: the table and the two figures in the
style of Dean et al. 2012.

    table.csv                     one row per group (algorithm, replicas, learning rate):
                                  seeds run, reached the target, failed; time and samples
                                  to the target (median, min, max over the seeds that
                                  reached it); final test accuracy (median, min, max)
    runs.csv                      one row per run, the numbers the table summarises
    accuracy_vs_time.png          test accuracy against wall time, one colour per group,
                                  every seed drawn (the paper's Figure 4)
    time_to_target_vs_cores.png   median time to the target against the ranks a run
                                  used, one line per algorithm, bars from the fastest to
                                  the slowest seed (the paper's Figure 5)
    accuracy_vs_bytes_sent.png    test accuracy against the bytes the replicas sent
                                  (summary.json's bytes_sent, issue 33), log scale: what
                                  a slow network pays for each algorithm's accuracy

Only the runs of the current plan are read; a run that failed (or never ran) counts in
its group's `failed` column and draws nothing.
"""

from __future__ import annotations

import csv
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distbelief.compare.plan import PlannedRun
from distbelief.compare.running import LOGS_DIR, RUNS_DIR, read_state, read_summary
from distbelief.records.metrics import METRICS_FILE, eval_accuracy, read_metrics
from distbelief.records.report import import_pyplot, save_with_legend

TABLE_CSV = "table.csv"
RUNS_CSV = "runs.csv"
ACCURACY_FIGURE = "accuracy_vs_time.png"
SCALING_FIGURE = "time_to_target_vs_cores.png"
BYTES_FIGURE = "accuracy_vs_bytes_sent.png"


@dataclass
class RunResult:
    """One run's outcome, from compare.json, summary.json and metrics.jsonl."""

    run: PlannedRun
    state: str                       # finished, failed, interrupted, not run
    exit_status: int | None
    target: float | None
    time_to_target: float | None
    samples_to_target: int | None
    final_accuracy: float | None
    wall_seconds: float | None
    curve: list[tuple[float, float]]  # (time, accuracy) of each evaluation (eval_accuracy)
    split: str = "test"               # what the evaluations ran on: test, or validation
    bytes_sent: int | None = None     # over all replicas (summary.json), None if unreported
    bytes_received: int | None = None
    bytes_sent_per_sample: float | None = None
    bytes_curve: list[tuple[float, float]] | None = None  # (bytes sent, accuracy)


def collect(out_dir: str | Path, runs: Sequence[PlannedRun]) -> list[RunResult]:
    """Each planned run's result, in plan order."""
    out = Path(out_dir)
    records = {r.get("folder"): r for r in read_state(out).get("runs", [])}
    results = []
    for run in runs:
        record = records.get(run.folder) or {}
        state = record.get("state") or "not run"
        evals = _evals(out / RUNS_DIR / run.folder) if state != "not run" else []
        summary = _summary(out / RUNS_DIR / run.folder) if state == "finished" else {}
        target = summary.get("target_accuracy")
        hit = next((e for e in evals if target is not None
                    and eval_accuracy(e) >= target), None)
        per_sample = summary.get("bytes_sent_per_sample")
        results.append(RunResult(
            run, state, record.get("exit_status"), target,
            summary.get("time_to_target"),
            hit["samples"] if hit is not None and summary.get("time_to_target") is not None
            else None,
            summary.get("final_test_accuracy"), summary.get("wall_seconds"),
            [(e["time"], eval_accuracy(e)) for e in evals],
            "validation" if any("val_accuracy" in e for e in evals) else "test",
            summary.get("bytes_sent"), summary.get("bytes_received"), per_sample,
            _bytes_curve(evals, per_sample)))
    return results


def _bytes_curve(evals: list[dict[str, Any]],
                 per_sample: float | None) -> list[tuple[float, float]] | None:
    """(bytes sent, accuracy) of each evaluation: the bytes its metrics line logged, or
    where it logged none (Downpour's shards count them only at the end), its samples times
    the run's bytes sent per sample (each step or round of a run moves the same payload)."""
    if per_sample is None and not any("bytes_sent" in e for e in evals):
        return None
    return [(float(e["bytes_sent"]) if "bytes_sent" in e else e["samples"] * per_sample,
             eval_accuracy(e)) for e in evals
            if "bytes_sent" in e or per_sample is not None]


def _evals(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return []
    return [r for r in read_metrics(path)
            if r.get("kind") == "eval" and eval_accuracy(r) is not None]


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


TABLE_COLUMNS = ("algorithm", "replicas", "ranks", "learning_rate", "seeds", "reached",
                 "failed", "time_to_target_median", "time_to_target_min",
                 "time_to_target_max", "samples_to_target_median", "samples_to_target_min",
                 "samples_to_target_max", "final_accuracy_median", "final_accuracy_min",
                 "final_accuracy_max", "bytes_sent_per_sample_median",
                 "bytes_sent_per_sample_min", "bytes_sent_per_sample_max")


def table_rows(groups: Sequence[Group]) -> list[dict[str, Any]]:
    """One dict per group, keyed by TABLE_COLUMNS (None where there is nothing to show)."""
    rows = []
    for g in groups:
        row: dict[str, Any] = {"algorithm": g.algorithm, "replicas": g.replicas,
                               "ranks": g.ranks, "learning_rate": g.learning_rate,
                               "seeds": len(g.results), "reached": len(g.reached),
                               "failed": g.failed}
        for name, values in (
                ("time_to_target", [r.time_to_target for r in g.reached]),
                ("samples_to_target", [r.samples_to_target for r in g.reached
                                       if r.samples_to_target is not None]),
                ("final_accuracy", [r.final_accuracy for r in g.finished
                                    if r.final_accuracy is not None]),
                ("bytes_sent_per_sample", [r.bytes_sent_per_sample for r in g.finished
                                           if r.bytes_sent_per_sample is not None])):
            stats = spread(values) or (None, None, None)
            for suffix, value in zip(("median", "min", "max"), stats):
                row[f"{name}_{suffix}"] = value
        rows.append(row)
    return rows


def format_table(rows: Sequence[dict[str, Any]], target: float | None) -> str:
    """The table as text: medians over seeds with [min-max] beside them; a learning-rate
    column only when the comparison gave learning rates."""
    to = f"to {target:g}" if target is not None else "to target"
    with_lr = any(row["learning_rate"] is not None for row in rows)
    lr_head = f" {'lr':>7}" if with_lr else ""
    names = [_row_name(row) for row in rows]
    width = max([len("algorithm"), *map(len, names)])
    header = (f"{'algorithm':<{width}} {'ranks':>5}{lr_head} {'reached':>8} {'failed':>6}  "
              f"{'time ' + to + ' (s)':<22} {'samples ' + to:<26} {'final accuracy':<24} "
              f"bytes sent/sample")
    lines = [header]
    for row, name in zip(rows, names):
        lr = ""
        if with_lr:
            lr = " " + (f"{row['learning_rate']:>7g}" if row["learning_rate"] is not None
                        else f"{'-':>7}")
        lines.append(
            f"{name:<{width}} {row['ranks']:>5}{lr} {row['reached']:>4}/{row['seeds']:<3} "
            f"{row['failed']:>6}  {_cell(row, 'time_to_target', '.1f'):<22} "
            f"{_cell(row, 'samples_to_target', ',.0f'):<26} "
            f"{_cell(row, 'final_accuracy', '.4f'):<24} "
            f"{_cell(row, 'bytes_sent_per_sample', ',.0f')}".rstrip())
    lines.append("median over the seeds [min-max]; times and samples over the seeds that "
                 "reached the target")
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
    """table.csv (the groups) and runs.csv (each run); returns their paths."""
    out = Path(out_dir)
    table = out / TABLE_CSV
    _write_csv(table, TABLE_COLUMNS, rows)
    per_run = out / RUNS_CSV
    columns = ("algorithm", "replicas", "ranks", "learning_rate", "seed", "state",
               "exit_status", "time_to_target", "samples_to_target", "final_accuracy",
               "wall_seconds", "bytes_sent", "bytes_received", "bytes_sent_per_sample",
               "run_dir", "log")
    _write_csv(per_run, columns, [{
        "algorithm": r.run.algorithm, "replicas": r.run.replicas, "ranks": r.run.ranks,
        "learning_rate": r.run.learning_rate, "seed": r.run.seed, "state": r.state,
        "exit_status": r.exit_status, "time_to_target": r.time_to_target,
        "samples_to_target": r.samples_to_target, "final_accuracy": r.final_accuracy,
        "wall_seconds": r.wall_seconds, "bytes_sent": r.bytes_sent,
        "bytes_received": r.bytes_received,
        "bytes_sent_per_sample": r.bytes_sent_per_sample,
        "run_dir": f"{RUNS_DIR}/{r.run.folder}",
        "log": f"{LOGS_DIR}/{r.run.folder}.log"} for r in results])
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


def plot(out_dir: str | Path, groups: Sequence[Group], target: float | None,
         title: str) -> list[Path]:
    """The three figures into out_dir; returns their paths."""
    plt = import_pyplot()
    out = Path(out_dir)
    return [_plot_accuracy(plt, groups, target, title, out / ACCURACY_FIGURE),
            _plot_scaling(plt, groups, target, title, out / SCALING_FIGURE),
            _plot_bytes(plt, groups, target, title, out / BYTES_FIGURE)]


def _group_label(g: Group, show_lr: bool) -> str:
    label = g.algorithm if g.algorithm.startswith("sgd") \
        else f"{g.algorithm}, {g.replicas} replica{'s' if g.replicas != 1 else ''}"
    label += f" ({g.ranks} rank{'s' if g.ranks != 1 else ''})"
    if show_lr and g.learning_rate is not None:
        label += f", lr {g.learning_rate:g}"
    return label


def _plot_accuracy(plt: Any, groups: Sequence[Group], target: float | None, title: str,
                   path: Path) -> Path:
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
    ylabel = _accuracy_axis(ax, groups, target)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return _save(plt, fig, ax, path, f"Test accuracy against time\n{title}")


LINE_STYLES = ("-", "--", ":", "-.")


def _accuracy_axis(ax: Any, groups: Sequence[Group], target: float | None) -> str:
    """With a target, its line and the accuracy axis from accuracy_axis_floor to just above
    it; returns the axis's label."""
    ylabel = f"{_split(groups)} accuracy"
    if target is not None:
        ax.axhline(target, color="gray", linestyle=":", linewidth=1,
                   label=f"target {target:g}")
        floor = accuracy_axis_floor(groups, target)
        ax.set_ylim(floor, min(1.0, target + 0.03))
        ylabel += f" (axis from {floor:g})"
    return ylabel


def _plot_bytes(plt: Any, groups: Sequence[Group], target: float | None, title: str,
                path: Path) -> Path:
    """Accuracy against the bytes the replicas sent, log scale (the algorithms differ by
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
    ylabel = _accuracy_axis(ax, groups, target)
    if any_curve:
        ax.set_xscale("log")
    ax.set_xlabel("bytes sent by all replicas (MB, log scale)")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    return _save(plt, fig, ax, path, f"Test accuracy against bytes sent\n{title}")

ZOOM_BELOW_TARGET = 0.1
"""With a target, the accuracy figure's axis starts this far below it (the runs differ near
the target, where a full 0-1 axis squeezes them together), or lower: accuracy_axis_floor."""


def accuracy_axis_floor(groups: Sequence[Group], target: float) -> float:
    """Where the accuracy axis starts: ZOOM_BELOW_TARGET under the target, or lower, so that
    every run's best evaluation is on the figure (a run stuck at chance included)."""
    bests = [max(y for _, y in r.curve) for g in groups for r in g.results if r.curve]
    floor = min([target - ZOOM_BELOW_TARGET, *(best - 0.02 for best in bests)])
    return max(0.0, round(floor, 2))


def _algorithm_colors(plt: Any, groups: Sequence[Group]) -> dict[str, str]:
    """One colour per algorithm, the same in both figures."""
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = list(dict.fromkeys(g.algorithm for g in groups))
    return {name: cycle[i % len(cycle)] for i, name in enumerate(names)}


def _plot_scaling(plt: Any, groups: Sequence[Group], target: float | None, title: str,
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
    to = f"{target:g}" if target is not None else "the target"
    split = _split(groups)
    ax.set_ylabel(f"time to {to} {split} accuracy (s)")
    ax.set_ylim(bottom=0)
    if not ranks_seen:  # say so, on an axis that still spans the rank counts that ran
        ax.text(0.5, 0.5, f"no run reached {to} {split} accuracy", transform=ax.transAxes,
                ha="center", va="center", fontsize="large", color="dimgray")
        ax.set_ylim(0, 1)
        ranks_seen = {g.ranks for g in groups}
    if ranks_seen:
        ax.set_xticks(sorted(ranks_seen))
        ax.set_xlim(min(ranks_seen) - 0.5, max(ranks_seen) + 0.5)
    ax.grid(True, alpha=0.3)
    return _save(plt, fig, ax, path,
                 f"Time to {to} {split} accuracy against cores\n{title}\n"
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
