"""Will this job fit? Each rank's predicted memory (distbelief.model.memory_model) for the
configured layout, against what its node offers (distbelief.runtime.memory), checked by
`train` before anything is set up; a layout that needs more is refused on every rank at
once, naming the largest role and a layout that fits. `distbelief costmodel` (costmodel)
prints the same prediction with the step time (print_layouts) and plans a layout
(print_plan). docs/performance.md, "Memory per rank".
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from distbelief.algorithms import registry
from distbelief.config import Config, build_optimizer
from distbelief.errors import ConfigError
from distbelief.model.memory_model import (
    RoleMemory,
    Workload,
    largest,
    predict_memory,
)
from distbelief.runtime.communicators.placement import spread_order
from distbelief.runtime.launching.launcher import world_rank
from distbelief.runtime.memory import node_memory_bytes

GB = 2**30


@dataclass(frozen=True)
class Layout:
    """S parameter-server shards, R replicas of P partitions each (and `extra` ranks: a
    coordinator), and `spares` spare replicas beyond the R (cluster.spare_replicas: each
    planned as a replica, which it becomes when it takes a lost one's part over)."""

    shards: int
    replicas: int
    partitions: int
    extra: int = 0
    spares: int = 0

    @property
    def ranks(self) -> int:
        return self.shards + self.extra + (self.replicas + self.spares) * self.partitions

    def describe(self) -> str:
        shards = f"{self.shards} shard(s) + " if self.shards else ""
        spares = f" + {self.spares} spare(s)" if self.spares else ""
        parts = f" x {self.partitions} partitions" if self.partitions > 1 else ""
        return f"{shards}{self.replicas} replica(s){spares}{parts}"


def layout_of(config: Config, world_size: int) -> Layout | None:
    """The layout `world_size` ranks give this configuration (no shards for the algorithms
    that keep none); None when they do not make one, which the trainer's own checks then
    report in their words. Pure."""
    algorithm = registry.get(config.optimizer.algorithm)
    shards = config.cluster.ps_shards if algorithm.needs_shards(vars(config.optimizer)) else 0
    partitions = config.cluster.partitions
    extra = algorithm.coordinators
    left = world_size - shards - extra
    spares = config.cluster.spare_replicas
    if left < partitions or left % partitions or left // partitions <= spares:
        return None
    return Layout(shards, left // partitions - spares, partitions, extra, spares)


def workload(config: Config, info: Any, transport: str) -> Workload:
    """What the configuration puts in memory besides the layout."""
    opt = config.optimizer
    # The shards' state arrays: those of the rule the algorithm says its shards run
    # (asynchronous DiLoCo's: the outer optimizer), else optimizer.update's.
    build_rule = registry.get(opt.algorithm).load_shard_rule() or build_optimizer
    state = len(build_rule(config, 1).state())
    # A row as a shard holds it (sparse: its average entries' bytes), and 8 for its target.
    per_row = info.stored_row_bytes + 8
    rows = info.n_train if config.data.in_memory else (config.data.stream_memory_mb << 20) // per_row
    eval_rows = config.run.eval_samples or info.n_test
    run = config.run
    copies = run.checkpoint_in_background and bool(run.checkpoint_every_seconds
                                                    or run.checkpoint_every_steps)
    return Workload(batch=config.data.batch_size, state_arrays=state, transport=transport,
                    row_ids=row_ids(config, info), n_fetch=opt.n_fetch,
                    push_bytes=2 if opt.push_dtype == "bfloat16" else 4, n_push=opt.n_push,
                    overlapped=opt.fetch == "overlapped", train_rows=rows, row_bytes=per_row,
                    eval_rows=min(eval_rows, info.n_test or eval_rows),
                    checkpoint_copy=copies,
                    input_values=0 if info.features == "dense" else -(-info.input_row_bytes // 4))


def row_ids(config: Config, info: Any) -> tuple[float, ...]:
    """Each table's ids a sample reads, for a sparse model whose replicas move their
    batches' rows (optimizer.table_pulls = "rows", Downpour's): one per field of an id
    matrix, a row's average entries for CSR features; () otherwise."""
    from distbelief.model.sparse_network import is_sparse

    # Only Downpour's own replicas move rows (downpour.plan._row_pulls): every other
    # algorithm's replicas hold the whole vector, whatever table_pulls says.
    if (config.optimizer.algorithm != "downpour"
            or getattr(config.optimizer, "table_pulls", "whole") != "rows"
            or not is_sparse(config.model.layers)):
        return ()
    if info.features == "ids":
        return (1.0,) * len(info.id_rows)
    if info.features == "sparse":
        return (float(info.nnz_per_row),)
    return ()


def rank_roles(roles: list[RoleMemory]) -> list[RoleMemory]:
    """One entry per world rank, in rank order (shards first, then replicas)."""
    return [role for role in roles for _ in range(role.count)]


def node_need(roles: list[RoleMemory], node_of: list[int]) -> dict[int, int]:
    """Bytes each node needs, its ranks' predictions summed."""
    need: dict[int, int] = {}
    for role, node in zip(rank_roles(roles), node_of, strict=False):
        need[node] = need.get(node, 0) + role.bytes
    return need


def block_nodes(ranks: int, per_node: int) -> list[int]:
    """Node of each rank when ranks fill nodes in order (srun's and mpiexec's default)."""
    return [r // max(per_node, 1) for r in range(ranks)]


def placed_nodes(ranks: int, per_node: int, shards: int) -> list[int]:
    """Node of each of the job's ranks (shards first) when the launcher fills nodes in
    order and the shards are then dealt round-robin over them (cluster.shard_placement
    = "spread", the default: distbelief.runtime.communicators.placement)."""
    block = block_nodes(ranks, per_node)
    return [block[world] for world in spread_order(block, shards)]


def fits(network: Any, layout: Layout, work: Workload, node_bytes: int,
         per_node: int) -> bool:
    """Whether every node of `layout`, `per_node` ranks each with the shards spread over
    them, needs at most `node_bytes`."""
    roles = predict_memory(network, layout.shards, layout.replicas, layout.partitions, work,
                           layout.spares)
    node_of = placed_nodes(layout.ranks, per_node, layout.shards)
    return max(node_need(roles, node_of).values()) <= node_bytes


def suggest_layout(network: Any, current: Layout, work: Workload, node_bytes: int,
                   per_node: int, nodes: int) -> Layout | None:
    """A layout that fits nodes of `node_bytes`, `per_node` ranks each: first one of the
    same number of ranks (more shards make each slice smaller, more partitions each
    replica), else one on more nodes; the most replicas first, then the fewest shards.
    None when nothing on up to 8x the nodes fits."""
    widest = _widest(network)
    for node_count in range(nodes, 8 * nodes + 1):
        ranks = current.ranks if node_count == nodes else per_node * node_count
        shard_counts = [0] if not current.shards else sorted(
            {s for s in (*range(1, 17), *(2**k for k in range(5, 20))) if s < ranks})
        candidates = []
        for shards in shard_counts:
            left = ranks - shards - current.extra
            for partitions in (p for p in range(1, min(left, widest, 64) + 1)
                               if left % p == 0 and left // p > current.spares):
                layout = Layout(shards, left // partitions - current.spares, partitions,
                                current.extra, current.spares)
                if fits(network, layout, work, node_bytes, per_node):
                    candidates.append(layout)
        if candidates:
            return max(candidates, key=lambda c: (c.replicas, -c.shards, -c.partitions))
    return None


def _widest(network: Any) -> int:
    """The most partitions a replica of `network` may have: its widest layer's split
    units, or 1 with a layer model parallelism does not split (conv, dropout, layernorm)
    or none at all (a model of one's own, which is one piece)."""
    from distbelief.model.partition import UNSPLIT, split_units

    if not network.layers or any(type(layer) in UNSPLIT for layer in network.layers):
        return 1
    return max(split_units(layer) for layer in network.layers)


def refusal(network: Any, layout: Layout, work: Workload, node_of: list[int], node: int,
            node_bytes: int, source: str) -> str | None:
    """The error when node `node` of this job (its ranks: node_of) needs more than its
    `node_bytes`; None when it fits."""
    roles = predict_memory(network, layout.shards, layout.replicas, layout.partitions, work,
                           layout.spares)
    bytes_needed = node_need(roles, node_of).get(node, 0)
    if bytes_needed <= node_bytes:
        return None
    big = largest(roles)
    parts = ", ".join(f"{name} {size / GB:.2f}" for name, size in
                      sorted(big.parts.items(), key=lambda item: -item[1])[:3])
    nodes = max(node_of) + 1
    per_node = max(node_of.count(n) for n in range(nodes))
    better = suggest_layout(network, layout, work, node_bytes, per_node, nodes)
    if better is None:
        advice = ("No layout on up to 8 times the nodes fits: use nodes with more memory "
                  "or a smaller model")
    else:
        more = -(-better.ranks // per_node)
        where = f" on {more} nodes of {per_node} ranks" if more > nodes else ""
        advice = (f"A layout that fits: {better.describe()}, {better.ranks} ranks{where} "
                  f"(--set cluster.ps_shards={better.shards} --set cluster.partitions="
                  f"{better.partitions}, mpiexec -n {better.ranks})")
    return (f"this layout ({layout.describe()}, {work.transport} transport) needs "
            f"{bytes_needed / GB:.2f} GB on node {node} ({node_of.count(node)} rank(s)), "
            f"which has {node_bytes / GB:.2f} GB ({source}). The largest role is "
            f"{big.role}: {big.bytes / GB:.2f} GB per rank ({parts} GB). {advice}. Each "
            f"role's prediction: distbelief costmodel CONFIG --layouts "
            f"{layout.shards}:{layout.replicas}:{layout.partitions}; "
            f"DISTBELIEF_NODE_MEMORY=SIZE overrides the node's figure")


def check_memory(config: Config, info: Any, network: Any, world_size: int,
                 node_of: list[int], node: int,
                 environ: dict[str, str] | None = None) -> list[int] | None:
    """ConfigError when node `node` (this rank's) would need more memory than it has; else
    each rank's predicted bytes, in rank order (None when its ranks make no layout, or
    have a coordinator, which the formulas do not place). Pure but for reading this
    node's memory figure; the caller makes every rank agree."""
    node_bytes, source = node_memory_bytes(environ)
    requested = (environ if environ is not None else os.environ).get(
        "DISTBELIEF_PS_TRANSPORT", "") or "auto"
    one_node = max(node_of) == 0
    transport = "shared" if requested == "shared" or (requested == "auto" and one_node) \
        else "rma"
    layout = layout_of(config, world_size)
    if layout is None:
        return None
    work = workload(config, info, transport)
    if node_bytes is not None:
        message = refusal(network, layout, work, node_of, node, node_bytes, source)
        if message is not None:
            raise ConfigError(message)
    roles = predict_memory(network, layout.shards, layout.replicas, layout.partitions, work,
                           layout.spares)
    per_rank = [role.bytes for role in rank_roles(roles)]
    return None if layout.extra or len(per_rank) != world_size else per_rank


def costmodel_workload(config: Config, info: Any, transport: str) -> Workload:
    """`workload`, also for a network given without its data file (info None)."""
    if info is None:  # no data file: the batch and the optimizer, no data or eval set
        base = workload(config, _NoData(), transport)
        return Workload(**{**vars(base), "train_rows": 0, "eval_rows": 0})
    return workload(config, info, transport)


class _NoData:
    stored_dtype, input_shape, n_train, n_test = "float32", (1,), 0, 0
    features, stored_row_bytes, input_row_bytes = "dense", 4, 4


def print_layouts(layouts: Any, transport: str, config: Config, info: Any, network: Any,
                  batch: int, machine: Any, node_bytes: int | None) -> None:
    """`distbelief costmodel --layouts`: each S:R:P layout's step time and memory."""
    from distbelief.model.cost_model import format_layouts, predict_layout
    from distbelief.model.memory_model import format_memory

    work = costmodel_workload(config, info, transport)
    predictions, memory, tables = [], [], []
    # Spares (cluster.spare_replicas) train nothing until they replace a lost replica: R
    # sets the throughput; each holds a replica's memory (once it has taken a part over).
    spares = config.cluster.spare_replicas
    for shards, replicas, partitions in layouts:
        predictions.append(predict_layout(network, shards, replicas, partitions, batch,
                                          machine, transport))
        roles = predict_memory(network, shards, replicas, partitions, work, spares)
        total = sum(r.bytes * r.count for r in roles)
        big = largest(roles)
        mark = "" if node_bytes is None else (" fits" if total <= node_bytes
                                              else " does not fit")
        memory.append(f"{big.role} {big.bytes / 2**20:,.0f} MB, all {total / 2**20:,.0f} MB"
                      f"{mark}")
        plus = f" + {spares} spare(s)" if spares else ""
        tables.append(f"{shards} x {replicas}{plus} x {partitions} ({transport}):\n"
                      + format_memory(roles))
    print(format_layouts(predictions, memory))
    print("\nmemory per rank (MB; one node holds them all" +
          ("" if node_bytes is None else f", {node_bytes / 2**30:.1f} GB") + "):")
    print("\n\n".join(tables))


def print_plan(nodes: int, cores: int | None, bandwidth: float, transport: str,
               config: Config, info: Any, network: Any, batch: int, machine: Any,
               node_bytes: int | None) -> int:
    """`distbelief costmodel --plan`: the fastest layouts of `nodes` x `cores` ranks that
    fit nodes of `node_bytes`; the exit status (1: none fits)."""
    from dataclasses import replace

    from distbelief.model.cost_model import format_layouts, predict_layout
    if cores is None or node_bytes is None:
        raise ConfigError("--plan needs --cores (ranks per node) and --memory (bytes per "
                          "node), as well as --nodes and --bandwidth")
    per_node = cores
    ranks = nodes * per_node
    transport = "shared" if nodes == 1 and transport == "shared" else "rma"
    work = costmodel_workload(config, info, transport)
    # One rank per core: the node's link is shared by its ranks, no cores are shared.
    link = replace(machine.link, bandwidth=machine.link.bandwidth / per_node)
    machine = replace(machine, link=link, cores=0)
    widest = _widest(network)
    found = []
    for shards in range(1, max(2, ranks // 2 + 1)):
        for partitions in range(1, min(widest, ranks - shards) + 1):
            replicas = (ranks - shards) // partitions
            if replicas < 1:
                continue
            layout = Layout(shards, replicas, partitions)
            if not fits(network, layout, work, node_bytes, per_node):
                continue
            found.append(predict_layout(network, shards, replicas, partitions, batch,
                                        machine, transport))
    if not found:
        print(f"no layout of {ranks} ranks fits nodes of {node_bytes / 2**30:.1f} GB: "
              f"use more nodes or nodes with more memory")
        return 1
    found.sort(key=lambda p: -p.samples_per_second)
    best = found[0]
    print(f"plan for {nodes} node(s) x {per_node} ranks, {node_bytes / 2**30:.1f} GB and "
          f"{bandwidth:g} GB/s each ({transport} transport); the fastest layouts that "
          f"fit:")
    print(format_layouts(found[:8]))
    print(f"suggested: {best.shards} shard(s) + {best.replicas} replica(s) x "
          f"{best.partitions} partition(s) = {best.shards + best.replicas * best.partitions}"
          f" ranks: --set cluster.ps_shards={best.shards} --set cluster.partitions="
          f"{best.partitions}")
    return 0


def costmodel(config_path: str, *, partitions: Sequence[int],
              layouts: Sequence[tuple[int, int, int]], plan: bool, nodes: int,
              cores: int | None, memory: str | None, measure: bool, gflops: float,
              bandwidth: float, latency: float, message_us: float, half_width: float,
              fold_rate: float, transport: str, batch: int | None,
              input_shape: tuple[int, ...] | None, classes: int | None) -> int:
    """`distbelief costmodel` (its --help says what each argument is): print the
    predictions for the configuration at `config_path`; the exit status (print_plan's).
    With --measure under mpiexec, collective over COMM_WORLD (the Put and Get timed
    between two processes); rank 0 prints."""
    from distbelief.config import build_network, load_config
    from distbelief.model.cost_model import Link, Machine, format_table, predict
    from distbelief.model.network import Network

    config = load_config(config_path, check_data=False)
    if (input_shape is None) != (classes is None):
        raise ConfigError("give --input-shape and --classes together, or neither (then "
                          "the data file's are used)")
    info = None
    if input_shape is not None:
        from distbelief.model.losses import make_loss

        network = Network(input_shape, [dict(layer) for layer in config.model.layers], classes,
                          loss=make_loss(config.model.loss, classes))
    else:
        from distbelief.data.hdf5 import open_dataset

        info = open_dataset(config.data.path, labels=False)
        network = build_network(config, info)
    batch = batch or config.data.batch_size
    if measure:
        from distbelief.model import calibrate

        measured = calibrate.measure(network, batch)
        machine = measured.machine(message_us * 1e-6, cores or os.cpu_count() or 1)
        figures = measured.describe()
    else:
        machine = Machine(gflops * 1e9, Link(bandwidth * 1e9, latency * 1e-6, message_us * 1e-6),
                          fold_rate * 1e9, half_width, cores or 0)
        figures = (f"per rank {gflops:g} GFLOP/s, link {bandwidth:g} GB/s, "
                   f"{latency:g} us + {message_us:g} us per message, fold "
                   f"{fold_rate:g} Gparam/s")
    if world_rank() != 0:
        return 0
    print(f"{network.layout.size:,d} parameters, batch {batch}; {figures}"
          + (f"; half-speed block {machine.half_width:g} units" if machine.half_width
             and not measure else ""))
    node_bytes = _node_bytes(memory)
    if plan:
        return print_plan(nodes, cores, bandwidth, transport, config, info, network, batch,
                          machine, node_bytes)
    if layouts:
        print_layouts(layouts, transport, config, info, network, batch, machine, node_bytes)
        return 0
    try:
        predictions = [predict(network, p, batch, machine.flops, machine.link,
                               machine.half_width) for p in partitions]
    except ValueError as e:
        raise ConfigError(f"--partitions: {e}") from e
    print(format_table(predictions))
    return 0


def _node_bytes(text: str | None) -> int | None:
    from distbelief.runtime.memory import parse_size

    return None if text is None else parse_size(text)
