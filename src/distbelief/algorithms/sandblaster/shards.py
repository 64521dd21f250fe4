"""Sandblaster's shards (ShardServer): the command loop over this shard's vectors
(vector_shard), answering the coordinator's commands with partial dot
products, the replicas' fetches with the trial point, and summing their pushes.
docs/sandblaster.md, "Design" (shards, the order of a trial), says how.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.sandblaster.plan import (
    HEADER,
    TAG_COMMAND,
    TAG_FETCH,
    TAG_FINISHED,
    TAG_PARAMS,
    TAG_PUSH,
    TAG_RESULT,
    Piece,
    SandblasterPlan,
    poll_backoff,
    shard_segments,
)
from distbelief.algorithms.sandblaster.vector_shard import VectorShard
from distbelief.records import checkpoint as ckpt
from distbelief.runtime.communicators.agreement import wait_all
from distbelief.runtime.health import watchdog
from distbelief.runtime.launching.faults import Faults

# ------------------------------------------------------------------------------------------
# Shards


class ShardServer:
    """A shard's command loop: the coordinator's vector operations, replicas' fetches and
    pushes. Point-to-point with the coordinator and every replica.

    `pieces`: per partition, the ranges of the flat vector it owns (`all_pieces`). Partition
    p of any replica fetches and pushes `segments[p]`, the parts of its pieces in this
    shard's range, back to back; a trial is finished once every partition owning some of
    the range ("owners") has pushed every unit."""

    def __init__(self, comm: MPI.Comm, plan: SandblasterPlan, store: VectorShard,
                 pieces: list[list[Piece]], *, faults: Faults):
        self.comm, self.plan, self.store = comm, plan, store
        topology = plan.topology
        self.coordinator = topology.coordinator_rank
        self.first_replica, self.partitions = topology.first_replica_rank, topology.partitions
        lo, hi = store.start, store.stop
        if len(pieces) != self.partitions:
            raise ValueError(f"pieces for {len(pieces)} partitions, the topology has "
                             f"{self.partitions}")
        self.segments = [[(a - lo, b - lo) for a, b in shard_segments(own, [(lo, hi)])[0]]
                         for own in pieces]
        self.sizes = [sum(b - a for a, b in segs) for segs in self.segments]
        self.owners = [p for p, size in enumerate(self.sizes) if size]
        self.unit_counts = [0] * self.partitions  # units pushed by each partition, this trial
        self.push_buffer = np.empty(HEADER + hi - lo, dtype=np.float32)
        self.trial_msgs = self._messages(store.trial32, -1)
        self.snapshot_msgs = self._messages(store.snapshot32, -1)
        self.sending: list[tuple[MPI.Request, np.ndarray, int]] = []  # (send, buffer, to)
        self.finish_due: tuple[int, int] | None = None  # (n_units, batch_size)
        self.signals = None  # set by train(); only the coordinator acts on signals
        self.running = True
        self.leave = self.diverged = False  # how the coordinator's "stop" ends the run
        # trial_bytes: what the replicas' fetches of trial points cost this shard (the
        # relay tree keeps it O(RELAY_FANOUT) per trial: plan.relay_parent).
        self.counts = {"commands": 0, "fetches": 0, "pushes": 0, "stale_pushes": 0,
                       "lost_pushes": 0, "trial_fetches": 0, "trial_bytes": 0,
                       "snapshot_fetches": 0, "snapshot_bytes": 0}
        # Test-only (distbelief.runtime.launching.faults): AT counts the pushes this shard received.
        self.faults = faults

    def _messages(self, values: np.ndarray, ident: int) -> list[np.ndarray | None]:
        """Per partition, a new [header | its segments of values] float32 buffer (a send of
        the old one may be in flight); None for partitions that own nothing here."""
        out: list[np.ndarray | None] = []
        for segs, size in zip(self.segments, self.sizes):
            if not size:
                out.append(None)
                continue
            msg = np.empty(HEADER + size, dtype=np.float32)
            msg[:HEADER].view(np.int32)[:] = (ident, 0, 0, 0)
            at = HEADER
            for a, b in segs:
                msg[at:at + b - a] = values[a:b]
                at += b - a
            out.append(msg)
        return out

    def _partition_of(self, source: int) -> int:
        """The partition index of replica rank `source` (protocol error for another rank)."""
        if source < self.first_replica:
            raise RuntimeError(f"shard {self.comm.Get_rank()}: replica message from rank "
                               f"{source}, which is no replica (protocol error)")
        return (source - self.first_replica) % self.partitions

    def _trial_complete(self) -> bool:
        n_units = self.finish_due[0]
        return all(self.unit_counts[p] >= n_units for p in self.owners)

    def run(self) -> None:
        """Serve until the coordinator says stop and every send has completed.
        Point-to-point with the coordinator and the replicas; polls with back-off sleeps."""
        status, backoff = MPI.Status(), poll_backoff()
        while self.running or self.sending:
            busy = False
            while self.running and self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                self._handle(status)
                busy = True
            if self.finish_due and self._trial_complete():
                self._finish_trial()
                busy = True
            self.sending = [(r, b, to) for r, b, to in self.sending if not r.Test()]
            self.faults.after_updates(self.counts["pushes"])
            if busy:
                backoff.reset()
            else:
                backoff.wait()

    def _handle(self, status: MPI.Status) -> None:
        source, tag = status.Get_source(), status.Get_tag()
        if tag == TAG_PUSH:
            partition = self._partition_of(source)
            count = status.Get_count(MPI.FLOAT)
            if not self._receive_push(source):
                return
            trial, units, sender = (int(v) for v in self.push_buffer[:3].view(np.int32))
            if trial < self.store.trial_id:
                # Of a trial the coordinator abandoned after losing a replica: it is being
                # computed again, every unit of it (work_units: A LOST REPLICA).
                self.counts["stale_pushes"] += 1
                return
            if trial != self.store.trial_id:
                raise RuntimeError(f"shard {self.comm.Get_rank()}: push for trial {trial} "
                                   f"during trial {self.store.trial_id} (protocol error)")
            if sender != partition or count != HEADER + self.sizes[partition]:
                raise RuntimeError(f"shard {self.comm.Get_rank()}: push of {count} floats "
                                   f"from rank {source} (partition {partition}, header "
                                   f"{sender}); expected {HEADER + self.sizes[partition]} "
                                   f"(protocol error)")
            self.store.add_gradient(self.push_buffer[HEADER:count], units,
                                    self.segments[partition])
            self.unit_counts[partition] += units
            self.counts["pushes"] += 1
        elif tag == TAG_FETCH:
            partition = self._partition_of(source)
            kind = self.comm.recv(source=source, tag=TAG_FETCH)
            msg = (self.trial_msgs if kind == "trial" else self.snapshot_msgs)[partition]
            if msg is None:
                raise RuntimeError(f"shard {self.comm.Get_rank()}: fetch from rank {source}, "
                                   f"whose partition {partition} owns nothing here "
                                   f"(protocol error)")
            self.sending.append((self.comm.Isend([msg, MPI.FLOAT], source, TAG_PARAMS), msg,
                                 source))
            self.counts["fetches"] += 1
            self.counts[f"{kind}_fetches"] += 1
            self.counts[f"{kind}_bytes"] += msg.nbytes
        elif tag == TAG_COMMAND and source == self.coordinator:
            op, args = self.comm.recv(source=source, tag=TAG_COMMAND)
            self.counts["commands"] += 1
            self._command(op, args)
        else:
            raise RuntimeError(f"shard {self.comm.Get_rank()}: unexpected message tag {tag} "
                               f"from rank {source}")

    def _command(self, op: str, args: tuple) -> None:
        store = self.store
        if op == "begin_trial":
            result = store.begin_trial(*args)
            self.unit_counts = [0] * self.partitions
            self.finish_due = None  # the previous trial, if unfinished, is abandoned
            self.trial_msgs = self._messages(store.trial32, store.trial_id)
        elif op == "finish_trial":
            self.finish_due = args  # answered once every unit has been pushed
            return
        elif op == "accept":
            result = store.accept(*args)
        elif op == "take_gradient":
            result = store.take_gradient()
        elif op == "set_direction":
            result = store.set_direction(*args)
        elif op == "snapshot":
            result = store.take_snapshot(*args)
            self.snapshot_msgs = self._messages(store.snapshot32, store.snapshot_id)
        elif op == "gram":
            result = store.gram()
        elif op == "checkpoint":
            partial, meta, order = args
            params, state = store.checkpoint_arrays(order)
            result = ckpt.write_shard_part(partial, meta, self.comm.Get_rank(), store.start,
                                           store.stop, params, state)
        elif op == "stop":
            leave, diverged, lost = args
            self.running, result = False, np.zeros(0)
            self.leave, self.diverged = leave, diverged
            # A send to a lost rank never completes: do not wait for it.
            self.sending = [(r, b, to) for r, b, to in self.sending if to not in lost]
        else:
            raise RuntimeError(f"shard: unknown command {op!r}")
        self.comm.send(result, dest=self.coordinator, tag=TAG_RESULT)

    def _finish_trial(self) -> None:
        n_units, batch_size = self.finish_due
        wrong = {p: self.unit_counts[p] for p in self.owners if self.unit_counts[p] != n_units}
        if wrong:
            raise RuntimeError(f"shard {self.comm.Get_rank()}: units pushed for trial "
                               f"{self.store.trial_id} by partition {wrong}, expected "
                               f"{n_units} from each of {self.owners}")
        self.finish_due = None
        gtd = self.store.finish_trial(batch_size)
        self.comm.send((self.store.trial_id, gtd), dest=self.coordinator, tag=TAG_FINISHED)

    def _receive_push(self, source: int) -> bool:
        """Receive the push that `source` has begun to send into push_buffer; False if
        `source` died before all of it arrived (the push is dropped: its replica is lost,
        and its trial will be abandoned). Polled, so a dead sender cannot hang the shard."""
        request = self.comm.Irecv([self.push_buffer, MPI.FLOAT], source, TAG_PUSH)
        try:
            wait_all([request], "a replica's push", (source,))
        except watchdog.RankLost:
            request.Cancel()
            self.counts["lost_pushes"] += 1
            return False
        return True

    def stats(self) -> dict[str, Any]:
        return {"role": "shard", "rank": self.comm.Get_rank(), "start": self.store.start,
                "stop": self.store.stop, "owners": self.owners, **self.counts}
