"""A dataset file from arrays a researcher already has: numpy arrays in memory, `.npy` files
(memory-mapped), an `.npz` archive, or datasets of any other HDF5 file; and sparse features:
a SparseRows, a scipy.sparse matrix (or its `save_npz` file), or integer ids per field with
their table sizes. How-to: docs/your-own-data.md, docs/sparse-models.md.

`write_dataset` copies rows in blocks, so inputs larger than memory (`np.load(...,
mmap_mode="r")`, h5py datasets) go through with bounded memory; `read_source` opens a
source file's arrays by name; `pick_names` finds the usual names (x_train, y_train, ...).
"""

from __future__ import annotations

import os
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from distbelief.data.features import first_bad_id, id_dtype
from distbelief.data.hdf5 import (
    IMAGE_SCALE,
    TARGETS,
    DatasetInfo,
    DatasetWriter,
    non_finite_row,
)
from distbelief.data.sparse import SparseRows
from distbelief.errors import DataError

# Rows are copied in blocks of about this many bytes of x: bounded memory, few HDF5 calls.
BLOCK_BYTES = 32 << 20
# A progress callback is called at most this often (seconds).
PROGRESS_EVERY_S = 5.0
# What a mistaken label array's error adds, for the newcomer with regression or multi-label
# targets.
VALUES_HINT = ("multi-label (0/1) or regression targets are floats: pass y as float "
               "(y.astype(np.float32)) or targets='values' (--targets values)")

# The names a source file's arrays usually have (Keras, scikit-learn style, distbelief),
# tried in order when the caller names none: (x, y, x_test, y_test).
USUAL_NAMES = (
    ("x_train", "y_train", "x_test", "y_test"),
    ("X_train", "y_train", "X_test", "y_test"),
    ("X_train", "Y_train", "X_test", "Y_test"),
    ("train/x", "train/y", "test/x", "test/y"),
    ("x", "y", None, None),
    ("X", "y", None, None),
    ("X", "Y", None, None),
)

FILE_KINDS = {b"\x93NUMPY": "npy", b"PK\x03\x04": "npz", b"\x89HDF\r\n\x1a\n": "hdf5"}
SCIPY_NPZ_KEYS = frozenset({"format", "shape", "data", "indices", "indptr"})
"""The arrays scipy.sparse.save_npz writes for a CSR or CSC matrix."""


def file_kind(path: str | os.PathLike) -> str:
    """"npy", "npz" or "hdf5", read from the file's first bytes (not its name)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    for magic, kind in FILE_KINDS.items():
        if head.startswith(magic):
            return kind
    raise DataError(f"{path}: neither a numpy .npy or .npz file nor an HDF5 file (a CSV or "
                    f"an image folder: see docs/your-own-data.md for a few lines of numpy "
                    f"that read one)")


@contextmanager
def read_source(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """The arrays of an .npz or HDF5 file by name (HDF5: every dataset, by its path without
    the leading slash), open for the `with` block. .npz arrays are read into memory when
    first used; HDF5 datasets are read row block by row block."""
    path = Path(path)
    kind = file_kind(path)
    if kind == "npy":
        raise DataError(f"{path} is a single .npy array: give the inputs and labels as "
                        f"two files, --x X.npy --y Y.npy")
    if kind == "npz":
        try:
            archive = np.load(path, allow_pickle=False)
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            raise DataError(f"{path}: not a readable .npz file: {exc}") from exc
        with archive:
            if SCIPY_NPZ_KEYS <= set(archive.files):
                raise DataError(f"{path} holds one scipy.sparse matrix (save_npz), not named "
                                f"arrays: give it as --x {path.name} with the targets as "
                                f"--y Y.npy")
            yield _LazyNpz(path, archive)
        return
    import h5py

    try:
        f = h5py.File(path, "r", locking=False)
    except OSError as exc:
        raise DataError(f"{path}: not a readable HDF5 file: {exc}") from exc
    with f:
        found: dict[str, Any] = {}

        def note(name: str, obj: Any) -> None:  # returns None: visititems goes on
            if isinstance(obj, h5py.Dataset):
                found[name] = obj

        f.visititems(note)
        yield found


class _LazyNpz(dict):
    """An .npz archive's arrays by name, each read on first use (not all at open)."""

    def __init__(self, path: Path, archive: Any):
        super().__init__((name, None) for name in archive.files)
        self._path, self._archive = path, archive

    def __getitem__(self, name: str) -> np.ndarray:
        value = super().__getitem__(name)
        if value is None:
            try:
                value = self._archive[name]
            except ValueError as exc:  # object arrays need pickle, which is never allowed
                raise DataError(f"{self._path}: array {name!r} cannot be read without "
                                f"pickle: {exc}") from exc
            super().__setitem__(name, value)
        return value


