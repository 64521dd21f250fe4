"""An exception on one rank must end the whole job quickly with a non-zero status.

Run under `python -m mpi4py`, whose excepthook calls MPI_Abort. `--fail shard` raises on
shard 0 while it serves, `--fail replica` on the last replica after a few pushes; the
other ranks are then blocked in RMA calls or polling loops and would hang forever without
the abort.
"""

import numpy as np
from ps_common import open_server, parser, say

from distbelief.ps.endpoint import ParameterServerShard
from distbelief.runtime.launching import guardian


class Boom(RuntimeError):
    """The deliberate failure."""


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--fail", choices=["shard", "replica"], required=True)
    args = p.parse_args()
    topology, endpoint = open_server(args)
    last_replica = topology.world_size - 1
    if isinstance(endpoint, ParameterServerShard):
        polls = 0
        while not endpoint.finished:
            endpoint.serve_once()
            polls += 1
            if args.fail == "shard" and endpoint.rank == 0 and endpoint.stats.pushes >= 3:
                raise Boom(f"shard 0 fails on purpose after {endpoint.stats.pushes} pushes")
    else:
        grad = np.ones(args.size, dtype=np.float32)
        params = np.empty(args.size, dtype=np.float32)
        for step in range(10**9):  # only the abort ends this
            endpoint.push(grad)
            endpoint.pull(params)
            if args.fail == "replica" and topology.world_rank == last_replica and step == 5:
                raise Boom(f"rank {last_replica} fails on purpose at step {step}")
    say("unreachable")
    endpoint.free()


if __name__ == "__main__":
    try:
        main()
    except Boom:
        # What distbelief's own excepthook does before MPI_Abort (cli.main): leave a
        # cleaner behind for this node's shared-memory segments.
        guardian.clean_up_after_abort()
        raise
