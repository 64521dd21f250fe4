"""Run configuration: a TOML file read into validated, frozen dataclasses, one per section.

Everything is checked before training starts, so a run never dies half-way on a typo:
unknown sections and keys (with the closest valid name suggested), types and ranges, and,
in `load_config`, that the data file opens and fits the model. Errors are
`ConfigError`/`DataError` with one message naming `section.key`, the value given and what
is allowed.

    config = load_config("configs/fashion_mnist_mlp.toml", ["run.max_steps=100"])
    config.optimizer.learning_rate, config.run.out_dir, config.to_dict(), config_hash(config)

The keys, their defaults and meanings are docs/configuration.md. [optimizer] holds the
shared keys (OptimizerConfig: learning rate, update rule, schedule) and the keys each
algorithm owns, declared by its options dataclass (distbelief.options.Options, named by
its registry line) and checked by it; `config.optimizer.<key>` reads either kind (another
algorithm's key reads its default). docs/configuration.md's [optimizer] tables are written
from these declarations (`python -m distbelief.config --docs`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import math
import re
import sys
import tomllib
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from distbelief.algorithms import registry
from distbelief.errors import ConfigError, DataError
from distbelief.model import losses
from distbelief.options import (
    Key,
    Options,
    Rule,
    boolean,
    choice,
    integer,
    keys,
    number,
    option,
)
from distbelief.options import (
    text as text_rule,
)

ALGORITHMS = registry.names()
"""optimizer.algorithm: the names in distbelief.algorithms.registry."""
NOT_IMPLEMENTED_ALGORITHMS: tuple[str, ...] = ()
UPDATES = ("adagrad", "sgd", "adarevision", "momentum", "adam", "dcasgd")
"""optimizer.update: the rule that applies a gradient. "adagrad" and "sgd" are also
spelled `adagrad = true/false`; "adarevision" (delay-tolerant Adagrad) runs on the shards
of an algorithm whose options list it in `shard_updates` (Downpour's), where the delay is
known."""
UPDATE_KEYS = {"momentum": ("momentum", "nesterov"), "adam": ("beta1", "beta2"),
               "dcasgd": ("dc_lambda",)}
"""[optimizer] keys that only one update rule reads: an error with another rule, and left
out of the config hash unless the rule uses them."""
SCHEDULES = ("constant", "step", "cosine")
"""optimizer.schedule: the learning rate after the warmup (distbelief.model.optimizers.
Schedule). Its steps are the updates the optimizer applies, counted where they are applied
(docs/configuration.md, "Learning-rate schedules")."""
SCHEDULE_KEYS = ("warmup_steps", "schedule", "decay_steps", "decay_rate", "min_learning_rate")
"""[optimizer] keys of the learning-rate schedule; at their defaults (no warmup, constant)
they are left out of the config hash, so adding them did not change the hash of earlier
runs."""
SHARD_PLACEMENTS = ("spread", "ranks")
"""cluster.shard_placement: shards dealt round-robin over the nodes, or at world ranks
0..S-1 as the job script placed them (distbelief.runtime.communicators.topology)."""


LOSSES = tuple(losses.LOSSES)
"""model.loss: model.losses.LOSSES's names."""
TARGET_METRICS = ("loss", *dict.fromkeys(m for kind in losses.LOSSES.values()
                                         for m in kind.metrics))
"""run.target_metric: a figure an evaluation reports (which ones: each Loss.metrics)."""


@dataclass(frozen=True)
class ModelConfig:
    layers: tuple[dict, ...] = ()
    loss: str = "cross_entropy"
    """What the output is trained against: model.losses. Left out of to_dict when it is
    the default, so runs hash as before there was a choice."""
    own: dict | None = None
    """A model of the user's own (distbelief.train's `model`, train --model): its identity
    (model.protocol.identity), which the config hash covers; None for the built-in
    layers. Left out of to_dict when None, so built-in runs hash as before it existed."""


@dataclass(frozen=True)
class DataConfig:
    path: Path
    batch_size: int = 64
    in_memory: bool = True
    stream_memory_mb: int = 256
    validation: float = 0.0


@dataclass(frozen=True)
class OptimizerConfig:
    """[optimizer]'s shared keys. A loaded Config's optimizer is an instance of a subclass
    that adds every registered algorithm's own keys (`optimizer_type`), so that
    `config.optimizer.<key>` reads them as before the keys had owners."""

    algorithm: str = option(
        "sgd", choice(registry.names),
        "the algorithm that trains; each has keys of its own (`distbelief help ALGORITHM`)")
    learning_rate: float = option(
        0.02, number(0.0, strict=True),
        "Adagrad's gamma, or the SGD rate; with a warmup or schedule (below), the peak rate")
    adagrad: bool = option(
        True, boolean(),
        "the older spelling of `update`: true is `\"adagrad\"`, false is `\"sgd\"`; giving "
        "both, they must agree")
    update: str = option(
        None, choice(UPDATES),
        "the rule that applies a gradient: `\"adagrad\"` (same rule and eps as "
        "`torch.optim.Adagrad`), `\"sgd\"` (fixed rate), `\"adarevision\"` (Downpour's "
        "shards only: Adagrad revised for each push's delay, McMahan and Streeter 2014; see "
        "[downpour.md](downpour.md#adarevision-on-the-shards)), `\"momentum\"` (SGD with "
        "momentum, as `torch.optim.SGD(momentum=, nesterov=)` without dampening) or "
        "`\"adam\"` (as `torch.optim.Adam`, no weight decay; its bias correction counts the "
        "updates where they are applied: a Downpour shard's applied gradients, a trainer's "
        "steps, both kept in checkpoints), or `\"dcasgd\"` (Downpour's shards only: SGD "
        "with delay compensation, Zheng et al. 2017, in MXNet's approximation; see "
        "[downpour.md](downpour.md#delay-compensation-update--dcasgd)). Every algorithm "
        "with a learning rate takes each rule but the shards-only ones; on Downpour's "
        "shards the rule runs on each shard's slice",
        shown='"adagrad"')
    n_fetch: int = option(
        1, integer(1), "Downpour: pull parameters every n_fetch steps")
    n_push: int = option(
        1, integer(1), "Downpour: push the summed gradient every n_push steps")
    warm_start_steps: int = option(
        0, integer(0), "Downpour: replica 0 trains alone this many steps first (the paper's "
        "warm start; the rate is untouched, unlike `warmup_steps`)")
    momentum: float = option(
        0.9, number(0.0, maximum=0.999), "`update = \"momentum\"` only: the momentum (in "
        "[0, 0.999]); in the config hash only with that rule")
    nesterov: bool = option(
        False, boolean(), "`update = \"momentum\"` only: Nesterov's form; in the config "
        "hash only with that rule")
    beta1: float = option(
        0.9, number(0.0, maximum=0.999), "`update = \"adam\"` only: the first moving "
        "average's rate (eps is torch's 1e-8); in the config hash only with that rule")
    beta2: float = option(
        0.999, number(0.0, maximum=0.99999), "`update = \"adam\"` only: the second moving "
        "average's rate; in the config hash only with that rule")
    dc_lambda: float = option(
        0.04, number(0.0), "`update = \"dcasgd\"` only: the compensation's lambda "
        "(MXNet's default, 0.04); in the config hash only with that rule")
    warmup_steps: int = option(
        0, integer(0), "linear learning-rate warmup: update t (from 0) runs at "
        "`learning_rate` x (t + 1) / warmup_steps until the rate is reached; see "
        "[Learning-rate schedules](#learning-rate-schedules). Not `warm_start_steps`",
        hashed="unless default")
    schedule: str = option(
        "constant", choice(SCHEDULES), "the rate after the warmup: `\"constant\"`, "
        "`\"step\"` (multiplied by `decay_rate` every `decay_steps` updates) or "
        "`\"cosine\"` (half a cosine from `learning_rate` down to `min_learning_rate` over "
        "`decay_steps` updates, then flat)", hashed="unless default")
    decay_steps: int | None = option(
        None, integer(1), "`\"step\"` and `\"cosine\"` (required by both): updates between "
        "two decays / the length of the cosine, counted after the warmup",
        hashed="unless default")
    decay_rate: float | None = option(
        None, number(0.0, strict=True, maximum=1.0), "`\"step\"` only: the factor at each "
        "decay, 0 < r < 1", hashed="unless default", shown="0.1")
    min_learning_rate: float | None = option(
        None, number(0.0), "`\"step\"` and `\"cosine\"`: the floor of the rate, below "
        "`learning_rate`", hashed="unless default", shown="0.0")


def options_of(algorithm: str) -> type[Options]:
    """The options dataclass of `algorithm`'s own [optimizer] keys (Options: none)."""
    return registry.get(algorithm).load_options() or Options


def own_options(optimizer: OptimizerConfig) -> Options:
    """The chosen algorithm's own keys of a loaded [optimizer], as its options dataclass."""
    cls = options_of(optimizer.algorithm)
    return cls(**{key.name: getattr(optimizer, key.name) for key in keys(cls)})


def algorithm_keys() -> dict[str, tuple[Key, ...]]:
    """Every registered algorithm's own [optimizer] keys, by algorithm (those with any)."""
    found = {a.name: keys(options_of(a.name)) for a in registry.ALGORITHMS}
    return {name: own for name, own in found.items() if own}


SHARED_OPTIMIZER_KEYS = keys(OptimizerConfig)


def optimizer_type() -> type[OptimizerConfig]:
    """OptimizerConfig with every registered algorithm's own keys added as fields (at
    their defaults unless the chosen algorithm sets them)."""
    return _optimizer_type(registry.ALGORITHMS)


@functools.cache
def _optimizer_type(algorithms: tuple[registry.Algorithm, ...]) -> type[OptimizerConfig]:
    shared = {key.name for key in SHARED_OPTIMIZER_KEYS}
    added: dict[str, Key] = {}
    for own in algorithm_keys().values():
        for key in own:
            if key.name not in shared:
                added.setdefault(key.name, key)  # a key two algorithms own: one field
    fields = [(key.name, Any, dataclasses.field(default=key.default)) for key in added.values()]
    made = dataclasses.make_dataclass("OptimizerConfig", fields, bases=(OptimizerConfig,),
                                      frozen=True)
    made.__module__ = __name__
    return made


@dataclass(frozen=True)
class ClusterConfig:
    ps_shards: int = 1
    partitions: int = 1
    shard_placement: str = "spread"
    spare_replicas: int = 0  # hot spares, where the algorithm takes them (registry)
    release_spares_at: tuple[int, ...] = ()  # steps at which spares join as replicas
    standby_shards: bool = False  # shard 0 adopts a lost shard's slice (registry)


@dataclass(frozen=True)
class RunConfig:
    out_dir: Path
    max_steps: int = 0
    max_seconds: float = 0.0
    target_accuracy: float | None = None
    target_loss: float | None = None
    target_metric: str | None = None
    target_value: float | None = None
    eval_every_seconds: float = 2.0
    eval_samples: int = 0
    seed: int = 0
    threads: int = 0
    flush_subnormals: bool = True
    progress_every_seconds: float = 2.0
    checkpoint_every_seconds: float = 600.0
    checkpoint_every_steps: int = 0
    keep_checkpoints: int = 3
    keep_best: bool = True
    checkpoint_in_background: bool = True
    max_bad_gradients_in_a_row: int = 10
    replica_timeout_seconds: float = 300.0
    heartbeat_timeout_seconds: float = 30.0
    stall_warn_seconds: float = 60.0
    stall_abort_seconds: float = 600.0
    owner_timeout_seconds: float = 120.0
    collapse_window_seconds: float = 30.0
    stop_on_collapse: bool = False
    tensorboard: bool | None = None  # None: events when tensorboardX is installed


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
        if self.model.own is None:
            del out["model"]["own"]
        if self.model.loss == "cross_entropy":
            del out["model"]["loss"]
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
# The rules are distbelief.options'; these names are the ones [run] and the others use.

_int, _float, _bool, _string, _choice = integer, number, boolean, text_rule, choice


def _steps() -> Rule:
    """A list of global steps >= 1 in increasing order (cluster.release_spares_at)."""
    def convert(v: Any) -> Any:
        if not isinstance(v, list) or any(
                isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in v):
            return None
        return tuple(v) if list(v) == sorted(v) else None
    return Rule(convert, "a list of steps >= 1 in increasing order, e.g. [1000, 5000]")


def _layers() -> Rule:
    def convert(v: Any) -> Any:
        if isinstance(v, list) and v and all(isinstance(layer, dict) for layer in v):
            return tuple(dict(layer) for layer in v)
        return None
    return Rule(convert, "a non-empty list of tables, e.g. [[model.layers]] blocks")


REQUIRED = object()
"""Default marker: the key must be given."""

SCHEMA: dict[str, dict[str, tuple[Rule, Any]]] = {
    "model": {
        "layers": (_layers(), REQUIRED),
        "loss": (choice(LOSSES), "cross_entropy"),
    },
    "data": {
        "path": (_string(), REQUIRED),
        "batch_size": (_int(1), 64),
        "in_memory": (_bool(), True),
        "stream_memory_mb": (_int(4), 256),
        "validation": (_float(0.0, maximum=0.5), 0.0),
    },
    "optimizer": {key.name: (key.rule, key.default) for key in SHARED_OPTIMIZER_KEYS},
    "cluster": {
        "ps_shards": (_int(0), None),
        "partitions": (_int(1), 1),
        "shard_placement": (_choice(SHARD_PLACEMENTS), "spread"),
        "spare_replicas": (_int(0), 0),
        "release_spares_at": (_steps(), ()),
        "standby_shards": (_bool(), False),
    },
    "run": {
        "max_steps": (_int(0), 0),
        "max_seconds": (_float(0.0), 0.0),
        "target_accuracy": (_float(0.0, strict=True, maximum=1.0), None),
        "target_loss": (_float(0.0), None),
        "target_metric": (choice(TARGET_METRICS), None),
        "target_value": (number(-math.inf), None),
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
        "keep_best": (_bool(), True),
        "checkpoint_in_background": (_bool(), True),
        "max_bad_gradients_in_a_row": (_int(1), 10),
        "replica_timeout_seconds": (_float(0.0), 300.0),
        "heartbeat_timeout_seconds": (_float(0.0), 30.0),
        "stall_warn_seconds": (_float(0.0), 60.0),
        "stall_abort_seconds": (_float(0.0), 600.0),
        "owner_timeout_seconds": (_float(0.0), 120.0),
        "collapse_window_seconds": (_float(0.0, strict=True), 30.0),
        "stop_on_collapse": (_bool(), False),
        "tensorboard": (_bool(), None),
    },
}
SECTIONS = tuple(SCHEMA)


def schema(section: str) -> dict[str, tuple[Rule, Any]]:
    """The keys of one section: (rule, default) by name. [optimizer]'s are the shared
    keys and every registered algorithm's own (which one may set is checked later)."""
    if section != "optimizer":
        return SCHEMA[section]
    out = dict(SCHEMA[section])
    for own in algorithm_keys().values():
        for key in own:
            out.setdefault(key.name, (key.rule, key.default))
    return out


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
        valid = schema(section)
        for key in table:
            if key not in valid:
                raise ConfigError(f"{where}: unknown key '{section}.{key}'"
                                  f"{_did_you_mean(key, valid)} "
                                  f"(valid keys in [{section}]: {', '.join(valid)})")


def _section_values(raw: dict, section: str, where: str) -> dict[str, Any]:
    """The checked values of one section, defaults filled in (REQUIRED keys must be there)."""
    table = raw.get(section, {})
    values = {}
    for key, (rule, default) in schema(section).items():
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
    valid = schema(section)
    if key not in valid:
        raise ConfigError(f"--set {text}: unknown key '{section}.{key}'"
                          f"{_did_you_mean(key, valid)} "
                          f"(valid keys in [{section}]: {', '.join(valid)})")
    rule = valid[key][0]
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
            for other in REPLACES.get((section, key), ()):
                if (section, other) not in overridden:
                    table.pop(other, None)  # --set update=... replaces the file's adagrad
    return merged


TARGET_KEYS = ("target_accuracy", "target_loss", "target_metric", "target_value")
"""The [run] keys that give a run its target (records.metrics.target_of reads them)."""
_TARGET_PAIRS = {"target_metric": "target_value", "target_value": "target_metric"}
REPLACES = {("optimizer", "update"): ("adagrad",), ("optimizer", "adagrad"): ("update",),
            **{("run", key): tuple(k for k in TARGET_KEYS if k not in (key, _TARGET_PAIRS.get(key)))
               for key in TARGET_KEYS}}
"""The keys an override of a key replaces as the file gives them: one setting said two
ways (update, adagrad), and a run's one target, whichever key gives it (so `compare
--target` or `--set run.target_loss=...` replaces a file's run.target_accuracy). Two
overrides that disagree are still an error."""


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
                     cwd: Path | None = None, own_model: bool = False) -> Config:
    """Validate raw TOML tables into a Config (schema only; no files are opened).

    Relative `data.path` is resolved against the config file's folder (the current directory
    when there is no file); relative `run.out_dir` against `cwd` (default: the current one).
    With `own_model` a model object comes with the config ([model] then has no layers; the
    launch records the model's identity in model.own).
    """
    where = str(source) if source is not None else "config"
    if own_model:
        _check_no_layers(raw, where)
    _check_names(raw, where)
    values = {section: _section_values(raw, section, where) for section in SECTIONS
              if not (own_model and section == "model")}
    if own_model:
        values["model"] = {"layers": (), "own": {}, "loss": _own_model_loss(raw, where)}
    _check_not_implemented(values, where)
    given = raw.get("optimizer", {})
    _resolve_update(values["optimizer"], given, where)
    _check_owned_keys(values["optimizer"], given, where)
    _resolve_schedule(values["optimizer"], given, where)
    _check_algorithm_options(values, given, where)
    _check_spares(values, where)
    _resolve_ps_shards(values, where)
    _check_standby_shards(values, where)
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
        optimizer=optimizer_type()(**values["optimizer"]),
        cluster=ClusterConfig(**values["cluster"]),
        run=RunConfig(**run),
        source=source.resolve() if source is not None else None,
    )


