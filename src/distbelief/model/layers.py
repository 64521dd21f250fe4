"""The layers of a DistBelief network: fully connected (dense), locally connected, the
parameter-free image layers of the paper's image model (pooling, max or L2, and local
contrast normalization), and the layers a researcher's own model expects besides:
convolution (tied weights), dropout and layer normalization.

Each layer is a small object that knows its shapes and has a forward and a backward over
explicit arrays: its input, its output buffer, its parameter arrays and their gradient
arrays, all handed in by the caller. A layer owns no parameters and no buffers (a conv
layer's scratch for im2col aside: it holds nothing from one call to the next). That is what
lets the network keep every parameter in one flat vector (views per layer), reuse work
buffers across steps, and, later, lets a model partition run the same code on its own block
of output units (dense) or band of output rows (local) with its own slices of the arrays.

Activations between layers are 2-D (N, units) float32 C-contiguous arrays; a local layer
reads them as (N, H, W, C) images (row, column, channel order), which is a free reshape.

A layer may also keep values from its forward for its backward: `saved_per_output` int32
values per output unit (max pooling its argmax, dropout its draws: 1; the others 0). The
caller allocates them (`saved`: (N, saved_per_output * outputs), SAVED_DTYPE) beside the
activations, reuses them step after step, passes them to forward and then the same array
to backward, and passes None to a forward that no backward follows (evaluation). Every
layer takes the argument, so every caller drives all layer types the same way.

Pooling, LCN and dropout layers keep no parameters (their parameter list is empty, so the
flat layout is that of the other layers alone) and take empty arrays in the weights and
bias positions of forward and backward, so every caller drives all layer types the same way.

Every image layer (local, pool, lcn, conv) says which input rows a band of output rows
reads (`input_rows`) and which input columns any output reads (`input_columns`), which is
all partition.py needs to count its halo; local, pool and lcn layers are split by output
rows for model parallelism. Conv, dropout and layernorm layers are not split (partition.py
says why), and a conv layer keeps one work buffer, its im2col columns (see Conv).

The output layer's forward stops at the logits (bias, no nonlinearity: the network sets its
`kernel_activation` to "linear") and the network's loss applies the activation its config
names (softmax, sigmoid, or none for mse); the loss's gradient with respect to the logits
arrives in backward as `dout`.
"""

from __future__ import annotations

import math

import numpy as np

from distbelief.model import kernels

ACTIVATIONS = ("relu", "sigmoid", "tanh", "linear", "softmax")
SAVED_DTYPE = np.int32
"""The dtype of what a layer's forward saves for its backward (`Layer.saved_per_output`)."""


class Layer:
    """What every layer shares: shapes, activation, initialisation."""

    kind = "layer"
    saved_per_output = 0
    """SAVED_DTYPE values per output unit that forward saves for backward (see the module's
    docstring): the caller's `saved` array has this many times the outputs as columns."""
    random_init = True
    """Whether init_params draws the weights from its rng (Network.init_slice follows the
    stream through the layers that do)."""

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
    """A layer over (H, W, C) images whose output rows read bands of input rows: local,
    pool, lcn and conv."""

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


