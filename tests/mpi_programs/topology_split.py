"""split_communicators: each rank checks the communicators it gets against the topology."""

import argparse

from mpi4py import MPI
from ps_common import check, say

from distbelief.runtime.communicators.topology import Topology, split_communicators


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shards", type=int, required=True)
    p.add_argument("--partitions", type=int, default=1)
    p.add_argument("--coordinator", action="store_true")
    args = p.parse_args()
    world = MPI.COMM_WORLD
    t = Topology(world.Get_size(), world.Get_rank(), args.shards, args.partitions,
                 args.coordinator)
    comms = split_communicators(world, t)
    null = MPI.COMM_NULL
    if t.is_shard:
        check(comms.shards.Get_size() == t.ps_shards, "shards communicator size")
        check(comms.shards.Get_rank() == t.shard_index, "shard rank order")
        check(comms.replicas == null and comms.partition == null, "shard in replica comms")
        # The shards' communicator works on its own: every shard contributes its index.
        total = comms.shards.allreduce(t.shard_index)
        check(total == sum(range(t.ps_shards)), f"allreduce over shards gave {total}")
    elif t.is_replica:
        check(comms.replicas.Get_size() == t.num_replicas * t.partitions, "replicas size")
        check(comms.partition.Get_size() == t.partitions, "partition size")
        check(comms.partition.Get_rank() == t.partition_index, "partition rank order")
        check(comms.shards == null, "replica in the shards' communicator")
        members = comms.partition.allgather(t.world_rank)
        check(members == list(t.replica_ranks(t.replica_index)), f"partition {members}")
    else:
        check(comms.shards == null and comms.replicas == null and comms.partition == null,
              "the coordinator belongs to no sub-communicator")
    say(f"rank {t.world_rank} {t.role} ok")
    comms.free()


if __name__ == "__main__":
    main()
