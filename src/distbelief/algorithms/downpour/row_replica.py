"""A Downpour replica of a sparse model that moves only its batches' table rows
(optimizer.table_pulls = "rows"; docs/sparse-models.md, "Row-sharded tables on the
parameter server").

At each fetch it draws the batches it will compute before the next fetch (up to n_fetch,
copied: the replica's batch memory is those batches), numbers the rows they read
(model.sparse_rows.RowCache: each table's ids deduplicated) and pulls those rows and the
dense part into a compact vector (ParameterClient.use_pieces); its steps compute on that
vector (RowsView), and a push sends the compact gradient of the rows its steps read,
summed over the block (gradients of different caches merged), which the shards apply at
those rows alone. So its memory follows n_fetch batches and their rows, never a table.

The data position it reports (checkpoints, its end) is that of the first batch drawn but
not yet computed, so a resumed run computes exactly the batches this one did not.

Under optimizer.max_staleness (downpour.clocks) the gate's FETCH pulls the rows of the
batches drawn and not yet computed, those of the next steps (the ones it drew at the push
if a fetch was due there, else what is left of the last fetch's): new compact vectors
count as never fetched (ReplicaClock.emptied), so the gate never lets a block
start on rows it did not pull after MIN_CLOCK allowed it.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from distbelief.algorithms.downpour.replica import Replica
from distbelief.algorithms.downpour.run import OpenRun
from distbelief.data.sparse import SparseRows
from distbelief.model.layout import DTYPE
from distbelief.model.sparse_rows import RowCache, RowsView, merged
from distbelief.ps.endpoint import PieceMap
from distbelief.ps.run_control import ControlExchange


class _CompactLayout:
    """What Replica reads of a model's layout: the size of the vectors it holds."""

    size = 0


class RowsModel(RowsView):
    """RowsView with the `layout` Replica sizes its vectors by (0 until the first
    fetch: the row replica allocates them per fetch)."""

    layout = _CompactLayout()


class RowReplica(Replica):
    """Replica over a row cache: pulls its next batches' rows, pushes their gradients."""

    def __init__(self, run: OpenRun, network: Any, fetch: str = "own_pushes"):
        self.sparse = network
        super().__init__(run, RowsModel(network), fetch)
        self._queue: list[tuple[Any, np.ndarray, dict]] = []  # (x, y, data state before)
        self._cache: RowCache | None = None
        self._pull_map: PieceMap | None = None
        self._parts: list[tuple[RowCache, np.ndarray]] = []  # the block's gradients
        self._pending = False  # self.grad holds a step's gradient not yet banked
        self._drawn_at = -1  # self.t when the cache was last made
        self.rows_pulled = 0  # over all fetches (statistics)

    # -- the row cache

    def _next_rows(self) -> None:
        """Before a pull: draw the batches up to the next scheduled fetch, make their rows
        the cache, point the pull at them and allocate the compact vectors."""
        self._bank()
        if self._cache is not None and self._drawn_at == self.t:
            return  # drawn at this step already (the push, then the bound's gate)
        self._drawn_at = self.t
        n_fetch = self.plan.n_fetch
        wanted = n_fetch - self.t % n_fetch
        while len(self._queue) < wanted:
            state = self.data.state()
            x, y = self.data.next_batch(self.plan.batch_size)
            # Batches are views of the reader's buffers: copies, kept until computed.
            x = x[np.arange(len(x))] if isinstance(x, SparseRows) else np.array(x)
            self._queue.append((x, np.array(y), state))
        self._cache = RowCache.for_batches(self.sparse, [x for x, _, _ in self._queue])
        self._pull_map = PieceMap(self._cache.pieces, self.client.ranges)
        self.network.cache = self._cache
        self.params = np.zeros(self._cache.size, dtype=DTYPE)
        self.grad = np.zeros_like(self.params)
        self.pushed = self.grad
        self.client.use_pieces(self._pull_map, None)
        self.rows_pulled += self._cache.rows
        if self.clock is not None:
            self.clock.emptied()  # new vectors: the gate must fetch into them

    def _bank(self) -> None:
        """Keep the last step's gradient (zeroed by _drop if it was not finite) for the
        block's push."""
        if not self._pending:
            return
        self._pending = False
        if self._parts and self._parts[-1][0] is self._cache:
            self._parts[-1][1][...] += self.grad
        else:
            self._parts.append((self._cache, self.grad.copy()))

    # -- Replica's hooks

    def _first_claim(self) -> int:
        self._next_rows()
        return super()._first_claim()

    def _pull(self) -> None:
        self._next_rows()
        super()._pull()

    def _compute_step(self) -> tuple[float, float]:
        """Replica's step on the next batch drawn at the last fetch."""
        self._bank()
        started = time.perf_counter()
        x, y, _ = self._queue.pop(0)
        loss = self.network.loss_and_grad(self.params, x, y, self.grad)
        self.t += 1
        self.injected.after_gradient(self.t, self.grad)
        self._pending = True
        return loss, started

    def _push(self, control: ControlExchange) -> None:
        """Push the block's gradient (its rows and the dense part); with a fetch due, pull
        the next batches' rows in the same call."""
        self._bank()
        if not self._parts:  # nothing computed (a stop before the first step)
            self._parts = [(self._cache, np.zeros(self._cache.size, dtype=DTYPE))]
        cache, total = merged(self.sparse, self._parts)
        self._parts = []
        # The pieces of the rows last pulled are pushed back as they were mapped, unless
        # the block's steps read several caches (then their union is mapped).
        push_map = (self._pull_map if cache is self._cache and self._pull_map is not None
                    else PieceMap(cache.pieces, self.client.ranges))
        if self.t % self.plan.n_fetch == 0:
            self._next_rows()
        self.client.use_pieces(self._pull_map, push_map)
        self.pushed = total
        try:
            super()._push(control)
        finally:
            self.pushed = self.grad

    def _publish_position(self, **more: int) -> Any:
        """Publish the position of the first batch drawn and not computed (and `more`)."""
        if self.data is None:  # a spare that trains no part (downpour.spares)
            return super()._publish_position(**more)
        state = self._queue[0][2] if self._queue else self.data.state()
        self.control.publish(epoch=state["epoch"], position=state["position"],
                             local_steps=self.t, **more)
        return self._exchange(self.control.set(claim=0))

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["rows_pulled"] = self.rows_pulled
        return out
