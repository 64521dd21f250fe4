"""One training run, set up: `train(config, comm, resume)` claims run.out_dir, looks for
a finished run, places the shards, checks that the layout fits the nodes' memory, runs the
configured trainer (algorithms.registry names it) and adds every rank's peak memory to the
summary. `distbelief train` parses its arguments and calls this.
"""

from __future__ import annotations

import sys
from typing import Any

from distbelief.algorithms import registry
from distbelief.errors import ConfigError
from distbelief.runtime.guardian import start_mpi


def train(config: Any, comm: Any, resume: str) -> dict[str, Any] | None:
    """Claim run.out_dir, dispatch to the configured trainer, give the folder back after
    the trainer's last write; the summary on the rank that wrote it."""
    algorithm = config.optimizer.algorithm
    if algorithm not in registry.names():
        raise ConfigError(f"optimizer.algorithm = {algorithm!r} has no trainer")
    one_process = registry.get(algorithm).in_one_process(config.cluster.partitions)
    if one_process and comm is not None and comm.Get_size() > 1:
        raise ConfigError(f"optimizer.algorithm = \"{algorithm}\" trains in one process, but "
                          f"{comm.Get_size()} MPI ranks were started; run it without "
                          f"mpiexec, or use algorithm = \"downpour\"")
    if comm is None and not one_process:
        comm = start_mpi()
    owner = _claim_run_dir(config, comm)
    try:
        finished = _finished_run(config, comm, resume)
        if finished is not None:
            return finished or None  # the old summary on rank 0, None elsewhere
        if not config.run.flush_subnormals:
            from distbelief.model.kernels import flush_subnormals

            flush_subnormals(False)
        # Not freed at the end: MPI_Comm_free is collective, and a lost rank never comes.
        return _dispatch(config, _place_shards(config, comm), resume)
    finally:
        if owner is not None:
            owner.release()


def _place_shards(config: Any, comm: Any) -> Any:
    """The job's communicator, with the shards on distinct nodes (cluster.shard_placement,
    distbelief.runtime.topology); `comm` itself on one node or without shards. Collective
    over `comm`; rank 0 says where the shards are when there are several nodes."""
    shards = config.cluster.ps_shards
    if comm is None or comm.Get_size() == 1 or shards == 0:
        return comm
    from distbelief.runtime.topology import describe_shard_nodes, place_shards

    job, nodes = place_shards(comm, shards, config.cluster.shard_placement)
    if nodes.count > 1 and comm.Get_rank() == 0:
        print(f"distbelief: {nodes.count} nodes; {describe_shard_nodes(job, shards, nodes)}"
              + (" (distbelief's rank r below is the job's: shard s is rank s)"
                 if job is not comm else ""), flush=True)
    return job


def _claim_run_dir(config: Any, comm: Any) -> Any:
    """Make this run the one live owner of run.out_dir (distbelief.runtime.ownership), before
    anything is written there. With several ranks rank 0 claims and a refusal is raised
    on every rank (collective over `comm`: agreement.agree). The Ownership on the rank
    that holds it, None elsewhere."""
    from distbelief.runtime.ownership import claim

    def claim_here() -> Any:
        owner = claim(config.run.out_dir, config.run.owner_timeout_seconds)
        if owner.took_over:
            print(f"distbelief: took run.out_dir over from a run taken for dead: "
                  f"{owner.took_over}", flush=True)
        return owner

    if comm is None or comm.Get_size() == 1:
        return claim_here()
    from distbelief.runtime.agreement import agree

    return agree(comm, lambda: claim_here() if comm.Get_rank() == 0 else None)


def _finished_run(config: Any, comm: Any, resume: str) -> dict[str, Any] | None:
    """The summary of a finished run that this rerun leaves untouched, on rank 0 ({} on the
    other ranks); None when there is training to do. Collective over `comm` (rank 0
    decides: distbelief.algorithms.common.finished_run)."""
    from distbelief.algorithms.common import finished_run, latest_checkpoint
    from distbelief.records.checkpoint import checkpoint_root

    rank = 0 if comm is None else comm.Get_rank()
    # Verified by every rank, each its share of the parts (latest_checkpoint).
    latest = None if resume == "fresh" else latest_checkpoint(
        checkpoint_root(config.run.out_dir), comm)
    summary = finished_run(config, resume, sys.stdout, latest) if rank == 0 else None
    if comm is None or comm.Get_size() == 1:
        return summary
    from distbelief.runtime.agreement import bcast_after_barrier

    done = bcast_after_barrier(comm, summary is not None)
    return (summary if rank == 0 else {}) if done else None


