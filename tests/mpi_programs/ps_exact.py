"""Exactness: K replicas push M exactly representable gradients each; with SGD every shard
must end with exactly initial - lr * (sum of all gradients): no push lost or applied twice.

Gradient m of replica r: ((r + 1) * (m + 1) + i % 7) / 16 at element i; initial parameters
(i % 5) / 4; lr a power of two. Every partial sum is a multiple of 1/32 far below 2**24, so
float32 arithmetic is exact in any order of accumulation and folding.
"""

import numpy as np
from ps_common import check, open_server, parser, say

from distbelief.ps.endpoint import ParameterServerShard


def gradient(replica: int, step: int, size: int) -> np.ndarray:
    i = np.arange(size)
    return (((replica + 1) * (step + 1) + i % 7) / 16).astype(np.float32)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--pushes", type=int, required=True)
    args = p.parse_args()
    initial = ((np.arange(args.size) % 5) / 4).astype(np.float32)
    topology, endpoint = open_server(args, initial)
    if isinstance(endpoint, ParameterServerShard):
        stats = endpoint.serve()
        total = sum(gradient(r, m, args.size).astype(np.float64)
                    for r in range(topology.num_replicas) for m in range(args.pushes))
        expected = (initial - args.lr * total)[endpoint.start : endpoint.stop]
        got = endpoint.parameters()
        bad = np.flatnonzero(got != expected)
        check(bad.size == 0, f"shard {endpoint.rank}: {bad.size} wrong parameters, first at "
              f"{bad[:3]}: got {got[bad[:3]]}, expected {expected[bad[:3]]}")
        want_pushes = topology.num_replicas * args.pushes
        check(stats.pushes == want_pushes, f"folded {stats.pushes} pushes, sent {want_pushes}")
        check(endpoint.version == stats.folds, f"version {endpoint.version} != folds")
        say(f"shard {endpoint.rank} exact: transport={stats.transport} "
            f"[{endpoint.start}, {endpoint.stop}) "
            f"pushes={stats.pushes} folds={stats.folds}")
    else:
        params = np.empty(args.size, dtype=np.float32)
        versions = endpoint.pull(params)
        # Only a lone replica's first pull is sure to come before any push (the
        # coordinator's may come after the replica's first pushes).
        check(np.array_equal(params, initial) or topology.num_replicas > 1
              or not topology.is_replica,
              "first pull of a lone replica must see the initial parameters")
        if topology.is_replica:
            spare = np.empty_like(params)
            in_flight = None  # an overlapped push's gradient must live until it completes
            for m in range(args.pushes):
                grad = gradient(topology.replica_index, m, args.size)
                # Six ways to push: alone, followed by a pull, with a pull in the same
                # rounds, followed by a pull that holds it (read-your-writes), and
                # overlapped (left in flight) with and without a pull; the next call,
                # whichever, completes an overlapped one.
                new = versions
                if m % 6 == 0:
                    staleness = endpoint.push(grad)
                elif m % 6 == 1:
                    staleness = endpoint.push(grad)
                    new = endpoint.pull(params)
                elif m % 6 == 2:
                    staleness, new = endpoint.push_pull(grad, params)
                elif m % 6 == 3:
                    staleness, _ = endpoint.push_pull_own(grad, params)
                    new = endpoint.pulled_versions.copy()
                else:
                    staleness, _ = endpoint.push_pull_overlapped(
                        grad, spare if m % 6 == 4 else None)
                    in_flight = grad
                    new = endpoint.pulled_versions.copy()
                check(bool((staleness >= 0).all()), f"negative staleness {staleness}")
                check(bool((new >= versions).all()), f"versions went back: {versions} {new}")
                versions = new
            say(f"replica {topology.replica_index} pushed {args.pushes}; staleness mean "
                f"{endpoint.staleness.mean:.2f} max {endpoint.staleness.max}")
            del in_flight
        endpoint.finish()  # completes an overlapped push left in flight
    endpoint.free()


if __name__ == "__main__":
    main()
