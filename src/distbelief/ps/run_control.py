"""Downpour's run control: the slots on shard 0 through which replicas and the run agree,
one-sided, without any collective that a replica takes part in.

Why one-sided: a replica may die (kill -9, a crashed node) and training must go on without
it (issue 7). A collective that includes a dead rank never completes, so replicas take
part in none after the set-up: they claim steps, report their work, learn of checkpoints,
stops and the end of the run, and publish what a checkpoint needs of them, all through
this block, read and written with every push they make anyway (no extra round trip).
Shard 0 owns the block and decides; the shards agree among themselves with collectives
over their own communicator (shards cannot be lost without losing parameters).

The block is an array of int64 slots (one float64) in shard 0's memory: in its ACCUM
window on the RMA transport, in its segment on the shared-memory one (rma_windows.py, shared_memory.py).

    global slots          written by            meaning
    CLAIMED               replicas (+claim)     steps claimed (the global step counter)
    STEPS                 replicas (+steps)     steps finished and pushed
    LEFT                  (nobody)              unused, always 0: kept so the block's
                                                  layout stays; ranks that leave tell rank 0
                                                  by message (downpour.replica._say_leaving)
    LOSS                  replicas (+sum)       sum of their minibatch losses, fixed
                                                  point (LOSS_SCALE units; loss_value)
    STOP                  shard 0               why the run stops (a STOP_* code), 0: it goes
                                                  on; set once, replaced only by an error
    STOP_ARG              shard 0               with STOP_BAD_GRADIENTS: the replica index + 1
    CHECKPOINT            shard 0 (+1)          checkpoints asked for so far
    RELEASE               shard 0 (+1)          checkpoints written (replicas may go on)
    TEARDOWN              shard 0 (once)        TEARDOWN_FREE or TEARDOWN_LEAVE, at the end
    WARM                  shard 0 (once)        the warm start is over whatever the steps
                                                  (replica 0 was lost or has finished)
    MIN_CLOCK             shard 0               with optimizer.max_staleness: the lowest
                                                  clock among the live replicas (those
                                                  counted in, neither finished nor lost);
                                                  0 otherwise (downpour.clocks)

    per replica r         written by            meaning
    BEAT                  replica r (+1)        exchanges made (its heartbeat)
    ACKED                 replica r             last checkpoint it paused for, its data
    EPOCH, POSITION,      replica r             position (TrainShard epoch and position) and
      LOCAL_STEPS                                 local steps then, or at its finish
    USR1, TERM            replica r             SIGUSR1s, SIGTERMs it received
    GAVE_UP               replica r (0 -> 1)    too many non-finite gradients in a row
    FINISHED              replica r (0 -> 1)    its last push is in and its data position
                                                  final
    ABANDONED             replica r (0 -> 1)    one of its partitions is gone: it is lost
    LOST                  shard 0 (0 -> 1)      shard 0 declared it lost: it must stop
    CLOCK                 replica r             with optimizer.max_staleness: its pushes in
                                                  this job that every shard has applied
    JOINED                shard 0 (once)        with optimizer.max_staleness, for a replica
                                                  counted in after the start (the warm
                                                  start's, a spare's): 1 + the clock it
                                                  starts at
    TAKES_OVER            shard 0 (once)        a spare's (cluster.spare_replicas): 1 + the
                                                  training replica whose part it takes over
    FROM_EPOCH,           shard 0 (once)        with TAKES_OVER, written before it: 1 + the
      FROM_POSITION,                              epoch, the position and the local steps
      FROM_STEPS                                  the spare starts that part at
    SERVING               the spare (0 -> 1+r)  it has opened part r's data; its position
                                                  (EPOCH, POSITION) is that part's from now

Every update is an addition (a writer sends the difference from what it wrote before),
so on the RMA transport every access is a count-1 int64 atomic: Accumulate(SUM) or
Fetch_and_op(SUM) by the writer and Fetch_and_op(NO_OP) reads by everyone else. Only a
bounded replica's exchange (optimizer.max_staleness) reads MIN_CLOCK and its JOINED, and
only a waiting spare's its TAKES_OVER and FROM_* slots: an unbounded run without spares
makes the same operations as before they existed. Count-1
integer atomics are what a network card does by itself (issue 28: with Open MPI's osc/ucx
and `acc_single_intrinsic` they take no accumulate lock that a dying replica could keep),
which is why the loss is fixed point, not a float64 accumulate. Element-wise atomic and
legal under `accumulate_ops = same_op_no_op`, even for shard 0's own writes. On the
shared-memory transport the block is read and written under the segment's reader-writer
lock like everything there (a dead process's kernel locks are released).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

# Global slots (int64)
(CLAIMED, STEPS, LEFT, LOSS, STOP, STOP_ARG, CHECKPOINT, RELEASE, TEARDOWN, WARM,
 MIN_CLOCK) = range(11)
GLOBAL_SLOTS = 11
COMMANDS = slice(STOP, WARM + 1)  # what a replica reads with each exchange
# Per-replica slots
(BEAT, ACKED, EPOCH, POSITION, LOCAL_STEPS, USR1, TERM, GAVE_UP, FINISHED, ABANDONED,
 LOST, CLOCK, JOINED, TAKES_OVER, FROM_EPOCH, FROM_POSITION, FROM_STEPS, SERVING) = range(18)
REPLICA_SLOTS = 18
TAKEOVER = slice(TAKES_OVER, FROM_STEPS + 1)  # what a waiting spare reads with each exchange
SLOT_BYTES = 8
LOSS_SCALE = 1 << 20
"""LOSS holds sum(loss) * LOSS_SCALE as an int64 (resolution ~1e-6 per exchange)."""
LOSS_HUGE = 1 << 52
"""What one exchange adds for a loss sum too large to scale (a diverging run); a LOSS of
LOSS_INFINITE or more reads as infinite, so the supervisor's divergence rule still
fires. About 2000 such exchanges fit before int64 wraps; the run stops long before."""
LOSS_INFINITE = 1 << 55

# STOP codes: why the run stops (replicas stop after their current block in every case)
(STOP_RULE, STOP_SIGNAL, STOP_BAD_GRADIENTS, STOP_DIVERGED, STOP_CHECKPOINT_FAILED,
 STOP_ALL_LOST) = range(1, 7)
# TEARDOWN codes
TEARDOWN_FREE = 1  # nobody was lost: every rank frees the windows collectively
TEARDOWN_LEAVE = 2  # a rank was lost: nobody frees (a collective would wait for the dead)


def block_slots(replicas: int) -> int:
    return GLOBAL_SLOTS + replicas * REPLICA_SLOTS


def block_bytes(replicas: int) -> int:
    """Bytes of the block for `replicas` replicas (0 replicas: no block at all)."""
    return block_slots(replicas) * SLOT_BYTES if replicas else 0


def replica_slot(replica: int, slot: int) -> int:
    """Index in the block of replica `replica`'s slot `slot`."""
    return GLOBAL_SLOTS + replica * REPLICA_SLOTS + slot