def load_npy(path: str | os.PathLike) -> Any:
    """One .npy file, memory-mapped (read as rows are copied, never whole); or a sparse
    matrix that scipy.sparse.save_npz wrote, as SparseRows (read whole)."""
    path = Path(path)
    kind = file_kind(path)
    if kind == "npz" and _is_scipy_npz(path):
        return load_sparse_npz(path)
    if kind != "npy":
        raise DataError(f"{path}: not a .npy file (an .npz or HDF5 file is the SOURCE "
                        f"argument, with --x NAME --y NAME)")
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: not a readable .npy file: {exc}") from exc


def _is_scipy_npz(path: Path) -> bool:
    try:
        with np.load(path, allow_pickle=False) as archive:
            return SCIPY_NPZ_KEYS <= set(archive.files)
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: not a readable .npz file: {exc}") from exc


def load_sparse_npz(path: str | os.PathLike) -> SparseRows:
    """The matrix of an .npz file that scipy.sparse.save_npz wrote (CSR, or CSC turned into
    CSR), read with numpy alone, as SparseRows."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as archive:
            if not SCIPY_NPZ_KEYS <= set(archive.files):
                raise DataError(f"{path}: not a scipy.sparse matrix file (save_npz): it "
                                f"holds {', '.join(sorted(archive.files))}")
            fmt = archive["format"].item()
            fmt = fmt.decode("ascii", "replace") if isinstance(fmt, bytes) else str(fmt)
            shape = tuple(int(d) for d in archive["shape"])
            data, indices, indptr = (archive[name] for name in ("data", "indices", "indptr"))
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: not a readable .npz file: {exc}") from exc
    if fmt not in ("csr", "csc") or len(shape) != 2:
        raise DataError(f"{path}: a scipy.sparse {fmt} matrix; only CSR and CSC are read: "
                        f"save_npz(path, matrix.tocsr()) first")
    if len(indptr) != (shape[1] if fmt == "csc" else shape[0]) + 1:
        raise DataError(f"{path}: indptr has {len(indptr)} offsets for a {fmt} matrix of "
                        f"shape {shape}")
    if fmt == "csc":
        indptr, indices, data = _csc_to_csr(shape, indptr, indices, data)
    try:
        return SparseRows.from_arrays(indptr, indices, data, shape[1])
    except DataError as exc:
        raise DataError(f"{path}: {exc}") from exc


def _csc_to_csr(shape: tuple[int, int], indptr: np.ndarray, indices: np.ndarray,
                data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The CSR arrays of a CSC matrix: entries sorted by row, columns ascending within it."""
    columns = np.repeat(np.arange(shape[1], dtype=np.int64), np.diff(indptr))
    rows = np.asarray(indices, dtype=np.int64)
    if len(rows) and (rows.min() < 0 or rows.max() >= shape[0]):
        raise DataError(f"a CSC matrix of shape {shape} has the row index "
                        f"{int(rows.min() if rows.min() < 0 else rows.max())}")
    order = np.argsort(rows, kind="stable")  # stable: columns stay ascending within a row
    csr_indptr = np.zeros(shape[0] + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=shape[0]), out=csr_indptr[1:])
    return csr_indptr, columns[order], np.asarray(data)[order]


