"""Hogwild (Niu, Recht, Re and Wright, NIPS 2011): lock-free updates of parameters shared
by the replicas of one node. The trainer is trainer.py (its docstring says how), and
options.py the [optimizer] keys Hogwild owns.

This `__init__` imports nothing, so that config can read options.py without MPI; the
trainer's names are still reached as `distbelief.algorithms.hogwild.NAME`, imported on
first use.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__") or name == "trainer":  # not one of the trainer's names
        raise AttributeError(name)
    from distbelief.algorithms.hogwild import trainer

    return getattr(trainer, name)
