"""Polled collectives among MPI ranks that must never block on each other while they train.

A collective that includes a rank that may die never completes, and MPICH's blocking calls
busy-poll a core (DESIGN.md), so every collective here is non-blocking and polled with
back-off sleeps: `Rounds` (the decisions that need every rank), `wait_for_everyone` and the
barriers built on it, `wait_all`. Each wait is declared to the stall watchdog
(runtime.health.watchdog), which raises RankLost at once when a rank it waits for is gone
and reports (and aborts) after run.stall_*_seconds otherwise: nothing here deadlocks while
every rank keeps polling.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from distbelief.errors import UserError
from distbelief.runtime.backoff import Backoff
from distbelief.runtime.communicators.topology import world_ranks
from distbelief.runtime.health import watchdog

WAIT_SLEEP_S = (50e-6, 5e-3)
"""Back-off bounds of a polled wait: quick at first (the others are usually close), never
more than 5 ms late."""


SPIN_TESTS = 100
"""Testall calls before the first sleep in `wait_all`: a partner's message in lockstep is
usually microseconds away, and a sleep costs tens of microseconds."""


YIELD_S = 2e-3
"""How long `wait_all` yields the core between tests before it sleeps between them: a
collective in lockstep (sync's 2.7 MB Iallreduce) needs many rounds of progress on both
sides, and each sleep delays a round. Measured with 2 ranks (a 2.7 MB Iallreduce, 100
times, /tmp-free script in docs/performance.md): sleeps alone 5.9-8.7 ms, yielding for up
to 2 ms first 2.0-2.1 ms, a blocking Allreduce 1.6-3.0 ms. A yield gives the core to any
rank that has work, so an oversubscribed node loses little to it; past 2 ms the wait is
a long one and sleeps."""


def wait_all(requests: list[MPI.Request], what: str = "messages",
             ranks: Sequence[int] = ()) -> None:
    """Complete `requests` without spinning a core for long: MPICH's Wait busy-polls
    (DESIGN.md), and partitions may share cores with each other or with shards. Testall a
    few times, then for up to YIELD_S between tests yield the core, then sleep 20 us,
    doubling up to 1 ms (runtime.backoff's Backoff). The wait is declared to the stall
    watchdog as waiting for `what` from the world ranks `ranks`; watchdog.RankLost if one
    of them is gone."""
    for _ in range(SPIN_TESTS):
        if MPI.Request.Testall(requests):
            return
    end = time.perf_counter() + YIELD_S
    while time.perf_counter() < end:
        if MPI.Request.Testall(requests):
            return
        os.sched_yield()
    backoff = Backoff(min_sleep_s=20e-6, max_sleep_s=1e-3)
    guard = watchdog.current()
    with guard.waiting(what, ranks):
        while not MPI.Request.Testall(requests):
            guard.check(lambda: MPI.Request.Testall(requests))
            backoff.wait()


def polled_bcast(comm: MPI.Comm, value: np.ndarray, what: str = "its lead partition",
                 ranks: Any = ()) -> np.ndarray:
    """Rank 0's `value` on every rank of `comm`, in place: an Ibcast waited for with
    back-off sleeps (a partition may wait long for its lead). Collective over `comm`."""
    wait_all([comm.Ibcast(value, root=0)], what, ranks)
    return value


class Rounds:
    """Rounds of MPI_Iallreduce(MAX) over `width` int64 flags on `comm`, polled.

    Downpour's shards serve free, yet some decisions need every shard: write a checkpoint
    now (a global consistency point), stop because a signal reached one of them, and the
    end of the run (its replicas, which may die, agree through its one-sided run control
    instead). Round k+1 is posted only after round k completed on that rank, and no sooner
    than `interval_s` after round k was posted, so rounds cost a Test per poll and a few
    small messages per interval. Every rank sees the same result for round k, so every
    decision taken from a round result is taken by all ranks, at the same point of their
    sequence of collectives; any rank can raise a flag (a signal, a failure) and rank 0 can
    ask for a checkpoint. A round completes once every rank has posted it, so its latency
    is the longest time any rank goes without polling (a replica polls after each push: one
    block of n_push steps).

    Why not a broadcast from rank 0 plus point-to-point messages for signals: a message
    sent to rank 0 after it stopped listening would never be received, and a collective
    cannot be cancelled; rounds need neither, and they also end the run cleanly (the
    `done` flag: the last round is the one in which every rank says it is done).

    Collective over `comm` in the sense of MPI: every rank must keep calling poll() until
    the rounds end, and must issue any other collective on `comm` between the same rounds
    (right after acting on a round's result). `comm` should be private to this use.
    """

    def __init__(self, comm: MPI.Comm, width: int, interval_s: float):
        self.comm = comm
        self.interval_s = interval_s
        self._send = np.zeros(width, dtype=np.int64)
        self._result = np.zeros(width, dtype=np.int64)
        self._request: MPI.Request | None = None
        self._next_post = 0.0
        self.completed = 0

    @property
    def in_flight(self) -> bool:
        return self._request is not None

    def poll(self, contribute: Callable[[], Sequence[int]]) -> np.ndarray | None:
        """Test the round in flight: its result (a copy) once it completed, else None.
        With no round in flight, post the next one with `contribute()` (called only then)
        once the interval has passed. Non-blocking."""
        if self._request is not None:
            if not self._request.Test():
                return None
            self._request = None
            self.completed += 1
            return self._result.copy()
        now = time.monotonic()
        if now >= self._next_post:
            self._send[:] = contribute()
            self._request = self.comm.Iallreduce(self._send, self._result, MPI.MAX)
            self._next_post = now + self.interval_s
        return None


def wait_for_everyone(comm: MPI.Comm, serve: Callable[[], bool] | None = None,
                      backoff: Backoff | None = None, what: str = "a barrier") -> None:
    """Collective over `comm`: an Ibarrier polled with back-off sleeps; `serve()` (if given)
    runs between polls, and True from it (work was done) keeps the polls fast. Declared to
    the stall watchdog as waiting for `what` from the other ranks of `comm`.

    Sandblaster and the partitioned trainer use it. A shard that waits keeps serving, so the
    RMA epochs of replicas that have not arrived yet still complete. A blocking collective
    issued right after it (everyone has arrived) finishes at once: that is how a lowercase
    bcast/gather of Python objects is done without a spinning wait (bcast_after_barrier)."""
    request = comm.Ibarrier()
    if request.Test():
        return
    backoff = backoff or Backoff(*WAIT_SLEEP_S)
    guard = watchdog.current()
    others = [r for r in range(comm.Get_size()) if r != comm.Get_rank()]
    with guard.waiting(what, world_ranks(comm, others) if guard.enabled else ()):
        while not request.Test():
            guard.check(request.Test)
            if serve is not None and serve():
                backoff.reset()
            else:
                backoff.wait()


OBJECT_TAG, ARRAY_TAG = 32000, 32001
"""Tags of the point-to-point collectives below (gather_polled, bcast_polled,
gatherv_polled): a communicator they are used on carries no other message with them."""


def gather_polled(comm: MPI.Comm, value: object, root: int = 0,
                  what: str = "the others' parts") -> list | None:
    """Every rank's `value` in rank order on `root` (None elsewhere), sent point to point
    and received by probes polled with back-off sleeps, each wait declared to the stall
    watchdog: a rank that dies before it has sent raises RankLost in the root, where a
    blocking gather would hold every rank inside MPI for ever (a rank can die between a
    barrier and the gather after it). Collective over `comm` in effect: every rank calls
    it, in the same order as the others of this module (messages from one rank arrive in
    order)."""
    me, size = comm.Get_rank(), comm.Get_size()
    if me != root:
        wait_all([comm.isend(value, dest=root, tag=OBJECT_TAG)], what,
                 world_ranks(comm, [root]))
        return None
    values = {me: value}
    _probe_each(comm, [r for r in range(size) if r != me],
                got=lambda rank, message: values.__setitem__(rank, message.recv()),
                what=what)
    return [values[rank] for rank in range(size)]


def bcast_polled(comm: MPI.Comm, value: object, root: int = 0,
                 what: str = "a decision") -> object:
    """`root`'s `value` on every rank of `comm`, point to point, polled and watched as
    gather_polled is (RankLost if the root is gone before it sent). Collective over
    `comm` in effect."""
    me = comm.Get_rank()
    if me == root:
        others = [r for r in range(comm.Get_size()) if r != me]
        wait_all([comm.isend(value, dest=r, tag=OBJECT_TAG) for r in others], what,
                 world_ranks(comm, others))
        return value
    received: list = []
    _probe_each(comm, [root],
                got=lambda _, message: received.append(message.recv()), what=what)
    return received[0]


def gatherv_polled(comm: MPI.Comm, part: np.ndarray, out: np.ndarray | None,
                   counts: Sequence[int], displs: Sequence[int], root: int = 0,
                   what: str = "the others' slices") -> np.ndarray | None:
    """Gatherv of float32 `part`s into `out` on `root` (rank r's at displs[r], counts[r]
    values), point to point, polled and watched as gather_polled is. Collective over
    `comm` in effect."""
    me = comm.Get_rank()
    if me != root:
        wait_all([comm.Isend([part, MPI.FLOAT], dest=root, tag=ARRAY_TAG)], what,
                 world_ranks(comm, [root]))
        return None
    out[displs[me] : displs[me] + counts[me]] = part
    others = [r for r in range(comm.Get_size()) if r != me]
    wait_all([comm.Irecv([out[displs[r] : displs[r] + counts[r]], MPI.FLOAT], source=r,
                         tag=ARRAY_TAG) for r in others], what, world_ranks(comm, others))
    return out


def _probe_each(comm: MPI.Comm, sources: list[int],
                got: Callable[[int, MPI.Message], None], what: str) -> None:
    """Receive one OBJECT_TAG message from each of `sources`, calling `got(rank,
    message)`, by Improbe polled with back-off sleeps; the wait is declared for the ranks
    not heard from yet."""
    pending = list(sources)
    guard, backoff = watchdog.current(), Backoff(*WAIT_SLEEP_S)
    while pending:
        for rank in list(pending):
            message = comm.improbe(source=rank, tag=OBJECT_TAG)
            if message is not None:
                got(rank, message)
                pending.remove(rank)
        if pending:
            with guard.waiting(what, world_ranks(comm, pending) if guard.enabled else ()):
                guard.check()
                backoff.wait()


def bcast_after_barrier(comm: MPI.Comm, value: object, root: int = 0) -> object:
    """Collective over `comm`: the root's `value` on every rank (a polled barrier, then a
    bcast that completes at once)."""
    wait_for_everyone(comm)
    return comm.bcast(value, root=root)


def gather_after_barrier(comm: MPI.Comm, value: object, root: int = 0) -> list | None:
    """Collective over `comm`: every rank's `value` in rank order on the root, None
    elsewhere (a polled barrier, then a gather that completes at once)."""
    wait_for_everyone(comm)
    return comm.gather(value, root=root)


def agree(comm: MPI.Comm, setup: Callable[[], Any]) -> Any:
    """Run `setup()` here; if it raised a UserError on any rank, raise it on every rank.

    Collective over `comm` (a back-off barrier, then allgather of the error messages):
    the local set-up differs by rank (a replica reads its rows, rank 0 writes the run
    folder), so a failure there would otherwise leave the other ranks waiting forever.
    """
    try:
        result, error = setup(), None
    except UserError as e:
        result, error = None, str(e)
    wait_for_everyone(comm)
    errors = [message for message in comm.allgather(error) if message is not None]
    if errors:
        raise UserError(errors[0])  # the lowest rank's, so that rank 0 prints one message
    return result


SHARE_TAG = 0x73756D  # "sum": the end-of-run value sent from the writer to every rank
SHARE_WAIT_S = 10.0
"""How long the writer waits for its sends in `share_from_writer` to complete (each rank
posted its receive when its trainer returned, so they are close)."""


def share_from_writer(comm: MPI.Comm, writer: int, value: object,
                      skip: Sequence[int] = (), written_off: bool = False) -> object:
    """`value` from rank `writer` of `comm` on every rank but those in `skip` (known lost),
    after a run. Point-to-point, never a collective: a rank may be gone by then. The
    writer waits at most SHARE_WAIT_S for its sends; the others wait, polled with back-off
    sleeps, for as long as the writer takes (it may still be evaluating the test set),
    and get None if the writer is gone. A rank `written_off` (its replica was lost) is
    not sent to and gets None at once."""
    rank = comm.Get_rank()
    if rank == writer:
        _send_to_all(comm, value, [r for r in range(comm.Get_size())
                                   if r != writer and r not in set(skip)])
        return value
    if written_off or rank in set(skip):
        return None
    backoff = Backoff(*WAIT_SLEEP_S)
    try:
        while (message := comm.improbe(source=writer, tag=SHARE_TAG)) is None:
            backoff.wait()
        return message.recv()  # a matched probe: any size, no buffer guessed
    except MPI.Exception:  # the writer is gone: what it wrote is on disk, if anything
        return None


def _send_to_all(comm: MPI.Comm, value: object, ranks: Sequence[int]) -> None:
    requests = []
    for rank in ranks:
        try:
            requests.append(comm.isend(value, dest=rank, tag=SHARE_TAG))
        except MPI.Exception:  # a rank that died: left out
            pass
    deadline = time.monotonic() + SHARE_WAIT_S
    backoff = Backoff(*WAIT_SLEEP_S)
    while requests and time.monotonic() < deadline:
        still = []
        for request in requests:
            try:
                if not request.Test():
                    still.append(request)
            except MPI.Exception:
                pass
        requests = still
        if requests:
            backoff.wait()
