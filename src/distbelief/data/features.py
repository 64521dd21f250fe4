"""The kinds of features a dataset file's x holds beside dense arrays (hdf5.py's FORMAT has
the layout): "sparse", CSR rows in a group of three datasets, and "ids", one integer id per
field per example. What hdf5.py asks of them: the root attributes read and checked, a
split's x checked (its structure cheaply; its content, part by part, on request), rows
read, and a split's x created and appended to by the writer.

Imports no other module of data/ but sparse.py, so that hdf5.py can import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from distbelief.data.sparse import INDEX_LIMIT_32, SparseRows, concatenate, index_dtype
from distbelief.errors import DataError
from distbelief.runtime import counters

FEATURES = ("dense", "sparse", "ids")
"""What /split/x holds (root attribute `features`; absent means dense)."""
SPARSE_PARTS = ("indptr", "indices", "values")
ID_DTYPES = ("int32", "int64")
"""How ids are stored: int64 only where a table has more than 2**31 - 1 rows."""

# Content is checked in blocks of this many rows and entries: bounded memory for any file.
CHECK_ROWS = 1 << 20
CHECK_ENTRIES = 1 << 22
# Chunks of the writer's sparse datasets, about 256 KiB each.
INDPTR_CHUNK = 1 << 15
ENTRY_CHUNK = 1 << 16


@dataclass(frozen=True)
class Features:
    """What a file's root attributes say x is: its kind, and the table sizes the ids
    index (n_features for sparse; one per field for ids)."""

    kind: str = "dense"
    n_features: int = 0
    id_rows: tuple[int, ...] = ()


def _count(*arrays: Any) -> None:
    """hdf5.count_read's counter (the same process-wide figure), for reads made here."""
    counters.add("data_bytes_read", sum(int(a.nbytes) for a in arrays))


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def read_features(path: Path, attrs: h5py.AttributeManager) -> Features:
    """The root attributes `features`, `n_features` and `id_rows`, checked."""
    kind = _text(attrs.get("features", "dense"))
    if kind not in FEATURES:
        raise DataError(f"{path}: root attribute 'features' is {kind!r}, expected one of "
                        f"{', '.join(FEATURES)}")
    if kind == "sparse":
        value = np.asarray(attrs.get("n_features", -1))
        if value.shape != () or not np.issubdtype(value.dtype, np.integer) or value < 1:
            raise DataError(f"{path}: root attribute 'n_features' (the feature ids' table "
                            f"size) must be a positive integer, got "
                            f"{attrs.get('n_features', 'none')!r}")
        return Features(kind, n_features=int(value))
    if kind == "ids":
        if "id_rows" not in attrs:
            raise DataError(f"{path}: root attribute 'id_rows' is missing (the file's "
                            f"features are 'ids': one table size per field)")
        rows = np.asarray(attrs["id_rows"])
        if rows.ndim != 1 or not len(rows) or not np.issubdtype(rows.dtype, np.integer) \
                or rows.min() < 1:
            raise DataError(f"{path}: root attribute 'id_rows' must list one positive table "
                            f"size per field, got {rows.tolist()!r}")
        return Features(kind, id_rows=tuple(int(r) for r in rows))
    return Features()


def _dataset(path: Path, group: Any, name: str) -> h5py.Dataset:
    obj = group.get(name)
    if not isinstance(obj, h5py.Dataset):
        what = "missing" if obj is None else "not a dataset"
        raise DataError(f"{path}: /{group.name.strip('/')}/{name} is {what} (sparse x is a "
                        f"group of indptr, indices and values)")
    return obj


def sparse_parts(path: Path, f: h5py.File, split: str) -> tuple[h5py.Dataset, ...]:
    """/split/x's indptr, indices and values datasets (not checked beyond being there)."""
    group = f.get(f"{split}/x")
    if group is None:
        raise DataError(f"{path}: /{split}/x is missing")
    if not isinstance(group, h5py.Group):
        raise DataError(f"{path}: /{split}/x is a dataset, but the file's features are "
                        f"'sparse': x must be a group of indptr, indices and values")
    return tuple(_dataset(path, group, name) for name in SPARSE_PARTS)


