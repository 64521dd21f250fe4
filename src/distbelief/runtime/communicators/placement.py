"""Where the shards go among the nodes (cluster.shard_placement; runtime.communicators.topology
builds the job's communicator from it). Pure, with no MPI import, so the memory plan
can place a layout that has not started.
"""

from __future__ import annotations

from collections.abc import Sequence


def spread_order(node_of: Sequence[int], ps_shards: int) -> list[int]:
    """World ranks in the job's order: `ps_shards` shards dealt round-robin over the nodes
    (shard s is the next unused rank of node s % N, skipping a node with none left), then
    every other rank in world order. Pure; `node_of[r]` is world rank r's node."""
    queues = [[r for r, n in enumerate(node_of) if n == node]
              for node in range(max(node_of, default=-1) + 1)]
    shards: list[int] = []
    node = 0
    while len(shards) < min(ps_shards, len(node_of)):
        if queues[node]:
            shards.append(queues[node].pop(0))
        node = (node + 1) % len(queues)
    taken = set(shards)
    return shards + [r for r in range(len(node_of)) if r not in taken]