def pick_names(path: Path, available: list[str], x: str | None, y: str | None,
               x_test: str | None, y_test: str | None) -> tuple[str, str, str | None,
                                                              str | None]:
    """The names of (x, y, x_test, y_test) in a source file: the ones given, else the first
    of USUAL_NAMES the file holds. DataError listing what it holds otherwise."""
    holds = ", ".join(sorted(available)) or "no arrays"
    if (x is None) != (y is None):
        raise DataError("give both --x and --y (the inputs and the labels), or neither")
    if (x_test is None) != (y_test is None):
        raise DataError("give both --x-test and --y-test, or neither")
    if x is None:
        for names in USUAL_NAMES:
            if names[0] in available and names[1] in available:
                x, y = names[:2]
                if x_test is None and names[2] in available and names[3] in available:
                    x_test, y_test = names[2:]
                break
        else:
            raise DataError(f"{path} holds {holds}: name the inputs and labels with "
                            f"--x NAME --y NAME (and the test split with --x-test NAME "
                            f"--y-test NAME, or hold one out with --test-fraction F)")
    for name in (x, y, x_test, y_test):
        if name is not None and name not in available:
            raise DataError(f"{path} has no array {name!r}; it holds {holds}")
    return x, y, x_test, y_test


def write_dataset(path: str | os.PathLike, x: Any, y: Any, x_test: Any = None,
                  y_test: Any = None, *, test_fraction: float | None = None,
                  num_classes: int | None = None, targets: str | None = None,
                  scale: float | None = None, shuffle: bool = True, seed: int = 0,
                  source: str = "arrays",
                  progress: Callable[[int, int], None] | None = None,
                  id_rows: Any = None) -> DatasetInfo:
    """Write inputs `x` (N, *input_shape) and targets `y` as a distbelief dataset file at
    `path` (atomically: a failure leaves no file there).

    `y` is either integer class labels (N,), or float values (N,) or (N, k): regression
    targets, or multi-label 0/1 outputs. `targets` says which ("classes" or "values"); by
    default an integer y (or a given `num_classes`) makes class labels, a float or bool y
    values (bool as 0.0/1.0). The test split is `x_test`, `y_test`, or else a seeded random
    `test_fraction` of the rows, held out. uint8 inputs are stored as they are, with `scale`
    (default 1/255, for image bytes); any other numbers become float32 times `scale`
    (default 1). Labels must be whole numbers in [0, num_classes); `num_classes` defaults
    to the largest label + 1. Values are stored as float32 and must be finite. With
    `shuffle` (the default) the training rows are written in a seeded random order, so
    that each replica's contiguous block of rows holds every class even when the source is
    sorted by class. Arrays are read in blocks: np.memmap and h5py datasets larger than
    memory go through. `progress(rows_done, rows_total)` is called every few seconds.
    Returns the written file's description.

    Sparse features (docs/sparse-models.md): x (and x_test) given as a data.sparse.SparseRows
    or as any scipy.sparse matrix (anything with `.tocsr()`) makes a "sparse" file of
    x.shape[1] features; integer x (N, fields) with `id_rows`, one table size per field,
    makes an "ids" file (field f's ids in [0, id_rows[f])). Neither takes a `scale`.
    """
    path = Path(path)
    features = _features_of(x, id_rows, "x")
    x = _as_rows(x, "x", features)
    targets = _target_kind(y, targets, num_classes)
    x_shape = _check_pair(x, y, "x", "y", targets)
    id_rows = _check_id_rows(id_rows, x_shape) if features == "ids" else ()
    if (x_test is None) != (y_test is None):
        raise DataError("give both x_test and y_test, or neither")
    if x_test is not None and test_fraction is not None:
        raise DataError("give a test split (x_test, y_test) or a test_fraction, not both")
    stored, scale = _storage(x, scale, features, id_rows)
    n = x_shape[0]
    if x_test is not None:
        if _features_of(x_test, id_rows or None, "x_test") != features:
            raise DataError(f"x is {features} but x_test is "
                            f"{_features_of(x_test, id_rows or None, 'x_test')}: give both "
                            f"the same kind of features")
        x_test = _as_rows(x_test, "x_test", features)
        test_shape = _check_pair(x_test, y_test, "x_test", "y_test", targets)
        if test_shape[1:] != x_shape[1:]:
            raise DataError(f"x has rows of shape {x_shape[1:]} but x_test has "
                            f"{test_shape[1:]}")
        if tuple(y_test.shape[1:]) != tuple(y.shape[1:]):
            raise DataError(f"y has targets of shape {tuple(y.shape)} but y_test has "
                            f"{tuple(y_test.shape)}: give both the same number of targets "
                            f"per row")
        if features == "dense" and _storage(x_test, scale, features, ())[0] != stored:
            raise DataError(f"x is {np.dtype(x.dtype)} but x_test is "
                            f"{np.dtype(x_test.dtype)}: give both as uint8 or both as numbers "
                            f"to store as float32")
        train_rows, test_rows = np.arange(n), None
    else:
        train_rows, test_rows = _hold_out(n, test_fraction, seed)
    if shuffle:
        train_rows = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(1,))) \
            .permutation(train_rows)
    splits = {"train": (x, y, "x", "y", train_rows),
              "test": (x, y, "x", "y", test_rows) if test_rows is not None
              else (x_test, y_test, "x_test", "y_test", np.arange(x_test.shape[0]))}
    if targets == "classes" and num_classes is None:
        num_classes = 1 + max(_largest_label(labels, name) for name, labels in
                              (("y", y), ("y_test", y_test)) if labels is not None)
    if targets == "classes" and num_classes < 2:
        raise DataError(f"the labels hold a single class (num_classes = {num_classes}); "
                        f"a classifier needs at least 2")
    total = sum(len(rows) for *_, rows in splits.values())
    done, last = 0, time.monotonic()
    with DatasetWriter(path, input_shape=x_shape[1:], num_classes=int(num_classes or 0),
                       n_train=len(splits["train"][-1]), n_test=len(splits["test"][-1]),
                       stored_dtype=stored, scale=scale, source=source, targets=targets,
                       target_shape=tuple(int(d) for d in y.shape[1:]), features=features,
                       id_rows=id_rows) as writer:
        for split, (xs, ys, x_name, y_name, rows) in splits.items():
            for block in _blocks(rows, _row_bytes(x, features)):
                by = _gather(ys, block)
                by = (_labels(by, split, num_classes) if targets == "classes"
                      else _values(by, y_name, block))
                writer.append(split, _x_block(xs, block, stored, id_rows, x_name), by)
                done += len(block)
                if progress is not None and time.monotonic() - last >= PROGRESS_EVERY_S:
                    progress(done, total)
                    last = time.monotonic()
        return writer.commit()


