"""The dataset file format: validation on open, per-rank training shards, the test set, and
an atomic writer the converters in `datasets.py` use.

FORMAT (version 1). One HDF5 file holding four datasets:

    /train/x   (N_train, *input_shape)   uint8 or float32, chunked by rows
    /train/y   (N_train,)                "classes": integer labels in [0, num_classes)
               (N_train,) or (N_train, k)  "values": finite float32 targets, k >= 1
    /test/x    (N_test, *input_shape)    same dtype and `scale` as /train/x
    /test/y    as /train/y, with the same per-row shape

input_shape is (H, W, C) for images (Fashion-MNIST: (28, 28, 1)) or (F,) for flat features.
uint8 x carries a float attribute `scale`: value = stored * scale (1/255 for images). float32
x may carry `scale` too; without it the scale is 1. Root attributes: `format` =
"distbelief-dataset", `version` = 1, `targets` = "classes" (the default when absent) or
"values" (regression, multi-label 0/1), `num_classes` (int >= 2; classes only: a values
file needs none and any is ignored), `source` (free text). Both splits hold at least one row.
An optional third split, /val/x and /val/y (same shapes, dtype and scale), is a validation
set: when it is there, evaluations during training and the stop rules use it, and the test
set is evaluated once, at the end. Without one, `with_validation` holds out the last rows
of /train (data.validation). Files written here chunk x by rows (about 256 KiB per chunk)
so that reading a block of rows reads only the chunks that hold them, and add Fletcher-32
checksums to every chunk, so flipped bytes raise an error instead of becoming silent bad
pixels. Readers accept files without either (e.g. written by hand with h5py).

Sparse features (issue 44; docs/sparse-models.md). A root attribute `features` says what
x holds: "dense" (the default when absent: everything above), or one of two kinds for
sparse models, whose y is as above and whose splits follow the same rules (/val included):

    features = "sparse"   root attribute n_features (int >= 1): the feature ids' table size
    /split/x              a GROUP, compressed sparse rows (scipy.sparse's CSR):
      indptr   (N + 1,)   int64, 0 first, the number of entries last, non-decreasing;
                          row i's entries are [indptr[i], indptr[i + 1])
      indices  (nnz,)     int32 feature ids in [0, n_features) (int64 where n_features
                          > 2**31 - 1)
      values   (nnz,)     float32, finite
    input_shape = (n_features,); readers give x as a data.sparse.SparseRows.

    features = "ids"      root attribute id_rows: int64 array, one table size per field
    /split/x              (N, fields) int32 ids (int64 where a table has more than
                          2**31 - 1 rows); field f's ids are in [0, id_rows[f])
    input_shape = (fields,); readers give x as int64 (never floats, never scaled).

Neither kind has a `scale`. A file may also hold a group /planted (synthetic_sparse.py's
planted model), which readers ignore. Reading a block of sparse rows reads its slice of
indptr, then only the indices and values that slice spans.

`open_dataset` validates everything that is cheap to check (structure, shapes, dtypes,
attributes, every label's range or every value's finiteness; for sparse x also every
offset, id and value, for ids x every id's range) and returns a `DatasetInfo`.
`TrainShard` holds one rank's contiguous block of training rows in memory, in the stored
dtype, and serves minibatches.
Every problem with a file is a `DataError` whose one-line message names the file.

`bytes_read()` is how many bytes of rows and labels this process has read from dataset
files (x and y as stored, array nbytes): the file system's load per rank, which should be
that rank's share of the data, not the whole set (issue 32).
"""

from __future__ import annotations

import math
import os
import secrets
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple, Self

import h5py
import numpy as np

from distbelief.data import features as kinds
from distbelief.data.features import Features
from distbelief.data.sparse import SparseRows, index_dtype
from distbelief.errors import DataError
from distbelief.model.layout import balanced_ranges
from distbelief.runtime import counters

FORMAT_NAME = "distbelief-dataset"
FORMAT_VERSION = 1
SPLITS = ("train", "test", "validation")
"""What load_split reads: "validation" is /val, or the rows of /train held out by
with_validation."""
STORED_DTYPES = ("uint8", "float32")
TARGETS = ("classes", "values")
"""What /split/y holds (root attribute `targets`): integer class labels, or float32 values
of any per-row shape () or (k,) (regression, multi-label)."""
IMAGE_SCALE = 1.0 / 255.0

# Aim for chunks of about this many bytes: big enough that HDF5's per-chunk overhead is
# negligible, small enough that a shard boundary drags in little foreign data.
CHUNK_BYTES = 256 * 1024
DENSE = Features()
"""The Features of a dense file (no `features` attribute)."""
# What h5py raises for a damaged file (found by flipping random bytes of valid files):
# OSError for unreadable metadata or a failed chunk checksum, RuntimeError or KeyError for
# damaged object headers, ValueError or TypeError for a damaged datatype.
H5_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError)
# Labels are checked in blocks so that validating a file larger than memory stays cheap
# (values: blocks of this many targets, whatever the width of a row).
LABEL_CHECK_ROWS = 1 << 20

def bytes_read() -> int:
    """Bytes of rows and labels (x and y as stored: the nbytes of what was read) this
    process has read from dataset files so far: shards, evaluation sets, label checks.
    Process-wide on purpose: what the process asked of the file system, whoever asked
    (summary.json's control_plane reports the same counter, data_bytes_read)."""
    return counters.count("data_bytes_read")


def count_read(*arrays: np.ndarray) -> None:
    """Add the stored bytes of `arrays`, just read from a dataset file, to bytes_read()
    (thread-safe: a streaming shard's prefetch thread reads too)."""
    counters.add("data_bytes_read", sum(int(a.nbytes) for a in arrays))


