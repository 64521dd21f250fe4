"""The shared-memory transport of the parameter server: every rank of the job on one node.

A client folds its own gradient into the shard's parameters with the shard's optimizer,
and copies parameters out, directly in the shard's shared segment under a kernel
reader-writer lock; no shard is on the critical path of a step.
transport.open_parameter_server chooses this transport or RMA for the whole job.

SHARED MEMORY (transport "shared"; SharedMemoryShard, SharedMemoryClient). One window from
Win.Allocate_shared over the node communicator (= the world), a segment per shard (size 0
on other ranks); every rank maps every segment (Win.Shared_query). Shard s's segment:

    [0:64) header, int64 slots: VERSION 0 | APPLIED 1 | SERVING 2 (1 once the shard polls)
           | BEFORE 3 (gradients applied in earlier jobs: the schedule's count goes on)
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
| BEFORE              | shard: initialisation (store)                   | exclusive |
|                     | client push: the schedule's count (load)        | exclusive |
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

import copy
import fcntl
import os
import struct
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from distbelief.errors import ConfigError
from distbelief.model import kernels
from distbelief.model.layout import DTYPE, balanced_ranges
from distbelief.model.optimizers import ShardRule, StepInfo
from distbelief.ps import run_control as rc
from distbelief.ps.endpoint import (
    APPLIED,
    CONTROL_SHARD,
    COUNTER_BYTES,
    GIVE_UP_S,
    HEADER_BYTES,
    TRANSPORT_ENV,
    VERSION,
    OpenWindows,
    ParameterClient,
    ParameterServerShard,
    PieceMap,
    PullLedger,
    PushFaults,
    RuleFactory,
    ServerSpec,
    aligned,
    check_vector,
    own_slice,
    saved_state,
    serve_polls,
    touched_mask,
    waiting_backoff,
)
from distbelief.ps.run_control import ControlExchange, ControlView
from distbelief.ps.stats import ShardStats
from distbelief.runtime.backoff import Backoff
from distbelief.runtime.communicators.nodes import node_communicator
from distbelief.runtime.communicators.topology import Topology
from distbelief.runtime.health import watchdog

SERVING = 2  # int64 slot in a shared segment's header: 1 once the shard has polled
BEFORE = 3  # int64 slot: gradients the slice applied in earlier jobs (set at start)
# int64 slots of each client in a shared segment, written by that client only
PULLED, FINISHED = 0, 1
CLIENT_SLOTS = 2
SHARED_POLL_S = (0.5e-3, 2e-3)
"""Back-off bounds of a shard on shared memory, whatever serve() is given: its polls
serve no client (they only notice finish() and run shard 0's duties), so they can be
sparse; a 0.5 ms cap cost ~8% of a core, measured (benchmarks/RMA_NOTES.md section 8)."""


def _segment_bytes(count: int, clients: int, state_arrays: int, control_bytes: int) -> int:
    slots = aligned(clients * CLIENT_SLOTS * COUNTER_BYTES)
    return (HEADER_BYTES + slots + aligned(control_bytes)
            + (1 + state_arrays) * aligned(count * DTYPE().itemsize))


@dataclass
class _Segment:
    """Views of one shard's shared segment (no copies)."""

    header: np.ndarray  # int64 slots VERSION, APPLIED, SERVING
    clients: np.ndarray  # int64 (clients, CLIENT_SLOTS): PULLED, FINISHED
    control: np.ndarray  # int64, the run control block (distbelief.ps.run_control)
    params: np.ndarray  # float32, the shard's parameters (the master copy)
    state: dict[str, np.ndarray]  # float32, the optimizer's state arrays by name


def _segment_views(buffer: MPI.buffer, count: int, clients: int, names: list[str],
                   control_bytes: int) -> _Segment:
    raw = np.frombuffer(buffer, dtype=np.uint8)
    control = HEADER_BYTES + aligned(clients * CLIENT_SLOTS * COUNTER_BYTES)
    offset = control + aligned(control_bytes)
    data = aligned(count * DTYPE().itemsize)
    arrays = [raw[offset + i * data : offset + i * data + count * DTYPE().itemsize].view(DTYPE)
              for i in range(1 + len(names))]
    return _Segment(
        header=raw[:HEADER_BYTES].view(np.int64),
        clients=raw[HEADER_BYTES : HEADER_BYTES + clients * CLIENT_SLOTS * COUNTER_BYTES]
        .view(np.int64).reshape(clients, CLIENT_SLOTS),
        control=raw[control : control + control_bytes].view(np.int64),
        params=arrays[0], state=dict(zip(names, arrays[1:], strict=True)))


def _shareable_state(optimizer: RuleFactory) -> list[str] | None:
    """The names of the optimizer's state arrays if they can live in shared memory (each
    float32 and held in the attribute of its name, so a client's copy of the optimizer can
    be pointed at the shard's arrays); None otherwise."""
    probe = optimizer(1)
    state = probe.state()
    for name, value in state.items():
        if getattr(probe, name, None) is not value or value.dtype != DTYPE:
            return None
    return sorted(state)


def _bind_state(optimizer: ShardRule, state: dict[str, np.ndarray]) -> None:
    """Make `optimizer` work on the shared arrays `state` (see _shareable_state)."""
    for name, view in state.items():
        setattr(optimizer, name, view)
        if optimizer.state()[name] is not view:
            raise RuntimeError(f"optimizer state {name!r} could not be moved to shared memory")


def _lock_file(node: MPI.Comm) -> int | None:
    """An open file descriptor on a fresh lock file shared by every rank of `node`, already
    unlinked (nothing is left behind, even after a crash); None if one could not be made.
    Collective over `node`."""
    path = None
    if node.Get_rank() == 0:
        folder = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        try:
            fd, path = tempfile.mkstemp(prefix="distbelief-ps-", suffix=".lock", dir=folder)
            os.close(fd)
        except OSError:
            path = None
    path = node.bcast(path, root=0)
    fd = None
    if path is not None:
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            fd = None
    everyone = node.allreduce(fd is not None, op=MPI.LAND)  # also: all have opened it
    if node.Get_rank() == 0 and path is not None:
        os.unlink(path)
    if not everyone and fd is not None:
        os.close(fd)
        fd = None
    return fd


class SharedSegments:
    """Every shard's segment in one Win.Allocate_shared window over the node communicator,
    and the lock file whose byte s is segment s's reader-writer lock.

    Locks are POSIX record locks (fcntl): the kernel grants them, so no rank's progress
    engine is involved, a waiter sleeps instead of spinning, and a rank that dies releases
    what it held. Win.Sync after taking a lock and before releasing it is the memory
    barrier MPI asks for between load/store accesses of different processes to a shared
    window; it is legal inside the passive-target epoch that Lock_all(MODE_NOCHECK) opens
    for the window's lifetime (no lock traffic: measured local, 0.1 us per Sync).
    """

    def __init__(self, node: MPI.Comm, lock_fd: int, topology: Topology,
                 ranges: list[tuple[int, int]], names: list[str], control_bytes: int):
        self.node, self.lock_fd, self.names = node, lock_fd, names
        # Process ids by rank (node ranks are world ranks), to name a lock's holder.
        self.pids = node.allgather(os.getpid())
        clients = topology.world_size - topology.ps_shards
        index = topology.shard_index
        mine = (0 if index is None
                else _segment_bytes(ranges[index][1] - ranges[index][0], clients, len(names),
                                    control_bytes))
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")  # each segment on its owner's pages
        try:
            self.win = MPI.Win.Allocate_shared(mine, 1, info, node)
        finally:
            info.Free()
        if self.win.model != MPI.WIN_UNIFIED:
            raise RuntimeError("shared-memory window is not in the unified memory model")
        self.win.Lock_all(MPI.MODE_NOCHECK)
        # node ranks are world ranks (one node, Split_type keyed by rank): shard s is rank s
        self.segments = [_segment_views(self.win.Shared_query(s)[0], stop - start, clients,
                                        names, control_bytes)
                         for s, (start, stop) in enumerate(ranges)]

    @contextmanager
    def lock(self, shard: int, exclusive: bool) -> Iterator[_Segment]:
        """Shard `shard`'s segment, locked: exclusive (writers) or shared (readers). When
        the lock is taken, the wait is declared to the stall watchdog with its holder."""
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.lockf(self.lock_fd, mode | fcntl.LOCK_NB, 1, shard)
        except OSError:  # held by another rank: wait for it, sleeping in the kernel
            with watchdog.current().waiting(
                    f"the {'exclusive' if exclusive else 'shared'} lock on shard {shard}'s "
                    f"segment", (), lambda: self.holder(shard, exclusive)):
                fcntl.lockf(self.lock_fd, mode, 1, shard)
        try:
            self.win.Sync()
            yield self.segments[shard]
        finally:
            self.win.Sync()
            fcntl.lockf(self.lock_fd, fcntl.LOCK_UN, 1, shard)

    def holder(self, shard: int, exclusive: bool) -> int | None:
        """The rank holding a lock on shard `shard`'s segment that conflicts with taking it
        `exclusive`ly or not (fcntl F_GETLK), or None."""
        request = struct.pack("hhqqi", fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK,
                              os.SEEK_SET, shard, 1, 0) + bytes(8)
        answer = fcntl.fcntl(self.lock_fd, fcntl.F_GETLK, request)
        kind, _, _, _, pid = struct.unpack("hhqqi", answer[: struct.calcsize("hhqqi")])
        if kind == fcntl.F_UNLCK or pid not in self.pids:
            return None
        return self.pids.index(pid)

    def free(self) -> None:
        """Collective over the node communicator (= the world), same order on every rank."""
        self.win.Unlock_all()
        self.win.Free()
        os.close(self.lock_fd)
        self.node.Free()


def _open_segments(comm: MPI.Comm, spec: ServerSpec, required: bool) -> SharedSegments | None:
    """The shared segments if the shared transport can be used, else None (use another).
    Collective over `comm`; every rank reaches the same answer (all ranks on one node or
    not, the same rule factory, one lock file for all)."""
    node = node_communicator(comm)  # MPI's node, or a simulated one (runtime.communicators.nodes)
    names = _shareable_state(spec.rule)
    why = None
    if node.Get_size() != comm.Get_size():
        why = "the ranks are on more than one node (or MPI shares no memory between them)"
    elif names is None:
        why = "the optimizer's state cannot live in shared memory"
    lock_fd = _lock_file(node) if why is None else None
    if why is None and lock_fd is None:
        why = "no lock file could be created in /dev/shm or the temporary folder"
    if why is None:
        return SharedSegments(node, lock_fd, spec.topology, spec.ranges, names,
                              spec.control_bytes)
    node.Free()
    if required:
        raise ConfigError(f"the shared-memory parameter server was requested "
                          f"({TRANSPORT_ENV}=shared) but {why}")
    return None


def open_shared_memory(comm: MPI.Comm, spec: ServerSpec,
                       required: bool) -> ParameterServerShard | ParameterClient | None:
    """The shared-memory transport's opener (transport.OPENERS["shared"]): a
    SharedMemoryShard on shard ranks, a SharedMemoryClient on the others, or None on
    every rank when this transport cannot serve the job (ranks on several nodes, a rule
    whose state cannot be shared, no lock file); ConfigError instead when `required`.
    Collective over `comm`; returns once every shard has initialised its segment."""
    segments = _open_segments(comm, spec, required)
    if segments is None:
        return None
    topology, ranges = spec.topology, spec.ranges
    endpoint: ParameterServerShard | ParameterClient
    if topology.is_shard:
        start, stop = ranges[topology.world_rank]
        endpoint = SharedMemoryShard(comm, segments, topology, spec.size,
                                     spec.rule(stop - start), spec.initial,
                                     spec.gradients_before)
    comm.Barrier()  # every shard has initialised its segment
    if not topology.is_shard:
        endpoint = SharedMemoryClient(comm, segments, topology, spec.size, spec.rule,
                                      spec.push_dtype)
    return endpoint


class SharedMemoryShard(ParameterServerShard):
    """A shard on the shared-memory transport: its parameters and optimizer state live in
    its segment, its clients fold their gradients into them and read them directly, and
    the shard watches (finish, statistics), runs shard 0's duties and serves snapshots and
    checkpoints."""

    def __init__(self, comm: MPI.Comm, segments: SharedSegments, topology: Topology,
                 size: int, optimizer: ShardRule, initial: np.ndarray | None,
                 gradients_before: int = 0):
        self.topology, self.size = topology, size
        self.ranges = balanced_ranges(size, topology.ps_shards)
        self._open = OpenWindows(comm, segments)
        self.rank = topology.world_rank
        self.start, self.stop = self.ranges[self.rank]
        self.num_clients = topology.world_size - topology.ps_shards
        self._optimizer = optimizer
        self._finished = False
        self.stats = ShardStats(transport="shared")
        with segments.lock(self.rank, exclusive=True) as seg:
            seg.header[:] = 0
            seg.header[BEFORE] = gradients_before
            seg.clients[:] = 0
            seg.control[:] = 0
            seg.params[:] = 0 if initial is None else own_slice(initial, self.start, self.stop)
            for name, value in optimizer.state().items():
                np.copyto(seg.state[name], value)
            _bind_state(optimizer, seg.state)

    def adopt(self, rank: int) -> SharedMemoryShard:
        """Shard `rank`'s slice, read and checkpointed from this rank once that shard is
        lost (cluster.standby_shards). Its segment outlives its process: every rank of
        the node maps it, its clients go on folding into it, and a dead process's locks
        are released by the kernel, so no update is lost. The view writes nothing; it
        has its own copy of the update rule, pointed at that segment's state. Local."""
        view = copy.copy(self)
        view.rank = rank
        view.start, view.stop = self.ranges[rank]
        view.stats = ShardStats(transport="shared")
        view._optimizer = copy.copy(self._optimizer)
        _bind_state(view._optimizer, self._open.live().segments[rank].state)
        return view

    def _lock(self, exclusive: bool, shard: int | None = None):
        return self._open.live().lock(self.rank if shard is None else shard, exclusive)

    @property
    def finished(self) -> bool:
        """True once every client has called finish() (its pushes were applied then)."""
        return self._finished

    @property
    def optimizer(self) -> ShardRule:
        """The update rule of this shard's slice, working on the segment's state."""
        return self._optimizer

    def watch_clients(self, gone: Callable[[int], bool], give_up_s: float = GIVE_UP_S,
                      ended: Callable[[int], bool] | None = None) -> None:
        """Nothing to watch here: a client holds nothing but a segment's lock, which the
        kernel releases when its process dies. Local."""

    @property
    def version(self) -> int:
        """Updates applied to this shard's parameters so far (read under the lock)."""
        with self._lock(exclusive=False) as seg:
            return int(seg.header[VERSION])

    @property
    def gradients_applied(self) -> int:
        """As ParameterServerShard.gradients_applied (read under the lock)."""
        with self._lock(exclusive=False) as seg:
            return int(seg.header[BEFORE] + seg.header[APPLIED])

    def parameters(self, copy: bool = True) -> np.ndarray:
        """A copy of this shard's current parameters, under the shared lock (always a
        copy: clients write the segment; `copy` is ParameterServerShard's signature)."""
        with self._lock(exclusive=False) as seg:
            return seg.params.copy()

    def checkpoint_state(self) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
        """As ParameterServerShard.checkpoint_state, all copied under one shared lock."""
        with self._lock(exclusive=False) as seg:
            kept = saved_state(self._optimizer)
            return (seg.params.copy(), {name: value.copy() for name, value in seg.state.items()
                                        if name in kept},
                    int(seg.header[VERSION]))

    def set_parameters(self, values: np.ndarray) -> None:
        """Overwrite this shard's parameters under the exclusive lock; counters unchanged."""
        with self._lock(exclusive=True) as seg:
            if values.shape != seg.params.shape:
                raise ValueError(f"shard {self.rank} holds {seg.params.size} parameters, "
                                 f"got shape {values.shape}")
            seg.params[:] = values

    def read_counters(self) -> tuple[int, int, int]:
        """(pushes applied, clients finished, pulls published by the clients so far: each
        publishes its count with its pushes and at finish), under the shared lock."""
        with self._lock(exclusive=False) as seg:
            done, pulls = (int(x) for x in seg.clients[:, [FINISHED, PULLED]].sum(axis=0))
            return int(seg.header[APPLIED]), done, pulls

    def read_run_control(self) -> ControlView:
        """The run control block (shard 0's is in use), read under the shared lock."""
        with self._lock(exclusive=False) as seg:
            block = seg.control.copy()
        return rc.ControlView.from_block(block)

    def add_run_control(self, slot: int, value: int) -> None:
        """Add `value` to a slot of the run control block, under the exclusive lock."""
        with self._lock(exclusive=True) as seg:
            seg.control[slot] += value

    def snapshot(self, out: np.ndarray, pieces: PieceMap | None = None) -> np.ndarray:
        """The whole parameter vector into `out`, each shard's slice copied under that
        shard's shared lock (one at a time); returns each slice's version. With
        `pieces`, only those, gathered into the compact `out`."""
        size = self.size if pieces is None else pieces.size
        if out.dtype != DTYPE or out.shape != (size,) or not out.flags.c_contiguous:
            raise ValueError(f"snapshot buffer must be a contiguous float32 vector of "
                             f"{size} elements, got {out.dtype} {out.shape}")
        versions = np.zeros(self.topology.ps_shards, dtype=np.int64)
        for shard, (start, stop) in enumerate(self.ranges):
            with self._lock(False, shard) as seg:
                if pieces is None:
                    np.copyto(out[start:stop], seg.params)
                elif shard in pieces.shards:
                    np.take(seg.params, pieces.index(shard), out=pieces.part(out, shard))
                versions[shard] = seg.header[VERSION]
        return versions

    def fold(self) -> int:
        """Nothing to fold: on this transport the clients fold their own pushes."""
        return 0

    def serve_once(self) -> bool:
        """One poll: statistics and finish, read from the segment. Returns False: nothing
        a client waits for happens here, so the shard may back off to its longest sleep."""
        self.stats.polls += 1
        if self.stats.polls == 1:
            with self._lock(exclusive=True) as seg:
                seg.header[SERVING] = 1
        with self._lock(exclusive=False) as seg:  # a poll never delays a pull
            self.stats.folds = int(seg.header[VERSION])
            self.stats.pushes = int(seg.header[APPLIED])
            done, self.stats.pulls = (int(x) for x in
                                      seg.clients[:, [FINISHED, PULLED]].sum(axis=0))
        # A client finishes after its last push returned, and pushes fold synchronously.
        self._finished = done == self.num_clients
        return False

    def serve(self, backoff: Backoff | None = None,
              between: Callable[[], bool] | None = None,
              until: Callable[[], bool] | None = None) -> ShardStats:
        """As ParameterServerShard.serve, but always with the sparse SHARED_POLL_S back-off
        (`backoff`, tuned for RMA clients, is not needed: no client waits for a poll)."""
        return serve_polls(self, Backoff(*SHARED_POLL_S), between, until)

    def free(self) -> None:
        """Serve until every client has finished, then free the segments. Collective over
        the world communicator (with every client's free())."""
        self.serve()
        self._open.free(waiting_backoff())


class SharedMemoryClient(ParameterClient):
    """A client on the shared-memory transport: a push folds the gradient into every
    shard's segment with the shard's optimizer, under the segment's exclusive lock, and
    returns when it is applied; a pull copies every segment's parameters under its shared
    lock. No shard takes part. restrict_to: only the pieces are folded and copied; shards
    without any are not touched, except shard 0 for a control exchange."""

    def __init__(self, comm: MPI.Comm, segments: SharedSegments, topology: Topology,
                 size: int, optimizer: RuleFactory, push_dtype: str = "float32"):
        self.topology, self.size = topology, size
        self.ranges = balanced_ranges(size, topology.ps_shards)
        self._open = OpenWindows(comm, segments)
        self._ledger = PullLedger(self.ranges)
        self.pulled_versions = self._ledger.pulled_versions
        self.applied_pushes = self._ledger.applied_pushes
        self.staleness = self._ledger.staleness
        self.bytes_sent = 0
        self.pull_in_flight = False  # nothing is ever left in flight here
        self._finished = False
        self._faults = PushFaults()  # test-only
        # optimizer.push_dtype = "bfloat16": each push is rounded to bfloat16 here, as the
        # RMA transport's pushes are, and folded from this float32 copy (one node moves no
        # bytes over a wire, so nothing is narrowed in memory): the same numbers train.
        self._rounded = (np.zeros(size, dtype=np.float32) if push_dtype == "bfloat16"
                         else None)
        self._received = 0
        self._slot = topology.world_rank - topology.ps_shards
        self._pulls = 0  # pulls made (each reads every shard), published under EXCLUSIVE
        # One optimizer per shard, working on that shard's state arrays (a copy of what
        # the factory gives, in case it hands out one object every time).
        self._optimizers = []
        for shard, (start, stop) in enumerate(self.ranges):
            local = copy.copy(optimizer(stop - start))
            _bind_state(local, segments.segments[shard].state)
            self._optimizers.append(local)
        self._pieces = self._piece_folders()
        self._served = np.zeros(len(self.ranges), dtype=bool)
        self._pull_map: PieceMap | None = None  # use_pieces: compact pulls and pushes
        self._push_map: PieceMap | None = None

    def hang_in_next_push(self, faults: Any) -> None:
        """As ParameterClient.hang_in_next_push: it holds a segment's exclusive lock."""
        self._faults.hang = faults.hang

    def kill_in_next_push(self, faults: Any) -> None:
        """As ParameterClient.kill_in_next_push: holding a segment's exclusive lock."""
        self._faults.hang = faults.kill

    def linger_in_exchanges(self, seconds: float) -> None:
        """Nothing to linger in: an exchange here holds no epoch (a lock is held only for
        the exchange's own loads and stores)."""
        self._faults.linger_s = seconds

    def _check_vector(self, vector: np.ndarray, what: str) -> None:
        check_vector(vector, self.size, what)

    def _check_open(self) -> SharedSegments:
        segments = self._open.live()
        if self._finished:
            raise RuntimeError("this client already called finish()")
        return segments

    def _wait_served(self, shards: Sequence[int]) -> None:
        """Before the first access to a shard: wait, sleeping, until it has polled once."""
        backoff = Backoff(min_sleep_s=20e-6, max_sleep_s=1e-3)
        guard = watchdog.current()
        for shard in shards:
            if self._served[shard]:
                continue
            with guard.waiting(f"shard {shard} to start serving", (shard,)):
                while not self._served[shard]:
                    with self._open.live().lock(shard, exclusive=False) as seg:
                        self._served[shard] = bool(seg.header[SERVING])
                    if not self._served[shard]:
                        guard.check()
                        backoff.wait()

    def restrict_to(self, pieces: Sequence[tuple[int, int]]) -> None:
        """As ParameterClient.restrict_to."""
        self._ledger.restrict_to(pieces)
        self._pieces = self._piece_folders()

    def _piece_folders(self) -> list[list[tuple[int, int, ShardRule]]]:
        """Per shard: (start, stop) of each piece in the vector and an optimizer working
        on the piece's part of the shard's state (the whole range: the shard's own)."""
        pieces = []
        segments = self._open.live()
        for shard, (low, high) in enumerate(self.ranges):
            folders = []
            for start, stop in self._ledger.segments[shard]:
                if (start, stop) == (low, high):
                    folders.append((start, stop, self._optimizers[shard]))
                    continue
                part = copy.copy(self._optimizers[shard])
                _bind_state(part, {name: view[start - low : stop - low] for name, view
                                   in segments.segments[shard].state.items()})
                folders.append((start, stop, part))
            pieces.append(folders)
        return pieces

    def use_pieces(self, pulls: PieceMap | None, pushes: PieceMap | None) -> None:
        """As ParameterClient.use_pieces: a pull gathers the pieces under each shard's
        shared lock, a push folds them with the shard's rule at those coordinates alone
        (ShardRule.apply_at) under its exclusive lock."""
        if self._rounded is not None and (pulls is not None or pushes is not None):
            raise ValueError("bfloat16 pushes of pieces are not supported")
        self._pull_map, self._push_map = pulls, pushes
        if pushes is not None:
            self._ledger.touched = touched_mask(len(self.ranges), pushes.shards)

    def _size_of(self, vector: np.ndarray, plan: PieceMap | None, what: str) -> None:
        check_vector(vector, self.size if plan is None else plan.size, what)

    def _read_pieces(self, seg: _Segment, shard: int, out: np.ndarray) -> None:
        """Gather this client's pull pieces of a segment into `out`, and its version."""
        plan = self._pull_map
        if shard in plan.shards:
            np.take(seg.params, plan.index(shard), out=plan.part(out, shard))
            self._received += int(plan.count[shard]) * DTYPE().itemsize
            self._ledger.headers[shard] = seg.header[VERSION], seg.header[APPLIED]

    def _fold_pieces(self, seg: _Segment, shard: int, grad: np.ndarray) -> None:
        """Apply this client's push pieces of `grad` at their coordinates alone as the
        shard's next update (exclusive lock held)."""
        plan = self._push_map
        version = int(seg.header[VERSION])
        self._ledger.taken[shard, 0] = version
        info = StepInfo(update=int(seg.header[BEFORE] + seg.header[APPLIED]),
                        version=version, fetched=int(self.pulled_versions[shard]))
        self._optimizers[shard].apply_at(seg.params, plan.part(grad, shard),
                                         plan.index(shard), info)
        self.bytes_sent += int(plan.count[shard]) * DTYPE().itemsize
        seg.header[VERSION] = version + 1
        seg.header[APPLIED] += 1
        seg.clients[self._slot, PULLED] = self._pulls
        self._faults.in_push(f"holding the lock on shard {shard}")

    @property
    def bytes_received(self) -> int:
        """Parameter data copied out of the shards' segments so far, in bytes."""
        return self._received

    def _rounded_to_push_dtype(self, grad: np.ndarray) -> np.ndarray:
        """`grad` as this client pushes it: itself, or (bfloat16 pushes) its pieces
        rounded to bfloat16 in a copy."""
        if self._rounded is None:
            return grad
        for pieces in self._pieces:
            for start, stop, _ in pieces:
                kernels.bf16_round(grad[start:stop], self._rounded[start:stop])
        return self._rounded

    def _read(self, seg: _Segment, shard: int, out: np.ndarray) -> None:
        """Copy this client's pieces of a segment's parameters, and its version."""
        low = self.ranges[shard][0]
        for start, stop, _ in self._pieces[shard]:
            np.copyto(out[start:stop], seg.params[start - low : stop - low])
            self._received += (stop - start) * DTYPE().itemsize
        self._ledger.headers[shard] = seg.header[VERSION], seg.header[APPLIED]

    def _fold(self, seg: _Segment, shard: int, grad: np.ndarray,
              control: ControlExchange | None, out: np.ndarray | None = None) -> None:
        """Apply this client's pieces of `grad` as the shard's next update (with `out`, also
        copy the new values of its pieces there, in the same pass), and the control
        operations on shard 0 (exclusive lock held)."""
        if self._push_map is not None:
            if shard in self._push_map.shards:
                self._fold_pieces(seg, shard, grad)
            if out is not None:
                self._read_pieces(seg, shard, out)
        elif self._ledger.touched[shard]:
            low = self.ranges[shard][0]
            version = int(seg.header[VERSION])
            update = int(seg.header[BEFORE] + seg.header[APPLIED])  # the schedule's count
            self._ledger.taken[shard, 0] = version
            # AdaRevision revises for the updates since this client's last pull.
            info = StepInfo(update=update, version=version,
                            fetched=int(self.pulled_versions[shard]))
            for start, stop, rule in self._pieces[shard]:
                copy_to = None if out is None else out[start:stop]
                # the gradient folded in, the new values copied out (float32 both ways)
                self.bytes_sent += (stop - start) * DTYPE().itemsize
                if out is not None:
                    self._received += (stop - start) * DTYPE().itemsize
                rule.apply(seg.params[start - low : stop - low], grad[start:stop], info,
                           copy_to)
            whole = self._optimizers[shard]
            if whole.revises:
                # A partitioned replica's pieces recorded only their slices of the new
                # version's gradient sum; the rest did not change in this version.
                whole.record_version(version + 1)
            seg.header[VERSION] = version + 1
            seg.header[APPLIED] += 1
            seg.clients[self._slot, PULLED] = self._pulls
            self._faults.in_push(f"holding the lock on shard {shard}")
        if control is not None and shard == CONTROL_SHARD:
            control.apply(seg.control)

    def _progress(self) -> None:
        """Let MPI progress, as every RMA call of the other transport does by itself: the
        caller's nonblocking operations (a partitioned replica's messages to its partners,
        a replica's statistics to rank 0) advance only while their ranks are inside MPI.
        One Iprobe on the private communicator (where nothing is ever sent), ~1 us."""
        self._open.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)

    def _pushed_to(self, control: ControlExchange | None) -> list[int]:
        """The shards a push locks: those it touches, and shard 0 for a control exchange."""
        pulled = () if self._pull_map is None else self._pull_map.shards
        return [shard for shard in self.topology.shard_ranks
                if self._ledger.touched[shard] or (control is not None and shard == CONTROL_SHARD)
                or (self._push_map is not None and shard in pulled)]

    def pull(self, out: np.ndarray) -> np.ndarray:
        """As ParameterClient.pull: every shard's slice is one consistent snapshot."""
        self._size_of(out, self._pull_map, "pull buffer")
        segments = self._check_open()
        shards = ([int(s) for s in np.flatnonzero(self._ledger.touched)]
                  if self._pull_map is None else self._pull_map.shards)
        self._wait_served(shards)
        for shard in shards:
            with segments.lock(shard, exclusive=False) as seg:
                if self._pull_map is None:
                    self._read(seg, shard, out)
                else:
                    self._read_pieces(seg, shard, out)
        self._pulls += 1
        self._progress()
        return self._ledger.pulled()

    def push(self, grad: np.ndarray, control: ControlExchange | None = None) -> np.ndarray:
        """As ParameterClient.push, but the gradient is applied when it returns."""
        self._size_of(grad, self._push_map, "gradient")
        segments = self._check_open()
        self._wait_served(self._pushed_to(control))
        grad = self._rounded_to_push_dtype(grad)
        for shard in self._pushed_to(control):
            with segments.lock(shard, exclusive=True) as seg:
                self._fold(seg, shard, grad, control)
        self._progress()
        return self._ledger.pushed()

    def push_pull(self, grad: np.ndarray, out: np.ndarray,
                  control: ControlExchange | None = None) -> tuple[np.ndarray, np.ndarray]:
        """As ParameterClient.push_pull; the parameters fetched always contain `grad` (the
        copy is made under the same exclusive lock, right after the fold)."""
        self._size_of(grad, self._push_map, "gradient")
        self._size_of(out, self._pull_map, "pull buffer")
        segments = self._check_open()
        self._wait_served(self._pushed_to(control))
        grad = self._rounded_to_push_dtype(grad)
        self._pulls += 1  # published by the folds below, with this pull
        for shard in self._pushed_to(control):
            with segments.lock(shard, exclusive=True) as seg:
                self._fold(seg, shard, grad, control, out)
                if self._ledger.touched[shard] and self._push_map is None:
                    self._ledger.headers[shard] = seg.header[VERSION], seg.header[APPLIED]
        self._progress()
        return self._ledger.pushed(), self._ledger.pulled()

    def push_pull_own(self, grad: np.ndarray, out: np.ndarray,
                      control: ControlExchange | None = None) -> tuple[np.ndarray, int]:
        """As ParameterClient.push_pull_own: here push_pull's copy, made right after the
        fold, always holds the push, so no extra pull is ever needed."""
        return self.push_pull(grad, out, control)[0], 0

    def push_pull_overlapped(self, grad: np.ndarray, out: np.ndarray | None,
                             control: ControlExchange | None = None) -> tuple[np.ndarray, bool]:
        """As ParameterClient.push_pull_overlapped, without the overlap: on one node the
        client folds its own push and copies the parameters out while it holds the
        lock, so there is no transfer to hide. The pull (into `out`) is complete on
        return, and reported so."""
        if out is None:
            return self.push(grad, control), False
        return self.push_pull(grad, out, control)[0], True

    def drain(self) -> bool:
        """Nothing is left in flight on this transport: False."""
        return False

    def catch_up(self, out: np.ndarray) -> int:
        """0: a push returns once applied, so a pull after it always holds it (and
        push_pull's copy is made right after the fold). Local."""
        return 0

    def wait_applied(self) -> None:
        """Nothing to wait for: a push returns once applied. Local."""

    def exchange(self, control: ControlExchange) -> None:
        """Only the control operations, under shard 0's exclusive lock."""
        segments = self._check_open()
        self._wait_served([CONTROL_SHARD])
        with segments.lock(CONTROL_SHARD, exclusive=True) as seg:
            control.apply(seg.control)

    def finish(self) -> None:
        """Publish this client's pull count and mark it finished on every shard (its own
        slots, under the exclusive lock). Idempotent."""
        if self._finished:
            return
        segments = self._check_open()
        for shard in self.topology.shard_ranks:
            with segments.lock(shard, exclusive=True) as seg:
                seg.clients[self._slot, PULLED] = self._pulls
                seg.clients[self._slot, FINISHED] = 1
        self._finished = True

    def free(self) -> None:
        """finish() if not yet done, then free the segments. Collective over the world
        communicator (with every shard's free())."""
        self.finish()
        self._open.free(waiting_backoff())
