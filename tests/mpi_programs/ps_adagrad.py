"""The shard's optimizer state lives on the shard and sees every push in order: one replica
pushes `--pushes` random gradients, each time waiting until the shards have applied it,
so each fold holds exactly one push; every shard must then hold bit for bit what the same
optimizer gives applied locally to its slice of those gradients in the same order (and,
for Adagrad, the same sum of squared gradients). Other replicas only pull.
"""

import time

import numpy as np
from ps_common import check, open_server, parser, say

from distbelief.model.optimizers import make_optimizer
from distbelief.ps.endpoint import ParameterServerShard


def gradients(count: int, size: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1234)
    return [rng.standard_normal(size, dtype=np.float32) for _ in range(count)]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--pushes", type=int, default=10)
    args = p.parse_args()
    initial = np.linspace(-1, 1, args.size, dtype=np.float32)
    topology, endpoint = open_server(args, initial)
    if isinstance(endpoint, ParameterServerShard):
        endpoint.serve()
        reference = make_optimizer(args.adagrad, args.lr, endpoint.stop - endpoint.start)
        expected = initial[endpoint.start : endpoint.stop].copy()
        for grad in gradients(args.pushes, args.size):
            reference.step(expected, grad[endpoint.start : endpoint.stop])
        check(endpoint.version == args.pushes, f"{endpoint.version} updates, expected "
              f"{args.pushes} (one per push)")
        check(np.array_equal(endpoint.parameters(), expected),
              f"shard {endpoint.rank}: parameters differ from the local reference by up to "
              f"{np.abs(endpoint.parameters() - expected).max()}")
        for name, value in reference.state().items():
            check(np.array_equal(endpoint.optimizer.state()[name], value),
                  f"shard {endpoint.rank}: optimizer state {name!r} differs")
        say(f"shard {endpoint.rank} matches the local optimizer after {args.pushes} pushes")
    else:
        params = np.empty(args.size, dtype=np.float32)
        if topology.replica_index == 0:
            for m, grad in enumerate(gradients(args.pushes, args.size)):
                endpoint.push(grad)
                while not (endpoint.pull(params) == m + 1).all():
                    time.sleep(1e-3)
        else:
            endpoint.pull(params)
        endpoint.finish()
    endpoint.free()


if __name__ == "__main__":
    main()
