"""The suite's sample of each test matrix (tests/helpers/matrix.py)."""

from __future__ import annotations

import math

import pytest
from helpers import matrix


class Case:
    """What the sampler reads of a pytest item: its id and whether it is marked."""

    def __init__(self, nodeid: str, marked: bool = True):
        self.nodeid, self._marked = nodeid, marked

    def get_closest_marker(self, name: str):
        return object() if self._marked and name == "matrix" else None


def cases(function: str, n: int) -> list[Case]:
    return [Case(f"tests/test_x.py::{function}[{i}]") for i in range(n)]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 9, 10])
def test_each_matrix_keeps_a_third_rounded_up_and_the_rest_are_dropped(size: int) -> None:
    items = [*cases("test_a", size), Case("tests/test_x.py::test_plain", marked=False)]
    kept, dropped = matrix.sample(items, "seed")
    assert len(kept) - 1 == math.ceil(size / matrix.MATRIX_SHARE)
    assert {c.nodeid for c in kept} | {c.nodeid for c in dropped} == {c.nodeid for c in items}
    assert "tests/test_x.py::test_plain" in {c.nodeid for c in kept}


def test_a_seed_draws_the_same_sample_and_other_seeds_draw_others() -> None:
    items = [*cases("test_a", 9), *cases("test_b", 9)]
    picks = {seed: [c.nodeid for c in matrix.sample(items, seed)[0]]
             for seed in map(str, range(40))}
    assert picks["7"] == [c.nodeid for c in matrix.sample(items, "7")[0]]
    assert len({tuple(p) for p in picks.values()}) > 1
    # Over seeds, every case is drawn: the whole matrix is covered across commits.
    assert {n for p in picks.values() for n in p} == {c.nodeid for c in items}


def test_the_environment_chooses_every_case_or_a_sample(monkeypatch) -> None:
    monkeypatch.setenv(matrix.MATRIX_ENV, "all")
    assert matrix.every_case()
    monkeypatch.setenv(matrix.MATRIX_ENV, "")
    assert not matrix.every_case()
    monkeypatch.setenv(matrix.MATRIX_ENV, "everything")
    with pytest.raises(pytest.UsageError, match="'all' or 'sample'"):
        matrix.every_case()
    monkeypatch.setenv(matrix.SEED_ENV, "abc")
    assert matrix.seed(matrix.Path(".")) == "abc"


def test_a_repeat_step_keeps_one_case_of_every_parametrized_test(monkeypatch) -> None:
    items = [*cases("test_a", 9), *[Case(c.nodeid, marked=False) for c in cases("test_b", 4)],
             Case("tests/test_x.py::test_plain", marked=False)]
    kept, dropped = matrix.sample(items, "seed", repeat=True)
    names = sorted(c.nodeid.split("[")[0] for c in kept)
    assert names == ["tests/test_x.py::test_a", "tests/test_x.py::test_b",
                     "tests/test_x.py::test_plain"]
    assert len(dropped) == 8 + 3
    monkeypatch.setenv(matrix.REPEAT_ENV, "1")
    assert matrix.repeating()
    monkeypatch.setenv(matrix.REPEAT_ENV, "yes")
    with pytest.raises(pytest.UsageError, match="1 or 0"):
        matrix.repeating()
