"""Parameter averaging (`optimizer.algorithm = "averaging"`), issue 14's supervisor pattern,
in two forms chosen by `optimizer.elastic_alpha`:

    unset  collective.py: every rank a replica (cluster.ps_shards = 0); replicas train
           locally and every `average_every` steps their parameters are averaged with a
           polled Iallreduce. A lost replica stops the run (one line, exit 1).
    set    elastic.py: asynchronous EASGD (Zhang, Choromanska, LeCun 2015) on Downpour's
           machinery, the center variable on the parameter-server shards (ps_shards >= 1).
           A lost replica does not stop the others.

    mpiexec -n R python -m distbelief train CONFIG      # [optimizer] algorithm = "averaging"

Each module's docstring cites its sources and says what is kept local.
"""

from __future__ import annotations

import sys
from typing import IO, Any

from mpi4py import MPI

from distbelief.config import Config

__all__ = ["train"]


def train(config: Config, comm: MPI.Comm, stream: IO[str] | None = sys.stdout,
          resume: str = "auto") -> dict[str, Any] | None:
    """Train with parameter averaging on the ranks of `comm` (collective over it): EASGD
    when optimizer.elastic_alpha is set, the collective average otherwise. The summary on
    the rank that wrote it, None elsewhere."""
    if config.optimizer.elastic_alpha is not None:
        from distbelief.algorithms.downpour import elastic

        return elastic.train(config, comm, stream, resume=resume)
    from distbelief.algorithms.averaging import collective

    return collective.train(config, comm, stream, resume=resume)
