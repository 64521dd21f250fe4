"""Models over sparse inputs: a sparse linear model, embeddings feeding a dense tower, and
matrix factorisation, over the same flat float32 vector as every other model.

The first layer reads the batch's ids and is one of:

    {type = "sparse_linear", units, activation}      sparse rows (CSR) -> (N, units):
        a weight row per feature id: x @ W + b. With units = 1 and a sigmoid output it is
        logistic regression on sparse features (the Hogwild paper's and CTR's baseline).
    {type = "embedding", dim, combine = "concat", rows = <from the data>}
        ids (N, F), a table of `dim`-wide rows per field -> the fields' rows combined:
        "concat" (N, F*dim), "sum" or "mean" (N, dim), or "dot" (two fields: user and
        item) (N, 1), matrix factorisation's prediction. `rows` makes every field's
        table that many rows, ids taken modulo it (the hashing trick); by default each
        field's table has the data's id_rows. Over sparse rows (a bag of ids per example)
        it is "sum" or "mean" of the rows, weighted by the values.

Dense layers may follow (model.network's, the tower); without them the first layer is the
output layer, with the loss's activation. Each table is stored rows-major in the vector,
so a row is a contiguous slice: what a shard holding a range of a table's rows needs.

A step touches only the batch's rows (model.sparse_kernels): they are gathered from the
parameters into a compact array, and their gradient is written back at their rows of the
whole gradient, whose other table rows are zero.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from distbelief.errors import ConfigError, DataError
from distbelief.model import kernels
from distbelief.model.layout import DTYPE, ParamLayout
from distbelief.model.losses import CrossEntropy, Evaluation, Loss
from distbelief.model.network import (
    Network,
    check_activation,
    evaluation_size,
    layer_values,
)
from distbelief.model.sparse_kernels import Lookup, bag_backward, bag_forward, segment_sum

SPARSE_LAYER_KEYS: dict[str, tuple[tuple[str, ...], dict[str, object]]] = {
    "sparse_linear": (("type", "units", "activation"), {}),
    "embedding": (("type", "dim"), {"combine": "concat", "activation": "linear",
                                    "rows": None}),
}
COMBINES = ("concat", "sum", "mean", "dot")
INPUT_KINDS = ("sparse", "ids")
"""What a sparse model reads (distbelief.data: DatasetInfo.features): CSR rows
(data.sparse.SparseRows) or an integer id per field (an (N, F) integer array)."""
SPARSE_LINEAR_LIMIT = 0.01
"""sparse_linear's weights start uniform in +-this: near zero, as a linear model's usually
start, yet not all equal when units > 1 feed a tower."""


def is_sparse(layers: Any) -> bool:
    """Whether a [model] layer list starts with a sparse input layer."""
    return (isinstance(layers, Sequence) and not isinstance(layers, str) and len(layers) > 0
            and isinstance(layers[0], Mapping) and layers[0].get("type") in SPARSE_LAYER_KEYS)


class TableLookup(NamedTuple):
    """One table's rows in a batch: the distinct ids, and each entry's position among
    them."""

    ids: np.ndarray
    positions: np.ndarray


class SparseInput:
    """The first layer: a batch's ids -> (N, out_size), through rows of its tables."""

    kind = "sparse"
    saved_per_output = 0
    random_init = True

    def __init__(self, tables: list[tuple[str, int, int]], out_size: int, activation: str,
                 limit: float):
        self.tables = tables  # (name, rows, width)
        self.out_size = out_size
        self.out_shape = (out_size,)
        self.activation = activation
        self.kernel_activation = activation
        self.limit = limit

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(name, (rows, width)) for name, rows, width in self.tables] + [
            ("bias", (self.out_size,))]

    @property
    def num_params(self) -> int:
        return sum(math.prod(shape) for _, shape in self.param_shapes())

    def describe(self) -> str:
        tables = ", ".join(f"{rows:,d}x{width}" for _, rows, width in self.tables)
        return (f"{self.kind:<6} {self.out_size:<12} {self.num_params:>12,d} params  "
                f"{self.activation} (tables {tables})")

    # What each kind defines:
    def lookups(self, x: Any) -> list[TableLookup]:
        raise NotImplementedError

    def table_ids(self, x: Any) -> list[np.ndarray]:
        """Each table's row id of every entry of the batch (repeats included): what a
        replica's row cache must hold for this batch (model.sparse_rows)."""
        raise NotImplementedError

    def combine(self, x: Any, found: list[TableLookup], rows: list[np.ndarray],
                out: np.ndarray) -> None:
        """out (N, out_size) = the tables' rows (compact, one array per table) combined,
        before bias and activation."""
        raise NotImplementedError

    def combine_backward(self, x: Any, found: list[TableLookup], rows: list[np.ndarray],
                         dz: np.ndarray) -> list[np.ndarray]:
        """Each table's compact rows' gradient from dz (N, out_size)."""
        raise NotImplementedError