@dataclass(frozen=True)
class DatasetInfo:
    """What `open_dataset` learned about a valid dataset file."""

    path: Path
    input_shape: tuple[int, ...]
    num_classes: int
    n_train: int
    n_test: int
    stored_dtype: str
    scale: float
    n_val: int = 0
    """Rows of the validation split: /val's, or the held-out end of /train."""
    held_out: int = 0
    """Rows at the end of /train held out as the validation split (with_validation):
    n_train counts only the rows trained on."""
    targets: str = "classes"
    """What y holds: "classes" (int labels; num_classes > 0) or "values" (float32 targets;
    num_classes is 0)."""
    target_shape: tuple[int, ...] = ()
    """The per-row shape of y: () for (N,), (k,) for (N, k) ("values" only)."""
    features: str = "dense"
    """What x holds: "dense" arrays, "sparse" CSR rows of input_shape[0] features (readers
    give data.sparse.SparseRows), or "ids", one integer id per field (readers give int64
    (N, fields))."""
    id_rows: tuple[int, ...] = ()
    """"ids" only: each field's table size (field f's ids are in [0, id_rows[f]))."""
    nnz_per_row: float = 0.0
    """"sparse" only: the average number of stored entries in a row of /train."""

    @property
    def stored_row_bytes(self) -> int:
        """Bytes of one row of x as a training shard holds it: the stored dtype for dense
        rows, indices, values and an indptr entry (average) for sparse ones, int64 ids."""
        if self.features == "sparse":
            entry = index_dtype(self.input_shape[0]).itemsize + 4
            return math.ceil(entry * self.nnz_per_row) + 8
        if self.features == "ids":
            return 8 * self.input_shape[0]
        return math.prod(self.input_shape) * np.dtype(self.stored_dtype).itemsize

    @property
    def input_row_bytes(self) -> int:
        """Bytes of one row of x as a model takes it (a batch's, the evaluation set's): a
        dense row as float32, a sparse or ids row as stored_row_bytes."""
        if self.features == "dense":
            return 4 * math.prod(self.input_shape)
        return self.stored_row_bytes

    @property
    def outputs(self) -> int:
        """How many outputs a model of this data has: num_classes for classes, else the
        number of target values per row (1 for y of shape (N,))."""
        return self.num_classes if self.targets == "classes" else math.prod(self.target_shape)

    @property
    def target_dtype(self) -> np.dtype:
        """The dtype every reader returns y in: int32 for classes, float32 for values."""
        return np.dtype(np.int32 if self.targets == "classes" else np.float32)


def open_h5(path: Path) -> h5py.File:
    """Open read-only, turning h5py's errors into one DataError.

    File locking is off: our writers never expose a half-written file (they rename a
    finished one into place), and HDF5's locks fail on some cluster file systems, where
    every replica opens the same file at once.
    """
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if not path.is_file():
        raise DataError(f"{path}: not a regular file")
    try:
        return h5py.File(path, "r", locking=False)
    except H5_ERRORS as exc:
        numpy_kind = _numpy_kind(path)
        if numpy_kind:
            raise DataError(f"{path}: a numpy {numpy_kind} file, not a distbelief dataset "
                            f"(HDF5); {CONVERT_HINT}") from exc
        raise DataError(f"{path}: not a readable HDF5 file (truncated or corrupt?): "
                        f"{first_line(exc)}") from exc


CONVERT_HINT = ("convert your arrays with `distbelief prepare arrays` (docs/your-own-data.md: "
                ".npz, .npy pairs, other HDF5 layouts)")


def _numpy_kind(path: Path) -> str | None:
    """".npy" or ".npz" when the file starts as one does, else None."""
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError:
        return None
    return ".npy" if head == b"\x93NUMPY" else ".npz" if head[:4] == b"PK\x03\x04" else None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _attr_text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _attr_int(path: Path, attrs: h5py.AttributeManager, name: str) -> int:
    if name not in attrs:
        raise DataError(f"{path}: root attribute '{name}' is missing")
    value = np.asarray(attrs[name])
    if value.shape != () or not np.issubdtype(value.dtype, np.integer):
        raise DataError(f"{path}: root attribute '{name}' must be an integer, got {value!r}")
    return int(value)


def _get_dataset(path: Path, f: h5py.File, name: str) -> h5py.Dataset:
    obj = f.get(name)
    if obj is None:
        raise DataError(f"{path}: dataset /{name} is missing")
    if not isinstance(obj, h5py.Dataset):
        raise DataError(f"{path}: /{name} is not a dataset")
    return obj


def _x_scale(path: Path, x: h5py.Dataset, name: str) -> tuple[str, float]:
    """The stored dtype of an x dataset and its scale, validated."""
    dtype = x.dtype.name
    if dtype not in STORED_DTYPES:
        raise DataError(f"{path}: /{name} has dtype {dtype}, expected uint8 or float32")
    if "scale" in x.attrs:
        scale = np.asarray(x.attrs["scale"])
        if scale.shape != () or not np.issubdtype(scale.dtype, np.number):
            raise DataError(f"{path}: /{name} attribute 'scale' must be a number")
        scale = float(scale)
    elif dtype == "uint8":
        raise DataError(f"{path}: /{name} is uint8 but has no 'scale' attribute")
    else:
        scale = 1.0
    if not (np.isfinite(scale) and scale > 0):
        raise DataError(f"{path}: /{name} attribute 'scale' must be positive, got {scale}")
    return dtype, scale


def _part_rows(rows: int, part: tuple[int, int]) -> tuple[int, int]:
    """[first, stop) of `part` = (i, k): the i-th of k contiguous near-equal parts of rows."""
    i, k = part
    return rows * i // k, rows * (i + 1) // k


def _check_labels(path: Path, y: h5py.Dataset, name: str, num_classes: int,
                  part: tuple[int, int] = (0, 1)) -> None:
    """Every label in [0, num_classes), or those of `part` = (i, k), the i-th of k
    contiguous near-equal parts of the rows; read in blocks, so big files stay cheap."""
    first, stop = _part_rows(y.shape[0], part)
    for start in range(first, stop, LABEL_CHECK_ROWS):
        block = y[start : min(stop, start + LABEL_CHECK_ROWS)]
        count_read(block)
        low, high = int(block.min()), int(block.max())
        if low < 0 or high >= num_classes:
            bad = low if low < 0 else high
            raise DataError(f"{path}: /{name} has label {bad} outside [0, {num_classes})")


def non_finite_row(values: np.ndarray) -> int | None:
    """The first row (along the first axis) of `values` holding a NaN or an infinity, or
    None when every value is finite."""
    finite = np.isfinite(values.reshape(len(values), -1)).all(axis=1)
    return None if finite.all() else int(np.argmin(finite))


