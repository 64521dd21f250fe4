"""The public Python API: a trained model in a notebook or a script, without MPI.

    import distbelief
    model = distbelief.load_model("runs/fashion_mnist_mlp")  # run folder, checkpoint, export
    model = distbelief.load_model("runs/fashion_mnist_mlp", which="last")  # not the best
    probabilities = model.predict(x)      # x: the dataset file's stored array (uint8/float32)
    loss, accuracy = model.evaluate(x, y)  # and .figures: r2, rmse, auc, by the loss
    for name, array in model.named_parameters(): ...

These names are a contract that users' scripts rely on: `load_model`, `Model` (`predict`,
`evaluate`, `named_parameters`, `layers`, `input_shape`, `input_scale`, `num_classes`,
`source`) and `Evaluation` (`loss`, `accuracy`, unpacked as a pair). Change them only by
adding.
`evaluate_split` is `distbelief evaluate`'s: a split of a dataset file, scored.

Nothing below this module imports mpi4py: the model, data and records layers are MPI-free
(only model.partitioned_network and the ps, runtime and algorithms layers use MPI), so
`import distbelief` works on a login node. tests/test_export.py checks it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from distbelief.data.hdf5 import open_dataset, to_float, with_validation
from distbelief.data.sparse import SparseRows
from distbelief.errors import DataError
from distbelief.model.sparse_network import SparseNetwork
from distbelief.records.export import TrainedModel, read_trained
from distbelief.records.vectors import WholeScorer, evaluate_in_blocks

BATCH_SIZE = 1000
"""Rows per forward pass in predict and evaluate (the trainers' evaluation batch)."""
EVAL_BLOCK_BYTES = 64 << 20
"""evaluate_split reads this much of a split at a time."""


@dataclass(frozen=True)
class Evaluation:
    """A model's mean loss on a labelled set and its loss's metrics (model.losses):
    `accuracy` (None for mse), and in `figures` every one by name ("loss", "accuracy",
    "r2", "rmse", "auc": those the loss reports). Unpacks as (loss, accuracy)."""

    loss: float
    accuracy: float | None
    figures: dict[str, float] = field(default_factory=dict)

    def __iter__(self) -> Iterator[float | None]:
        return iter((self.loss, self.accuracy))


class Model:
    """A trained model: its layers, its weights and a forward pass. Not thread-safe."""

    def __init__(self, trained: TrainedModel):
        self._trained = trained
        self._network = trained.network()
        self._sparse = isinstance(self._network, SparseNetwork)
        self._named: dict[str, np.ndarray] | None = None
        if self._sparse:  # its tables stay stored: each batch reads its rows
            self._scorer = trained.scorer(self._network)
        else:
            self._params = np.ascontiguousarray(trained.params)
            self._scorer = WholeScorer(self._network, self._params)

    @property
    def layers(self) -> list[dict[str, Any]]:
        """The layer tables of the run's [model] section (a copy), e.g.
        {"type": "dense", "units": 512, "activation": "relu"}."""
        return [dict(layer) for layer in self._trained.layers]

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One input's shape: (H, W, C) for images, (F,) for flat features."""
        return self._trained.input_shape

    @property
    def input_scale(self) -> float:
        """The model reads x * input_scale (the dataset file's `scale`, 1/255 for images)."""
        return self._trained.input_scale

    @property
    def num_classes(self) -> int:
        return self._trained.num_classes

    @property
    def source(self) -> dict[str, Any]:
        """Where the weights came from: checkpoint path, step, samples, algorithm, ..."""
        return dict(self._trained.source)

    def named_parameters(self) -> Iterator[tuple[str, np.ndarray]]:
        """(name, array) per parameter array, in layer order: layers.<i>.weight and
        layers.<i>.bias, shaped as in an export (dense: PyTorch's nn.Linear). The arrays
        are the model's own: writing to them changes its predictions. A sparse model's
        tables are read whole here, on the first call (predict and evaluate read only
        their batches' rows until then, and the arrays from then on)."""
        if self._named is None:
            if self._sparse:
                self._params = np.ascontiguousarray(self._trained.params)
                self._scorer = WholeScorer(self._network, self._params)
            self._named = self._trained.named_arrays(self._network.layout, self._params)
        yield from self._named.items()

    def predict(self, x: np.ndarray, batch_size: int = BATCH_SIZE) -> np.ndarray:
        """Class probabilities, float32 (N, num_classes), for x (N, *input_shape) given as
        the dataset file stores it: uint8 or float32, scaled here by input_scale; each
        output's probability for binary_cross_entropy, the predicted values for mse. A
        model of your own: what its predict returns, as float32."""
        inputs = self._inputs(x)
        if self._trained.own is not None:
            step = _check_batch(batch_size)
            return np.concatenate([
                self._scorer.logits(inputs[start:start + step])
                for start in range(0, len(inputs), step)]).astype(np.float32, copy=False)
        out = np.empty((len(inputs), self.num_classes), dtype=np.float32)
        for start in range(0, len(inputs), _check_batch(batch_size)):
            logits = self._scorer.logits(inputs[start:start + batch_size])
            out[start:start + len(logits)] = _activate(logits, self._trained.loss)
        return out

    def evaluate(self, x: np.ndarray, y: np.ndarray,
                 batch_size: int = BATCH_SIZE) -> Evaluation:
        """Mean loss and accuracy on x (as for predict) and integer labels y (N,): the
        figures training reports as test_loss and test_accuracy."""
        tally = self._scorer.tally(self._inputs(x), np.asarray(y), _check_batch(batch_size))
        result = self._network.figures_of.evaluation(tally)
        return Evaluation(result.loss, result.figures.get("accuracy"), dict(result.figures))

    def _inputs(self, x: Any) -> Any:
        """x as the network's input: the same conversion training applies (float32 scaled
        for dense features; sparse rows as SparseRows, from any scipy.sparse matrix too;
        id fields as int64)."""
        if self._trained.features == "sparse":
            return _sparse_rows(x, self.input_shape[0])
        if self._trained.features == "ids":
            x = np.asarray(x)
            if not np.issubdtype(x.dtype, np.integer) or x.shape[1:] != self.input_shape:
                raise DataError(f"x must be integer ids of shape (N, {self.input_shape[0]}) "
                                f"(one per field), got {x.dtype} {x.shape}")
            return x.astype(np.int64, copy=False)
        x = np.asarray(x)
        if x.dtype not in (np.uint8, np.float32):
            raise DataError(f"x must be uint8 or float32, as a dataset file stores it (the "
                            f"model multiplies it by input_scale = {self.input_scale:g}); "
                            f"got {x.dtype}")
        if x.ndim < 1 or x.shape[1:] != self.input_shape or len(x) == 0:
            raise DataError(f"x has shape {x.shape}, the model needs (N > 0, "
                            f"{', '.join(map(str, self.input_shape))})")
        return to_float(x, self.input_scale)

    def __repr__(self) -> str:
        if self._trained.own is not None:
            return (f"Model(a model of your own: {self._trained.own['name']}; input "
                    f"{self.input_shape}, {self._network.layout.size:,d} parameters)")
        kinds = ", ".join(layer["type"] for layer in self._trained.layers)
        return (f"Model({len(self._trained.layers)} layers: {kinds}; input "
                f"{self.input_shape}, {self.num_classes} classes, "
                f"{self._network.layout.size:,d} parameters)")


def _sparse_rows(x: Any, n_features: int) -> SparseRows:
    """x (a SparseRows, or a scipy.sparse matrix) as SparseRows of n_features columns."""
    if not isinstance(x, SparseRows) and hasattr(x, "tocsr"):
        csr = x.tocsr()
        x = SparseRows.from_arrays(csr.indptr, csr.indices, csr.data, csr.shape[1])
    if not isinstance(x, SparseRows) or x.n_features != n_features or len(x) == 0:
        raise DataError(f"x must be sparse rows of {n_features} features (a "
                        f"distbelief.data.sparse.SparseRows or a scipy.sparse matrix), got "
                        f"{type(x).__name__} {getattr(x, 'shape', '')}")
    return x


def _check_batch(batch_size: int) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
            or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    return int(batch_size)


def load_model(path: str | Path, data: str | Path | None = None,
               which: str | None = None, model: Any = None) -> Model:
    """The trained model at `path`: a run folder (its best model, which run.keep_best
    kept, else its newest valid checkpoint; `which="best"` or `"last"` chooses, and
    `Model.source["which"]` says which it is), a checkpoint folder, or a file written by
    `distbelief export` (HDF5 or safetensors).

    A checkpoint takes its input shape and scale from the run's data file; `data` names
    another dataset file when that one has moved. Never starts MPI. A damaged or unknown
    file raises distbelief.errors.UserError with one line saying what is wrong; a damaged
    newer checkpoint of a run folder that was passed over is a warning (and in
    `Model.source["skipped"]`). A run of a model of your own (distbelief.model.protocol)
    needs that model: `model`, an object like the one trained; predict and evaluate call
    it.
    """
    trained = read_trained(path, data=data, which=which, model=model)
    for skipped in trained.source.get("skipped", []):
        warnings.warn(f"skipped a damaged checkpoint: {skipped}", stacklevel=2)
    return Model(trained)


def evaluate_split(path: str | Path, trained: TrainedModel, data: str | Path | None,
                   split: str) -> dict[str, Any]:
    """`distbelief evaluate`: the loss and accuracy of `trained` (read from `path`) on
    `split` ("test", "validation" or "train") of the dataset file `data`, by default the
    one it was trained on; with where the figures came from, as --json prints them."""
    file = data or trained.source.get("data")
    if file is None:
        raise DataError(f"{path} names no dataset file: give one with --data FILE")
    try:
        info = open_dataset(file)
    except DataError as exc:
        if data:
            raise
        raise DataError(f"{exc} (the data file the model was trained on); give another "
                        "with --data FILE") from exc
    if info.input_shape != trained.input_shape or info.outputs != trained.num_classes:
        raise DataError(f"{info.path} holds inputs {info.input_shape} with {info.outputs} "
                        f"{'classes' if info.targets == 'classes' else 'targets'} a row, the "
                        f"model takes {trained.input_shape} and has {trained.num_classes} "
                        f"outputs")
    if split == "validation":  # the run's held-out rows, or the file's /val
        info = with_validation(info, trained.source.get("validation") or 0.0)
    network = trained.network()
    # Read in blocks and scaled by the file's own scale, as in training; a sparse model's
    # tables a batch's rows at a time (records.vectors).
    result = evaluate_in_blocks(trained.scorer(network), info, split,
                                BATCH_SIZE, EVAL_BLOCK_BYTES)
    return {**result.figures, "score": result.score_name, "data": str(info.path),
            "split": split, "samples": result.rows, "model": str(path),
            "checkpoint": trained.source.get("path"), "step": trained.source.get("step"),
            "which": trained.source.get("which"),
            "kept_for": trained.source.get("evaluation")}


def _activate(logits: np.ndarray, loss: str) -> np.ndarray:
    """The network's outputs as predict returns them: softmax over classes for
    cross_entropy, each output's sigmoid for binary_cross_entropy, as they are for mse."""
    if loss == "mse":
        return logits
    if loss == "binary_cross_entropy":
        return 0.5 * (1.0 + np.tanh(0.5 * logits))  # sigmoid, without overflow
    logits -= logits.max(axis=1, keepdims=True)  # exp never overflows
    np.exp(logits, out=logits)
    logits /= logits.sum(axis=1, keepdims=True)
    return logits