def _dispatch(config: Any, comm: Any, resume: str) -> dict[str, Any] | None:
    """Run the configured trainer (distbelief.algorithms.registry names it)."""
    from distbelief.algorithms.common import final_test

    algorithm = registry.get(config.optimizer.algorithm)
    trainer = algorithm.load_trainer(config.cluster.partitions, vars(config.optimizer))
    one_process = algorithm.in_one_process(config.cluster.partitions)
    predicted = _check_memory(config, None if one_process else comm)
    if one_process:
        summary = trainer(config, resume=resume)
        if summary is not None:
            summary = _with_peak_memory(config, summary,
                                        [_own_peak("the one process", predicted)])
    else:
        summary = trainer(config, comm, resume=resume)
        summary = _gather_peak_memory(config, algorithm, comm, summary, predicted)
    return None if summary is None else final_test(config, summary, sys.stdout)


def _check_memory(config: Any, comm: Any) -> int | None:
    """Refuse, on every rank at once, a layout whose predicted memory exceeds a node's
    (distbelief.algorithms.memory_plan); else return this rank's predicted bytes (None
    where the formulas do not say), for summary.json. Collective over `comm` when there is
    one (the node split, then an agreement); nothing is set up or written before it."""
    from distbelief.algorithms.memory_plan import check_memory
    from distbelief.config import build_network
    from distbelief.data.hdf5 import open_dataset, with_validation

    def check(node_of: list[int], node: int) -> Any:
        info = with_validation(open_dataset(config.data.path, labels=False),
                               config.data.validation)
        return check_memory(config, info, build_network(config, info),
                            1 if comm is None else comm.Get_size(), node_of, node)

    if comm is None:
        prediction = check([0], 0)
        return None if prediction is None else prediction[0]
    from distbelief.runtime.agreement import agree
    from distbelief.runtime.nodes import node_split

    nodes = node_split(comm)
    prediction = agree(comm, lambda: check(list(nodes.node_of), nodes.node_of[nodes.me]))
    return None if prediction is None else prediction[comm.Get_rank()]


def _own_peak(role: str, predicted: int | None) -> dict[str, Any]:
    from distbelief.runtime.memory import rank_figure

    return rank_figure(0, role, predicted)


def _gather_peak_memory(config: Any, algorithm: Any, comm: Any,
                        summary: dict[str, Any] | None,
                        predicted: int | None) -> dict[str, Any] | None:
    """Every rank's peak RSS, named by its role, with its prediction (`predicted`: this
    rank's bytes), into the summary on the rank that wrote it (point-to-point, waiting a
    bounded time: runtime.memory.gather_peak_rss)."""
    from distbelief.runtime.memory import gather_peak_rss
    from distbelief.runtime.topology import Topology

    shards = config.cluster.ps_shards if algorithm.needs_shards(vars(config.optimizer)) else 0
    topology = Topology(comm.Get_size(), comm.Get_rank(), shards, config.cluster.partitions,
                        coordinator=algorithm.coordinators > 0)
    writer = topology.coordinator_rank if topology.coordinator else 0
    role = topology.describe_rank(topology.world_rank).partition("(")[2].rstrip(")")
    lost = [rank for entry in (summary or {}).get("lost_replicas", [])
            if isinstance(entry, dict) for rank in entry.get("ranks", [])]
    figures = gather_peak_rss(comm, writer, role, skip=lost, predicted=predicted)
    if summary is None or figures is None:
        return summary
    return _with_peak_memory(config, summary, figures)


def _with_peak_memory(config: Any, summary: dict[str, Any],
                      figures: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json rewritten with `peak_rss` (each rank's figure) and the largest, and
    `control_plane`: each rank's counters of file and one-sided operations
    (runtime.counters)."""
    from distbelief.records.metrics import SUMMARY_FILE, write_json_atomic

    peaks = [{k: v for k, v in figure.items() if k != "counters"} for figure in figures]
    control = [{"rank": figure["rank"], "role": figure["role"], **figure["counters"]}
               for figure in figures if "counters" in figure]
    largest = max(peaks, key=lambda figure: figure["peak_rss_mb"])
    summary = {**summary, "peak_rss": peaks,
               "peak_rss_largest": {"role": largest["role"], "mb": largest["peak_rss_mb"]},
               "control_plane": control}
    write_json_atomic(config.run.out_dir / SUMMARY_FILE, summary)
    print(_peak_memory_line(peaks), flush=True)
    return summary


def _peak_memory_line(peaks: list[dict[str, Any]]) -> str:
    """The largest peak of each kind of rank (shard, replica, ...), with its prediction."""
    import re

    biggest: dict[str, dict[str, Any]] = {}
    for figure in peaks:
        kind = re.sub(r"\s*\d.*", "", figure["role"])
        if kind not in biggest or figure["peak_rss_mb"] > biggest[kind]["peak_rss_mb"]:
            biggest[kind] = figure
    parts = []
    for figure in biggest.values():
        predicted = f" (predicted {figure['predicted_mb']:,.0f})" \
            if "predicted_mb" in figure else ""
        parts.append(f"{figure['role']} {figure['peak_rss_mb']:,.0f} MB{predicted}")
    return (f"distbelief: peak memory, the largest of each role: {', '.join(parts)}; every "
            "rank's in summary.json (peak_rss)")
