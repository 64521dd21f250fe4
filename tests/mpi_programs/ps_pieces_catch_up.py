"""A pieces push to one shard, then a read-your-writes pull of pieces on another shard
alone (push_pull_own), as a row replica's batch of one row does when its next rows lie on
another shard: the pull must return once the shards it reads hold the client's pushes,
and a later pull that reads the first shard must see the push there. One client, SGD at
lr 1, so each pulled value is the initial one minus the gradients pushed to it.
"""

import numpy as np
from ps_common import check, open_server, parser, say

from distbelief.ps.endpoint import ParameterServerShard, PieceMap


def main() -> None:
    p = parser(__doc__)
    p.set_defaults(pieces=True)
    args = p.parse_args()
    initial = np.zeros(args.size, dtype=np.float32)
    _, endpoint = open_server(args, initial)
    if isinstance(endpoint, ParameterServerShard):
        endpoint.serve()
    else:
        first = PieceMap(np.array([[0, 4]]), endpoint.ranges)  # on shard 0 alone
        last = PieceMap(np.array([[args.size - 4, args.size]]), endpoint.ranges)  # shard 1
        check(first.shards == [0] and last.shards == [1], "each piece on one shard")
        compact = np.empty(4, dtype=np.float32)
        ones = np.ones(4, dtype=np.float32)
        for turn in range(3):
            endpoint.use_pieces(last, first)  # push to shard 0, pull from shard 1
            endpoint.push_pull_own(ones, compact)
            check(np.array_equal(compact, -turn * ones), f"shard 1's rows: {compact}")
            endpoint.use_pieces(first, last)  # push to shard 1, pull from shard 0
            endpoint.push_pull_own(ones, compact)
            check(np.array_equal(compact, -(turn + 1) * ones), f"shard 0's rows: {compact}")
        say("pulls of other shards' pieces returned with every push seen")
        endpoint.finish()
    endpoint.free()


if __name__ == "__main__":
    main()