class Bag(SparseInput):
    """sparse_linear, or an embedding over sparse rows: each example's rows of one table,
    weighted by its values, summed (or averaged over its ids)."""

    def __init__(self, kind: str, n_features: int, width: int, activation: str,
                 mean: bool = False):
        limit = SPARSE_LINEAR_LIMIT if kind == "sparse_linear" else math.sqrt(3.0 / width)
        super().__init__([("table", n_features, width)], width, activation, limit)
        self.kind = kind
        self.mean = mean
        self._lookup = Lookup(n_features)

    def lookups(self, x: Any) -> list[TableLookup]:
        return [TableLookup(*self._lookup(x.indices))]

    def table_ids(self, x: Any) -> list[np.ndarray]:
        return [x.indices]

    def combine(self, x: Any, found: list[TableLookup], rows: list[np.ndarray],
                out: np.ndarray) -> None:
        bag_forward(x.indptr, found[0].positions, x.values, rows[0], out)
        if self.mean:
            out /= self._counts(x)

    def combine_backward(self, x: Any, found: list[TableLookup], rows: list[np.ndarray],
                         dz: np.ndarray) -> list[np.ndarray]:
        if self.mean:
            dz = dz / self._counts(x)
        return [bag_backward(x.indptr, found[0].positions, x.values, dz, len(found[0].ids))]

    @staticmethod
    def _counts(x: Any) -> np.ndarray:
        return np.maximum(np.diff(x.indptr), 1).astype(DTYPE)[:, None]


class FieldEmbedding(SparseInput):
    """An embedding table per field of an (N, F) id array, the fields' rows combined."""

    kind = "embedding"

    def __init__(self, table_rows: Sequence[int], dim: int, combine: str, activation: str,
                 hashed: bool):
        fields = len(table_rows)
        out = {"concat": fields * dim, "sum": dim, "mean": dim, "dot": 1}[combine]
        super().__init__([(f"table_{f}", int(rows), dim) for f, rows in enumerate(table_rows)],
                         out, activation, math.sqrt(3.0 / dim))
        self.dim, self.mode, self.hashed = dim, combine, hashed
        self._lookups = [Lookup(int(rows)) for rows in table_rows]

    def lookups(self, x: Any) -> list[TableLookup]:
        return [TableLookup(*look(ids)) for ids, look in zip(self.table_ids(x), self._lookups)]

    def table_ids(self, x: Any) -> list[np.ndarray]:
        if self.hashed:
            x = x % np.array([rows for _, rows, _ in self.tables])
        return [x[:, f] for f in range(len(self.tables))]

    def combine(self, x: Any, found: list[TableLookup], rows: list[np.ndarray],
                out: np.ndarray) -> None:
        picked = [table[look.positions] for table, look in zip(rows, found)]
        if self.mode == "concat":
            np.concatenate(picked, axis=1, out=out)
        elif self.mode == "dot":
            np.einsum("nd,nd->n", picked[0], picked[1], out=out[:, 0])
        else:
            np.sum(picked, axis=0, out=out)
            if self.mode == "mean":
                out /= len(picked)

    def combine_backward(self, x: Any, found: list[TableLookup], rows: list[np.ndarray],
                         dz: np.ndarray) -> list[np.ndarray]:
        fields, dim = len(self.tables), self.dim
        if self.mode == "concat":
            per_field = [dz[:, f * dim:(f + 1) * dim] for f in range(fields)]
        elif self.mode == "dot":
            # d(u.v)/du = v: each field's rows get dz times the other field's rows.
            other = [rows[1][found[1].positions], rows[0][found[0].positions]]
            per_field = [dz * other[f] for f in range(2)]
        else:
            scaled = dz / fields if self.mode == "mean" else dz
            per_field = [scaled] * fields
        return [segment_sum(look.positions, np.ascontiguousarray(d, dtype=DTYPE),
                            len(look.ids))
                for look, d in zip(found, per_field)]


