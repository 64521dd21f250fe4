"""`distbelief compare`: one configuration trained by several algorithms, one run after
another, and the paper's comparison drawn from their run folders (Dean et al. 2012,
Figures 4 and 5).

    plan      the grid of runs (algorithms x replicas x learning rates x seeds), each
              run's overrides and its MPI rank count
    running   launching each run (mpiexec or the user's launcher), progress, resume state,
              signals forwarded to the run
    results   the table (time and samples to the target, the final value of its metric:
              median and spread over seeds) and the figures

It stands on config, records and runtime only: each run is a `distbelief train` process,
so its folder is exactly what train writes and `distbelief report RUN` works on it.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from pathlib import Path


def compare(config: str, algorithms: Sequence[str], replicas: Sequence[int],
            seeds: Sequence[int], learning_rates: Sequence[float], max_seconds: float | None,
            target: float | None, overrides: Sequence[str], launcher: str | None,
            run_timeout: float | None, out: str | None,
            target_metric: str | None = None) -> int:
    """`distbelief compare` (its --help says what each argument is): run the grid, print
    the table, write the tables and figures; the exit status (130 after Ctrl-C)."""
    from distbelief.compare import plan, results, running
    from distbelief.records.report import import_pyplot
    from distbelief.runtime.health.ownership import claim

    import_pyplot()  # fail on a missing matplotlib before the first run, not after the last
    specs = list({spec.label: spec for spec in map(plan.parse_algorithm,
                                                    algorithms)}.values())
    launcher_template = launcher or running.DEFAULT_LAUNCHER
    running.check_launcher(launcher_template)
    grid = plan.Grid(specs, replicas, seeds, learning_rates, max_seconds, target,
                     target_metric, overrides)
    runs = plan.plan_runs(config, grid)
    folder = Path(out if out is not None
                  else Path("comparisons") / Path(config).stem).resolve()
    owner = claim(folder)
    try:
        print(f"distbelief compare: {len(runs)} runs of {config} into {folder}", flush=True)
        stopped_by = running.run_comparison(config, runs, folder, launcher_template,
                                            run_timeout=run_timeout)
        collected = results.collect(folder, runs)
        groups = results.group_results(collected)
        rows = results.table_rows(groups)
        measured = results.comparison_target(collected)
        print(results.format_table(rows, measured))
        written = results.write_tables(folder, collected, rows)
        written += results.plot(folder, groups, measured, Path(config).name)
    finally:
        owner.release()
    for path in written:
        print(f"wrote {path}")
    if stopped_by is not None:
        done = sum(r.state == "finished" for r in collected)
        print(f"distbelief: compare stopped by {signal.Signals(stopped_by).name} with {done} of "
              f"{len(runs)} runs finished; run the same command again to resume",
              file=sys.stderr)
        return 130 if stopped_by == signal.SIGINT else 0
    return 0
