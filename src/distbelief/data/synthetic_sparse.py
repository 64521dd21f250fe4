"""Synthetic sparse datasets with a planted model, one for each sparse workload of issue 44
(`distbelief prepare sparse-synthetic KIND`; docs/sparse-models.md):

- `logistic`: CSR rows of about `nnz` distinct feature ids each, Zipf-distributed (a few ids
  very common, most rare: the shape of RCV1 and click logs), values 1 scaled to a unit L2
  norm per row; y ~ Bernoulli(sigmoid(x.w + b)) for a planted weight per feature and bias.
- `mf`: (user, item) id pairs, both Zipf-distributed; y = U[user].V[item] + noise for
  planted factors U, V.
- `fields`: one Zipf id per field; the fields' planted embeddings, concatenated, go through
  a planted tanh layer to one logit; y ~ Bernoulli(sigmoid(logit)).

The data is synthetic, and each file says so in its `source` attribute, with the planted
model's own loss on the test split: the floor a learner can reach (the log-loss of the
true probabilities; for `mf`, about noise**2). The planted model is stored in the file, as
datasets of the group /planted (readers ignore it): `weights`, `bias` (logistic);
`users`, `items` (mf); `embedding_<f>` for each field, `hidden_weights`, `hidden_bias`,
`output_weights`, `output_bias` (fields).

Ids are drawn by rank from a Zipf law (probability of rank r proportional to
(r + 1)**-zipf) and the ranks are spread over the table by a seeded permutation, so the
common ids are not all at its start. Rows are generated in blocks, each from its own
generator keyed by (seed, split, block), and written through DatasetWriter as they come:
memory is bounded whatever the row count, and the same options give the same file.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from distbelief.data.features import id_dtype
from distbelief.data.hdf5 import DatasetInfo, DatasetWriter
from distbelief.data.sparse import SparseRows
from distbelief.errors import DataError

KINDS = ("logistic", "mf", "fields")
BLOCK_DRAWS = 1 << 21
"""Ids drawn per block of rows: bounded memory."""
LOGISTIC_WEIGHT_SCALE = 3.0
"""Planted weights ~ N(0, scale**2): on unit-norm rows the logit's spread is about this,
far from a coin flip and far from certain."""
FIELDS_OUTPUT_SCALE = 4.0
_SPLIT_STREAMS = {"train": 1, "test": 2}


@dataclass(frozen=True)
class Options:
    """Every kind's options (each kind reads its own; `distbelief prepare sparse-synthetic
    --help` lists them)."""

    train: int | None = None
    test: int | None = None
    features: int = 100_000
    nnz: int = 40
    users: int = 10_000
    items: int = 5_000
    rank: int = 8
    noise: float = 0.1
    fields: int = 8
    field_rows: int = 10_000
    dim: int = 4
    hidden: int = 16
    zipf: float = 1.1
    seed: int = 0


DEFAULT_ROWS = {"logistic": (50_000, 10_000), "mf": (200_000, 20_000),
                "fields": (100_000, 10_000)}
"""(train, test) rows by kind: a second or two to generate."""

KIND_OPTIONS = {"logistic": ("features", "nnz"), "mf": ("users", "items", "rank", "noise"),
                "fields": ("fields", "field_rows", "dim")}
"""Each kind's own options (Options' names; the command line's flags are these with -):
one kind ignores the others', so giving them is refused (kind_options)."""


@dataclass(frozen=True)
class Synthetic:
    """A written file and its planted model's floor: `floor` is its test loss (`loss`
    names it), `baseline` a constant predictor's on the same rows."""

    info: DatasetInfo
    loss: str
    floor: float
    baseline: float

    def describe(self) -> str:
        return _floor_text(self.loss, self.floor, self.baseline)

    def summary(self) -> str:
        """'<path>: N training and M test rows (<shape>); <floor>', said of a made file."""
        info = self.info
        shape = (f"{info.input_shape[0]:,d} feature ids, {info.nnz_per_row:.1f} a row"
                 if info.features == "sparse" else
                 f"{len(info.id_rows)} id fields of {_table_sizes(info.id_rows)}")
        return (f"{info.path}: {info.n_train:,d} training and {info.n_test:,d} test rows "
                f"({shape}); {self.describe()}")


def _table_sizes(id_rows: tuple[int, ...]) -> str:
    """'10,000 rows each', or '10,000, 5,000 rows' for tables of different sizes."""
    if len(set(id_rows)) == 1:
        return f"{id_rows[0]:,d} rows each"
    return f"{', '.join(f'{r:,d}' for r in id_rows)} rows"


def _floor_text(loss: str, floor: float, baseline: float) -> str:
    return (f"the planted model's test {loss} is {floor:.4f} (the floor; a constant "
            f"predictor's: {baseline:.4f})")


class Zipf:
    """Ids of a table of `rows` rows: rank r drawn with probability proportional to
    (r + 1)**-exponent, ranks spread over the ids by a seeded permutation."""

    def __init__(self, rows: int, exponent: float, rng: np.random.Generator):
        cdf = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -exponent)
        self.cdf = cdf / cdf[-1]
        self.ids = rng.permutation(rows)

    def draw(self, rng: np.random.Generator, size: tuple[int, ...]) -> np.ndarray:
        ranks = np.searchsorted(self.cdf, rng.random(size), side="right")
        return self.ids[np.minimum(ranks, len(self.ids) - 1)]


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key))


def _blocks(seed: int, split: str, rows: int,
            block_rows: int) -> Iterator[tuple[np.random.Generator, int]]:
    """(generator, rows) of each block of a split: the generator keyed by the block."""
    for block, start in enumerate(range(0, rows, block_rows)):
        yield _rng(seed, _SPLIT_STREAMS[split], block), min(block_rows, rows - start)


@dataclass
class _Plan:
    """What a kind's generator gives the writer: the file's x, a block of rows from a
    generator (`rows(rng, n, split)`, which also tallies the planted model's test loss),
    the source text, the planted arrays, and the floor once the test rows are made."""

    features: str
    input_shape: tuple[int, ...]
    stored: str
    id_rows: tuple[int, ...]
    rows: Callable[[np.random.Generator, int, str], tuple]
    block_rows: int
    source: str
    planted: dict[str, np.ndarray]
    floor: Callable[[], tuple[str, float, float]]
    """(loss name, the planted model's test loss, a constant predictor's)."""


class _Tally:
    """The planted model's summed test loss and the targets' sums, over the test blocks."""

    def __init__(self) -> None:
        self.loss = self.total = self.squares = 0.0
        self.rows = 0

    def add(self, loss: float, y: np.ndarray) -> None:
        self.loss += loss
        self.total += float(y.sum())
        self.squares += float(np.sum(np.square(y, dtype=np.float64)))
        self.rows += len(y)

    def binary(self) -> tuple[str, float, float]:
        """log-loss: the planted model's mean, and the base rate's entropy."""
        rate = min(max(self.total / self.rows, 1e-12), 1 - 1e-12)
        constant = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
        return "log-loss", self.loss / self.rows, constant

    def squared(self) -> tuple[str, float, float]:
        """mse: the planted model's mean, and the targets' variance (predicting the mean)."""
        mean = self.total / self.rows
        return "mse", self.loss / self.rows, self.squares / self.rows - mean**2


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def _log_loss(p: np.ndarray, y: np.ndarray) -> float:
    """Summed binary log-loss of probabilities p for 0/1 targets y."""
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return float(-np.sum(y * np.log(p) + (1 - y) * np.log1p(-p)))


# -- logistic --------------------------------------------------------------------------------


def distinct_rows(draws: np.ndarray, k: int, n_features: int) -> SparseRows:
    """Rows of at most `k` distinct ids each, the first `k` distinct ones of each row of
    `draws` (drawing without repeats), sorted; values 1 scaled to a unit L2 norm."""
    order = np.argsort(draws, axis=1, kind="stable")  # stable: a first draw stays first
    ranked = np.take_along_axis(draws, order, axis=1)
    repeat_ranked = np.zeros(draws.shape, dtype=bool)
    repeat_ranked[:, 1:] = ranked[:, 1:] == ranked[:, :-1]
    repeat = np.empty_like(repeat_ranked)
    np.put_along_axis(repeat, order, repeat_ranked, axis=1)
    keep = ~repeat & (np.cumsum(~repeat, axis=1) <= k)
    lengths = keep.sum(axis=1)
    ids = np.sort(np.where(keep, draws, np.iinfo(np.int64).max), axis=1)
    ids = ids[np.arange(draws.shape[1]) < lengths[:, None]]
    indptr = np.zeros(len(draws) + 1, np.int64)
    np.cumsum(lengths, out=indptr[1:])
    values = np.repeat(1.0 / np.sqrt(np.maximum(lengths, 1)), lengths)
    return SparseRows.from_arrays(indptr, ids, values, n_features)


def _logistic(o: Options) -> _Plan:
    if o.nnz > o.features:
        raise DataError(f"--nnz {o.nnz} is more than --features {o.features}: a row holds "
                        f"distinct ids")
    planted = _rng(o.seed, 0)
    ids = Zipf(o.features, o.zipf, planted)
    weights = planted.normal(0.0, LOGISTIC_WEIGHT_SCALE, o.features)
    bias = float(planted.normal(0.0, 0.5))
    draws = min(2 * o.nnz, o.features)
    tally = _Tally()

    def rows(rng: np.random.Generator, n: int, split: str) -> tuple[SparseRows, np.ndarray]:
        x = distinct_rows(ids.draw(rng, (n, draws)), o.nnz, o.features)
        row = np.repeat(np.arange(n), np.diff(x.indptr))
        p = _sigmoid(np.bincount(row, weights=weights[x.indices] * x.values, minlength=n)
                     + bias)
        y = (rng.random(n) < p).astype(np.float32)
        if split == "test":
            tally.add(_log_loss(p, y), y)
        return x, y

    source = (f"synthetic (distbelief prepare sparse-synthetic logistic, seed {o.seed}): "
              f"{o.features:,d} feature ids, about {o.nnz} distinct a row drawn from a Zipf "
              f"law of exponent {o.zipf:g}, values 1 scaled to unit L2 norm per row; a "
              f"planted weight per feature ~ N(0, {LOGISTIC_WEIGHT_SCALE:g}**2) and bias "
              f"{bias:.4f} (/planted/weights, /planted/bias); y ~ Bernoulli(sigmoid(x.w + b)) "
              f"as values 0/1")
    return _Plan("sparse", (o.features,), "float32", (), rows, max(1, BLOCK_DRAWS // draws),
                 source, {"weights": weights.astype(np.float32), "bias": np.float32(bias)},
                 tally.binary)


# -- matrix factorisation --------------------------------------------------------------------


def _mf(o: Options) -> _Plan:
    planted = _rng(o.seed, 0)
    users, items = Zipf(o.users, o.zipf, planted), Zipf(o.items, o.zipf, planted)
    scale = o.rank ** -0.25  # U[u].V[i] then has variance 1
    u_factors = planted.normal(0.0, scale, (o.users, o.rank))
    v_factors = planted.normal(0.0, scale, (o.items, o.rank))
    tally = _Tally()

    def rows(rng: np.random.Generator, n: int, split: str) -> tuple[np.ndarray, np.ndarray]:
        x = np.stack([users.draw(rng, (n,)), items.draw(rng, (n,))], axis=1)
        clean = np.einsum("ij,ij->i", u_factors[x[:, 0]], v_factors[x[:, 1]])
        y = (clean + o.noise * rng.standard_normal(n)).astype(np.float32)
        if split == "test":
            tally.add(float(np.sum((y - clean) ** 2)), y)
        return x, y

    source = (f"synthetic (distbelief prepare sparse-synthetic mf, seed {o.seed}): "
              f"(user, item) ids of {o.users:,d} users and {o.items:,d} items, each drawn "
              f"from a Zipf law of exponent {o.zipf:g}; planted factors U, V of rank "
              f"{o.rank} ~ N(0, {scale:.4f}**2) (/planted/users, /planted/items); "
              f"y = U[user].V[item] + N(0, {o.noise:g}**2) as values")
    return _Plan("ids", (2,), id_dtype((o.users, o.items)), (o.users, o.items), rows,
                 max(1, BLOCK_DRAWS // 2), source,
                 {"users": u_factors.astype(np.float32), "items": v_factors.astype(np.float32)},
                 tally.squared)


# -- embeddings feeding a tower ---------------------------------------------------------------


def _fields(o: Options) -> _Plan:
    planted = _rng(o.seed, 0)
    tables = [Zipf(o.field_rows, o.zipf, planted) for _ in range(o.fields)]
    embeddings = [planted.standard_normal((o.field_rows, o.dim)) for _ in range(o.fields)]
    width = o.fields * o.dim
    w1 = planted.normal(0.0, 1.0 / math.sqrt(width), (width, o.hidden))
    b1 = planted.normal(0.0, 0.1, o.hidden)
    w2 = planted.normal(0.0, FIELDS_OUTPUT_SCALE / math.sqrt(o.hidden), o.hidden)
    b2 = float(planted.normal(0.0, 0.5))
    tally = _Tally()

    def rows(rng: np.random.Generator, n: int, split: str) -> tuple[np.ndarray, np.ndarray]:
        x = np.stack([table.draw(rng, (n,)) for table in tables], axis=1)
        concat = np.concatenate([e[x[:, f]] for f, e in enumerate(embeddings)], axis=1)
        p = _sigmoid(np.tanh(concat @ w1 + b1) @ w2 + b2)
        y = (rng.random(n) < p).astype(np.float32)
        if split == "test":
            tally.add(_log_loss(p, y), y)
        return x, y

    id_rows = (o.field_rows,) * o.fields
    source = (f"synthetic (distbelief prepare sparse-synthetic fields, seed {o.seed}): "
              f"{o.fields} id fields of {o.field_rows:,d} rows each, ids drawn from a Zipf "
              f"law of exponent {o.zipf:g}; planted embeddings of dim {o.dim} per field "
              f"(/planted/embedding_<f>), concatenated, through a planted tanh layer of "
              f"{o.hidden} units to one logit (/planted/hidden_weights, hidden_bias, "
              f"output_weights, output_bias); y ~ Bernoulli(sigmoid(logit)) as values 0/1")
    arrays = {f"embedding_{f}": e.astype(np.float32) for f, e in enumerate(embeddings)}
    arrays |= {"hidden_weights": w1.astype(np.float32), "hidden_bias": b1.astype(np.float32),
               "output_weights": w2.astype(np.float32), "output_bias": np.float32(b2)}
    return _Plan("ids", (o.fields,), id_dtype(id_rows), id_rows, rows,
                 max(1, BLOCK_DRAWS // (o.fields * o.dim)), source, arrays, tally.binary)


# -- writing ---------------------------------------------------------------------------------


def _write(out: Path, plan: _Plan, seed: int, train: int, test: int) -> Synthetic:
    """The file: each split's blocks appended, the planted arrays under /planted, and the
    floor (known once the test rows are made) added to `source` before the commit."""
    with DatasetWriter(out, input_shape=plan.input_shape, n_train=train, n_test=test,
                       stored_dtype=plan.stored, scale=1.0, source=plan.source,
                       targets="values", features=plan.features,
                       id_rows=plan.id_rows) as writer:
        for split, n in (("train", train), ("test", test)):
            for rng, count in _blocks(seed, split, n, plan.block_rows):
                writer.append(split, *plan.rows(rng, count, split))
        for name, values in plan.planted.items():
            writer.write_array(name, values)
        loss, floor, baseline = plan.floor()
        writer.set_source(f"{plan.source}. Floor: {_floor_text(loss, floor, baseline)}")
        return Synthetic(writer.commit(), loss, floor, baseline)


GENERATORS: dict[str, Callable[[Options], _Plan]] = {
    "logistic": _logistic, "mf": _mf, "fields": _fields}


def make_sparse_synthetic(kind: str, out_path: str | os.PathLike,
                          options: Options | None = None) -> Synthetic:
    """Write the synthetic `kind` dataset ("logistic", "mf" or "fields") at `out_path`
    (atomically; never over an existing file) and return it with its planted floor, which
    the file's `source` attribute also states."""
    out = Path(out_path)
    _known(kind)
    if out.exists():
        raise DataError(f"{out} exists: distbelief never overwrites a dataset; remove it or "
                        "choose another --out")
    o = _checked(options or Options())
    train, test = (o.train or DEFAULT_ROWS[kind][0]), (o.test or DEFAULT_ROWS[kind][1])
    return _write(out, GENERATORS[kind](o), o.seed, train, test)


def _known(kind: str) -> None:
    if kind not in GENERATORS:
        raise DataError(f"unknown synthetic kind {kind!r}: one of {', '.join(KINDS)}")


def kind_options(kind: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """The kind-specific options given in `values` (those of KIND_OPTIONS not None; other
    keys are left alone), all `kind`'s own; DataError naming the flags of another kind's,
    which `kind` would silently ignore."""
    _known(kind)
    given = {name: values[name] for names in KIND_OPTIONS.values() for name in names
             if values.get(name) is not None}
    foreign = sorted(set(given) - set(KIND_OPTIONS[kind]))
    if foreign:
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in foreign)
        raise DataError(f"{flags}: not an option of {kind} (distbelief prepare "
                        f"sparse-synthetic --help lists each kind's)")
    return given


def _checked(o: Options) -> Options:
    """The options, each a positive whole number (noise, zipf: a number >= 0, > 0)."""
    for name in ("train", "test", "features", "nnz", "users", "items", "rank", "fields",
                 "field_rows", "dim", "hidden"):
        value = getattr(o, name)
        if value is not None and (isinstance(value, bool) or not isinstance(
                value, (int, np.integer)) or value < 1):
            raise DataError(f"sparse-synthetic: {name} must be a positive whole number, got "
                            f"{value!r}")
    if not (np.isfinite(o.noise) and o.noise >= 0):
        raise DataError(f"sparse-synthetic: noise must be a number >= 0, got {o.noise!r}")
    if not (np.isfinite(o.zipf) and o.zipf > 0):
        raise DataError(f"sparse-synthetic: zipf must be a positive number, got {o.zipf!r}")
    if isinstance(o.seed, bool) or not isinstance(o.seed, (int, np.integer)) or o.seed < 0:
        raise DataError(f"sparse-synthetic: seed must be a whole number >= 0, got {o.seed!r}")
    return o