def _check_values(path: Path, y: h5py.Dataset, name: str,
                  part: tuple[int, int] = (0, 1)) -> None:
    """Every target of `part` (as in _check_labels) finite: one NaN would turn every
    weight it reaches into NaN. Read in blocks of about LABEL_CHECK_ROWS values."""
    first, stop = _part_rows(y.shape[0], part)
    step = max(1, LABEL_CHECK_ROWS // max(1, math.prod(y.shape[1:])))
    for start in range(first, stop, step):
        block = y[start : min(stop, start + step)]
        count_read(block)
        row = non_finite_row(block)
        if row is not None:
            bad = block[row][~np.isfinite(block[row])].flat[0]
            raise DataError(f"{path}: /{name} row {start + row} holds {bad}: targets must be "
                            f"finite numbers")


def _target_shape(path: Path, y: h5py.Dataset, name: str, targets: str) -> tuple[int, ...]:
    """y's per-row shape, checked (with its dtype) against what `targets` allows."""
    if targets == "classes":
        if y.ndim != 1:
            raise DataError(f"{path}: /{name} has shape {y.shape}, expected (N,)")
        if not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"{path}: /{name} has dtype {y.dtype}, expected integer labels")
        return ()
    if y.ndim not in (1, 2) or min(y.shape[1:], default=1) < 1:
        raise DataError(f"{path}: /{name} has shape {y.shape}, expected (N,) or (N, k) values")
    if y.dtype != np.float32:
        raise DataError(f"{path}: /{name} has dtype {y.dtype}, expected float32 (the file's "
                        f"targets are 'values')")
    return tuple(int(d) for d in y.shape[1:])


def _y_form(target_shape: tuple[int, ...]) -> str:
    """y's shape as an error message writes it: (N,) or (N, k)."""
    return f"(N, {target_shape[0]})" if target_shape else "(N,)"


class _Split(NamedTuple):
    """What _check_split learned about one split."""

    rows: int
    input_shape: tuple[int, ...]
    stored_dtype: str
    scale: float
    target_shape: tuple[int, ...]
    nnz: int = 0
    """Stored entries of sparse x."""


def _check_split(path: Path, f: h5py.File, split: str, num_classes: int,
                 labels: bool = True, part: tuple[int, int] = (0, 1),
                 targets: str = "classes", kind: Features = DENSE) -> _Split:
    """Validate /split/x and /split/y (with `labels`, every label's range, or for values
    every target's finiteness, of `part` too; and the content of sparse or ids x)."""
    if kind.kind != "dense":
        return _check_coded_split(path, f, split, num_classes, labels, part, targets, kind)
    x = _get_dataset(path, f, f"{split}/x")
    y = _get_dataset(path, f, f"{split}/y")
    if x.ndim < 2:
        raise DataError(f"{path}: /{split}/x has shape {x.shape}, expected (N, *input_shape)")
    target_shape = _target_shape(path, y, f"{split}/y", targets)
    if x.shape[0] != y.shape[0]:
        raise DataError(f"{path}: /{split}/x has {x.shape[0]} rows but /{split}/y has "
                        f"{y.shape[0]} {'labels' if targets == 'classes' else 'rows'}")
    if x.shape[0] == 0:
        raise DataError(f"{path}: /{split} is empty")
    if min(x.shape[1:]) == 0:
        raise DataError(f"{path}: /{split}/x has an empty input shape {x.shape[1:]}")
    dtype, scale = _x_scale(path, x, f"{split}/x")
    if labels and targets == "classes":
        _check_labels(path, y, f"{split}/y", num_classes, part)
    elif labels:
        _check_values(path, y, f"{split}/y", part)
    return _Split(x.shape[0], tuple(int(d) for d in x.shape[1:]), dtype, scale, target_shape)


def _check_coded_split(path: Path, f: h5py.File, split: str, num_classes: int, labels: bool,
                       part: tuple[int, int], targets: str, kind: Features) -> _Split:
    """_check_split for sparse or ids x (data.features): x's structure, y as for dense
    files, and with `labels` the content of `part` of both."""
    nnz = 0
    if kind.kind == "sparse":
        rows, nnz = kinds.check_sparse_x(path, f, split, kind.n_features)
        input_shape, dtype = (kind.n_features,), "float32"
    else:
        rows = kinds.check_ids_x(path, f, split, kind.id_rows)
        input_shape, dtype = (len(kind.id_rows),), "int64"
    y = _get_dataset(path, f, f"{split}/y")
    target_shape = _target_shape(path, y, f"{split}/y", targets)
    if rows != y.shape[0]:
        raise DataError(f"{path}: /{split}/x has {rows} rows but /{split}/y has "
                        f"{y.shape[0]} {'labels' if targets == 'classes' else 'rows'}")
    if rows == 0:
        raise DataError(f"{path}: /{split} is empty")
    if labels:
        if targets == "classes":
            _check_labels(path, y, f"{split}/y", num_classes, part)
        else:
            _check_values(path, y, f"{split}/y", part)
        if kind.kind == "sparse":
            kinds.check_sparse_content(path, f, split, kind.n_features, _part_rows(rows, part))
        else:
            kinds.check_ids_content(path, f, split, kind.id_rows, _part_rows(rows, part))
    return _Split(rows, input_shape, dtype, 1.0, target_shape, nnz)


def open_dataset(path: str | os.PathLike, labels: bool = True,
                 part: tuple[int, int] = (0, 1)) -> DatasetInfo:
    """Validate a dataset file and describe it. Raises DataError naming the problem.

    Checks the structure, shapes, dtypes and attributes, and with `labels` reads every
    label (not x) to check its range, or every target of a "values" file to check that it
    is finite; without, the metadata only (what describing the file needs: the command
    line's checks before a run, a model's input shape). `part` = (i, k): read and check
    only the i-th of k parts of each split's labels, so that k ranks check a file together,
    each reading 1/k of the labels (they must then agree on the verdict). Corrupt x bytes
    are caught later, when a shard or the test set reads them (chunk checksums).
    """
    path = Path(path)
    i, k = part
    if not 0 <= i < k:
        raise ValueError(f"part must be (i, k) with 0 <= i < k, got {part!r}")
    counters.add("dataset_opens")
    with open_h5(path) as f:
        try:
            return _describe(path, f, labels, part)
        except DataError:
            raise
        except H5_ERRORS as exc:
            raise DataError(f"{path}: corrupt HDF5 file: {first_line(exc)}") from exc


