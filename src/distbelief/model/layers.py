"""The layers of a DistBelief network: fully connected (dense) and locally connected.

Each layer is a small object that knows its shapes and has a forward and a backward over
explicit arrays: its input, its output buffer, its parameter arrays and their gradient
arrays, all handed in by the caller. A layer owns no parameters and no buffers. That is what
lets the network keep every parameter in one flat vector (views per layer), reuse work
buffers across steps, and, later, lets a model partition run the same code on its own block
of output units (dense) or band of output rows (local) with its own slices of the arrays.

Activations between layers are 2-D (N, units) float32 C-contiguous arrays; a local layer
reads them as (N, H, W, C) images (row, column, channel order), which is a free reshape.

A layer whose activation is "softmax" is the output layer: its forward stops at the logits
(bias, no nonlinearity) and the network applies softmax cross-entropy, whose gradient with
respect to the logits arrives in backward as `dout`.
"""

from __future__ import annotations

import math

import numpy as np

from distbelief.model import kernels

ACTIVATIONS = ("relu", "sigmoid", "tanh", "linear", "softmax")


class Layer:
    """What dense and local layers share: shapes, activation, initialisation."""

    kind = "layer"

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
                out: np.ndarray) -> None:
        """out (N, units) = act(x (N, in) @ weights.T + bias)."""
        np.matmul(x, weights.T, out=out)
        kernels.bias_activation(out, bias, self.kernel_activation)

    def backward(self, x: np.ndarray, out: np.ndarray, dout: np.ndarray,
                 weights: np.ndarray, dweights: np.ndarray, dbias: np.ndarray,
                 dx: np.ndarray | None) -> None:
        """Overwrite dweights, dbias and (unless None) dx; `dout` is overwritten with dz."""
        kernels.activation_backward(out, dout, self.kernel_activation, dout, dbias)
        np.matmul(dout.T, x, out=dweights)
        if dx is not None:
            np.matmul(dout, weights, out=dx)


class Local(Layer):
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
                out: np.ndarray) -> None:
        """out (N, Ho*Wo*Cout) = act(local(x (N, H*W*Cin)) + bias)."""
        n = x.shape[0]
        kernels.local_forward(x.reshape(n, *self.in_shape), weights,
                              out.reshape(n, *self.out_shape), self.kernel, self.stride)
        kernels.bias_activation(out, bias.reshape(-1), self.kernel_activation)

    def backward(self, x: np.ndarray, out: np.ndarray, dout: np.ndarray,
                 weights: np.ndarray, dweights: np.ndarray, dbias: np.ndarray,
                 dx: np.ndarray | None) -> None:
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
