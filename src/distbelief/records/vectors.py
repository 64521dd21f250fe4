"""A trained model's flat vectors (its parameters and optimizer state) read a piece at a
time, never whole: from memory, from a checkpoint's shard parts, or from an export file;
and a model scored from them batch by batch. No MPI in this module.

What a table larger than one process's memory needs (issue 44, docs/sparse-models.md,
"Export, evaluate and load_model"): `distbelief export` copies each array in row blocks
(`read`), and `evaluate`, `load_model`'s predict and a run's final test read, for each
batch, only the table rows it touches (`read_rows`: one indexed read of the batch's
sorted distinct ids per file) and the dense part once (`RowScorer`). A dense model is
read whole, once (`WholeScorer`): its vector is what one rank trained.

Every reader has the same three calls, on a vector `name` ("params", or an optimizer
state's name, e.g. "accum"):

    read(name, start, stop)              float32 (stop - start,): [start, stop) of it
    read_rows(name, offset, width, ids)  float32 (len(ids), width): rows `ids` (sorted,
                                         distinct int64) of the table at `offset`
    state_names                          the optimizer states it holds

Files are opened for each call and closed after it, so a reader holds no open file; but
inside `kept_open(reader)` a checkpoint's parts, or an HDF5 export, stay open across
calls (an evaluation's batches, `evaluate_in_blocks`), all closed when the block ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from distbelief.data.hdf5 import H5_ERRORS
from distbelief.errors import DataError, UserError
from distbelief.model.layout import DTYPE, ParamEntry, ParamLayout
from distbelief.model.losses import Evaluation
from distbelief.model.sparse_network import SparseNetwork, tally_batches
from distbelief.model.sparse_rows import RowCache, RowsView
from distbelief.records import checkpoint as ckpt

BLOCK_BYTES = 16 << 20
"""An export copies each array this much at a time (whole rows of it)."""


def table_rows(width: int, ids: np.ndarray, offset: int) -> np.ndarray:
    """The flat coordinates of rows `ids` of a table of `width` at `offset`, row by row."""
    return (offset + np.asarray(ids, dtype=np.int64)[:, None] * width
            + np.arange(width, dtype=np.int64)).reshape(-1)


class MemoryVectors:
    """Vectors held in memory: a model that was read whole, or built in Python."""

    def __init__(self, params: np.ndarray, state: Mapping[str, np.ndarray] | None = None):
        self.vectors = {"params": params, **(state or {})}
        self.state_names = sorted(state or {})

    def read(self, name: str, start: int, stop: int) -> np.ndarray:
        return self.vectors[name][start:stop]

    def read_rows(self, name: str, offset: int, width: int, ids: np.ndarray) -> np.ndarray:
        return self.vectors[name][table_rows(width, ids, offset)].reshape(-1, width)


class CheckpointVectors:
    """A checkpoint's vectors, read from the shard parts that hold each piece (a shard
    part holds a range of the flat vector, whatever the layout)."""

    def __init__(self, found: ckpt.Checkpoint, with_optimizer: bool):
        self.found = found
        self.state_names = sorted(found.manifest["optimizer_state"]) if with_optimizer else []
        self._parts: ckpt.OpenParts | None = None  # inside kept_open()

    @contextmanager
    def kept_open(self) -> Iterator[None]:
        """Inside the block, each part is opened once, at its first read, and closed when
        the block ends (an evaluation's batches: not one open per batch and table)."""
        if self._parts is not None:  # nested: the outer block closes them
            yield
            return
        self._parts = self.found.open_parts()
        try:
            yield
        finally:
            parts, self._parts = self._parts, None
            parts.close()

    def read(self, name: str, start: int, stop: int) -> np.ndarray:
        return self.found.read_vector(name, start, stop, self._parts)

    def read_rows(self, name: str, offset: int, width: int, ids: np.ndarray) -> np.ndarray:
        return self.found.read_elements(name, table_rows(width, ids, offset),
                                        self._parts).reshape(-1, width)


def kept_open(vectors: Any) -> AbstractContextManager[Any]:
    """A block inside which `vectors` keeps its files open across reads, where it can (a
    checkpoint's parts, an HDF5 export); a no-op for any other reader."""
    keep = getattr(vectors, "kept_open", None)
    return keep() if keep is not None else nullcontext()


class ExportVectors:
    """An export file's arrays (HDF5 datasets, or safetensors tensors mapped from the
    file), read by rows of each array: `arrays` maps (vector, layout entry) to its name in
    the file, as records.export names them."""

    def __init__(self, path: Path, fmt: str, layout: ParamLayout,
                 names: Mapping[str, Mapping[ParamEntry, str]],
                 tensors: Mapping[str, tuple[int, tuple[int, ...]]] | None = None):
        self.path, self.fmt, self.layout = path, fmt, layout
        self.names = names
        self.tensors = tensors or {}  # safetensors: name -> (byte offset in the file, shape)
        self.state_names = sorted(n for n in names if n != "params")
        self._file: h5py.File | None = None  # an HDF5 export inside kept_open()

    @contextmanager
    def kept_open(self) -> Iterator[None]:
        """Inside the block an HDF5 export stays open across reads, closed when it ends
        (a safetensors export is mapped per read, which opens nothing to keep)."""
        if self.fmt != "hdf5" or self._file is not None:
            yield
            return
        try:
            self._file = h5py.File(self.path, "r", locking=False)
        except H5_ERRORS as exc:
            raise UserError(f"{self.path}: damaged export: {_first_line(exc)}") from exc
        try:
            yield
        finally:
            f, self._file = self._file, None
            f.close()

    @contextmanager
    def _arrays(self) -> Iterator[Callable[[str], Any]]:
        """A function of an array's name in the file -> an array-like (rows by slice or by
        a sorted index array), valid inside the block."""
        try:
            if self.fmt == "hdf5" and self._file is not None:
                kept = self._file
                yield lambda name: _hdf5_array(kept, name)
            elif self.fmt == "hdf5":
                with h5py.File(self.path, "r", locking=False) as f:
                    yield lambda name: _hdf5_array(f, name)
            else:
                def mapped(name: str) -> np.ndarray:
                    at, shape = self.tensors[name]
                    return np.memmap(self.path, dtype="<f4", mode="r", offset=at, shape=shape)
                yield mapped
        except H5_ERRORS as exc:  # a file changed or damaged since it was opened
            raise UserError(f"{self.path}: damaged export: {_first_line(exc)}") from exc

    def read(self, name: str, start: int, stop: int) -> np.ndarray:
        out = np.empty(stop - start, DTYPE)
        with self._arrays() as array:
            for e in self.layout.entries:
                lo, hi = max(start, e.offset), min(stop, e.stop)
                if lo >= hi:
                    continue
                lo, hi = lo - e.offset, hi - e.offset
                row = math.prod(e.shape[1:])  # 1 for a vector
                first, last = lo // row, -(-hi // row)
                rows = np.asarray(array(self.names[name][e])[first:last], dtype=DTYPE)
                out[lo + e.offset - start:hi + e.offset - start] = \
                    rows.reshape(-1)[lo - first * row:hi - first * row]
        return out

    def read_rows(self, name: str, offset: int, width: int, ids: np.ndarray) -> np.ndarray:
        entry = next(e for e in self.layout.entries if e.offset == offset)
        if len(ids) == 0:
            return np.empty((0, width), DTYPE)
        with self._arrays() as array:
            return np.asarray(array(self.names[name][entry])[np.asarray(ids, np.int64)],
                              dtype=DTYPE).reshape(-1, width)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _hdf5_array(f: h5py.File, name: str) -> h5py.Dataset:
    if name.startswith("optimizer."):
        _, state, rest = name.split(".", 2)
        return f["optimizer"][state][rest]
    return f["params"][name]


# ---------------------------------------------------------------------------------------
# Scoring a stored model


class WholeScorer:
    """A model read whole, once: any network (a dense one, a model of one's own)."""

    def __init__(self, network: Any, params: np.ndarray):
        self.network, self.params = network, params

    def logits(self, x: Any) -> np.ndarray:
        return self.network.logits(self.params, x)

    def tally(self, x: Any, y: np.ndarray, batch_size: int) -> np.ndarray:
        return self.network.tally(self.params, x, y, batch_size=batch_size)


class RowScorer:
    """A sparse model scored from stored vectors a batch at a time: each batch reads its
    tables' rows (one indexed read per table and file) into a row cache
    (model.sparse_rows), the dense part read once; memory follows the batch."""

    def __init__(self, network: SparseNetwork, vectors: Any):
        self.network, self.vectors = network, vectors
        self.view = RowsView(network)
        bias = network.layout.entry(0, "bias")
        self.dense = vectors.read("params", bias.offset, network.layout.size)

    def compact(self, cache: RowCache) -> np.ndarray:
        """The cache's compact vector: its rows of each table, then the dense part."""
        parts = [self.vectors.read_rows("params", offset, width, ids).reshape(-1)
                 for (offset, _, width), ids in zip(cache.tables, cache.ids)]
        return np.concatenate([*parts, self.dense])

    def logits(self, x: Any) -> np.ndarray:
        self.view.cache = cache = RowCache.for_batches(self.network, [x])
        return self.view.logits(self.compact(cache), x)

    def tally(self, x: Any, y: np.ndarray, batch_size: int) -> np.ndarray:
        return tally_batches(self.logits, self.network.loss_fn, x, y, batch_size)


def scorer(network: Any, vectors: Any) -> WholeScorer | RowScorer:
    """How to score `network` from `vectors`: by batch rows for a sparse model, else from
    its whole vector."""
    if isinstance(network, SparseNetwork):
        return RowScorer(network, vectors)
    size = network.layout.size
    return WholeScorer(network, vectors.read("params", 0, size))


def evaluate_in_blocks(scorer_: WholeScorer | RowScorer, info: Any, split: str,
                       batch_size: int, block_bytes: int) -> Evaluation:
    """The Evaluation of a stored model on the whole of `split` of a dataset (DatasetInfo),
    read from the file in blocks of about `block_bytes` of whole batches, their tallies
    summed (model.losses) and turned into figures by the network's `figures_of` (read
    after them: a model of one's own sets it as it tallies)."""
    from distbelief.data.hdf5 import model_input, read_rows

    rows = {"test": info.n_test, "validation": info.n_val, "train": info.n_train}[split]
    if rows == 0:
        raise DataError(f"{info.path} has no {split} split" + (
            ": add a /val group, or hold out part of /train with data.validation"
            if split == "validation" else ""))
    block = max(1, block_bytes // (info.input_row_bytes * batch_size)) * batch_size
    tally = None
    # A sparse model's batches read their rows from parts opened once, closed after.
    with kept_open(getattr(scorer_, "vectors", None)):
        for start in range(0, rows, block):
            x, y = read_rows(info, split, start, min(rows, start + block))
            part = scorer_.tally(model_input(info, x), y, batch_size)
            tally = part if tally is None else tally + part
    return scorer_.network.figures_of.evaluation(tally)
