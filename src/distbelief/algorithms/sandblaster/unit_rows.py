"""A Sandblaster replica's training rows (UnitRows): the block of rows its own units draw
from (plan.owner_blocks), read once at start, and the rows of other replicas' units it is
given (load balancing, backups, a lost replica's units), read from the file when asked
for and kept in a bounded cache. So the file system sees each replica read about 1/R of
the training set plus what was moved to it, not the whole set (docs/sandblaster.md,
"Data by role").
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from distbelief.algorithms.sandblaster.plan import BatchRows, Block
from distbelief.data.hdf5 import DatasetInfo, bytes_read, read_rows, read_rows_at

MIN_CACHE_BYTES = 32 << 20
"""Other replicas' rows kept at least this many bytes (else as many as the own block):
in the full batch the same units come back every iteration."""


class UnitRows:
    """The stored x and int32 y of any unit's rows; its own block's from memory."""

    def __init__(self, info: DatasetInfo, batches: BatchRows, block: Block,
                 read: bool = True):
        """`read` False: x and y are left to be filled (by a broadcast from partition 0
        of the same replica: roles.start) instead of read from the file."""
        self.info, self.batches = info, batches
        _, _, self.lo, self.hi = block
        if read:
            self.x, self.y = read_rows(info, "train", self.lo, self.hi)
        else:
            self.x = np.empty((self.hi - self.lo, *info.input_shape), dtype=info.stored_dtype)
            self.y = np.empty(self.hi - self.lo, dtype=np.int32)
        self.cache_bytes = max(MIN_CACHE_BYTES, self.x.nbytes + self.y.nbytes)
        self._cache: OrderedDict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = \
            OrderedDict()
        self._cached = 0
        self.foreign_units = 0   # units of other replicas asked for
        self.foreign_reads = 0   # ... of which read from the file (not in the cache)
        self.foreign_bytes = 0   # x and y bytes of those reads

    def unit(self, batch: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """x (stored dtype) and y of batch `batch`'s positions [start, stop)."""
        rows = self.batches.rows_at(batch, start, stop)
        if len(rows) and self.lo <= rows.min() and rows.max() < self.hi:
            return self.x[rows - self.lo], self.y[rows - self.lo]
        self.foreign_units += 1
        # The full batch is the same rows every time: key by position alone.
        key = (-1 if self.batches.batch_size >= self.batches.n else batch, start, stop)
        found = self._cache.get(key)
        if found is not None:
            self._cache.move_to_end(key)
            return found
        self.foreign_reads += 1
        before = bytes_read()
        if len(rows) and np.array_equal(rows, np.arange(rows[0], rows[0] + len(rows))):
            found = read_rows(self.info, "train", int(rows[0]), int(rows[0]) + len(rows))
        else:
            found = read_rows_at(self.info, "train", rows)
        self.foreign_bytes += bytes_read() - before  # as stored (bytes_read)
        size = found[0].nbytes + found[1].nbytes
        while self._cache and self._cached + size > self.cache_bytes:
            _, (x, y) = self._cache.popitem(last=False)
            self._cached -= x.nbytes + y.nbytes
        if size <= self.cache_bytes:
            self._cache[key] = found
            self._cached += size
        return found
