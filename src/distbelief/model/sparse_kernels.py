"""The arithmetic of the sparse input layers over a batch's rows of a table.

A batch touches a few rows of a table (an embedding's, a sparse linear model's weights).
The layers work on those rows only, gathered into a compact (k, width) array: `lookup`
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


def lookup(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct ids in increasing order, each id's position among them) for a 1-d
    array of ids."""
    unique, position = np.unique(ids, return_inverse=True)
    return unique, position.reshape(-1).astype(np.intp, copy=False)


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
