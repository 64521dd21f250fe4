"""svmlight / libsvm text files (RCV1, news20, the Criteo samples) as a sparse dataset file:
`distbelief prepare libsvm` (docs/sparse-models.md).

One example a line: `label id:value id:value ...`, with an optional `qid:N` (ignored) and
`#` comments. Feature ids are used as given (1-based files leave row 0 of the table
unused). The labels decide the targets: only 0/1 or only -1/+1 is a binary problem, stored
as values 0/1 (a sigmoid output, binary cross-entropy); other whole numbers are classes
(>= 0); any other number makes a regression.

The text is read in blocks of BLOCK_BYTES and each block parsed with numpy (the lines'
token and colon counts from the bytes, the numbers by one conversion of the block's
tokens); a block that does not parse is read again line by line to name the first bad
line. Parsed entries go to a scratch folder beside the output (int32 ids, float32 values),
which is memory-mapped to write the dataset file with `write_dataset`: the same test
hold-out and seeded shuffle as `prepare arrays`, with memory bounded by the rows'
offsets and labels (16 bytes a row), not the text.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from distbelief.data.arrays import PROGRESS_EVERY_S, write_dataset
from distbelief.data.hdf5 import DatasetInfo
from distbelief.data.sparse import INDEX_LIMIT_32, SparseRows
from distbelief.errors import DataError

BLOCK_BYTES = 4 << 20
"""Text parsed at a time (whole lines): about 10x that in memory while it is parsed."""
DEFAULT_TEST_FRACTION = 0.1
_COMMENT = re.compile(rb"#[^\n]*")
_QID = re.compile(rb"(?<!\S)qid:\S*")
_SPACE = np.zeros(256, dtype=bool)
_SPACE[[9, 10, 11, 12, 13, 32]] = True  # what bytes.split() splits at


@dataclass
class ParsedFile:
    """One text file's examples, parsed: labels and row lengths in memory, ids and values
    in scratch files (`ids_path`, `values_path`)."""

    path: Path
    ids_path: Path
    values_path: Path
    id_dtype: np.dtype
    labels: list[np.ndarray] = field(default_factory=list)
    lengths: list[np.ndarray] = field(default_factory=list)
    largest_id: int = -1
    nnz: int = 0

    @property
    def rows(self) -> int:
        return sum(len(part) for part in self.lengths)

    def all_labels(self) -> np.ndarray:
        return np.concatenate(self.labels) if self.labels else np.empty(0)

    def sparse_rows(self, n_features: int) -> SparseRows:
        """The file's rows over memory maps of the scratch files (read as they are used)."""
        indptr = np.zeros(self.rows + 1, np.int64)
        if self.lengths:
            np.cumsum(np.concatenate(self.lengths), out=indptr[1:])
        ids, values = (np.memmap(p, dtype=d, mode="r", shape=(self.nnz,)) if self.nnz else
                       np.empty(0, d) for p, d in ((self.ids_path, self.id_dtype),
                                                   (self.values_path, np.float32)))
        return SparseRows(indptr, ids, values, n_features)


def parse_block(data: bytes, first_line: int, path: Path) -> tuple[np.ndarray, ...]:
    """(labels float64, row lengths, ids int64, values float64, line numbers) of the
    examples in `data`, whole lines of `path` starting at line `first_line` (1-based).
    Empty and comment-only lines hold no example. DataError naming the first bad line."""
    text = _COMMENT.sub(b"", data) if b"#" in data else data
    if b"qid:" in text:
        text = _QID.sub(b"", text)
    tokens, colons = _line_counts(text)
    examples = np.flatnonzero(tokens)
    pairs = colons[examples]
    try:
        numbers = np.array(text.replace(b":", b" ").split(), dtype=np.float64)
    except ValueError:
        numbers = None
    if (numbers is None or np.any(tokens[examples] != 1 + pairs)
            or len(numbers) != len(examples) + 2 * int(pairs.sum())):
        _raise_first_bad_line(data, first_line, path)
    starts = np.zeros(len(examples), np.int64)
    np.cumsum(1 + 2 * pairs[:-1], out=starts[1:])
    entry = np.ones(len(numbers), dtype=bool)
    entry[starts] = False
    labels, entries = numbers[starts], numbers[entry]
    ids, values = entries[0::2], entries[1::2]
    lines = first_line + examples
    _check_numbers(labels, ids, values, pairs, lines, path)
    return labels, pairs.astype(np.int64), ids.astype(np.int64), values, lines


