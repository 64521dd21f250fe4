"""Run configuration: a TOML file read into validated, frozen dataclasses, one per section.

Everything is checked before training starts, so a run never dies half-way on a typo:
unknown sections and keys (with the closest valid name suggested), types and ranges, the
settings that are not implemented yet, and, in `load_config`, that the data file opens and
fits the model. Errors are `ConfigError`/`DataError` with one message naming `section.key`,
the value given and what is allowed.

    config = load_config("configs/fashion_mnist_mlp.toml", ["run.max_steps=100"])
    config.optimizer.learning_rate, config.run.out_dir, config.to_dict(), config_hash(config)

Sections and keys, with their defaults:

    [model]      layers (list of tables, required; checked by distbelief.model.network.Network)
    [data]       path (required; relative to the config file's folder), batch_size = 64,
                 in_memory = true, stream_memory_mb = 256 (data.in_memory = false: rows in
                 memory per replica), validation = 0.0 (the fraction of /train held out as
                 a validation split, its last rows; 0 = none, unless the file has a /val
                 group: then evaluations and stop rules use the validation split and the
                 test set is evaluated once, at the end)
    [optimizer]  algorithm = "sgd" | "downpour" | "sandblaster" | "sync" | "averaging" |
                 "hogwild" | "diloco", learning_rate = 0.02, update = "adagrad" | "sgd" |
                 "adarevision" | "momentum" | "adam" (the update rule; `adagrad =
                 true/false` is the older spelling of "adagrad"/"sgd"; "adarevision" is
                 Downpour's shards only), momentum = 0.9, nesterov = false (update =
                 "momentum"), beta1 = 0.9, beta2 = 0.999 (update = "adam"),
                 n_fetch = 1, n_push = 1, warm_start_steps = 0 (Downpour: replica 0 trains
                 alone first; not the learning-rate warmup below)
                 The learning-rate schedule (every algorithm but Sandblaster, which has no
                 learning rate; see SCHEDULES below): warmup_steps = 0 (linear warmup from
                 learning_rate / warmup_steps up to learning_rate), schedule = "constant" |
                 "step" | "cosine" (after the warmup), decay_steps (step: updates between
                 two decays; cosine: updates from learning_rate down to the minimum;
                 required by both), decay_rate = 0.1 (step only: the factor at each
                 decay), min_learning_rate = 0.0 (step and cosine: the rate's floor)
                 Downpour only: fetch = "own_pushes" | "asynchronous" | "overlapped" (what
                 a replica's fetch waits for; FETCHES below), push_dtype = "float32" |
                 "bfloat16" (what a push carries; PUSH_DTYPES below)
                 Synchronous SGD only: backup_workers = 0 (each step takes the first
                 R - k gradients and drops the late ones; k > 0 goes through the shards)
                 Averaging only: average_every = 10 (local steps between averages),
                 elastic_alpha (unset; set, it is EASGD's moving rate, on the shards)
                 DiLoCo only (docs/diloco.md): inner_steps = 50 (H: local steps with
                 optimizer.update between two outer steps), outer_update = "nesterov" |
                 "sgd" | "delayed_nesterov" (the outer optimizer, applied to the
                 replicas' deltas; the last asynchronous only), outer_learning_rate =
                 0.7, outer_momentum (the Nesterov rules only; unset: 0.9 synchronous,
                 the paper's, 0.5 asynchronous: OUTER_MOMENTUM below, 0.9 delayed),
                 asynchronous = false (true: each replica's delta is applied on the
                 shards as it lands, ps_shards >= 1; false: the deltas of all replicas
                 are averaged each round by a collective), push_dtype (as Downpour's:
                 "bfloat16" narrows the deltas on the wire, in both forms)
                 Sandblaster L-BFGS only (algorithms.sandblaster.roles; no learning rate):
                 m = 10 (history pairs), work_unit_size = 0 (examples per work unit;
                 0 = automatic), push_every_units = 4, backup_copies = 2 (copies of a
                 unit in flight at most, the original included), line_search = "wolfe" |
                 "armijo", wolfe_c1 = 1e-4, wolfe_c2 = 0.9, max_line_search = 20,
                 gradient_tolerance = 1e-6 (stop when the gradient norm is below)
    [cluster]    ps_shards = 1 (0 for an algorithm that keeps no parameters on shards:
                 sync without backup workers, averaging without elastic_alpha, hogwild),
                 partitions = 1 (ranks per model replica: model parallelism)
    [run]        max_steps = 0, max_seconds = 0 (0 = no limit), target_accuracy (unset),
                 eval_every_seconds = 2.0, eval_samples = 0 (0 = whole test set), seed = 0,
                 out_dir = "runs/<config file stem>" (relative to the current directory),
                 threads = 0 (0 = BLAS default), progress_every_seconds = 2.0,
                 checkpoint_every_seconds = 600 (0 = off), checkpoint_every_steps = 0
                 (0 = off), keep_checkpoints = 3 (at least 2),
                 checkpoint_in_background = true (Downpour's shards copy their state,
                 release the replicas, then write; false: no copy, the replicas wait),
                 max_bad_gradients_in_a_row = 10 (Downpour: a replica drops a non-finite
                 gradient; this many in a row from one replica stop the run),
                 replica_timeout_seconds = 300 (Downpour: a replica not heard from for this
                 long is lost, the run goes on without it; 0 = never),
                 heartbeat_timeout_seconds = 30 (Downpour, ranks on several nodes: a rank
                 on another node whose heartbeat file in out_dir has not changed for this
                 long is taken for dead; 0 = never; see distbelief.runtime.heartbeat),
                 stall_warn_seconds = 60, stall_abort_seconds = 600 (a rank waiting on
                 another this long says which and what for / aborts the job; 0 = never),
                 owner_timeout_seconds = 120 (a run owning out_dir on another host whose
                 heartbeat is older than this is taken for dead; 0 = never; see
                 distbelief.runtime.ownership), collapse_window_seconds = 30 (a training
                 loss at chance for this long, or non-finite, is reported as a collapse),
                 stop_on_collapse = false (true: a collapse ends the run, exit status 4)

Checkpoints (distbelief.records.checkpoint) go to out_dir/checkpoints; besides the periodic ones,
a run always writes one when it stops (budget, target, SIGTERM/SIGUSR1), so it can be
extended or resumed. `keep_checkpoints` >= 2 so that a damaged newest checkpoint always
has a predecessor to fall back on.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from distbelief.algorithms import registry
from distbelief.errors import ConfigError, DataError

ALGORITHMS = registry.names()
"""optimizer.algorithm: the names in distbelief.algorithms.registry."""
NOT_IMPLEMENTED_ALGORITHMS: tuple[str, ...] = ()
UPDATES = ("adagrad", "sgd", "adarevision", "momentum", "adam")
UPDATE_KEYS = {"momentum": ("momentum", "nesterov"), "adam": ("beta1", "beta2")}
"""[optimizer] keys that only one update rule reads: an error with another rule, and left
out of the config hash unless the rule uses them."""
"""optimizer.update: the rule that applies a gradient. "adagrad" and "sgd" are also
spelled `adagrad = true/false`; "adarevision" (delay-tolerant Adagrad) runs on Downpour's
shards, where the delay is known."""
FETCHES = ("own_pushes", "asynchronous", "overlapped")
"""optimizer.fetch (Downpour): "own_pushes" (the default), a fetch waits until the shards
have applied the replica's own last push, so one replica is sequential SGD; "asynchronous",
the fetch rides on the push and returns what the shards had published (every gradient at
least one update stale); "overlapped", the push and the fetch of one step move while the
next step computes, as the paper's fetch and push threads (at least two updates stale).
On the RMA transport the later ones make a step cheaper; on shared memory a replica's push
is applied before its fetch anyway (docs/downpour.md, "Fetch")."""
SCHEDULES = ("constant", "step", "cosine")
"""optimizer.schedule: the learning rate after the warmup (distbelief.model.optimizers.
Schedule). Its steps are the updates the optimizer applies, counted where they are applied:
sgd, sync and model-parallel sgd, the run's steps; averaging and EASGD, each replica's local
steps; Hogwild, the steps of all replicas together (as they published them); Downpour, the
gradients (pushes) each shard has applied, its own count, kept in its checkpoint."""
SCHEDULE_KEYS = ("warmup_steps", "schedule", "decay_steps", "decay_rate", "min_learning_rate")
"""[optimizer] keys of the learning-rate schedule; at their defaults (no warmup, constant)
they are left out of the config hash, so adding them did not change the hash of earlier
runs."""
PUSH_DTYPES = ("float32", "bfloat16")
"""optimizer.push_dtype (Downpour): the number format of a replica's pushed gradient.
"bfloat16" rounds each gradient to bfloat16 (round to nearest even) before it is pushed,
and the shards widen it back and fold in float32 (the optimizer and its state unchanged).
On the RMA transport the push slots hold bfloat16, halving the bytes a push Puts; on the
shared-memory transport (one node) the gradient is rounded the same way and folded from
the replica's float32 memory, so a run trains the same numbers on one node as across
nodes. Hashed when not "float32" (docs/downpour.md, "Narrowed pushes")."""
ALGORITHM_KEYS = {a.name: a.own_keys for a in registry.ALGORITHMS if a.own_keys}
"""[optimizer] keys that only some algorithms read (each algorithm's `own_keys`; a key may
belong to more than one, as push_dtype to Downpour and DiLoCo): setting one for another
algorithm is an error, and they are left out of the other algorithms' config hash (so
adding them did not change the hash of earlier runs)."""
OUTER_MOMENTUM = {False: 0.9, True: 0.5}
"""optimizer.outer_momentum when unset, by optimizer.asynchronous: the paper's 0.9 for the
synchronous form; 0.5 for the asynchronous one, where staleness adds momentum of its own
(Mitliagkas et al. 2016) and 0.9 missed 88% on the reference MLP in 4 runs of 4 (two
fell to 0.52 and 0.22; docs/performance.md, DiLoCo). outer_update = "delayed_nesterov"
keeps 0.9: it is what that rule is for."""
OUTER_UPDATES = ("nesterov", "sgd", "delayed_nesterov")
"""optimizer.outer_update (DiLoCo): the outer optimizer that applies the replicas' deltas
(the fetched parameters minus the local ones after inner_steps) to the global parameters:
"nesterov", SGD with Nesterov momentum outer_momentum (the paper's choice), plain "sgd"
(with outer_learning_rate = 1 that is parameter averaging), or "delayed_nesterov"
(asynchronous only: Async Local-SGD's rule, whose momentum moves once every R deltas, on
their mean; model.optimizers.DelayedNesterov)."""
MOMENTUM_OUTER_UPDATES = ("nesterov", "delayed_nesterov")
"""The outer updates that read optimizer.outer_momentum."""
LINE_SEARCHES = ("wolfe", "armijo")
SHARD_PLACEMENTS = ("spread", "ranks")
"""cluster.shard_placement: shards dealt round-robin over the nodes, or at world ranks
0..S-1 as the job script placed them (distbelief.runtime.topology)."""
SANDBLASTER_KEYS = ("m", "work_unit_size", "push_every_units", "backup_copies", "line_search",
                    "wolfe_c1", "wolfe_c2", "max_line_search", "gradient_tolerance")
"""[optimizer] keys only Sandblaster reads; left out of other algorithms' config hash, so
adding them did not change the hash of existing runs (their checkpoints still resume)."""
SANDBLASTER_UNHASHED = ("work_unit_size", "push_every_units", "backup_copies",
                        "gradient_tolerance")
"""Sandblaster keys that change how the batch gradient is computed or when the run stops,
not what is trained: a resumed run may change them (like run.max_steps)."""


@dataclass(frozen=True)
class ModelConfig:
    layers: tuple[dict, ...]


@dataclass(frozen=True)
class DataConfig:
    path: Path
    batch_size: int = 64
    in_memory: bool = True
    stream_memory_mb: int = 256
    validation: float = 0.0


@dataclass(frozen=True)
class OptimizerConfig:
    algorithm: str = "sgd"
    learning_rate: float = 0.02
    adagrad: bool = True
    update: str = "adagrad"
    fetch: str = "own_pushes"
    push_dtype: str = "float32"
    backup_workers: int = 0
    average_every: int = 10
    elastic_alpha: float | None = None
    inner_steps: int = 50
    outer_update: str = "nesterov"
    outer_learning_rate: float = 0.7
    outer_momentum: float = 0.9  # resolved: 0.9 synchronous, 0.5 asynchronous (unset)
    asynchronous: bool = False
    n_fetch: int = 1
    n_push: int = 1
    warm_start_steps: int = 0
    momentum: float = 0.9
    nesterov: bool = False
    beta1: float = 0.9
    beta2: float = 0.999
    warmup_steps: int = 0
    schedule: str = "constant"
    decay_steps: int | None = None
    decay_rate: float | None = None
    min_learning_rate: float | None = None
    m: int = 10
    work_unit_size: int = 0
    push_every_units: int = 4
    backup_copies: int = 2
    line_search: str = "wolfe"
    wolfe_c1: float = 1e-4
    wolfe_c2: float = 0.9
    max_line_search: int = 20
    gradient_tolerance: float = 1e-6


@dataclass(frozen=True)
class ClusterConfig:
    ps_shards: int = 1
    partitions: int = 1
    shard_placement: str = "spread"


@dataclass(frozen=True)
class RunConfig:
    out_dir: Path
    max_steps: int = 0
    max_seconds: float = 0.0
    target_accuracy: float | None = None
    eval_every_seconds: float = 2.0
    eval_samples: int = 0
    seed: int = 0
    threads: int = 0
    flush_subnormals: bool = True
    progress_every_seconds: float = 2.0
    checkpoint_every_seconds: float = 600.0
    checkpoint_every_steps: int = 0
    keep_checkpoints: int = 3
    checkpoint_in_background: bool = True
    max_bad_gradients_in_a_row: int = 10
    replica_timeout_seconds: float = 300.0
    heartbeat_timeout_seconds: float = 30.0
    stall_warn_seconds: float = 60.0
    stall_abort_seconds: float = 600.0
    owner_timeout_seconds: float = 120.0
    collapse_window_seconds: float = 30.0
    stop_on_collapse: bool = False


@dataclass(frozen=True)
class Config:
    """A complete, validated run configuration. `source` is the TOML file it came from."""

    model: ModelConfig
    data: DataConfig
    optimizer: OptimizerConfig
    cluster: ClusterConfig
    run: RunConfig
    source: Path | None = None

    def to_dict(self) -> dict:
        """JSON-friendly nested dict of the resolved configuration (paths as strings)."""
        out = {}
        for section in SECTIONS:
            values = asdict(getattr(self, section))
            out[section] = {k: _jsonable(v) for k, v in values.items()}
        return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------------------------
# The schema: for each key, how to check a raw TOML value and what to say when it is wrong.


@dataclass(frozen=True)
class Rule:
    """Checks one key. `convert` returns the clean value or None when the value is wrong."""

    convert: Callable[[Any], Any]
    allowed: str


def _int(minimum: int) -> Rule:
    def convert(v: Any) -> Any:
        # bool is an int in Python; `true` is never a count.
        if isinstance(v, int) and not isinstance(v, bool) and v >= minimum:
            return v
        return None
    return Rule(convert, f"an integer >= {minimum}")


def _float(minimum: float, strict: bool = False, maximum: float | None = None) -> Rule:
    def convert(v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return None
        v = float(v)
        if v < minimum or (strict and v == minimum) or (maximum is not None and v > maximum):
            return None
        return v
    low = f"> {minimum:g}" if strict else f">= {minimum:g}"
    high = f" and <= {maximum:g}" if maximum is not None else ""
    return Rule(convert, f"a number {low}{high}")


def _bool() -> Rule:
    return Rule(lambda v: v if isinstance(v, bool) else None, "true or false")


def _string() -> Rule:
    return Rule(lambda v: v if isinstance(v, str) and v else None, "a non-empty string")


def _layers() -> Rule:
    def convert(v: Any) -> Any:
        if isinstance(v, list) and v and all(isinstance(layer, dict) for layer in v):
            return tuple(dict(layer) for layer in v)
        return None
    return Rule(convert, "a non-empty list of tables, e.g. [[model.layers]] blocks")


def _choice(options: Iterable[str]) -> Rule:
    options = tuple(options)
    return Rule(lambda v: v if v in options else None,
                "one of " + ", ".join(repr(o) for o in options))


REQUIRED = object()
"""Default marker: the key must be given."""

SCHEMA: dict[str, dict[str, tuple[Rule, Any]]] = {
    "model": {
        "layers": (_layers(), REQUIRED),
    },
    "data": {
        "path": (_string(), REQUIRED),
        "batch_size": (_int(1), 64),
        "in_memory": (_bool(), True),
        "stream_memory_mb": (_int(4), 256),
        "validation": (_float(0.0, maximum=0.5), 0.0),
    },
    "optimizer": {
        "algorithm": (_choice(ALGORITHMS + NOT_IMPLEMENTED_ALGORITHMS), "sgd"),
        "learning_rate": (_float(0.0, strict=True), 0.02),
        "adagrad": (_bool(), True),
        "update": (_choice(UPDATES), None),
        "fetch": (_choice(FETCHES), "own_pushes"),
        "push_dtype": (_choice(PUSH_DTYPES), "float32"),
        "backup_workers": (_int(0), 0),
        "average_every": (_int(1), 10),
        "elastic_alpha": (_float(0.0, strict=True, maximum=1.0), None),
        "inner_steps": (_int(1), 50),
        "outer_update": (_choice(OUTER_UPDATES), "nesterov"),
        "outer_learning_rate": (_float(0.0, strict=True, maximum=10.0), 0.7),
        "outer_momentum": (_float(0.0, maximum=0.999), None),
        "asynchronous": (_bool(), False),
        "n_fetch": (_int(1), 1),
        "n_push": (_int(1), 1),
        "warm_start_steps": (_int(0), 0),
        "momentum": (_float(0.0, maximum=0.999), 0.9),
        "nesterov": (_bool(), False),
        "beta1": (_float(0.0, maximum=0.999), 0.9),
        "beta2": (_float(0.0, maximum=0.99999), 0.999),
        "warmup_steps": (_int(0), 0),
        "schedule": (_choice(SCHEDULES), "constant"),
        "decay_steps": (_int(1), None),
        "decay_rate": (_float(0.0, strict=True, maximum=1.0), None),
        "min_learning_rate": (_float(0.0), None),
        "m": (_int(1), 10),
        "work_unit_size": (_int(0), 0),
        "push_every_units": (_int(1), 4),
        "backup_copies": (_int(1), 2),
        "line_search": (_choice(LINE_SEARCHES), "wolfe"),
        "wolfe_c1": (_float(0.0, strict=True, maximum=0.5), 1e-4),
        "wolfe_c2": (_float(0.0, strict=True, maximum=1.0), 0.9),
        "max_line_search": (_int(1), 20),
        "gradient_tolerance": (_float(0.0), 1e-6),
    },
    "cluster": {
        "ps_shards": (_int(0), None),
        "partitions": (_int(1), 1),
        "shard_placement": (_choice(SHARD_PLACEMENTS), "spread"),
    },
    "run": {
        "max_steps": (_int(0), 0),
        "max_seconds": (_float(0.0), 0.0),
        "target_accuracy": (_float(0.0, strict=True, maximum=1.0), None),
        "eval_every_seconds": (_float(0.0, strict=True), 2.0),
        "eval_samples": (_int(0), 0),
        "seed": (_int(0), 0),
        "out_dir": (_string(), None),
        "threads": (_int(0), 0),
        "flush_subnormals": (_bool(), True),
        "progress_every_seconds": (_float(0.0, strict=True), 2.0),
        "checkpoint_every_seconds": (_float(0.0), 600.0),
        "checkpoint_every_steps": (_int(0), 0),
        "keep_checkpoints": (_int(2), 3),
        "checkpoint_in_background": (_bool(), True),
        "max_bad_gradients_in_a_row": (_int(1), 10),
        "replica_timeout_seconds": (_float(0.0), 300.0),
        "heartbeat_timeout_seconds": (_float(0.0), 30.0),
        "stall_warn_seconds": (_float(0.0), 60.0),
        "stall_abort_seconds": (_float(0.0), 600.0),
        "owner_timeout_seconds": (_float(0.0), 120.0),
        "collapse_window_seconds": (_float(0.0, strict=True), 30.0),
        "stop_on_collapse": (_bool(), False),
    },
}
SECTIONS = tuple(SCHEMA)


def _did_you_mean(name: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def _check_names(raw: dict, where: str) -> None:
    """Unknown sections or keys are errors: a typo must not silently fall back to a default."""
    for section, table in raw.items():
        if section not in SCHEMA:
            raise ConfigError(f"{where}: unknown section [{section}]"
                              f"{_did_you_mean(section, SECTIONS)} "
                              f"(valid sections: {', '.join(SECTIONS)})")
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: [{section}] must be a table of keys, "
                              f"got {table!r}")
        for key in table:
            if key not in SCHEMA[section]:
                valid = SCHEMA[section]
                raise ConfigError(f"{where}: unknown key '{section}.{key}'"
                                  f"{_did_you_mean(key, valid)} "
                                  f"(valid keys in [{section}]: {', '.join(valid)})")


def _section_values(raw: dict, section: str, where: str) -> dict[str, Any]:
    """The checked values of one section, defaults filled in (REQUIRED keys must be there)."""
    table = raw.get(section, {})
    values = {}
    for key, (rule, default) in SCHEMA[section].items():
        if key not in table:
            if default is REQUIRED:
                raise ConfigError(f"{where}: missing required key '{section}.{key}' "
                                  f"({rule.allowed})")
            values[key] = default
            continue
        value = rule.convert(table[key])
        if value is None:
            raise ConfigError(f"{where}: {section}.{key} = {_show(table[key])} is invalid; "
                              f"expected {rule.allowed}")
        values[key] = value
    return values


def _show(value: Any) -> str:
    """A value as the user would have written it in TOML (strings quoted)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


# ---------------------------------------------------------------------------------------
# --set section.key=value overrides


def parse_override(text: str) -> tuple[str, str, Any]:
    """`section.key=value` -> (section, key, value); value parsed as TOML, else a bare string.

    So `run.max_steps=100` gives 100, `optimizer.adagrad=false` gives False,
    `data.path=x.h5` gives "x.h5" (not valid TOML, kept as the string).
    """
    name, sep, value_text = text.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key or "." in key:
        raise ConfigError(f"bad --set {text!r}: expected section.key=value, "
                          "e.g. --set run.max_steps=100")
    try:
        value = tomllib.loads(f"v = {value_text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = value_text.strip()
    return section, key, value


def check_override(text: str) -> tuple[str, str, Any]:
    """parse_override, then the name and the value checked against the schema: a mistake
    in --set is a command-line error naming --set, not one in the config file."""
    section, key, value = parse_override(text)
    if section not in SCHEMA:
        raise ConfigError(f"--set {text}: unknown section [{section}]"
                          f"{_did_you_mean(section, SECTIONS)} "
                          f"(valid sections: {', '.join(SECTIONS)})")
    if key not in SCHEMA[section]:
        valid = SCHEMA[section]
        raise ConfigError(f"--set {text}: unknown key '{section}.{key}'"
                          f"{_did_you_mean(key, valid)} "
                          f"(valid keys in [{section}]: {', '.join(valid)})")
    rule = SCHEMA[section][key][0]
    if rule.convert(value) is None:
        raise ConfigError(f"--set {text}: {section}.{key} = {_show(value)} is invalid; "
                          f"expected {rule.allowed}")
    return section, key, value


def apply_overrides(raw: dict, overrides: Iterable[str]) -> dict:
    """A copy of the raw TOML dict with each `section.key=value` override applied (each
    checked by check_override first)."""
    merged = {section: dict(table) if isinstance(table, dict) else table
              for section, table in raw.items()}
    overridden: set[tuple[str, str]] = set()
    for text in overrides:
        section, key, value = check_override(text)
        table = merged.setdefault(section, {})
        if isinstance(table, dict):
            table[key] = value
            overridden.add((section, key))
            other = SPELLINGS.get((section, key))
            if other is not None and (section, other) not in overridden:
                table.pop(other, None)  # --set update=... replaces the file's adagrad
    return merged


SPELLINGS = {("optimizer", "update"): "adagrad", ("optimizer", "adagrad"): "update"}
"""Keys that say the same thing two ways: an override of one replaces the other as the
file gives it (two overrides that disagree are still an error)."""


# ---------------------------------------------------------------------------------------
# Building the Config


def read_toml(path: str | Path) -> dict:
    """The raw TOML tables of a config file; ConfigError if it is missing or not TOML."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from e
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e


def config_from_dict(raw: dict, source: Path | None = None,
                     cwd: Path | None = None) -> Config:
    """Validate raw TOML tables into a Config (schema only; no files are opened).

    Relative `data.path` is resolved against the config file's folder (the current directory
    when there is no file); relative `run.out_dir` against `cwd` (default: the current one).
    """
    where = str(source) if source is not None else "config"
    _check_names(raw, where)
    values = {section: _section_values(raw, section, where) for section in SECTIONS}
    _check_not_implemented(values, where)
    _resolve_update(values["optimizer"], raw.get("optimizer", {}), where)
    _resolve_schedule(values["optimizer"], raw.get("optimizer", {}), where)
    _resolve_ps_shards(values, where)
    _check_consistency(values, where)

    base = source.resolve().parent if source is not None else Path.cwd()
    cwd = (cwd or Path.cwd()).resolve()
    data = values["data"]
    data["path"] = (base / data["path"]).resolve()
    run = values["run"]
    stem = source.stem if source is not None else "run"
    run["out_dir"] = (cwd / (run["out_dir"] or f"runs/{stem}")).resolve()
    return Config(
        model=ModelConfig(**values["model"]),
        data=DataConfig(**data),
        optimizer=OptimizerConfig(**values["optimizer"]),
        cluster=ClusterConfig(**values["cluster"]),
        run=RunConfig(**run),
        source=source.resolve() if source is not None else None,
    )


def _check_not_implemented(values: dict, where: str) -> None:
    algorithm = values["optimizer"]["algorithm"]
    if algorithm in NOT_IMPLEMENTED_ALGORITHMS:
        raise ConfigError(f"{where}: optimizer.algorithm = {algorithm!r} is not implemented "
                          f"yet; use one of {', '.join(repr(a) for a in ALGORITHMS)}")


def _resolve_update(opt: dict, given: dict, where: str) -> None:
    """optimizer.update from `adagrad` when it is not given; both given must agree."""
    if opt["update"] is None:
        opt["update"] = "adagrad" if opt["adagrad"] else "sgd"
    elif "adagrad" in given and opt["adagrad"] != (opt["update"] == "adagrad"):
        raise ConfigError(f"{where}: optimizer.adagrad = {_show(opt['adagrad'])} contradicts "
                          f"optimizer.update = {_show(opt['update'])}; give only update")
    opt["adagrad"] = opt["update"] == "adagrad"
    for rule, keys in UPDATE_KEYS.items():
        for key in keys:
            if key in given and opt["update"] != rule:
                raise ConfigError(f"{where}: optimizer.{key} applies only to update = "
                                  f"{_show(rule)}, not {_show(opt['update'])}")
    if opt["algorithm"] == "sandblaster" and opt["update"] in UPDATE_KEYS:
        raise ConfigError(f"{where}: optimizer.update = {_show(opt['update'])}, but "
                          "algorithm = \"sandblaster\" has no update rule (L-BFGS steps by "
                          "its line search)")
    if opt["update"] == "adarevision" and opt["algorithm"] != "downpour":
        raise ConfigError(f"{where}: optimizer.update = \"adarevision\" runs on Downpour's "
                          f"parameter-server shards, which know each push's delay; with "
                          f"algorithm = {_show(opt['algorithm'])} use \"adagrad\" or \"sgd\"")
    own = ALGORITHM_KEYS.get(opt["algorithm"], ())
    for key in sorted({key for keys in ALGORITHM_KEYS.values() for key in keys}):
        if key in given and key not in own:
            owners = " or ".join(_show(a) for a, keys in ALGORITHM_KEYS.items()
                                 if key in keys)
            raise ConfigError(f"{where}: optimizer.{key} applies only to algorithm = "
                              f"{owners}, not {_show(opt['algorithm'])}")
    delayed = opt["outer_update"] == "delayed_nesterov"
    if opt["outer_momentum"] is None:
        opt["outer_momentum"] = 0.9 if delayed else OUTER_MOMENTUM[bool(opt["asynchronous"])]
    if opt["algorithm"] == "diloco" and opt["outer_update"] not in MOMENTUM_OUTER_UPDATES \
            and "outer_momentum" in given:
        raise ConfigError(f"{where}: optimizer.outer_momentum applies only to outer_update "
                          f"= \"nesterov\" or \"delayed_nesterov\", not "
                          f"{_show(opt['outer_update'])}")
    if opt["algorithm"] == "diloco" and delayed and not opt["asynchronous"]:
        raise ConfigError(f"{where}: optimizer.outer_update = \"delayed_nesterov\" is for "
                          "deltas that land one at a time: it needs optimizer.asynchronous "
                          "= true (the synchronous form steps once per round on the mean "
                          "of all deltas, which is plain \"nesterov\")")


def _resolve_schedule(opt: dict, given: dict, where: str) -> None:
    """Check the learning-rate schedule's keys against each other and the algorithm, and
    fill in the defaults that only step or cosine have (decay_rate, min_learning_rate)."""
    keys = [key for key in SCHEDULE_KEYS if key in given]
    if opt["algorithm"] == "sandblaster" and keys:
        raise ConfigError(f"{where}: optimizer.{keys[0]} = {_show(opt[keys[0]])}, but "
                          "algorithm = \"sandblaster\" has no learning rate (L-BFGS takes "
                          "its step length from a line search): leave out "
                          f"{', '.join('optimizer.' + k for k in SCHEDULE_KEYS)}")
    kind = opt["schedule"]
    if kind == "constant":
        for key in ("decay_steps", "decay_rate", "min_learning_rate"):
            if key in given:
                raise ConfigError(f"{where}: optimizer.{key} = {_show(opt[key])} applies to "
                                  "optimizer.schedule = \"step\" or \"cosine\", but the "
                                  "schedule is \"constant\" (the default)")
        return
    if opt["decay_steps"] is None:
        horizon = ("updates between two decays of the rate" if kind == "step" else
                   "updates over which the rate falls from learning_rate to "
                   "min_learning_rate")
        raise ConfigError(f"{where}: optimizer.schedule = {_show(kind)} needs "
                          f"optimizer.decay_steps, an integer >= 1: the {horizon} (counted "
                          "after the warmup; see docs/configuration.md, \"Learning-rate "
                          "schedules\", for what an update is in each algorithm)")
    if kind == "cosine" and opt["decay_rate"] is not None:
        raise ConfigError(f"{where}: optimizer.decay_rate = {_show(opt['decay_rate'])} "
                          "applies to optimizer.schedule = \"step\"; a cosine schedule ends "
                          "at optimizer.min_learning_rate")
    if kind == "step":
        if opt["decay_rate"] is None:
            opt["decay_rate"] = 0.1
        elif opt["decay_rate"] >= 1.0:
            raise ConfigError(f"{where}: optimizer.decay_rate = {_show(opt['decay_rate'])} "
                              "is invalid; expected a number > 0 and < 1 (the factor the "
                              "rate is multiplied by every decay_steps updates)")
    if opt["min_learning_rate"] is None:
        opt["min_learning_rate"] = 0.0
    elif opt["min_learning_rate"] >= opt["learning_rate"]:
        raise ConfigError(f"{where}: optimizer.min_learning_rate = "
                          f"{_show(opt['min_learning_rate'])} must be below "
                          f"optimizer.learning_rate = {_show(opt['learning_rate'])}")


def build_schedule(config: Config) -> Any:
    """The learning-rate Schedule of `config.optimizer` (distbelief.model.optimizers), which
    the optimizers take in place of a fixed rate: make_optimizer(..., build_schedule(c),
    ...). A constant one when no schedule is configured."""
    from distbelief.model.optimizers import Schedule

    opt = config.optimizer
    if opt.schedule == "constant":
        return Schedule(opt.learning_rate, opt.warmup_steps)
    return Schedule(opt.learning_rate, opt.warmup_steps, opt.schedule, opt.decay_steps,
                    opt.decay_rate if opt.decay_rate is not None else 0.1,
                    opt.min_learning_rate or 0.0)


def build_outer_optimizer(config: Config, size: int, replicas: int = 1) -> Any:
    """DiLoCo's outer optimizer over `size` parameters (a shard's slice, or the whole
    vector): optimizer.outer_update at optimizer.outer_learning_rate, a constant rate (the
    learning-rate schedule is the inner optimizer's). Its step(params, delta) takes the
    delta, the parameters a round started from minus the replica's, as its gradient. The
    asynchronous form (`replicas` = R) weighs each replica's delta 1/R, so that R deltas
    landing move the parameters as one synchronous round's average does: "nesterov" and
    "sgd" at rate / R, "delayed_nesterov" with its momentum moving every R deltas."""
    from distbelief.model.optimizers import SGD, DelayedNesterov, Momentum

    opt = config.optimizer
    rate = opt.outer_learning_rate
    if opt.outer_update == "delayed_nesterov":
        return DelayedNesterov(size, rate, opt.outer_momentum, period=replicas)
    if opt.outer_update == "nesterov":
        return Momentum(size, rate / replicas, opt.outer_momentum, nesterov=True)
    return SGD(rate / replicas)


def build_optimizer(config: Config, size: int) -> Any:
    """The optimizer config.optimizer.update names over `size` parameters, on the run's
    schedule, with its own settings (distbelief.model.optimizers.optimizer_for)."""
    from distbelief.model.optimizers import optimizer_for

    opt = config.optimizer
    hyper = {key: getattr(opt, key) for key in UPDATE_KEYS.get(opt.update, ())}
    return optimizer_for(opt.update, build_schedule(config), size, **hyper)


def needs_shards(algorithm: str, optimizer: dict[str, Any]) -> bool:
    """Whether an algorithm keeps parameters on parameter-server shards (ps_shards >= 1)
    with these [optimizer] settings (distbelief.algorithms.registry says)."""
    return registry.get(algorithm).needs_shards(optimizer)


def _resolve_ps_shards(values: dict, where: str) -> None:
    """cluster.ps_shards defaults to what the algorithm needs: at least one shard for the
    algorithms that keep parameters there, none for those that do not (sgd ignores it)."""
    opt, cluster = values["optimizer"], values["cluster"]
    algorithm = opt["algorithm"]
    shards = needs_shards(algorithm, opt)
    if cluster["ps_shards"] is None:
        cluster["ps_shards"] = 1 if shards or algorithm == "sgd" else 0
    elif shards and cluster["ps_shards"] == 0:
        raise ConfigError(f"{where}: cluster.ps_shards = 0, but algorithm = "
                          f"{_show(algorithm)}{_shard_reason(opt)} keeps the parameters on "
                          "parameter-server shards: give at least 1")
    elif not shards and algorithm != "sgd" and cluster["ps_shards"] > 0:
        raise ConfigError(f"{where}: cluster.ps_shards = {cluster['ps_shards']}, but "
                          f"algorithm = {_show(algorithm)}{_shard_reason(opt)} uses no "
                          "parameter-server shard: set cluster.ps_shards = 0 or leave it out")


def _shard_reason(opt: dict) -> str:
    if opt["algorithm"] == "sync":
        return f" with backup_workers = {opt['backup_workers']}"
    if opt["algorithm"] == "averaging":
        return (" without elastic_alpha" if opt["elastic_alpha"] is None
                else f" with elastic_alpha = {opt['elastic_alpha']:g}")
    if opt["algorithm"] == "diloco":
        return f" with asynchronous = {_show(opt['asynchronous'])}"
    return ""


def _check_consistency(values: dict, where: str) -> None:
    run = values["run"]
    opt = values["optimizer"]
    if opt["algorithm"] == "sandblaster" and not opt["wolfe_c1"] < opt["wolfe_c2"]:
        raise ConfigError(f"{where}: optimizer.wolfe_c1 = {opt['wolfe_c1']:g} must be smaller "
                          f"than optimizer.wolfe_c2 = {opt['wolfe_c2']:g} (Wolfe conditions "
                          "need 0 < c1 < c2 < 1)")
    if opt["algorithm"] == "sandblaster" and opt["wolfe_c2"] >= 1.0:
        raise ConfigError(f"{where}: optimizer.wolfe_c2 = {opt['wolfe_c2']:g} must be below 1")
    if opt["algorithm"] == "sandblaster" and not values["data"]["in_memory"]:
        raise ConfigError(f"{where}: data.in_memory = false streams each replica's own part "
                          "of the training set, but a Sandblaster replica may be handed any "
                          "work unit and reads the whole set; leave data.in_memory = true")
    if not run["max_steps"] and not run["max_seconds"] and run["target_accuracy"] is None:
        raise ConfigError(f"{where}: the run would never end: set at least one of "
                          "run.max_steps, run.max_seconds or run.target_accuracy")


def load_config(path: str | Path, overrides: Iterable[str] = (), check_data: bool = True,
                cwd: Path | None = None, open_data: bool = True) -> Config:
    """Read, override and validate a config file; with `check_data`, also that the data
    file exists and, with `open_data` too, that it opens and fits the model (see
    `check_data_fits`; `train` leaves that to algorithms.launch, which opens it once)."""
    source = Path(path)
    raw = apply_overrides(read_toml(source), overrides)
    config = config_from_dict(raw, source, cwd)
    if check_data:
        given = str(raw.get("data", {}).get("path", ""))
        if not Path(given).is_absolute() and not config.data.path.exists():
            # The usual surprise: the path was read from the current folder, not this one.
            raise DataError(f"data.path = {given!r}: {config.data.path}: no such file (a "
                            f"relative data.path is resolved from the config file's folder, "
                            f"{source.resolve().parent}; give an absolute path, or make the "
                            "file with `distbelief prepare`: fashion-mnist, synthetic, or "
                            "arrays for your own .npz, .npy or HDF5 arrays)")
        if open_data:
            check_data_fits(config)
    return config


def check_data_fits(config: Config, info: Any = None, network: Any = None) -> None:
    """Open the data file and build the model on it (or take `info` and `network`, the
    file already opened and the model built); DataError/ConfigError if they do not fit.

    Cheap: reads the file's metadata only and does not allocate parameters.
    """
    if info is None:
        from distbelief.data.hdf5 import open_dataset, with_validation

        # Metadata only: the trainer reads and checks the labels (once per rank, not twice).
        info = with_validation(open_dataset(config.data.path, labels=False),
                               config.data.validation)
    if network is None:
        network = build_network(config, info)
    if config.cluster.partitions > 1:
        from distbelief.model.partition import (
            balanced_splits,
            check_every_partition_owns_units,
            split_units,
        )

        try:
            check_every_partition_owns_units(network.layers, [
                balanced_splits(split_units(layer), config.cluster.partitions)
                for layer in network.layers])
        except ConfigError as e:
            raise ConfigError(f"cluster.{e}") from e
    # Sandblaster's batch is the whole training set when batch_size is that large.
    if config.data.batch_size > info.n_train and config.optimizer.algorithm != "sandblaster":
        raise DataError(f"data.batch_size = {config.data.batch_size} is larger than the "
                        f"{info.n_train} training samples in {info.path}")
    split, rows = ("validation", info.n_val) if info.n_val else ("test", info.n_test)
    if config.run.eval_samples > rows:
        raise DataError(f"run.eval_samples = {config.run.eval_samples} is larger than the "
                        f"{rows} {split} samples in {info.path}")
    _check_eval_set_fits(config, info, split, rows)


def _check_eval_set_fits(config: Config, info: Any, split: str, rows: int) -> None:
    """A streamed run (data.in_memory = false) holds its evaluation set in memory as
    float32: refuse one larger than data.stream_memory_mb, naming the eval_samples that fits,
    rather than run out of memory at the first evaluation."""
    if config.data.in_memory:
        return
    row_bytes = 4 * math.prod(info.input_shape)
    budget = config.data.stream_memory_mb << 20
    used = min(rows, config.run.eval_samples or rows)
    if used * row_bytes > budget:
        raise DataError(f"{info.path}: the {split} set evaluations use ({used:,d} rows, "
                        f"{used * row_bytes / 2**20:,.0f} MB as float32) is larger than "
                        f"data.stream_memory_mb = {config.data.stream_memory_mb}: set "
                        f"run.eval_samples = {budget // row_bytes} or fewer (an "
                        f"evaluation holds its rows in memory)")


def build_network(config: Config, info: Any) -> Any:
    """The model of `config.model.layers` on the data described by `info` (a DatasetInfo).

    A layer spec that is wrong, or that does not fit the data's input shape or number of
    classes, is a ConfigError naming the data it was checked against.
    """
    from distbelief.model.network import Network

    try:
        return Network(tuple(info.input_shape), [dict(layer) for layer in config.model.layers],
                       int(info.num_classes))
    except ConfigError as e:
        shape = "x".join(str(d) for d in info.input_shape)
        raise ConfigError(f"model.layers: {e} (data {info.path}: input {shape}, "
                          f"{info.num_classes} classes)") from e


HASHED_RUN_KEYS = ("seed",)
"""Of [run], only the seed changes what is trained; the rest are budgets and cadences."""
HASHED_SECTIONS = ("model", "data", "optimizer")
"""[cluster] is left out: the shard and partition counts spread the same model over more or
fewer ranks, and a checkpoint must load on a different shard count (it is re-sliced)."""


def run_name(config: Config) -> str:
    """The algorithm a run names itself by in its summary and report: the configured one,
    or "easgd" for averaging with optimizer.elastic_alpha set (Downpour's machinery)."""
    if config.optimizer.algorithm == "averaging" and config.optimizer.elastic_alpha is not None:
        return "easgd"
    return config.optimizer.algorithm


def hashed_settings(config: Config) -> dict[str, Any]:
    """The settings that decide the training trajectory, as a JSON-friendly nested dict:
    model, data, optimizer and run.seed. Checkpoint manifests store it so that a refused
    resume can name the keys that changed."""
    d = config.to_dict()
    out = {section: d[section] for section in HASHED_SECTIONS}
    algorithm = config.optimizer.algorithm
    dropped = set(SANDBLASTER_UNHASHED if algorithm == "sandblaster" else SANDBLASTER_KEYS)
    for owner, keys in ALGORITHM_KEYS.items():
        if owner != algorithm:
            dropped.update(keys)
    dropped.difference_update(ALGORITHM_KEYS.get(algorithm, ()))
    if algorithm == "diloco" and config.optimizer.outer_update not in MOMENTUM_OUTER_UPDATES:
        dropped.add("outer_momentum")  # not read
    if config.optimizer.update in ("adagrad", "sgd"):
        dropped.add("update")  # `adagrad` says it, as it did before `update` existed
    for rule, keys in UPDATE_KEYS.items():
        if config.optimizer.update != rule:
            dropped.update(keys)
    if config.optimizer.fetch == "own_pushes":
        dropped.add("fetch")  # the default, as before the key existed
    # The schedule's keys at their defaults (or unset), as before they existed.
    defaults = {"warmup_steps": 0, "schedule": "constant", "decay_steps": None,
                "decay_rate": None, "min_learning_rate": None}
    dropped.update(key for key, default in defaults.items()
                   if getattr(config.optimizer, key) == default)
    if config.optimizer.push_dtype == "float32":
        dropped.add("push_dtype")  # the default, as before the key existed
    out["optimizer"] = {k: v for k, v in out["optimizer"].items() if k not in dropped}
    out["run"] = {k: d["run"][k] for k in HASHED_RUN_KEYS}
    if config.data.in_memory:  # the default, as before the keys existed
        out["data"] = {k: v for k, v in out["data"].items()
                       if k not in ("in_memory", "stream_memory_mb")}
    if not config.data.validation:  # the default, as before the key existed
        out["data"].pop("validation", None)
    return out


def config_hash(config: Config) -> str:
    """sha256 (hex) of `hashed_settings`. Stop rules, output folder, threads, cadences and
    the cluster shape are left out so a checkpointed run can be resumed with a longer
    budget, elsewhere, or on another shard count. Stable across processes and Python
    versions (canonical JSON)."""
    return settings_hash(hashed_settings(config))


def settings_hash(settings: dict[str, Any]) -> str:
    """sha256 (hex) of a settings dict in canonical JSON."""
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def settings_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`section.key: old -> new` for each setting that differs between two
    `hashed_settings` dicts (a key missing on one side shows as None)."""
    changes = []
    for section in sorted(set(old) | set(new)):
        a, b = old.get(section) or {}, new.get(section) or {}
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                changes.append(f"{section}.{key}: {_short(a.get(key))} -> "
                               f"{_short(b.get(key))}")
    return changes


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

