"""The grid of runs a comparison makes, each run's `train --set` overrides and its MPI rank
count, worked out before anything runs (so a mistake is one line, not a failed run).

An algorithm is given as NAME or NAME:SECTION.KEY=VALUE[,SECTION.KEY=VALUE...], e.g.
`downpour`, `sync:optimizer.backup_workers=1`,
`sandblaster:data.batch_size=6000,optimizer.m=10`: one word per algorithm on a command line
or in an sbatch script, the overrides in `--set`'s own syntax. The spec as written is the
algorithm's label in the table and figures, so two specs of one algorithm are two lines.

Rank counts (R replicas, P = cluster.partitions, S = cluster.ps_shards):
    sgd          P ranks; with P = 1 one plain process, no launcher (replicas do not apply)
    sandblaster  S + 1 + R x P (the coordinator)
    every other  S + R x P, where S is 0 for an algorithm that keeps no parameters on shards
                 (config.needs_shards) unless its own overrides set cluster.ps_shards

The target: a configuration's own (run.target_accuracy, run.target_loss, or
run.target_metric with run.target_value), or --target VALUE on the runs' score (accuracy,
or r2 for model.loss = "mse"), or on --target-metric's metric. Every run of a comparison
is measured by one metric: its table and figures have one axis.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distbelief.algorithms import registry
from distbelief.config import (
    ALGORITHMS,
    NOT_IMPLEMENTED_ALGORITHMS,
    TARGET_KEYS,
    TARGET_METRICS,
    apply_overrides,
    check_override,
    load_config,
    needs_shards,
    read_toml,
    schema,
)
from distbelief.errors import ConfigError
from distbelief.model.losses import LOSSES
from distbelief.records.metrics import Target, target_of

# A comma starts the next override only where `section.key=` follows, so a value may hold
# commas (a TOML list) and colons (a path).
_NEXT_OVERRIDE = re.compile(r",(?=\s*[A-Za-z_]+\.[A-Za-z_]+\s*=)")


COMPARE_KEYS = (("optimizer", "algorithm"), ("run", "out_dir"))
"""Keys compare sets for each run itself."""


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm of a comparison: its name and the overrides only its runs get."""

    label: str
    name: str
    overrides: tuple[str, ...] = ()


def parse_algorithm(text: str) -> AlgorithmSpec:
    """NAME[:SECTION.KEY=VALUE[,SECTION.KEY=VALUE...]] -> AlgorithmSpec; ConfigError naming
    the spec when the name is unknown or an override is malformed."""
    label = text.strip()
    name, _, rest = label.partition(":")
    name = name.strip()
    known = ALGORITHMS + NOT_IMPLEMENTED_ALGORITHMS
    if name not in known:
        raise ConfigError(f"--algorithm {text!r}: unknown algorithm {name!r}; expected one of "
                          f"{', '.join(known)}, optionally followed by "
                          f":section.key=value,... (e.g. sync:optimizer.backup_workers=1)")
    overrides = tuple(part.strip() for part in _NEXT_OVERRIDE.split(rest)) if rest else ()
    for override in overrides:
        try:
            section, key, _ = check_override(override)
        except ConfigError as e:
            raise ConfigError(f"--algorithm {text!r}: {e}") from e
        if (section, key) in COMPARE_KEYS:
            raise ConfigError(f"--algorithm {text!r}: {section}.{key} is set by compare "
                              "itself; leave it out")
    return AlgorithmSpec(label, name, overrides)


@dataclass(frozen=True)
class PlannedRun:
    """One training run of the comparison."""

    algorithm: str              # the spec's label
    name: str                   # optimizer.algorithm
    replicas: int
    seed: int
    learning_rate: float | None  # None: the configuration's own
    ranks: int
    uses_launcher: bool         # False for single-process sgd
    folder: str                 # under the comparison's runs/
    overrides: tuple[str, ...] = field(default=())  # train --set, run.out_dir excluded
    target: Target | None = None  # what the overrides give it; None: none (or an invalid one)

    def describe(self) -> str:
        lr = "" if self.learning_rate is None else f", lr {self.learning_rate:g}"
        plural = "s" if self.replicas != 1 else ""
        one = registry.get(self.name).one_replica
        replicas = "" if one else f", {self.replicas} replica{plural}"
        return (f"{self.algorithm}{replicas}{lr}, seed {self.seed} "
                f"({self.ranks} rank{'s' if self.ranks != 1 else ''})")


@dataclass(frozen=True)
class Grid:
    """What to compare: the lists the command line gives."""

    algorithms: Sequence[AlgorithmSpec]
    replicas: Sequence[int] = (1,)
    seeds: Sequence[int] = (0,)
    learning_rates: Sequence[float] = ()
    max_seconds: float | None = None
    target: float | None = None     # --target: a value of target_metric
    target_metric: str | None = None  # --target-metric; None: the runs' score
    overrides: Sequence[str] = ()   # --set, for every run