def check_sparse_x(path: Path, f: h5py.File, split: str, n_features: int) -> tuple[int, int]:
    """(rows, stored entries) of /split/x once its structure is checked: three 1-d datasets
    of the right dtypes and lengths, indptr running from 0 to the number of entries."""
    indptr, indices, values = sparse_parts(path, f, split)
    where = f"/{split}/x"
    for ds in (indptr, indices, values):
        if ds.ndim != 1:
            raise DataError(f"{path}: {ds.name} has shape {ds.shape}, expected 1-d")
    if indptr.dtype != np.int64:
        raise DataError(f"{path}: {where}/indptr has dtype {indptr.dtype}, expected int64")
    if indices.dtype.name not in ID_DTYPES or (
            n_features > INDEX_LIMIT_32 and indices.dtype != np.int64):
        raise DataError(f"{path}: {where}/indices has dtype {indices.dtype}, expected "
                        f"{index_dtype(n_features)} for {n_features:,d} features")
    if values.dtype != np.float32:
        raise DataError(f"{path}: {where}/values has dtype {values.dtype}, expected float32")
    if indices.shape != values.shape:
        raise DataError(f"{path}: {where} has {indices.shape[0]} indices but "
                        f"{values.shape[0]} values")
    if indptr.shape[0] < 1:
        raise DataError(f"{path}: {where}/indptr is empty, expected rows + 1 offsets")
    first, last = int(indptr[0]), int(indptr[indptr.shape[0] - 1])
    if first != 0 or last != indices.shape[0]:
        raise DataError(f"{path}: {where}/indptr runs from {first} to {last}, expected 0 to "
                        f"the number of entries ({indices.shape[0]})")
    return indptr.shape[0] - 1, indices.shape[0]


def check_sparse_content(path: Path, f: h5py.File, split: str, n_features: int,
                         rows: tuple[int, int]) -> None:
    """Rows [first, stop) of /split/x: offsets non-decreasing, every id in [0, n_features),
    every value finite. Read in blocks, so a file larger than memory stays cheap."""
    indptr, indices, values = sparse_parts(path, f, split)
    first, stop = rows
    for start in range(first, stop, CHECK_ROWS):
        ptr = indptr[start:min(stop, start + CHECK_ROWS) + 1]
        _count(ptr)
        steps = np.diff(ptr)
        if len(steps) and steps.min() < 0:
            raise DataError(f"{path}: /{split}/x/indptr decreases at row "
                            f"{start + int(np.argmin(steps))}: the offsets must not decrease")
        for lo in range(int(ptr[0]), int(ptr[-1]), CHECK_ENTRIES):
            hi = min(int(ptr[-1]), lo + CHECK_ENTRIES)
            ids, vals = indices[lo:hi], values[lo:hi]
            _count(ids, vals)
            bad = np.flatnonzero((ids < 0) | (ids >= n_features))
            if len(bad):
                row = start + int(np.searchsorted(ptr, lo + bad[0], side="right")) - 1
                raise DataError(f"{path}: /{split}/x row {row} has the feature id "
                                f"{int(ids[bad[0]])}, outside [0, {n_features})")
            bad = np.flatnonzero(~np.isfinite(vals))
            if len(bad):
                row = start + int(np.searchsorted(ptr, lo + bad[0], side="right")) - 1
                raise DataError(f"{path}: /{split}/x row {row} holds the value "
                                f"{vals[bad[0]]}: values must be finite numbers")


def check_ids_x(path: Path, f: h5py.File, split: str, id_rows: tuple[int, ...]) -> int:
    """Rows of /split/x, an (N, fields) integer dataset, once its shape and dtype are
    checked against the id_rows attribute."""
    x = f.get(f"{split}/x")
    if not isinstance(x, h5py.Dataset):
        raise DataError(f"{path}: /{split}/x is {'missing' if x is None else 'not a dataset'}")
    if x.ndim != 2 or x.shape[1] != len(id_rows):
        raise DataError(f"{path}: /{split}/x has shape {x.shape}, expected (N, "
                        f"{len(id_rows)}): one id per field, as many fields as id_rows "
                        f"has table sizes")
    if x.dtype.name not in ID_DTYPES:
        raise DataError(f"{path}: /{split}/x has dtype {x.dtype}, expected int32 or int64 ids")
    return x.shape[0]


