"""A model of the user's own, and the one surface every trainer trains through.

A model is any object with

    init_params(rng) -> np.ndarray            the flat float32 parameter vector
    loss_and_grad(params, x, y) -> (loss, grad)   mean loss of the batch, its gradient
    predict(params, x) -> np.ndarray          the outputs, one row per input row

and, optionally, `name` and `version` (its identity in the config hash, so a resume with
another model is refused), `named_slices() -> [(name, shape), ...]` (the vector's parts,
in order, for checkpoints and the summary) and `evaluate(params, x, y) -> dict` with
"loss" and the score of the run's [model] loss ("accuracy", or "r2" for mse; its other
metrics, "rmse" or "auc", when it has them), else the loss is loss_and_grad's and the
metrics are the loss's (model.losses) of what predict returns: probabilities for
cross_entropy and binary_cross_entropy, values for mse. docs/your-own-model.md walks
through one.

`OwnModel` wraps such an object in what the trainers call (model.network.Network's
surface: `layout`, `init_params(seed)`, `init_slice`, `loss_and_grad(params, x, y, grad)`,
`evaluate`) and checks every answer: a call that raises, a gradient of the wrong size or
dtype, or a loss that is not finite is one ModelError naming the model and the call. The
shards never see the model, only the vector's length and layout.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np

from distbelief.errors import UserError
from distbelief.model.layout import DTYPE, ParamLayout
from distbelief.model.losses import CrossEntropy, Evaluation, Loss, predicted_classes

__all__ = ["ModelError", "OwnModel", "TrainableModel", "accuracy_of", "load_factory"]


@runtime_checkable
class TrainableModel(Protocol):
    """What distbelief.train takes as `model` (see the module's docstring)."""

    def init_params(self, rng: np.random.Generator) -> np.ndarray: ...

    def loss_and_grad(self, params: np.ndarray, x: np.ndarray,
                      y: np.ndarray) -> tuple[float, np.ndarray]: ...

    def predict(self, params: np.ndarray, x: np.ndarray) -> np.ndarray: ...


class ModelError(UserError):
    """A model of the user's own broke the protocol: raised, or answered wrongly."""


REQUIRED = ("init_params", "loss_and_grad", "predict")


def check_protocol(model: Any) -> None:
    """ModelError unless `model` has the protocol's methods."""
    missing = [name for name in REQUIRED if not callable(getattr(model, name, None))]
    if missing:
        raise ModelError(f"model {_name_of(model)}: no {', '.join(missing)} method; a model "
                         f"needs init_params(rng), loss_and_grad(params, x, y) and "
                         f"predict(params, x) (docs/your-own-model.md)")


def identity(model: Any, num_params: int) -> dict[str, Any]:
    """The model's identity for the config hash: its name, version and parameter count."""
    return {"name": _name_of(model), "version": str(getattr(model, "version", "1")),
            "parameters": int(num_params)}


def _name_of(model: Any) -> str:
    name = getattr(model, "name", None)
    if isinstance(name, str) and name:
        return name
    kind = type(model)
    return f"{kind.__module__}.{kind.__qualname__}"


class OwnModel:
    """A user's model behind the trainers' surface; every answer checked."""

    layers: tuple = ()  # no built-in layers: model parallelism and the cost model refuse

    def __init__(self, model: Any, input_shape: tuple[int, ...], num_classes: int,
                 seed: int = 0, loss: Loss | None = None, probe_y: np.ndarray | None = None):
        """`loss`: the run's [model] loss, whose metrics judge predict's outputs
        (cross_entropy over `num_classes` when None); `probe_y`: two rows of targets
        shaped as the data's (two zero labels when None)."""
        check_protocol(model)
        self.model = model
        self.name = _name_of(model)
        self.input_shape = tuple(int(d) for d in input_shape)
        self.num_classes = int(num_classes)
        self.loss_fn = CrossEntropy(self.num_classes) if loss is None else loss
        self._probe_y = np.zeros(2, dtype=np.int64) if probe_y is None else probe_y
        self._models_figures = _ModelsFigures(self.loss_fn)
        self.figures_of: Loss = self.loss_fn
        """What turns this model's tallies into figures: the loss, or _ModelsFigures when
        its own evaluate returns the score (tally sets it)."""
        self.seed = int(seed)
        self.step = 0  # the trainers set it on a resume (Network's dropout key); not read
        self.on_error: Callable[[str], None] | None = None
        """Called with the message instead of raising ModelError, once training runs on
        several ranks (algorithms.launch: abort the job in one line; an error raised on
        one replica would otherwise end that replica alone, taken for a lost one)."""
        first = self._vector(self._call("init_params", np.random.default_rng(seed)),
                             "init_params", None)
        self.layout = ParamLayout(self._slices(first.size))
        self._initial = (int(seed), first)
        self._probe(first)

    def _probe(self, params: np.ndarray) -> None:
        """One predict and one loss_and_grad on two zero rows: a model that does not fit
        the data's shape fails here, before anything is written, not at its first step."""
        x = np.zeros((2, *self.input_shape), dtype=DTYPE)
        self.logits(params, x)
        self.loss_and_grad(params, x, self._probe_y, np.empty(self.layout.size, dtype=DTYPE))
        self.tally(params, x, self._probe_y)  # fixes figures_of before any evaluation

    # -- parameters ----------------------------------------------------------------------

    def init_params(self, seed: int | np.random.Generator) -> np.ndarray:
        """A fresh vector, deterministic per seed (the model draws from default_rng(seed))."""
        if not isinstance(seed, np.random.Generator) and int(seed) == self._initial[0]:
            return self._initial[1].copy()
        rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
        return self._vector(self._call("init_params", rng), "init_params", self.layout.size)

    def init_slice(self, seed: int, start: int, stop: int) -> np.ndarray:
        """`init_params(seed)[start:stop]`: a shard's slice (the whole vector is drawn)."""
        return self.init_params(seed)[start:stop].copy()

    def _slices(self, size: int) -> list[tuple[int, str, tuple[int, ...]]]:
        named = getattr(self.model, "named_slices", None)
        if not callable(named):
            return [(0, "params", (size,))]
        slices = self._call("named_slices")
        try:
            arrays = [(i, str(name), tuple(int(d) for d in shape))
                      for i, (name, shape) in enumerate(slices)]
            layout = ParamLayout(arrays)
        except (TypeError, ValueError) as exc:
            raise ModelError(f"model {self.name}: named_slices() must list (name, shape) "
                             f"pairs: {exc}") from exc
        if layout.size != size:
            raise ModelError(f"model {self.name}: named_slices() cover {layout.size:,d} "
                             f"values, init_params returned {size:,d}")
        names = [name for _, name, _ in arrays]
        bad = sorted({n for n in names if names.count(n) > 1 or not n or "/" in n
                      or n.startswith("optimizer.")})
        if bad:
            raise ModelError(f"model {self.name}: named_slices() names {bad} more than "
                             f"once, or with a '/' or an 'optimizer.' prefix; each slice "
                             f"needs a name of its own (the exports' array names)")
        return arrays

    # -- training and evaluation ---------------------------------------------------------

    def loss_and_grad(self, params: np.ndarray, x: np.ndarray, y: np.ndarray,
                      grad: np.ndarray) -> float:
        """The model's mean loss of the batch; its gradient written into `grad`."""
        answer = self._call("loss_and_grad", params, x, y)
        if not isinstance(answer, tuple) or len(answer) != 2:
            raise self._fail(f"model {self.name}: loss_and_grad returned "
                             f"{type(answer).__name__}, not a (loss, grad) pair")
        loss = self._loss(answer[0], "loss_and_grad")
        np.copyto(grad, self._vector(answer[1], "loss_and_grad", self.layout.size))
        return loss

    def touched(self) -> None:
        """A model of your own's gradient may be non-zero anywhere (None: all of it)."""
        return

    def logits(self, params: np.ndarray, x: np.ndarray) -> np.ndarray:
        """The model's outputs for `x`, one row per input row."""
        out = np.asarray(self._call("predict", params, x))
        if out.ndim not in (1, 2) or out.shape[0] != len(x):
            raise self._fail(f"model {self.name}: predict returned shape {out.shape} for "
                             f"{len(x)} rows; it must return one row of outputs per input "
                             f"row, (rows, outputs) or (rows,)")
        return out

    def evaluate(self, params: np.ndarray, x: np.ndarray, y: np.ndarray,
                 batch_size: int = 1000) -> Evaluation:
        """The loss and its metrics over all of x, y, in batches of `batch_size`."""
        tally = self.tally(params, x, y, batch_size)
        return self.figures_of.evaluation(tally)

    def tally(self, params: np.ndarray, x: np.ndarray, y: np.ndarray,
              batch_size: int = 1000) -> np.ndarray:
        """Additive statistics of an evaluation (model.losses): the figures of the model's
        own evaluate weighted by rows, when it has one that returns the loss's score; else
        the loss (its evaluate's, or loss_and_grad's) with the loss's metrics of predict's
        outputs. `figures_of` turns the sum into figures."""
        from distbelief.model.network import evaluation_size

        evaluation_size(x, y, batch_size)  # a DataError for an empty or uneven set
        scratch = np.empty(self.layout.size, dtype=DTYPE)
        parts = []
        for start in range(0, len(y), batch_size):
            xb, yb = x[start:start + batch_size], y[start:start + batch_size]
            answer = self._answer(params, xb, yb, scratch)
            if self.loss_fn.score in answer:  # the model's figures, as they are
                self.figures_of = self._models_figures
                parts.append(self._models_figures.tally_of(answer, len(yb)))
            else:
                self.figures_of = self.loss_fn
                parts.append(self.loss_fn.tally(self.logits(params, xb), yb,
                                                answer["loss"] * len(yb), probabilities=True))
        return np.sum(parts, axis=0)

    def _answer(self, params: np.ndarray, x: np.ndarray, y: np.ndarray,
                scratch: np.ndarray) -> dict[str, float]:
        """The model's evaluate's figures, or {"loss": loss_and_grad's} without one."""
        if callable(getattr(self.model, "evaluate", None)):
            return self._metrics(self._call("evaluate", params, x, y))
        return {"loss": self.loss_and_grad(params, x, y, scratch)}

    def describe(self) -> str:
        return (f"  a model of your own: {self.name}, {self.layout.size:,d} parameters in "
                f"{len(self.layout.entries)} slice(s)")

    def __repr__(self) -> str:
        return f"OwnModel({self.name}, {self.layout.size} parameters)"

    # -- checks --------------------------------------------------------------------------

    def _fail(self, message: str) -> ModelError:
        """The error to raise for `message`, after on_error (which may end the job)."""
        if self.on_error is not None:
            self.on_error(message)
        return ModelError(message)

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self.model, method)(*args)
        except Exception as exc:  # the user's code: any error is theirs, named as such
            raise self._fail(f"model {self.name}: {method} raised {type(exc).__name__}: "
                             f"{exc}") from exc

    def _vector(self, value: Any, method: str, size: int | None) -> np.ndarray:
        what = "returned" if method == "init_params" else "returned a gradient of"
        if not isinstance(value, np.ndarray) or value.dtype != DTYPE or value.ndim != 1:
            kind = (f"{value.dtype} of shape {value.shape}" if isinstance(value, np.ndarray)
                    else type(value).__name__)
            raise self._fail(f"model {self.name}: {method} {what} {kind}; it must be a "
                             f"flat float32 vector (np.float32, one dimension)")
        if size is not None and value.size != size:
            raise self._fail(f"model {self.name}: {method} {what} {value.size:,d} values; "
                             f"the model has {size:,d} parameters")
        if value.size == 0:
            raise self._fail(f"model {self.name}: {method} returned an empty vector")
        if not np.isfinite(value).all():
            raise self._fail(f"model {self.name}: {method} {what} NaN or infinite values "
                             f"(a bug in the model, or training diverged: a learning rate "
                             f"too high)")
        return value

    def _loss(self, value: Any, method: str) -> float:
        try:
            loss = float(value)
        except (TypeError, ValueError):
            raise self._fail(f"model {self.name}: {method} returned a loss of type "
                             f"{type(value).__name__}, not a number") from None
        if not math.isfinite(loss):
            raise self._fail(f"model {self.name}: {method} returned the loss {loss} (a "
                             f"bug in the model, or training diverged: a learning rate too "
                             f"high)")
        return loss

    def _metrics(self, value: Any) -> dict[str, float]:
        score = self.loss_fn.score
        if not isinstance(value, dict) or "loss" not in value:
            raise self._fail(f"model {self.name}: evaluate must return a dict with 'loss' "
                             f"(and {score!r}, the score of model.loss = "
                             f"{self.loss_fn.name!r}, else it is computed from predict), "
                             f"got {value!r:.80}")
        figures = {"loss": self._loss(value["loss"], "evaluate")}
        if score not in value:
            return figures
        for name in self.loss_fn.metrics:
            try:
                figures[name] = float(value.get(name, math.nan))
            except (TypeError, ValueError):
                raise self._fail(f"model {self.name}: evaluate returned {name} = "
                                 f"{value[name]!r:.40}, not a number") from None
        accuracy = figures.get("accuracy", 0.0)
        if not 0.0 <= accuracy <= 1.0:
            raise self._fail(f"model {self.name}: evaluate returned the accuracy "
                             f"{accuracy}; it must be a share of rows, 0 to 1")
        return figures