def _targets(path: Path, attrs: h5py.AttributeManager) -> tuple[str, int]:
    """(targets, num_classes) from the root attributes: num_classes is 0 for values."""
    targets = _attr_text(attrs.get("targets", "classes"))
    if targets not in TARGETS:
        raise DataError(f"{path}: root attribute 'targets' is {targets!r}, expected "
                        f"'classes' or 'values'")
    if targets == "values":
        return targets, 0
    num_classes = _attr_int(path, attrs, "num_classes")
    if num_classes < 2:
        raise DataError(f"{path}: num_classes is {num_classes}, need at least 2")
    return targets, num_classes


def _describe(path: Path, f: h5py.File, labels: bool = True,
              part: tuple[int, int] = (0, 1)) -> DatasetInfo:
    fmt = _attr_text(f.attrs.get("format", ""))
    if fmt != FORMAT_NAME:
        raise DataError(f"{path}: not a distbelief dataset (root attribute 'format' is "
                        f"{fmt!r}, expected {FORMAT_NAME!r}); {CONVERT_HINT}")
    version = _attr_int(path, f.attrs, "version")
    if version != FORMAT_VERSION:
        raise DataError(f"{path}: dataset format version {version} is not supported "
                        f"(this reader knows version {FORMAT_VERSION})")
    targets, num_classes = _targets(path, f.attrs)
    kind = kinds.read_features(path, f.attrs)
    train, test = (_check_split(path, f, split, num_classes, labels, part, targets, kind)
                   for split in ("train", "test"))
    if train.input_shape != test.input_shape:
        raise DataError(f"{path}: train inputs have shape {train.input_shape} but test "
                        f"inputs have {test.input_shape}")
    if (train.stored_dtype, train.scale) != (test.stored_dtype, test.scale):
        raise DataError(f"{path}: train x is {train.stored_dtype} with scale {train.scale} "
                        f"but test x is {test.stored_dtype} with scale {test.scale}")
    _same_target_shape(path, train, test, "test")
    n_val = 0
    if "val" in f:
        val = _check_split(path, f, "val", num_classes, labels, part, targets, kind)
        if (val.input_shape, val.stored_dtype, val.scale) != \
                (train.input_shape, train.stored_dtype, train.scale):
            raise DataError(f"{path}: /val x is {val.stored_dtype} {val.input_shape} with "
                            f"scale {val.scale} but train x is {train.stored_dtype} "
                            f"{train.input_shape} with scale {train.scale}")
        _same_target_shape(path, train, val, "val")
        n_val = val.rows
    return DatasetInfo(path=path, input_shape=train.input_shape, num_classes=num_classes,
                       n_train=train.rows, n_test=test.rows, stored_dtype=train.stored_dtype,
                       scale=train.scale, n_val=n_val, targets=targets,
                       target_shape=train.target_shape, features=kind.kind,
                       id_rows=kind.id_rows, nnz_per_row=train.nnz / train.rows)


def _same_target_shape(path: Path, train: _Split, other: _Split, split: str) -> None:
    if other.target_shape != train.target_shape:
        raise DataError(f"{path}: /train/y is {_y_form(train.target_shape)} but /{split}/y "
                        f"is {_y_form(other.target_shape)}: every split needs the same "
                        f"number of targets per row")


def training_rows(n_train: int, held_out: int, path: str | Path,
                  validation: float | None = None) -> str:
    """The training rows an error message counts, in terms the user knows: '360 training
    rows in tiny.h5', or after a validation split (`held_out` rows of /train) '324 training
    rows after the validation split (data.validation = 0.1) of the 360 in tiny.h5'."""
    if not held_out:
        return f"{n_train} training rows in {path}"
    setting = f"data.validation = {validation:g}" if validation else "data.validation"
    return (f"{n_train} training rows after the validation split ({setting}) of the "
            f"{n_train + held_out} in {path}")


def with_validation(info: DatasetInfo, fraction: float) -> DatasetInfo:
    """`info` with the last round(fraction * n_train) rows of /train held out as the
    validation split (data.validation): they are never trained on. fraction 0 leaves
    `info` as it is; a file with a /val split of its own refuses a fraction (one or the
    other)."""
    if not fraction:
        return info
    if info.n_val and not info.held_out:
        raise DataError(f"{info.path} has a validation split of its own (/val, {info.n_val} "
                        f"rows): leave data.validation = 0 to use it")
    total = info.n_train + info.held_out
    held = round(fraction * total)
    if not 1 <= held < total:
        raise DataError(f"data.validation = {fraction:g} of the {total} training rows in "
                        f"{info.path} holds out {held}: it must leave at least one row on "
                        f"each side")
    return replace(info, n_train=total - held, n_val=held, held_out=held)


def read_rows(info: DatasetInfo, split: str, start: int,
               stop: int) -> tuple[Any, np.ndarray]:
    """Rows [start, stop) of /split as (x in the stored dtype, y in info.target_dtype:
    int32 labels, or float32 values (B,) or (B, k) as stored). Sparse x is a SparseRows
    (only the rows' slice of the file is read), ids x int64.

    Re-checks the shapes against `info`, since the file may have been replaced since.
    "validation" reads the validation split (/val, or the held-out end of /train).
    """
    return _read(info, split, np.s_[start:stop], f"rows {start}..{stop}")


def read_rows_at(info: DatasetInfo, split: str,
                 rows: np.ndarray) -> tuple[Any, np.ndarray]:
    """Rows `rows` (distinct indices, in any order) of /split, in that order, as read_rows
    gives them: only those rows are read (a selection of points, not their whole span)."""
    rows = np.asarray(rows, dtype=np.intp)
    order = np.argsort(rows, kind="stable")
    ascending = rows[order]
    if len(ascending) and np.any(ascending[1:] == ascending[:-1]):
        raise ValueError("read_rows_at: rows must be distinct")
    x, y = _read(info, split, ascending, f"{len(rows)} rows")
    back = np.empty_like(order)
    back[order] = np.arange(len(order))
    return x[back], y[back]