def _check_no_layers(raw: dict, where: str) -> None:
    """A model object replaces [model]'s layers: layers given beside one are a mistake
    worth naming."""
    if not isinstance(raw.get("model", {}), dict):
        raise ConfigError(f"{where}: [model] must be a table (and may be left out: a model "
                          f"of your own was given)")
    if raw.get("model", {}).get("layers"):
        raise ConfigError(f"{where}: model.layers describe the built-in network, and a "
                          f"model of your own was given too; remove [[model.layers]] or "
                          f"leave the model out")


def _check_not_implemented(values: dict, where: str) -> None:
    algorithm = values["optimizer"]["algorithm"]
    if algorithm in NOT_IMPLEMENTED_ALGORITHMS:
        raise ConfigError(f"{where}: optimizer.algorithm = {algorithm!r} is not implemented "
                          f"yet; use one of {', '.join(repr(a) for a in ALGORITHMS)}")


def _resolve_update(opt: dict, given: dict, where: str) -> None:
    """optimizer.update from `adagrad` when it is not given; both given must agree; the
    rule must be one the algorithm runs."""
    if opt["update"] is None:
        opt["update"] = "adagrad" if opt["adagrad"] else "sgd"
    elif "adagrad" in given and opt["adagrad"] != (opt["update"] == "adagrad"):
        raise ConfigError(f"{where}: optimizer.adagrad = {_show(opt['adagrad'])} contradicts "
                          f"optimizer.update = {_show(opt['update'])}; give only update")
    opt["adagrad"] = opt["update"] == "adagrad"
    for rule, keys_of_rule in UPDATE_KEYS.items():
        for key in keys_of_rule:
            if key in given and opt["update"] != rule:
                raise ConfigError(f"{where}: optimizer.{key} applies only to update = "
                                  f"{_show(rule)}, not {_show(opt['update'])}")
    algorithm, own = opt["algorithm"], options_of(opt["algorithm"])
    if own.no_learning_rate and opt["update"] in UPDATE_KEYS:
        raise ConfigError(f"{where}: optimizer.update = {_show(opt['update'])}, but "
                          f"algorithm = {_show(algorithm)} has no update rule "
                          f"({own.no_learning_rate})")
    runners = [a.name for a in registry.ALGORITHMS
               if opt["update"] in options_of(a.name).shard_updates]
    if runners and algorithm not in runners:
        shards = " or ".join(f"{name.capitalize()}'s" for name in runners)
        raise ConfigError(f"{where}: optimizer.update = {_show(opt['update'])} runs on "
                          f"{shards} parameter-server shards, which know each push's "
                          f"delay; with algorithm = {_show(algorithm)} use \"adagrad\" "
                          "or \"sgd\"")


