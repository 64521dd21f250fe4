"""The layers of a DistBelief network: fully connected (dense), locally connected, and the
parameter-free image layers of the paper's image model: pooling (max or L2) and local
contrast normalization.

Each layer is a small object that knows its shapes and has a forward and a backward over
explicit arrays: its input, its output buffer, its parameter arrays and their gradient
arrays, all handed in by the caller. A layer owns no parameters and no buffers. That is what
lets the network keep every parameter in one flat vector (views per layer), reuse work
buffers across steps, and, later, lets a model partition run the same code on its own block
of output units (dense) or band of output rows (local) with its own slices of the arrays.

Activations between layers are 2-D (N, units) float32 C-contiguous arrays; a local layer
reads them as (N, H, W, C) images (row, column, channel order), which is a free reshape.

A layer may also keep values from its forward for its backward: `saved_per_output` int32
values per output unit (only max pooling does, its argmax: 1; every other layer 0). The
caller allocates them (`saved`: (N, saved_per_output * outputs), SAVED_DTYPE) beside the
activations, reuses them step after step, passes them to forward and then the same array
to backward, and passes None to a forward that no backward follows (evaluation). Every
layer takes the argument, so every caller drives all layer types the same way.

Pooling and LCN layers keep no parameters (their parameter list is empty, so the flat
layout is that of the other layers alone) and take empty arrays in the weights and bias
positions of forward and backward, so every caller drives all layer types the same way.

Every image layer (local, pool, lcn) is split by output rows for model parallelism; each
says which input rows a band of output rows reads (`input_rows`) and which input columns
any output reads (`input_columns`), which is all partition.py needs to count its halo.

A layer whose activation is "softmax" is the output layer: its forward stops at the logits
(bias, no nonlinearity) and the network applies softmax cross-entropy, whose gradient with
respect to the logits arrives in backward as `dout`.
"""

from __future__ import annotations

import math

import numpy as np

from distbelief.model import kernels

ACTIVATIONS = ("relu", "sigmoid", "tanh", "linear", "softmax")
SAVED_DTYPE = np.int32
"""The dtype of what a layer's forward saves for its backward (`Layer.saved_per_output`)."""


class Layer:
    """What dense and local layers share: shapes, activation, initialisation."""

    kind = "layer"
    saved_per_output = 0
    """SAVED_DTYPE values per output unit that forward saves for backward (see the module's
    docstring): the caller's `saved` array has this many times the outputs as columns."""

    def __init__(self, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
                 activation: str):
        self.in_shape = in_shape
        self.out_shape = out_shape
        self.activation = activation
        self.in_size = math.prod(in_shape)
        self.out_size = math.prod(out_shape)
        # The output layer computes logits only; the loss applies the softmax.
        self.kernel_activation = "linear" if activation == "softmax" else activation

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of each parameter array, in storage order: weights, then bias."""
        raise NotImplementedError

    def fans(self) -> tuple[int, int]:
        """(fan_in, fan_out) for the He / Glorot initialisation scale."""
        raise NotImplementedError

    @property
    def num_params(self) -> int:
        return sum(math.prod(shape) for _, shape in self.param_shapes())

    def init_params(self, rng: np.random.Generator, weights: np.ndarray,
                    bias: np.ndarray) -> None:
        """Fill `weights` in place from `rng`, uniform He (relu) or Glorot (others); bias 0.

        Draws float32 straight into the array, so initialising a huge layer allocates
        nothing.
        """
        fan_in, fan_out = self.fans()
        if self.activation == "relu":
            limit = math.sqrt(6.0 / fan_in)
        else:
            limit = math.sqrt(6.0 / (fan_in + fan_out))
        rng.random(dtype=np.float32, out=weights)
        weights *= np.float32(2.0 * limit)
        weights -= np.float32(limit)
        bias[...] = 0.0

    def describe(self) -> str:
        shape = "x".join(map(str, self.out_shape))
        return f"{self.kind:<6} {shape:<12} {self.num_params:>12,d} params  {self.activation}"


class ImageLayer(Layer):
    """A layer over (H, W, C) images, split by output rows: local, pool and lcn."""

    kernel: int

    def input_rows(self, start: int, stop: int) -> tuple[int, int]:
        """The input rows [first, last) that output rows [start, stop) read."""
        raise NotImplementedError

    def input_columns(self) -> np.ndarray:
        """Boolean mask over the input's columns: those some output reads."""
        raise NotImplementedError


class ValidWindows(ImageLayer):
    """Windows of kernel x kernel inputs every `stride` rows and columns, no padding."""

    stride: int

    def input_rows(self, start: int, stop: int) -> tuple[int, int]:
        return start * self.stride, (stop - 1) * self.stride + self.kernel

    def input_columns(self) -> np.ndarray:
        columns = np.zeros(self.in_shape[1], dtype=bool)
        for c in range(self.out_shape[1]):
            columns[c * self.stride: c * self.stride + self.kernel] = True
        return columns