def _target_kind(y: Any, targets: str | None, num_classes: int | None) -> str:
    """"classes" or "values": `targets` if given, else from y's dtype (integer or a given
    num_classes: class labels; float or bool: values)."""
    if targets is not None:
        if targets not in TARGETS:
            raise DataError(f"targets must be 'classes' (integer labels) or 'values' (float "
                            f"targets: regression, multi-label), got {targets!r}")
        if targets == "values" and num_classes is not None:
            raise DataError("num_classes is for class labels: values targets have none "
                            "(leave it out)")
        return targets
    dtype = getattr(y, "dtype", None)
    if num_classes is None and dtype is not None and (
            np.issubdtype(dtype, np.floating) or dtype == np.bool_):
        return "values"
    return "classes"  # integers; anything else is reported by _labels


def _check_pair(x: Any, y: Any, x_name: str, y_name: str, targets: str) -> tuple[int, ...]:
    """x's shape, once x and y are checked to be (N, *input_shape) inputs and N labels
    (classes) or N rows of targets, (N,) or (N, k) (values)."""
    for value, name in ((x, x_name), (y, y_name)):
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise DataError(f"{name} must be an array (numpy, memory-mapped or an h5py "
                            f"dataset), got {type(value).__name__}")
    shape = tuple(int(d) for d in x.shape)
    if len(shape) < 2 or min(shape[1:]) == 0:
        raise DataError(f"{x_name} has shape {shape}: expected (rows, *input_shape), e.g. "
                        f"(N, 784) for flat features or (N, 28, 28, 1) for images")
    if targets == "classes" and len(y.shape) != 1:
        raise DataError(f"{y_name} has shape {tuple(y.shape)} of {np.dtype(y.dtype)}: class "
                        f"labels are one per row, (N,) (one-hot labels: take their argmax "
                        f"first); {VALUES_HINT}")
    if targets == "values" and (len(y.shape) not in (1, 2) or min(y.shape[1:], default=1) < 1):
        raise DataError(f"{y_name} has shape {tuple(y.shape)}: targets are (N,) or (N, k), "
                        f"k >= 1 numbers a row")
    if y.shape[0] != shape[0]:
        raise DataError(f"{x_name} has {shape[0]} rows but {y_name} has {y.shape[0]} "
                        f"{'labels' if targets == 'classes' else 'rows'}")
    if shape[0] == 0:
        raise DataError(f"{x_name} has no rows")
    return shape


