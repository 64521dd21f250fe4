"""Spacing of polling loops: how long a rank sleeps between polls of something that is
not ready yet (a shard polling its windows, a rank waiting on a non-blocking collective).

Moved from the parameter server unchanged, so that the layers below it (runtime's polled
waits, the partitioned network) need not import it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Spacing of a polling loop: after work, sleep `min_sleep_s`; each idle poll doubles
    the sleep, up to `max_sleep_s`.

    Defaults measured in benchmarks/RMA_NOTES.md (2.7 MB push_pull per step, 2 cores): a
    shard that never sleeps answers a step in 0.4 ms but burns a whole core even when
    idle; capping the back-off at 0.5 ms answers in ~1 ms at ~6% of a core when idle
    (1 ms: ~1.8 ms at 3.5%; 0.25 ms: 0.6 ms at 11%). A step's RMA epoch needs several
    round trips through the shard's progress engine, and the first ones wait for its next
    poll, so the cap sets the latency. Spinning for a while after each fold was measured
    too: it only added CPU (10-15% of a core) without making steps faster.
    """

    min_sleep_s: float = 50e-6
    max_sleep_s: float = 0.5e-3
    _sleep: float = field(default=0.0, repr=False)

    def reset(self) -> None:
        """Work was done: the next wait is the shortest."""
        self._sleep = 0.0

    def wait(self) -> None:
        """Nothing was done: sleep, twice as long as last time (within the bounds)."""
        self._sleep = min(max(self._sleep * 2, self.min_sleep_s), self._longest())
        time.sleep(self._sleep)

    def _longest(self) -> float:
        """The longest sleep now."""
        return self.max_sleep_s


@dataclass
class PacedBackoff(Backoff):
    """Backoff for a shard whose clients push at a steady pace (Downpour replicas): it
    learns the interval between bursts of traffic and, from `lead` x interval after the
    last burst, polls every `fast_sleep_s` instead of backing off, until the traffic
    comes (or 3 intervals pass: the pace has changed, and it backs off as Backoff).

    Why: every RMA epoch needs two polls of the target (lock grant, unlock), and traffic
    is seen only when an epoch completes, so a shard that has backed off to 0.5 ms answers
    a push_pull in ~1 ms however fast it polls afterwards. Measured with the reference MLP
    (2.7 MB push_pull every ~2 ms, 1 replica, benchmarks/RMA_NOTES.md section 6): 0.8-1.2
    ms of RMA per step instead of 1.0-2.2, at about the same shard CPU (30-40% of a core,
    folds included). A shard that never sleeps was no faster on this shared 2-core box:
    whenever a third process wants a core, the spinner costs the replica its time slice.
    Polls within `merge_s` of the last traffic belong to the same burst (one push_pull
    shows up as pulls, then a fold).
    """

    fast_sleep_s: float = 20e-6
    lead: float = 0.5
    merge_s: float = 0.3e-3
    longest_pace_s: float = 50e-3
    _last: float = field(default=0.0, repr=False)
    _interval: float = field(default=0.0, repr=False)

    def reset(self) -> None:
        """Traffic now: update the interval estimate (a moving average), then as Backoff."""
        now = time.perf_counter()
        gap = now - self._last
        if gap > self.merge_s:
            if gap < self.longest_pace_s:
                self._interval = (gap if not self._interval
                                  else 0.75 * self._interval + 0.25 * gap)
            self._last = now
        super().reset()

    def wait(self) -> None:
        """Sleep briefly when traffic is due, else back off."""
        since = time.perf_counter() - self._last
        if self._interval and self.lead * self._interval <= since <= 3 * self._interval:
            time.sleep(self.fast_sleep_s)
            return
        super().wait()


@dataclass
class LearnedBackoff(Backoff):
    """Backoff for a wait that recurs, such as a client's wait for the shards to fold its
    push or for a free push slot: its sleeps may grow to 1/`polls` of how long such waits
    have lasted (a moving average), so a wait costs about log2 + `polls` polls however long
    it is, where a fixed cap costs one poll per `max_sleep_s`. Short waits (typical /
    `polls` under `max_sleep_s`) are spaced exactly as by Backoff; a long one wakes at most
    1/`polls` of its length late. `longest_sleep_s` bounds any sleep.

    Why: with R replicas on one shard a fold waits behind up to R others, so a fixed 0.2 ms
    cap makes each waiting client poll R x fold time / 0.2 ms times, and every poll is an
    atomic the shard's progress engine must answer (docs/performance.md, "The control
    plane as the ranks grow").
    """

    polls: int = 8
    longest_sleep_s: float = 20e-3
    _typical: float = field(default=0.0, repr=False)
    _began: float = field(default=0.0, repr=False)

    def begin(self) -> None:
        """A wait starts: sleeps start short again."""
        self._began = time.perf_counter()
        self.reset()

    def end(self) -> None:
        """The wait begun last is over: learn its length."""
        took = time.perf_counter() - self._began
        self._typical = took if not self._typical else 0.75 * self._typical + 0.25 * took

    def _longest(self) -> float:
        return min(max(self.max_sleep_s, self._typical / self.polls), self.longest_sleep_s)
