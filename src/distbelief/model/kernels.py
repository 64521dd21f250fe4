"""Validated Python entry points to the compiled kernels in pyx/_kernels.pyx.

CONTRACT (fixed; other modules code against it). All arrays float32 and C-contiguous unless
said otherwise; outputs are caller-allocated and written in place; nothing is returned
except where stated. Every function validates dtype, shape and contiguity and raises
ValueError/TypeError in plain words; the compiled kernel then runs without the GIL.

Outputs must not overlap inputs, except where a function says an output may be the very
same array as an input (element-wise kernels are safe with exact aliasing).

At import, an editable checkout's pyx/ sources are hashed and compared with the hash the
extension was built from, so a stale build fails loudly instead of running old kernels.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np

ACTIVATIONS = ("linear", "relu", "sigmoid", "tanh")

REBUILD_COMMAND = "pip install -e ."
# In an editable install this file is <checkout>/src/distbelief/model/kernels.py.
PYX_DIR = Path(__file__).resolve().parents[3] / "pyx"


def pyx_source_hash(pyx_dir: Path) -> str:
    """sha256 over pyx_dir's *.pyx and *.pxd in name order, exactly as setup.py's."""
    digest = hashlib.sha256()
    for path in sorted([*pyx_dir.glob("*.pyx"), *pyx_dir.glob("*.pxd")]):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def check_kernels_current(pyx_dir: Path, compiled_hash: str) -> None:
    """Raise ImportError if pyx_dir exists and its sources are not those compiled.

    No pyx_dir (an installed wheel) means nothing to compare and passes.
    """
    if not pyx_dir.is_dir():
        return
    if pyx_source_hash(pyx_dir) != compiled_hash:
        raise ImportError(
            f"The compiled kernels are older than the sources in {pyx_dir}: rebuild them "
            f"with `{REBUILD_COMMAND}` from the checkout."
        )


try:
    from distbelief.model import _kernels
except ImportError as exc:
    raise ImportError(
        "The compiled kernels (distbelief.model._kernels) are missing: run "
        f"`{REBUILD_COMMAND}` from the checkout, or reinstall distbelief."
    ) from exc

check_kernels_current(PYX_DIR, _kernels.SOURCE_HASH)


def flush_subnormals(on: bool) -> bool:
    """Flush subnormal float32 values to zero (FTZ and DAZ) in the calling thread and in
    the threads it creates from now on, or stop; False where the CPU type has no such mode.
    BLAS worker threads keep the mode they were created with (distbelief.cli sets it before
    numpy starts them)."""
    return _kernels.flush_subnormals(bool(on))


def flushes_subnormals() -> bool:
    """Whether the calling thread flushes subnormal floats to zero."""
    return _kernels.flushes_subnormals()


# ---------------------------------------------------------------------------------------
# Validation helpers: every message names the argument and what was expected.

def _check_float32(name: str, a: object, ndim: int, writeable: bool = False) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(a).__name__}")
    if a.dtype != np.float32:
        raise TypeError(f"{name} must have dtype float32, got {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (use np.ascontiguousarray)")
    if writeable and not a.flags.writeable:
        raise ValueError(f"{name} is an output and must be writeable")
    return a


def _check_shape(name: str, a: np.ndarray, shape: tuple[int, ...]) -> None:
    if a.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {a.shape}")


def _identical(a: np.ndarray, b: np.ndarray) -> bool:
    """Same memory, element for element (same start, shape and strides)."""
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.shape == b.shape and a.strides == b.strides)


def _check_no_overlap(out_name: str, out: np.ndarray, others: dict[str, np.ndarray],
                      may_be: tuple[str, ...] = ()) -> None:
    """Outputs must not overlap inputs, except exact aliases named in may_be."""
    for name, other in others.items():
        # may_share_memory first: it is cheap, _identical is not (~5 us per call).
        if not np.may_share_memory(out, other):
            continue
        if name in may_be and (out is other or _identical(out, other)):
            continue
        raise ValueError(f"{out_name} must not overlap {name}")


def _check_real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return int(value)


def _activation_code(activation: object) -> int:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return _kernels.ACTIVATION_CODES[activation]


# ---------------------------------------------------------------------------------------
# Optimizer updates.

def adagrad_update(params: np.ndarray, accum: np.ndarray, grad: np.ndarray,
                   lr: float, eps: float = 1e-10, copy: np.ndarray | None = None) -> None:
    """One fused pass: accum += grad**2; params -= lr * grad / (sqrt(accum) + eps); and,
    if `copy` is given, copy[:] = the new params in the same pass.

    1-D arrays of equal length. Same rule and eps as torch.optim.Adagrad (no initial
    accumulator value, no decay).
    """
    _check_update(params, {"accum": accum}, grad, copy)
    lr = _check_real("lr", lr)
    eps = _check_real("eps", eps)
    _kernels.adagrad_update(params, accum, grad, lr, eps, copy)


def adarevision_update(params: np.ndarray, gsum: np.ndarray, z: np.ndarray,
                       zmax: np.ndarray, fetched: np.ndarray, grad: np.ndarray, lr: float,
                       eps: float = 1e-10, copy: np.ndarray | None = None) -> None:
    """One fused pass of AdaRevision (distbelief.model.optimizers.AdaRevision has the rule):
    b = gsum - fetched; z += grad**2 + 2*grad*b; zmax = max(zmax, z); params -= the
    revised step; gsum += grad; with `copy`, copy[:] = the new params in the same pass.
    1-D float32 arrays of equal length; eps > 0. With fetched == gsum it is adagrad_update
    with accum = z, to the bit."""
    _check_update(params, {"gsum": gsum, "z": z, "zmax": zmax}, grad, copy,
                  {"fetched": fetched})
    lr = _check_real("lr", lr)
    eps = _check_real("eps", eps)
    if eps <= 0:
        raise ValueError(f"eps must be positive, got {eps}")
    _kernels.adarevision_update(params, gsum, z, zmax, fetched, grad, lr, eps, copy)


def sgd_update(params: np.ndarray, grad: np.ndarray, lr: float,
               copy: np.ndarray | None = None) -> None:
    """params -= lr * grad (1-D, equal length), one pass; with `copy`, copy[:] = the new
    params in the same pass."""
    _check_update(params, {}, grad, copy)
    lr = _check_real("lr", lr)
    _kernels.sgd_update(params, grad, lr, copy)


def momentum_update(params: np.ndarray, buf: np.ndarray, grad: np.ndarray, lr: float,
                    momentum: float, nesterov: bool = False,
                    copy: np.ndarray | None = None) -> None:
    """SGD with momentum, one fused pass, as torch.optim.SGD(momentum=, nesterov=) with no
    dampening: buf = momentum * buf + grad; params -= lr * (buf, or grad + momentum * buf
    with Nesterov); with `copy`, copy[:] = the new params in the same pass."""
    _check_update(params, {"buf": buf}, grad, copy)
    lr = _check_real("lr", lr)
    momentum = _check_real("momentum", momentum)
    _kernels.momentum_update(params, buf, grad, lr, momentum, bool(nesterov), copy)


def adam_update(params: np.ndarray, m: np.ndarray, v: np.ndarray, grad: np.ndarray,
                lr: float, beta1: float, beta2: float, eps: float, t: int,
                copy: np.ndarray | None = None) -> None:
    """Adam's update number `t` (1 for the first), one fused pass, as torch.optim.Adam
    with no weight decay: m += (1 - beta1) * (grad - m); v = beta2 * v + (1 - beta2) *
    grad**2; params -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps);
    with `copy`, copy[:] = the new params in the same pass."""
    _check_update(params, {"m": m, "v": v}, grad, copy)
    lr, beta1, beta2, eps = (_check_real(n, x) for n, x in
                             (("lr", lr), ("beta1", beta1), ("beta2", beta2), ("eps", eps)))
    t = _check_positive_int("t", t)
    step_size = lr / (1.0 - beta1 ** t)
    bc2_sqrt = math.sqrt(1.0 - beta2 ** t)
    _kernels.adam_update(params, m, v, grad, step_size, 1.0 - beta1, beta2, 1.0 - beta2,
                         bc2_sqrt, eps, copy)
# ---------------------------------------------------------------------------------------
# bfloat16 (narrowed pushes): stored as its 16 bits in uint16, numpy having no bfloat16.

def _check_bf16(name: str, a: object, writeable: bool = False) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(a).__name__}")
    if a.dtype != np.uint16:
        raise TypeError(f"{name} must have dtype uint16 (bfloat16 bits), got {a.dtype}")
    if a.ndim != 1 or not a.flags.c_contiguous:
        raise ValueError(f"{name} must be 1-D and C-contiguous, got shape {a.shape}")
    if writeable and not a.flags.writeable:
        raise ValueError(f"{name} is an output and must be writeable")
    return a


def bf16_narrow(src: np.ndarray, out: np.ndarray) -> None:
    """out[:] = src rounded to bfloat16, as uint16 bits: round to nearest, ties to even;
    values beyond bfloat16's range round to infinity; a NaN stays a quiet NaN of the same
    sign. 1-D, equal length; src float32, out uint16."""
    _check_float32("src", src, 1)
    _check_bf16("out", out, writeable=True)
    _check_shape("out", out, src.shape)
    _check_no_overlap("out", out, {"src": src})
    _kernels.bf16_narrow(src, out)


def bf16_widen(src: np.ndarray, out: np.ndarray, accumulate: bool = False) -> None:
    """out[:] = src (bfloat16 bits, uint16) as float32, exactly; with `accumulate`,
    out += it instead. 1-D, equal length."""
    _check_bf16("src", src)
    _check_float32("out", out, 1, writeable=True)
    _check_shape("out", out, src.shape)
    _check_no_overlap("out", out, {"src": src})
    _kernels.bf16_widen(src, out, bool(accumulate))


def bf16_round(src: np.ndarray, out: np.ndarray) -> None:
    """out[:] = src rounded to bfloat16's precision (bf16_narrow, then widened), float32
    in and out; `out` may be `src` itself."""
    _check_float32("src", src, 1)
    _check_float32("out", out, 1, writeable=True)
    _check_shape("out", out, src.shape)
    _check_no_overlap("out", out, {"src": src}, may_be=("src",))
    _kernels.bf16_round(src, out)


def _check_update(params: np.ndarray, states: dict[str, np.ndarray], grad: np.ndarray,
                  copy: np.ndarray | None, inputs: dict[str, np.ndarray] | None = None) -> None:
    """What every fused update checks: `params` and its `states` (written in place) and
    `grad` and other `inputs` (read) are 1-D float32 arrays of one length; no written
    array overlaps another array; `copy`, if given, overlaps none."""
    _check_float32("params", params, 1, writeable=True)
    for name, array in states.items():
        _check_float32(name, array, 1, writeable=True)
        _check_shape(name, array, params.shape)
    read = {**(inputs or {}), "grad": grad}
    for name, array in read.items():
        _check_float32(name, array, 1)
        _check_shape(name, array, params.shape)
    arrays = {"params": params, **states, **read}
    names = list(arrays)
    for i, name in enumerate(names[:1 + len(states)]):
        _check_no_overlap(name, arrays[name], {k: arrays[k] for k in names[i + 1:]})
    _check_copy(copy, params, arrays)


def _check_copy(copy: np.ndarray | None, params: np.ndarray,
                others: dict[str, np.ndarray]) -> None:
    if copy is None:
        return
    _check_float32("copy", copy, 1, writeable=True)
    _check_shape("copy", copy, params.shape)
    _check_no_overlap("copy", copy, others)


# ---------------------------------------------------------------------------------------
# Bias + activation, its derivative, and the loss.

def bias_activation(z: np.ndarray, bias: np.ndarray, activation: str) -> None:
    """z[n, u] = act(z[n, u] + bias[u]) in place. z is (N, U), bias is (U,).

    activation is one of ACTIVATIONS.
    """
    _check_float32("z", z, 2, writeable=True)
    _check_float32("bias", bias, 1)
    _check_shape("bias", bias, (z.shape[1],))
    code = _activation_code(activation)
    _check_no_overlap("z", z, {"bias": bias})
    _kernels.bias_activation(z, bias, code)


def activation_backward(out: np.ndarray, dout: np.ndarray, activation: str,
                        dz: np.ndarray, dbias: np.ndarray | None = None) -> None:
    """dz = dout * act'(z), written in terms of the activation's output `out`.

    out, dout, dz are (N, U); dz may be the same array as dout. If dbias (U,) is given it is
    overwritten with dz summed over the batch (the bias gradient), in the same pass.
    """
    _check_float32("out", out, 2)
    _check_float32("dout", dout, 2)
    _check_float32("dz", dz, 2, writeable=True)
    _check_shape("dout", dout, out.shape)
    _check_shape("dz", dz, out.shape)
    code = _activation_code(activation)
    _check_no_overlap("dz", dz, {"out": out, "dout": dout}, may_be=("out", "dout"))
    if dbias is not None:
        _check_float32("dbias", dbias, 1, writeable=True)
        _check_shape("dbias", dbias, (out.shape[1],))
        _check_no_overlap("dbias", dbias, {"out": out, "dout": dout, "dz": dz})
    _kernels.activation_backward(out, dout, code, dz, dbias)


def softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray, grad: np.ndarray) -> float:
    """Mean cross-entropy of softmax(logits) against integer labels; returns the loss.

    logits (N, C) float32; labels (N,) any integer dtype (cast to int32 if needed), each in
    [0, C); grad (N, C) is overwritten with d(mean loss)/d(logits) = (softmax - onehot) / N.
    grad may be the same array as logits. Numerically stable (max subtracted).
    """
    _check_float32("logits", logits, 2)
    _check_float32("grad", grad, 2, writeable=True)
    _check_shape("grad", grad, logits.shape)
    rows, classes = logits.shape
    if rows == 0 or classes == 0:
        # The mean over an empty batch is undefined; returning 0 would hide a bug upstream.
        raise ValueError(f"logits must have at least one row and one class, got {logits.shape}")
    if not isinstance(labels, np.ndarray):
        raise TypeError(f"labels must be a numpy array, got {type(labels).__name__}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise TypeError(f"labels must have an integer dtype, got {labels.dtype}")
    _check_shape("labels", labels, (rows,))
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= classes:
        bad = low if low < 0 else high
        raise ValueError(f"labels must be in [0, {classes}), got {bad}")
    _check_no_overlap("grad", grad, {"logits": logits}, may_be=("logits",))
    labels32 = np.ascontiguousarray(labels, dtype=np.int32)
    return float(_kernels.softmax_cross_entropy(logits, labels32, grad))


def squared_error(outputs: np.ndarray, targets: np.ndarray, grad: np.ndarray) -> float:
    """Mean over rows and outputs of (output - target)^2; returns it.

    outputs, targets, grad (N, K) float32; grad is overwritten with d(mean)/d(outputs) =
    2 (output - target) / (N K) and may be the same array as outputs.
    """
    _check_target_loss(outputs, targets, grad, "outputs")
    return float(_kernels.squared_error(outputs, targets, grad))


def sigmoid_binary_cross_entropy(logits: np.ndarray, targets: np.ndarray,
                                 grad: np.ndarray) -> float:
    """Mean over rows and outputs of the cross-entropy of sigmoid(logits) against targets
    in [0, 1] (0/1 labels, or soft ones); returns it.

    logits, targets, grad (N, K) float32; grad is overwritten with d(mean)/d(logits) =
    (sigmoid(logits) - targets) / (N K) and may be the same array as logits.
    """
    _check_target_loss(logits, targets, grad, "logits")
    return float(_kernels.sigmoid_binary_cross_entropy(logits, targets, grad))


def _check_target_loss(outputs: np.ndarray, targets: np.ndarray, grad: np.ndarray,
                       name: str) -> None:
    _check_float32(name, outputs, 2)
    _check_float32("targets", targets, 2)
    _check_float32("grad", grad, 2, writeable=True)
    _check_shape("targets", targets, outputs.shape)
    _check_shape("grad", grad, outputs.shape)
    if outputs.shape[0] == 0 or outputs.shape[1] == 0:
        raise ValueError(f"{name} must have at least one row and one output, "
                         f"got {outputs.shape}")
    _check_no_overlap("grad", grad, {name: outputs, "targets": targets}, may_be=(name,))


# ---------------------------------------------------------------------------------------
# Locally connected layer.

def _local_shapes(x: np.ndarray, weights: np.ndarray, kernel: object,
                  stride: object) -> tuple[int, int, int]:
    """Check x and weights against kernel and stride; return (out_h, out_w, cout)."""
    kernel = _check_positive_int("kernel", kernel)
    stride = _check_positive_int("stride", stride)
    _, height, width, cin = x.shape
    if height < kernel or width < kernel:
        raise ValueError(f"x's height and width {height}x{width} are smaller than the "
                         f"kernel {kernel}")
    out_h = (height - kernel) // stride + 1
    out_w = (width - kernel) // stride + 1
    cout = weights.shape[3]
    _check_shape("weights", weights, (out_h, out_w, kernel * kernel * cin, cout))
    return out_h, out_w, cout


def local_forward(x: np.ndarray, weights: np.ndarray, out: np.ndarray,
                  kernel: int, stride: int) -> None:
    """Locally connected 2-D layer, no bias: out[n,i,j,:] = patch(n,i,j) @ weights[i,j].

    x (N, H, W, Cin); weights (Ho, Wo, kernel*kernel*Cin, Cout), untied per output
    position; out (N, Ho, Wo, Cout), overwritten. Valid padding: Ho = (H - kernel)//stride
    + 1, likewise Wo. patch(n,i,j) is x[n, i*stride : i*stride+kernel,
    j*stride : j*stride+kernel, :] flattened in (row, col, channel) order.
    """
    _check_float32("x", x, 4)
    _check_float32("weights", weights, 4)
    _check_float32("out", out, 4, writeable=True)
    out_h, out_w, cout = _local_shapes(x, weights, kernel, stride)
    _check_shape("out", out, (x.shape[0], out_h, out_w, cout))
    _check_no_overlap("out", out, {"x": x, "weights": weights})
    _kernels.local_forward(x, weights, out, int(kernel), int(stride))


def local_backward(x: np.ndarray, weights: np.ndarray, dout: np.ndarray,
                   dweights: np.ndarray, dx: np.ndarray | None,
                   kernel: int, stride: int) -> None:
    """Gradients of local_forward. dout (N, Ho, Wo, Cout).

    dweights (same shape as weights) is overwritten with sum_n patch^T dout.
    dx (same shape as x) is overwritten with the input gradient; pass None to skip it
    (first layer). The bias gradient comes from activation_backward's dbias.
    """
    _check_float32("x", x, 4)
    _check_float32("weights", weights, 4)
    _check_float32("dout", dout, 4)
    _check_float32("dweights", dweights, 4, writeable=True)
    out_h, out_w, cout = _local_shapes(x, weights, kernel, stride)
    _check_shape("dout", dout, (x.shape[0], out_h, out_w, cout))
    _check_shape("dweights", dweights, weights.shape)
    inputs = {"x": x, "weights": weights, "dout": dout}
    _check_no_overlap("dweights", dweights, inputs)
    if dx is not None:
        _check_float32("dx", dx, 4, writeable=True)
        _check_shape("dx", dx, x.shape)
        _check_no_overlap("dx", dx, {**inputs, "dweights": dweights})
    _kernels.local_backward(x, weights, dout, dweights, dx, int(kernel), int(stride))


# ---------------------------------------------------------------------------------------
# Convolution (tied weights) by im2col: the copies here, the products by BLAS (layers.Conv).

CONV_PADDINGS = ("valid", "same")


def conv_extent(size: int, kernel: int, stride: int, padding: str) -> tuple[int, int]:
    """(outputs, zeros padded before the first input) of a convolution's window sweep over
    `size` inputs. "valid": windows inside the inputs, (size - kernel) // stride + 1 of
    them. "same": ceil(size / stride) outputs, the inputs padded with the zeros that takes,
    the odd one after (TensorFlow's rule; with stride 1, PyTorch's padding="same")."""
    kernel = _check_positive_int("kernel", kernel)
    stride = _check_positive_int("stride", stride)
    size = _check_positive_int("size", size)
    if padding not in CONV_PADDINGS:
        raise ValueError(f"padding must be one of {CONV_PADDINGS}, got {padding!r}")
    if padding == "valid":
        if size < kernel:
            raise ValueError(f"valid padding needs at least the kernel's {kernel} inputs, "
                             f"got {size}")
        return (size - kernel) // stride + 1, 0
    outputs = -(-size // stride)
    return outputs, max((outputs - 1) * stride + kernel - size, 0) // 2


def _conv_geometry(image: tuple[int, ...], columns: np.ndarray, name: str, kernel: object,
                   stride: object, padding: object) -> tuple[int, int, int, int]:
    """Check `columns` against the image (N, H, W, C); return (pad_top, pad_left, Ho, Wo)."""
    n, height, width, channels = image
    out_h, top = conv_extent(height, kernel, stride, padding)
    out_w, left = conv_extent(width, kernel, stride, padding)
    _check_shape(name, columns, (n * out_h * out_w, kernel * kernel * channels))
    return top, left, out_h, out_w


def im2col(x: np.ndarray, columns: np.ndarray, kernel: int, stride: int,
           padding: str) -> None:
    """A convolution's patches as rows: columns[(n*Ho + i)*Wo + j] = the kernel x kernel
    patch of x[n] at output position (i, j), flattened in (row, column, channel) order
    (as local_forward's), zero where it lies in the padding.

    x (N, H, W, C); columns (N*Ho*Wo, kernel*kernel*C), overwritten; Ho, Wo and the
    padding as conv_extent says.
    """
    _check_float32("x", x, 4)
    _check_float32("columns", columns, 2, writeable=True)
    top, left, out_h, out_w = _conv_geometry(x.shape, columns, "columns", kernel, stride,
                                             padding)
    _check_no_overlap("columns", columns, {"x": x})
    _kernels.im2col(x, columns, int(kernel), int(stride), top, left, out_h, out_w)


def col2im(columns: np.ndarray, dx: np.ndarray, kernel: int, stride: int,
           padding: str) -> None:
    """The adjoint of im2col: dx (N, H, W, C) is overwritten with each row of columns
    (N*Ho*Wo, kernel*kernel*C) added back into its patch (overlapping patches sum; taps
    in the padding are dropped)."""
    _check_float32("columns", columns, 2)
    _check_float32("dx", dx, 4, writeable=True)
    top, left, out_h, out_w = _conv_geometry(dx.shape, columns, "columns", kernel, stride,
                                             padding)
    _check_no_overlap("dx", dx, {"columns": columns})
    _kernels.col2im(columns, dx, int(kernel), int(stride), top, left, out_h, out_w)


# ---------------------------------------------------------------------------------------
# Pooling (max or L2) and local contrast normalization: no parameters.

POOL_MODES = ("max", "l2")


def _pool_shapes(x: np.ndarray, kernel: object, stride: object,
                 mode: object) -> tuple[tuple[int, int, int, int], int]:
    """Check kernel, stride and mode against x; return (out shape, mode code)."""
    kernel = _check_positive_int("kernel", kernel)
    stride = _check_positive_int("stride", stride)
    if mode not in POOL_MODES:
        raise ValueError(f"mode must be one of {POOL_MODES}, got {mode!r}")
    n, height, width, channels = x.shape
    if height < kernel or width < kernel:
        raise ValueError(f"x's height and width {height}x{width} are smaller than the "
                         f"kernel {kernel}")
    shape = (n, (height - kernel) // stride + 1, (width - kernel) // stride + 1, channels)
    return shape, _kernels.POOL_MODES[mode]


def _check_argmax(argmax: object, mode: str, shape: tuple[int, ...], x: np.ndarray,
                  writeable: bool) -> np.ndarray:
    """Max pooling's saved offsets: int32, C-contiguous, one per output."""
    if mode != "max":
        raise ValueError(f"argmax is for mode 'max' only, got mode {mode!r}")
    if not isinstance(argmax, np.ndarray):
        raise TypeError(f"argmax must be a numpy array, got {type(argmax).__name__}")
    if argmax.dtype != np.int32:
        raise TypeError(f"argmax must have dtype int32, got {argmax.dtype}")
    if not argmax.flags.c_contiguous:
        raise ValueError("argmax must be C-contiguous (use np.ascontiguousarray)")
    if writeable and not argmax.flags.writeable:
        raise ValueError("argmax is an output and must be writeable")
    _check_shape("argmax", argmax, shape)
    if math.prod(x.shape[1:]) >= 2 ** 31:
        raise ValueError(f"x's samples ({x.shape[1:]}) have 2^31 elements or more, too "
                         f"many for int32 argmax offsets")
    return argmax


def pool_forward(x: np.ndarray, out: np.ndarray, kernel: int, stride: int,
                 mode: str, argmax: np.ndarray | None = None) -> None:
    """Pooling over kernel x kernel windows, per channel, valid windows (as local_forward).

    x (N, H, W, C); out (N, Ho, Wo, C), overwritten; Ho = (H - kernel)//stride + 1, likewise
    Wo. mode "max": the window's maximum; "l2": the square root of its sum of squares.

    argmax (N, Ho, Wo, C) int32, mode "max" only: if given, it is overwritten with where
    each maximum is, as an offset into its sample x[n] flattened (the first maximum in
    (row, column) order, as PyTorch's max_pool2d). pool_backward needs it.
    """
    _check_float32("x", x, 4)
    _check_float32("out", out, 4, writeable=True)
    shape, code = _pool_shapes(x, kernel, stride, mode)
    _check_shape("out", out, shape)
    _check_no_overlap("out", out, {"x": x})
    if argmax is None:
        _kernels.pool_forward(x, out, int(kernel), int(stride), code)
        return
    _check_argmax(argmax, mode, shape, x, writeable=True)
    _check_no_overlap("argmax", argmax, {"x": x, "out": out})
    _kernels.max_pool_forward_argmax(x, out, argmax, int(kernel), int(stride))


def pool_backward(x: np.ndarray, out: np.ndarray, dout: np.ndarray, dx: np.ndarray,
                  kernel: int, stride: int, mode: str,
                  argmax: np.ndarray | None = None) -> None:
    """Gradient of pool_forward: dx (like x) is overwritten.

    Max: `argmax` is required, as pool_forward wrote it for this x; each output's gradient
    goes to the input it names, and x and out are not read. ValueError if an offset lies
    outside the sample (dx is then incomplete). L2: `out` is pool_forward's output for
    this x; the gradient is dout * x / out, 0 where out is 0.
    """
    _check_float32("x", x, 4)
    _check_float32("out", out, 4)
    _check_float32("dout", dout, 4)
    _check_float32("dx", dx, 4, writeable=True)
    shape, _ = _pool_shapes(x, kernel, stride, mode)
    _check_shape("out", out, shape)
    _check_shape("dout", dout, shape)
    _check_shape("dx", dx, x.shape)
    _check_no_overlap("dx", dx, {"x": x, "out": out, "dout": dout})
    if mode == "l2":
        if argmax is not None:
            _check_argmax(argmax, mode, shape, x, writeable=False)  # raises: max only
        _kernels.l2_pool_backward(x, out, dout, dx, int(kernel), int(stride))
        return
    if argmax is None:
        raise ValueError("max pooling's backward needs the argmax its forward saved: "
                         "pass the same int32 array as argmax= to pool_forward and "
                         "pool_backward")
    _check_argmax(argmax, mode, shape, x, writeable=False)
    _check_no_overlap("dx", dx, {"argmax": argmax})
    n = x.shape[0]
    bad = _kernels.max_pool_backward(argmax.reshape(n, math.prod(shape[1:])),
                                     dout.reshape(n, math.prod(shape[1:])),
                                     dx.reshape(n, math.prod(x.shape[1:])))
    if bad:
        raise ValueError(f"argmax holds {bad} offsets outside x's samples: it was not "
                         f"written by pool_forward for an x of this shape")


def gaussian_window(kernel: int) -> np.ndarray:
    """The LCN's 1-D Gaussian of `kernel` (odd) taps, sigma = (kernel - 1) / 4 (the window
    spans 2 sigma each side), normalised to sum 1; the 2-D window is its outer product."""
    kernel = _check_positive_int("kernel", kernel)
    if kernel % 2 == 0:
        raise ValueError(f"kernel must be odd (a window centred on its pixel), got {kernel}")
    if kernel == 1:
        return np.ones(1, dtype=np.float32)
    sigma = (kernel - 1) / 4.0
    taps = np.arange(kernel, dtype=np.float64) - kernel // 2
    window = np.exp(-taps ** 2 / (2.0 * sigma ** 2))
    return (window / window.sum()).astype(np.float32)


def _lcn_checks(x: np.ndarray, band: np.ndarray, band_name: str, kernel: object,
                floor: object, off: object) -> tuple[np.ndarray, float, int]:
    window = gaussian_window(kernel)
    floor = _check_real("floor", floor)
    if floor <= 0:
        raise ValueError(f"floor must be positive (it bounds the divisor), got {floor}")
    if isinstance(off, bool) or not isinstance(off, (int, np.integer)) or off < 0:
        raise ValueError(f"off must be a non-negative integer, got {off!r}")
    n, rows, width, channels = x.shape
    if band.shape[0] != n or band.shape[2:] != (width, channels) or off + band.shape[1] > rows:
        raise ValueError(f"{band_name} must be (N, rows, W, C) = ({n}, <= {rows - off}, "
                         f"{width}, {channels}) for x {x.shape} and off {off}, "
                         f"got {band.shape}")
    return window, floor, int(off)


def lcn_forward(x: np.ndarray, out: np.ndarray, kernel: int, floor: float,
                off: int = 0) -> None:
    """Local contrast normalization (Jarrett et al. 2009), same size, zero padding:
    v = x - the Gaussian-weighted mean over a kernel x kernel window and all channels,
    out = v / max(the weighted standard deviation of v likewise, floor).

    x (N, H, W, C) and out (N, H, W, C), off = 0, for whole images. For a row band (model
    parallelism) x holds the image rows out's band reads (out's rows widened by kernel - 1
    each side, clipped to the image) and out's first row is x's row `off`.
    """
    _check_float32("x", x, 4)
    _check_float32("out", out, 4, writeable=True)
    window, floor, off = _lcn_checks(x, out, "out", kernel, floor, off)
    _check_no_overlap("out", out, {"x": x})
    _kernels.lcn_forward(x, out, window, floor, off)


def lcn_backward(x: np.ndarray, dout: np.ndarray, dx: np.ndarray, kernel: int,
                 floor: float, off: int = 0) -> None:
    """Gradient of lcn_forward with the same x, kernel, floor and off: dx (like x) is
    overwritten, including the halo rows of a band (their share goes to their owner)."""
    _check_float32("x", x, 4)
    _check_float32("dout", dout, 4)
    _check_float32("dx", dx, 4, writeable=True)
    window, floor, off = _lcn_checks(x, dout, "dout", kernel, floor, off)
    _check_shape("dx", dx, x.shape)
    _check_no_overlap("dx", dx, {"x": x, "dout": dout})
    _kernels.lcn_backward(x, dout, dx, window, floor, off)


# ---------------------------------------------------------------------------------------
# Dropout and layer normalization.

def _check_rate(rate: object) -> float:
    rate = _check_real("rate", rate)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"rate must be at least 0 and below 1, got {rate}")
    return rate