def plan_runs(config_path: str | Path, grid: Grid, check: bool = True) -> list[PlannedRun]:
    """Every run of the grid, in the order they run: algorithm by algorithm, then replica
    count, learning rate, seed. With `check`, each run of an algorithm that is implemented
    is validated as train would (config and data file), so bad input stops the comparison
    before its first run; an algorithm still listed as not implemented is passed through
    (its runs fail and are reported as failed)."""
    base = read_toml(config_path)
    for override in grid.overrides:
        section, key, _ = check_override(override)
        if (section, key) in COMPARE_KEYS:
            raise ConfigError(f"--set {override}: {section}.{key} is set by compare itself "
                              "(--algorithm, --out); leave it out")
    _check_target_metric(grid)
    runs: list[PlannedRun] = []
    for spec in grid.algorithms:
        raw = apply_overrides(base, [*grid.overrides, *spec.overrides])
        targeted = target_settings(raw, grid)
        optimizer = raw.get("optimizer", {})
        cluster = raw.get("cluster", {})
        partitions = _checked(cluster, "cluster", "partitions", 1)
        shards = _shard_count(spec, optimizer, cluster)
        algorithm = registry.get(spec.name)
        replica_counts = (1,) if algorithm.one_replica else tuple(dict.fromkeys(grid.replicas))
        rates: Sequence[float | None] = tuple(dict.fromkeys(grid.learning_rates)) or (None,)
        for replicas in replica_counts:
            ranks = _rank_count(spec.name, replicas, partitions, shards)
            for rate in rates:
                for seed in dict.fromkeys(grid.seeds):
                    settings = _run_settings(spec, shards, seed, rate, grid, targeted)
                    runs.append(PlannedRun(
                        spec.label, spec.name, replicas, seed, rate, ranks,
                        uses_launcher=not algorithm.in_one_process(partitions),
                        folder=_folder_name(spec, replicas, rate, seed),
                        overrides=tuple(settings), target=_run_target(base, settings)))
    _check_unique_folders(runs)
    _check_one_metric(runs)
    if check:
        for run in runs:
            if run.name in ALGORITHMS:
                validate_run(config_path, run)
    return runs


NO_TARGET = ("compare measures the time to a target: give --target VALUE (a value of the "
             "runs' score: accuracy, or r2 for model.loss = \"mse\"), with --target-metric "
             f"{'|'.join(TARGET_METRICS)} for another metric, or set run.target_accuracy, "
             "run.target_loss, or run.target_metric with run.target_value in the "
             "configuration")


def validate_run(config_path: str | Path, run: PlannedRun) -> None:
    """Load the run's configuration as train will (data file included); ConfigError or
    DataError naming the algorithm when it does not hold, or when it has no target."""
    raw_run = apply_overrides(read_toml(config_path), run.overrides).get("run", {})
    # Before load_config: without a budget either, its error would name the budgets first.
    if isinstance(raw_run, dict) and not any(key in raw_run for key in TARGET_KEYS):
        raise ConfigError(NO_TARGET)
    try:
        load_config(config_path, run.overrides)
    except ConfigError as e:
        raise ConfigError(f"--algorithm {run.algorithm}: {e}") from e


def _check_target_metric(grid: Grid) -> None:
    if grid.target_metric is None:
        return
    if grid.target_metric not in TARGET_METRICS:
        raise ConfigError(f"--target-metric {grid.target_metric}: expected one of "
                          f"{', '.join(TARGET_METRICS)}")
    if grid.target is None:
        raise ConfigError(f"--target-metric {grid.target_metric} names the metric of "
                          "--target; give --target VALUE too")


TARGET_RANGES = {"accuracy": (0.0, 1.0, "an accuracy, between 0 and 1"),
                 "auc": (0.0, 1.0, "an AUC, between 0 and 1"),
                 "r2": (-math.inf, 1.0, "an r2, at most 1")}
"""(above, at most, what it is) of --target on a metric that has bounds; a loss or an
rmse is any positive number (--target's own type)."""


def target_settings(raw: dict, grid: Grid) -> list[str]:
    """The run.* overrides that give an algorithm's runs --target (raw: its configuration
    with its overrides); none without --target. The metric is --target-metric, or the
    score of its model.loss; ConfigError when the loss does not report it or the value
    is out of the metric's range."""
    if grid.target is None:
        return []
    loss = _checked(raw.get("model", {}), "model", "loss", "cross_entropy")
    metric = grid.target_metric or LOSSES[loss].score
    reported = ("loss", *LOSSES[loss].metrics)
    if metric not in reported:
        raise ConfigError(f"--target-metric {metric}: model.loss = \"{loss}\" reports "
                          f"{', '.join(reported)}; choose one of those")
    above, most, what = TARGET_RANGES.get(metric, (0.0, math.inf, "a positive number"))
    if not above < grid.target <= most:
        raise ConfigError(f"--target {grid.target:g}: {what}")
    # An accuracy as run.target_accuracy, as before targets had metrics: an accuracy
    # comparison's runs keep their overrides, so their settings keys and resume hold.
    if metric == "accuracy":
        return [f"run.target_accuracy={grid.target!r}"]
    if metric == "loss":
        return [f"run.target_loss={grid.target!r}"]
    return [f"run.target_metric={json.dumps(metric)}", f"run.target_value={grid.target!r}"]


