"""A replica's training rows streamed from the file, for training sets larger than memory
(`data.in_memory = false`): the same interface as `hdf5.TrainShard`, with at most a
bounded number of bytes of rows in memory. docs/your-own-data.md says how it orders rows.

The shard's rows are cut into blocks aligned to the file's chunks. Each epoch visits the
blocks in a seeded random order, a window of blocks at a time, and the rows of a window
in a seeded random order; so each epoch still visits every row exactly once, and the
order depends only on (seed, rank, epoch, window size): a resumed shard finds its place
again from (epoch, position). A prefetch thread reads the next window while the current
one is trained on (h5py releases the GIL inside HDF5's read); it opens the file itself,
after any fork, and is the only user of that file handle.

Sparse rows (SparseRows) are read and served the same way; their blocks are sized by the
file's average stored bytes per row (DatasetInfo.stored_row_bytes), so the memory bound
holds on average, not for a window of unusually long rows.
"""

from __future__ import annotations

import atexit
import itertools
import queue
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from distbelief.data import features as kinds
from distbelief.data.hdf5 import (
    H5_ERRORS,
    DatasetInfo,
    count_read,
    first_line,
    open_h5,
    saved_position,
    shard_range,
    to_float,
)
from distbelief.data.sparse import concatenate
from distbelief.errors import DataError

READ_BYTES = 1 << 20
"""Rows are read in blocks of about this many bytes (whole chunks of the file)."""
WINDOWS_IN_MEMORY = 3
"""The window trained on, the next one (queued) and the one being read."""
_POLL_S = 0.1


@dataclass(frozen=True)
class _Window:
    epoch: int
    index: int            # the window's number in its epoch
    first: int            # its first row's position in the epoch's stream
    x: Any                # its rows, stored dtype (sparse: a SparseRows), in block order
    y: np.ndarray
    order: np.ndarray     # the order its rows are served in


