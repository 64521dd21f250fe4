"""The losses a model trains with, and the figures an evaluation judges it by.

    cross_entropy         softmax over classes, integer labels; metrics accuracy
    mse                   values of any width (regression); metrics rmse and r2
    binary_cross_entropy  one or more sigmoid outputs against 0/1 targets (binary and
                          multi-label); metrics accuracy (of every output at 0.5) and auc

Each loss has a **score**: the metric a run is judged by (the best model kept, the
report's column, the default target, the collapse of a run), higher is better: accuracy,
or r2 for mse. Its other metrics are recorded beside it.

An evaluation is first a tally: a float64 vector of additive statistics (rows, the loss's sum, hits, per-output
sums, AUC histograms) that batches, blocks of a file and ranks add before the figures are
computed once (`Loss.evaluation`), so a figure over many pieces is the figure of the whole.
AUC is read from histograms of the logit (AUC_BINS bins over [-AUC_LOGIT, AUC_LOGIT]), in
which two outputs that share a bin count as a tie: exact to within the share of pairs that
are that close.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from distbelief.errors import ConfigError, DataError
from distbelief.model import kernels
from distbelief.model.layout import DTYPE

AUC_BINS = 1024
AUC_LOGIT = 16.0
SCORES = ("accuracy", "r2")
"""Every loss's score is one of these (records name an evaluation's score key by it)."""


def predicted_classes(outputs: np.ndarray) -> np.ndarray:
    """Each row's class: its largest output, or with one output a row whether it is above
    0.5 (a binary model's probability of class 1)."""
    return outputs > 0.5 if outputs.ndim == 1 else outputs.argmax(axis=1)


@dataclass(frozen=True)
class Evaluation:
    """The figures of one evaluation: `figures` has "loss", the score and the loss's other
    metrics, by name; `rows` is how many rows it is over."""

    score_name: str
    figures: dict[str, float]
    rows: int

    @property
    def loss(self) -> float:
        return self.figures["loss"]

    @property
    def score(self) -> float:
        """The loss's score (higher is better): accuracy, or r2."""
        return self.figures[self.score_name]


class Loss:
    """What every loss has; see the module's docstring."""

    name = "loss"
    score = "accuracy"
    metrics: tuple[str, ...] = ()
    """Everything an evaluation reports besides the loss, the score first."""
    output_activation = "linear"
    """The activation the config's output layer names (the loss applies it itself)."""
    targets = "values"
    """What the data's y holds: "classes" (integer labels) or "values" (floats)."""

    def __init__(self, width: int):
        self.width = int(width)

    def loss_and_dout(self, logits: np.ndarray, y: np.ndarray, dout: np.ndarray) -> float:
        """Mean loss of the batch; its gradient w.r.t. the logits into `dout` (may be
        `logits`)."""
        raise NotImplementedError

    def tally(self, outputs: np.ndarray, y: np.ndarray, loss_sum: float,
              probabilities: bool = False) -> np.ndarray:
        """The additive statistics of one batch: its `outputs` (the network's logits, or
        with `probabilities` what a model's predict returned) against `y`, and the sum of
        its rows' losses."""
        raise NotImplementedError

    def figures(self, tally: np.ndarray) -> dict[str, float]:
        """{"loss": ..., score: ..., other metrics} of a summed tally."""
        raise NotImplementedError

    def evaluation(self, tally: np.ndarray) -> Evaluation:
        """The Evaluation of a summed tally (rows > 0)."""
        figures = {name: float(value) for name, value in self.figures(tally).items()}
        return Evaluation(self.score, figures, int(tally[0]))

    def empty_tally(self) -> np.ndarray:
        return np.zeros(self.tally_size(), dtype=np.float64)

    def tally_size(self) -> int:
        raise NotImplementedError

    def check_targets(self, y: Any, rows: int) -> np.ndarray:
        """`y` as the loss reads it, or a DataError saying what it must be."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(width={self.width})"


class CrossEntropy(Loss):
    name = "cross_entropy"
    metrics = ("accuracy",)
    output_activation = "softmax"
    targets = "classes"

    def loss_and_dout(self, logits, y, dout):
        return kernels.softmax_cross_entropy(logits, self.check_targets(y, len(logits)), dout)

    def tally(self, outputs, y, loss_sum, probabilities=False):
        labels = self.check_targets(y, len(outputs))
        hits = np.count_nonzero(predicted_classes(outputs) == labels)
        return np.array([len(labels), loss_sum, hits],
                        dtype=np.float64)

    def tally_size(self):
        return 3

    def figures(self, tally):
        rows, loss_sum, hits = tally
        return {"loss": loss_sum / rows, "accuracy": hits / rows}

    def check_targets(self, y, rows):
        y = np.asarray(y)
        if y.shape != (rows,) or not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"labels must be integers of shape ({rows},), got {y.dtype} "
                            f"{y.shape} (cross_entropy trains on class labels; "
                            f"[model] loss = \"mse\" or \"binary_cross_entropy\" on values)")
        return y


class MeanSquaredError(Loss):
    name = "mse"
    score = "r2"
    metrics = ("r2", "rmse")

    def loss_and_dout(self, logits, y, dout):
        return kernels.squared_error(logits, self.check_targets(y, len(logits)), dout)

    def tally(self, outputs, y, loss_sum, probabilities=False):
        targets = self.check_targets(y, len(outputs)).astype(np.float64)
        errors = np.asarray(outputs, dtype=np.float64).reshape(targets.shape) - targets
        return np.concatenate([[len(targets), loss_sum], targets.sum(axis=0),
                               (targets ** 2).sum(axis=0), (errors ** 2).sum(axis=0)])

    def tally_size(self):
        return 2 + 3 * self.width

    def figures(self, tally):
        rows, loss_sum = tally[:2]
        y_sum, y_squares, errors = tally[2:].reshape(3, self.width)
        variance = y_squares - y_sum ** 2 / rows  # the sum of squares about the mean
        varied = variance > 1e-12 * np.maximum(y_squares, 1.0)
        r2 = (float(np.mean(1.0 - errors[varied] / variance[varied])) if varied.any()
              else math.nan)  # every target constant: r2 is undefined
        return {"loss": loss_sum / rows, "r2": r2,
                "rmse": math.sqrt(errors.sum() / (rows * self.width))}

    def check_targets(self, y, rows):
        return _values(y, rows, self.width, self.name)


class BinaryCrossEntropy(Loss):
    name = "binary_cross_entropy"
    metrics = ("accuracy", "auc")
    output_activation = "sigmoid"

    def loss_and_dout(self, logits, y, dout):
        return kernels.sigmoid_binary_cross_entropy(logits, self.check_targets(y, len(logits)),
                                                    dout)

    def tally(self, outputs, y, loss_sum, probabilities=False):
        targets = self.check_targets(y, len(outputs))
        outputs = np.asarray(outputs, dtype=np.float64).reshape(targets.shape)
        if probabilities:  # the logit of p: the same order, the histograms' axis
            p = np.clip(outputs, 1e-12, 1 - 1e-12)
            outputs = np.log(p) - np.log1p(-p)
        positive = targets >= 0.5
        hits = np.count_nonzero((outputs > 0) == positive)
        bins = np.clip(((outputs + AUC_LOGIT) * (AUC_BINS / (2 * AUC_LOGIT))).astype(np.int64),
                       0, AUC_BINS - 1)
        column = np.broadcast_to(np.arange(self.width) * AUC_BINS, bins.shape)
        cells = (column + bins).ravel()
        size = self.width * AUC_BINS
        pos = np.bincount(cells[positive.ravel()], minlength=size)
        neg = np.bincount(cells[~positive.ravel()], minlength=size)
        return np.concatenate([[len(targets), loss_sum, hits], pos, neg]).astype(np.float64)

    def tally_size(self):
        return 3 + 2 * self.width * AUC_BINS

    def figures(self, tally):
        rows, loss_sum, hits = tally[:3]
        pos, neg = tally[3:].reshape(2, self.width, AUC_BINS)
        # P(positive's logit > negative's), ties (one bin) a half: per output, then the mean.
        below = np.cumsum(neg, axis=1) - neg
        pairs = pos.sum(axis=1) * neg.sum(axis=1)
        wins = (pos * (below + 0.5 * neg)).sum(axis=1)
        aucs = wins[pairs > 0] / pairs[pairs > 0]
        return {"loss": loss_sum / rows, "accuracy": hits / (rows * self.width),
                "auc": float(aucs.mean()) if aucs.size else math.nan}

    def check_targets(self, y, rows):
        y = np.asarray(y)
        if np.issubdtype(y.dtype, np.integer) and y.shape == (rows,) and self.width == 1:
            y = y.astype(DTYPE)  # class labels 0/1: one output
        targets = _values(y, rows, self.width, self.name)
        if targets.size and (targets.min() < 0 or targets.max() > 1):
            raise DataError(f"binary_cross_entropy needs targets in [0, 1], got values from "
                            f"{targets.min()} to {targets.max()}")
        return targets


def _values(y: Any, rows: int, width: int, loss: str) -> np.ndarray:
    """y as a C-contiguous float32 (rows, width) array: (rows,) is one output's."""
    y = np.asarray(y)
    if y.shape == (rows,) and width == 1:
        y = y.reshape(rows, 1)
    if y.shape != (rows, width) or not np.issubdtype(y.dtype, np.floating):
        raise DataError(f"{loss} needs float targets of shape ({rows}, {width}) (one per "
                        f"output), got {y.dtype} {y.shape}")
    return np.ascontiguousarray(y, dtype=DTYPE)


LOSSES: dict[str, type[Loss]] = {kind.name: kind for kind in
                                 (CrossEntropy, MeanSquaredError, BinaryCrossEntropy)}


def make_loss(name: str, width: int) -> Loss:
    """The loss `name` over `width` outputs, or a ConfigError listing the losses."""
    kind = LOSSES.get(name)
    if kind is None:
        raise ConfigError(f"model.loss must be one of {', '.join(map(repr, LOSSES))}, "
                          f"got {name!r}")
    return kind(width)


def loss_for_data(name: str, targets: str, num_classes: int, outputs: int) -> Loss:
    """The loss `name` for data whose y holds `targets` ("classes" or "values") with
    `outputs` outputs a row, or a ConfigError saying which loss the data needs."""
    kind = type(make_loss(name, outputs))  # a ConfigError listing them for another name
    if kind.targets == "classes" and targets != "classes":
        raise ConfigError(f"model.loss = {name!r} needs integer class labels, but the data's "
                          f"targets are float values; set model.loss = \"mse\" (regression) "
                          f"or \"binary_cross_entropy\" (0/1 targets)")
    if kind is MeanSquaredError and targets == "classes":
        raise ConfigError("model.loss = 'mse' needs float targets, but the data holds class "
                          "labels; write the targets as floats (data/README.md)")
    if kind is BinaryCrossEntropy and targets == "classes":
        if num_classes != 2:
            raise ConfigError(f"model.loss = 'binary_cross_entropy' on class labels needs "
                              f"two classes (0 and 1), the data has {num_classes}; use "
                              f"cross_entropy, or write 0/1 float targets per output")
        return kind(1)
    return kind(outputs)
