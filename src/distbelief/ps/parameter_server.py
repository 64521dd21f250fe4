"""Sharded parameter server for Downpour SGD: MPI one-sided communication (RMA) between
nodes, MPI shared-memory windows within one.

The flat float32 parameter vector of `size` elements is split into S contiguous balanced
ranges (`distbelief.model.layout.balanced_ranges`); shard s (world rank s, see topology.py) owns
range s. Two transports, chosen once by `open_parameter_server` for the whole job (every
rank agrees; `requested_transport` for how to force one):

- "shared", when every rank of the job is on one node (SHARED MEMORY below): a client
  folds its own gradient into the shard's parameters with the shard's optimizer, and
  copies parameters out, directly in the shard's shared segment under a kernel
  reader-writer lock. No shard is on the critical path of a step.
- "rma" otherwise: replicas push gradients and pull parameters with passive-target RMA;
  the shard folds the pushed gradients into its parameters with its optimizer (Adagrad or
  SGD). The rest of this section up to SHARED MEMORY describes it.

Why both: with MPICH on one node every RMA epoch needs two passes through the target's
progress engine, and the read-your-writes fetch puts the shard's fold on the critical
path too; a 2 ms step paid ~1.25 ms of RMA with a shard that sleeps between polls
(benchmarks/RMA_NOTES.md sections 6-8). In shared memory the same step pays a lock (a few
microseconds), the optimizer step it would pay anyway, and one 2.7 MB copy (~0.1 ms).
Mixing the two in one job (node-local clients on shared memory, the others on RMA) is
not done: Downpour's run control needs one atomic location for the step claims that every
client can reach, and a window that both RMA and plain loads and stores update would need
the shard's progress engine for every lock again.

Windows (per shard; size 0 on every other rank), allocated with Win.Allocate over a
private duplicate of the world communicator, displacement unit 1 byte:

    ACCUM  [0:8) taken | [8:16) pushes | [16:24) done | [64:64+c) run control block |
           [64+c': +4n) gradient accumulator f32   (c = run_control.block_bytes(R), used on
           shard 0 only, 0 outside Downpour; c' = c rounded up to 64 bytes)
    PARAMS [0:8) version | [8:16) applied | [16:24) pulls | [64:64+4n) parameters f32
                                                                   (counters: int64)

    taken   = gradient batches the shard has taken out of the accumulator (folds started)
    pushes  = pushes received (every push adds 1)
    done    = clients (replicas and coordinator) that called finish()
    version = updates applied to the parameters (folds finished); version <= taken <= +1
    applied = pushes contained in the parameters (the value of `pushes` at the last take)
    pulls   = pulls served (so that the shard sees pull traffic and polls fast)

The run control block (distbelief.ps.run_control: step claims, reports, commands, each
replica's slots) rides on the pushes a replica makes anyway (`ControlExchange`, issued
inside the push's SHARED epoch on shard 0), so it costs no extra lock round trip. Its
access rules are in run_control's docstring: every access is an accumulate (SUM by the
writer of a slot, NO_OP by its readers), under SHARED locks only, shard 0's own too.

Two windows rather than one, so that pushes keep landing in ACCUM while the shard
publishes new parameters into PARAMS, and pulls keep reading PARAMS while it takes the
accumulator; `push_pull` still costs a step only one round of lock traffic, because it
opens its epochs on both windows at once.

RMA SCHEME. "Owner" is the shard itself, "client" any other rank (replica, coordinator).
Every lock is taken and released through `_epoch` (a context manager).

| location         | access                                     | epoch (lock)          |
|------------------|--------------------------------------------|-----------------------|
| ACCUM gradient   | client: Accumulate(SUM), float32           | SHARED on the shard   |
|                  | owner: copy out + store zeros (load/store) | EXCLUSIVE on itself   |
| ACCUM pushes     | client: Accumulate(SUM, +1), int64         | SHARED on the shard   |
|                  | owner: Fetch_and_op(NO_OP) (poll for work) | SHARED on itself      |
|                  | owner: load                                | EXCLUSIVE on itself   |
| ACCUM taken      | client: Fetch_and_op(NO_OP), int64         | SHARED on the shard   |
|                  | owner: store (taken + 1)                   | EXCLUSIVE on itself   |
| ACCUM done       | client: Accumulate(SUM, +1), int64         | SHARED on the shard   |
|                  | owner: Fetch_and_op(NO_OP)                 | SHARED on itself      |
| PARAMS version,  | client: Get                                | SHARED on the shard   |
| applied, params  | owner: store (copy of its master params)   | EXCLUSIVE on itself   |
| PARAMS pulls     | client: Accumulate(SUM, +1), int64         | SHARED on the shard   |
|                  | owner: Fetch_and_op(NO_OP)                 | SHARED on itself      |
| PARAMS version,  | shard 0 (snapshot for evaluation): Get     | SHARED on the other   |
| applied, params  | of another shard's window, like a client   | shard                 |
| ACCUM run        | client: Get_accumulate(SUM) / Accumulate   | SHARED on shard 0     |
| control block    |   (SUM) on its slots, Get_accumulate(NO_OP)|                       |
| (shard 0)        | owner: Get_accumulate(NO_OP) reads,        | SHARED on itself      |
|                  |   Accumulate(SUM) commands                 |                       |
|                  | owner: store zeros at creation             | EXCLUSIVE on itself   |

Why each access is legal (MPI-4.1, one-sided chapter: conflicting accesses, passive-target
synchronization, and the semantics section; window info `accumulate_ops`):
- Two accesses to one location conflict unless both are reads or both are accumulate
  operations (Accumulate, Get_accumulate, Fetch_and_op) with the same basic datatype; and
  `accumulate_ops=same_op_no_op` (the default; set explicitly here) further requires that
  concurrent accumulates use the same op or NO_OP. Concurrent pushes are all SUM on
  float32 (gradient) or SUM on int64 (pushes, done, pulls, the run control's int64 slots)
  or SUM on float64 (its loss slot), and every concurrent reader of a counter uses NO_OP
  with the counter's own datatype: element-wise atomic and legal. REPLACE is never used,
  so SUM never meets a different op. A client's Get of the PARAMS header covers version
  and applied only, never the pulls counter that other clients update concurrently.
- Shard 0's snapshot Get of another shard's PARAMS window is exactly a client's pull
  without the pull counter: a SHARED epoch on that shard, which its owner's EXCLUSIVE
  publish excludes. Shard 0 waits in that epoch only for the other shard's progress,
  which polls on its own and never waits for shard 0, so the two cannot deadlock.
- Everything else (the owner's loads and stores, a client's plain Get) would conflict
  with a concurrent update, so the locks keep it apart: "accesses that are protected by
  an exclusive lock will not be concurrent at the window site with other accesses to the
  same window that are lock protected" (MPI_Win_lock/unlock). The owner stores into its
  windows only inside an EXCLUSIVE epoch on itself; clients touch a shard only inside a
  SHARED epoch on it. So a Get never overlaps a store, and Accumulate(SUM) never overlaps
  the owner zeroing the accumulator: no push is lost or counted twice, no pull is torn.
- Get_accumulate(NO_OP) for pulls would be legal even against concurrent accumulate
  stores, but it is atomic per element only, so a pull could still mix two versions of
  the vector: whole-slice snapshots need the exclusive lock anyway, and under it a plain
  Get is legal and as fast (53 GB/s both, benchmarks/RMA_NOTES.md).
- Visibility: the windows use the unified memory model (checked at creation). Remote
  updates become visible to the owner's loads when it locks its own window, and its
  stores become visible to later remote accesses at its unlock, so no Win.Sync is needed
  (it is for loads and stores outside a lock epoch, or polling inside one).
- Exclusive sections are short: the optimizer works on a private master copy outside any
  lock; the PARAMS epoch only copies the result in (one memcpy of the slice), the ACCUM
  epoch only copies the accumulator out and zeroes it (0.1-0.25 ms held for 2.7 MB).
- Staleness is exact because `taken` only changes inside the owner's EXCLUSIVE epoch on
  ACCUM: a push that reads taken = t in its SHARED epoch lands in the accumulator before
  take t+1, so it is applied as update t+1. If its parameters were pulled at version p,
  the shard applied t - p other updates in between: that is the staleness.

PROGRESS. With MPICH on shared memory a lock, accumulate or get completes only while the
target is inside MPI (DESIGN.md), and one epoch takes several round trips through the
target's progress engine (~4-6 polls measured). The shard therefore polls: `serve_once()`
reads its counters (SHARED epochs on itself, which also drive MPI progress: more epochs
per poll than Request.Test or Iprobe, measured) and folds pending gradients; `serve()`
loops over it, sleeping between polls with `Backoff`: 50 us after traffic, doubling to
0.5 ms while idle. That costs ~6% of a core when idle and ~1 ms per 2.7 MB push_pull; a
shard that never sleeps answers in 0.4 ms but burns a core even when idle (table in
benchmarks/RMA_NOTES.md). MPICH's async progress thread is not used: it spins in every
rank. Downpour's shards use `PacedBackoff` instead, which learns the pace of the pushes
and polls every 20 us around the time the next one is due (0.8-1.2 ms of RMA per step
instead of 1.0-2.2 with the reference MLP, benchmarks/RMA_NOTES.md section 6).

READ-YOUR-WRITES. `catch_up()` pulls again until the pulled versions include the take
that holds the client's last push (the push read taken = t under the shared lock, so its
fold is take t + 1): plain pulls, legal as above, and waiting only for the shard.

SHUTDOWN. A client's `finish()` adds 1 to `done` on every shard, one-sided, after its
last push has completed; a shard's `serve()` returns once done counts every client and it
has folded every push counted before that. `free()` is the same on every rank: one
Ibarrier polled with back-off sleeps (a finished replica does not spin a core while the
others train), then the windows are freed in one fixed order.

SHARED MEMORY (transport "shared"; SharedMemoryShard, SharedMemoryClient). One window from
Win.Allocate_shared over the node communicator (= the world), a segment per shard (size 0
on other ranks); every rank maps every segment (Win.Shared_query). Shard s's segment:

    [0:64) header, int64 slots: VERSION 0 | APPLIED 1 | SERVING 2 (1 once the shard polls)
    [64:..) per client c (non-shard world rank S + c): PULLED, FINISHED (int64; pulls
           made so far, published with each push and at finish)
    then, each 64-byte aligned: the run control block (distbelief.ps.run_control; used on
           shard 0), the parameters f32, each optimizer state array f32 (for Adagrad, its
           sum of squared gradients), by name

The parameters and the optimizer state are the shard's own (its optimizer object works
on the segment's arrays; every client holds a copy of the optimizer pointed at the same
arrays). Segment s is guarded by a reader-writer lock: a POSIX record lock (fcntl) on
byte s of one lock file that all ranks opened (and that is unlinked at once). The kernel
grants it: no MPI progress is needed from anybody, a waiter sleeps, a dead process's
locks are released. MPI's own Win_lock on a shared window was measured to wait for the
target's progress (0.5 s behind a sleeping target), so it is not used.

| location            | access                                          | lock      |
|---------------------|-------------------------------------------------|-----------|
| params, state,      | client push: optimizer step with its gradient,  | exclusive |
| VERSION, APPLIED    |   VERSION += 1, APPLIED += 1 (load/store)       |           |
|                     | shard: set_parameters, initialisation (store)   | exclusive |
|                     | client pull, shard snapshot/parameters/         | shared    |
|                     |   checkpoint_state/version (load)               |           |
| run control block   | client, with a push or exchange: read, add      | exclusive |
| (shard 0)           | shard 0: read_run_control (load)                | shared    |
|                     | shard 0: add_run_control (load, store)          | exclusive |
| SERVING             | shard: first serve_once (store 1)               | exclusive |
|                     | client, before its first access (load)          | shared    |
| PULLED[c],          | client c only, with a push and at finish: store | exclusive |
| FINISHED[c]         | shard: serve_once, read_counters (load)         | shared    |

Why it is correct: load/store accesses to a shared window are ordinary memory accesses of
the processes (MPI-4.1, shared memory windows), so they need what any shared-memory
program needs: no location is written while another process accesses it. Every write
above is under the exclusive lock, every other access under the shared or the exclusive
one. (A pull therefore does not count itself in the segment; the client publishes its
count later, under the exclusive lock it takes anyway.) So a pull never sees half a fold
(no torn reads), a fold's read-modify-write of the parameters, the state and the counters
is never interleaved with another (no lost or doubled update), and step claims are atomic
(max_steps stays exact). Memory ordering: Win.Sync after taking a lock and before
releasing it (the memory barrier the standard asks for between processes' load/store
accesses to a shared window; legal because Lock_all(MODE_NOCHECK) keeps a passive-target
epoch open for the window's life, without lock traffic); the lock calls are system calls,
which order memory as well.

Semantics against "rma": a client's first access waits (sleeping) until every shard it
touches has polled once (SERVING), as its first RMA epoch would: a caller that sets up
after open_parameter_server (Downpour's shard 0 starts its clock, its rounds) finds no
work done before it serves. A push returns once the gradient is applied (it is one fold:
version and applied pushes advance together, and staleness counts the updates applied
after the pull, exactly as there), a fetch after it always contains it (catch_up never
pulls again), push_pull's fetch always contains its push. The shard only polls, sparsely
(SHARED_POLL_S), for `finish()` and statistics, and shard 0 runs its duties between polls
as before. A checkpoint taken while clients may push uses `checkpoint_state()` (one
shared lock for parameters and state together); where no client pushes (Downpour's
checkpoint rounds) `parameters()` and `optimizer.state()` agree as on "rma".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

from distbelief.model.layout import DTYPE, balanced_ranges
from distbelief.ps import run_control as rc
from distbelief.ps.run_control import ControlExchange, ControlView
from distbelief.runtime import watchdog
from distbelief.runtime.backoff import Backoff
from distbelief.runtime.topology import Topology

HEADER_BYTES = 64  # counters at the head of each window; data starts cache-line aligned
FLOAT_BYTES = DTYPE().itemsize
COUNTER_BYTES = 8
HEADER_SLOTS = HEADER_BYTES // COUNTER_BYTES
# int64 slots in the ACCUM header
TAKEN, PUSHES, DONE = 0, 1, 2
CONTROL_SHARD = 0  # holds Downpour's run control block (distbelief.ps.run_control)
# int64 slots in the PARAMS header
VERSION, APPLIED, PULLS = 0, 1, 2
STALENESS_BINS = 64  # histogram bins 0..62, and the last for 63 or more


class Optimizer(Protocol):
    """What a shard needs from distbelief.model.optimizers (make_optimizer's Adagrad or SGD): an
    in-place update of its slice, and its state for checkpoints."""

    def step(self, params: np.ndarray, grad: np.ndarray,
             copy: np.ndarray | None = None) -> None: ...

    def state(self) -> dict[str, np.ndarray]: ...


OptimizerFactory = Callable[[int], Optimizer]  # slice length -> optimizer for that slice


@contextmanager
def _epoch(win: MPI.Win, rank: int, lock_type: int) -> Iterator[None]:
    """A passive-target access epoch: Lock on entry; Unlock on exit, which completes every
    operation issued inside, at the origin and at the target. Declared to the stall
    watchdog: an epoch that never completes means `rank` is not polling (gone, stalled)
    or a client holds a lock on it that it never releases (it died or froze in a push)."""
    kind = "exclusive" if lock_type == MPI.LOCK_EXCLUSIVE else "shared"
    with watchdog.current().waiting(f"an RMA epoch ({kind} lock) on rank {rank}'s window",
                                    (rank,)):
        win.Lock(rank, lock_type)
        try:
            yield
        finally:
            win.Unlock(rank)


def _int64(buf: np.ndarray) -> list:
    """An mpi4py buffer spec that names the MPI datatype, so every accumulate on a counter
    uses the same basic datatype (atomicity holds per datatype)."""
    return [buf, MPI.INT64_T]


def _float64(buf: np.ndarray) -> list:
    """The same for the float64 loss slot."""
    return [buf, MPI.DOUBLE]


def _window_info() -> MPI.Info:
    info = MPI.Info.Create()
    # The default, stated so that the scheme above does not depend on it silently.
    info.Set("accumulate_ops", "same_op_no_op")
    info.Set("same_disp_unit", "true")
    return info


class _ShardWindows:
    """The two windows of every shard, allocated and freed collectively in one order.
    ACCUM holds the run control block (`control_bytes`, Downpour's, used on shard 0) between
    its header and the gradient accumulator, which starts at `accum_data`."""

    def __init__(self, comm: MPI.Comm, local_count: int, control_bytes: int = 0):
        self.control_bytes = control_bytes
        self.accum_data = HEADER_BYTES + _aligned(control_bytes)
        data = local_count * DTYPE().itemsize
        info = _window_info()
        try:
            self.accum = MPI.Win.Allocate(self.accum_data + data if local_count else 0, 1,
                                          info, comm)
            self.params = MPI.Win.Allocate(HEADER_BYTES + data if local_count else 0, 1,
                                           info, comm)
        finally:
            info.Free()
        for win in (self.accum, self.params):
            if win.model != MPI.WIN_UNIFIED:
                # The visibility argument in the module docstring assumes the unified model
                # (MPICH and Open MPI on cache-coherent machines always give it).
                raise RuntimeError("RMA window is not in the unified memory model")

    def free(self) -> None:
        """Collective over the window communicator, same order on every rank."""
        self.params.Free()
        self.accum.Free()


def _views(win: MPI.Win, count: int, data_offset: int) -> tuple[np.ndarray, np.ndarray]:
    """(int64 header, all its slots; float32 data from `data_offset`) views of this rank's
    part of `win`; no copy."""
    raw = np.frombuffer(win.tomemory(), dtype=np.uint8)
    header = raw[:HEADER_BYTES].view(np.int64)
    data = raw[data_offset : data_offset + count * DTYPE().itemsize].view(DTYPE)
    return header, data


class _Endpoint:
    """What shards and clients share: topology, ranges, windows and the collective free."""

    def __init__(self, comm: MPI.Comm, windows: _ShardWindows, topology: Topology,
                 size: int):
        self.topology = topology
        self.size = size
        self.ranges = balanced_ranges(size, topology.ps_shards)
        self._comm: MPI.Comm | None = comm
        self._windows: _ShardWindows | None = windows

    def _live(self) -> _ShardWindows:
        if self._windows is None:
            raise RuntimeError("parameter server already freed")
        return self._windows

    def _free_all(self, backoff: Backoff) -> None:
        """Collective over the world communicator, the same on every rank: wait for every
        rank (Ibarrier polled with back-off sleeps), free the windows, then the private
        communicator."""
        windows = self._live()
        request = self._comm.Ibarrier()
        guard = watchdog.current()
        others = [r for r in range(self._comm.Get_size()) if r != self._comm.Get_rank()]
        with guard.waiting("every rank, to free the parameter server's windows", others):
            while not request.Test():
                guard.check(request.Test)
                backoff.wait()
        windows.free()
        self._windows = None
        self._comm.Free()
        self._comm = None


def _waiting_backoff() -> Backoff:
    """For ranks with nothing to serve: back off up to 10 ms."""
    return Backoff(max_sleep_s=10e-3)


class ParameterServerShard(_Endpoint):
    """One shard: owns parameters [start, stop) and folds pushed gradients into them.

    Created by `open_parameter_server` on shard ranks. Its methods communicate only with
    its own windows (one-sided, target itself), except `free()`, which is collective.
    """

    def __init__(self, comm: MPI.Comm, windows: _ShardWindows, topology: Topology,
                 size: int, optimizer: Optimizer, initial: np.ndarray | None):
        super().__init__(comm, windows, topology, size)
        self.rank = topology.world_rank
        self.start, self.stop = self.ranges[self.rank]
        self.num_clients = topology.world_size - topology.ps_shards
        count = self.stop - self.start
        windows = self._live()
        self._accum_header, self._accum = _views(windows.accum, count, windows.accum_data)
        self._params_header, self._params = _views(windows.params, count, HEADER_BYTES)
        raw = np.frombuffer(windows.accum.tomemory(), dtype=np.uint8)
        self._control = raw[HEADER_BYTES : HEADER_BYTES + windows.control_bytes].view(np.int64)
        self._optimizer = optimizer
        self._master = np.zeros(count, dtype=DTYPE)  # the parameters; private to this rank
        self._grad = np.zeros(count, dtype=DTYPE)  # the gradient batch being applied
        self._counters = np.zeros(3, dtype=np.int64)  # pushes, done, pulls as last read
        self._taken = 0
        self._pushes_taken = 0
        self._finished = False
        self.stats = ShardStats()
        if initial is not None:
            self._master[:] = initial[self.start : self.stop]
        # Window memory comes uninitialised: zero every counter and the accumulator before
        # the first client can see them (open_parameter_server's barrier follows).
        with _epoch(windows.accum, self.rank, MPI.LOCK_EXCLUSIVE):
            self._accum_header[:] = 0
            self._control.fill(0)
            self._accum.fill(0)
        with _epoch(windows.params, self.rank, MPI.LOCK_EXCLUSIVE):
            self._params_header[:] = 0
        self._publish()

    @property
    def version(self) -> int:
        """Updates applied to this shard's parameters so far."""
        return self._taken

    @property
    def finished(self) -> bool:
        """True once every client has called finish() and every push is folded."""
        return self._finished

    @property
    def optimizer(self) -> Optimizer:
        """The optimizer of this shard's slice (its state goes into checkpoints)."""
        return self._optimizer

    def parameters(self) -> np.ndarray:
        """A copy of this shard's current parameters (for checkpoints). Local."""
        return self._master.copy()

    def checkpoint_state(self) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
        """Copies of the parameters and of the optimizer state, and the version, taken
        together: what a checkpoint writes. Local. (Here only the shard itself changes
        them; on the shared transport clients do, and this takes the segment's lock.)"""
        state = {name: value.copy() for name, value in self._optimizer.state().items()}
        return self._master.copy(), state, self._taken

    def set_parameters(self, values: np.ndarray) -> None:
        """Overwrite this shard's parameters (initial values, restores, tests).

        One-sided on its own PARAMS window: the store happens under the exclusive lock, so
        a concurrent pull sees either the old or the new slice, never a mix. Counters are
        unchanged.
        """
        self._live()
        if values.shape != self._master.shape:
            raise ValueError(f"shard {self.rank} holds {self._master.size} parameters, "
                             f"got shape {values.shape}")
        self._master[:] = values
        self._publish()

    def read_counters(self) -> tuple[int, int, int]:
        """(pushes received, clients finished, pulls served), each read atomically.

        One-sided on its own windows: SHARED epochs with Fetch_and_op(NO_OP), legal
        against the clients' concurrent SUMs. The epochs also drive MPI progress.
        """
        windows = self._live()
        pushes, done, pulls = (self._counters[i : i + 1] for i in range(3))
        for win, slot, value in ((windows.accum, PUSHES, pushes), (windows.accum, DONE, done),
                                 (windows.params, PULLS, pulls)):
            with _epoch(win, self.rank, MPI.LOCK_SHARED):
                win.Fetch_and_op(_int64(value), _int64(value), self.rank,
                                 slot * COUNTER_BYTES, MPI.NO_OP)
        return int(pushes[0]), int(done[0]), int(pulls[0])

    def read_run_control(self) -> ControlView:
        """Downpour's run control block (distbelief.ps.run_control) as it stands on this shard
        (shard 0 holds the one in use).

        One-sided on its own ACCUM window: one SHARED epoch of Get_accumulate(NO_OP) reads
        with each slot's datatype, legal against the clients' concurrent SUMs.
        """
        win = self._live().accum
        n = self._control.size
        ints = np.zeros(n, dtype=np.int64)
        zeros = np.zeros(n, dtype=np.int64)
        loss = np.zeros(1, dtype=np.float64)
        parts = [(0, rc.LOSS), (rc.LOSS + 1, n)]  # int64 slots around the float64 LOSS
        with _epoch(win, self.rank, MPI.LOCK_SHARED):
            for a, b in parts:
                win.Get_accumulate(_int64(zeros[a:b]), _int64(ints[a:b]), self.rank,
                                   (HEADER_BYTES + a * COUNTER_BYTES, b - a, MPI.INT64_T),
                                   MPI.NO_OP)
            win.Get_accumulate(_float64(np.zeros(1)), _float64(loss), self.rank,
                               (HEADER_BYTES + rc.LOSS * COUNTER_BYTES, 1, MPI.DOUBLE),
                               MPI.NO_OP)
        return rc.ControlView.from_block(ints, float(loss[0]))

    def add_run_control(self, slot: int, value: int) -> None:
        """Add `value` to slot `slot` of this shard's run control block (shard 0's commands:
        STOP, CHECKPOINT, RELEASE, TEARDOWN, a replica's LOST).

        One-sided on its own ACCUM window: Accumulate(SUM) inside a SHARED epoch, the same
        op the clients use, so shard 0 needs no exclusive lock to command (a client that
        died inside its epoch cannot block it).
        """
        win = self._live().accum
        with _epoch(win, self.rank, MPI.LOCK_SHARED):
            win.Accumulate(_int64(np.array([value], dtype=np.int64)), self.rank,
                           (HEADER_BYTES + slot * COUNTER_BYTES, 1, MPI.INT64_T), MPI.SUM)

    def snapshot(self, out: np.ndarray) -> np.ndarray:
        """The whole current parameter vector into `out` (float32, the full size): this
        shard's master copy, and every other shard's published slice; returns the version
        of each slice (int64, one per shard). Used by shard 0 to evaluate while it serves.

        One-sided: Get from every other shard's PARAMS window under SHARED locks, all open
        at once (a client's pull, without the pull counter). Waits only for the other
        shards' own polling, never for a replica.
        """
        windows = self._live()
        if out.dtype != DTYPE or out.shape != (self.size,) or not out.flags.c_contiguous:
            raise ValueError(f"snapshot buffer must be a contiguous float32 vector of "
                             f"{self.size} elements, got {out.dtype} {out.shape}")
        headers = np.zeros((self.topology.ps_shards, 2), dtype=np.int64)
        others = [s for s in self.topology.shard_ranks if s != self.rank]
        with ExitStack() as stack:
            for shard in others:
                stack.enter_context(_epoch(windows.params, shard, MPI.LOCK_SHARED))
            for shard in others:
                start, stop = self.ranges[shard]
                windows.params.Get(_int64(headers[shard]), shard, (0, 2, MPI.INT64_T))
                windows.params.Get([out[start:stop], MPI.FLOAT], shard,
                                   (HEADER_BYTES, stop - start, MPI.FLOAT))
        out[self.start : self.stop] = self._master
        headers[self.rank, VERSION] = self._taken
        return headers[:, VERSION].copy()

    @contextmanager
    def _exclusive(self, win: MPI.Win) -> Iterator[None]:
        """An EXCLUSIVE epoch on this rank's own part of `win`, timed: the wait for the
        lock (clients' SHARED epochs in flight) and how long it is held."""
        t0 = time.perf_counter()
        with _epoch(win, self.rank, MPI.LOCK_EXCLUSIVE):
            t1 = time.perf_counter()
            yield
            t2 = time.perf_counter()
        self.stats.exclusive(wait=t1 - t0, hold=t2 - t1)

    def fold(self) -> int:
        """Take the accumulated gradient and apply it with the optimizer; returns the
        number of pushes it contained (0: nothing to do, the version is unchanged).

        One-sided on its own windows: an EXCLUSIVE epoch on ACCUM copies out and zeroes
        the accumulator, the optimizer runs outside any lock on the private master copy,
        an EXCLUSIVE epoch on PARAMS publishes the result.
        """
        with self._exclusive(self._live().accum):
            pushes = int(self._accum_header[PUSHES])
            if pushes == self._pushes_taken:
                return 0
            np.copyto(self._grad, self._accum)
            self._accum.fill(0)
            self._taken += 1
            self._accum_header[TAKEN] = self._taken
        new = pushes - self._pushes_taken
        self._pushes_taken = pushes
        self._optimizer.step(self._master, self._grad)
        self._publish()
        self.stats.folds += 1
        self.stats.pushes += new
        return new

    def _publish(self) -> None:
        """Copy the master parameters and the counters into PARAMS (EXCLUSIVE on self)."""
        with self._exclusive(self._live().params):
            np.copyto(self._params, self._master)
            self._params_header[VERSION] = self._taken
            self._params_header[APPLIED] = self._pushes_taken

    def serve_once(self) -> bool:
        """One poll: read the counters (which drives MPI progress, letting the clients'
        pending locks, accumulates and gets complete) and fold if pushes are pending.
        Returns True if there was traffic (a fold, or pulls since the last poll), telling
        the caller to keep polling fast. One-sided on its own windows.
        """
        self.stats.polls += 1
        pushes, done, pulls = self.read_counters()
        # Clients finish only after their last push completed, so once every client is
        # done, `pushes` is final and folding it leaves nothing behind.
        folded = pushes > self._pushes_taken and self.fold() > 0
        if done == self.num_clients and self._pushes_taken >= pushes:
            self._finished = True
        pulled, self.stats.pulls = pulls > self.stats.pulls, pulls
        return folded or pulled

    def serve(self, backoff: Backoff | None = None,
              between: Callable[[], bool] | None = None,
              until: Callable[[], bool] | None = None) -> ShardStats:
        """Serve pushes and pulls until every client has called finish() (or, if given,
        until `until()` is true); returns stats.

        Polls with `serve_once`, sleeping between polls under `backoff` (shortest sleep
        after traffic, longer while idle). `between()`, if given, runs after every poll
        (Downpour's shard 0 evaluates, logs and applies the stop rules there; it must be
        short, since the clients' epochs wait while it runs); True counts as traffic.
        One-sided on its own windows, plus whatever `between` does.
        """
        backoff = backoff or Backoff()
        c0, t0 = time.process_time(), time.perf_counter()
        while not (until() if until is not None else self._finished):
            traffic = self.serve_once()
            if between is not None:
                traffic = between() or traffic
            if traffic:
                backoff.reset()
            else:
                backoff.wait()
        self.stats.cpu_s += time.process_time() - c0
        self.stats.wall_s += time.perf_counter() - t0
        return self.stats

    def free(self) -> None:
        """Serve until every client has finished, then free the windows.

        Collective over the world communicator (with every client's free()).
        """
        self.serve()
        self._free_all(_waiting_backoff())


@dataclass
class ShardStats:
    """What a shard did: folds, pushes folded, pulls served (as of the last poll), polls,
    its exclusive sections (time held, and time waiting for the clients' shared epochs to
    drain), CPU and wall time served, and the transport ("rma" or "shared"). On the shared
    transport the clients fold, and folds/pushes/pulls are read from the segment."""

    folds: int = 0
    pushes: int = 0
    pulls: int = 0
    polls: int = 0
    exclusive_sections: int = 0
    hold_max_s: float = 0.0
    hold_total_s: float = 0.0
    wait_max_s: float = 0.0
    wait_total_s: float = 0.0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    transport: str = "rma"

    def exclusive(self, wait: float, hold: float) -> None:
        self.exclusive_sections += 1
        self.hold_max_s = max(self.hold_max_s, hold)
        self.hold_total_s += hold
        self.wait_max_s = max(self.wait_max_s, wait)
        self.wait_total_s += wait


@dataclass
class StalenessStats:
    """Staleness of pushed gradients, one sample per (push, shard): the number of updates
    the shard applied after the version the gradient was computed from, before it.

    `histogram[k]` counts samples of staleness k, the last bin those of STALENESS_BINS - 1
    or more."""

    samples: int = 0
    total: int = 0
    max: int = 0
    histogram: np.ndarray = field(
        default_factory=lambda: np.zeros(STALENESS_BINS, dtype=np.int64), repr=False)

    @property
    def mean(self) -> float:
        return self.total / self.samples if self.samples else 0.0

    def add(self, staleness: np.ndarray) -> None:
        self.samples += int(staleness.size)
        self.total += int(staleness.sum())
        self.max = max(self.max, int(staleness.max(initial=0)))
        self.histogram += np.bincount(np.minimum(staleness, STALENESS_BINS - 1),
                                      minlength=STALENESS_BINS)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: samples, mean, max, and the histogram with its trailing zeros cut."""
        used = int(np.flatnonzero(self.histogram)[-1]) + 1 if self.samples else 0
        return {"samples": self.samples, "mean": self.mean, "max": self.max,
                "histogram": [int(c) for c in self.histogram[:used]],
                "histogram_cap": STALENESS_BINS - 1}


class ParameterClient(_Endpoint):
    """A replica's (or the coordinator's) handle on all shards: pull, push, finish.

    Created by `open_parameter_server` on every non-shard rank. pull, push and finish are
    one-sided, targeting every shard (SHARED locks on all shards at once, so transfers to
    several shards overlap); free is collective over the world communicator.
    """

    def __init__(self, comm: MPI.Comm, windows: _ShardWindows, topology: Topology,
                 size: int):
        super().__init__(comm, windows, topology, size)
        shards = topology.ps_shards
        self.pulled_versions = np.zeros(shards, dtype=np.int64)
        self.applied_pushes = np.zeros(shards, dtype=np.int64)
        self.staleness = StalenessStats()
        self._finished = False
        self._headers = np.zeros((shards, 2), dtype=np.int64)
        self._one = np.ones(1, dtype=np.int64)
        self._taken = np.zeros((shards, 1), dtype=np.int64)
        self._push_versions = np.zeros(shards, dtype=np.int64)  # versions holding last push
        # What this client transfers, per shard: all of its range unless restrict_to.
        self._segments = [[r] for r in self.ranges]
        self._touched = np.ones(shards, dtype=bool)
        self._hang: Any = None  # test-only: what to do in the next push (Faults.hang or .kill)
        self._linger_s = 0.0  # test-only: seconds to hold each exchange's epoch open

    def hang_in_next_push(self, faults: Any) -> None:
        """TEST-ONLY (distbelief.runtime.faults "hang"): the next push stops responding for ever
        while it holds its locks on the shards, as a replica that froze mid-push."""
        self._hang = faults.hang

    def kill_in_next_push(self, faults: Any) -> None:
        """TEST-ONLY (distbelief.runtime.faults "killpush"): the next push kills its process
        (SIGKILL) once its operations are issued, before they complete, as a replica whose
        node crashed mid-push."""
        self._hang = faults.kill

    def linger_in_exchanges(self, seconds: float) -> None:
        """TEST-ONLY (distbelief.runtime.faults "linger"): from now on every exchange flushes
        its operations to shard 0 (they are applied there) and holds its epoch open
        `seconds` longer before the Unlock, as a rank descheduled just before it."""
        self._linger_s = seconds

    def _maybe_hang(self, shard: int) -> None:
        if self._hang is not None:
            self._hang(f"in a push, holding the lock on shard {shard}")

    def restrict_to(self, pieces: Sequence[tuple[int, int]]) -> None:
        """From now on pull and push only `pieces`, [start, stop) ranges of the vector (a
        model partition's own parameters, the paper's Figure 2). Shards holding none of
        them are not touched: no transfer, no pull or push counted there, no staleness
        sample (epochs are still opened on every shard, so a control exchange with shard
        0 stays legal). Local; call it before the first pull."""
        segments: list[list[tuple[int, int]]] = [[] for _ in self.ranges]
        for shard, (low, high) in enumerate(self.ranges):
            for start, stop in sorted(pieces):
                start, stop = max(start, low), min(stop, high)
                if start < stop:
                    segments[shard].append((start, stop))
        self._segments = segments
        self._touched = np.array([bool(s) for s in segments])

    def _check_vector(self, vector: np.ndarray, what: str) -> None:
        if vector.dtype != DTYPE or vector.shape != (self.size,) or not vector.flags.c_contiguous:
            raise ValueError(f"{what} must be a contiguous float32 vector of {self.size} "
                             f"elements, got {vector.dtype} {vector.shape}")

    def _check_open(self) -> _ShardWindows:
        windows = self._live()
        if self._finished:
            raise RuntimeError("this client already called finish()")
        return windows

    @contextmanager
    def _all_shards(self, *wins: MPI.Win) -> Iterator[None]:
        """SHARED epochs on every shard of every window in `wins`, open at the same time,
        so that their lock round trips and transfers overlap."""
        with ExitStack() as stack:
            for win in wins:
                for shard in self.topology.shard_ranks:
                    stack.enter_context(_epoch(win, shard, MPI.LOCK_SHARED))
            yield

    def _issue_pull(self, win: MPI.Win, out: np.ndarray) -> None:
        for shard, (low, _) in enumerate(self.ranges):
            if not self._touched[shard]:
                continue
            # version and applied only: `pulls` is updated concurrently by other clients.
            win.Get(_int64(self._headers[shard]), shard, (0, 2, MPI.INT64_T))
            for start, stop in self._segments[shard]:
                win.Get([out[start:stop], MPI.FLOAT], shard,
                        (HEADER_BYTES + (start - low) * FLOAT_BYTES, stop - start, MPI.FLOAT))
            win.Accumulate(_int64(self._one), shard, (PULLS * COUNTER_BYTES, 1, MPI.INT64_T),
                           MPI.SUM)

    def _issue_push(self, win: MPI.Win, grad: np.ndarray,
                    control: ControlExchange | None) -> None:
        # The order inside the epoch does not matter: the shard takes the accumulator and
        # the push count together under its EXCLUSIVE lock, after this SHARED epoch has
        # completed. (Counters first, to wake the shard earlier, was measured: no faster.)
        data = self._live().accum_data
        for shard, (low, _) in enumerate(self.ranges):
            if not self._touched[shard]:
                continue
            for start, stop in self._segments[shard]:
                win.Accumulate([grad[start:stop], MPI.FLOAT], shard,
                               (data + (start - low) * FLOAT_BYTES, stop - start,
                                MPI.FLOAT), MPI.SUM)
            win.Accumulate(_int64(self._one), shard, (PUSHES * COUNTER_BYTES, 1, MPI.INT64_T),
                           MPI.SUM)
            win.Fetch_and_op(_int64(self._one), _int64(self._taken[shard]), shard,
                             TAKEN * COUNTER_BYTES, MPI.NO_OP)
        if control is not None:
            control.issue(win, CONTROL_SHARD, HEADER_BYTES)
        self._maybe_hang(CONTROL_SHARD)

    def _pulled(self) -> np.ndarray:
        self.pulled_versions[:] = self._headers[:, VERSION]
        self.applied_pushes[:] = self._headers[:, APPLIED]
        return self.pulled_versions.copy()

    def _pushed(self) -> np.ndarray:
        # The push read taken = t on each shard: the fold that applies it is take t + 1.
        touched = self._touched
        self._push_versions[touched] = self._taken[touched, 0] + 1
        staleness = self._taken[:, 0] - self.pulled_versions
        self.staleness.add(staleness[touched])
        return staleness

    def pull(self, out: np.ndarray) -> np.ndarray:
        """Fetch all parameters into `out`; returns each shard's version (int64, one per
        shard). One-sided: Get from every shard's PARAMS window under a SHARED lock, so
        each shard's slice is one consistent snapshot matching its version (plus an
        Accumulate(SUM) of 1 into its pull counter)."""
        self._check_vector(out, "pull buffer")
        win = self._check_open().params
        with self._all_shards(win):
            self._issue_pull(win, out)
        return self._pulled()

    def push(self, grad: np.ndarray, control: ControlExchange | None = None) -> np.ndarray:
        """Add `grad` to every shard's accumulator; returns the staleness per shard
        (updates the shard applied after the version of the last pull, before this one).

        One-sided: per shard, in one SHARED epoch, Accumulate(SUM) of its slice and of 1
        into its push counter, and Fetch_and_op(NO_OP) on taken; with `control`, its
        operations on shard 0 ride in the same epoch.
        """
        self._check_vector(grad, "gradient")
        win = self._check_open().accum
        with self._all_shards(win):
            self._issue_push(win, grad, control)
        return self._pushed()

    def push_pull(self, grad: np.ndarray, out: np.ndarray,
                  control: ControlExchange | None = None) -> tuple[np.ndarray, np.ndarray]:
        """push(grad, control) and pull(out) with all their epochs open at once; returns
        (staleness, versions) as push and pull do.

        One-sided, to every shard: the same operations as push and pull, overlapped, so a
        training step costs the shard one round of lock traffic instead of two. The
        parameters fetched may or may not contain this gradient yet (usually not).
        """
        self._check_vector(grad, "gradient")
        self._check_vector(out, "pull buffer")
        windows = self._check_open()
        with self._all_shards(windows.accum, windows.params):
            self._issue_push(windows.accum, grad, control)
            self._issue_pull(windows.params, out)
        return self._pushed(), self._pulled()

    def catch_up(self, out: np.ndarray, backoff: Backoff | None = None) -> int:
        """Make the last pull contain this client's last push (read-your-writes): pull
        again, sleeping under `backoff` between pulls, until every shard's pulled version
        includes the take that held that push. Returns the number of extra pulls (0 when
        the last pull had it already).

        One-sided, to every shard (pulls). It waits only for the shards to fold, never
        for another client; with one replica, push_pull + catch_up is exactly sequential
        SGD (the DistBelief server answers a replica's fetch after applying its push).
        """
        backoff = backoff or Backoff(min_sleep_s=20e-6, max_sleep_s=0.2e-3)
        extra = 0
        guard = watchdog.current()
        with guard.waiting("the shards to apply this client's push",
                           self.topology.shard_ranks):
            while (self.pulled_versions < self._push_versions).any():
                if extra:
                    guard.check()
                    backoff.wait()
                self.pull(out)
                extra += 1
        return extra

    def exchange(self, control: ControlExchange) -> None:
        """Only the control operations, without a gradient (a replica's first claim, its
        warm-start polls). One-sided: a SHARED epoch on shard 0's ACCUM window."""
        win = self._check_open().accum
        with _epoch(win, CONTROL_SHARD, MPI.LOCK_SHARED):
            control.issue(win, CONTROL_SHARD, HEADER_BYTES)
            if self._linger_s:
                win.Flush(CONTROL_SHARD)
                time.sleep(self._linger_s)

    def finish(self) -> None:
        """Tell every shard that this rank will push no more. One-sided: Accumulate(SUM) of
        1 into each shard's done counter. Call it after the last push; idempotent."""
        if self._finished:
            return
        win = self._check_open().accum
        with self._all_shards(win):
            for shard in self.topology.shard_ranks:
                win.Accumulate(_int64(self._one), shard, (DONE * COUNTER_BYTES, 1, MPI.INT64_T),
                               MPI.SUM)
        self._finished = True

    def free(self) -> None:
        """finish() if not yet done, wait for every rank (polling with back-off sleeps,
        not spinning) and free the windows. Collective over the world communicator (with
        every shard's free())."""
        self.finish()
        self._free_all(_waiting_backoff())


# ------------------------------------------------------------------------------------------
# Shared by the transports (shared_memory.py, transport.py)

TRANSPORT_ENV = "DISTBELIEF_PS_TRANSPORT"
"""Environment variable naming the transport when open_parameter_server is not told:
"auto" (the default: shared memory when every rank is on one node, else RMA), "shared"
(shared memory or a ConfigError), "rma" (always RMA, e.g. to test the multi-node path)."""
TRANSPORTS = ("auto", "shared", "rma")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // HEADER_BYTES) * HEADER_BYTES
