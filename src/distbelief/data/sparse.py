"""Sparse feature rows: `SparseRows`, a batch or a split of examples in CSR form.

A sparse model (a weight per feature id, an embedding table) reads only the features an
example has. SparseRows holds them as compressed sparse rows, the layout of scipy.sparse's
csr_matrix and of the svmlight/libsvm files RCV1 and Criteo ship in:

    indptr   (n + 1,)  int64, indptr[0] = 0, non-decreasing; row i is [indptr[i], indptr[i+1])
    indices  (nnz,)    int32 (int64 where n_features > 2**31 - 1): feature ids in [0, n_features)
    values   (nnz,)    float32, finite

It slices like an array's rows (`rows[a:b]`, `rows[index_array]`, `len(rows)`), so the
trainers' batching takes it where it takes a dense x. Construction checks the shapes and
dtypes (cheap); `check()` also checks every id and value (a file's whole content, once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from distbelief.errors import DataError

INDEX_LIMIT_32 = 2**31 - 1
"""The largest feature count whose ids fit int32."""


def index_dtype(n_features: int) -> np.dtype:
    """The dtype of feature ids for a table of `n_features` rows."""
    return np.dtype(np.int32 if n_features <= INDEX_LIMIT_32 else np.int64)


@dataclass(frozen=True, eq=False)
class SparseRows:
    """`len(indptr) - 1` rows of `n_features` columns in CSR form (module docstring)."""

    indptr: np.ndarray
    indices: np.ndarray
    values: np.ndarray
    n_features: int

    def __post_init__(self) -> None:
        if not isinstance(self.n_features, (int, np.integer)) or self.n_features < 1:
            raise DataError(f"sparse rows: n_features must be a positive integer, got "
                            f"{self.n_features!r}")
        indptr, indices, values = self.indptr, self.indices, self.values
        if indptr.ndim != 1 or len(indptr) < 1 or indptr.dtype != np.int64:
            raise DataError(f"sparse rows: indptr must be a 1-d int64 array of n + 1 "
                            f"offsets, got {indptr.dtype} of shape {indptr.shape}")
        if indices.ndim != 1 or indices.dtype != index_dtype(int(self.n_features)):
            raise DataError(f"sparse rows: indices must be a 1-d "
                            f"{index_dtype(int(self.n_features))} array, got "
                            f"{indices.dtype} of shape {indices.shape}")
        if values.ndim != 1 or values.dtype != np.float32 or len(values) != len(indices):
            raise DataError(f"sparse rows: values must be a 1-d float32 array as long as "
                            f"indices ({len(indices)}), got {values.dtype} of shape "
                            f"{values.shape}")
        if indptr[0] != 0 or indptr[-1] != len(indices):
            raise DataError(f"sparse rows: indptr must run from 0 to the number of stored "
                            f"values ({len(indices)}), got {int(indptr[0])} to "
                            f"{int(indptr[-1])}")

    @classmethod
    def from_arrays(cls, indptr: Any, indices: Any, values: Any,
                    n_features: int) -> SparseRows:
        """SparseRows from array-likes of any integer and float dtypes, converted (the ids
        to the narrowest dtype that holds n_features), then `check`ed."""
        n_features = int(n_features)
        rows = cls(np.ascontiguousarray(indptr, dtype=np.int64),
                   _as_ids(indices, n_features),
                   np.ascontiguousarray(values, dtype=np.float32), n_features)
        rows.check()
        return rows

    @classmethod
    def from_scipy(cls, matrix: Any) -> SparseRows:
        """The rows of a scipy.sparse matrix or array of any format (anything with
        `.tocsr()`; scipy itself is not imported), `check`ed. Duplicate entries of a row
        are kept: a model sums them, as scipy does."""
        csr = matrix.tocsr()
        return cls.from_arrays(csr.indptr, csr.indices, csr.data, int(csr.shape[1]))

    @classmethod
    def from_dense(cls, x: np.ndarray) -> SparseRows:
        """The non-zero entries of a 2-d array (tests, small examples)."""
        x = np.asarray(x)
        if x.ndim != 2:
            raise DataError(f"sparse rows: a dense array to convert must be 2-d, got shape "
                            f"{x.shape}")
        row, col = np.nonzero(x)
        indptr = np.zeros(x.shape[0] + 1, np.int64)
        np.cumsum(np.bincount(row, minlength=x.shape[0]), out=indptr[1:])
        return cls.from_arrays(indptr, col, x[row, col], x.shape[1])

    def check(self) -> None:
        """Every row's offsets non-decreasing, every id in range, every value finite: a
        DataError naming the first row that is not."""
        steps = np.diff(self.indptr)
        if len(steps) and steps.min() < 0:
            raise DataError(f"sparse rows: indptr decreases at row {int(np.argmin(steps))}")
        bad = np.flatnonzero((self.indices < 0) | (self.indices >= self.n_features))
        if len(bad):
            raise DataError(f"sparse rows: row {self._row_of(bad[0])} has the feature id "
                            f"{int(self.indices[bad[0]])}, outside [0, {self.n_features})")
        bad = np.flatnonzero(~np.isfinite(self.values))
        if len(bad):
            raise DataError(f"sparse rows: row {self._row_of(bad[0])} has the value "
                            f"{self.values[bad[0]]}")

    def _row_of(self, position: int) -> int:
        return int(np.searchsorted(self.indptr, position, side="right") - 1)

    def __len__(self) -> int:
        return len(self.indptr) - 1

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self), int(self.n_features))

    @property
    def nnz(self) -> int:
        return len(self.indices)

    @property
    def nbytes(self) -> int:
        return int(self.indptr.nbytes + self.indices.nbytes + self.values.nbytes)

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    def __getitem__(self, rows: Any) -> SparseRows:
        """The rows of a slice (step 1) or of an integer index array, in that order."""
        if isinstance(rows, slice):
            start, stop, step = rows.indices(len(self))
            if step != 1:
                rows = np.arange(start, stop, step)
            else:
                stop = max(start, stop)
                a, b = int(self.indptr[start]), int(self.indptr[stop])
                return SparseRows(self.indptr[start:stop + 1] - a, self.indices[a:b],
                                  self.values[a:b], self.n_features)
        rows = np.asarray(rows)
        if rows.dtype == bool or rows.ndim != 1 or not np.issubdtype(rows.dtype, np.integer):
            raise DataError(f"sparse rows: rows are taken by a slice or a 1-d integer array, "
                            f"got {rows.dtype} of shape {rows.shape}")
        starts = self.indptr[rows]
        lengths = self.indptr[rows + 1] - starts
        indptr = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lengths, out=indptr[1:])
        # The stored positions of the rows' entries, row after row.
        positions = np.repeat(starts - indptr[:-1], lengths) + np.arange(indptr[-1])
        return SparseRows(indptr, self.indices[positions], self.values[positions],
                          self.n_features)

    def to_dense(self) -> np.ndarray:
        """A (n, n_features) float32 array (tests, small examples: it is the whole
        table's width)."""
        out = np.zeros(self.shape, np.float32)
        rows = np.repeat(np.arange(len(self)), np.diff(self.indptr))
        np.add.at(out, (rows, self.indices), self.values)
        return out


def concatenate(parts: list[SparseRows]) -> SparseRows:
    """The rows of `parts`, one after another (all with the same n_features)."""
    if not parts:
        raise DataError("sparse rows: nothing to concatenate")
    n_features = parts[0].n_features
    if any(part.n_features != n_features for part in parts):
        raise DataError(f"sparse rows: parts with different n_features "
                        f"{sorted({part.n_features for part in parts})}")
    offsets = np.cumsum([0] + [part.nnz for part in parts])
    indptr = np.concatenate([[0]] + [part.indptr[1:] + offset
                                     for part, offset in zip(parts, offsets)])
    return SparseRows(indptr.astype(np.int64), np.concatenate([p.indices for p in parts]),
                      np.concatenate([p.values for p in parts]), n_features)


def _as_ids(indices: Any, n_features: int) -> np.ndarray:
    ids = np.asarray(indices)
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise DataError(f"sparse rows: feature ids must be integers, got {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= n_features):  # before a narrowing cast
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise DataError(f"sparse rows: the feature id {bad} is outside [0, {n_features})")
    return np.ascontiguousarray(ids, dtype=index_dtype(n_features))
