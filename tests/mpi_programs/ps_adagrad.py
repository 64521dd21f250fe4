"""The shard's optimizer state lives on the shard and sees every push in order: one replica
pushes `--pushes` random gradients, each time waiting until the shards have applied it,
so each fold holds exactly one push; every shard must then hold bit for bit what the same
optimizer gives applied locally to its slice of those gradients in the same order (and,
for Adagrad, the same sum of squared gradients). Other replicas only pull.

With --pieces each push is a few pieces of the vector (ParameterClient.use_pieces, a
row-sharded sparse model's push; one push nearly the whole vector, which an RMA slot takes
in its values-in-place form), the gradient zero elsewhere; the other replicas pull pieces
and check them against the same local reference.
"""

import time

import numpy as np
from ps_common import check, open_server, parser, say

from distbelief.model.optimizers import make_optimizer
from distbelief.ps.endpoint import ParameterServerShard, PieceMap, piece_positions


def gradients(count: int, size: int, pieces: bool = False) -> list[np.ndarray]:
    rng = np.random.default_rng(1234)
    out = [rng.standard_normal(size, dtype=np.float32) for _ in range(count)]
    if pieces:
        for m, grad in enumerate(out):
            grad[np.setdiff1d(np.arange(size), piece_positions(pieces_of(m, size)))] = 0
    return out


def pieces_of(m: int, size: int) -> np.ndarray:
    """Push m's pieces: sorted, disjoint; push 1 is 9 elements of every 10 (too many
    pieces for an RMA slot's compact form: its values go in place)."""
    if m == 1:
        starts = np.arange(0, size - 10, 10)
        return np.stack([starts, starts + 9], axis=1)
    rng = np.random.default_rng(m)
    edges = np.unique(rng.integers(0, size, 60))
    return edges[: len(edges) // 2 * 2].reshape(-1, 2)


def local_reference(args, size: int, initial: np.ndarray) -> np.ndarray:
    reference = make_optimizer(args.adagrad, args.lr, size)
    expected = initial.copy()
    for grad in gradients(args.pushes, size, args.pieces):
        reference.step(expected, grad)
    return expected


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--pushes", type=int, default=10)
    p.add_argument("--pieces", action="store_true")
    args = p.parse_args()
    initial = np.linspace(-1, 1, args.size, dtype=np.float32)
    topology, endpoint = open_server(args, initial)
    if isinstance(endpoint, ParameterServerShard):
        endpoint.serve()
        reference = make_optimizer(args.adagrad, args.lr, endpoint.stop - endpoint.start)
        expected = initial[endpoint.start : endpoint.stop].copy()
        for grad in gradients(args.pushes, args.size, args.pieces):
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
        if args.pieces:
            pull = PieceMap(np.array([[5, 9], [args.size // 2, args.size // 2 + 7],
                                      [args.size - 2, args.size]]), endpoint.ranges)
            compact = np.empty(pull.size, dtype=np.float32)
        if topology.replica_index == 0:
            for m, grad in enumerate(gradients(args.pushes, args.size, args.pieces)):
                if args.pieces:
                    push = PieceMap(pieces_of(m, args.size), endpoint.ranges)
                    endpoint.use_pieces(pull, push)
                    endpoint.push(np.ascontiguousarray(grad[piece_positions(push.pieces)]))
                    while not (endpoint.pull(compact) == m + 1).all():
                        time.sleep(1e-3)
                else:
                    endpoint.push(grad)
                    while not (endpoint.pull(params) == m + 1).all():
                        time.sleep(1e-3)
        elif args.pieces:
            endpoint.use_pieces(pull, None)
            while not (endpoint.pull(compact) == args.pushes).all():
                time.sleep(1e-3)
            expected = local_reference(args, args.size, initial)
            check(np.array_equal(compact, expected[piece_positions(pull.pieces)]),
                  "pulled pieces differ from the local reference")
            say("pulled pieces match the local optimizer")
        else:
            endpoint.pull(params)
        endpoint.finish()
    endpoint.free()


if __name__ == "__main__":
    main()