def _run_target(base: dict, settings: Sequence[str]) -> Target | None:
    """The target a run's settings give it; None for none, or for a value that is not a
    number (validate_run names it)."""
    table = apply_overrides(base, settings).get("run", {})
    try:
        return target_of(table) if isinstance(table, dict) else None
    except (TypeError, ValueError):
        return None


def _check_one_metric(runs: Sequence[PlannedRun]) -> None:
    """Every run with a target measured by one metric (the table's and figures' axis)."""
    first = next((run for run in runs if run.target is not None), None)
    for run in runs:
        if run.target is not None and run.target.metric != first.target.metric:
            raise ConfigError(f"--algorithm {first.algorithm} has a target of "
                              f"{first.target.metric} and --algorithm {run.algorithm} one of "
                              f"{run.target.metric}; a comparison measures every run by one "
                              "metric: give them one (--target, --target-metric)")


def _shard_count(spec: AlgorithmSpec, optimizer: dict, cluster: dict) -> int:
    """cluster.ps_shards of the algorithm's runs: its own override if it has one; else the
    configuration's (at least 1) where the algorithm keeps parameters on shards, 0 where
    it does not (so one base file serves Downpour and the shard-less algorithms alike)."""
    own = [o for o in spec.overrides if o.replace(" ", "").startswith("cluster.ps_shards=")]
    if own:
        return _checked(cluster, "cluster", "ps_shards", 0)
    rule = registry.get(spec.name).shards  # "always", "never", "ignored" or an optimizer key
    settings = ({} if rule in ("always", "never", "ignored")
                else {rule: _checked(optimizer, "optimizer", rule, None)})
    if needs_shards(spec.name, settings):
        return max(1, _checked(cluster, "cluster", "ps_shards", 1))
    return 0


def _checked(table: dict, section: str, key: str, default: Any) -> Any:
    """A value the rank counts need, checked against the configuration schema before they
    use it: a wrong one is the one-line error train would give, not a traceback."""
    if key not in table:
        return default
    rule = schema(section)[key][0]
    value = rule.convert(table[key])
    if value is None:
        raise ConfigError(f"{section}.{key} = {table[key]!r} is invalid; expected "
                          f"{rule.allowed}")
    return value


def _rank_count(name: str, replicas: int, partitions: int, shards: int) -> int:
    return shards + registry.get(name).coordinators + replicas * partitions


def _run_settings(spec: AlgorithmSpec, shards: int, seed: int, rate: float | None,
                  grid: Grid, targeted: Sequence[str]) -> list[str]:
    """The run's --set overrides: the comparison's, the grid point's (its target:
    target_settings), then the algorithm's own (which win)."""
    settings = [*grid.overrides, f"optimizer.algorithm={json.dumps(spec.name)}"]
    if registry.get(spec.name).shards != "ignored":  # else train does not check it
        settings.append(f"cluster.ps_shards={shards}")
    settings.append(f"run.seed={seed}")
    if rate is not None:
        settings.append(f"optimizer.learning_rate={rate!r}")
    if grid.max_seconds is not None:
        settings.append(f"run.max_seconds={grid.max_seconds!r}")
    return [*settings, *targeted, *spec.overrides]


def _folder_name(spec: AlgorithmSpec, replicas: int, rate: float | None, seed: int) -> str:
    """A readable folder name: sync+backup_workers=1-r2-lr0.01-seed0."""
    label = spec.name + "".join(f"+{o.split('.', 1)[1]}" for o in spec.overrides)
    label = re.sub(r"[^A-Za-z0-9._=+-]+", "_", label.replace(" ", ""))
    parts = [label] + ([] if registry.get(spec.name).one_replica else [f"r{replicas}"])
    if rate is not None:
        parts.append(f"lr{rate:g}")
    parts.append(f"seed{seed}")
    return "-".join(parts)


def _check_unique_folders(runs: Sequence[PlannedRun]) -> None:
    seen: dict[str, PlannedRun] = {}
    for run in runs:
        if run.folder in seen and seen[run.folder].algorithm != run.algorithm:
            raise ConfigError(f"--algorithm {seen[run.folder].algorithm!r} and "
                              f"{run.algorithm!r} would share the run folder {run.folder}; "
                              "give them different overrides")
        seen[run.folder] = run
