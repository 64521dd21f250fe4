"""One training run, set up once: `train(config, comm, resume)` opens the data file and
builds the network, claims run.out_dir, finds the checkpoint to start from, places the
shards, checks that the layout fits the nodes' memory, runs the configured trainer
(algorithms.registry names it) on what it found, and adds every rank's peak memory to the
summary. The trainer's RunSession receives that set-up (session.RunSetup) instead of
finding it again, so a resumed run opens the data file and hashes each checkpoint part
once. `distbelief train` parses its arguments and calls `run`: `train`, then the exit
status and the outcome file the slurm/ scripts read; a Python caller can call either.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import IO, Any

from distbelief.algorithms import registry
from distbelief.algorithms.session import RunSetup
from distbelief.config import Config
from distbelief.errors import ConfigError

__all__ = ["run", "train"]


def train(config: Config, comm: Any = None, resume: str = "auto",
          stream: IO[str] | None = sys.stdout, model: Any = None,
          everywhere: bool = False) -> dict[str, Any] | None:
    """Train `config` on the ranks of `comm` (None: this process, or MPI started here when
    the algorithm needs ranks); the summary on the rank that wrote it, None elsewhere, or
    on every rank that is still in the run with `everywhere` (sent from the writer at the
    end). `resume` is one of common.RESUME_MODES; `model` a model of the user's own
    (distbelief.model.protocol) for a config loaded with own_model. Claims run.out_dir and
    gives it back after the trainer's last write. Collective over `comm`; a UserError is
    raised on every rank."""
    algorithm = _algorithm(config)
    _check_own_model(config, model)
    one_process = algorithm.in_one_process(config.cluster.partitions)
    if one_process and comm is not None and comm.Get_size() > 1:
        raise ConfigError(f"optimizer.algorithm = \"{algorithm.name}\" trains in one "
                          f"process, but {comm.Get_size()} MPI ranks were started; run it "
                          f"without mpiexec, or use algorithm = \"downpour\"")
    if comm is None and not one_process:
        from distbelief.runtime.launching.guardian import start_mpi

        comm = start_mpi()
    # Checked before anything is written: a file that does not fit the model claims nothing.
    info, network = _open_data(config, None if one_process else comm, model)
    if model is not None:
        config = _with_own_model(config, network, None if one_process else comm)
    owner = _claim_run_dir(config, comm)
    try:
        latest = _latest_checkpoint(config, comm, resume)
        finished = _finished_run(config, comm, resume, latest, stream, everywhere)
        if finished is not None:
            return finished or None  # the old summary on rank 0 (or everywhere), else None
        if not config.run.flush_subnormals:
            from distbelief.model.kernels import flush_subnormals

            flush_subnormals(False)
        setup = RunSetup(info, network, latest)
        if one_process:
            return _train_here(config, algorithm, resume, setup, stream)
        # Not freed at the end: MPI_Comm_free is collective, and a lost rank never comes.
        return _train_on(config, algorithm, _place_shards(config, comm, stream), resume,
                         setup, stream, everywhere)
    finally:
        if owner is not None:
            owner.release()


OUTCOME_ENV = "DISTBELIEF_OUTCOME_FILE"
"""If set, the rank that writes summary.json also writes there, when the run ends without
an error, {"stop_reason": ..., "lost_replicas": N}: the slurm/ scripts read it, because a
launcher's exit status is not 0 once a rank was lost, even when the others finished the
run (or stopped it cleanly for a requeue)."""


def run(config: Config, comm: Any = None, resume: str = "auto", model: Any = None) -> int:
    """`distbelief train`: `train`, then the outcome file (OUTCOME_ENV) and the process's
    exit status: 130 after a Ctrl-C that stopped the run cleanly, 4 after a collapse,
    else 0. Collective over `comm`, as `train` is."""
    summary = train(config, comm, resume, model=model)
    outcome = os.environ.get(OUTCOME_ENV)
    if summary is not None and outcome:
        from distbelief.records.metrics import write_json_atomic

        write_json_atomic(outcome, {"stop_reason": summary["stop_reason"],
                                    "lost_replicas": len(summary.get("lost_replicas", []))})
    from distbelief.algorithms.common import (
        COLLAPSED_STATUS,
        INTERRUPTED_STATUS,
        interrupted_by_user,
    )

    # Ctrl-C stopped the run cleanly (checkpoint and summary written): say so in the status.
    if interrupted_by_user():
        return INTERRUPTED_STATUS
    return COLLAPSED_STATUS if summary and summary.get("stop_reason") == "collapse" else 0


def _algorithm(config: Config) -> registry.Algorithm:
    name = config.optimizer.algorithm
    if name not in registry.names():
        raise ConfigError(f"optimizer.algorithm = {name!r} has no trainer")
    return registry.get(name)


def _check_own_model(config: Config, model: Any) -> None:
    """ConfigError for a model object and a config that do not go together."""
    if model is None and config.model.own is not None:
        raise ConfigError("the configuration was loaded for a model of your own "
                          "(own_model=True), and no model was given")
    if model is not None and config.model.own is None:
        raise ConfigError("a model of your own was given with a configuration for the "
                          "built-in layers; load it with own_model=True (distbelief.train "
                          "does)")
    if model is not None and config.cluster.partitions > 1:
        raise ConfigError(f"cluster.partitions = {config.cluster.partitions}: model "
                          f"parallelism splits the built-in layers, and a model of your own "
                          f"is one piece; set cluster.partitions = 1")


def _with_own_model(config: Config, network: Any, comm: Any) -> Config:
    """`config` with the user's model's identity, which the config hash covers. On several
    ranks, from now on a model error ends the job in one line: raised on one replica it
    would end that replica alone, which the others would take for a lost one."""
    from dataclasses import replace

    from distbelief.model.protocol import identity

    if comm is not None and comm.Get_size() > 1:
        from distbelief.runtime.health.watchdog import abort_and_leave

        network.on_error = lambda message: abort_and_leave(comm, message)
    return replace(config, model=replace(config.model, own=identity(
        network.model, network.layout.size)))


def _open_data(config: Config, comm: Any, model: Any = None) -> tuple[Any, Any]:
    """(DatasetInfo, Network): the data file opened and the model built on it (or the
    user's `model`, checked on it), checked against each other (config.check_data_fits).
    With several ranks each checks its part of the labels and they agree (collective over
    `comm`)."""
    from distbelief.algorithms.common import open_data
    from distbelief.config import check_data_fits

    def open_here() -> tuple[Any, Any]:
        part = (0, 1) if comm is None else (comm.Get_rank(), comm.Get_size())
        info, network = open_data(config, part, model)
        check_data_fits(config, info, network)
        return info, network

    if comm is None or comm.Get_size() == 1:
        return open_here()
    from distbelief.runtime.communicators.agreement import agree

    return agree(comm, open_here)


def _claim_run_dir(config: Config, comm: Any) -> Any:
    """Make this run the one live owner of run.out_dir (distbelief.runtime.health.ownership), before
    anything is written there. With several ranks rank 0 claims and a refusal is raised
    on every rank (collective over `comm`: agreement.agree). The Ownership on the rank
    that holds it, None elsewhere."""
    from distbelief.runtime.health.ownership import claim

    def claim_here() -> Any:
        owner = claim(config.run.out_dir, config.run.owner_timeout_seconds)
        if owner.took_over:
            print(f"distbelief: took run.out_dir over from a run taken for dead: "
                  f"{owner.took_over}", flush=True)
        return owner

    if comm is None or comm.Get_size() == 1:
        return claim_here()
    from distbelief.runtime.communicators.agreement import agree

    return agree(comm, lambda: claim_here() if comm.Get_rank() == 0 else None)


def _latest_checkpoint(config: Config, comm: Any, resume: str) -> Any:
    """common.latest_checkpoint of run.out_dir (None with --fresh): every rank hashes its
    share of each candidate's parts, once for the whole run. Collective over `comm`."""
    if resume == "fresh":
        return None
    from distbelief.algorithms.common import latest_checkpoint
    from distbelief.records.checkpoint import checkpoint_root

    return latest_checkpoint(checkpoint_root(config.run.out_dir), comm)


def _finished_run(config: Config, comm: Any, resume: str, latest: Any,
                  stream: IO[str] | None, everywhere: bool = False) -> dict[str, Any] | None:
    """The summary of a finished run that this rerun leaves untouched, on rank 0 ({} on the
    other ranks, or the summary too with `everywhere`); None when there is training to do.
    Collective over `comm` (rank 0 decides: distbelief.algorithms.common.finished_run)."""
    from distbelief.algorithms.common import finished_run

    rank = 0 if comm is None else comm.Get_rank()
    summary = finished_run(config, resume, stream, latest) if rank == 0 else None
    if comm is None or comm.Get_size() == 1:
        return summary
    from distbelief.runtime.communicators.agreement import bcast_after_barrier

    if everywhere:
        return bcast_after_barrier(comm, summary)
    done = bcast_after_barrier(comm, summary is not None)
    return (summary if rank == 0 else {}) if done else None


def _place_shards(config: Config, comm: Any, stream: IO[str] | None) -> Any:
    """The job's communicator, with the shards on distinct nodes (cluster.shard_placement,
    distbelief.runtime.communicators.topology); `comm` itself on one node or without shards.
    Collective over `comm`; rank 0 says where the shards are when there are several nodes."""
    shards = config.cluster.ps_shards
    if comm.Get_size() == 1 or shards == 0:
        return comm
    from distbelief.records.console import say
    from distbelief.runtime.communicators.topology import describe_shard_nodes, place_shards

    job, nodes = place_shards(comm, shards, config.cluster.shard_placement)
    if nodes.count > 1 and comm.Get_rank() == 0:
        say(stream, f"distbelief: {nodes.count} nodes; "
                    f"{describe_shard_nodes(job, shards, nodes)}"
                    + (" (distbelief's rank r below is the job's: shard s is rank s)"
                       if job is not comm else ""))
    return job


def _train_here(config: Config, algorithm: registry.Algorithm, resume: str,
                setup: RunSetup, stream: IO[str] | None) -> dict[str, Any] | None:
    """The one-process trainer, then its peak memory and the final test."""
    from distbelief.algorithms.common import final_test
    from distbelief.runtime.memory import rank_figure

    predicted = _check_memory(config, setup, None)
    trainer = algorithm.load_trainer(config.cluster.partitions, vars(config.optimizer))
    summary = trainer(config, resume=resume, setup=setup)
    if summary is None:
        return None
    summary = _with_peak_memory(config, summary, [rank_figure(0, "the one process", predicted)],
                                stream)
    return final_test(config, summary, stream, setup.network)


def _train_on(config: Config, algorithm: registry.Algorithm, comm: Any, resume: str,
              setup: RunSetup, stream: IO[str] | None,
              everywhere: bool = False) -> dict[str, Any] | None:
    """The trainer on the ranks of `comm`, then every rank's peak memory and the final
    test (on the rank that wrote the summary), and with `everywhere` the summary sent from
    there to every rank still in the run. Collective over `comm`."""
    from distbelief.algorithms.common import final_test

    predicted = _check_memory(config, setup, comm)
    setup.topology = _topology(config, algorithm, comm)
    trainer = algorithm.load_trainer(config.cluster.partitions, vars(config.optimizer))
    summary = trainer(config, comm, resume=resume, setup=setup)
    summary = _gather_peak_memory(config, setup.topology, comm, summary, predicted, stream)
    if summary is not None:
        summary = final_test(config, summary, stream, setup.network)
    return _shared(setup.topology, comm, summary) if everywhere else summary


def _shared(topology: Any, comm: Any, summary: dict[str, Any] | None) -> Any:
    """The summary, from the rank that wrote it, on every rank still in the run (None on a
    rank whose replica was lost)."""
    from distbelief.runtime import memory
    from distbelief.runtime.communicators.agreement import share_from_writer

    return share_from_writer(comm, _writer(topology), summary, _lost_ranks(summary),
                             memory.is_written_off())


def _writer(topology: Any) -> int:
    """The rank that writes summary.json: Sandblaster's coordinator, else rank 0."""
    return topology.coordinator_rank if topology.coordinator else 0


def _lost_ranks(summary: dict[str, Any] | None) -> list[int]:
    """The ranks of the replicas, and of the shards (cluster.standby_shards: shard s is
    rank s), the summary lists as lost (empty off the writer)."""
    summary = summary or {}
    return [rank for entry in summary.get("lost_replicas", [])
            if isinstance(entry, dict) for rank in entry.get("ranks", [])] + [
        entry["shard"] for entry in summary.get("lost_shards", [])]


def _check_memory(config: Config, setup: RunSetup, comm: Any) -> int | None:
    """Refuse, on every rank at once, a layout whose predicted memory exceeds a node's
    (distbelief.algorithms.memory_plan); else return this rank's predicted bytes (None
    where the formulas do not say), for summary.json. Collective over `comm` when there is
    one (the node split, then an agreement); nothing is set up or written before it."""
    from distbelief.algorithms.memory_plan import check_memory

    def check(node_of: list[int], node: int) -> Any:
        return check_memory(config, setup.info, setup.network,
                            1 if comm is None else comm.Get_size(), node_of, node)

    if comm is None:
        prediction = check([0], 0)
        return None if prediction is None else prediction[0]
    from distbelief.runtime.communicators.agreement import agree
    from distbelief.runtime.communicators.nodes import node_split

    nodes = node_split(comm)
    prediction = agree(comm, lambda: check(list(nodes.node_of), nodes.node_of[nodes.me]))
    return None if prediction is None else prediction[comm.Get_rank()]


def _topology(config: Config, algorithm: registry.Algorithm, comm: Any) -> Any:
    """This rank's Topology in the job (shards only for settings that keep them); None when
    the ranks make no layout, which the trainer then refuses in its own words."""
    from distbelief.algorithms.memory_plan import layout_of
    from distbelief.runtime.communicators.topology import Topology

    if layout_of(config, comm.Get_size()) is None:
        return None
    shards = config.cluster.ps_shards if algorithm.needs_shards(vars(config.optimizer)) else 0
    spares = config.cluster.spare_replicas if algorithm.takes_spares(vars(config.optimizer)) else 0
    return Topology(comm.Get_size(), comm.Get_rank(), shards, config.cluster.partitions,
                    coordinator=algorithm.coordinators > 0, spares=spares)


def _gather_peak_memory(config: Config, topology: Any, comm: Any,
                        summary: dict[str, Any] | None, predicted: int | None,
                        stream: IO[str] | None) -> dict[str, Any] | None:
    """Every rank's peak RSS, named by its role in `topology`, with its prediction
    (`predicted`: this rank's bytes), into the summary on the rank that wrote it
    (point-to-point, waiting a bounded time: runtime.memory.gather_peak_rss)."""
    from distbelief.runtime.memory import gather_peak_rss

    role = topology.describe_rank(topology.world_rank).partition("(")[2].rstrip(")")
    figures = gather_peak_rss(comm, _writer(topology), role, skip=_lost_ranks(summary),
                              predicted=predicted)
    if summary is None or figures is None:
        return summary
    return _with_peak_memory(config, summary, figures, stream)


def _with_peak_memory(config: Config, summary: dict[str, Any],
                      figures: list[dict[str, Any]],
                      stream: IO[str] | None) -> dict[str, Any]:
    """summary.json rewritten with `peak_rss` (each rank's figure) and the largest, and
    `control_plane`: each rank's counters of file and one-sided operations
    (runtime.counters)."""
    from distbelief.records.console import say
    from distbelief.records.metrics import SUMMARY_FILE, write_json_atomic

    peaks = [{k: v for k, v in figure.items() if k != "counters"} for figure in figures]
    control = [{"rank": figure["rank"], "role": figure["role"], **figure["counters"]}
               for figure in figures if "counters" in figure]
    largest = max(peaks, key=lambda figure: figure["peak_rss_mb"])
    summary = {**summary, "peak_rss": peaks,
               "peak_rss_largest": {"role": largest["role"], "mb": largest["peak_rss_mb"]},
               "control_plane": control}
    write_json_atomic(Path(config.run.out_dir) / SUMMARY_FILE, summary)
    say(stream, peak_memory_line(peaks))
    return summary


def peak_memory_line(peaks: list[dict[str, Any]]) -> str:
    """The largest peak of each kind of rank (shard, replica, ...), with its prediction."""
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
