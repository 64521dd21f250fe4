"""A configuration that does not fit must fail on every rank before any communication.

Like the command line: each rank prints its ConfigError and exits with status 2. Run with
plain `python` (not `-m mpi4py`, whose abort on SystemExit could kill the other ranks
before they print): every rank must reach the error on its own, without communicating.
"""

import argparse
import sys

import numpy as np
from mpi4py import MPI

from distbelief.errors import EXIT_USER_ERROR, ConfigError
from distbelief.model.optimizers import ShardRule
from distbelief.ps.endpoint import ServerSpec
from distbelief.ps.transport import open_parameter_server
from distbelief.runtime.communicators.topology import Topology


class CopiedState(ShardRule):
    """An update rule whose state is a fresh copy, held in no attribute of its name: it
    cannot live in shared memory (the "shared" transport refuses it on every rank)."""

    def state(self) -> dict[str, np.ndarray]:
        return {"copy": np.zeros(1, dtype=np.float32)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shards", type=int, required=True)
    p.add_argument("--size", type=int, default=100)
    p.add_argument("--partitions", type=int, default=1)
    args = p.parse_args()
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    try:
        topology = Topology(world.Get_size(), rank, args.shards, args.partitions)
        endpoint = open_parameter_server(world, ServerSpec(
            topology, args.size, lambda n: CopiedState(), np.zeros(args.size, dtype=np.float32)))
    except ConfigError as err:
        print(f"rank {rank}: ConfigError: {err}", flush=True)
        sys.exit(EXIT_USER_ERROR)
    endpoint.free()
    print(f"rank {rank}: configuration fits", flush=True)


if __name__ == "__main__":
    main()