class Dense(Layer):
    """Fully connected: out = act(x @ W.T + b), W is (units_out, units_in).

    Weights are stored output-unit-major so a block of output units is one contiguous
    slice of the flat parameter vector (model parallelism splits dense layers that way).
    """

    kind = "dense"

    def __init__(self, in_shape: tuple[int, ...], units: int, activation: str):
        super().__init__(in_shape, (units,), activation)
        self.units = units

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [("weights", (self.units, self.in_size)), ("bias", (self.units,))]

    def fans(self) -> tuple[int, int]:
        return self.in_size, self.units

    def forward(self, x: np.ndarray, weights: np.ndarray, bias: np.ndarray,
                out: np.ndarray, saved: np.ndarray | None = None) -> None:
        """out (N, units) = act(x (N, in) @ weights.T + bias)."""
        np.matmul(x, weights.T, out=out)
        kernels.bias_activation(out, bias, self.kernel_activation)

    def backward(self, x: np.ndarray, out: np.ndarray, dout: np.ndarray,
                 weights: np.ndarray, dweights: np.ndarray, dbias: np.ndarray,
                 dx: np.ndarray | None, saved: np.ndarray | None = None) -> None:
        """Overwrite dweights, dbias and (unless None) dx; `dout` is overwritten with dz."""
        kernels.activation_backward(out, dout, self.kernel_activation, dout, dbias)
        np.matmul(dout.T, x, out=dweights)
        if dx is not None:
            np.matmul(dout, weights, out=dx)


class Local(ValidWindows):
    """Locally connected 2-D layer: like a convolution with valid padding, but untied.

    Every output position (i, j) has its own weights (kernel*kernel*Cin, Cout) and its own
    bias (Cout,): weights (Ho, Wo, kernel*kernel*Cin, Cout), bias (Ho, Wo, Cout). Stored
    output-row-major, so a band of output rows is one contiguous slice.
    """

    kind = "local"

    def __init__(self, in_shape: tuple[int, int, int], kernel: int, stride: int,
                 channels: int, activation: str):
        height, width, _ = in_shape
        out_shape = (output_extent(height, kernel, stride),
                     output_extent(width, kernel, stride), channels)
        super().__init__(in_shape, out_shape, activation)
        self.kernel = kernel
        self.stride = stride
        self.channels = channels

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        out_h, out_w, channels_out = self.out_shape
        patch = self.kernel * self.kernel * self.in_shape[2]
        return [("weights", (out_h, out_w, patch, channels_out)),
                ("bias", (out_h, out_w, channels_out))]

    def fans(self) -> tuple[int, int]:
        area = self.kernel * self.kernel
        return area * self.in_shape[2], area * self.channels

    def forward(self, x: np.ndarray, weights: np.ndarray, bias: np.ndarray,
                out: np.ndarray, saved: np.ndarray | None = None) -> None:
        """out (N, Ho*Wo*Cout) = act(local(x (N, H*W*Cin)) + bias)."""
        n = x.shape[0]
        kernels.local_forward(x.reshape(n, *self.in_shape), weights,
                              out.reshape(n, *self.out_shape), self.kernel, self.stride)
        kernels.bias_activation(out, bias.reshape(-1), self.kernel_activation)

    def backward(self, x: np.ndarray, out: np.ndarray, dout: np.ndarray,
                 weights: np.ndarray, dweights: np.ndarray, dbias: np.ndarray,
                 dx: np.ndarray | None, saved: np.ndarray | None = None) -> None:
        """Overwrite dweights, dbias and (unless None) dx; `dout` is overwritten with dz."""
        n = x.shape[0]
        kernels.activation_backward(out, dout, self.kernel_activation, dout,
                                    dbias.reshape(-1))
        kernels.local_backward(x.reshape(n, *self.in_shape), weights,
                               dout.reshape(n, *self.out_shape), dweights,
                               None if dx is None else dx.reshape(n, *self.in_shape),
                               self.kernel, self.stride)


def output_extent(size: int, kernel: int, stride: int) -> int:
    """Output rows (or columns) of a valid-padding window sweep over `size` inputs."""
    return (size - kernel) // stride + 1


NO_PARAMS = np.empty(0, dtype=np.float32)
"""What a parameter-free layer gets for weights, bias and their gradients."""