class SparseNetwork:
    """A sparse input layer, then (optionally) a tower of dense layers, then the loss: the
    trainers' surface, as model.network.Network's."""

    def __init__(self, input_kind: str, input_shape: tuple[int, ...], layers: list[dict],
                 num_classes: int, seed: int = 0, loss: Loss | None = None,
                 id_rows: Sequence[int] = ()):
        """`input_kind` is "sparse" (input_shape (n_features,)) or "ids" (input_shape
        (fields,), `id_rows` each field's table size)."""
        if loss is None:
            loss = CrossEntropy(num_classes)
        self.loss_fn = loss
        self.num_classes = loss.width
        self.input_kind = input_kind
        self.input_shape = tuple(int(d) for d in input_shape)
        self.seed = int(seed)
        self._own_step = 0
        tower = list(layers[1:])
        self.input_layer = build_input_layer(input_kind, self.input_shape, tuple(id_rows),
                                             layers[0], not tower, loss)
        self.tower = (Network((self.input_layer.out_size,), tower, self.num_classes,
                              seed=seed, loss=loss) if tower else None)
        if self.tower is None and self.input_layer.out_size != self.num_classes:
            key = "units" if self.input_layer.kind == "sparse_linear" else "dim"
            raise ConfigError(f"layer 0 ({self.input_layer.kind}): the output layer has "
                              f"{self.input_layer.out_size} outputs but the loss needs "
                              f"{self.num_classes}; set {key!r} so they match, or add "
                              f"dense layers after it")
        if self.tower is None:
            self.input_layer.kernel_activation = "linear"  # the loss applies it
        own = [(0, name, shape) for name, shape in self.input_layer.param_shapes()]
        tower_entries = [] if self.tower is None else [
            (e.layer + 1, e.name, e.shape) for e in self.tower.layout.entries]
        self.layout = ParamLayout(own + tower_entries)
        self._tower_offset = sum(math.prod(shape) for _, _, shape in own)
        self._split_cache: dict[str, tuple[np.ndarray, list, np.ndarray]] = {}
        bias = self.layout.entry(0, "bias")
        # Every coordinate outside the tables: the first layer's bias, then the tower.
        self._dense_index = np.r_[np.arange(bias.offset, bias.stop),
                                  np.arange(self._tower_offset, self.layout.size)]
        self._touched = self._dense_index

    @property
    def layers(self) -> list[Any]:
        return [self.input_layer, *([] if self.tower is None else self.tower.layers)]

    @property
    def step(self) -> int:
        return self._own_step if self.tower is None else self.tower.step

    @step.setter
    def step(self, value: int) -> None:
        if self.tower is None:
            self._own_step = int(value)
        else:
            self.tower.step = int(value)

    @property
    def tables(self) -> list[tuple[int, int, int]]:
        """(offset in the vector, rows, row width) of each table: the parts whose rows a
        batch touches sparsely."""
        return [(self.layout.entry(0, name).offset, rows, width)
                for name, rows, width in self.input_layer.tables]

    # -- parameters ----------------------------------------------------------------------

    def init_params(self, seed: int | np.random.Generator) -> np.ndarray:
        """A fresh vector, deterministic per seed: the tables uniform in +-their limit
        from PCG64(seed), biases 0, the tower as Network(seed + 1) draws it."""
        if isinstance(seed, np.random.Generator):
            seed = int(seed.integers(2**62))
        return self.init_slice(int(seed), 0, self.layout.size)

    def init_slice(self, seed: int, start: int, stop: int) -> np.ndarray:
        """init_params(seed)[start:stop] without building the whole vector (a shard's
        slice of a table larger than one rank's memory)."""
        if not 0 <= start <= stop <= self.layout.size:
            raise ValueError(f"slice [{start}, {stop}) outside the {self.layout.size} "
                             f"parameters")
        out = np.zeros(stop - start, dtype=DTYPE)
        drawn = 0  # the table values drawn before this table's
        for name, _, _ in self.input_layer.tables:
            entry = self.layout.entry(0, name)
            lo, hi = max(start, entry.offset), min(stop, entry.stop)
            if lo < hi:
                part = out[lo - start:hi - start]
                _uniform_from(seed, drawn + lo - entry.offset, part)
                part *= np.float32(2.0 * self.input_layer.limit)
                part -= np.float32(self.input_layer.limit)
            drawn += entry.size
        if self.tower is not None:
            lo, hi = max(start, self._tower_offset), stop
            if lo < hi:
                out[lo - start:] = self.tower.init_slice(seed + 1, lo - self._tower_offset,
                                                         hi - self._tower_offset)
        return out

    def _split(self, flat: np.ndarray, what: str) -> tuple[list[np.ndarray], np.ndarray,
                                                          np.ndarray | None]:
        """(the tables, the first layer's bias, the tower's vector) as views of `flat`."""
        cached = self._split_cache.get(what)
        if cached is not None and cached[0] is flat:
            return cached[1]
        if (not isinstance(flat, np.ndarray) or flat.dtype != DTYPE
                or flat.shape != (self.layout.size,) or not flat.flags.c_contiguous):
            raise ValueError(f"{what} must be a contiguous float32 vector of "
                             f"{self.layout.size} elements, got "
                             f"{getattr(flat, 'dtype', type(flat))} {getattr(flat, 'shape', '')}")
        tables = [self.layout.view(flat, 0, name) for name, _, _ in self.input_layer.tables]
        split = (tables, self.layout.view(flat, 0, "bias"),
                 None if self.tower is None else flat[self._tower_offset:])
        self._split_cache[what] = (flat, split)
        return split

    # -- forward and backward -------------------------------------------------------------

    def _check_input(self, x: Any) -> None:
        if self.input_kind == "sparse":
            if getattr(x, "n_features", None) != self.input_shape[0] or len(x) == 0:
                raise DataError(f"input must be sparse rows of {self.input_shape[0]} "
                                f"features (data.sparse.SparseRows), got "
                                f"{type(x).__name__} {getattr(x, 'shape', '')}")
        elif (not isinstance(x, np.ndarray) or x.ndim != 2 or len(x) == 0
              or x.shape[1:] != self.input_shape or not np.issubdtype(x.dtype, np.integer)):
            raise DataError(f"input must be an integer array of shape (N > 0, "
                            f"{self.input_shape[0]}), got {getattr(x, 'dtype', type(x))} "
                            f"{getattr(x, 'shape', '')}")

    def _first(self, params: np.ndarray, x: Any) -> tuple[np.ndarray, list, list]:
        """The first layer's output (N, out_size), its lookups and the compact rows."""
        self._check_input(x)
        tables, bias, _ = self._split(params, "params")
        found = self.input_layer.lookups(x)
        rows = [table[look.ids] for table, look in zip(tables, found)]
        return self.first_from_rows(x, found, rows, bias), found, rows

    def first_from_rows(self, x: Any, found: list, rows: list[np.ndarray],
                        bias: np.ndarray) -> np.ndarray:
        """The first layer's output (N, out_size) from the batch's compact rows (one
        (k, width) array per table, `found` numbering the batch's entries into them)."""
        out = np.empty((len(x), self.input_layer.out_size), dtype=DTYPE)
        self.input_layer.combine(x, found, rows, out)
        kernels.bias_activation(out, bias, self.input_layer.kernel_activation)
        return out

    def backward_from_rows(self, x: Any, y: np.ndarray, out: np.ndarray, found: list,
                           rows: list[np.ndarray], tower: np.ndarray | None,
                           dtower: np.ndarray | None, dbias: np.ndarray) -> tuple[float, list]:
        """The loss, the tower's and the bias's gradients (written into `dtower`, `dbias`)
        and each table's compact rows' gradient (returned), from the first layer's
        output `out`."""
        dz = np.empty_like(out)
        if self.tower is None:
            loss = self.loss_fn.loss_and_dout(out.copy(), y, dz)
            self._own_step += 1
        else:
            loss = self.tower.loss_and_grad(tower, out, y, dtower, dinput=dz)
        kernels.activation_backward(out, dz, self.input_layer.kernel_activation, dz, dbias)
        return float(loss), self.input_layer.combine_backward(x, found, rows, dz)

    def loss_and_grad(self, params: np.ndarray, x: Any, y: np.ndarray,
                      grad: np.ndarray) -> float:
        """Mean loss over the batch; writes the whole gradient into `grad` (zero at the
        table rows the batch does not touch)."""
        if np.may_share_memory(params, grad):
            raise ValueError("grad must not overlap params")
        out, found, rows = self._first(params, x)
        dtables, dbias, dtower = self._split(grad, "grad")
        _, _, tower = self._split(params, "params")
        loss, drows_all = self.backward_from_rows(x, y, out, found, rows, tower, dtower, dbias)
        for dtable, look, drows in zip(dtables, found, drows_all):
            dtable[...] = 0
            dtable[look.ids] = drows  # each id once: written, not accumulated
        self._touched = np.concatenate([self._dense_index, *(
            (offset + look.ids[:, None] * width + np.arange(width)).ravel()
            for (offset, _, width), look in zip(self.tables, found))])
        return float(loss)

    def touched(self) -> np.ndarray:
        """The coordinates whose gradient the last loss_and_grad may have made non-zero:
        the batch's rows of each table and every coordinate outside the tables (distinct,
        for optimizers' step_at)."""
        return self._touched

    def logits(self, params: np.ndarray, x: Any) -> np.ndarray:
        """The output layer's values before the loss's activation, (N, num_classes)."""
        out, _, _ = self._first(params, x)
        if self.tower is None:
            return out
        return self.tower.logits(self._split(params, "params")[2], out)

    def loss(self, params: np.ndarray, x: Any, y: np.ndarray) -> float:
        logits = self.logits(params, x)
        return float(self.loss_fn.loss_and_dout(logits, y, logits))

    def evaluate(self, params: np.ndarray, x: Any, y: np.ndarray,
                 batch_size: int = 1000) -> Evaluation:
        return self.loss_fn.evaluation(self.tally(params, x, y, batch_size))

    @property
    def figures_of(self) -> Loss:
        return self.loss_fn

    def tally(self, params: np.ndarray, x: Any, y: np.ndarray,
              batch_size: int = 1000) -> np.ndarray:
        """The loss's additive statistics over all of x, y (model.losses)."""
        return tally_batches(lambda xb: self.logits(params, xb), self.loss_fn, x, y,
                             batch_size)

    def describe(self) -> str:
        return "\n".join(f"{i:>3} {layer.describe()}" for i, layer in enumerate(self.layers))

    def __repr__(self) -> str:
        return (f"SparseNetwork({self.input_kind} input {self.input_shape}, "
                f"{len(self.layers)} layers, {self.layout.size} parameters)")