def _check_owned_keys(opt: dict, given: dict, where: str) -> None:
    """A key another algorithm owns, set for this one, is an error naming its owners."""
    algorithm = opt["algorithm"]
    mine = {key.name for key in keys(options_of(algorithm))}
    owners: dict[str, list[str]] = {}
    for name, own in algorithm_keys().items():
        if not options_of(name).ignored_by_others:
            for key in own:
                owners.setdefault(key.name, []).append(name)
    for key in sorted(owners):
        if key in given and key not in mine and key not in SCHEMA["optimizer"]:
            why = [options_of(owner).refused_because.get(key) for owner in owners[key]]
            because = "".join(f": {text}" for text in why if text)
            raise ConfigError(f"{where}: optimizer.{key} applies only to algorithm = "
                              f"{' or '.join(_show(a) for a in owners[key])}, not "
                              f"{_show(algorithm)}{because}")


def _check_algorithm_options(values: dict, given: dict, where: str) -> None:
    """The chosen algorithm checks its own keys (and resolves those whose default depends
    on others): distbelief.options.Options.checked."""
    opt = values["optimizer"]
    cls = options_of(opt["algorithm"])
    own = cls(**{key.name: opt[key.name] for key in keys(cls)})
    opt.update(asdict(own.checked(given, values, where)))


