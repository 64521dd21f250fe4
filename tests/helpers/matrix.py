"""A sample of each test matrix per run: the cases of a test marked `matrix` repeat one
mechanism (a kill, a resume, a refusal) over rank counts, transports, fetch modes and
moments, and each run of the suite keeps one case in MATRIX_SHARE of each, at least one,
chosen by a seed. A different commit draws a different sample, so the whole matrix is
covered across commits, while each run pays for a third of it (issue 41: CI under 25
minutes). The seed is printed in the header and a failure names it, so a sample can be
run again exactly.

    DISTBELIEF_TEST_MATRIX=all          every case
    DISTBELIEF_TEST_MATRIX_SEED=TEXT    this sample (default: the checkout's commit)

The steps of .ci/run after the first run tests that step 1 ran already under MPICH on one
node, again under Open MPI, osc/ucx or on simulated nodes; what they add is that other
MPI or those nodes, which one case of a parametrized test exercises as well as all of
them. With DISTBELIEF_TEST_REPEAT=1 (those steps set it) every parametrized test keeps
one case, drawn by the same seed, so the cases still rotate across commits.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

MATRIX_ENV = "DISTBELIEF_TEST_MATRIX"
SEED_ENV = "DISTBELIEF_TEST_MATRIX_SEED"
MATRIX_SHARE = 3
"""One case in this many of each matrix runs (rounded up)."""
REPEAT_ENV = "DISTBELIEF_TEST_REPEAT"
"""Set to 1 in a step that repeats tests under another MPI or on simulated nodes: one
case of each parametrized test."""


def seed(repo: Path) -> str:
    """SEED_ENV if set, else the checkout's commit, else "none"."""
    if os.environ.get(SEED_ENV):
        return os.environ[SEED_ENV]
    try:
        done = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "none"
    return done.stdout.strip() or "none"


def every_case() -> bool:
    text = os.environ.get(MATRIX_ENV, "").strip()
    if text not in ("", "all", "sample"):
        raise pytest.UsageError(f"{MATRIX_ENV}={text!r}: 'all' or 'sample'")
    return text == "all"


def repeating() -> bool:
    text = os.environ.get(REPEAT_ENV, "").strip()
    if text not in ("", "0", "1"):
        raise pytest.UsageError(f"{REPEAT_ENV}={text!r}: 1 or 0")
    return text == "1"


def sample(items: list[pytest.Item], seed_text: str, repeat: bool = False
           ) -> tuple[list[pytest.Item], list[pytest.Item]]:
    """(kept, dropped): of each test function marked `matrix`, the cases a Random seeded by
    `seed_text` and the function's name picks, one in MATRIX_SHARE rounded up; with
    `repeat`, one case of every parametrized function."""
    groups: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        if repeat and "[" in item.nodeid or item.get_closest_marker("matrix") is not None:
            groups[item.nodeid.split("[", 1)[0]].append(item)
    dropped: set[str] = set()
    for name, cases in groups.items():
        keep = 1 if repeat else math.ceil(len(cases) / MATRIX_SHARE)
        chosen = {item.nodeid for item in random.Random(f"{seed_text}:{name}").sample(cases, keep)}
        dropped.update(item.nodeid for item in cases if item.nodeid not in chosen)
    return ([item for item in items if item.nodeid not in dropped],
            [item for item in items if item.nodeid in dropped])


class MatrixSample:
    """The pytest plugin: samples after `-m` and `-k` have chosen (trylast), says so in the
    header, and names the seed again under failures."""

    def __init__(self, repo: Path):
        self.all = every_case()
        self.repeat = repeating() and not self.all
        self.seed = seed(repo)
        self.kept = self.total = 0

    def pytest_report_header(self) -> str:
        if self.all:
            return f"matrix: every case ({MATRIX_ENV}=all)"
        if self.repeat:
            return (f"matrix: a repeat step ({REPEAT_ENV}=1): one case of each "
                    f"parametrized test, seed {self.seed}")
        return (f"matrix: one case in {MATRIX_SHARE} of each, seed {self.seed} "
                f"({SEED_ENV}={self.seed} draws this sample again, {MATRIX_ENV}=all runs "
                f"every case)")

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        matrix = [item for item in items if item.get_closest_marker("matrix") is not None
                  or self.repeat and "[" in item.nodeid]
        self.total = len(matrix)
        if self.all:
            self.kept = self.total
            return
        kept, dropped = sample(items, self.seed, self.repeat)
        self.kept = self.total - len(dropped)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept

    def pytest_terminal_summary(self, terminalreporter, exitstatus: int) -> None:
        if self.total and not self.all:
            terminalreporter.write_line(
                f"matrix: kept {self.kept} of {self.total} matrix cases, seed {self.seed} "
                f"(again: {SEED_ENV}={self.seed}; every case: {MATRIX_ENV}=all)")
