"""A reader stuck on a shard's buffer against a read-your-writes client, on the RMA
transport: client 0 pulls, sleeping `--sleep` seconds once registered on its buffer (as a
rank descheduled, stopped or swapped mid-pull), while every other client pushes and pulls
until the pull holds its push (push_pull_own, Downpour's default fetch). Prints the steps
each client made in `--seconds` and the shard's held publishes: with four publish buffers
the stuck reader held nobody back; with two it held every publish, and so every
read-your-writes client, until the shard learnt to rewrite its newest buffer in place
(rma_shard.STUCK_S; docs/performance.md, "Two publish buffers").

    mpiexec -n 3 python -m mpi4py benchmarks/bench_stuck_reader.py [--sleep 0.2] [--seconds 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from distbelief.model.optimizers import make_optimizer
from distbelief.ps import rma_windows
from distbelief.ps.endpoint import ParameterServerShard, ServerSpec
from distbelief.ps.transport import open_parameter_server
from distbelief.runtime.communicators.topology import Topology


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=669_706, help="parameters (1 shard)")
    p.add_argument("--sleep", type=float, default=0.2)
    p.add_argument("--seconds", type=float, default=2.0)
    args = p.parse_args()
    world = MPI.COMM_WORLD
    topology = Topology(world.Get_size(), world.Get_rank(), 1)
    endpoint = open_parameter_server(world, ServerSpec(
        topology, args.size, lambda n: make_optimizer(False, 1.0, n), None), transport="rma")
    if isinstance(endpoint, ParameterServerShard):
        endpoint.serve()
        print(f"shard: {endpoint.stats.holds} publish(es) held, "
              f"{getattr(endpoint, 'publishes_in_place', 0)} in place, "
              f"{endpoint.stats.folds} folds", flush=True)
    else:
        params = np.empty(args.size, dtype=np.float32)
        grad = np.full(args.size, -1, dtype=np.float32)
        me = topology.world_rank - 1
        if me == 0:
            issue = rma_windows.PublishedReader.issue_get

            def stuck(self, *a, **k):
                time.sleep(args.sleep)
                issue(self, *a, **k)

            rma_windows.PublishedReader.issue_get = stuck
        t0, steps = time.perf_counter(), 0
        while time.perf_counter() - t0 < args.seconds:
            if me == 0:
                endpoint.pull(params)
            else:
                endpoint.push_pull_own(grad, params)
            steps += 1
        print(f"client {me} ({'stuck reader' if me == 0 else 'read-your-writes'}): "
              f"{steps} steps in {args.seconds:g} s", flush=True)
        endpoint.finish()
    endpoint.free()


if __name__ == "__main__":
    main()
