"""Test-only fault injection: kill, crash, slow down, hang or poison a given rank at a given
step, so that the tests can check what every other rank does about it.

The faults come from the environment variable DISTBELIEF_FAULTS (`ENV` says how to write
them). Nothing but the tests and the benchmarks sets it; a real run never should, and the
rank prints what it does when a fault fires.

One seam: a run reads them once, in its RunSession (`session.faults`, a Faults for the
rank, which arms none without the variable), and every role calls that object's hooks; the
parameter server gets what it needs of it from the algorithm (ServerSpec.push_slots, the
client's hang_in_next_push and the like). The only other reader is the command line's
`noinit` check, before MPI_Init, when there is no session yet.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distbelief.errors import ConfigError

ENV = "DISTBELIEF_FAULTS"
"""One or more faults, separated by commas or spaces, each ACTION:RANK:AT[:ARG]. RANK is a
rank of the job (the MPI rank, except where cluster.shard_placement reorders them: then
shard s is rank s), or `*` for every rank the fault applies to. AT counts what the rank
does: a Downpour replica its local steps, a Sandblaster replica its work units, a Downpour
shard the updates it has folded, a Sandblaster shard the pushes it has received,
Sandblaster's coordinator its iterations.

    kill:RANK:AT          SIGKILL itself after step AT (a crashed node: no clean-up at all)
    raise:RANK:AT         raise RuntimeError after step AT (an unhandled exception)
    poison:RANK:AT        put a NaN into the gradient of step AT; AT+ from AT on
    delay:RANK:AT:10x     from step AT on, every step takes 10 times its compute time
    delay:RANK:AT:0.002s  from step AT on, every step takes 2 ms longer
    hang:RANK:AT          stop responding after step AT, for ever (a Downpour replica: in the
                          middle of its next push, holding the lock on the shard it pushes to)
    killpush:RANK:AT      SIGKILL itself in the middle of its next push after step AT (a
                          Downpour replica: its operations on the shards issued, not completed,
                          holding whatever the transport holds during a push; a
                          Sandblaster replica: in its first push after unit AT, once its
                          part for the first shard is sent)
    pause:RANK:AT:5s      stop responding after step AT for 5 s, holding nothing, then go on
    linger:RANK:AT:1s     a Downpour replica that has done AT steps or more, at the end of the
                          run: hold each epoch of its exchanges with shard 0 open 1 s longer,
                          its operations flushed to shard 0 (a rank descheduled just before
                          its Unlock)
    killfree:RANK:0       SIGKILL itself at the end of a Downpour run, once the ranks are to
                          free the windows together (a rank lost in the collective
                          teardown); AT is unused
    noinit:RANK:0         the rank's worker exits with status 1 before MPI_Init (a rank that
                          cannot start: a missing library, a full disk); AT is unused
    link:RANK:0:125e6B/s  a slow network, simulated: every byte the rank's replica sends or
                          receives through the transport or a collective (summary.json's
                          bytes_sent + bytes_received) costs 1/125e6 s, slept right after
                          the transfer (no overlap with compute); AT is unused
    slowwrite:RANK:AT:2s  a Downpour shard's checkpoint parts, from the AT-th checkpoint on
                          (counted from 0), take 2 s longer to write (a slow file system):
                          slept in the thread that writes them
    killwrite:RANK:AT     a Downpour shard: SIGKILL itself just before it writes its part
                          of its AT-th checkpoint (counted from 0), in the thread that
                          writes it (a shard lost in the middle of a checkpoint)
    slots:*:K             every RMA shard has K push slots (K >= 1), not two per replica
                          up to MAX_PUSH_SLOTS: the contention of many replicas, with few;
                          RANK must be * (the windows are allocated collectively)