def _line_counts(text: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Whitespace-separated tokens and colons on each line of `text`."""
    a = np.frombuffer(text, dtype=np.uint8)
    newlines = np.flatnonzero(a == 10)
    space = _SPACE[a]
    token_starts = np.flatnonzero(~space & np.concatenate(([True], space[:-1])))
    lines = len(newlines) + 1
    tokens = np.bincount(np.searchsorted(newlines, token_starts), minlength=lines)
    colons = np.bincount(np.searchsorted(newlines, np.flatnonzero(a == 58)), minlength=lines)
    return tokens, colons


def _check_numbers(labels: np.ndarray, ids: np.ndarray, values: np.ndarray,
                   pairs: np.ndarray, lines: np.ndarray, path: Path) -> None:
    """Finite labels and values, whole non-negative ids: a DataError naming the line."""
    def line_of_entry(at: int) -> int:
        return int(lines[np.searchsorted(np.cumsum(pairs), at, side="right")])

    bad = np.flatnonzero(~np.isfinite(labels))
    if len(bad):
        raise DataError(f"{path}, line {int(lines[bad[0]])}: the label {labels[bad[0]]} is "
                        f"not a finite number")
    bad = np.flatnonzero((ids < 0) | (ids != np.floor(ids)) | (ids >= 2.0**63))
    if len(bad):
        raise DataError(f"{path}, line {line_of_entry(bad[0])}: the feature id "
                        f"{ids[bad[0]]:g} is not a whole number >= 0")
    bad = np.flatnonzero(~np.isfinite(values.astype(np.float32)))
    if len(bad):
        raise DataError(f"{path}, line {line_of_entry(bad[0])}: the value {values[bad[0]]:g} "
                        f"is not a finite float32 number")


def _raise_first_bad_line(data: bytes, first_line: int, path: Path) -> None:
    """A block failed to parse: read its lines one by one and name the first bad one."""
    for number, line in enumerate(data.split(b"\n"), start=first_line):
        problem = _line_problem(line.split(b"#", 1)[0].split())
        if problem:
            raise DataError(f"{path}, line {number}: {problem}")
    last = first_line + data.count(b"\n")
    raise DataError(f"{path}, lines {first_line}-{last}: not libsvm text (label id:value "
                    f"id:value ...)")


def _line_problem(tokens: list[bytes]) -> str | None:
    """What is wrong with one line's tokens, or None."""
    if not tokens:
        return None
    label = tokens[0].decode("utf-8", "replace")
    if b"," in tokens[0]:
        return (f"the label {label!r} lists several labels (multi-label libsvm), which "
                f"is not supported: give one label a line")
    if not _is_number(tokens[0]):
        return f"the label {label!r} is not a number (a line is: label id:value id:value ...)"
    for token in tokens[1:]:
        if token.startswith(b"qid:"):
            continue
        name, colon, value = token.partition(b":")
        text = token.decode("utf-8", "replace")
        if not colon or not name.isdigit() or not _is_number(value):
            return f"{text!r} is not id:value (a whole feature id >= 0, a colon, a number)"
    return None


def _is_number(token: bytes) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def read_blocks(f: BinaryIO, size: int = BLOCK_BYTES) -> Iterator[tuple[bytes, int]]:
    """(whole lines of about `size` bytes, the number of their first line) of a file."""
    tail, line = b"", 1
    while True:
        chunk = f.read(size)
        if not chunk:
            break
        data = tail + chunk
        cut = data.rfind(b"\n") + 1
        if cut == 0:  # one line longer than the block: read on
            tail = data
            continue
        tail = data[cut:]
        yield data[:cut], line
        line += data.count(b"\n", 0, cut)
    if tail:
        yield tail, line


def parse_file(path: Path, scratch: Path, name: str, features: int | None) -> ParsedFile:
    """Parse `path` into scratch files `name`.ids and `name`.values in `scratch`; with
    `features`, an id >= features is a DataError naming the line."""
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    wide = features is not None and features > INDEX_LIMIT_32
    parsed = ParsedFile(path, scratch / f"{name}.ids", scratch / f"{name}.values",
                        np.dtype(np.int64 if wide else np.int32))
    last = time.monotonic()
    try:
        with open(path, "rb") as f, open(parsed.ids_path, "wb") as ids_out, \
                open(parsed.values_path, "wb") as values_out:
            for data, first_line in read_blocks(f):
                labels, lengths, ids, values, lines = parse_block(data, first_line, path)
                _check_ids(ids, lengths, lines, features, wide, path)
                ids.astype(parsed.id_dtype).tofile(ids_out)
                values.astype(np.float32).tofile(values_out)
                parsed.labels.append(labels)
                parsed.lengths.append(lengths)
                parsed.nnz += len(ids)
                if len(ids):
                    parsed.largest_id = max(parsed.largest_id, int(ids.max()))
                if time.monotonic() - last >= PROGRESS_EVERY_S:
                    print(f"distbelief prepare: read {f.tell() / 2**20:,.0f} MB of {path}",
                          flush=True)
                    last = time.monotonic()
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if not parsed.rows:
        raise DataError(f"{path}: no examples (every line is empty or a comment)")
    return parsed


def _check_ids(ids: np.ndarray, lengths: np.ndarray, lines: np.ndarray,
               features: int | None, wide: bool, path: Path) -> None:
    """Every id below `features` (when given) and storable as int32 (unless `wide`)."""
    limit = features if features is not None else INDEX_LIMIT_32
    bad = np.flatnonzero(ids >= limit)
    if not len(bad):
        return
    line = int(lines[np.searchsorted(np.cumsum(lengths), bad[0], side="right")])
    if features is not None:
        raise DataError(f"{path}, line {line}: the feature id {int(ids[bad[0]])} is not "
                        f"below --features {features} (the table's rows: ids 0 to "
                        f"{features - 1}); raise --features or leave it out (largest id + 1)")
    if not wide:
        raise DataError(f"{path}, line {line}: the feature id {int(ids[bad[0]])} is above "
                        f"2**31 - 1: give --features (the table's rows, more than 2**31 - 1) "
                        f"so that ids are stored as int64")


def label_targets(labels: np.ndarray) -> tuple[np.ndarray, str]:
    """(y, what it is) from the parsed labels of every file: "binary" (only 0/1 or only
    -1/+1: values 0/1), "classes" (whole numbers >= 0: int64 labels) or "regression"
    (float32 values)."""
    found = np.unique(labels)
    if np.all(np.isin(found, (0.0, 1.0))) or np.all(np.isin(found, (-1.0, 1.0))):
        return (labels > 0).astype(np.float32), "binary"
    if np.all(found == np.round(found)):
        if found[0] < 0:
            shown = ", ".join(f"{v:g}" for v in found[:6]) + (", ..." if len(found) > 6 else "")
            raise DataError(f"the labels are whole numbers ({shown}) but neither only 0/1 "
                            f"nor only -1/+1 (binary), and class labels must be >= 0")
        return labels.astype(np.int64), "classes"
    return labels.astype(np.float32), "regression"


def first_negative_label(files: list[ParsedFile]) -> str:
    """'FILE, line N has the label L' for the first negative label (the files read again:
    for an error only)."""
    for parsed in files:
        with open(parsed.path, "rb") as f:
            for data, first_line in read_blocks(f):
                labels, *_, lines = parse_block(data, first_line, parsed.path)
                bad = np.flatnonzero(labels < 0)
                if len(bad):
                    return (f"{parsed.path}, line {int(lines[bad[0]])} has the label "
                            f"{labels[bad[0]]:g}")
    return "the labels"


def convert_libsvm(source: str | os.PathLike, out_path: str | os.PathLike, *,
                   test: str | os.PathLike | None = None, features: int | None = None,
                   test_fraction: float | None = None, shuffle: bool = True,
                   seed: int = 0) -> DatasetInfo:
    """`distbelief prepare libsvm`: `source` (and `test`, the test split's file) written as
    a sparse dataset file at `out_path`, with progress lines on stdout. Without `test`, a
    seeded `test_fraction` (default 0.1) of the rows is held out. Never overwrites a file."""
    out = Path(out_path)
    if out.exists():
        raise DataError(f"{out} exists: distbelief never overwrites a dataset; remove it or "
                        "choose another --out")
    if test is not None and test_fraction is not None:
        raise DataError("give a test file (--test) or a --test-fraction, not both")
    if features is not None and features < 1:
        raise DataError(f"--features must be a positive number of feature ids, got {features}")
    if not out.parent.is_dir():
        raise DataError(f"{out}: cannot write, folder {out.parent} does not exist")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as scratch:
        files = [parse_file(Path(p), Path(scratch), name, features)
                 for name, p in (("train", source), ("test", test)) if p is not None]
        n_features = features or max(1, 1 + max(f.largest_id for f in files))
        try:
            y, kind = label_targets(np.concatenate([f.all_labels() for f in files]))
        except DataError as exc:
            raise DataError(f"{first_negative_label(files)}: {exc}") from None
        ys = np.split(y, np.cumsum([f.rows for f in files])[:-1])
        xs = [f.sparse_rows(n_features) for f in files]
        parsed_s = time.monotonic() - started
        x_test, y_test = (xs[1], ys[1]) if test is not None else (None, None)
        held_out = None if test is not None else test_fraction or DEFAULT_TEST_FRACTION
        info = write_dataset(
            out, xs[0], ys[0], x_test, y_test, test_fraction=held_out,
            targets="classes" if kind == "classes" else "values", shuffle=shuffle, seed=seed,
            source=_source_text(files, kind, n_features, features), progress=_progress)
    _report(info, files, kind, parsed_s, time.monotonic() - started)
    return info


def _source_text(files: list[ParsedFile], kind: str, n_features: int,
                 features: int | None) -> str:
    names = " and test ".join(str(f.path.resolve()) for f in files)
    rows = "--features" if features else "largest id + 1"
    return f"libsvm text {names}: {kind} labels, {n_features:,d} feature ids ({rows})"


def _progress(done: int, total: int) -> None:
    print(f"distbelief prepare: {done:,d} of {total:,d} rows", flush=True)


def _report(info: DatasetInfo, files: list[ParsedFile], kind: str, parsed_s: float,
            total_s: float) -> None:
    text_mb = sum(f.path.stat().st_size for f in files) / 2**20
    what = {"binary": "binary labels, stored as values 0/1 (one sigmoid output, "
                      "binary_cross_entropy)",
            "classes": f"{info.num_classes} classes",
            "regression": "regression targets (values)"}[kind]
    print(f"wrote {info.path}: {info.n_train:,d} training and {info.n_test:,d} test rows of "
          f"{info.input_shape[0]:,d} feature ids ({info.nnz_per_row:.1f} stored a row on "
          f"average), {what}; {text_mb:,.1f} MB of text parsed in {parsed_s:.1f} s, "
          f"written in {total_s:.1f} s")