def _features_of(x: Any, id_rows: Any, name: str) -> str:
    """What kind of features x is (hdf5.py's FORMAT): "sparse" for a SparseRows or a
    scipy.sparse matrix, "ids" for integer x with id_rows, else "dense"."""
    sparse = isinstance(x, SparseRows) or hasattr(x, "tocsr")
    if id_rows is None:
        return "sparse" if sparse else "dense"
    if sparse:
        raise DataError(f"id_rows is for integer ids, one per field, but {name} is a sparse "
                        f"matrix: leave id_rows out for sparse features")
    dtype = getattr(x, "dtype", None)
    if dtype is None or not np.issubdtype(dtype, np.integer) or len(x.shape) != 2:
        raise DataError(f"with id_rows, {name} must be integer ids (N, fields), got "
                        f"{getattr(x, 'dtype', type(x).__name__)} of shape "
                        f"{tuple(getattr(x, 'shape', ()))}")
    return "ids"


def _as_rows(x: Any, name: str, features: str) -> Any:
    """x as write_dataset copies it: a scipy.sparse matrix as SparseRows."""
    if features != "sparse" or isinstance(x, SparseRows):
        return x
    try:
        return SparseRows.from_scipy(x)
    except DataError as exc:
        raise DataError(f"{name}: {exc}") from exc


def _check_id_rows(id_rows: Any, x_shape: tuple[int, ...]) -> tuple[int, ...]:
    """id_rows as a tuple of positive ints, one per field of x."""
    try:
        rows = tuple(int(r) for r in id_rows)
    except (TypeError, ValueError) as exc:
        raise DataError(f"id_rows must be a list of table sizes, one per field, got "
                        f"{id_rows!r}") from exc
    if len(rows) != x_shape[1] or min(rows, default=0) < 1 \
            or any(r != v for r, v in zip(rows, id_rows, strict=True)):
        raise DataError(f"id_rows must give one positive whole table size for each of x's "
                        f"{x_shape[1]} fields, got {list(id_rows)!r}")
    return rows


def _row_bytes(x: Any, features: str) -> int:
    """Bytes of one of x's rows as copied, for the block size."""
    if features == "sparse":
        return 8 * x.nnz // max(1, len(x)) + 8
    return (8 if features == "ids" else 4) * int(np.prod(x.shape[1:], dtype=np.int64))


def _x_block(xs: Any, rows: np.ndarray, stored: str, id_rows: tuple[int, ...],
             name: str) -> Any:
    """Rows `rows` of xs as the writer takes them, ids checked against their tables."""
    if isinstance(xs, SparseRows):
        return xs[rows]  # in memory: any order
    block = _gather(xs, rows)
    if id_rows:
        bad = first_bad_id(id_rows, block)
        if bad is not None:
            row, field = bad
            raise DataError(f"{name} row {int(rows[row])} field {field} has the id "
                            f"{int(block[row, field])}, outside [0, {id_rows[field]}): "
                            f"id_rows[{field}] is that field's table size")
        return block
    return block.astype(stored, copy=False)