class StreamingTrainShard:
    """Part `rank` of `num_ranks` of the training set, read window by window; at most
    `memory_bytes` of rows (WINDOWS_IN_MEMORY windows) in memory. Serves the same batches
    on every run with the same seed, rank, rank count and memory_bytes."""

    def __init__(self, info: DatasetInfo, rank: int = 0, num_ranks: int = 1, seed: int = 0,
                 memory_bytes: int = 256 << 20):
        self.info = info
        self.rank, self.num_ranks, self.seed = int(rank), int(num_ranks), int(seed)
        self.start, self.stop = shard_range(info, rank, num_ranks, seed)
        self.n = self.stop - self.start
        row_bytes = info.stored_row_bytes
        self.block_rows = _block_rows(info, row_bytes)
        block_bytes = self.block_rows * row_bytes
        if memory_bytes < WINDOWS_IN_MEMORY * block_bytes:
            raise DataError(f"{info.path}: data.stream_memory_mb = {memory_bytes / 2**20:g} "
                            f"holds less than {WINDOWS_IN_MEMORY} blocks of "
                            f"{self.block_rows} rows ({block_bytes:,d} bytes each, whole "
                            f"chunks of the file); raise it")
        self.blocks = _blocks(self.start, self.stop, self.block_rows)
        self.blocks_per_window = memory_bytes // (WINDOWS_IN_MEMORY * block_bytes)
        self.epoch = 0
        self.position = 0
        self._batch_size = 0
        self._window: _Window | None = None
        self._reader: _Reader | None = None
        atexit.register(self.close)

    # -- the order -------------------------------------------------------------------------

    def windows(self, epoch: int) -> list[list[tuple[int, int]]]:
        """Epoch `epoch`'s windows: lists of (first row, stop row) blocks, in stream order."""
        rng = np.random.default_rng(np.random.SeedSequence(self.seed,
                                                           spawn_key=(self.rank, epoch, 0)))
        order = [self.blocks[i] for i in rng.permutation(len(self.blocks))]
        k = self.blocks_per_window
        return [order[i:i + k] for i in range(0, len(order), k)]

    def row_order(self, epoch: int, index: int, rows: int) -> np.ndarray:
        seq = np.random.SeedSequence(self.seed, spawn_key=(self.rank, epoch, 1 + index))
        return np.random.default_rng(seq).permutation(rows)

    # -- serving batches -------------------------------------------------------------------

    def _ensure_buffers(self, batch_size: int) -> None:
        if batch_size == self._batch_size:
            return
        shape = (batch_size, *self.info.input_shape)
        if self.info.features != "sparse":  # a sparse batch is gathered fresh (its nnz varies)
            self._stored = np.empty(shape, dtype=self.info.stored_dtype)
        if self.info.features == "dense":
            self._xbuf = np.empty(shape, dtype=np.float32)
        self._ybuf = np.empty((batch_size, *self.info.target_shape),
                              dtype=self.info.target_dtype)
        self._batch_size = batch_size

    def _current(self) -> _Window:
        """The window holding the stream's position (from the prefetch thread)."""
        window = self._window
        if window is not None and window.epoch == self.epoch \
                and window.first <= self.position < window.first + len(window.order):
            return window
        self._window = None  # let it go before the next one arrives (the memory bound)
        if self._reader is None:
            self._reader = _Reader(self, self.epoch, self.position)
        while True:
            window = self._reader.next_window()
            if window.epoch == self.epoch and \
                    window.first <= self.position < window.first + len(window.order):
                self._window = window
                return window

    def next_batch(self, batch_size: int) -> tuple[Any, np.ndarray]:
        """The next minibatch: x float32 (B, *input_shape) scaled (sparse: a SparseRows;
        ids: int64), y int32 labels (B,) or float32 values (B, *target_shape). Views of
        buffers the next call overwrites, as TrainShard's."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
                or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if batch_size > self.n:
            raise ValueError(f"batch_size {batch_size} is larger than this shard "
                             f"({self.n} rows, rank {self.rank} of {self.num_ranks})")
        self._ensure_buffers(batch_size)
        sparse = self.info.features == "sparse"
        pieces = []
        filled = 0
        while filled < batch_size:
            window = self._current()
            offset = self.position - window.first
            take = min(batch_size - filled, len(window.order) - offset)
            index = window.order[offset:offset + take]
            if sparse:
                pieces.append(window.x[index])
            else:
                np.take(window.x, index, axis=0, out=self._stored[filled:filled + take])
            np.take(window.y, index, axis=0, out=self._ybuf[filled:filled + take])
            filled += take
            self.position += take
            if self.position == self.n:
                self.epoch += 1
                self.position = 0
        if sparse:
            return (pieces[0] if len(pieces) == 1 else concatenate(pieces)), self._ybuf
        if self.info.features == "ids":
            return self._stored, self._ybuf
        to_float(self._stored, self.info.scale, out=self._xbuf)
        return self._xbuf, self._ybuf

    # -- resume ----------------------------------------------------------------------------

    def state(self) -> dict:
        """Where the batch stream stands, as plain ints (TrainShard's keys and the window
        shape, which decides the order)."""
        return {"seed": self.seed, "rank": self.rank, "num_ranks": self.num_ranks,
                "n": self.n, "epoch": self.epoch, "position": self.position,
                "block_rows": self.block_rows, "blocks_per_window": self.blocks_per_window}

    def load_state(self, state: dict) -> None:
        """Resume the exact batch sequence saved by `state()` (ValueError for another
        shard, or a state written with another window shape or in memory)."""
        epoch, position = saved_position(
            self.state(), state, "not a streaming shard state (was the run trained with "
            "data.in_memory = true?)")
        self.close()
        self.epoch, self.position = epoch, position

    def close(self) -> None:
        """Stop the prefetch thread (a later batch starts it again)."""
        if self._reader is not None:
            self._reader.stop()
            self._reader = None
        self._window = None


class _Reader:
    """The prefetch thread: reads the windows from (epoch, position) on, in stream order,
    into a queue one window deep; a read error is handed over and raised by next_window."""

    def __init__(self, shard: StreamingTrainShard, epoch: int, position: int):
        self._shard = shard
        self._queue: queue.Queue = queue.Queue(maxsize=WINDOWS_IN_MEMORY - 2)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(epoch, position),
                                        name=f"distbelief-prefetch-{shard.rank}", daemon=True)
        self._thread.start()

    def next_window(self) -> _Window:
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise DataError(f"{self._shard.info.path}: the prefetch thread "
                                    "stopped") from None
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=10)

    def _run(self, epoch: int, position: int) -> None:
        shard = self._shard
        try:
            with open_h5(shard.info.path) as f:
                x, y = f["train/x"], f["train/y"]
                while not self._stopping.is_set():
                    first = 0
                    for index, blocks in enumerate(shard.windows(epoch)):
                        rows = sum(hi - lo for lo, hi in blocks)
                        if first + rows > position and \
                                not self._put(self._read(x, y, epoch, index, first, blocks)):
                            return
                        first += rows
                    epoch, position = epoch + 1, 0
        except Exception as exc:  # noqa: BLE001 (any failure is handed to the training thread)
            error = exc if isinstance(exc, DataError) else DataError(
                f"{shard.info.path}: cannot read the training rows: {first_line(exc)}")
            self._put(error)

    def _read(self, x: Any, y: Any, epoch: int, index: int, first: int,
              blocks: list[tuple[int, int]]) -> _Window:
        shard = self._shard
        rows = sum(hi - lo for lo, hi in blocks)
        ys = np.empty((rows, *shard.info.target_shape), dtype=shard.info.target_dtype)
        at = 0
        try:
            xs = self._read_x(x, blocks, rows)
            for lo, hi in blocks:
                labels = y[lo:hi]
                ys[at:at + hi - lo] = labels
                count_read(labels)
                at += hi - lo
        except H5_ERRORS as exc:
            raise DataError(f"{shard.info.path}: cannot read training rows of /train/x "
                            f"(corrupt file?): {first_line(exc)}") from exc
        return _Window(epoch, index, first, xs, ys, shard.row_order(epoch, index, rows))

    def _read_x(self, x: Any, blocks: list[tuple[int, int]], rows: int) -> Any:
        """The blocks' rows of /train/x, one after another, as TrainShard holds them."""
        info = self._shard.info
        if info.features == "sparse":
            xs = concatenate([kinds.read_sparse(x, np.s_[lo:hi], info.input_shape[0])
                              for lo, hi in blocks])
            count_read(xs)
            return xs
        xs = np.empty((rows, *info.input_shape), dtype=info.stored_dtype)
        at = 0
        for lo, hi in blocks:
            if info.features == "ids":  # stored int32 or int64, held as int64
                xs[at:at + hi - lo] = x[lo:hi]
            else:
                x.read_direct(xs, np.s_[lo:hi], np.s_[at:at + hi - lo])
            at += hi - lo
        count_read(xs)
        return xs

    def _put(self, item: Any) -> bool:
        """Queue `item`, waiting for room; False once asked to stop."""
        while not self._stopping.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False


def _block_rows(info: DatasetInfo, row_bytes: int) -> int:
    """Rows per read: whole chunks of the file's /train/x, about READ_BYTES (sparse rows:
    about READ_BYTES of them on average; their chunks hold entries, not rows)."""
    if info.features == "sparse":
        return min(max(1, READ_BYTES // max(1, row_bytes)), info.n_train + info.held_out)
    with open_h5(info.path) as f:
        chunks = f["train/x"].chunks
    chunk_rows = chunks[0] if chunks else 1
    rows = chunk_rows * max(1, READ_BYTES // max(1, chunk_rows * row_bytes))
    # No larger than the file's rows: a small file streams in a little memory. (Dense
    # files keep the block they always had, which a saved position records.)
    return rows if info.features == "dense" else min(rows, info.n_train + info.held_out)


def _blocks(start: int, stop: int, block_rows: int) -> list[tuple[int, int]]:
    """[start, stop) cut at the multiples of block_rows (so reads stay chunk-aligned)."""
    edges = [start, *range((start // block_rows + 1) * block_rows, stop, block_rows), stop]
    return [(lo, hi) for lo, hi in itertools.pairwise(edges) if hi > lo]
