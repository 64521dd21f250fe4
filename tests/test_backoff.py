"""The polling back-offs (distbelief.runtime.backoff), with real sleeps."""

from __future__ import annotations

import time

import pytest

from distbelief.runtime.backoff import Backoff, LearnedBackoff


def polls_until(backoff: Backoff, seconds: float) -> int:
    """Polls a loop makes, sleeping under `backoff`, until `seconds` have passed."""
    if isinstance(backoff, LearnedBackoff):
        backoff.begin()
    end, polls = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        polls += 1
        backoff.wait()
    if isinstance(backoff, LearnedBackoff):
        backoff.end()
    return polls


def test_a_learned_backoff_polls_a_long_wait_a_bounded_number_of_times():
    fixed = Backoff(min_sleep_s=20e-6, max_sleep_s=0.2e-3)
    learned = LearnedBackoff(min_sleep_s=20e-6, max_sleep_s=0.2e-3, polls=8)
    first = polls_until(learned, 0.2)  # nothing learned yet: spaced as the fixed one
    later = [polls_until(learned, 0.2) for _ in range(3)]
    # About log2(25 ms / 20 us) ~ 10 doublings plus 8 capped sleeps; the fixed cap of 0.2
    # ms makes hundreds (fewer than 1,000 where the machine oversleeps).
    assert polls_until(fixed, 0.2) > 150 and first > 150, first
    assert max(later) <= 30, later


def test_short_waits_are_spaced_as_by_the_plain_backoff():
    # Waits of 20 ms (longer where the machine oversleeps): 1/1000 of that is under
    # max_sleep_s, which then caps the sleeps as in Backoff.
    learned = LearnedBackoff(min_sleep_s=20e-6, max_sleep_s=0.2e-3, polls=1000)
    for _ in range(3):
        polls_until(learned, 20e-3)
    learned.begin()
    sleeps = []
    for _ in range(6):
        learned.wait()
        sleeps.append(learned._sleep)
    assert sleeps == pytest.approx([20e-6, 40e-6, 80e-6, 160e-6, 0.2e-3, 0.2e-3])


def test_no_sleep_is_longer_than_its_bound():
    learned = LearnedBackoff(min_sleep_s=1e-3, max_sleep_s=1e-3, polls=2,
                             longest_sleep_s=5e-3)
    polls_until(learned, 0.3)  # typical 0.3 s: 1/2 of it would be 150 ms
    learned.begin()
    for _ in range(8):
        learned.wait()
    assert learned._sleep == 5e-3
