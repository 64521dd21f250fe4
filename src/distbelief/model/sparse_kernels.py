"""The arithmetic of the sparse input layers over a batch's rows of a table.

A batch touches a few rows of a table (an embedding's, a sparse linear model's weights).
The layers work on those rows only, gathered into a compact (k, width) array: `Lookup`
numbers the batch's distinct ids 0..k-1, the forward reads `rows[position]`, and the
backward returns the gradient of those k rows (each id once, so it is written, not
accumulated, into a whole gradient). This is also the form in which a replica will pull and
push rows of a table sharded over the parameter server.

numpy throughout: the work is gathers and segment sums, which numpy's `take`, `reduceat`
and `bincount` do in C.
"""

from __future__ import annotations

import numpy as np

from distbelief.model.layout import DTYPE

SCATTER_ROWS = 1 << 24
"""Tables up to this many rows number a batch's ids by scattering them into a scratch
array of one slot a row (Lookup); larger ones sort them (np.unique), not to hold a
table-sized array for it."""


class Lookup:
    """Numbers a batch's distinct ids of one table: (the distinct ids, each id's position
    among them). With a scratch slot per table row the ids are scattered and gathered
    back, O(batch) and no sort: a third of np.unique's time on a batch of 64 rows of 77
    ids (the sort was 44% of a sparse logistic step). The distinct ids then come in no
    particular order."""

    def __init__(self, rows: int):
        self._slots = (np.empty(rows, dtype=np.int32 if rows < 2**31 else np.int64)
                       if rows <= SCATTER_ROWS else None)

    def __call__(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = ids.reshape(-1)
        if self._slots is None:
            unique, position = np.unique(ids, return_inverse=True)
            return unique, position.reshape(-1).astype(np.intp, copy=False)
        entries = np.arange(len(ids), dtype=self._slots.dtype)
        # Every slot read below was written just now: one entry of each id wins the slot,
        # and it is that id's representative.
        self._slots[ids] = entries
        first = self._slots[ids]
        is_first = first == entries
        number = np.cumsum(is_first, dtype=np.intp) - 1  # the representative's number
        return ids[is_first], number[first]


def bag_forward(indptr: np.ndarray, positions: np.ndarray, values: np.ndarray | None,
                rows: np.ndarray, out: np.ndarray) -> None:
    """out[i] = sum over row i's entries j of values[j] * rows[positions[j]] (values None:
    each 1). `indptr` (n + 1,) delimits the n rows' entries; rows is (k, width), out
    (n, width), overwritten."""
    contributions = rows[positions]
    if values is not None:
        contributions *= values[:, None]
    out[...] = 0
    nonempty = indptr[1:] > indptr[:-1]
    if len(contributions):
        # reduceat sums from each start to the next one: with the empty rows left out,
        # that is exactly each row's entries.
        out[nonempty] = np.add.reduceat(contributions, indptr[:-1][nonempty], axis=0)


def bag_backward(indptr: np.ndarray, positions: np.ndarray, values: np.ndarray | None,
                 dout: np.ndarray, k: int) -> np.ndarray:
    """The gradient of bag_forward's k rows, (k, width), from dout (n, width)."""
    row_of = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
    contributions = dout[row_of]
    if values is not None:
        contributions *= values[:, None]
    return segment_sum(positions, contributions, k)


def segment_sum(positions: np.ndarray, contributions: np.ndarray, k: int) -> np.ndarray:
    """(k, width): the rows of `contributions` (m, width) summed by `positions` (m,)."""
    width = contributions.shape[1]
    if width == 1:  # bincount is the fastest scatter-add numpy has
        total = np.bincount(positions, weights=contributions[:, 0], minlength=k)
        return total.astype(DTYPE).reshape(k, 1)
    out = np.zeros((k, width), dtype=DTYPE)
    if len(positions) == 0:
        return out
    order = np.argsort(positions, kind="stable")
    ordered = positions[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    out[ordered[starts]] = np.add.reduceat(contributions[order], starts, axis=0)
    return out