def dropout(x: np.ndarray, draws: np.ndarray, rate: float, out: np.ndarray) -> None:
    """Inverted dropout: out = x / (1 - rate) where draws >= rate, else 0. x, draws, out
    (N, U); draws uniform in [0, 1) (one per unit, e.g. Generator.random). The backward is
    the same call on the output's gradient with the same draws. out may be x itself."""
    _check_float32("x", x, 2)
    _check_float32("draws", draws, 2)
    _check_float32("out", out, 2, writeable=True)
    _check_shape("draws", draws, x.shape)
    _check_shape("out", out, x.shape)
    rate = _check_rate(rate)
    _check_no_overlap("out", out, {"x": x, "draws": draws}, may_be=("x",))
    _kernels.dropout(x, draws, rate, 1.0 / (1.0 - rate), out)


LAYERNORM_EPS = 1e-5
"""Added to the variance under the square root (PyTorch's LayerNorm default)."""


def _check_layernorm(x: np.ndarray, gain: np.ndarray, bias_name: str, bias: np.ndarray,
                     eps: object) -> float:
    _check_float32("x", x, 2)
    _check_float32("gain", gain, 1)
    _check_float32(bias_name, bias, 1)
    _check_shape("gain", gain, (x.shape[1],))
    _check_shape(bias_name, bias, (x.shape[1],))
    eps = _check_real("eps", eps)
    if eps <= 0:
        raise ValueError(f"eps must be positive, got {eps}")
    return eps


