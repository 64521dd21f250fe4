"""A sparse model computed on a replica's row cache: the rows of its next batches only,
never a whole table (issue 44, part 3; docs/sparse-models.md, "Row-sharded tables").

The parameters' identity stays the flat float32 vector (model.layout): each table rows-major,
so row i of a table at `offset` is the slice [offset + i*width, offset + (i + 1)*width),
and the dense part (the first layer's bias, then the tower) is one range at the end.

A `RowCache` is a set of rows per table (their ids sorted) and the compact vector that
holds them: each table's cached rows in id order, then the dense part. Its `pieces` are
the vector ranges that compact vector is made of, in order (runs of consecutive ids
coalesced), which is what a parameter-server client pulls and pushes
(ps.endpoint.PieceMap). `RowsView` computes a SparseNetwork's loss and gradient on such a
compact vector: the batch's ids are numbered by their position in the cache (a binary
search: no table-sized scratch), and the first layer's compact rows are the cache's rows
themselves, so the gradient comes out compact too, the same numbers as the whole-vector
computation at those rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from distbelief.model.layout import DTYPE
from distbelief.model.losses import Evaluation, Loss
from distbelief.model.sparse_network import SparseNetwork, TableLookup, tally_batches


class RowCache:
    """Rows of each table of `network` (`ids`: sorted distinct int64 per table) and the
    layout of the compact vector holding them and the dense part."""

    def __init__(self, network: SparseNetwork, ids: Sequence[np.ndarray]):
        self.tables = network.tables  # (offset, rows, width)
        if len(ids) != len(self.tables):
            raise ValueError(f"{len(ids)} id arrays for {len(self.tables)} tables")
        self.ids = [np.asarray(i, dtype=np.int64) for i in ids]
        for t, ((_, rows, _), table_ids) in enumerate(zip(self.tables, self.ids)):
            if table_ids.ndim != 1 or (len(table_ids) and (
                    table_ids[0] < 0 or table_ids[-1] >= rows
                    or np.any(table_ids[1:] <= table_ids[:-1]))):
                raise ValueError(f"table {t}: ids must be sorted, distinct and in "
                                 f"[0, {rows})")
        sizes = [len(i) * width for i, (_, _, width) in zip(self.ids, self.tables)]
        self.table_at = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # compact
        bias = network.layout.entry(0, "bias")
        self.dense = (bias.offset, network.layout.size)  # bias, then the tower
        self.bias_size = bias.size
        self.size = int(self.table_at[-1]) + self.dense[1] - self.dense[0]
        self.pieces = self._pieces()

    @classmethod
    def for_batches(cls, network: SparseNetwork, xs: Sequence[Any]) -> RowCache:
        """The rows the batches `xs` read, each table's ids deduplicated over them."""
        per_batch = [network.input_layer.table_ids(x) for x in xs]
        ids = [sorted_distinct(np.concatenate([np.asarray(b[t]).reshape(-1)
                                               for b in per_batch]))
               for t in range(len(network.tables))]
        return cls(network, ids)

    def _pieces(self) -> np.ndarray:
        """(n, 2) int64 [start, stop) vector ranges of the compact vector, in its order."""
        parts = []
        for (offset, _, width), ids in zip(self.tables, self.ids):
            if not len(ids):
                continue
            starts = np.empty(len(ids), dtype=bool)  # a run of consecutive ids starts here
            starts[0] = True
            np.not_equal(ids[1:], ids[:-1] + 1, out=starts[1:])
            ends = np.empty_like(starts)  # and ends here
            ends[:-1], ends[-1] = starts[1:], True
            part = np.empty((int(starts.sum()), 2), dtype=np.int64)
            part[:, 0] = offset + ids[starts] * width
            part[:, 1] = offset + (ids[ends] + 1) * width
            parts.append(part)
        parts.append(np.array([self.dense], dtype=np.int64))
        return np.concatenate(parts)

    @property
    def rows(self) -> int:
        """Rows held, over all tables."""
        return sum(len(i) for i in self.ids)

    def views(self, compact: np.ndarray) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """(each table's cached rows (u, width), the bias, the tower's vector) as views of
        a compact vector."""
        if compact.dtype != DTYPE or compact.shape != (self.size,):
            raise ValueError(f"a compact vector of this cache is float32 ({self.size},), got "
                             f"{compact.dtype} {compact.shape}")
        tables = [compact[a:b].reshape(-1, width) for a, b, (_, _, width)
                  in zip(self.table_at[:-1], self.table_at[1:], self.tables)]
        dense = compact[int(self.table_at[-1]):]
        return tables, dense[:self.bias_size], dense[self.bias_size:]

    def positions(self, table: int, ids: np.ndarray) -> np.ndarray:
        """Each id's row in this cache's table `table`; ValueError if one is not held."""
        held = self.ids[table]
        ids = np.asarray(ids).reshape(-1)
        at = np.searchsorted(held, ids)
        missing = (at >= len(held)) | (held[np.minimum(at, len(held) - 1)] != ids
                                       if len(held) else np.ones(len(ids), dtype=bool))
        if np.any(missing):
            raise ValueError(f"table {table}: id {int(ids[np.argmax(missing)])} is not in "
                             f"the row cache (pull the batch's rows first)")
        return at.astype(np.intp)

    def gather(self, whole: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """This cache's compact vector read from a whole vector (tests, a local start)."""
        out = np.empty(self.size, dtype=DTYPE) if out is None else out
        at = 0
        for start, stop in self.pieces:
            out[at:at + stop - start] = whole[start:stop]
            at += stop - start
        return out

    def scatter(self, compact: np.ndarray, whole: np.ndarray) -> None:
        """Write a compact vector's values at their places in a whole vector (tests)."""
        at = 0
        for start, stop in self.pieces:
            whole[start:stop] = compact[at:at + stop - start]
            at += stop - start


def sorted_distinct(ids: np.ndarray) -> np.ndarray:
    """The distinct values of `ids`, sorted, as int64: np.unique's result, by a sort and a
    comparison of neighbours (half np.unique's time on a batch's few thousand ids, which
    np.unique hashes before it sorts)."""
    ids = np.sort(np.asarray(ids, dtype=np.int64).reshape(-1))
    if len(ids) < 2:
        return ids
    keep = np.empty(len(ids), dtype=bool)
    keep[0] = True
    np.not_equal(ids[1:], ids[:-1], out=keep[1:])
    return ids[keep]


def merged(network: SparseNetwork, parts: Sequence[tuple[RowCache, np.ndarray]]
           ) -> tuple[RowCache, np.ndarray]:
    """Compact gradients over several caches summed into one over the union of their rows
    (a push of steps that fetched different rows)."""
    if len(parts) == 1:
        return parts[0]
    union = RowCache(network, [sorted_distinct(np.concatenate([c.ids[t] for c, _ in parts]))
                               for t in range(len(network.tables))])
    total = np.zeros(union.size, dtype=DTYPE)
    tables, bias, tower = union.views(total)
    for cache, grad in parts:
        ctables, cbias, ctower = cache.views(grad)
        for t, rows in enumerate(ctables):
            tables[t][union.positions(t, cache.ids[t])] += rows
        bias += cbias
        tower += ctower
    return union, total


class RowsView:
    """A SparseNetwork's loss and gradient on the compact vector of a RowCache (`cache`,
    set before each call): the replica-side model of a row-sharded run; and its
    evaluation on a cache of the evaluation set's rows (shard 0's, never the tables)."""

    def __init__(self, network: SparseNetwork):
        self.network = network
        self.cache: RowCache | None = None

    def loss_and_grad(self, params: np.ndarray, x: Any, y: np.ndarray,
                      grad: np.ndarray) -> float:
        """Mean loss over the batch; the gradient of the cache's rows and of the dense
        part into the compact `grad` (zero at cached rows the batch does not read)."""
        net, cache = self.network, self._cached()
        net._check_input(x)
        tables, bias, tower = cache.views(params)
        dtables, dbias, dtower = cache.views(grad)
        found = self._found(x)
        out = net.first_from_rows(x, found, tables, bias)
        loss, drows = net.backward_from_rows(x, y, out, found, tables,
                                             tower if net.tower is not None else None,
                                             dtower if net.tower is not None else None, dbias)
        for dtable, d in zip(dtables, drows):
            dtable[...] = d
        return loss

    def logits(self, params: np.ndarray, x: Any) -> np.ndarray:
        """The output layer's values before the loss's activation, from the compact
        `params` of the cache (which must hold x's rows)."""
        net, cache = self.network, self._cached()
        net._check_input(x)
        tables, bias, tower = cache.views(params)
        out = net.first_from_rows(x, self._found(x), tables, bias)
        return out if net.tower is None else net.tower.logits(tower, out)

    def tally(self, params: np.ndarray, x: Any, y: np.ndarray,
              batch_size: int = 1000) -> np.ndarray:
        """As SparseNetwork.tally, on the cache's compact vector."""
        return tally_batches(lambda xb: self.logits(params, xb), self.network.loss_fn, x, y,
                             batch_size)

    def evaluate(self, params: np.ndarray, x: Any, y: np.ndarray,
                 batch_size: int = 1000) -> Evaluation:
        return self.network.loss_fn.evaluation(self.tally(params, x, y, batch_size))

    @property
    def figures_of(self) -> Loss:
        return self.network.loss_fn

    def _cached(self) -> RowCache:
        if self.cache is None:
            raise RuntimeError("RowsView: set a row cache before computing")
        return self.cache

    def _found(self, x: Any) -> list[TableLookup]:
        """Each table's lookup of the batch x: the cache's ids and each entry's row in it."""
        cache = self.cache
        return [TableLookup(cache.ids[t], cache.positions(t, ids))
                for t, ids in enumerate(self.network.input_layer.table_ids(x))]
