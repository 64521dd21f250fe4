"""Shared pieces of the parameter-server MPI programs: checks, options, set-up.

The programs run under `python -m mpi4py PROGRAM`, so any exception aborts the whole job
with a non-zero status instead of leaving the other ranks hanging.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from mpi4py import MPI

from distbelief.model.optimizers import make_optimizer
from distbelief.ps.endpoint import ParameterClient, ParameterServerShard, ServerSpec
from distbelief.ps.transport import open_parameter_server
from distbelief.runtime.communicators.topology import Topology


def check(condition: bool, message: str) -> None:
    """Raise (and so abort the job under mpi4py) when a checked property does not hold."""
    if not condition:
        raise RuntimeError(f"rank {MPI.COMM_WORLD.Get_rank()}: CHECK FAILED: {message}")


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--shards", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--coordinator", action="store_true")
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--adagrad", action="store_true", help="Adagrad instead of SGD")
    p.add_argument("--transport", choices=["auto", "shared", "rma"], default="shared",
                   help="parameter-server transport (shared: fail unless it is used; auto: "
                   "let open_parameter_server choose, as downpour does, from "
                   "$DISTBELIEF_PS_TRANSPORT or else by itself)")
    return p


def open_server(args: argparse.Namespace, initial: np.ndarray | None = None
                ) -> tuple[Topology, ParameterServerShard | ParameterClient]:
    """Topology from COMM_WORLD and the parameter server (collective); SGD, or Adagrad
    with --adagrad, at --lr, on the --transport asked for."""
    world = MPI.COMM_WORLD
    topology = Topology(world.Get_size(), world.Get_rank(), args.shards,
                        coordinator=args.coordinator)
    transport = None if args.transport == "auto" else args.transport
    endpoint = open_parameter_server(world, ServerSpec(
        topology, args.size, lambda n: make_optimizer(args.adagrad, args.lr, n), initial,
        pieces=getattr(args, "pieces", False)), transport=transport)
    return topology, endpoint


def say(*parts: object) -> None:
    print(*parts, flush=True)
    sys.stdout.flush()