def tally_batches(logits: Any, loss_fn: Loss, x: Any, y: np.ndarray,
                  batch_size: int) -> np.ndarray:
    """`loss_fn`'s additive statistics over all of x, y, `logits(x_batch)` computed a batch
    of `batch_size` rows at a time (SparseNetwork's, or a row cache's: sparse_rows)."""
    total = evaluation_size(x, y, batch_size)
    tally = loss_fn.empty_tally()
    for start in range(0, total, batch_size):
        xb, yb = x[start:start + batch_size], y[start:start + batch_size]
        out = logits(xb)
        work = out.copy()  # the loss's gradient overwrites its input
        loss = loss_fn.loss_and_dout(work, yb, work)
        tally += loss_fn.tally(out, yb, loss * len(yb))
    return tally


def _uniform_from(seed: int, position: int, out: np.ndarray) -> None:
    """out = the float32 uniforms at positions [position, position + len(out)) of the
    stream PCG64(seed) draws (numpy draws two a 64-bit output, the low half first)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    rng.bit_generator.advance(position // 2)
    if position % 2:
        rng.random(1, dtype=DTYPE)
    rng.random(dtype=DTYPE, out=out)


def build_input_layer(input_kind: str, input_shape: tuple[int, ...], id_rows: tuple[int, ...],
                      spec: object, is_output: bool, loss: Loss) -> SparseInput:
    """The first layer of a sparse model from its [model] table, or a ConfigError naming
    the key."""
    if not isinstance(spec, Mapping) or spec.get("type") not in SPARSE_LAYER_KEYS:
        raise ConfigError(f"layer 0: a sparse model starts with a layer of type "
                          f"{' or '.join(map(repr, SPARSE_LAYER_KEYS))}")
    kind = spec["type"]
    where = f"layer 0 ({kind})"
    values = layer_values(where, spec, *SPARSE_LAYER_KEYS[kind])
    activation = values["activation"]
    check_activation(where, activation, is_output, loss.output_activation)
    width = values["units" if kind == "sparse_linear" else "dim"]
    if not _positive_int(width):
        raise ConfigError(f"{where}: key {'units' if kind == 'sparse_linear' else 'dim'!r} "
                          f"must be a positive integer, got {width!r}")
    if input_kind not in INPUT_KINDS:
        raise ConfigError(f"{where}: needs sparse features or id fields as input, but the "
                          f"data's features are dense (docs/sparse-models.md)")
    if kind == "sparse_linear":
        if input_kind != "sparse":
            raise ConfigError(f"{where}: needs sparse features (CSR rows), but the data has "
                              f"id fields; use an embedding layer")
        return Bag(kind, input_shape[0], int(width), activation)
    combine, rows = values["combine"], values["rows"]
    if combine not in COMBINES:
        raise ConfigError(f"{where}: key 'combine' must be one of "
                          f"{', '.join(map(repr, COMBINES))}, got {combine!r}")
    if rows is not None and not _positive_int(rows):
        raise ConfigError(f"{where}: key 'rows' must be a positive integer, got {rows!r}")
    if input_kind == "sparse":
        if combine not in ("sum", "mean") or rows is not None:
            raise ConfigError(f"{where}: over sparse features an embedding is one table of "
                              f"n_features rows whose rows are summed or averaged: set "
                              f"combine = \"sum\" or \"mean\", and no 'rows'")
        return Bag(kind, input_shape[0], int(width), activation, mean=combine == "mean")
    if combine == "dot" and input_shape[0] != 2:
        raise ConfigError(f"{where}: combine = \"dot\" takes two id fields (user, item), "
                          f"the data has {input_shape[0]}")
    if rows is None and len(id_rows) != input_shape[0]:
        raise ConfigError(f"{where}: the data gives no table size per field (id_rows); "
                          f"set 'rows'")
    tables = [int(rows)] * input_shape[0] if rows is not None else list(id_rows)
    return FieldEmbedding(tables, int(width), combine, activation, hashed=rows is not None)


def _positive_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 0