class Pool(ValidWindows):
    """Pooling over kernel x kernel windows every `stride` pixels, per channel, no padding:
    "max", or "l2" (the square root of the window's sum of squares, the paper's choice).
    No parameters."""

    kind = "pool"

    def __init__(self, in_shape: tuple[int, int, int], kernel: int, stride: int,
                 mode: str):
        height, width, channels = in_shape
        out_shape = (output_extent(height, kernel, stride),
                     output_extent(width, kernel, stride), channels)
        super().__init__(in_shape, out_shape, "linear")
        self.kernel = kernel
        self.stride = stride
        self.mode = mode
        # Max pooling keeps each output's argmax, so that its backward only scatters.
        self.saved_per_output = 1 if mode == "max" else 0

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return []

    def fans(self) -> tuple[int, int]:
        return self.kernel * self.kernel, 1

    def init_params(self, rng: np.random.Generator, weights: np.ndarray,
                    bias: np.ndarray) -> None:
        """Nothing to initialise (and nothing drawn from rng)."""

    def forward(self, x: np.ndarray, weights: np.ndarray, bias: np.ndarray,
                out: np.ndarray, saved: np.ndarray | None = None) -> None:
        """Max pooling fills `saved` (N, outputs) with each output's argmax, unless None."""
        n = x.shape[0]
        kernels.pool_forward(x.reshape(n, *self.in_shape), out.reshape(n, *self.out_shape),
                             self.kernel, self.stride, self.mode,
                             self._argmax(saved, n))

    def backward(self, x: np.ndarray, out: np.ndarray, dout: np.ndarray,
                 weights: np.ndarray, dweights: np.ndarray, dbias: np.ndarray,
                 dx: np.ndarray | None, saved: np.ndarray | None = None) -> None:
        """Overwrite dx (unless None); `dout` is left as it is. Max pooling needs the
        `saved` its forward filled."""
        if dx is None:
            return
        n = x.shape[0]
        kernels.pool_backward(x.reshape(n, *self.in_shape), out.reshape(n, *self.out_shape),
                              dout.reshape(n, *self.out_shape), dx.reshape(n, *self.in_shape),
                              self.kernel, self.stride, self.mode, self._argmax(saved, n))

    def _argmax(self, saved: np.ndarray | None, n: int) -> np.ndarray | None:
        """`saved` as the kernels' (N, Ho, Wo, C) argmax; None for L2 pooling."""
        if saved is None or not self.saved_per_output:
            return None
        return saved.reshape(n, *self.out_shape)

    def describe(self) -> str:
        return (f"{super().describe().rsplit(maxsplit=1)[0]}  {self.mode} "
                f"{self.kernel}x{self.kernel}/{self.stride}")


LCN_FLOOR = 0.1
"""The default floor of LCN's divisor: on activations of order 1, regions whose local
standard deviation is under a tenth of that are centred but not amplified."""


class Lcn(ImageLayer):
    """Local contrast normalization (Jarrett et al. 2009, Le et al. 2012): subtract the
    Gaussian-weighted mean over a kernel x kernel window and all channels, divide by the
    weighted standard deviation, floored at `floor`. Same size out; zero padding; no
    parameters (the Gaussian is fixed: kernels.gaussian_window)."""

    kind = "lcn"

    def __init__(self, in_shape: tuple[int, int, int], kernel: int, floor: float):
        super().__init__(in_shape, in_shape, "linear")
        self.kernel = kernel
        self.floor = floor

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return []

    def fans(self) -> tuple[int, int]:
        return self.kernel * self.kernel * self.in_shape[2], 1

    def init_params(self, rng: np.random.Generator, weights: np.ndarray,
                    bias: np.ndarray) -> None:
        """Nothing to initialise (and nothing drawn from rng)."""

    @property
    def reach(self) -> int:
        """Rows (and columns) an output reads each side: the mean's window and then the
        standard deviation's, each kernel // 2."""
        return 2 * (self.kernel // 2)

    def input_rows(self, start: int, stop: int) -> tuple[int, int]:
        return max(0, start - self.reach), min(self.in_shape[0], stop + self.reach)

    def input_columns(self) -> np.ndarray:
        return np.ones(self.in_shape[1], dtype=bool)

    def forward(self, x: np.ndarray, weights: np.ndarray, bias: np.ndarray,
                out: np.ndarray, saved: np.ndarray | None = None) -> None:
        n = x.shape[0]
        kernels.lcn_forward(x.reshape(n, *self.in_shape), out.reshape(n, *self.out_shape),
                            self.kernel, self.floor)

    def backward(self, x: np.ndarray, out: np.ndarray, dout: np.ndarray,
                 weights: np.ndarray, dweights: np.ndarray, dbias: np.ndarray,
                 dx: np.ndarray | None, saved: np.ndarray | None = None) -> None:
        """Overwrite dx (unless None); `dout` is left as it is."""
        if dx is None:
            return
        n = x.shape[0]
        kernels.lcn_backward(x.reshape(n, *self.in_shape), dout.reshape(n, *self.out_shape),
                             dx.reshape(n, *self.in_shape), self.kernel, self.floor)

    def describe(self) -> str:
        return (f"{super().describe().rsplit(maxsplit=1)[0]}  {self.kernel}x{self.kernel} "
                f"floor {self.floor:g}")
