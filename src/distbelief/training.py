"""Train from Python: `distbelief.train(config, model=None)`.

    import distbelief
    summary = distbelief.train("run.toml")                     # the [model] layers
    summary = distbelief.train("run.toml", model=MyModel())    # a model of your own
    summary = distbelief.train({"data": {...}, "optimizer": {...}, "run": {...}},
                               model=MyModel(), overrides=["run.max_steps=200"])

The script runs on every rank (`mpiexec -n 3 python my_script.py`, or plainly `python
my_script.py` for one-process algorithms); each rank calls `train` the same way and gets
the run's summary: the rank that wrote it (rank 0, or Sandblaster's coordinator) sends it
to every rank still in the run at the end (None on a rank whose replica was lost). Everything `distbelief train` does happens here too: the run folder, the
checkpoints and resume, stop rules, metrics and each algorithm's fault tolerance. A model
of your own is any object with `init_params(rng)`, `loss_and_grad(params, x, y)` and
`predict(params, x)` (distbelief.model.protocol; docs/your-own-model.md).

Errors that the ranks find together (a configuration, a data file, a model that does not
fit the data) are raised on every rank as a distbelief.errors.UserError; a model that fails
later, on one rank, ends the job with one line.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["train"]


def train(config: str | Path | Mapping[str, Any], model: Any = None, *,
          overrides: Iterable[str] = (), resume: str = "auto") -> dict[str, Any] | None:
    """Train `config` (a TOML path, or a dict shaped like the TOML) with its [model] layers
    or with `model`, a model of your own. `overrides` are `--set` texts
    ("section.key=value"); `resume` is "auto" (resume the run folder's newest checkpoint if
    there is one), "require" or "fresh". Returns the summary (summary.json's content) on
    every rank still in the run (None on a rank whose replica was lost, or whose writer
    died). Collective: every rank calls it."""
    from distbelief.runtime.launching import launcher
    from distbelief.runtime.launching.guardian import start_mpi

    comm = start_mpi() if launcher.launched_with_several_ranks() else None
    loaded = _load(config, overrides, model is not None)
    from distbelief.algorithms import launch
    from distbelief.algorithms.common import interrupts_noted

    # Ctrl-C stops the run at the next step with a checkpoint, as `distbelief train` does;
    # the script's own handler is back when train returns.
    with interrupts_noted():
        return launch.train(loaded, comm, resume, model=model, everywhere=True)


def _load(config: str | Path | Mapping[str, Any], overrides: Iterable[str],
          own_model: bool) -> Any:
    from distbelief.config import apply_overrides, config_from_dict, load_config
    from distbelief.errors import ConfigError

    if isinstance(config, (str, Path)):
        return load_config(config, list(overrides), open_data=False, own_model=own_model)
    if not isinstance(config, Mapping):
        raise ConfigError(f"config must be a TOML path or a dict shaped like the TOML, got "
                          f"{type(config).__name__}")
    raw = apply_overrides({k: dict(v) if isinstance(v, Mapping) else v
                           for k, v in config.items()}, list(overrides))
    return config_from_dict(raw, None, None, own_model)