"""
ACTIONS = ("kill", "raise", "poison", "delay", "hang", "killpush", "pause", "linger",
           "noinit", "link", "slots", "slowwrite", "killfree", "killwrite")


@dataclass(frozen=True)
class Fault:
    """One fault: `action` on world rank `rank` (None: every rank) at step `at`."""

    action: str
    rank: int | None
    at: int
    from_then_on: bool = False  # poison: every step from `at` on
    factor: float = 1.0  # delay: a step takes this many times its compute time
    extra_seconds: float = 0.0  # delay: and this much longer
    bytes_per_second: float = 0.0  # link: the simulated network's rate

    def applies_to(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank


def parse(text: str) -> list[Fault]:
    """The faults in `text` (DISTBELIEF_FAULTS's syntax); ConfigError naming the bad one."""
    faults = []
    for item in text.replace(",", " ").split():
        try:
            faults.append(_parse_one(item))
        except ValueError as exc:
            raise ConfigError(f"{ENV}: cannot read {item!r}: {exc} (expected ACTION:RANK:AT"
                              f"[:ARG], ACTION one of {', '.join(ACTIONS)})") from None
    return faults


def _parse_one(item: str) -> Fault:
    action, *fields = item.split(":")
    if action not in ACTIONS:
        raise ValueError(f"unknown action {action!r}")
    timed = ("delay", "pause", "linger", "link", "slowwrite")
    if len(fields) != (3 if action in timed else 2):
        raise ValueError("wrong number of fields")
    rank = None if fields[0] == "*" else _non_negative(fields[0], "RANK")
    if action == "slots" and (rank is not None or fields[1] == "0"):
        raise ValueError("slots applies to every rank (*) and needs K >= 1")
    at_text = fields[1]
    from_then_on = action == "poison" and at_text.endswith("+")
    at = _non_negative(at_text.removesuffix("+") if from_then_on else at_text, "AT")
    if action not in timed:
        return Fault(action, rank, at, from_then_on)
    arg = fields[2]
    if action == "link":
        if not arg.endswith("B/s"):
            raise ValueError("a link's rate is BYTESB/s, e.g. 125e6B/s")
        return Fault(action, rank, at, bytes_per_second=_positive_float(arg[:-3]))
    if action == "delay" and arg.endswith("x") and _positive_float(arg[:-1]) >= 1:
        return Fault(action, rank, at, factor=float(arg[:-1]))
    if arg.endswith("s"):
        return Fault(action, rank, at, extra_seconds=_positive_float(arg[:-1]))
    raise ValueError("a delay is Fx (F >= 1) or SECONDSs; a pause or linger is SECONDSs")


def _non_negative(text: str, what: str) -> int:
    if not text.isdigit():
        raise ValueError(f"{what} must be a non-negative integer, got {text!r}")
    return int(text)


def _positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{text!r} is not a positive number")
    return value


@dataclass
class Faults:
    """The faults armed for one rank, and the hooks its loops call. With none armed (no
    DISTBELIEF_FAULTS), every hook does nothing, so a caller need not test for faults."""

    rank: int
    faults: list[Fault] = field(default_factory=list)

    @classmethod
    def for_rank(cls, rank: int, environ: Mapping[str, str] | None = None) -> Faults:
        text = (os.environ if environ is None else environ).get(ENV, "")
        return cls(rank, [f for f in parse(text) if f.applies_to(rank)])

    def __bool__(self) -> bool:
        return bool(self.faults)

    def push_slots(self) -> int | None:
        """K of an armed `slots:*:K` fault (every RMA shard's push slots), or None."""
        return next((f.at for f in self.faults if f.action == "slots"), None)

    def _firing(self, action: str, step: int) -> list[Fault]:
        return [f for f in self.faults if f.action == action and f.at == step]

    def poisons(self, step: int) -> bool:
        """Whether the gradient of `step` is to be poisoned."""
        return any(f.action == "poison" and (f.at == step or f.from_then_on and step >= f.at)
                   for f in self.faults)

    def poison(self, step: int, grad: np.ndarray) -> None:
        """Put a NaN into `grad` if `step` is poisoned."""
        if self.faults and grad.size and self.poisons(step):
            grad[0] = np.nan

    def after_step(self, step: int, compute_seconds: float, what: str = "step") -> None:
        """Called once `step` is computed (its gradient already poisoned if it is to be):
        slow it down, then raise, kill or hang as armed."""
        if not self.faults:  # the common case, every step of a real run: nothing armed
            return
        delay = sum((f.factor - 1) * compute_seconds + f.extra_seconds
                    for f in self.faults if f.action == "delay" and step >= f.at)
        if delay > 0:
            time.sleep(delay)
        for pause in self._firing("pause", step):
            _say(f"test-only pause of rank {self.rank} for {pause.extra_seconds:g} s at "
                 f"{what} {step} ({ENV})")
            time.sleep(pause.extra_seconds)
        if self._firing("raise", step):
            raise RuntimeError(f"test-only failure on rank {self.rank} at {what} {step} ({ENV})")
        if self._firing("kill", step):
            self.kill(f"at {what} {step}")

    def after_transfer(self, nbytes: int) -> None:
        """Called after the rank moved `nbytes` through the transport or a collective:
        sleep what a link armed with `link` takes to carry them."""
        if not self.faults:
            return
        seconds = sum(nbytes / f.bytes_per_second for f in self.faults if f.action == "link")
        if seconds > 0:
            time.sleep(seconds)

    def after_updates(self, count: int) -> None:
        """Called by a shard between polls with the updates it has folded so far (a count
        that may jump): raise or kill once it reaches a fault's AT."""
        if not self.faults:
            return
        if any(f.action == "raise" and count >= f.at for f in self.faults):
            raise RuntimeError(f"test-only failure on rank {self.rank} after {count} "
                               f"updates ({ENV})")
        if any(f.action == "kill" and count >= f.at for f in self.faults):
            self.kill(f"after {count} updates")

    def before_checkpoint_write(self, index: int) -> None:
        """Called by a shard's writer thread before it writes its part of its `index`-th
        checkpoint (from 0): sleep as `slowwrite` says, or die as `killwrite` does."""
        if any(f.action == "killwrite" and f.at == index for f in self.faults):
            self.kill(f"before writing its part of checkpoint {index}")
        seconds = sum(f.extra_seconds for f in self.faults
                      if f.action == "slowwrite" and index >= f.at)
        if seconds > 0:
            time.sleep(seconds)

    def hang_due(self, step: int) -> bool:
        """Whether the rank is to stop responding after `step` (the caller decides where)."""
        return bool(self._firing("hang", step))

    def kill_in_push_due(self, step: int) -> bool:
        """Whether the rank is to kill itself inside its push after `step`."""
        return bool(self._firing("killpush", step))

    def kill_in_push_from(self, step: int) -> bool:
        """Whether a push made once `step` steps (units) are done is to be cut by a kill:
        the first push at or after a killpush fault's AT."""
        return any(f.action == "killpush" and step >= f.at for f in self.faults)

    def linger_seconds(self, step: int) -> float:
        """How long each end-of-run exchange epoch is to stay open, once `step` steps are
        done (0: not at all)."""
        return sum(f.extra_seconds for f in self.faults if f.action == "linger" and step >= f.at)

    def before_teardown(self) -> None:
        """SIGKILL this rank now if a `killfree` fault is armed for it."""
        if any(f.action == "killfree" for f in self.faults):
            self.kill("as the windows are to be freed")

    def before_mpi_init(self) -> None:
        """Exit with status 1 now if a `noinit` fault is armed for this rank."""
        if any(f.action == "noinit" for f in self.faults):
            _say(f"test-only exit of rank {self.rank} before MPI_Init ({ENV})")
            sys.exit(1)

    def kill(self, where: str) -> None:
        _say(f"test-only kill -9 of rank {self.rank} {where} ({ENV})")
        os.kill(os.getpid(), signal.SIGKILL)

    def hang(self, where: str) -> None:
        """Stop responding for ever (sleeping, so the rank holds whatever it holds)."""
        _say(f"test-only hang of rank {self.rank} {where} ({ENV})")
        while True:
            time.sleep(3600)


def _say(text: str) -> None:
    print(f"distbelief: {text}", file=sys.stderr, flush=True)


class StepFaults:
    """What a replica's step loop injects, behind one seam (step_faults): the poisoned
    gradient, the delays, kills and raises after a step, and the hang or kill armed for
    the next push. A loop calls after_gradient and after_step whether or not a fault is
    armed; without one they do nothing."""

    def __init__(self, faults: Faults, client: Any):
        self.faults, self.client = faults, client
        self.moved = 0  # bytes through the client at the last step's end (link faults)

    def after_gradient(self, step: int, grad: np.ndarray) -> None:
        self.faults.poison(step, grad)

    def after_step(self, step: int, started: float) -> None:
        """`started`: time.perf_counter() when the step began."""
        self.faults.after_step(step, time.perf_counter() - started)
        moved = int(self.client.bytes_sent) + int(self.client.bytes_received)
        self.faults.after_transfer(moved - self.moved)  # the pushes and pulls since
        self.moved = moved
        if self.faults.hang_due(step):
            self.client.hang_in_next_push(self.faults)
        if self.faults.kill_in_push_due(step):
            self.client.kill_in_next_push(self.faults)


class _NoStepFaults:
    def after_gradient(self, step: int, grad: np.ndarray) -> None:
        pass

    def after_step(self, step: int, started: float) -> None:
        pass


NO_STEP_FAULTS = _NoStepFaults()


def step_faults(faults: Faults, client: Any) -> StepFaults | _NoStepFaults:
    """The seam a replica's step loop calls: StepFaults when `faults` arms any, else one
    that does nothing (a test-only feature costs a run two empty calls a step)."""
    return StepFaults(faults, client) if faults else NO_STEP_FAULTS