def layernorm_forward(x: np.ndarray, gain: np.ndarray, bias: np.ndarray, out: np.ndarray,
                      eps: float = LAYERNORM_EPS) -> None:
    """Layer normalization per row: out = gain * (x - mean) / sqrt(var + eps) + bias, the
    mean and (biased) variance over the row's U features. x, out (N, U); gain, bias (U,)."""
    eps = _check_layernorm(x, gain, "bias", bias, eps)
    _check_float32("out", out, 2, writeable=True)
    _check_shape("out", out, x.shape)
    _check_no_overlap("out", out, {"x": x, "gain": gain, "bias": bias})
    _kernels.layernorm_forward(x, gain, bias, eps, out)


def layernorm_backward(x: np.ndarray, gain: np.ndarray, dout: np.ndarray,
                       dgain: np.ndarray, dbias: np.ndarray, dx: np.ndarray | None,
                       eps: float = LAYERNORM_EPS) -> None:
    """Gradients of layernorm_forward for the same x, gain and eps: dgain and dbias (U,)
    are overwritten with their sums over the batch, dx (N, U) with the input gradient
    (None skips it)."""
    eps = _check_layernorm(x, gain, "dgain", dgain, eps)
    _check_float32("dout", dout, 2)
    _check_shape("dout", dout, x.shape)
    _check_float32("dgain", dgain, 1, writeable=True)
    _check_float32("dbias", dbias, 1, writeable=True)
    _check_shape("dbias", dbias, gain.shape)
    inputs = {"x": x, "gain": gain, "dout": dout}
    _check_no_overlap("dgain", dgain, {**inputs, "dbias": dbias})
    _check_no_overlap("dbias", dbias, inputs)
    if dx is not None:
        _check_float32("dx", dx, 2, writeable=True)
        _check_shape("dx", dx, x.shape)
        _check_no_overlap("dx", dx, {**inputs, "dgain": dgain, "dbias": dbias})
    _kernels.layernorm_backward(x, gain, dout, eps, dgain, dbias, dx)