def _storage(x: Any, scale: float | None, features: str = "dense",
             id_rows: tuple[int, ...] = ()) -> tuple[str, float]:
    """(stored dtype, scale) for inputs of x's dtype and kind of features."""
    if features != "dense":
        if scale is not None and scale != 1:
            raise DataError(f"{features} features have no scale (got scale={scale}): scale "
                            f"the values before writing them")
        return ("float32" if features == "sparse" else id_dtype(id_rows)), 1.0
    dtype = np.dtype(x.dtype)
    if not (np.issubdtype(dtype, np.number) or dtype == np.bool_):
        raise DataError(f"inputs of dtype {dtype} are not numbers")
    if scale is not None and not (np.isfinite(scale) and scale > 0):
        raise DataError(f"scale must be a positive number, got {scale}")
    if dtype == np.uint8:
        return "uint8", IMAGE_SCALE if scale is None else float(scale)
    return "float32", 1.0 if scale is None else float(scale)


def _hold_out(n: int, fraction: float | None, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, test rows): a seeded random `fraction` of range(n) held out."""
    if fraction is None:
        raise DataError("there is no test split: give one (x_test and y_test; --x-test and "
                        "--y-test) or hold out a fraction of the rows (test_fraction; "
                        "--test-fraction 0.1)")
    if not 0 < fraction < 1:
        raise DataError(f"test_fraction must be between 0 and 1, got {fraction}")
    n_test = round(n * fraction)
    if not 1 <= n_test < n:
        raise DataError(f"test_fraction {fraction} of {n} rows leaves "
                        f"{'no test row' if n_test < 1 else 'no training row'}")
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0,)))
    held = np.zeros(n, dtype=bool)
    held[rng.choice(n, size=n_test, replace=False)] = True
    return np.flatnonzero(~held), np.flatnonzero(held)


def _blocks(rows: np.ndarray, row_bytes: int) -> Iterator[np.ndarray]:
    step = max(1, BLOCK_BYTES // max(1, row_bytes))
    for start in range(0, len(rows), step):
        yield rows[start:start + step]


def _gather(array: Any, rows: np.ndarray) -> np.ndarray:
    """array[rows] for any array-like, reading in increasing row order (h5py requires it,
    and it keeps a memory map's reads forward)."""
    if len(rows) and rows[-1] - rows[0] == len(rows) - 1 and np.all(np.diff(rows) == 1):
        return np.asarray(array[int(rows[0]):int(rows[-1]) + 1])
    order = np.argsort(rows, kind="stable")
    taken = np.asarray(array[rows[order]])
    out = np.empty_like(taken)
    out[order] = taken
    return out


def _largest_label(labels: Any, name: str) -> int:
    largest = -1
    n = labels.shape[0]
    step = 1 << 22
    for start in range(0, n, step):
        block = _labels(np.asarray(labels[start:start + step]), name, None)
        largest = max(largest, int(block.max()))
    return largest


def _labels(values: np.ndarray, split: str, num_classes: int | None) -> np.ndarray:
    """Labels as int32, checked: whole numbers in [0, num_classes)."""
    if np.issubdtype(values.dtype, np.floating):
        if not np.all(np.isfinite(values)) or np.any(values != np.round(values)):
            raise DataError(f"{split} labels must be whole numbers (class indices), found "
                            f"{values[~(values == np.round(values))][:1]}")
    elif not (np.issubdtype(values.dtype, np.integer) or values.dtype == np.bool_):
        raise DataError(f"{split} labels have dtype {values.dtype}: expected class indices "
                        f"0, 1, 2, ... (map names to indices first)")
    if values.size and values.min() < 0:
        raise DataError(f"{split} has a negative label, {int(values.min())}")
    if num_classes is not None and values.size and values.max() >= num_classes:
        raise DataError(f"{split} has label {int(values.max())}, outside [0, {num_classes})")
    return values.astype(np.int32)


def _values(values: np.ndarray, name: str, rows: np.ndarray) -> np.ndarray:
    """Targets as float32, checked finite; `rows` are their rows in `name`, for the error."""
    if not (np.issubdtype(values.dtype, np.number) or values.dtype == np.bool_) \
            or np.issubdtype(values.dtype, np.complexfloating):
        raise DataError(f"{name} has dtype {values.dtype}: values targets must be real numbers")
    with np.errstate(over="ignore"):  # a float64 too large for float32: reported below
        out = values.astype(np.float32)
    at = non_finite_row(out)
    if at is not None:  # the value as given: a float64 may be finite but too large
        bad = np.asarray(values[at])[~np.isfinite(out[at])].flat[0]
        raise DataError(f"{name} row {int(rows[at])} holds {bad}: targets must be finite "
                        f"float32 numbers (no NaN or infinity)")
    return out


def convert_arrays(source: str | None, out_path: str, x_name: str | None, y_name: str | None,
                   x_test: str | None, y_test: str | None, *, test_fraction: float | None,
                   classes: int | None, scale: float | None, shuffle: bool,
                   seed: int, targets: str | None = None,
                   id_rows: tuple[int, ...] | None = None) -> None:
    """`distbelief prepare arrays`: the arrays of `source` (an .npz or HDF5 file; None:
    the .npy files the names give, or scipy.sparse .npz files) written as a dataset at
    `out_path`, with progress lines on stdout. Never overwrites a file. `targets`,
    `id_rows`: as write_dataset's."""
    out = Path(out_path)
    if out.exists():
        raise DataError(f"{out} exists: distbelief never overwrites a dataset; remove it or "
                        "choose another --out")

    def convert(x: Any, y: Any, x_test: Any, y_test: Any, source: str) -> None:
        def report(done: int, total: int) -> None:
            print(f"distbelief prepare: {done:,d} of {total:,d} rows", flush=True)

        info = write_dataset(out, x, y, x_test, y_test, test_fraction=test_fraction,
                             num_classes=classes, targets=targets, scale=scale,
                             shuffle=shuffle, seed=seed, source=source,
                             progress=report, id_rows=id_rows)
        print(f"wrote {out}: {info.n_train:,d} training and {info.n_test:,d} test rows of "
              f"{_what_x_holds(info)}")

    names = (x_name, y_name, x_test, y_test)
    if source is None:
        if x_name is None or y_name is None:
            raise DataError("give an .npz or HDF5 file as SOURCE, or two .npy files with "
                            "--x X.npy --y Y.npy (see distbelief prepare arrays --help)")
        if (x_test is None) != (y_test is None):
            raise DataError("give both --x-test and --y-test, or neither")
        arrays = [None if name is None else load_npy(name) for name in names]
        convert(*arrays, source=f"numpy files {', '.join(n for n in names if n)}")
        return
    with read_source(source) as found:
        chosen = pick_names(Path(source), list(found), *names)
        arrays = [None if name is None else found[name] for name in chosen]
        convert(*arrays, source=f"{Path(source).resolve()}: "
                                f"{', '.join(n for n in chosen if n)}")


def _what_x_holds(info: DatasetInfo) -> str:
    """'shape (784,), 10 classes, stored as uint8': what a row holds, or for sparse
    features their kind and size, and what y holds."""
    if info.features == "sparse":
        return (f"sparse features ({info.input_shape[0]:,d} ids, {info.nnz_per_row:.1f} "
                f"stored a row on average), {_what_y_holds(info)}")
    if info.features == "ids":
        return (f"{len(info.id_rows)} id fields (table sizes "
                f"{', '.join(map(str, info.id_rows))}), {_what_y_holds(info)}")
    return f"shape {info.input_shape}, {_what_y_holds(info)}, stored as {info.stored_dtype}"


def _what_y_holds(info: DatasetInfo) -> str:
    """'7 classes', or for values '3 float targets a row (values: ...)' with the way back
    to classes, so that class labels stored as floats, read as values, are noticed."""
    if info.targets == "classes":
        return f"{info.num_classes} classes"
    count = f"{info.outputs} float target{'s' if info.outputs > 1 else ''} a row"
    return (f"{count} (values: regression or multi-label; for class labels pass integers "
            f"or --targets classes)")