class _ModelsFigures(Loss):
    """A model's own evaluate: its figures (the loss and `loss`'s metrics) averaged over
    the rows of the batches it was given. A figure it does not return is NaN."""

    def __init__(self, loss: Loss):
        super().__init__(loss.width)
        self.score, self.metrics = loss.score, loss.metrics
        self.names = ("loss", *loss.metrics)

    def tally_of(self, figures: dict[str, float], rows: int) -> np.ndarray:
        return np.array([rows, *(figures[name] * rows for name in self.names)],
                        dtype=np.float64)

    def tally_size(self) -> int:
        return 1 + len(self.names)

    def figures(self, tally: np.ndarray) -> dict[str, float]:
        return dict(zip(self.names, tally[1:] / tally[0]))


def accuracy_of(outputs: np.ndarray, y: np.ndarray) -> float:
    """The share of rows whose predicted class (losses.predicted_classes) is the row's
    integer label."""
    return float(np.count_nonzero(predicted_classes(outputs) == y)) / len(y)


def load_factory(spec: str) -> Any:
    """`module:factory` (train --model): import the module, call factory(), return what it
    returns. ModelError naming the spec when any step fails."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ModelError(f"--model {spec!r}: expected MODULE:FACTORY, e.g. "
                         f"my_models:logistic (FACTORY() returns the model)")
    if os.getcwd() not in sys.path:  # the `distbelief` script does not put it there
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ModelError(f"--model {spec}: cannot import {module_name} "
                         f"({type(exc).__name__}: {exc}); the module must be importable "
                         f"from the current folder or PYTHONPATH") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelError(f"--model {spec}: {module_name} has no callable {attr}")
    try:
        return factory()
    except Exception as exc:
        raise ModelError(f"--model {spec}: {attr}() raised {type(exc).__name__}: "
                         f"{exc}") from exc
