"""Stall watchdog: when a rank waits on another (a lock, a message, a collective) for too
long, say which rank and what for, and optionally abort the job (in the spirit of
Horovod's stall inspector); a wait on a rank that is gone ends at once.

Every wait that can depend on another rank declares itself, and polled waits call
`watchdog.current().check()` between polls:

    with watchdog.current().waiting("the lock on shard 1's segment", ranks=[1],
                                    holder=find_holder):
        ...block or poll...

One watchdog per process, installed by the trainer for the run (`watching`); `current()`
is a disabled one otherwise, so library code can declare its waits unconditionally. (It
is process-wide state on purpose: waits are declared deep inside the parameter server,
the agreement helpers and the model-parallel exchange, and there is one main thread.)
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from distbelief.runtime.launching import guardian

TICK_S = 0.1
"""How often the watchdog thread looks at the current wait."""

CHECK_S = 0.1
"""How often a polled wait looks for gone ranks (check())."""

DRAIN_S = 0.25
"""How long a wait keeps polling after one of its ranks is found gone before it gives up on
it: a message the rank sent before it left may still sit in MPI's queues, and one poll
moves only part of it (MPICH's shared-memory path copies a few cells per progress call)."""

GONE_GRACE_S = 2.0
"""A wait that is still on this long after one of its ranks is found gone is blocked
inside MPI (a polled wait raises RankLost within CHECK_S): the thread ends it."""


def drained(done: Callable[[], bool], seconds: float = DRAIN_S) -> bool:
    """Poll `done` (one MPI test each) for up to `seconds`, sleeping 1 ms between polls:
    True once it says the wait is over. For a wait whose rank is gone: what it sent before
    it left is delivered by polls, not at once."""
    end = time.monotonic() + seconds
    while not done():
        if time.monotonic() >= end:
            return False
        time.sleep(0.001)
    return True


class RankLost(Exception):
    """A rank that a polled wait waits for is gone."""

    def __init__(self, rank: int, what: str):
        super().__init__(f"rank {rank} is gone while waiting for {what}")
        self.rank, self.what = rank, what


@dataclass
class _Wait:
    what: str
    ranks: tuple[int, ...]
    holder: Callable[[], int | None] | None
    started: float = field(default_factory=time.monotonic)
    warned: bool = False


@dataclass
class _Call:
    """One MPI call in progress outside any declared wait (inside_mpi)."""

    what: str
    started: float
    warned: bool = False


class Watchdog:
    """Watches the waits of one rank (declared as the module docstring shows).

    A thread of the watchdog looks at the innermost wait every TICK_S: after `warn_s` it
    prints one line naming the rank waited for (or, with `holder`, the rank found holding
    what is waited for), after `abort_s` it aborts the job. The thread works while the main
    thread is blocked in a system call or in MPI (mpi4py releases the GIL there: measured,
    a thread ticked on while the main thread sat 1 s in MPI_Win_unlock). `check()` raises
    RankLost in the waiting rank when a rank it waits for is gone
    (runtime.health.liveness), so a polled wait on a dead peer ends at once instead of
    after the timeout. A wait that cannot poll (blocked inside MPI, such as an RMA epoch on
    a dead target, which never completes) is ended by the thread: when a rank it depends on
    has been gone for GONE_GRACE_S, the thread calls `on_lost`.

    `describe(rank)` names a rank for messages ("rank 3 (replica 1)"); `gone(rank)` says
    whether its process has ended (None: never known); `abort(message)` ends the job.
    `warn_s` / `abort_s` of 0 turn the warning / the abort off. `on_lost(lost)` ends the
    job when a wait blocked inside MPI depends on a gone rank (default: `abort` with a
    message naming it).
    """

    def __init__(self, rank: int, describe: Callable[[int], str], warn_s: float,
                 abort_s: float, abort: Callable[[str], None],
                 gone: Callable[[int], bool] | None = None,
                 on_lost: Callable[[RankLost], None] | None = None):
        self.rank, self.describe = rank, describe
        self.warn_s, self.abort_s = warn_s, abort_s
        self.abort, self.gone, self.on_lost = abort, gone, on_lost
        self._gone_since: dict[int, float] = {}  # the thread's view: rank -> found gone at
        self._waits: list[_Wait] = []
        self._call: _Call | None = None  # the MPI call in progress (call_began)
        self.written_off: set[int] = set()  # gone ranks the caller has handled (write_off)
        self._next_check = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reports: list[str] = []  # what it printed (tests, summaries)

    @property
    def enabled(self) -> bool:
        return bool(self.warn_s or self.abort_s or self.gone)

    @contextmanager
    def waiting(self, what: str, ranks: Sequence[int] = (),
                holder: Callable[[], int | None] | None = None) -> Iterator[None]:
        """Declare a wait for `what`, which depends on `ranks` (world ranks). `holder()`,
        if given, finds the rank holding what is waited for (called by the thread)."""
        if not self.enabled:
            yield
            return
        self._waits.append(_Wait(what, tuple(ranks), holder))
        try:
            yield
        finally:
            self._waits.pop()

    def check(self, done: Callable[[], bool] | None = None) -> None:
        """From a polled wait, between polls: raise RankLost if a rank the innermost wait
        depends on is gone, unless `done()` (polled for up to DRAIN_S more) says the wait
        is over: a rank may send its last message and leave before the receiver has
        tested for it.
        Cheap (looks every CHECK_S at most)."""
        if self.gone is None or not self._waits:
            return
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + CHECK_S
        wait = self._waits[-1]
        for rank in wait.ranks:
            if rank not in self.written_off and self.gone(rank):
                if done is not None and drained(done):
                    return
                raise RankLost(rank, wait.what)

    def write_off(self, ranks: Sequence[int]) -> None:
        """`ranks` are gone and the caller goes on without them (Sandblaster's coordinator
        and shards after a lost replica): no wait raises or aborts for them any more."""
        self.written_off.update(ranks)

    def call_began(self, what: str) -> None:
        """The main thread enters one MPI call that should return at once (an atomic, a
        Flush): if it stays inside for `warn_s` / `abort_s`, the thread says so / aborts
        the job, even outside any declared wait. Seen: under MPICH on one node a rank
        killed inside an atomic left the window's lock held, and every other rank's next
        atomic on that window blocked for ever (docs/rma-protocol.md). Cheap: call
        call_ended() after it."""
        if self.warn_s or self.abort_s:
            self._call = _Call(what, time.monotonic())

    def call_ended(self) -> None:
        self._call = None

    def progress(self) -> None:
        """The rank waited for has answered (a poll of a long wait got a reply): the
        innermost wait is not a stall, its clock starts again."""
        if self._waits:
            wait = self._waits[-1]
            wait.started, wait.warned = time.monotonic(), False

    # -- the thread

    def start(self) -> None:
        if self.warn_s or self.abort_s or self.gone is not None:
            self._thread = threading.Thread(target=self._watch, name="distbelief-watchdog",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        while not self._stop.wait(TICK_S):
            waits = self._waits
            call = self._call
            now = time.monotonic()
            covered = bool(waits) and call is not None and waits[-1].started <= call.started
            if call is not None and not covered and self._stuck_in_call(call, now):
                return  # aborted
            if not waits:
                continue
            wait = waits[-1]
            waited = now - wait.started
            if self._blocked_on_the_gone(wait, now):
                return
            if self.warn_s and waited >= self.warn_s and not wait.warned:
                wait.warned = True
                self._say(f"stall: {self.describe(self.rank)} has waited {waited:.1f} s for "
                          f"{wait.what}{self._culprit(wait)}")
            if self.abort_s and waited >= self.abort_s:
                self.abort(f"stall: {self.describe(self.rank)} waited {waited:.1f} s for "
                           f"{wait.what}{self._culprit(wait)}; aborting the job "
                           f"(run.stall_abort_seconds = {self.abort_s:g})")
                return

    def _stuck_in_call(self, call: _Call, now: float) -> bool:
        """Warn about / abort for one MPI call that has not returned (no declared wait
        covers it); True once the job is aborted."""
        inside = now - call.started
        why = (f"{self.describe(self.rank)} has been inside one MPI call ({call.what}) for "
               f"{inside:.1f} s (if a rank of the job died: under MPICH, an atomic on a "
               f"window in shared memory runs under that window's lock, which a rank killed "
               f"inside one leaves held; docs/rma-protocol.md)")
        if self.warn_s and inside >= self.warn_s and not call.warned:
            call.warned = True
            self._say(f"stall: {why}")
        if self.abort_s and inside >= self.abort_s:
            self.abort(f"stall: {why}; aborting the job (run.stall_abort_seconds = "
                       f"{self.abort_s:g}). Run the same command again to resume from the "
                       f"last checkpoint")
            return True
        return False

    def _blocked_on_the_gone(self, wait: _Wait, now: float) -> bool:
        """If a rank `wait` depends on has been gone for GONE_GRACE_S (and the wait goes
        on), end the job through on_lost; True then."""
        if self.gone is None:
            return False
        for rank in wait.ranks:
            if rank in self.written_off or not self.gone(rank):
                self._gone_since.pop(rank, None)
                continue
            since = self._gone_since.setdefault(rank, now)
            if now - since >= GONE_GRACE_S and self._waits and self._waits[-1] is wait:
                lost = RankLost(rank, wait.what)
                if self.on_lost is not None:
                    self.on_lost(lost)
                else:
                    self.abort(lost_message(self.describe, lost))
                return True
        return False

    def _culprit(self, wait: _Wait) -> str:
        holder = None
        if wait.holder is not None:
            try:
                holder = wait.holder()
            except OSError:
                holder = None
        if holder is not None:
            return f", held by {self.describe(holder)}"
        if wait.ranks:
            return f" from {', '.join(self.describe(r) for r in wait.ranks)}"
        return ""

    def _say(self, text: str) -> None:
        self.reports.append(text)
        print(f"distbelief: {text}", file=sys.stderr, flush=True)


def abort_job(world: Any, message: str) -> None:
    """Print `message` (one line, stderr) and abort every rank of the job (`world`:
    COMM_WORLD): for failures no rank can recover from, such as a lost shard or a stall."""
    print(f"distbelief: rank {world.Get_rank()}: {message}", file=sys.stderr, flush=True)
    guardian.clean_up_after_abort()
    time.sleep(0.2)  # let the launcher forward the line before the job is torn down
    world.Abort(1)


def for_job(comm: Any, describe: Callable[[int], str], run: Any) -> tuple[Watchdog, Any]:
    """This rank's watchdog for an MPI run, and the liveness.Peers it asks: `run` is the
    [run] configuration (stall_warn_seconds, stall_abort_seconds, out_dir,
    heartbeat_timeout_seconds), `describe(rank)` names a rank. Every rank's process is
    watched on this node, and by heartbeat on the others (distbelief.runtime.health.liveness);
    close the Peers at the end. Collective over `comm` (an allgather of every rank's
    identity)."""
    from distbelief.runtime.health.liveness import Peers

    peers = Peers.gather(comm, run.out_dir, run.heartbeat_timeout_seconds)
    guard = Watchdog(comm.Get_rank(), describe, run.stall_warn_seconds,
                     run.stall_abort_seconds, lambda message: abort_job(comm, message),
                     peers.gone)
    return guard, peers


def abort_for(world: Any, describe: Callable[[int], str], lost: RankLost) -> None:
    """A rank this one waited for is gone, and nothing can go on without it: abort the job
    with a message naming it."""
    abort_job(world, lost_message(describe, lost))


def abort_and_leave(world: Any, message: str) -> None:
    """Abort the job with `message`, then end this process without MPI_Finalize, which
    would wait for the dead rank (the abort may return while the launcher tears the job
    down, as under hydra's -disable-auto-cleanup). Never returns."""
    abort_job(world, message)
    guardian.skip_mpi_finalize()
    guardian.end_process(1)


def lost_message(describe: Callable[[int], str], lost: RankLost) -> str:
    return (f"{describe(lost.rank)} is gone while this rank waited for {lost.what}; the job "
            f"stops. Run the same command again to resume from the last checkpoint (where "
            f"the run writes them)")


_DISABLED = Watchdog(0, str, 0.0, 0.0, lambda message: None)
_current = _DISABLED


def current() -> Watchdog:
    """This process's watchdog (a disabled one outside `watching`)."""
    return _current


@contextmanager
def watching(watchdog: Watchdog) -> Iterator[Watchdog]:
    """Install `watchdog` as this process's for the block, with its thread running."""
    global _current
    previous, _current = _current, watchdog
    watchdog.start()
    try:
        yield watchdog
    finally:
        watchdog.stop()
        _current = previous