def _read(info: DatasetInfo, split: str, where: Any,
          what: str) -> tuple[Any, np.ndarray]:
    """x[where], y[where] of /split (read_rows, read_rows_at: a slice, or ascending row
    indices); `what` names the rows in an error."""
    offset = 0
    if split == "validation" and info.held_out:
        split, offset = "train", info.n_train
    elif split == "validation":
        split = "val"
    if offset:
        where = (np.s_[where.start + offset:where.stop + offset] if isinstance(where, slice)
                 else where + offset)
    expected = {"train": info.n_train + info.held_out, "test": info.n_test,
                "val": info.n_val}[split]
    with open_h5(info.path) as f:
        try:
            if info.features != "dense":
                return _read_coded(info, f, split, where, expected)
            x, y = f.get(f"{split}/x"), f.get(f"{split}/y")
            if (not isinstance(x, h5py.Dataset) or not isinstance(y, h5py.Dataset)
                    or x.shape != (expected, *info.input_shape)
                    or y.shape != (expected, *info.target_shape)
                    or x.dtype.name != info.stored_dtype or not _y_dtype_fits(info, y)):
                raise DataError(f"{info.path}: /{split} changed since the file was opened")
            if isinstance(where, slice) or len(where):
                xs, ys = x[where], y[where]
            else:  # h5py refuses an empty list of points
                xs = np.empty((0, *info.input_shape), dtype=x.dtype)
                ys = np.empty((0, *info.target_shape), dtype=y.dtype)
            count_read(xs, ys)
            return xs, ys.astype(info.target_dtype, copy=False)
        except DataError:
            raise
        except H5_ERRORS as exc:
            raise DataError(f"{info.path}: cannot read {what} of /{split}/x "
                            f"(corrupt file?): {first_line(exc)}") from exc


def _read_coded(info: DatasetInfo, f: h5py.File, split: str, where: Any,
                expected: int) -> tuple[Any, np.ndarray]:
    """_read's x[where], y[where] of sparse or ids x (data.features)."""
    x, y = f.get(f"{split}/x"), f.get(f"{split}/y")
    if info.features == "sparse":
        fits = kinds.sparse_fits(f, split, expected)
    else:
        fits = isinstance(x, h5py.Dataset) and x.shape == (expected, *info.input_shape) \
            and x.dtype.name in kinds.ID_DTYPES
    if not fits or not isinstance(y, h5py.Dataset) \
            or y.shape != (expected, *info.target_shape) or not _y_dtype_fits(info, y):
        raise DataError(f"{info.path}: /{split} changed since the file was opened")
    if info.features == "sparse":
        xs = kinds.read_sparse(x, where, info.input_shape[0])
    else:
        xs = kinds.read_ids(x, where)
    ys = y[where] if isinstance(where, slice) or len(where) else \
        np.empty((0, *info.target_shape), dtype=y.dtype)
    count_read(xs, ys)
    return xs, ys.astype(info.target_dtype, copy=False)


def _y_dtype_fits(info: DatasetInfo, y: h5py.Dataset) -> bool:
    """Whether y's stored dtype is one `info.targets` allows (any integer for labels)."""
    if info.targets == "classes":
        return np.issubdtype(y.dtype, np.integer)
    return y.dtype == np.float32


def to_float(stored: np.ndarray, scale: float, out: np.ndarray | None = None) -> np.ndarray:
    """value = stored * scale as float32, into `out` when given. Sparse rows (SparseRows)
    come back as they are: their values are float32 and files give them no scale."""
    if isinstance(stored, SparseRows):
        return stored
    if out is None:
        out = np.empty(stored.shape, dtype=np.float32)
    if scale == 1.0:
        np.copyto(out, stored, casting="unsafe")
    else:
        np.multiply(stored, np.float32(scale), out=out, casting="unsafe")
    return out


def model_input(info: DatasetInfo, stored: Any) -> Any:
    """Rows of x as read_rows gives them, as a model takes them: dense rows scaled to
    float32 (to_float), sparse rows and ids as they are (ids are never made floats)."""
    return to_float(stored, info.scale) if info.features == "dense" else stored


def load_test(info: DatasetInfo, limit: int | None = None) -> tuple[Any, np.ndarray]:
    """The first `limit` test rows (all when None): x as a model takes it (model_input:
    float32 scaled, SparseRows or int64 ids), y as read_rows gives it (int32 labels, or
    float32 values).

    A `limit` above the test set's size gives the whole test set.
    """
    return load_split(info, "test", limit)


