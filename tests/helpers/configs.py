"""The small model and its configuration text that most tests train on."""

from __future__ import annotations

import json
from typing import Any

SMALL_CONFIG: dict[str, dict[str, Any]] = {
    "model": {"layers": [{"type": "dense", "units": 32, "activation": "relu"},
                         {"type": "dense", "units": 4, "activation": "softmax"}]},
    "data": {"path": "synth.h5", "batch_size": 32},
    "optimizer": {"algorithm": "downpour", "learning_rate": 0.05},
    "cluster": {"ps_shards": 1},
    "run": {"max_steps": 400, "eval_every_seconds": 0.3, "progress_every_seconds": 0.5,
            "threads": 1},
}
"""An MLP of one hidden layer over synth.h5 (4 classes), trained by Downpour on one shard."""


def small_config_text(hidden: int | None = 32, classes: int = 4,
                      **sections: dict[str, Any] | None) -> str:
    """SMALL_CONFIG as TOML, with `hidden` units in its hidden layer (None: no hidden layer,
    softmax regression), `classes` outputs, and each given section updated by its dict; a
    value of None leaves that key out, a section of None the whole section."""
    config = {name: dict(values) for name, values in SMALL_CONFIG.items()}
    hidden_layer, output = config["model"]["layers"]
    output = {**output, "units": classes}
    config["model"] = {"layers": [output] if hidden is None
                       else [{**hidden_layer, "units": hidden}, output]}
    for name, values in sections.items():
        if values is None:
            del config[name]
        else:
            config.setdefault(name, {}).update(values)
    lines = []
    for name, values in config.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()
                  if value is not None]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)
