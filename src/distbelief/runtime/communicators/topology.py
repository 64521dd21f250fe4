"""Which rank does what: parameter-server shards, an optional coordinator, model replicas.

The ranks of the job's communicator (`place_shards`) are laid out in blocks, so that job
scripts can place them (for example the shards on their own nodes):

    0 .. S-1                      parameter-server shards
    S                             the coordinator (Sandblaster L-BFGS), only if configured
    first_replica + r*P + p       partition p of model replica r
    first_replica + (R+j)*P + p   partition p of spare j (cluster.spare_replicas = k)

where S = ps_shards, P = partitions (ranks per replica), first_replica = S + (1 if a
coordinator else 0), and the last k of the R + k replica groups are spares, which train
only once one takes over a lost replica's part (Downpour). A spare j is replica group
R + j: `replica_index` and `replica_ranks` count the spares after the replicas. S = 0 for the algorithms that keep no parameters on shards (sync
without backup workers, averaging without EASGD, hogwild): every rank is a replica. Shard
s is world rank s, which is also its rank in every window created over the world
communicator.

`Topology` and `validate_rank_count` are pure: they take integers and never communicate,
so every rank raises the same `ConfigError` before the first collective when the rank
count does not fit. `split_communicators` is the one collective step that builds the
sub-communicators.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mpi4py import MPI

from distbelief.errors import ConfigError
from distbelief.runtime.communicators.nodes import Nodes, node_split
from distbelief.runtime.communicators.placement import spread_order

ROLE_SHARD = "shard"
ROLE_COORDINATOR = "coordinator"
ROLE_REPLICA = "replica"


def validate_rank_count(world_size: int, ps_shards: int, partitions: int = 1,
                        coordinator: bool = False, spares: int = 0) -> int:
    """Check that `world_size` ranks fit the configuration; return the number of replica
    groups (training replicas and `spares` spares).

    Pure (no communication). Raises ConfigError naming the numbers and how to fix them.
    """
    if ps_shards < 0:
        raise ConfigError(f"ps_shards must be at least 0, got {ps_shards}")
    if partitions < 1:
        raise ConfigError(f"partitions must be at least 1, got {partitions}")
    fixed = ps_shards + (1 if coordinator else 0)
    what = f"{ps_shards} parameter-server shard(s)" + (" + 1 coordinator" if coordinator else "")
    left = world_size - fixed
    if left < partitions:
        raise ConfigError(
            f"{world_size} MPI rank(s) leave {max(left, 0)} for model replicas after {what}; "
            f"one replica needs {partitions} rank(s) (partitions={partitions}). Run with at "
            f"least {fixed + partitions} ranks (mpiexec -n {fixed + partitions})"
            + (" or lower ps_shards." if ps_shards else "."))
    if left % partitions:
        lower = fixed + (left // partitions) * partitions
        raise ConfigError(
            f"{world_size} MPI ranks leave {left} for model replicas after {what}, which is "
            f"not a multiple of partitions={partitions}. Run with {lower} or "
            f"{lower + partitions} ranks.")
    if spares < 0:
        raise ConfigError(f"spare_replicas must be at least 0, got {spares}")
    groups = left // partitions
    if groups - spares < 1:
        need = fixed + (spares + 1) * partitions
        raise ConfigError(
            f"{world_size} MPI rank(s) leave {groups} replica group(s) of {partitions} "
            f"rank(s) after {what}, but cluster.spare_replicas = {spares} holds back "
            f"{spares} of them as spares and at least one must train: run with at least "
            f"{need} ranks (mpiexec -n {need}) or fewer spares.")
    return groups


@dataclass(frozen=True)
class Topology:
    """The role of one rank in a job of `world_size` ranks. Pure; validated on creation."""

    world_size: int
    world_rank: int
    ps_shards: int
    partitions: int = 1
    coordinator: bool = False
    spares: int = 0  # cluster.spare_replicas: the last replica groups, held in reserve

    def __post_init__(self) -> None:
        validate_rank_count(self.world_size, self.ps_shards, self.partitions, self.coordinator,
                            self.spares)
        if not 0 <= self.world_rank < self.world_size:
            raise ConfigError(f"rank {self.world_rank} outside a world of {self.world_size}")

    @property
    def num_groups(self) -> int:
        """Replica groups: the training replicas, then the spares."""
        return (self.world_size - self.first_replica_rank) // self.partitions

    @property
    def num_replicas(self) -> int:
        """The training replicas (R): the training data is split over these alone."""
        return self.num_groups - self.spares

    @property
    def is_spare(self) -> bool:
        """A rank of a spare replica group (it trains only once it takes a part over)."""
        index = self.replica_index
        return index is not None and index >= self.num_replicas

    @property
    def coordinator_rank(self) -> int | None:
        return self.ps_shards if self.coordinator else None

    @property
    def first_replica_rank(self) -> int:
        return self.ps_shards + (1 if self.coordinator else 0)

    @property
    def shard_ranks(self) -> range:
        """World ranks of the shards; shard s is world rank s."""
        return range(self.ps_shards)

    @property
    def role(self) -> str:
        if self.world_rank < self.ps_shards:
            return ROLE_SHARD
        if self.world_rank == self.coordinator_rank:
            return ROLE_COORDINATOR
        return ROLE_REPLICA

    @property
    def is_shard(self) -> bool:
        return self.role == ROLE_SHARD

    @property
    def is_replica(self) -> bool:
        return self.role == ROLE_REPLICA

    @property
    def shard_index(self) -> int | None:
        return self.world_rank if self.is_shard else None

    @property
    def replica_index(self) -> int | None:
        if not self.is_replica:
            return None
        return (self.world_rank - self.first_replica_rank) // self.partitions

    @property
    def partition_index(self) -> int | None:
        if not self.is_replica:
            return None
        return (self.world_rank - self.first_replica_rank) % self.partitions

    def replica_ranks(self, replica: int) -> range:
        """World ranks of the partitions of replica group `replica` (a spare's: R + j), in
        partition order."""
        if not 0 <= replica < self.num_groups:
            raise ValueError(f"replica {replica} outside 0..{self.num_groups - 1}")
        start = self.first_replica_rank + replica * self.partitions
        return range(start, start + self.partitions)

    def describe_rank(self, rank: int) -> str:
        """'rank 3 (replica 1)', 'rank 0 (shard 0)' and the like, for messages."""
        if rank < self.ps_shards:
            return f"rank {rank} (shard {rank})"
        if rank == self.coordinator_rank:
            return f"rank {rank} (coordinator)"
        replica, partition = divmod(rank - self.first_replica_rank, self.partitions)
        part = f", partition {partition}" if self.partitions > 1 else ""
        if replica >= self.num_replicas:
            return f"rank {rank} (spare {replica - self.num_replicas}{part})"
        return f"rank {rank} (replica {replica}{part})"

    def describe(self) -> str:
        """One line for logs: the whole layout, the same on every rank."""
        coord = f", coordinator rank {self.coordinator_rank}" if self.coordinator else ""
        shards = f"shards 0..{self.ps_shards - 1}" if self.ps_shards else "no shards"
        spares = f" + {self.spares} spare(s)" if self.spares else ""
        return (f"{self.world_size} ranks: {shards}{coord}, "
                f"{self.num_replicas} replica(s){spares} x {self.partitions} partition(s) "
                f"from rank {self.first_replica_rank}")


@dataclass
class Communicators:
    """Sub-communicators of one rank; COMM_NULL where the rank has no part in one.

    shards: all shard ranks (checkpoints; they keep working when a replica fails).
    replicas: all replica ranks, every partition of every replica.
    partition: the partitions of this rank's replica (activation exchange).
    """

    shards: MPI.Comm
    replicas: MPI.Comm
    partition: MPI.Comm

    def free(self) -> None:
        """Free the communicators. Collective over each of them (MPI_Comm_free)."""
        for name in ("partition", "replicas", "shards"):
            comm = getattr(self, name)
            if comm != MPI.COMM_NULL:
                comm.Free()
            setattr(self, name, MPI.COMM_NULL)


def split_communicators(comm_world: MPI.Comm, topology: Topology) -> Communicators:
    """Split `comm_world` into the shards', replicas' and this replica's partition communicator.

    Collective over `comm_world`: every rank calls it, whatever its role, with the same
    topology (two Comm.Split calls, in the same order everywhere). The rank order inside
    each new communicator follows the world rank.
    """
    if comm_world.Get_size() != topology.world_size or comm_world.Get_rank() != topology.world_rank:
        raise ConfigError(
            f"topology is for rank {topology.world_rank} of {topology.world_size}, but the "
            f"communicator has rank {comm_world.Get_rank()} of {comm_world.Get_size()}")
    # The coordinator is alone in its role, so it takes part with MPI.UNDEFINED and gets
    # COMM_NULL rather than a one-rank communicator it would have to free.
    role_color = {ROLE_SHARD: 0, ROLE_COORDINATOR: MPI.UNDEFINED, ROLE_REPLICA: 1}[topology.role]
    by_role = comm_world.Split(role_color, topology.world_rank)
    replica = topology.replica_index
    partition = comm_world.Split(MPI.UNDEFINED if replica is None else replica,
                                 topology.world_rank)
    return Communicators(shards=by_role if topology.is_shard else MPI.COMM_NULL,
                         replicas=by_role if topology.is_replica else MPI.COMM_NULL,
                         partition=partition)


def world_ranks(comm: MPI.Comm, ranks: Sequence[int]) -> list[int]:
    """The COMM_WORLD ranks of `comm`'s ranks `ranks`. Local."""
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return [int(r) for r in group.Translate_ranks(list(ranks), world)]
    finally:
        group.Free()
        world.Free()



def place_shards(world: MPI.Comm, ps_shards: int, placement: str = "spread",
                 ) -> tuple[MPI.Comm, Nodes]:
    """The job's communicator: `world` with the shards spread over the nodes (placement
    "spread"; "ranks" keeps the world's order), and the world's node split. Collective
    over `world` (node_split, then a Comm.Split when the order changes). The caller frees a
    new communicator.

    "spread" (cluster.shard_placement's default): shard s is the first unused rank of node
    s % N, dealt round-robin, and every other rank keeps its world order. srun's default
    block placement would otherwise put every shard on the first node, whose network card
    would then carry every replica's pushes and pulls. "ranks" is for job scripts that
    place the shards themselves. On one node the two are the same."""
    nodes = node_split(world)
    order = (spread_order(nodes.node_of, ps_shards) if placement == "spread"
             else list(range(world.Get_size())))
    if order == list(range(world.Get_size())):
        return world, nodes
    return world.Split(0, key=order.index(world.Get_rank())), nodes


def describe_shard_nodes(job: MPI.Comm, ps_shards: int, nodes: Nodes) -> str:
    """'shard 0: node 0 (MPI rank 0), shard 1: node 1 (MPI rank 16)', for the job's log:
    which node holds which shard (shard s is the job's rank s). `nodes` is the world's
    split (place_shards'). Local."""
    world = world_ranks(job, list(range(ps_shards)))
    return ", ".join(f"shard {s}: node {nodes.node_of[w]} (MPI rank {w})"
                     for s, w in enumerate(world))
