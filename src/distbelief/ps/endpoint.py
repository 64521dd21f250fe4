"""The parameter server's public interface, whatever the transport: ParameterServerShard and
ParameterClient (the endpoints open_parameter_server returns), ServerSpec (what every rank
opens it with), the shard's update rule (a ShardRule), and the pieces both transports
compose: OpenWindows (the windows' life and collective free), PullLedger (what a client
saw of the shards), PushFaults (test-only hooks), the header constants.

The flat float32 parameter vector of `size` elements is split into S contiguous balanced
ranges (`distbelief.model.layout.balanced_ranges`); shard s (world rank s, see topology.py) owns
range s. Two transports, siblings behind this interface, chosen once by `open_parameter_server`
for the whole job from transport.OPENERS (every rank agrees; `requested_transport` for how
to force one):

- "shared", when every rank of the job is on one node (shared_memory.py): a client
  folds its own gradient into the shard's parameters with the shard's optimizer, and
  copies parameters out, directly in the shard's shared segment under a kernel
  reader-writer lock. No shard is on the critical path of a step.
- "rma" otherwise: replicas push gradients and pull parameters with passive-target RMA
  (float data by Put and Get, counters by integer atomics); the shard folds the pushed
  gradients into its parameters with its optimizer (Adagrad or SGD): rma_windows.py (the
  windows; docs/rma-protocol.md says why every access is legal), rma_shard.py,
  rma_client.py, rma.py (the opener).

Why both: with MPICH on one node every RMA round needs a pass through the target's
progress engine, and the read-your-writes fetch puts the shard's fold on the critical
path too; a 2 ms step paid ~1.25 ms of RMA with a shard that sleeps between polls
(benchmarks/RMA_NOTES.md sections 6-8). In shared memory the same step pays a lock (a few
microseconds), the optimizer step it would pay anyway, and one 2.7 MB copy (~0.1 ms).
Mixing the two in one job (node-local clients on shared memory, the others on RMA) is
not done: Downpour's run control needs one atomic location for the step claims that every
client can reach, and a window that both RMA and plain loads and stores update would need
the shard's progress engine for every lock again.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

from distbelief.errors import ConfigError
from distbelief.model.layout import DTYPE, balanced_ranges
from distbelief.model.optimizers import ShardRule
from distbelief.ps import run_control as rc
from distbelief.ps.run_control import ControlExchange, ControlView
from distbelief.ps.stats import ShardStats, StalenessStats
from distbelief.runtime.backoff import Backoff
from distbelief.runtime.communicators.topology import Topology
from distbelief.runtime.health import watchdog

HEADER_BYTES = 64  # counters at the head of each window; data starts cache-line aligned
COUNTER_BYTES = 8
CONTROL_SHARD = 0  # holds Downpour's run control block (distbelief.ps.run_control)
# int64 slots of a published parameter buffer's header (RMA) and of a shared segment's
VERSION, APPLIED = 0, 1
PUSH_DTYPES = ("float32", "bfloat16")
"""How a pushed gradient travels (optimizer.push_dtype; rma_windows.PUSH_BYTES)."""
GIVE_UP_S = 2.0
"""The default bound a shard is told for a client that shows no sign of life (Downpour
passes its heartbeat timeout to `watch_clients`; rma_shard says what it bounds)."""

RuleFactory = Callable[[int], ShardRule]
"""Slice length -> the update rule for that slice (distbelief.model.optimizers.ShardRule:
an optimizer_for optimizer, or another rule such as EASGD's center update)."""

TRANSPORT_ENV = "DISTBELIEF_PS_TRANSPORT"
"""Environment variable naming the transport when open_parameter_server is not told:
"auto" (the default: shared memory when every rank is on one node, else RMA), "shared"
(shared memory or a ConfigError), "rma" (always RMA, e.g. to test the multi-node path)."""


def saved_state(rule: ShardRule) -> dict[str, np.ndarray]:
    """The live state arrays a checkpoint keeps (ShardRule.saved_state)."""
    return rule.saved_state()


@dataclass(frozen=True)
class ServerSpec:
    """What every rank opens the parameter server with: the same on every rank, but for
    `initial`. `rule(n)` builds the update rule of a slice of n parameters (on shards; on
    the shared transport also on clients, once per shard, and once with n = 1 on every
    rank to see whether its state can be shared). `initial`: the full initial parameter
    vector (each shard copies its slice) or, on a shard, its slice alone (what a lean
    start builds: Network.init_slice); None means zeros. `control_replicas` > 0 reserves
    Downpour's run control block (distbelief.ps.run_control) for that many replicas on
    shard 0 (every shard's windows have the same layout). `gradients_before`: on a shard,
    the gradients its slice applied in earlier jobs (its checkpoint says), where the
    schedule's count (StepInfo.update) continues. `push_dtype` (PUSH_DTYPES): "bfloat16"
    rounds each pushed gradient to bfloat16; over RMA the push slots hold bfloat16 (half
    the bytes Put), on shared memory the client folds the rounded float32 gradient."""

    topology: Topology
    size: int
    rule: RuleFactory
    initial: np.ndarray | None = None
    control_replicas: int = 0
    gradients_before: int = 0
    push_dtype: str = "float32"
    pieces: bool = False
    """Clients push pieces (ParameterClient.use_pieces): over RMA each push slot then
    has a header saying which (rma_windows.SLOT_HEADER_BYTES)."""
    push_slots: int | None = None
    """TEST-ONLY: every RMA shard's push slots, set by the algorithm from an armed `slots`
    fault (distbelief.runtime.launching.faults); None: rma_windows.push_slots's count."""

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """Each shard's [start, stop) of the vector."""
        return balanced_ranges(self.size, self.topology.ps_shards)

    @property
    def control_bytes(self) -> int:
        """Bytes of the run control block in every shard's windows (0: none)."""
        return rc.block_bytes(self.control_replicas)

    def check(self, comm: MPI.Comm) -> None:
        """Raise ConfigError (ValueError for `initial`) if this spec does not fit `comm`.
        Local: a bad configuration raises on every rank before any communication."""
        topology = self.topology
        if self.push_dtype not in PUSH_DTYPES:
            raise ConfigError(f"push_dtype {self.push_dtype!r} must be one of "
                              f"{', '.join(PUSH_DTYPES)}")
        if self.size < topology.ps_shards:
            raise ConfigError(f"cannot shard {self.size} parameters over "
                              f"{topology.ps_shards} parameter-server shards; use at most "
                              f"{self.size} shards")
        if comm.Get_size() != topology.world_size:
            raise ConfigError(f"topology is for {topology.world_size} ranks, the "
                              f"communicator has {comm.Get_size()}")
        if self.initial is not None:
            size = self.size
            own = self.ranges[topology.shard_index] if topology.is_shard else (0, size)
            if self.initial.dtype != DTYPE or self.initial.shape not in (
                    (size,), (own[1] - own[0],)):
                raise ValueError(f"initial parameters must be float32 of shape ({size},) "
                                 f"or, on a shard, its slice's ({own[1] - own[0]},); got "
                                 f"{self.initial.dtype} {self.initial.shape}")


class Windows(Protocol):
    """A transport's windows (rma_windows.ShardWindows, shared_memory.SharedSegments)."""

    def free(self) -> None: ...


class OpenWindows:
    """An endpoint's private communicator and its transport's windows, from creation to
    the collective free; every endpoint of either transport holds one."""

    def __init__(self, comm: MPI.Comm, windows: Windows):
        self._comm: MPI.Comm | None = comm
        self._windows: Windows | None = windows

    @property
    def comm(self) -> MPI.Comm:
        """The private communicator (nothing but the endpoints' own traffic uses it)."""
        self.live()
        return self._comm

    def live(self) -> Any:
        """The windows; RuntimeError once freed."""
        if self._windows is None:
            raise RuntimeError("parameter server already freed")
        return self._windows

    def free(self, backoff: Backoff) -> None:
        """Collective over the world communicator, the same on every rank: wait for every
        rank (Ibarrier polled with back-off sleeps), free the windows, then the private
        communicator."""
        windows = self.live()
        request = self._comm.Ibarrier()
        guard = watchdog.current()
        others = [r for r in range(self._comm.Get_size()) if r != self._comm.Get_rank()]
        with guard.waiting("every rank, to free the parameter server's windows", others):
            while not request.Test():
                guard.check(request.Test)
                backoff.wait()
            # Win_free synchronises too: a rank killed after the barrier, before it, would
            # leave the others inside it for ever. Declared, the watchdog's thread ends the
            # job once the rank is found gone (seen: benchmarks/spare_kills.py).
            windows.free()
        self._windows = None
        self._comm.Free()
        self._comm = None


def waiting_backoff() -> Backoff:
    """For ranks with nothing to serve: back off up to 10 ms."""
    return Backoff(max_sleep_s=10e-3)


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to whole HEADER_BYTES (cache lines)."""
    return -(-nbytes // HEADER_BYTES) * HEADER_BYTES


def own_slice(initial: np.ndarray, start: int, stop: int) -> np.ndarray:
    """A shard's initial values: `initial` itself when it is already the slice [start,
    stop) (a lean start), else that slice of the full vector."""
    return initial if initial.size == stop - start else initial[start:stop]


def check_vector(vector: np.ndarray, size: int, what: str) -> None:
    """ValueError unless `vector` is a contiguous float32 vector of `size` elements."""
    if vector.dtype != DTYPE or vector.shape != (size,) or not vector.flags.c_contiguous:
        raise ValueError(f"{what} must be a contiguous float32 vector of {size} "
                         f"elements, got {vector.dtype} {vector.shape}")


def serve_polls(shard: ParameterServerShard, backoff: Backoff,
                between: Callable[[], bool] | None,
                until: Callable[[], bool] | None) -> ShardStats:
    """ParameterServerShard.serve's loop, on either transport: serve_once and `between`
    until `until()` (or the shard's `finished`), sleeping under `backoff` after a poll
    without traffic; adds the loop's CPU and wall time to the shard's stats."""
    c0, t0 = time.process_time(), time.perf_counter()
    while not (until() if until is not None else shard.finished):
        traffic = shard.serve_once()
        if between is not None:
            traffic = between() or traffic
        if traffic:
            backoff.reset()
        else:
            backoff.wait()
    shard.stats.cpu_s += time.process_time() - c0
    shard.stats.wall_s += time.perf_counter() - t0
    return shard.stats


def touched_mask(shards: int, touched: Iterable[int]) -> np.ndarray:
    """A bool per shard: whether it is in `touched` (np.isin's answer, without its cost on
    a few shards, paid at every step of a row replica)."""
    mask = np.zeros(shards, dtype=bool)
    mask[list(touched)] = True
    return mask


def piece_positions(ranges: np.ndarray) -> np.ndarray:
    """The positions [start, stop) of each of the (n, 2) `ranges`, in order."""
    lengths = ranges[:, 1] - ranges[:, 0]
    shift = np.repeat(ranges[:, 0] - (np.cumsum(lengths) - lengths), lengths)
    return shift + np.arange(int(lengths.sum()), dtype=np.int64)


class PieceMap:
    """Pieces of the vector ([start, stop) ranges, sorted and disjoint) that a client moves
    through a compact buffer holding them back to back, in order: a replica's row cache
    of a row-sharded sparse model (model.sparse_rows.RowCache.pieces). Per shard: the
    pieces clipped to its range, which lie back to back in the compact buffer too, so
    shard s moves the compact buffer's [at[s], at[s] + count[s])."""

    def __init__(self, pieces: np.ndarray, ranges: Sequence[tuple[int, int]]):
        pieces = np.asarray(pieces, dtype=np.int64).reshape(-1, 2)
        if len(pieces) and (np.any(pieces[:, 1] <= pieces[:, 0])
                            or np.any(pieces[1:, 0] < pieces[:-1, 1])):
            raise ValueError("pieces must be non-empty [start, stop) ranges, sorted and "
                             "disjoint")
        starts_at = np.zeros(len(pieces) + 1, dtype=np.int64)
        np.cumsum(pieces[:, 1] - pieces[:, 0], out=starts_at[1:])
        self.size = int(starts_at[-1])
        self.pieces = pieces
        self._index: dict[int, np.ndarray] = {}
        self.shards: list[int] = []
        self.at = np.zeros(len(ranges), dtype=np.int64)
        self.count = np.zeros(len(ranges), dtype=np.int64)
        self.local: list[np.ndarray] = []  # per shard: (n, 2) ranges within its slice
        # Shard s's pieces are pieces[first[s]:end[s]] (sorted and disjoint: those that
        # stop after its low and start before its high), the outer two clipped to it.
        lows = np.array([low for low, _ in ranges], dtype=np.int64)
        highs = np.array([high for _, high in ranges], dtype=np.int64)
        firsts = np.searchsorted(pieces[:, 1], lows, side="right")
        ends = np.searchsorted(pieces[:, 0], highs, side="left")
        for s, (low, high) in enumerate(ranges):
            first, end = int(firsts[s]), int(ends[s])
            if first >= end:
                self.local.append(np.empty((0, 2), dtype=np.int64))
                continue
            local = pieces[first:end] - low
            local[0, 0] = max(local[0, 0], 0)
            local[-1, 1] = min(local[-1, 1], high - low)
            self.local.append(local)
            self.shards.append(s)
            self.at[s] = starts_at[first] + max(low - pieces[first, 0], 0)
            self.count[s] = int(starts_at[end] - starts_at[first]) - max(
                low - pieces[first, 0], 0) - max(pieces[end - 1, 1] - high, 0)

    def index(self, shard: int) -> np.ndarray:
        """The positions within shard `shard`'s slice of its part of the buffer, in order."""
        if shard not in self._index:
            self._index[shard] = self._positions(shard)
        return self._index[shard]

    def _positions(self, shard: int) -> np.ndarray:
        return piece_positions(self.local[shard])

    def part(self, buffer: np.ndarray, shard: int) -> np.ndarray:
        """Shard `shard`'s part of a compact buffer (a view)."""
        return buffer[self.at[shard]:self.at[shard] + self.count[shard]]


class PullLedger:
    """What a client of either transport records of the shards: the pieces it moves per
    shard (restrict_to), the version and applied pushes of each shard's last pull, the
    version each shard had when a push reached it, and the staleness that follows."""

    def __init__(self, ranges: Sequence[tuple[int, int]]):
        shards = len(ranges)
        self.ranges = list(ranges)
        self.segments: list[list[tuple[int, int]]] = [[r] for r in self.ranges]
        self.touched = np.ones(shards, dtype=bool)
        self.headers = np.zeros((shards, 2), dtype=np.int64)  # VERSION, APPLIED as read
        self.taken = np.zeros((shards, 1), dtype=np.int64)  # the version a push found
        self.pulled_versions = np.zeros(shards, dtype=np.int64)
        self.applied_pushes = np.zeros(shards, dtype=np.int64)
        self.staleness = StalenessStats()

    def restrict_to(self, pieces: Sequence[tuple[int, int]]) -> None:
        """Move only `pieces` ([start, stop) ranges of the vector) from now on: each
        shard's share of them, and which shards hold any."""
        segments: list[list[tuple[int, int]]] = [[] for _ in self.ranges]
        for shard, (low, high) in enumerate(self.ranges):
            for start, stop in sorted(pieces):
                start, stop = max(start, low), min(stop, high)
                if start < stop:
                    segments[shard].append((start, stop))
        self.segments = segments
        self.touched = np.array([bool(s) for s in segments])

    def touched_shards(self) -> list[int]:
        """The shards this client moves data with, in order."""
        return [s for s in range(len(self.ranges)) if self.touched[s]]

    def pulled(self) -> np.ndarray:
        """Adopt the headers read as the last pull's; returns a copy of its versions."""
        self.pulled_versions[:] = self.headers[:, VERSION]
        self.applied_pushes[:] = self.headers[:, APPLIED]
        return self.pulled_versions.copy()

    def pushed(self) -> np.ndarray:
        """A push's staleness per shard: the updates the shard had applied when the push
        reached it (`taken`), after the version its gradient was computed on (the last
        pull's); recorded for the shards it touches."""
        staleness = self.taken[:, 0] - self.pulled_versions
        self.staleness.add(staleness[self.touched])
        return staleness


class PushFaults:
    """TEST-ONLY (distbelief.runtime.launching.faults): what a client's next push is told to do
    (Faults.hang or .kill, run with where it is), and how long each exchange lingers."""

    def __init__(self) -> None:
        self.hang: Callable[[str], Any] | None = None
        self.linger_s = 0.0

    def in_push(self, where: str) -> None:
        """Run the hang or kill the next push was given, if any."""
        if self.hang is not None:
            self.hang(f"in a push, {where}")


class ParameterServerShard(ABC):
    """One shard of the parameter server: owns parameters [start, stop) of the vector and
    applies pushed gradients with its update rule. Returned by open_parameter_server on
    shard ranks; rma_shard.RmaShard and shared_memory.SharedMemoryShard implement it.
    Every method is local or one-sided on its own windows, but `snapshot` (reads the
    other shards) and `free` (collective)."""

    topology: Topology
    size: int
    ranges: list[tuple[int, int]]
    rank: int  # its world rank (= shard index)
    start: int
    stop: int
    num_clients: int
    stats: ShardStats

    @property
    @abstractmethod
    def version(self) -> int:
        """Updates applied to this shard's parameters so far."""

    @property
    @abstractmethod
    def gradients_applied(self) -> int:
        """Gradients (pushes) this slice has applied over the whole run, earlier jobs
        included: the position of the learning-rate schedule, kept in checkpoints."""

    @property
    @abstractmethod
    def finished(self) -> bool:
        """True once every client has called finish() and every push is applied."""

    @property
    @abstractmethod
    def optimizer(self) -> ShardRule:
        """The update rule of this shard's slice (its state goes into checkpoints)."""

    @abstractmethod
    def parameters(self, copy: bool = True) -> np.ndarray:
        """This shard's current parameters (a copy, for checkpoints; `copy=False` may
        give them read-only, valid until the shard serves again)."""

    @abstractmethod
    def checkpoint_state(self) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
        """Copies of the parameters and of the rule's saved state, and the version, taken
        together: what a checkpoint writes."""

    @abstractmethod
    def set_parameters(self, values: np.ndarray) -> None:
        """Overwrite this shard's parameters (restores, tests); a concurrent pull sees
        the old or the new slice, never a mix."""

    @abstractmethod
    def read_counters(self) -> tuple[int, int, int]:
        """(pushes completed, clients finished, pulls served so far)."""

    @abstractmethod
    def watch_clients(self, gone: Callable[[int], bool], give_up_s: float = GIVE_UP_S,
                      ended: Callable[[int], bool] | None = None) -> None:
        """Let the shard ask whether a client (world rank) is gone (`gone`), or known to
        have ended (`ended`), when something it holds stays held."""

    @abstractmethod
    def read_run_control(self) -> ControlView:
        """Downpour's run control block as it stands on this shard (shard 0's is used)."""

    @abstractmethod
    def add_run_control(self, slot: int, value: int) -> None:
        """Add `value` to slot `slot` of this shard's run control block."""

    @abstractmethod
    def snapshot(self, out: np.ndarray, pieces: PieceMap | None = None) -> np.ndarray:
        """The whole current parameter vector into `out` (float32, the full size), or with
        `pieces` only those, back to back in the compact `out` (a sparse model's
        evaluation rows); returns each slice's version. One-sided: reads the other
        shards' slices."""

    @abstractmethod
    def fold(self) -> int:
        """Apply every push completed so far; returns how many (for tests)."""

    @abstractmethod
    def serve_once(self) -> bool:
        """One poll; True if there was traffic (the caller should poll again soon)."""

    @abstractmethod
    def serve(self, backoff: Backoff | None = None,
              between: Callable[[], bool] | None = None,
              until: Callable[[], bool] | None = None) -> ShardStats:
        """Serve until every client has called finish() (or until `until()`), running
        `between()` after every poll (True counts as traffic); returns stats."""

    @abstractmethod
    def free(self) -> None:
        """Serve until every client has finished, then free the windows. Collective over
        the world communicator (with every client's free())."""


class ParameterClient(ABC):
    """A replica's (or the coordinator's) handle on every shard: pull, push, finish.
    Returned by open_parameter_server on every non-shard rank; rma_client.RmaClient and
    shared_memory.SharedMemoryClient implement it. Every method is one-sided, to the
    shards, but `free` (collective over the world communicator)."""

    topology: Topology
    size: int
    ranges: list[tuple[int, int]]
    bytes_sent: int  # gradient data moved so far, in bytes
    pulled_versions: np.ndarray  # int64 per shard: the version of the last pull
    applied_pushes: np.ndarray  # int64 per shard: the pushes the last pull holds
    staleness: StalenessStats
    pull_in_flight: bool  # push_pull_overlapped left a pull incomplete

    @property
    @abstractmethod
    def bytes_received(self) -> int:
        """Parameter data moved so far, in bytes."""

    @abstractmethod
    def restrict_to(self, pieces: Sequence[tuple[int, int]]) -> None:
        """From now on pull and push only `pieces`, [start, stop) ranges of the vector (a
        model partition's own parameters, the paper's Figure 2); shards holding none of
        them are not touched. Local; call it before the first pull."""

    @abstractmethod
    def use_pieces(self, pulls: PieceMap | None, pushes: PieceMap | None) -> None:
        """From now on pull into a compact buffer of `pulls`' pieces and push one of
        `pushes`' (a replica's row cache of a row-sharded sparse model: the rows of its
        next batches and the dense part; docs/sparse-models.md); the shards apply a push
        at its pieces only (ShardRule.apply_at). Local; may change before every call."""

    @abstractmethod
    def pull(self, out: np.ndarray) -> np.ndarray:
        """Fetch all parameters into `out`; returns each shard's version (int64)."""

    @abstractmethod
    def push(self, grad: np.ndarray, control: ControlExchange | None = None) -> np.ndarray:
        """Push `grad` to every shard (with `control`'s operations on shard 0); returns
        the staleness per shard (updates applied after the last pull's version)."""

    @abstractmethod
    def push_pull(self, grad: np.ndarray, out: np.ndarray,
                  control: ControlExchange | None = None) -> tuple[np.ndarray, np.ndarray]:
        """push(grad, control) and pull(out) together; returns (staleness, versions)."""

    @abstractmethod
    def push_pull_own(self, grad: np.ndarray, out: np.ndarray,
                      control: ControlExchange | None = None) -> tuple[np.ndarray, int]:
        """push, then a pull that holds it (read-your-writes); returns (staleness, the
        pulls made beyond the first)."""

    @abstractmethod
    def push_pull_overlapped(self, grad: np.ndarray, out: np.ndarray | None,
                             control: ControlExchange | None = None) -> tuple[np.ndarray, bool]:
        """push and (with `out`) pull, whose transfers may complete in the next call;
        returns (staleness, whether the previous call's pull completed)."""

    @abstractmethod
    def drain(self) -> bool:
        """Complete what push_pull_overlapped left in flight; whether a pull completed."""

    @abstractmethod
    def catch_up(self, out: np.ndarray) -> int:
        """Pull until the last pull holds this client's last push; returns the pulls."""

    @abstractmethod
    def wait_applied(self) -> None:
        """Return once every shard this client touches has applied its last push and
        published it (a pull from then on holds it), without pulling."""

    @abstractmethod
    def exchange(self, control: ControlExchange) -> None:
        """Only the control operations on shard 0, without a gradient."""

    @abstractmethod
    def finish(self) -> None:
        """Tell every shard this client will push no more. Idempotent."""

    @abstractmethod
    def free(self) -> None:
        """finish() if not yet done, then free the windows. Collective over the world
        communicator (with every shard's free())."""

    @abstractmethod
    def hang_in_next_push(self, faults: Any) -> None:
        """TEST-ONLY (distbelief.runtime.launching.faults "hang"): the next push stops responding
        for ever while it holds what it holds on the shards."""

    @abstractmethod
    def kill_in_next_push(self, faults: Any) -> None:
        """TEST-ONLY (distbelief.runtime.launching.faults "killpush"): the next push kills its
        process (SIGKILL) mid-push."""

    @abstractmethod
    def linger_in_exchanges(self, seconds: float) -> None:
        """TEST-ONLY (distbelief.runtime.launching.faults "linger"): every exchange from now on
        holds its operations `seconds` longer, as a rank descheduled mid-exchange."""