def _resolve_schedule(opt: dict, given: dict, where: str) -> None:
    """Check the learning-rate schedule's keys against each other and the algorithm, and
    fill in the defaults that only step or cosine have (decay_rate, min_learning_rate)."""
    keys_given = [key for key in SCHEDULE_KEYS if key in given]
    no_rate = options_of(opt["algorithm"]).no_learning_rate
    if no_rate and keys_given:
        raise ConfigError(f"{where}: optimizer.{keys_given[0]} = "
                          f"{_show(opt[keys_given[0]])}, but algorithm = "
                          f"{_show(opt['algorithm'])} has no learning rate ({no_rate}): "
                          "leave out "
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
    algorithms that keep parameters there, none for those that do not (an algorithm whose
    registry line says shards="ignored", as sgd's, takes any count and defaults to 1)."""
    opt, cluster = values["optimizer"], values["cluster"]
    algorithm = registry.get(opt["algorithm"])
    shards, ignored = algorithm.needs_shards(opt), algorithm.shards == "ignored"
    if cluster["ps_shards"] is None:
        cluster["ps_shards"] = 1 if shards or ignored else 0
    elif shards and cluster["ps_shards"] == 0:
        raise ConfigError(f"{where}: cluster.ps_shards = 0, but algorithm = "
                          f"{_show(algorithm.name)}{_shard_reason(algorithm, opt)} keeps the "
                          "parameters on parameter-server shards: give at least 1")
    elif not shards and not ignored and cluster["ps_shards"] > 0:
        raise ConfigError(f"{where}: cluster.ps_shards = {cluster['ps_shards']}, but "
                          f"algorithm = {_show(algorithm.name)}"
                          f"{_shard_reason(algorithm, opt)} uses no parameter-server "
                          "shard: set cluster.ps_shards = 0 or leave it out")


def _check_spares(values: dict, where: str) -> None:
    """cluster.spare_replicas > 0 with an algorithm that cannot use spares (its registry
    line says, and why): one line."""
    spares, opt = values["cluster"]["spare_replicas"], values["optimizer"]
    algorithm = registry.get(opt["algorithm"])
    if spares and not algorithm.takes_spares(opt):
        raise ConfigError(f"{where}: cluster.spare_replicas = {spares}, but algorithm = "
                          f"{_show(algorithm.name)} cannot use spare replicas: "
                          f"{algorithm.no_spares}; leave cluster.spare_replicas out")


def _check_standby_shards(values: dict, where: str) -> None:
    """cluster.standby_shards with an algorithm whose shards cannot stand in for each
    other, or with fewer than 2 shards (shard 0 has no standby): one line."""
    cluster, opt = values["cluster"], values["optimizer"]
    if not cluster["standby_shards"]:
        return
    algorithm = registry.get(opt["algorithm"])
    if not algorithm.takes_standby_shards(opt):
        raise ConfigError(f"{where}: cluster.standby_shards = true, but algorithm = "
                          f"{_show(algorithm.name)} cannot survive a lost shard: "
                          f"{algorithm.no_standby_shards}; leave cluster.standby_shards out")
    if cluster["ps_shards"] < 2:
        raise ConfigError(f"{where}: cluster.standby_shards = true needs cluster.ps_shards "
                          f">= 2, got {cluster['ps_shards']}: shard 0 runs the job (clock, "
                          "evaluation, checkpoints) and adopts the slice of another shard "
                          "that is lost, but has no standby itself")


def _shard_reason(algorithm: registry.Algorithm, opt: dict) -> str:
    """" with KEY = VALUE" (or " without KEY") when an optimizer key decides the shards."""
    key = algorithm.shards
    if key in ("always", "never", "ignored"):
        return ""
    return f" without {key}" if opt[key] is None else f" with {key} = {_show(opt[key])}"


def _own_model_loss(raw: dict, where: str) -> str:
    """model.loss beside a model of one's own (which replaces the rest of [model])."""
    loss = raw.get("model", {}).get("loss", "cross_entropy")
    if loss not in LOSSES:
        raise ConfigError(f"{where}: model.loss must be one of "
                          f"{', '.join(map(repr, LOSSES))}, got {_show(loss)}")
    return loss


def _check_consistency(values: dict, where: str) -> None:
    run = values["run"]
    targets = [key for key in ("target_accuracy", "target_loss", "target_metric")
               if run[key] is not None]
    if not run["max_steps"] and not run["max_seconds"] and not targets:
        raise ConfigError(f"{where}: the run would never end: set at least one of "
                          "run.max_steps, run.max_seconds or a target (run.target_accuracy, "
                          "run.target_loss, or run.target_metric with run.target_value)")
    if len(targets) > 1:
        raise ConfigError(f"{where}: {' and '.join('run.' + key for key in targets)} are two "
                          f"targets; a run has one")
    if (run["target_metric"] is None) != (run["target_value"] is None):
        raise ConfigError(f"{where}: run.target_metric and run.target_value go together "
                          f"(e.g. target_metric = \"r2\", target_value = 0.95)")
    _check_loss_fits(values, where)


def _check_loss_fits(values: dict, where: str) -> None:
    """The target names a figure the loss reports; model parallelism trains
    cross_entropy alone."""
    loss, run = values["model"]["loss"], values["run"]
    reported = ("loss", *losses.LOSSES[loss].metrics)
    metric = ("accuracy" if run["target_accuracy"] is not None else run["target_metric"])
    if metric is not None and metric not in reported:
        key = ("run.target_accuracy" if run["target_accuracy"] is not None
               else f"run.target_metric = {_show(metric)}")
        raise ConfigError(f"{where}: {key}, but model.loss = {_show(loss)} reports "
                          f"{', '.join(reported)}; target one of those")
    if loss != "cross_entropy" and values["cluster"]["partitions"] > 1:
        raise ConfigError(f"{where}: cluster.partitions = {values['cluster']['partitions']} "
                          f"(model parallelism) trains model.loss = \"cross_entropy\" only, "
                          f"not {_show(loss)}; set cluster.partitions = 1")



def load_config(path: str | Path, overrides: Iterable[str] = (), check_data: bool = True,
                cwd: Path | None = None, open_data: bool = True,
                own_model: bool = False) -> Config:
    """Read, override and validate a config file; with `check_data`, also that the data
    file exists and, with `open_data` too, that it opens and fits the model (see
    `check_data_fits`; `train` leaves that to algorithms.launch, which opens it once).
    `own_model`: as config_from_dict's."""
    source = Path(path)
    raw = apply_overrides(read_toml(source), overrides)
    config = config_from_dict(raw, source, cwd, own_model)
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
    from distbelief.data.hdf5 import training_rows

    if info is None:
        from distbelief.data.hdf5 import open_dataset, with_validation

        # Metadata only: the trainer reads and checks the labels (once per rank, not twice).
        info = with_validation(open_dataset(config.data.path, labels=False),
                               config.data.validation)
    if network is None:
        network = build_network(config, info)
    if config.cluster.partitions > 1 and info.features != "dense":
        raise ConfigError(f"cluster.partitions = {config.cluster.partitions}: model "
                          f"parallelism splits the built-in dense layers; a sparse model "
                          f"trains with partitions = 1")
    if config.cluster.partitions > 1:
        from distbelief.model.partition import (
            balanced_splits,
            check_every_partition_owns_units,
            check_splittable,
            split_units,
        )

        try:
            check_splittable(network.layers, config.cluster.partitions)
            check_every_partition_owns_units(network.layers, [
                balanced_splits(split_units(layer), config.cluster.partitions)
                for layer in network.layers])
        except ConfigError as e:
            raise ConfigError(f"cluster.{e}") from e
    # Sandblaster's batch is the whole training set when batch_size is that large.
    whole_set = options_of(config.optimizer.algorithm).batch_may_exceed_data
    if config.data.batch_size > info.n_train and not whole_set:
        rows = training_rows(info.n_train, info.held_out, info.path, config.data.validation)
        raise DataError(f"data.batch_size = {config.data.batch_size} is larger than the "
                        f"{rows}")
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
    row_bytes = info.input_row_bytes
    budget = config.data.stream_memory_mb << 20
    used = min(rows, config.run.eval_samples or rows)
    if used * row_bytes > budget:
        raise DataError(f"{info.path}: the {split} set that evaluations use ({used:,d} "
                        f"rows, {used * row_bytes / 2**20:,.0f} MB in memory) is larger "
                        f"than data.stream_memory_mb = {config.data.stream_memory_mb}: set "
                        f"run.eval_samples = {budget // row_bytes} or fewer (an "
                        f"evaluation holds its rows in memory)")


def build_network(config: Config, info: Any) -> Any:
    """The model of `config.model.layers` on the data described by `info` (a DatasetInfo).

    A layer spec that is wrong, or that does not fit the data's input shape or number of
    classes, is a ConfigError naming the data it was checked against. Its dropout masks
    are keyed on run.seed.
    """
    from distbelief.model.models import build_model

    loss = data_loss(config, info)
    try:
        return build_model(info.input_shape, config.model.layers, loss, config.run.seed,
                           info.features, info.id_rows)
    except ConfigError as e:
        shape = "x".join(str(d) for d in info.input_shape)
        raise ConfigError(f"model.layers: {e} (data {info.path}: input {shape}, "
                          f"{targets_text(info)})") from e


def data_loss(config: Config, info: Any) -> Any:
    """The run's model.loss (a model.losses.Loss) over the outputs the data's targets need,
    or a ConfigError when the loss does not fit those targets."""
    try:
        return losses.loss_for_data(config.model.loss, info.targets, info.num_classes, info.outputs)
    except ConfigError as e:
        raise ConfigError(f"{e} (data {info.path}: {targets_text(info)})") from e


def targets_text(info: Any) -> str:
    """"10 classes" or "3 float targets a row": what a dataset's y holds."""
    if info.targets == "classes":
        return f"{info.num_classes} classes"
    return f"{info.outputs} float target{'s' if info.outputs > 1 else ''} a row"


HASHED_RUN_KEYS = ("seed",)
"""Of [run], only the seed changes what is trained; the rest are budgets and cadences."""
HASHED_SECTIONS = ("model", "data", "optimizer")
"""[cluster] is left out: the shard and partition counts spread the same model over more or
fewer ranks, and a checkpoint must load on a different shard count (it is re-sliced)."""


def run_name(config: Config) -> str:
    """The algorithm a run names itself by in its summary and report: the configured one,
    or what its options say (Options.run_name: "easgd" for averaging with elastic_alpha)."""
    return own_options(config.optimizer).run_name() or config.optimizer.algorithm


def hashed_settings(config: Config) -> dict[str, Any]:
    """The settings that decide the training trajectory, as a JSON-friendly nested dict:
    model, data, optimizer and run.seed. Checkpoint manifests store it so that a refused
    resume can name the keys that changed. Of [optimizer]: the shared keys and the chosen
    algorithm's own, less those their declarations leave out (`hashed`, Options.unhashed),
    so that adding a key left the hash of earlier runs alone."""
    d = config.to_dict()
    out = {section: d[section] for section in HASHED_SECTIONS}
    opt = config.optimizer
    own = own_options(opt)
    mine = {key.name for key in keys(type(own))}
    dropped = {key.name for keys_of in algorithm_keys().values() for key in keys_of} - mine
    dropped |= own.unhashed()
    dropped |= {key.name for key in SHARED_OPTIMIZER_KEYS
                if key.hashed == "unless default" and getattr(opt, key.name) == key.default}
    if opt.update in ("adagrad", "sgd"):
        dropped.add("update")  # `adagrad` says it, as it did before `update` existed
    for rule, keys_of_rule in UPDATE_KEYS.items():
        if opt.update != rule:
            dropped.update(keys_of_rule)
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



# ---------------------------------------------------------------------------------------
# The [optimizer] keys described: docs/configuration.md's tables and `distbelief help`.

DOCS_BEGIN = ("<!-- [optimizer] keys: written by `python -m distbelief.config --docs` from "
              "the declarations (config.OptimizerConfig, each algorithm's options.py); "
              "edit those, not this -->")
DOCS_END = "<!-- end of the generated [optimizer] keys -->"


HASH_NOTES = {"unless default": "; in the config hash only when not the default",
              "never": "; not in the config hash (a resumed run may change it)"}


def _doc_default(key: Key) -> str:
    shown = key.shown_default()
    return f"`{shown}`" if shown.startswith('"') else shown


def _doc_table(keys_of: Iterable[Key]) -> list[str]:
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for key in keys_of:
        meaning = key.help
        if key.name == "algorithm":
            meaning += ": " + ", ".join(f'`"{a.name}"` ({a.summary})'
                                        for a in registry.ALGORITHMS)
        meaning += HASH_NOTES.get(key.hashed, "")
        lines.append(f"| `optimizer.{key.name}` | {_doc_default(key)} | "
                     f"{meaning.replace('|', chr(92) + '|')} |")
    return lines


def key_tables() -> str:
    """docs/configuration.md's [optimizer] tables (Markdown, between DOCS_BEGIN and
    DOCS_END): the shared keys, then each algorithm's own, from their declarations."""
    shared = ("Every algorithm reads these (Sandblaster, which has no learning rate, "
              "refuses the schedule's):")
    lines = [DOCS_BEGIN, "", shared, "", *_doc_table(SHARED_OPTIMIZER_KEYS)]
    for name, own in algorithm_keys().items():
        cls, algorithm = options_of(name), registry.get(name)
        page = f"; [{cls.docs.removeprefix('docs/')}]({cls.docs.removeprefix('docs/')})" \
            if cls.docs else ""
        others = ("ignored by the other algorithms" if cls.ignored_by_others
                  else "an error with another algorithm")
        title = f'`algorithm = "{name}"` ({algorithm.summary}{page}); its own keys, {others}:'
        lines += ["", title, "", *_doc_table(own)]
    return "\n".join([*lines, "", DOCS_END])


def docs_with_key_tables(page: str) -> str:
    """`page` (docs/configuration.md's text) with its generated tables written anew."""
    if page.count(DOCS_BEGIN) != 1 or page.count(DOCS_END) != 1:
        raise ValueError("the page must hold the begin and end markers once each")
    before, rest = page.split(DOCS_BEGIN)
    return before + key_tables() + rest.split(DOCS_END, 1)[1]


def _plain(markdown: str) -> str:
    """Markdown as a terminal shows it: [text](link) is text, `code` is code."""
    return re.sub(r"\[([^\]]+)\]\([^)]*\)", r"\1", markdown).replace("`", "")


def _wrapped(text: str, indent: str) -> str:
    import textwrap

    return textwrap.fill(_plain(text), width=88, initial_indent=indent,
                         subsequent_indent=indent)


def _key_lines(keys_of: Iterable[Key]) -> list[str]:
    lines = []
    for key in keys_of:
        lines += [f"  optimizer.{key.name} = {key.shown_default()}  ({key.rule.allowed})",
                  _wrapped(key.help, "      ")]
    return lines


def describe_algorithm(name: str) -> str:
    """What `distbelief help NAME` prints: the algorithm, what it does, its own keys with
    their defaults and help, and where to read more. ConfigError for an unknown name."""
    if name not in registry.names():
        raise ConfigError(f"unknown algorithm {name!r}{_did_you_mean(name, registry.names())} "
                          f"(algorithms: {', '.join(registry.names())})")
    algorithm, cls = registry.get(name), options_of(name)
    lines = [f"{name}: {algorithm.summary}"]
    if cls.description:
        lines += ["", _wrapped(cls.description, "")]
    own = keys(cls)
    if own:
        lines += ["", "[optimizer] keys of its own (in the file, or --set optimizer.KEY=VALUE):",
                  *_key_lines(own)]
    else:
        lines += ["", "No [optimizer] keys of its own."]
    shared = ", ".join(key.name for key in SHARED_OPTIMIZER_KEYS if key.name != "algorithm")
    more = f"; {name}: {cls.docs}" if cls.docs else ""
    lines += ["", _wrapped(f"Shared keys ({shared}): distbelief help optimizer. Every key: "
                           f"docs/configuration.md{more}.", "")]
    return "\n".join(lines)


def describe_shared() -> str:
    """What `distbelief help optimizer` prints: the keys every algorithm shares."""
    return "\n".join(["[optimizer] keys every algorithm reads (docs/configuration.md):",
                      *_key_lines(SHARED_OPTIMIZER_KEYS)])


def main(argv: list[str] | None = None) -> int:
    """`python -m distbelief.config --docs [PAGE]`: write the [optimizer] key tables into
    PAGE (default docs/configuration.md); `--check` only says whether they are current."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m distbelief.config",
                                     description=main.__doc__)
    parser.add_argument("--docs", action="store_true", required=True)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("page", nargs="?", default="docs/configuration.md")
    args = parser.parse_args(argv)
    page = Path(args.page)
    old = page.read_text(encoding="utf-8")
    new = docs_with_key_tables(old)
    if args.check:
        print(f"{page}: {'current' if new == old else 'out of date: run without --check'}")
        return 0 if new == old else 1
    if new != old:
        page.write_text(new, encoding="utf-8")
    print(f"{page}: [optimizer] key tables {'written' if new != old else 'already current'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
