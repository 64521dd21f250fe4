"""Memory: what this process has used at most (peak RSS), what the node has, and the
gathering of every rank's peak to the rank that writes summary.json, so that a run shows
each rank's memory beside the memory model's figure, and a layout that will not fit on a
node is refused before it starts.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any

from distbelief.errors import ConfigError
from distbelief.runtime import counters

NODE_MEMORY_ENV = "DISTBELIEF_NODE_MEMORY"
MEMORY_TAG = 0x6D656D  # "mem": the end-of-run peak RSS messages
GATHER_WAIT_S = 10.0
"""How long the summary's writer waits for the other ranks' figures at the end of a run
(they send them as soon as their trainer returns; teardown is collective, so they are
close). A rank that does not send in time is left out of the summary, not waited for."""

_written_off = False


def written_off() -> None:
    """This rank's replica is lost (another partition of it died): the writer leaves this
    rank's figure out, and the ranks it would send to may have ended already. So
    gather_peak_rss sends nothing from here. Seen on simulated nodes: a lost replica's
    survivor that learnt of the death at the end of the run, once the writer had exited,
    died of SIGSEGV in the isend (MPICH's UCX netmod attaching to the ended rank's
    removed shared memory)."""
    global _written_off
    _written_off = True


def is_written_off() -> bool:
    """Whether `written_off` was called in this process."""
    return _written_off


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _status_kib(field: str, path: str = "/proc/self/status") -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far, in bytes. Local.

    The kernel's high-water mark of this process's resident set (/proc/self/status VmHWM;
    getrusage's ru_maxrss elsewhere). Pages of a shared-memory segment count in every
    process that touched them, so on the shared-memory transport a shard's slice shows in
    its replicas' peaks too (`rss_parts` tells anonymous from shared)."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def rss_parts() -> dict[str, int]:
    """The resident set now, in bytes: anonymous (private: numpy arrays), file-backed
    (the code) and shared memory (MPI windows and shared segments). Empty off Linux."""
    parts = {}
    for field, name in (("RssAnon", "anon"), ("RssFile", "file"), ("RssShmem", "shmem")):
        kib = _status_kib(field)
        if kib is not None:
            parts[name] = kib * 1024
    return parts


def parse_size(text: str, default_unit: str = "") -> int:
    """Bytes from '64G', '512M', '1.5T', '8000000' (binary units; `default_unit` for a bare
    number, as SLURM's megabytes). ConfigError on anything else."""
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    suffixed = value[-1:] in _UNITS and value[-1:] != ""
    unit = value[-1] if suffixed else default_unit
    number = value[:-1] if suffixed else value
    try:
        size = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        size = -1.0
    if not size > 0:
        raise ConfigError(f"memory size {text!r}: write a positive number with K, M, G or T "
                          f"(for example 64G)")
    return int(size)


def node_memory_bytes(environ: Mapping[str, str] | None = None,
                      meminfo: str = "/proc/meminfo") -> tuple[int | None, str]:
    """(bytes one node offers this job, where that figure comes from); (None, why) when
    nothing says. Pure but for reading `meminfo`.

    For refusing a layout that will not fit before it starts (docs/performance.md, "Memory
    per rank"): DISTBELIEF_NODE_MEMORY if set (a size such as 64G; tests use it), else the
    SLURM allocation (SLURM_MEM_PER_NODE, or SLURM_MEM_PER_CPU times SLURM_CPUS_ON_NODE),
    else the kernel's MemAvailable."""
    env = os.environ if environ is None else environ
    if env.get(NODE_MEMORY_ENV, "").strip():
        return parse_size(env[NODE_MEMORY_ENV]), f"${NODE_MEMORY_ENV}"
    if env.get("SLURM_MEM_PER_NODE", "").strip():
        return parse_size(env["SLURM_MEM_PER_NODE"], "M"), "the SLURM allocation (--mem)"
    per_cpu, cpus = env.get("SLURM_MEM_PER_CPU", "").strip(), env.get("SLURM_CPUS_ON_NODE", "")
    if per_cpu and cpus.strip():
        return (parse_size(per_cpu, "M") * int(cpus),
                f"the SLURM allocation (--mem-per-cpu x {int(cpus)} CPUs)")
    available = _status_kib("MemAvailable", meminfo)
    if available is not None:
        return available * 1024, "this machine's MemAvailable"
    return None, "no figure for this node's memory"


def rank_figure(rank: int, role: str, predicted: int | None = None) -> dict[str, Any]:
    """This process's line in summary.json's `peak_rss` (with `predicted_mb`, the memory
    model's figure for it, when there is one), with its control-plane counters
    (runtime.counters) and its rank in the launcher's job (`job_rank`: the ranks may be
    renumbered, cluster.shard_placement) under "counters". Local."""
    mpi = sys.modules.get("mpi4py.MPI")
    job_rank = (mpi.COMM_WORLD.Get_rank()
                if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() else 0)
    figure: dict[str, Any] = {"rank": rank, "role": role,
                              "peak_rss_mb": round(peak_rss_bytes() / 2**20, 1)}
    if predicted is not None:
        figure["predicted_mb"] = round(predicted / 2**20, 1)
    return {**figure, "counters": {"job_rank": job_rank, **counters.snapshot()}}


def gather_peak_rss(comm: Any, writer: int, role: str, skip: Iterable[int] = (),
                    wait_s: float = GATHER_WAIT_S,
                    predicted: int | None = None) -> list[dict[str, Any]] | None:
    """Every rank's {"rank", "role", "peak_rss_mb"} (and "predicted_mb": `predicted`, this
    rank's predicted bytes) on rank `writer` of `comm` (in rank order), None on the
    others. Point-to-point, never a collective: after the trainer
    returned, a rank may be gone (a lost replica), so the writer waits at most `wait_s`
    for each figure and leaves out the ranks in `skip` (known lost) and any that does not
    send in time. Each sender waits at most `wait_s` for its small send to complete."""
    from mpi4py import MPI

    mine = rank_figure(comm.Get_rank(), role, predicted)
    deadline = time.monotonic() + wait_s
    if comm.Get_rank() != writer:
        if _written_off:
            return None
        try:
            request = comm.isend(mine, dest=writer, tag=MEMORY_TAG)
            while not request.Test() and time.monotonic() < deadline:
                time.sleep(1e-3)
        except MPI.Exception:  # the writer is gone: its summary is lost anyway
            pass
        return None
    figures = [mine]
    waiting = set(range(comm.Get_size())) - {writer} - set(skip)
    while waiting and time.monotonic() < deadline:
        for rank in sorted(waiting):
            try:
                if comm.iprobe(source=rank, tag=MEMORY_TAG):
                    figures.append(comm.recv(source=rank, tag=MEMORY_TAG))
                    waiting.discard(rank)
            except MPI.Exception:  # a rank that died: left out
                waiting.discard(rank)
        if waiting:
            time.sleep(1e-3)
    return sorted(figures, key=lambda figure: figure["rank"])
