"""What every Downpour parameter-server shard does (_ShardRole): serve, take part in the
shards' rounds, write its part of each checkpoint, and end the run with the others.
Shard 0 does more (supervisor.Supervisor). "The module docstring" in the code below is
the package's (distbelief.algorithms.downpour).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.downpour.plan import (
    ROUND_CHECKPOINT,
    ROUND_FINISHED,
    ROUND_INTERVAL_S,
    ROUND_WIDTH,
    Ending,
)
from distbelief.algorithms.downpour.run import OpenRun
from distbelief.ps.endpoint import saved_state
from distbelief.records import checkpoint as ckpt
from distbelief.runtime.agreement import (
    Rounds,
    bcast_after_barrier,
    gather_after_barrier,
    wait_for_everyone,
)
from distbelief.runtime.backoff import PacedBackoff
from distbelief.runtime.faults import Faults

# ------------------------------------------------------------------------------------------
# Shards


class _ShardRole:
    """What every shard does: serve, take part in the shards' rounds, write checkpoints
    and end the run together (collectives over the shards' communicator only)."""

    def __init__(self, run: OpenRun):
        self.run_, self.plan, self.shard = run, run.plan, run.endpoint
        self.comm = run.communicators.shards
        self.rounds = Rounds(self.comm, ROUND_WIDTH, ROUND_INTERVAL_S)
        self.signals = run.signals
        self.faults = Faults.for_rank(self.shard.rank)  # test-only (distbelief.runtime.faults)
        self.all_finished = False  # a round said every replica has finished or is lost
        self.checkpoint_seconds = 0.0
        self.failure: str | None = None  # why a checkpoint could not be written
        self.diverged = False  # a shard held non-finite values at a checkpoint

    def run(self) -> None:
        self.shard.serve(PacedBackoff(), between=self._duties,
                         until=lambda: self.all_finished)

    def _duties(self) -> bool:
        """Between two polls: the test-only faults, the shards' liveness, the rounds."""
        if self.faults:
            self.faults.after_updates(self.shard.version)
        self.run_.check_shards(time.monotonic())
        return self._poll_rounds()

    # -- rounds

    def _poll_rounds(self) -> bool:
        """Test the shards' round in flight (post the next one when due) and act on a
        completed one. True when it ran a checkpoint. Collective over the shards in the
        sense of agreement.Rounds."""
        result = self.rounds.poll(self._contribution)
        if result is None:
            return False
        self._on_round(result)
        if result[ROUND_CHECKPOINT]:
            self.checkpoint()
        if result[ROUND_FINISHED]:
            self.all_finished = True
        return bool(result[ROUND_CHECKPOINT])

    def _contribution(self) -> list[int]:
        counts = self.signals.counts
        return [counts["SIGTERM"], counts["SIGUSR1"], 0, 0]

    def _on_round(self, result: np.ndarray) -> None:
        """Shard 0 reads the shards' signals here."""

    # -- checkpoints (CHECKPOINTS in the package docstring)

    def checkpoint(self) -> None:
        """Write a checkpoint of the whole run with the other shards, or nothing when shard
        0 decides there is nothing new. Collective over the shards: a polled barrier
        (serving meanwhile), bcast, gather, bcast."""
        began = time.monotonic()
        comm = self.comm
        wait_for_everyone(comm, serve=self.shard.serve_once)
        self._settle()
        plan = bcast_after_barrier(comm, self._plan_checkpoint())
        outcome: dict[str, Any] = {}
        if plan is not None:
            outcome = plan
            if "meta" in plan:
                meta = ckpt.CheckpointMeta(**plan["meta"])
                reports = gather_after_barrier(comm, self._write_parts(Path(plan["partial"]),
                                                                       meta))
                outcome = bcast_after_barrier(comm, self._commit(meta, reports))
        self.checkpoint_seconds += time.monotonic() - began
        self._after_checkpoint(outcome, time.monotonic() - began)

    def _settle(self) -> None:
        """Every push counted has completed: fold all of it (poll until nothing is left)."""
        while self.shard.serve_once():
            pass

    def _plan_checkpoint(self) -> dict[str, Any] | None:
        """Shard 0: {"partial", "meta"} to write, {"error"}, or None for nothing new."""
        return None

    def _write_parts(self, partial: Path, meta: ckpt.CheckpointMeta) -> dict[str, Any]:
        """Write this shard's part: {"records": [[name, size, sha256], ...]}, {"error": ...}
        or {"diverged": ...}."""
        shard = self.shard
        # Written before this shard serves again: its own parameters, not a copy.
        params, state = shard.parameters(copy=False), saved_state(shard.optimizer)
        if not (_all_finite(params) and all(_all_finite(v) for v in state.values())):
            return {"diverged": f"shard {shard.rank} holds non-finite values at step "
                                f"{meta.step}; not checkpointed"}
        counters = {"version": shard.version, "pushes": shard.stats.pushes,
                    "folds": shard.stats.folds,
                    "gradients_applied": shard.gradients_applied}
        return _part_report(lambda: [ckpt.write_shard_part(
            partial, meta, shard.rank, shard.start, shard.stop, params, state, counters)])

    def _commit(self, meta: ckpt.CheckpointMeta,
                reports: list[dict[str, Any]] | None) -> dict[str, Any]:
        """Shard 0: commit from every shard's report; the outcome every shard learns."""
        return {}

    def _after_checkpoint(self, outcome: dict[str, Any], seconds: float) -> None:
        if "diverged" in outcome:
            self.diverged = True
        elif "error" in outcome:
            self.failure = outcome["error"]

    # -- the end

    def finish(self) -> Ending:
        """End the run with the other shards: fold the rest, gather statistics and the
        final slices to shard 0 (which evaluates them), the final checkpoint, shard 0's
        summary, and the teardown decision. Collective over the shards."""
        self._settle()
        all_stats = gather_after_barrier(self.comm, self.stats())
        final = self._gather_parameters()
        self._before_final_checkpoint(all_stats, final)
        self.checkpoint()  # the final one (skipped if its step is already checkpointed)
        ending = bcast_after_barrier(self.comm, self._ending())
        ending.failure = ending.failure or self.failure
        self._announce(ending)
        if self.comm.Get_rank() != 0:
            ending.summary = None
        return ending

    def _gather_parameters(self) -> np.ndarray | None:
        """The final parameter vector on shard 0 (None elsewhere). Collective over the
        shards: Gatherv of each shard's slice."""
        shard = self.shard
        counts = [stop - start for start, stop in shard.ranges]
        displs = [start for start, _ in shard.ranges]
        out = self._final_buffer() if self.comm.Get_rank() == 0 else None
        wait_for_everyone(self.comm)
        self.comm.Gatherv([shard.parameters(copy=False), MPI.FLOAT],
                          [out, counts, displs, MPI.FLOAT] if out is not None else None,
                          root=0)
        return out

    def _final_buffer(self) -> np.ndarray:
        """Shard 0: where the final parameter vector is gathered."""
        return np.zeros(self.shard.size, dtype=np.float32)

    def _before_final_checkpoint(self, all_stats: list | None, final: np.ndarray | None) -> None:
        """Shard 0: the replicas' statistics and the final evaluation."""

    def _ending(self) -> Ending | None:
        """Shard 0: how the run ended (bcast to the shards)."""
        return None

    def _announce(self, ending: Ending) -> None:
        """Shard 0: TEARDOWN for the replicas."""

    def stats(self) -> dict[str, Any]:
        shard = self.shard
        stats = {"role": "shard", "rank": shard.rank, "version": shard.version,
                 "params": shard.stop - shard.start,
                 "checkpoint_seconds": self.checkpoint_seconds, **asdict(shard.stats)}
        revision = getattr(shard.optimizer, "delay_stats", None)
        if revision is not None:
            # AdaRevision: the folds this shard's optimizer made (every one on RMA; none
            # on shared memory, where each client folds its own pushes).
            stats["adarevision"] = revision()
        return stats


def _all_finite(values: np.ndarray, block: int = 1 << 20) -> bool:
    """np.isfinite(values).all() in blocks: no slice-sized temporary on a shard."""
    return all(np.isfinite(values[i : i + block]).all() for i in range(0, values.size, block))


def _part_report(write: Any) -> dict[str, Any]:
    """Run a part writer; its records, or the CheckpointError's message."""
    try:
        records = write()
    except ckpt.CheckpointError as exc:
        return {"error": str(exc)}
    return {"records": [[r.name, r.size, r.sha256] for r in records]}