def replica_offset(replica: int) -> int:
    """Byte offset of replica `replica`'s slots within the block."""
    return replica_slot(replica, 0) * SLOT_BYTES


@dataclass(frozen=True)
class ControlView:
    """The whole block as shard 0 read it at one moment."""

    steps: int
    loss_sum: float
    replicas: np.ndarray  # int64 (replicas, REPLICA_SLOTS)

    @classmethod
    def from_block(cls, block: np.ndarray) -> ControlView:
        """From the int64 block as read (LOSS fixed point)."""
        return cls(int(block[STEPS]), loss_value(int(block[LOSS])),
                   block[GLOBAL_SLOTS:].reshape(-1, REPLICA_SLOTS).copy())


def loss_units(loss_sum: float) -> int:
    """The int64 a loss sum adds to LOSS (LOSS_HUGE where it does not fit)."""
    scaled = loss_sum * LOSS_SCALE
    return round(scaled) if abs(scaled) < LOSS_HUGE else LOSS_HUGE


def loss_value(units: int) -> float:
    """The loss sum LOSS holds (inf once a diverging run saturated it)."""
    return math.inf if units >= LOSS_INFINITE else units / LOSS_SCALE


class ControlExchange:
    """A replica's side of the block: what it sends with an exchange and what it learns.

    Before an exchange: `set(claim, steps, loss_sum)` (steps to claim, steps finished since
    the last exchange and their loss sum) and, when they change, `publish(...)` of this
    replica's own slots (absolute values; the exchange sends the differences). After it:
    `claimed_before` and `steps_before` (the global counters just before this exchange's
    additions: claims are atomic, so no step is granted twice), and the commands.
    `replica` None is a client without slots (a partition that is not its replica's lead).
    `bounded` (a replica under optimizer.max_staleness) also reads MIN_CLOCK and its
    JOINED with each exchange (`min_clock`, `joined_at`). `spare` (a spare waiting for a
    part, cluster.spare_replicas; cleared once it serves one) also reads its TAKES_OVER
    and FROM_* slots (`takes_over`, `takeover_start`).
    """

    def __init__(self, replica: int | None, bounded: bool = False, spare: bool = False) -> None:
        self.replica = replica
        self.bounded = bounded and replica is not None
        self.spare = spare and replica is not None
        self._takeover = np.zeros(TAKEOVER.stop - TAKEOVER.start, dtype=np.int64)
        self._clocks = np.zeros(2, dtype=np.int64)  # MIN_CLOCK, JOINED as read
        self._send = np.zeros(3, dtype=np.int64)  # claim, steps, left
        self._loss = np.zeros(1, dtype=np.int64)  # loss_units
        self._before = np.zeros(3, dtype=np.int64)  # claimed, steps, left
        self._commands = np.zeros(COMMANDS.stop - COMMANDS.start, dtype=np.int64)
        self._zero = np.zeros(len(self._commands), dtype=np.int64)
        # This replica's slots: the values to publish (LOST stays 0: shard 0 writes it),
        # what the block holds from us, the difference to send, and the slots as they were.
        self._published = np.zeros(REPLICA_SLOTS, dtype=np.int64)
        self._sent = np.zeros(REPLICA_SLOTS, dtype=np.int64)
        self._delta = np.zeros(REPLICA_SLOTS, dtype=np.int64)
        self._row = np.zeros(REPLICA_SLOTS, dtype=np.int64)

    def set(self, claim: int, steps: int = 0, loss_sum: float = 0.0) -> ControlExchange:
        """What the next exchange adds."""
        if claim < 0 or steps < 0:
            raise ValueError(f"claim and steps must be >= 0, got {claim}, {steps}")
        self._send[:] = claim, steps, 0
        self._loss[0] = loss_units(loss_sum)
        return self

    def publish(self, **values: int) -> ControlExchange:
        """Set this replica's slots by name (acked, epoch, position, local_steps, usr1,
        term, gave_up, finished, abandoned, clock) for the next exchange."""
        names = {"acked": ACKED, "epoch": EPOCH, "position": POSITION,
                 "local_steps": LOCAL_STEPS, "usr1": USR1, "term": TERM, "gave_up": GAVE_UP,
                 "finished": FINISHED, "abandoned": ABANDONED, "clock": CLOCK,
                 "serving": SERVING}
        for name, value in values.items():
            self._published[names[name]] = int(value)
        return self

    # -- what the last exchange returned

    @property
    def claimed_before(self) -> int:
        return int(self._before[0])

    @property
    def steps_before(self) -> int:
        return int(self._before[1])

    def _command(self, slot: int) -> int:
        return int(self._commands[slot - COMMANDS.start])

    @property
    def stop(self) -> int:
        """The STOP code (0: the run goes on)."""
        return self._command(STOP)

    @property
    def stop_arg(self) -> int:
        return self._command(STOP_ARG)

    @property
    def checkpoint(self) -> int:
        return self._command(CHECKPOINT)

    @property
    def release(self) -> int:
        return self._command(RELEASE)

    @property
    def teardown(self) -> int:
        return self._command(TEARDOWN)

    @property
    def warm(self) -> bool:
        """The warm start is over, whatever the steps say."""
        return bool(self._command(WARM))

    @property
    def lost(self) -> bool:
        """Shard 0 declared this replica lost (it must stop and push no more)."""
        return bool(self._row[LOST])

    @property
    def min_clock(self) -> int:
        """MIN_CLOCK as read (a bounded exchange only; 0 otherwise)."""
        return int(self._clocks[0])

    @property
    def joined_at(self) -> int | None:
        """The clock shard 0 counted this replica in at (JOINED - 1), None before it has
        (a bounded exchange only)."""
        joined = int(self._clocks[1])
        return joined - 1 if joined else None

    @property
    def takes_over(self) -> int | None:
        """The training replica whose part shard 0 gave this spare, None before it has (a
        waiting spare's exchange only)."""
        part = int(self._takeover[0])
        return part - 1 if part else None

    @property
    def takeover_start(self) -> tuple[int, int, int]:
        """(epoch, position, local steps) the part starts at, as read with `takes_over`;
        complete in the exchange after the one that first read `takes_over` (shard 0 writes
        them first, but one epoch's reads may complete in any order)."""
        epoch, position, steps = (int(v) for v in self._takeover[1:])
        return epoch - 1, position, steps

    def _next_delta(self) -> np.ndarray:
        self._published[BEAT] += 1
        np.subtract(self._published, self._sent, out=self._delta)
        self._sent[:] = self._published
        return self._delta

    # -- the two transports

    def issue(self, win: MPI.Win, target: int, base: int) -> None:
        """The exchange's operations, inside the epoch every rank holds on `target`'s
        window whose block starts at byte `base`; all count-1 int64 atomics (network
        atomics): Fetch_and_op(SUM) of the claim and of the steps (returning CLAIMED and
        STEPS before), Accumulate(SUM) of the loss, Fetch_and_op(NO_OP) of each command,
        Accumulate(SUM) of each of this replica's slots that changes (BEAT always), and
        Fetch_and_op(NO_OP) of its LOST; a bounded exchange also Fetch_and_op(NO_OP) of
        MIN_CLOCK and its JOINED, a waiting spare's its TAKES_OVER and FROM_* slots. 10 +
        (changed slots) operations, 2 more when bounded, 4 more for a waiting spare."""
        int64 = MPI.INT64_T
        for i, slot in enumerate((CLAIMED, STEPS)):
            win.Fetch_and_op([self._send[i : i + 1], int64], [self._before[i : i + 1], int64],
                             target, base + slot * SLOT_BYTES, MPI.SUM)
        win.Accumulate([self._loss, int64], target, (base + LOSS * SLOT_BYTES, 1, int64),
                       MPI.SUM)
        for i in range(len(self._commands)):
            win.Fetch_and_op([self._zero[i : i + 1], int64],
                             [self._commands[i : i + 1], int64], target,
                             base + (COMMANDS.start + i) * SLOT_BYTES, MPI.NO_OP)
        if self.replica is None:
            return
        delta = self._next_delta()
        row = base + replica_offset(self.replica)
        for slot in np.flatnonzero(delta):
            win.Accumulate([delta[slot : slot + 1], int64], target,
                           (row + int(slot) * SLOT_BYTES, 1, int64), MPI.SUM)
        win.Fetch_and_op([self._zero[:1], int64], [self._row[LOST : LOST + 1], int64], target,
                         row + LOST * SLOT_BYTES, MPI.NO_OP)
        if self.bounded:
            for i, offset in enumerate((base + MIN_CLOCK * SLOT_BYTES,
                                        row + JOINED * SLOT_BYTES)):
                win.Fetch_and_op([self._zero[:1], int64], [self._clocks[i : i + 1], int64],
                                 target, offset, MPI.NO_OP)
        if self.spare:
            for i in range(len(self._takeover)):
                win.Fetch_and_op([self._zero[:1], int64], [self._takeover[i : i + 1], int64],
                                 target, row + (TAKEOVER.start + i) * SLOT_BYTES, MPI.NO_OP)

    def apply(self, block: np.ndarray) -> None:
        """The same on a shared-memory block (int64 view; LOSS as float64 bits), under the
        segment's exclusive lock."""
        self._before[:] = block[CLAIMED : LEFT + 1]
        block[CLAIMED : LEFT + 1] += self._send
        block[LOSS] += self._loss[0]
        self._commands[:] = block[COMMANDS]
        if self.replica is None:
            return
        mine = block[GLOBAL_SLOTS + self.replica * REPLICA_SLOTS:][:REPLICA_SLOTS]
        self._row[:] = mine
        if self.bounded:
            self._clocks[:] = block[MIN_CLOCK], mine[JOINED]
        if self.spare:
            self._takeover[:] = mine[TAKEOVER]
        mine += self._next_delta()
