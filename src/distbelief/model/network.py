"""A feed-forward network over one flat float32 parameter vector: loss, gradient, logits.

`Network` turns the layer list of a configuration into `distbelief.model.layers` objects (checking
every key, so a bad model spec fails before training with a `ConfigError` naming the layer
and key), fixes the parameter layout, and runs forward and backward passes. Parameters and
gradients are views into caller-owned flat vectors (the parameter server's layout); work
buffers are cached and reused, so a training step allocates nothing.

Dropout masks are the one randomness of a step: drawn from (seed, step, layer), where
`seed` is the run's and `step` counts loss_and_grad calls, so the same network at the
same step draws the same masks (a resumed trainer sets `step`); evaluation draws none.

A Network is not thread-safe: its work buffers are shared by all calls.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from distbelief.errors import ConfigError, DataError
from distbelief.model.kernels import CONV_PADDINGS, POOL_MODES
from distbelief.model.layers import (
    ACTIVATIONS,
    LCN_FLOOR,
    NO_PARAMS,
    SAVED_DTYPE,
    Conv,
    Dense,
    Dropout,
    Layer,
    LayerNorm,
    Lcn,
    Local,
    Pool,
)
from distbelief.model.layout import DTYPE, ParamLayout
from distbelief.model.losses import LOSSES, CrossEntropy, Evaluation, Loss

# Per layer type: required keys, and optional keys with their defaults.
LAYER_KEYS: dict[str, tuple[tuple[str, ...], dict[str, object]]] = {
    "dense": (("type", "units", "activation"), {}),
    "local": (("type", "kernel", "channels", "activation"), {"stride": 1}),
    "pool": (("type", "mode", "kernel"), {"stride": None}),  # None: the kernel
    "lcn": (("type", "kernel"), {"floor": LCN_FLOOR}),
    "conv": (("type", "filters", "kernel", "activation"), {"stride": 1, "padding": "valid"}),
    "dropout": (("type", "rate"), {}),
    "layernorm": (("type",), {}),
}
IMAGE_LAYERS = ("local", "pool", "lcn", "conv")
DROPOUT_STREAM = 0x64726F70
"""The first word of a dropout mask's SeedSequence spawn key ("drop"), so that its
streams are none of the data order's (distbelief.data keys those on the run's seed too)."""


class Network:
    """A stack of layers (dense, local, conv, pool, lcn, dropout, layernorm) whose last
    layer's outputs go to a loss (model.losses: softmax cross-entropy by default)."""

    def __init__(self, input_shape: tuple[int, ...], layers: list[dict], num_classes: int,
                 seed: int = 0, loss: Loss | None = None):
        """Validate the spec and fix the layout. Cheap: allocates no parameters or buffers.
        `num_classes` is the output layer's width (the loss's, when one is given: the
        number of targets a row for mse and binary_cross_entropy). `seed` keys the dropout
        masks (the run's seed; init_params takes its own)."""
        self.input_shape = check_input_shape(input_shape)
        if loss is None:
            loss = CrossEntropy(check_num_classes(num_classes))
        elif loss.width != num_classes:
            raise ValueError(f"the loss has {loss.width} outputs, num_classes is {num_classes}")
        self.loss_fn = loss
        self.num_classes = loss.width
        self.layers: list[Layer] = build_layers(self.input_shape, layers, self.num_classes,
                                                loss)
        self.seed = int(seed)
        self.step = 0
        """The training step the next loss_and_grad is (counted by it): it keys the
        dropout masks with `seed`, so a trainer that resumes at step k sets it to k."""
        self.layout = ParamLayout([(i, name, shape)
                                   for i, layer in enumerate(self.layers)
                                   for name, shape in layer.param_shapes()])
        widths = [layer.out_size for layer in self.layers]
        self._outputs = _RowBuffers(widths)  # each layer's activations
        self._douts = _RowBuffers(widths)    # the loss gradient w.r.t. each layer's output
        # What each layer's training forward keeps for its backward (max pooling: argmax).
        # Apart from the activations, so evaluation's larger batches do not grow it.
        self._saved = _RowBuffers([layer.saved_per_output * layer.out_size
                                   for layer in self.layers], SAVED_DTYPE)
        # The last flat vector seen as params and as grad, with its per-layer views: trainers
        # pass the same arrays every step, and rebuilding the views cost ~2% of a step.
        self._view_cache: dict[str, tuple[np.ndarray, list]] = {}

    # -- parameters ----------------------------------------------------------------------

    def init_params(self, seed: int | np.random.Generator) -> np.ndarray:
        """A fresh flat float32 parameter vector (layout.size), deterministic per seed."""
        rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
        params = self.layout.empty()
        for layer, (weights, bias) in zip(self.layers, self._views(params, "params")):
            layer.init_params(rng, weights, bias)
        return params

    def init_slice(self, seed: int, start: int, stop: int) -> np.ndarray:
        """`init_params(seed)[start:stop]`, bit for bit, without building the whole vector:
        what a parameter-server shard needs for its slice (at 1.7B parameters the whole
        vector is 6.8 GB).

        init_params draws each layer's weights in turn from one PCG64 stream of float32
        values (numpy draws two per 64-bit output, the low half first, carrying the high
        half over to the next call), and sets biases to 0. So the value at stream position
        k is reached by advancing a fresh PCG64(seed) k // 2 outputs and, for odd k,
        drawing one value to discard; tests/test_memory.py checks the equality."""
        if not 0 <= start <= stop <= self.layout.size:
            raise ValueError(f"slice [{start}, {stop}) outside the {self.layout.size} "
                             f"parameters")
        out = np.zeros(stop - start, dtype=DTYPE)
        drawn = 0  # float32 values init_params draws before this layer's weights
        no_bias = np.zeros(0, dtype=DTYPE)
        for i, layer in enumerate(self.layers):
            if not layer.num_params:
                continue
            entry = self.layout.entry(i, "weights")
            lo, hi = max(start, entry.offset), min(stop, entry.stop)
            if not layer.random_init:  # fixed weights (layernorm's gain 1), none drawn
                if lo < hi:
                    layer.init_params(None, out[lo - start : hi - start], no_bias)
                continue
            if lo < hi:
                position = drawn + lo - entry.offset
                rng = np.random.Generator(np.random.PCG64(seed))
                rng.bit_generator.advance(position // 2)
                if position % 2:
                    rng.random(1, dtype=DTYPE)
                layer.init_params(rng, out[lo - start : hi - start], no_bias)
            drawn += entry.size
        return out

    def _views(self, flat: np.ndarray, what: str) -> list[tuple[np.ndarray, np.ndarray]]:
        """(weights, bias) views of `flat` for each layer; checks dtype, shape, contiguity."""
        cached = self._view_cache.get(what)
        # Holding the array in the cache keeps its id from being reused by another one.
        if cached is not None and cached[0] is flat:
            return cached[1]
        if (not isinstance(flat, np.ndarray) or flat.dtype != DTYPE
                or flat.shape != (self.layout.size,) or not flat.flags.c_contiguous):
            raise ValueError(f"{what} must be a contiguous float32 vector of "
                             f"{self.layout.size} elements, got "
                             f"{getattr(flat, 'dtype', type(flat))} {getattr(flat, 'shape', '')}")
        views = [(self.layout.view(flat, i, "weights"), self.layout.view(flat, i, "bias"))
                 if layer.num_params else (NO_PARAMS, NO_PARAMS)
                 for i, layer in enumerate(self.layers)]
        self._view_cache[what] = (flat, views)
        return views

    # -- forward and backward -------------------------------------------------------------

    def _flat_input(self, x: np.ndarray) -> np.ndarray:
        """x (N, *input_shape) float32 as a C-contiguous (N, input size) array."""
        if not isinstance(x, np.ndarray) or x.dtype != DTYPE:
            raise DataError(f"input must be a float32 array, got {getattr(x, 'dtype', type(x))}")
        if x.ndim < 1 or x.shape[1:] != self.input_shape or x.shape[0] == 0:
            raise DataError(f"input has shape {x.shape}, the model needs "
                            f"(N > 0, {', '.join(map(str, self.input_shape))})")
        return np.ascontiguousarray(x).reshape(x.shape[0], -1)

    def _forward(self, param_views: list, x: np.ndarray,
                 save: bool = False) -> tuple[np.ndarray, list, list]:
        """Run all layers; returns (flat input, each layer's output buffer, each layer's
        saved values for backward, or Nones unless `save`)."""
        inputs = self._flat_input(x)
        outputs = self._outputs.rows(inputs.shape[0])
        saved = (self._saved.rows(inputs.shape[0]) if save
                 else [None] * len(self.layers))
        h = inputs
        for i, (layer, (weights, bias), out, keep) in enumerate(zip(
                self.layers, param_views, outputs, saved)):
            if keep is not None and isinstance(layer, Dropout):
                layer.draw(self.dropout_rng(self.step, i), keep)
            layer.forward(h, weights, bias, out, keep)
            h = out
        return inputs, outputs, saved

    def dropout_rng(self, step: int, layer: int) -> np.random.Generator:
        """The generator of layer `layer`'s dropout draws at training step `step`."""
        return np.random.default_rng(np.random.SeedSequence(
            self.seed, spawn_key=(DROPOUT_STREAM, step, layer)))

    def loss_and_grad(self, params: np.ndarray, x: np.ndarray, y: np.ndarray,
                      grad: np.ndarray, dinput: np.ndarray | None = None) -> float:
        """Mean loss over the batch; writes the full flat gradient into `grad` in place,
        and the gradient with respect to x (N, input size) into `dinput` when given (a
        layer below this network, model.sparse_network's, needs it)."""
        param_views = self._views(params, "params")
        grad_views = self._views(grad, "grad")
        if np.may_share_memory(params, grad):
            raise ValueError("grad must not overlap params: backward reads the weights "
                             "after writing their gradient")
        inputs, outputs, saved = self._forward(param_views, x, save=True)
        douts = self._douts.rows(inputs.shape[0])
        loss = self.loss_fn.loss_and_dout(outputs[-1], y, douts[-1])
        for i in reversed(range(len(self.layers))):
            # The first layer's input gradient is rarely needed: skip that GEMM without dinput.
            below, dbelow = (outputs[i - 1], douts[i - 1]) if i > 0 else (inputs, dinput)
            (weights, _), (dweights, dbias) = param_views[i], grad_views[i]
            self.layers[i].backward(below, outputs[i], douts[i], weights, dweights, dbias,
                                    dbelow, saved[i])
        self.step += 1
        return float(loss)

    def touched(self) -> None:
        """Which coordinates a step's gradient may be non-zero at: all of them (None); a
        sparse model (model.sparse_network) names its batch's rows."""
        return

    def loss(self, params: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
        """Mean loss over the batch."""
        _, outputs, _ = self._forward(self._views(params, "params"), x)
        # The logits are not needed afterwards, so the loss gradient may overwrite them.
        return float(self.loss_fn.loss_and_dout(outputs[-1], y, outputs[-1]))

    def logits(self, params: np.ndarray, x: np.ndarray) -> np.ndarray:
        """The output layer's values before the loss's activation (softmax, sigmoid; none
        for mse), (N, num_classes), a new array."""
        _, outputs, _ = self._forward(self._views(params, "params"), x)
        return outputs[-1].copy()

    def evaluate(self, params: np.ndarray, x: np.ndarray, y: np.ndarray,
                 batch_size: int = 1000) -> Evaluation:
        """The loss and the loss's metrics over all of x, y, in batches of `batch_size`."""
        return self.loss_fn.evaluation(self.tally(params, x, y, batch_size))

    @property
    def figures_of(self) -> Loss:
        """What turns this network's tallies into figures: its loss."""
        return self.loss_fn

    def tally(self, params: np.ndarray, x: np.ndarray, y: np.ndarray,
              batch_size: int = 1000) -> np.ndarray:
        """The loss's additive statistics over all of x, y (model.losses): tallies of
        several pieces add up to the whole's."""
        total = evaluation_size(x, y, batch_size)
        param_views = self._views(params, "params")
        tally = self.loss_fn.empty_tally()
        for start in range(0, total, batch_size):
            xb, yb = x[start:start + batch_size], y[start:start + batch_size]
            _, outputs, _ = self._forward(param_views, xb)
            logits = outputs[-1].copy()  # the loss's gradient overwrites outputs[-1]
            loss = self.loss_fn.loss_and_dout(outputs[-1], yb, outputs[-1])
            tally += self.loss_fn.tally(logits, yb, loss * len(yb))
        return tally

    def describe(self) -> str:
        """One line per layer: index, type, output shape, parameter count, activation."""
        return "\n".join(f"{i:>3} {layer.describe()}" for i, layer in enumerate(self.layers))

    def __repr__(self) -> str:
        return (f"Network(input_shape={self.input_shape}, {len(self.layers)} layers, "
                f"{self.layout.size} parameters)")


class _RowBuffers:
    """Work arrays (rows, width), one per width, sliced to the batch size.

    One set serves every batch size: it grows to the largest batch seen, and a batch of n
    uses the first n rows (still C-contiguous), so alternating training and evaluation
    batches allocate nothing after the first of each.
    """

    def __init__(self, widths: list[int], dtype: type = DTYPE):
        self.widths = widths
        self.dtype = dtype
        self.capacity = 0
        self._arrays: list[np.ndarray] = []
        self._rows = 0
        self._views: list[np.ndarray] = []

    def rows(self, n: int) -> list[np.ndarray]:
        if n > self.capacity:
            self._arrays = [np.empty((n, w), dtype=self.dtype) for w in self.widths]
            self.capacity = n
            self._rows = 0
        if n != self._rows:
            self._views = [a[:n] for a in self._arrays]
            self._rows = n
        return self._views


# -- configuration checks --------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_input_shape(input_shape: Sequence[int]) -> tuple[int, ...]:
    try:
        shape = tuple(input_shape)
    except TypeError:
        raise ConfigError(f"input_shape must be (H, W, C) or (F,), got {input_shape!r}") from None
    if len(shape) not in (1, 3) or not all(_is_int(d) and d > 0 for d in shape):
        raise ConfigError(f"input_shape must be (H, W, C) or (F,) of positive integers, "
                          f"got {input_shape!r}")
    return tuple(int(d) for d in shape)


def check_num_classes(num_classes: int) -> int:
    if not _is_int(num_classes) or num_classes < 2:
        raise ConfigError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    return int(num_classes)


def build_layers(input_shape: tuple[int, ...], specs: list[dict], num_classes: int,
                 loss: Loss | None = None) -> list[Layer]:
    """Layer objects for the config's layer tables, or a ConfigError naming layer and key.
    The output layer's activation must be the loss's (softmax for cross_entropy); it
    computes the logits only, and the loss applies its activation."""
    output_activation = "softmax" if loss is None else loss.output_activation
    if not isinstance(specs, Sequence) or isinstance(specs, str) or len(specs) == 0:
        raise ConfigError("layers: need a non-empty list of layer tables")
    layers: list[Layer] = []
    shape = input_shape
    last = len(specs) - 1
    for index, spec in enumerate(specs):
        layer = _build_layer(index, spec, shape, index == last, output_activation)
        layers.append(layer)
        shape = layer.out_shape
    output = layers[-1]
    if output.out_size != num_classes:
        key = ("units" if isinstance(output, Dense)
               else "filters" if isinstance(output, Conv) else "channels")
        raise ConfigError(f"layer {last} ({output.kind}): the output layer has "
                          f"{output.out_size} outputs {output.out_shape} but num_classes is "
                          f"{num_classes}; set {key!r} so they match")
    output.kernel_activation = "linear"
    return layers


def _build_layer(index: int, spec: object, in_shape: tuple[int, ...],
                 is_output: bool, output_activation: str = "softmax") -> Layer:
    if not isinstance(spec, Mapping):
        raise ConfigError(f"layer {index}: must be a table like {{type = \"dense\", ...}}, "
                          f"got {spec!r}")
    kind = spec.get("type")
    if kind not in LAYER_KEYS:
        raise ConfigError(f"layer {index}: key 'type' must be one of "
                          f"{', '.join(map(repr, LAYER_KEYS))}, got {kind!r}")
    where = f"layer {index} ({kind})"
    values = layer_values(where, spec, *LAYER_KEYS[kind])
    if kind == "pool":
        return _build_pool(where, values, in_shape, index, is_output)
    if kind == "lcn":
        return _build_lcn(where, values, in_shape, index, is_output)
    if kind == "dropout":
        return _build_dropout(where, values, in_shape, is_output)
    if kind == "layernorm":
        _check_not_output(where, is_output)
        return LayerNorm(in_shape)

    activation = values["activation"]
    check_activation(where, activation, is_output, output_activation)
    _check_positive_ints(where, values, ("type", "activation", "padding"))

    if kind == "dense":
        return Dense(in_shape, int(values["units"]), activation)
    if kind == "conv":
        padding = values["padding"]
        if padding not in CONV_PADDINGS:
            raise ConfigError(f"{where}: key 'padding' must be one of "
                              f"{', '.join(map(repr, CONV_PADDINGS))}, got {padding!r}")
        kernel = _check_image_input(where, kind, in_shape, index, int(values["kernel"]),
                                    padded=padding == "same")
        return Conv(in_shape, kernel, int(values["stride"]), int(values["filters"]),
                    padding, activation)
    kernel = _check_image_input(where, kind, in_shape, index, int(values["kernel"]))
    return Local(in_shape, kernel, int(values["stride"]), int(values["channels"]), activation)


def layer_values(where: str, spec: Mapping, required: tuple[str, ...],
                 optional: Mapping[str, object]) -> dict:
    """A layer table's values with the optional keys' defaults, or a ConfigError naming
    an unknown or a missing key."""
    for key in spec:
        if key not in required and key not in optional:
            raise ConfigError(f"{where}: unknown key {key!r}; allowed: "
                              f"{', '.join([*required, *optional])}")
    for key in required:
        if key not in spec:
            raise ConfigError(f"{where}: missing key {key!r}")
    return {**optional, **spec}


def check_activation(where: str, activation: object, is_output: bool,
                     output_activation: str) -> None:
    """ConfigError unless `activation` is a known one, the loss's on the output layer
    (`output_activation`), and softmax nowhere else."""
    if activation not in ACTIVATIONS:
        raise ConfigError(f"{where}: key 'activation' must be one of "
                          f"{', '.join(ACTIVATIONS)}, got {activation!r}")
    if is_output and activation != output_activation:
        loss = next(kind.name for kind in LOSSES.values()
                    if kind.output_activation == output_activation)
        raise ConfigError(f"{where}: key 'activation' of the output layer must be "
                          f"{output_activation!r} (model.loss = {loss!r}), got {activation!r}")
    if not is_output and activation == "softmax":
        raise ConfigError(f"{where}: key 'activation' = 'softmax' is only allowed on the "
                          f"last layer")


def _check_positive_ints(where: str, values: Mapping, others: tuple[str, ...]) -> None:
    for key, value in values.items():
        if key not in others and not (_is_int(value) and value > 0):
            raise ConfigError(f"{where}: key {key!r} must be a positive integer, "
                              f"got {value!r}")


def _check_image_input(where: str, kind: str, in_shape: tuple[int, ...], index: int,
                       kernel: int, padded: bool = False) -> int:
    """`kernel`, once the layer's input is an image at least that large (any image, if
    the layer pads its input)."""
    if len(in_shape) != 3:
        reason = ("comes after a dense layer" if index > 0
                  else f"gets flat input of shape {in_shape}")
        raise ConfigError(f"{where}: key 'type' = {kind!r} needs a 3-D (H, W, C) input, "
                          f"but this layer {reason}")
    if not padded and kernel > min(in_shape[0], in_shape[1]):
        raise ConfigError(f"{where}: key 'kernel' = {kernel} is larger than its "
                          f"{in_shape[0]}x{in_shape[1]} input")
    return kernel


def _check_not_output(where: str, is_output: bool) -> None:
    if is_output:
        raise ConfigError(f"{where}: the last layer must be the output layer (dense, "
                          f"local or conv, with the loss's activation: 'softmax' for "
                          f"cross_entropy)")


def _build_pool(where: str, values: dict, in_shape: tuple[int, ...], index: int,
                is_output: bool) -> Pool:
    _check_not_output(where, is_output)
    if values["mode"] not in POOL_MODES:
        raise ConfigError(f"{where}: key 'mode' must be one of "
                          f"{', '.join(map(repr, POOL_MODES))}, got {values['mode']!r}")
    _check_positive_ints(where, {key: value for key, value in values.items()
                                 if value is not None}, ("type", "mode"))
    if values["stride"] is None:
        values["stride"] = values["kernel"]
    kernel = _check_image_input(where, "pool", in_shape, index, int(values["kernel"]))
    return Pool(in_shape, kernel, int(values["stride"]), values["mode"])


def _build_lcn(where: str, values: dict, in_shape: tuple[int, ...], index: int,
               is_output: bool) -> Lcn:
    _check_not_output(where, is_output)
    _check_positive_ints(where, values, ("type", "floor"))
    floor = values["floor"]
    if (isinstance(floor, bool) or not isinstance(floor, (int, float))
            or not math.isfinite(floor) or floor <= 0):
        raise ConfigError(f"{where}: key 'floor' must be a positive number, got {floor!r}")
    kernel = int(values["kernel"])
    if kernel % 2 == 0:
        raise ConfigError(f"{where}: key 'kernel' must be odd (a window centred on its "
                          f"pixel), got {kernel}")
    # Zero padding makes any window size well defined, even one wider than the image.
    kernel = _check_image_input(where, "lcn", in_shape, index, kernel, padded=True)
    return Lcn(in_shape, kernel, float(floor))


def _build_dropout(where: str, values: dict, in_shape: tuple[int, ...],
                   is_output: bool) -> Dropout:
    _check_not_output(where, is_output)
    rate = values["rate"]
    if (isinstance(rate, bool) or not isinstance(rate, (int, float))
            or not 0 <= rate < 1):
        raise ConfigError(f"{where}: key 'rate' must be a number at least 0 and below 1 "
                          f"(the fraction of units dropped), got {rate!r}")
    return Dropout(in_shape, float(rate))


def evaluation_size(x: np.ndarray, y: np.ndarray, batch_size: int) -> int:
    """The number of examples `evaluate` is given, checked: as many labels as inputs, at
    least one, a positive batch size (ValueError, DataError)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    total = len(x)
    if total == 0 or len(y) != total:
        raise DataError(f"evaluate needs equal, non-zero numbers of inputs ({total}) "
                        f"and labels ({len(y)})")
    return total