class Conv(ImageLayer):
    """2-D convolution: tied weights, one set of `filters` filters shared by every output
    position. weights (kernel, kernel, Cin, filters), bias (filters,). padding "valid" or
    "same" (kernels.conv_extent: zeros around the image, Ho = ceil(H / stride)).

    By im2col: kernels.im2col copies the patches of a chunk of samples into the rows of a
    columns matrix (chunk*Ho*Wo, kernel*kernel*Cin), and BLAS (numpy's matmul) multiplies
    it with the filters; backward multiplies the other two ways and kernels.col2im adds
    the patches' gradients back into dx. The columns matrix is the one buffer a layer
    keeps: COLUMNS_BYTES at most (samples go through in chunks that fit), grown once and
    reused, so a training step allocates nothing; the network's evaluation batches do not
    grow it past that. A batch that fits in one chunk leaves its columns in the buffer, and
    the backward of that same input (the network's next call) multiplies them without a
    second im2col; the caller must not change the input in between.
    """

    kind = "conv"
    COLUMNS_BYTES = 4 << 20
    """The most bytes of im2col columns at once (at least one sample's). Small enough that
    a chunk's columns are still in cache when its GEMMs read them: 4 MB made the example
    config's second conv layer 15-20% faster than 32 MB (one chunk of 64 samples)."""

    def __init__(self, in_shape: tuple[int, int, int], kernel: int, stride: int,
                 filters: int, padding: str, activation: str):
        height, width, _ = in_shape
        out_h, self.pad_top = kernels.conv_extent(height, kernel, stride, padding)
        out_w, self.pad_left = kernels.conv_extent(width, kernel, stride, padding)
        super().__init__(in_shape, (out_h, out_w, filters), activation)
        self.kernel = kernel
        self.stride = stride
        self.filters = filters
        self.padding = padding
        self.patch = kernel * kernel * in_shape[2]
        positions = out_h * out_w
        self.chunk = max(1, self.COLUMNS_BYTES // (4 * positions * self.patch))
        self._columns = np.empty((0, self.patch), dtype=np.float32)
        self._dweights = np.empty((self.patch, filters), dtype=np.float32)
        self._holds: tuple[int, int] | None = None
        """(address, rows) of the input whose whole columns the buffer holds: a batch that
        fits in one chunk, from the last forward; its backward then needs no im2col."""

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [("weights", (self.kernel, self.kernel, self.in_shape[2], self.filters)),
                ("bias", (self.filters,))]

    def fans(self) -> tuple[int, int]:
        area = self.kernel * self.kernel
        return area * self.in_shape[2], area * self.filters

    def input_rows(self, start: int, stop: int) -> tuple[int, int]:
        first = start * self.stride - self.pad_top
        return max(0, first), min(self.in_shape[0],
                                  (stop - 1) * self.stride - self.pad_top + self.kernel)

    def input_columns(self) -> np.ndarray:
        columns = np.zeros(self.in_shape[1], dtype=bool)
        for c in range(self.out_shape[1]):
            first = c * self.stride - self.pad_left
            columns[max(0, first): first + self.kernel] = True
        return columns

    def scratch_bytes(self, batch: int) -> int:
        """Bytes of the work buffers a batch of `batch` grows this layer's to."""
        positions = self.out_shape[0] * self.out_shape[1]
        return 4 * self.patch * (min(batch, self.chunk) * positions + self.filters)

    def _chunks(self, n: int):
        """(sample slice, its columns buffer) in turn, chunk samples at a time."""
        rows = min(n, self.chunk) * self.out_shape[0] * self.out_shape[1]
        if self._columns.shape[0] < rows:
            self._columns = np.empty((rows, self.patch), dtype=np.float32)
        per_sample = self.out_shape[0] * self.out_shape[1]
        for start in range(0, n, self.chunk):
            stop = min(n, start + self.chunk)
            yield slice(start, stop), self._columns[:(stop - start) * per_sample]

    def forward(self, x: np.ndarray, weights: np.ndarray, bias: np.ndarray,
                out: np.ndarray, saved: np.ndarray | None = None) -> None:
        """out (N, Ho*Wo*filters) = act(conv(x (N, H*W*Cin)) + bias)."""
        n = x.shape[0]
        x4 = x.reshape(n, *self.in_shape)
        w = weights.reshape(self.patch, self.filters)
        rows = out.reshape(-1, self.filters)  # one row per output position
        per_sample = self.out_shape[0] * self.out_shape[1]
        for samples, columns in self._chunks(n):
            kernels.im2col(x4[samples], columns, self.kernel, self.stride, self.padding)
            np.matmul(columns, w, out=rows[samples.start * per_sample:
                                           samples.stop * per_sample])
        self._holds = (_address(x), n) if n <= self.chunk else None
        kernels.bias_activation(rows, bias, self.kernel_activation)

    def backward(self, x: np.ndarray, out: np.ndarray, dout: np.ndarray,
                 weights: np.ndarray, dweights: np.ndarray, dbias: np.ndarray,
                 dx: np.ndarray | None, saved: np.ndarray | None = None) -> None:
        """Overwrite dweights, dbias and (unless None) dx; `dout` is overwritten with dz."""
        n = x.shape[0]
        dz = dout.reshape(-1, self.filters)
        kernels.activation_backward(out.reshape(-1, self.filters), dz,
                                    self.kernel_activation, dz, dbias)
        x4 = x.reshape(n, *self.in_shape)
        w = weights.reshape(self.patch, self.filters)
        dw = dweights.reshape(self.patch, self.filters)
        dx4 = None if dx is None else dx.reshape(n, *self.in_shape)
        per_sample = self.out_shape[0] * self.out_shape[1]
        # The forward's columns, when they are this very input's and nothing overwrote them
        # (a network's backward follows its forward: Network is not thread-safe).
        held = self._holds == (_address(x), n)
        self._holds = None
        for samples, columns in self._chunks(n):
            dz_chunk = dz[samples.start * per_sample: samples.stop * per_sample]
            if not held:
                kernels.im2col(x4[samples], columns, self.kernel, self.stride,
                               self.padding)
            if samples.start == 0:
                np.matmul(columns.T, dz_chunk, out=dw)
            else:
                dw += np.matmul(columns.T, dz_chunk, out=self._dweights)
            if dx4 is not None:
                # The columns are spent: their buffer takes the patches' gradients.
                np.matmul(dz_chunk, w.T, out=columns)
                kernels.col2im(columns, dx4[samples], self.kernel, self.stride,
                               self.padding)
        if n == 0:
            dw[...] = 0.0

    def describe(self) -> str:
        return (f"{super().describe()}  {self.kernel}x{self.kernel}/{self.stride} "
                f"{self.padding}")


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


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


class Dropout(Layer):
    """Inverted dropout (Srivastava et al. 2014): in training each unit is zeroed with
    probability `rate` and the rest scaled by 1 / (1 - rate), so that evaluation, which
    passes the input through unchanged, sees activations of the same expected size. Any
    input shape, the same shape out; no parameters.

    The mask is one uniform float32 draw per unit: the caller draws them into `saved`
    (saved_per_output = 1; the int32 buffer holds the float32 draws' bits, `draws`) before
    a training forward, from a generator of its own (the network's is keyed on run.seed
    and the step, so a resumed run draws the masks it would have), and hands the same
    array to the backward. A forward without `saved` (evaluation) is the identity.
    """

    kind = "dropout"
    saved_per_output = 1

    def __init__(self, in_shape: tuple[int, ...], rate: float):
        super().__init__(in_shape, in_shape, "linear")
        self.rate = rate

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return []

    def fans(self) -> tuple[int, int]:
        return 1, 1

    def init_params(self, rng: np.random.Generator, weights: np.ndarray,
                    bias: np.ndarray) -> None:
        """Nothing to initialise (and nothing drawn from rng)."""

    @staticmethod
    def draws(saved: np.ndarray) -> np.ndarray:
        """`saved` (SAVED_DTYPE) as the float32 draws it holds."""
        return saved.view(np.float32)

    def draw(self, rng: np.random.Generator, saved: np.ndarray) -> None:
        """Fill `saved` with a training step's draws from `rng`, a row per sample."""
        rng.random(dtype=np.float32, out=self.draws(saved))

    def forward(self, x: np.ndarray, weights: np.ndarray, bias: np.ndarray,
                out: np.ndarray, saved: np.ndarray | None = None) -> None:
        if saved is None:
            np.copyto(out, x)
            return
        kernels.dropout(x, self.draws(saved), self.rate, out)

    def backward(self, x: np.ndarray, out: np.ndarray, dout: np.ndarray,
                 weights: np.ndarray, dweights: np.ndarray, dbias: np.ndarray,
                 dx: np.ndarray | None, saved: np.ndarray | None = None) -> None:
        """Overwrite dx (unless None) with dout through the forward's mask."""
        if dx is None:
            return
        if saved is None:
            raise ValueError("dropout's backward needs the draws its forward used: pass "
                             "the same saved array to forward and backward")
        kernels.dropout(dout, self.draws(saved), self.rate, dx)

    def describe(self) -> str:
        return f"{super().describe().rsplit(maxsplit=1)[0]}  rate {self.rate:g}"


class LayerNorm(Layer):
    """Layer normalization (Ba et al. 2016): each sample's features (all of them: H*W*C
    of an image) normalised to mean 0 and variance 1, then scaled and shifted per feature
    by a learnable gain (the "weights", initialised to 1) and bias (0). The same shape
    out.

    Layer norm rather than batch norm: its statistics are those of one sample, so training
    and evaluation compute the same function and nothing but the parameters is shared. Batch
    norm's batch statistics, and the running averages evaluation uses, would be each
    replica's own under Downpour's asynchronous replicas, with nowhere to combine them (the
    parameter server holds parameters and folds gradients, not statistics).
    """

    kind = "layernorm"
    random_init = False

    def __init__(self, in_shape: tuple[int, ...]):
        super().__init__(in_shape, in_shape, "linear")

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [("weights", (self.in_size,)), ("bias", (self.in_size,))]

    def fans(self) -> tuple[int, int]:
        return self.in_size, self.in_size

    def init_params(self, rng: np.random.Generator | None, weights: np.ndarray,
                    bias: np.ndarray) -> None:
        """Gain 1, bias 0 (nothing drawn from rng)."""
        weights[...] = 1.0
        bias[...] = 0.0

    def forward(self, x: np.ndarray, weights: np.ndarray, bias: np.ndarray,
                out: np.ndarray, saved: np.ndarray | None = None) -> None:
        kernels.layernorm_forward(x, weights, bias, out)

    def describe(self) -> str:
        return super().describe().rsplit(maxsplit=1)[0]

    def backward(self, x: np.ndarray, out: np.ndarray, dout: np.ndarray,
                 weights: np.ndarray, dweights: np.ndarray, dbias: np.ndarray,
                 dx: np.ndarray | None, saved: np.ndarray | None = None) -> None:
        """Overwrite dweights (the gain's gradient), dbias and (unless None) dx."""
        kernels.layernorm_backward(x, weights, dout, dweights, dbias, dx)