def check_ids_content(path: Path, f: h5py.File, split: str, id_rows: tuple[int, ...],
                      rows: tuple[int, int]) -> None:
    """Every id of rows [first, stop) of /split/x in [0, id_rows[field]), read in blocks."""
    x = f[f"{split}/x"]
    step = max(1, CHECK_ENTRIES // len(id_rows))
    first, stop = rows
    for start in range(first, stop, step):
        block = x[start:min(stop, start + step)]
        _count(block)
        bad = first_bad_id(id_rows, block)
        if bad is not None:
            row, field = bad
            raise DataError(f"{path}: /{split}/x row {start + row} field {field} has the id "
                            f"{int(block[row, field])}, outside [0, {id_rows[field]})")


def sparse_fits(f: h5py.File, split: str, rows: int) -> bool:
    """Whether /split/x is still a sparse group of `rows` rows (the file not replaced)."""
    group = f.get(f"{split}/x")
    if not isinstance(group, h5py.Group):
        return False
    parts = [group.get(name) for name in SPARSE_PARTS]
    return all(isinstance(p, h5py.Dataset) and p.ndim == 1 for p in parts) \
        and parts[0].shape[0] == rows + 1 and parts[1].shape == parts[2].shape


def read_sparse(group: h5py.Group, where: slice | np.ndarray, n_features: int) -> SparseRows:
    """Rows `where` (a slice of step 1, or ascending distinct row numbers) of a sparse x
    group: indptr's slice first, then only those rows' indices and values."""
    if isinstance(where, slice):
        return _read_sparse_range(group, where.start, where.stop, n_features)
    if not len(where):
        return _empty_rows(n_features)
    # Consecutive rows are read as one range: few reads when the rows cluster.
    breaks = np.flatnonzero(np.diff(where) != 1) + 1
    runs = zip(np.r_[0, breaks], np.r_[breaks, len(where)], strict=True)
    return concatenate([_read_sparse_range(group, int(where[a]), int(where[b - 1]) + 1,
                                           n_features) for a, b in runs])


def _read_sparse_range(group: h5py.Group, start: int, stop: int,
                       n_features: int) -> SparseRows:
    rows = group["indptr"].shape[0] - 1
    start = min(start, rows)
    stop = max(start, min(stop, rows))  # as a slice of a dataset: clipped, never reversed
    ptr = group["indptr"][start:stop + 1]
    lo, hi = int(ptr[0]), int(ptr[-1])
    indices = group["indices"][lo:hi].astype(index_dtype(n_features), copy=False)
    return SparseRows(ptr - lo, indices, group["values"][lo:hi], n_features)


def _empty_rows(n_features: int) -> SparseRows:
    return SparseRows(np.zeros(1, np.int64), np.empty(0, index_dtype(n_features)),
                      np.empty(0, np.float32), n_features)


def read_ids(x: h5py.Dataset, where: slice | np.ndarray) -> np.ndarray:
    """Rows `where` of an ids x dataset as int64 (N, fields)."""
    if not isinstance(where, slice) and not len(where):  # h5py refuses an empty point list
        return np.empty((0, x.shape[1]), np.int64)
    return x[where].astype(np.int64, copy=False)


# -- writing -------------------------------------------------------------------------------


def create_sparse(f: h5py.File, split: str, rows: int, n_features: int) -> None:
    """An empty sparse x group for `rows` rows; append_sparse fills it."""
    group = f.create_group(f"{split}/x")
    indptr = group.create_dataset("indptr", shape=(rows + 1,), dtype=np.int64,
                                  chunks=(min(INDPTR_CHUNK, rows + 1),), fletcher32=True)
    indptr[0] = 0
    for name, dtype in (("indices", index_dtype(n_features)), ("values", np.float32)):
        group.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype,
                             chunks=(ENTRY_CHUNK,), fletcher32=True)


def append_sparse(f: h5py.File, split: str, start: int, rows: SparseRows) -> None:
    """Rows `rows` as rows start, start + 1, ... of /split/x (after those written)."""
    group = f[f"{split}/x"]
    indices, values = group["indices"], group["values"]
    at = indices.shape[0]
    for ds, data in ((indices, rows.indices), (values, rows.values)):
        ds.resize((at + rows.nnz,))
        if rows.nnz:
            ds[at:] = data
    group["indptr"][start + 1:start + 1 + len(rows)] = rows.indptr[1:] + at


def first_bad_id(id_rows: tuple[int, ...], x: np.ndarray) -> tuple[int, int] | None:
    """(row, field) of the first id of x (rows, fields) outside its table, or None."""
    bad = np.argwhere((x < 0) | (x >= np.asarray(id_rows, dtype=np.int64)))
    return (int(bad[0][0]), int(bad[0][1])) if len(bad) else None


def check_id_block(id_rows: tuple[int, ...], x: np.ndarray) -> str | None:
    """What is wrong with a block of ids to write (shape, dtype, range), or None."""
    if x.ndim != 2 or x.shape[1] != len(id_rows):
        return f"ids of shape {x.shape}, expected (rows, {len(id_rows)})"
    if not np.issubdtype(x.dtype, np.integer):
        return f"ids of dtype {x.dtype}, expected integers"
    bad = first_bad_id(id_rows, x)
    if bad is not None:
        row, field = bad
        return (f"row {row} field {field} has the id {int(x[row, field])}, outside "
                f"[0, {id_rows[field]})")
    return None


def id_dtype(id_rows: tuple[int, ...]) -> str:
    """The narrowest dtype that stores ids of tables of `id_rows` rows."""
    return index_dtype(max(id_rows)).name