def load_split(info: DatasetInfo, split: str,
               limit: int | None = None) -> tuple[Any, np.ndarray]:
    """The first `limit` rows of /split (all when None): x as a model takes it
    (model_input), y as read_rows gives it (int32 labels, or float32 values).

    A `limit` above the split's size gives the whole split.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    total = {"train": info.n_train, "test": info.n_test, "validation": info.n_val}[split]
    if total == 0:
        raise DataError(f"{info.path} has no validation split: add a /val group, or hold "
                        f"out part of /train with data.validation")
    if limit is None:
        rows = total
    elif isinstance(limit, (int, np.integer)) and not isinstance(limit, bool) and limit > 0:
        rows = min(int(limit), total)
    else:
        raise ValueError(f"{split} limit must be a positive integer or None, got {limit!r}")
    x, y = read_rows(info, split, 0, rows)
    return model_input(info, x), y


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def _epoch_permutation(seed: int, rank: int, epoch: int, n: int) -> np.ndarray:
    """The order of epoch `epoch` on `rank`.

    Each epoch's permutation comes from its own generator, keyed by (seed, rank, epoch),
    so a resumed shard needs only the epoch number and position (plain ints), not the
    generator's 128-bit internal state.
    """
    seq = np.random.SeedSequence(seed, spawn_key=(rank, epoch))
    return np.random.default_rng(seq).permutation(n)


def shard_range(info: DatasetInfo, rank: int, num_ranks: int, seed: int) -> tuple[int, int]:
    """Rows [start, stop) of training shard `rank` of `num_ranks`: contiguous, disjoint,
    balanced (sizes differ by at most one row), after checking the arguments."""
    num_ranks = _positive_int(num_ranks, "num_ranks")
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) \
            or not 0 <= rank < num_ranks:
        raise ValueError(f"rank must be an integer in [0, {num_ranks}), got {rank!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if num_ranks > info.n_train:
        raise DataError(f"the {training_rows(info.n_train, info.held_out, info.path)} "
                        f"cannot be split into {num_ranks} shards")
    return balanced_ranges(info.n_train, num_ranks)[int(rank)]


class TrainShard:
    """Part `rank` of `num_ranks` of the training set: a contiguous, disjoint block of rows,
    read from the file once (only those rows), minibatches from its own seeded RNG.

    Blocks are balanced (sizes differ by at most one row; `layout.balanced_ranges`). The
    rows stay in memory in the stored dtype (uint8 is 4x smaller than float32) and are
    scaled to float32 batch by batch. Sparse rows stay a SparseRows, ids int64.

    Batches are consecutive pieces of an endless stream made of one fresh permutation of
    the shard per epoch, so each epoch visits every row of the shard exactly once. Every
    batch is full: the last batch of an epoch is completed from the start of the next one
    (so such a batch may hold one row twice, from two different epochs).
    """

    def __init__(self, info: DatasetInfo, rank: int = 0, num_ranks: int = 1, seed: int = 0,
                 rows: tuple[Any, np.ndarray] | None = None):
        """`rows`: the shard's rows as `stored_rows` gives them, read by another process
        (a partner partition's, partitioned_sgd), instead of read from the file here."""
        self.start, self.stop = shard_range(info, rank, num_ranks, seed)
        self.info = info
        self.rank, self.num_ranks, self.seed = int(rank), int(num_ranks), int(seed)
        self.n: int = self.stop - self.start
        if rows is None:
            rows = read_rows(info, "train", self.start, self.stop)
        x, y = rows
        if (isinstance(x, SparseRows) != (info.features == "sparse")
                or x.shape != (self.n, *info.input_shape) or x.dtype.name != info.stored_dtype
                or y.shape != (self.n, *info.target_shape) or y.dtype != info.target_dtype):
            raise ValueError(f"rows of shapes {x.shape} {x.dtype}, {y.shape} {y.dtype} are "
                             f"not rows {self.start}..{self.stop} of {info.path}")
        self._x, self._y = x, y
        self.epoch = 0
        self.position = 0
        self._perm = _epoch_permutation(self.seed, self.rank, 0, self.n)
        self._batch_size = 0

    @property
    def stored_rows(self) -> tuple[Any, np.ndarray]:
        """The shard's rows as read: x in the stored dtype, y in info.target_dtype (not to
        be modified)."""
        return self._x, self._y

    def _ensure_buffers(self, batch_size: int) -> None:
        if batch_size == self._batch_size:
            return
        shape = (batch_size, *self.info.input_shape)
        self._index = np.empty(batch_size, dtype=np.intp)
        if self.info.features != "sparse":  # a sparse batch is gathered fresh (its nnz varies)
            self._stored = np.empty(shape, dtype=self._x.dtype)
        if self.info.features == "dense":
            self._xbuf = np.empty(shape, dtype=np.float32)
        self._ybuf = np.empty((batch_size, *self.info.target_shape), dtype=self._y.dtype)
        self._batch_size = batch_size

    def _next_indices(self, batch_size: int) -> np.ndarray:
        """Fill self._index with the next `batch_size` rows of the stream."""
        filled = 0
        while filled < batch_size:
            take = min(batch_size - filled, self.n - self.position)
            self._index[filled : filled + take] = self._perm[self.position : self.position + take]
            filled += take
            self.position += take
            if self.position == self.n:
                self.epoch += 1
                self.position = 0
                self._perm = _epoch_permutation(self.seed, self.rank, self.epoch, self.n)
        return self._index

    def next_batch(self, batch_size: int) -> tuple[Any, np.ndarray]:
        """The next minibatch: x float32 (B, *input_shape) scaled (sparse: a SparseRows
        of B rows; ids: int64 (B, fields)), y int32 labels (B,) or float32 values
        (B, *target_shape).

        Both are views of buffers this shard reuses: the next call overwrites them, so copy
        them if you need them longer.
        """
        batch_size = _positive_int(batch_size, "batch_size")
        if batch_size > self.n:
            raise ValueError(f"batch_size {batch_size} is larger than this shard "
                             f"({self.n} rows, rank {self.rank} of {self.num_ranks})")
        self._ensure_buffers(batch_size)
        index = self._next_indices(batch_size)
        np.take(self._y, index, axis=0, out=self._ybuf)
        if self.info.features == "sparse":
            return self._x[index], self._ybuf
        np.take(self._x, index, axis=0, out=self._stored)
        if self.info.features == "ids":
            return self._stored, self._ybuf
        return to_float(self._stored, self.info.scale, out=self._xbuf), self._ybuf

    def state(self) -> dict:
        """Where the batch stream stands, as plain ints (JSON and HDF5 attribute friendly)."""
        return {"seed": self.seed, "rank": self.rank, "num_ranks": self.num_ranks,
                "n": self.n, "epoch": self.epoch, "position": self.position}

    def load_state(self, state: dict) -> None:
        """Resume the exact batch sequence saved by `state()`.

        The shard must be the same one (seed, rank, num_ranks, rows); otherwise the saved
        position means nothing and this raises ValueError.
        """
        self.epoch, self.position = saved_position(self.state(), state,
                                                   "not a TrainShard state")
        self._perm = _epoch_permutation(self.seed, self.rank, self.epoch, self.n)


def saved_position(mine: dict, state: dict, not_ours: str) -> tuple[int, int]:
    """(epoch, position) of a saved shard `state`, checked against this shard's own
    `state()` (`mine`): every other key must match (the same rows, seed and order), and the
    position must lie in the shard. ValueError, starting with `not_ours` when `state` lacks
    a key, otherwise naming the key that differs."""
    try:
        saved = {key: int(state[key]) for key in mine}
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{not_ours}: {state!r}") from exc
    for key in mine.keys() - {"epoch", "position"}:
        if saved[key] != mine[key]:
            raise ValueError(f"shard state is for {key}={saved[key]}, this shard has "
                             f"{key}={mine[key]}")
    if saved["epoch"] < 0 or not 0 <= saved["position"] < mine["n"]:
        raise ValueError(f"shard state has epoch {saved['epoch']}, position "
                         f"{saved['position']}: out of range for {mine['n']} rows")
    return saved["epoch"], saved["position"]


def _chunk_rows(row_shape: tuple[int, ...], itemsize: int) -> int:
    row_bytes = int(np.prod(row_shape, dtype=np.int64)) * itemsize
    return max(1, CHUNK_BYTES // max(1, row_bytes))


class DatasetWriter:
    """Writes a dataset file atomically, rows appended in order.

    Everything goes to a temporary file in the destination folder; `commit()` checks that
    every row was written, flushes, fsyncs and renames it over `path`, then validates the
    result with `open_dataset`. Leaving a `with` block without commit (an exception) removes
    the temporary file, so a failed conversion never leaves a file at `path`.

    `targets` = "classes" (integer labels, `num_classes` >= 2) or "values" (float32 targets
    of per-row shape `target_shape`, () or (k,); `num_classes` is then ignored).

    `features` = "sparse": input_shape is (n_features,), stored_dtype "float32", scale 1,
    and append takes x as a SparseRows; "ids": input_shape is (fields,), `id_rows` one
    table size per field, stored_dtype the ids' dtype in the file ("int32" or "int64"),
    scale 1, and append takes integer x (rows, fields). `write_array` adds arrays of a
    planted model under /planted.
    """

    def __init__(self, path: str | os.PathLike, *, input_shape: tuple[int, ...],
                 num_classes: int = 0, n_train: int, n_test: int, stored_dtype: str,
                 scale: float, source: str, chunk_rows: int | None = None, n_val: int = 0,
                 targets: str = "classes", target_shape: tuple[int, ...] = (),
                 features: str = "dense", id_rows: tuple[int, ...] = ()):
        self.path = Path(path)
        self._kind = _writer_features(features, tuple(int(d) for d in input_shape),
                                      stored_dtype, scale, id_rows)
        self._targets = targets
        self._target_shape = _writer_target_shape(targets, target_shape, num_classes)
        if self.path.is_dir():
            raise DataError(f"{self.path}: is a folder, expected a file name to write")
        if not self.path.parent.is_dir():
            raise DataError(f"{self.path}: cannot write, folder {self.path.parent} does not exist")
        self._rows = {"train": int(n_train), "test": int(n_test)}
        if min(self._rows.values()) < 1:
            raise ValueError(f"both splits need at least one row, got {self._rows}")
        if n_val:  # the optional validation split, /val
            self._rows["val"] = int(n_val)
        self._written = dict.fromkeys(self._rows, 0)
        self._file: h5py.File | None = None
        # A fresh name that h5py creates itself ("x": fail if it exists), so the file gets
        # the usual permissions from the umask (mkstemp would make it private).
        self._tmp = self.path.with_name(
            f".{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            self._file = h5py.File(self._tmp, "x")
            self._create(tuple(int(d) for d in input_shape), int(num_classes), stored_dtype,
                         float(scale), str(source), chunk_rows)
        except OSError as exc:
            self.abort()
            raise DataError(f"{self.path}: cannot write: {first_line(exc)}") from exc
        except BaseException:
            self.abort()
            raise

    def _create(self, input_shape: tuple[int, ...], num_classes: int, stored_dtype: str,
                scale: float, source: str, chunk_rows: int | None) -> None:
        f = self._file
        f.attrs["format"] = FORMAT_NAME
        f.attrs["version"] = np.int64(FORMAT_VERSION)
        # A classes file gets no `targets` attribute: byte for byte the file it always was.
        if self._targets == "classes":
            f.attrs["num_classes"] = np.int64(num_classes)
        else:
            f.attrs["targets"] = self._targets
        f.attrs["source"] = source
        if self._kind.kind != "dense":  # a dense file has no `features`: as it always was
            self._create_coded(input_shape, stored_dtype, chunk_rows)
            return
        dtype = np.dtype(stored_dtype)
        rows_per_chunk = chunk_rows or _chunk_rows(input_shape, dtype.itemsize)
        y_shape = self._target_shape
        y_dtype = np.int32 if self._targets == "classes" else np.float32
        # At least 4096 labels a chunk, fewer for wide values (about CHUNK_BYTES then).
        y_chunk = max(rows_per_chunk, min(4096, _chunk_rows(y_shape, 4)))
        for split, n in self._rows.items():
            x = f.create_dataset(f"{split}/x", shape=(n, *input_shape), dtype=dtype,
                                 chunks=(min(rows_per_chunk, n), *input_shape),
                                 fletcher32=True)
            x.attrs["scale"] = np.float64(scale)
            f.create_dataset(f"{split}/y", shape=(n, *y_shape), dtype=y_dtype,
                             chunks=(min(y_chunk, n), *y_shape), fletcher32=True)

    def _create_coded(self, input_shape: tuple[int, ...], stored_dtype: str,
                      chunk_rows: int | None) -> None:
        """_create's x and y of a sparse or ids file, with their root attributes."""
        f, kind = self._file, self._kind
        f.attrs["features"] = kind.kind
        if kind.kind == "sparse":
            f.attrs["n_features"] = np.int64(kind.n_features)
        else:
            f.attrs["id_rows"] = np.asarray(kind.id_rows, dtype=np.int64)
        y_shape = self._target_shape
        y_dtype = np.int32 if self._targets == "classes" else np.float32
        y_chunk = max(4096, _chunk_rows(y_shape, 4))  # about CHUNK_BYTES of targets
        for split, n in self._rows.items():
            if kind.kind == "sparse":
                kinds.create_sparse(f, split, n, kind.n_features)
            else:
                dtype = np.dtype(stored_dtype)
                rows_per_chunk = chunk_rows or _chunk_rows(input_shape, dtype.itemsize)
                f.create_dataset(f"{split}/x", shape=(n, *input_shape), dtype=dtype,
                                 chunks=(min(rows_per_chunk, n), *input_shape),
                                 fletcher32=True)
            f.create_dataset(f"{split}/y", shape=(n, *y_shape), dtype=y_dtype,
                             chunks=(min(y_chunk, n), *y_shape), fletcher32=True)

    def append(self, split: str, x: Any, y: np.ndarray) -> None:
        """Write the next len(x) rows of `split` (train, test, or val when n_val > 0): x
        as the writer's `features` says (an array, a SparseRows, integer ids)."""
        if self._file is None:
            raise ValueError(f"{self.path}: writer is closed")
        start = self._written[split]
        stop = start + len(x)
        if len(y) != len(x) or stop > self._rows[split]:
            raise ValueError(f"{split}: {len(x)} inputs, {len(y)} labels at row {start} "
                             f"of {self._rows[split]}")
        self._check_targets(split, start, np.asarray(y))
        self._check_x(split, x)
        try:
            if self._kind.kind == "sparse":
                kinds.append_sparse(self._file, split, start, x)
            else:
                self._file[f"{split}/x"][start:stop] = x
            self._file[f"{split}/y"][start:stop] = y
        except OSError as exc:
            raise DataError(f"{self.path}: cannot write: {first_line(exc)}") from exc
        self._written[split] = stop

    def _check_x(self, split: str, x: Any) -> None:
        """Sparse rows of the file's width, or ids in their tables' ranges (checked here,
        since commit publishes the file before it validates it)."""
        kind = self._kind
        if kind.kind == "sparse":
            if not isinstance(x, SparseRows) or x.n_features != kind.n_features:
                raise ValueError(f"{self.path}: {split} x must be a SparseRows of "
                                 f"{kind.n_features} features, got {x!r:.80}")
            x.check()
        elif kind.kind == "ids":
            problem = kinds.check_id_block(kind.id_rows, np.asarray(x))
            if problem:
                raise ValueError(f"{self.path}: {split} x: {problem}")

    def set_source(self, source: str) -> None:
        """Replace the `source` attribute (a generator that knows more once it has
        written the rows: synthetic_sparse's planted floor)."""
        if self._file is None:
            raise ValueError(f"{self.path}: writer is closed")
        self._file.attrs["source"] = source

    def write_array(self, name: str, values: np.ndarray) -> None:
        """Store `values` as /planted/<name> (a synthetic file's planted model, which
        readers ignore)."""
        if self._file is None:
            raise ValueError(f"{self.path}: writer is closed")
        try:
            self._file.create_dataset(f"planted/{name}", data=values)
        except OSError as exc:
            raise DataError(f"{self.path}: cannot write: {first_line(exc)}") from exc

    def _check_targets(self, split: str, start: int, y: np.ndarray) -> None:
        """y's rows have the writer's per-row shape; values are finite floats (checked here,
        since commit publishes the file before it validates it)."""
        if y.shape[1:] != self._target_shape:
            raise ValueError(f"{self.path}: {split} targets have rows of shape {y.shape[1:]}, "
                             f"expected {self._target_shape}")
        if self._targets == "classes":
            return
        if not np.issubdtype(y.dtype, np.floating):
            raise ValueError(f"{self.path}: {split} targets have dtype {y.dtype}, expected "
                             f"floats (targets 'values')")
        row = non_finite_row(y)
        if row is not None:
            raise ValueError(f"{self.path}: {split} row {start + row} holds a target that is "
                             f"not a finite number")

    def commit(self) -> DatasetInfo:
        """Publish the file at `path` (atomically) and return its validated description."""
        if self._file is None:
            raise ValueError(f"{self.path}: writer is closed")
        if self._written != self._rows:
            raise ValueError(f"{self.path}: wrote {self._written} rows, expected {self._rows}")
        try:
            self._file.close()
            self._file = None
            _fsync_path(self._tmp)
            os.replace(self._tmp, self.path)
            _fsync_path(self.path.parent)
        except OSError as exc:
            self.abort()
            raise DataError(f"{self.path}: cannot write: {first_line(exc)}") from exc
        return open_dataset(self.path)

    def abort(self) -> None:
        """Drop the temporary file; `path` is left as it was."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._file is not None:
            self.abort()


def _writer_features(kind: str, input_shape: tuple[int, ...], stored_dtype: str,
                     scale: float, id_rows: tuple[int, ...]) -> Features:
    """DatasetWriter's arguments about x, checked, as the Features the file will say."""
    if kind == "dense":
        if stored_dtype not in STORED_DTYPES:
            raise ValueError(f"stored_dtype must be one of {STORED_DTYPES}, got {stored_dtype!r}")
        return Features()
    if kind not in kinds.FEATURES:
        raise ValueError(f"features must be one of {kinds.FEATURES}, got {kind!r}")
    if scale != 1.0 or len(input_shape) != 1 or input_shape[0] < 1:
        raise ValueError(f"{kind} x has input_shape (n,) and scale 1, got {input_shape} and "
                         f"{scale}")
    if kind == "sparse":
        if stored_dtype != "float32":
            raise ValueError(f"sparse values are float32, got stored_dtype {stored_dtype!r}")
        return Features(kind, n_features=input_shape[0])
    rows = tuple(int(r) for r in id_rows)
    if len(rows) != input_shape[0] or min(rows, default=0) < 1:
        raise ValueError(f"id_rows must give a positive table size for each of the "
                         f"{input_shape[0]} fields, got {id_rows!r}")
    if stored_dtype not in kinds.ID_DTYPES or \
            np.iinfo(np.dtype(stored_dtype)).max < max(rows) - 1:
        raise ValueError(f"ids of tables of up to {max(rows)} rows are stored as "
                         f"{kinds.id_dtype(rows)}, got stored_dtype {stored_dtype!r}")
    return Features(kind, id_rows=rows)


def _writer_target_shape(targets: str, target_shape: tuple[int, ...],
                         num_classes: int) -> tuple[int, ...]:
    """DatasetWriter's arguments about y, checked; the per-row shape of y."""
    if targets not in TARGETS:
        raise ValueError(f"targets must be one of {TARGETS}, got {targets!r}")
    shape = tuple(int(d) for d in target_shape)
    if targets == "classes":
        if shape:
            raise ValueError(f"class labels are one per row: target_shape must be (), got "
                             f"{target_shape!r}")
        if num_classes < 2:
            raise ValueError(f"num_classes must be at least 2, got {num_classes}")
    elif len(shape) > 1 or min(shape, default=1) < 1:
        raise ValueError(f"target_shape must be () or (k,) with k >= 1, got {target_shape!r}")
    return shape


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
