"""Staleness in a controlled scenario: replica A pulls, replica B pushes `--updates` times,
each time waiting until the shards have applied it, then A pushes: every shard must report
a staleness of exactly `--updates` for A's push, and 0 for each of B's.

Then A pulls again (after its push is applied) and pushes once more, with push_pull:
staleness 0. Extra
replicas (world size > shards + 2) only pull, which must not change any count.
"""

import time

import numpy as np
from mpi4py import MPI
from ps_common import check, open_server, parser, say

from distbelief.ps.endpoint import ParameterClient, ParameterServerShard
from distbelief.runtime.communicators.topology import split_communicators


def wait_for_version(client: ParameterClient, params: np.ndarray, version: int) -> None:
    """Pull until every shard has applied `version` updates (polling, sleeping 1 ms)."""
    while not (client.pull(params) >= version).all():
        time.sleep(1e-3)
    check(bool((client.pulled_versions == version).all()),
          f"versions {client.pulled_versions}, expected exactly {version}")


def replica_a(client: ParameterClient, replicas: MPI.Comm, updates: int, size: int) -> None:
    params = np.empty(size, dtype=np.float32)
    grad = np.ones(size, dtype=np.float32)
    check(bool((client.pull(params) == 0).all()), "A's first pull must see version 0")
    replicas.send("pulled", dest=1)
    check(replicas.recv(source=1) == "pushed", "B's message")
    staleness = client.push(grad)
    check(bool((staleness == updates).all()), f"A's push: staleness {staleness}, "
          f"expected {updates} on every shard")
    wait_for_version(client, params, updates + 1)
    staleness, versions = client.push_pull(grad, params)
    check(bool((staleness == 0).all()), f"A's second push: staleness {staleness}, expected 0")
    check(bool((versions >= updates + 1).all()), f"push_pull pulled versions {versions}")
    shards = len(client.ranges)
    check(client.staleness.samples == 2 * shards and client.staleness.max == updates
          and client.staleness.mean == updates / 2, f"A's stats {client.staleness}")
    say(f"replica A: staleness {updates} then 0, as expected")


def replica_b(client: ParameterClient, replicas: MPI.Comm, updates: int, size: int) -> None:
    params = np.empty(size, dtype=np.float32)
    grad = np.ones(size, dtype=np.float32)
    check(replicas.recv(source=0) == "pulled", "A's message")
    for j in range(1, updates + 1):
        client.pull(params)
        staleness = client.push(grad)
        check(bool((staleness == 0).all()), f"B's push {j}: staleness {staleness}")
        wait_for_version(client, params, j)
    replicas.send("pushed", dest=0)
    say(f"replica B: {updates} pushes applied one at a time, staleness 0")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--updates", type=int, default=5)
    args = p.parse_args()
    topology, endpoint = open_server(args)
    comms = split_communicators(MPI.COMM_WORLD, topology)
    if isinstance(endpoint, ParameterServerShard):
        stats = endpoint.serve()
        check(stats.pushes == args.updates + 2 and endpoint.version == args.updates + 2,
              f"shard {endpoint.rank}: {stats.pushes} pushes in {endpoint.version} updates")
    elif topology.replica_index == 0:
        replica_a(endpoint, comms.replicas, args.updates, args.size)
    elif topology.replica_index == 1:
        replica_b(endpoint, comms.replicas, args.updates, args.size)
    else:
        endpoint.pull(np.empty(args.size, dtype=np.float32))
    endpoint.free()
    comms.free()


if __name__ == "__main__":
    main()
