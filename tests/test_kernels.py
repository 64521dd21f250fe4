"""The compiled kernels against plain numpy references (float64), their input validation,
and the missing/stale extension checks.

Outputs are pre-filled with NaN so a test fails if a kernel leaves any element unwritten.
"""

from __future__ import annotations

import ast
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from distbelief.model import _kernels, kernels

REPO = Path(__file__).resolve().parents[1]
RTOL = 1e-5
ATOL = 1e-6


def randn(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def nan_like(a: np.ndarray) -> np.ndarray:
    return np.full_like(a, np.nan)


# ---------------------------------------------------------------------------------------
# Optimizer updates

SIZES = [0, 1, 3, 17, 1000, 4103]


@pytest.mark.parametrize("size", SIZES)
def test_adagrad_update_matches_reference(size: int) -> None:
    rng = np.random.default_rng(size)
    params = randn(rng, size)
    accum = np.abs(randn(rng, size))
    grad = randn(rng, size, scale=3.0)
    grad[: size // 5] = 0.0  # zero gradients on a zero accumulator must not give NaN
    accum[: size // 10] = 0.0
    lr, eps = 0.03, 1e-10
    acc64 = accum.astype(np.float64) + grad.astype(np.float64) ** 2
    expected = params - lr * grad / (np.sqrt(acc64) + eps)

    kernels.adagrad_update(params, accum, grad, lr, eps)
    np.testing.assert_allclose(accum, acc64, rtol=1e-6)
    np.testing.assert_allclose(params, expected, rtol=RTOL, atol=ATOL)
    assert np.all(np.isfinite(params))


def test_adagrad_update_on_unaligned_slices_and_read_only_grad() -> None:
    # Shards update sub-ranges that start at any element; the gradient may be read-only
    # (a received buffer).
    rng = np.random.default_rng(7)
    flat, acc_flat, grad_flat = randn(rng, 1001), np.zeros(1001, np.float32), randn(rng, 1001)
    grad_flat.flags.writeable = False
    before = flat.copy()
    kernels.adagrad_update(flat[3:998], acc_flat[3:998], grad_flat[3:998], 0.1)
    g = grad_flat[3:998].astype(np.float64)
    np.testing.assert_allclose(flat[3:998], before[3:998] - 0.1 * g / (np.abs(g) + 1e-10),
                               rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(flat[:3], before[:3])
    np.testing.assert_array_equal(flat[998:], before[998:])
    np.testing.assert_array_equal(acc_flat[:3], 0.0)


@pytest.mark.parametrize("size", SIZES)
def test_sgd_update_matches_reference(size: int) -> None:
    rng = np.random.default_rng(size + 100)
    params, grad = randn(rng, size), randn(rng, size)
    expected = params.astype(np.float64) - 0.25 * grad
    kernels.sgd_update(params, grad, 0.25)
    np.testing.assert_allclose(params, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("size", SIZES)
def test_updates_with_a_copy_write_the_new_params_twice_bit_for_bit(size: int) -> None:
    # The copy (a Downpour replica's fetch in the same pass) must be exactly what the
    # update without a copy leaves in params.
    rng = np.random.default_rng(size + 200)
    params, accum, grad = randn(rng, size), np.abs(randn(rng, size)), randn(rng, size)
    plain_p, plain_a = params.copy(), accum.copy()
    kernels.adagrad_update(plain_p, plain_a, grad, 0.03)
    copy = nan_like(params)
    kernels.adagrad_update(params, accum, grad, 0.03, copy=copy)
    assert np.array_equal(params, plain_p) and np.array_equal(accum, plain_a)
    assert np.array_equal(copy, params)
    plain = params.copy()
    kernels.sgd_update(plain, grad, 0.5)
    copy = nan_like(params)
    kernels.sgd_update(params, grad, 0.5, copy=copy)
    assert np.array_equal(params, plain) and np.array_equal(copy, params)


def test_a_copy_that_overlaps_or_does_not_fit_is_refused() -> None:
    rng = np.random.default_rng(9)
    params, accum, grad = randn(rng, 10), np.zeros(10, np.float32), randn(rng, 10)
    with pytest.raises(ValueError, match="copy"):
        kernels.adagrad_update(params, accum, grad, 0.1, copy=accum)
    with pytest.raises(ValueError, match="copy"):
        kernels.sgd_update(params, grad, 0.1, copy=np.zeros(9, np.float32))


# ---------------------------------------------------------------------------------------
# Bias + activation and its derivative

def ref_activation(z: np.ndarray, activation: str) -> np.ndarray:
    return {"linear": lambda v: v,
            "relu": lambda v: np.maximum(v, 0.0),
            "sigmoid": lambda v: 1.0 / (1.0 + np.exp(-v)),
            "tanh": np.tanh}[activation](z)


def ref_derivative(z: np.ndarray, activation: str) -> np.ndarray:
    """act'(z), written in terms of z (the kernel uses the output instead)."""
    if activation == "linear":
        return np.ones_like(z)
    if activation == "relu":
        return (z > 0).astype(np.float64)
    if activation == "sigmoid":
        s = 1.0 / (1.0 + np.exp(-z))
        return s * (1.0 - s)
    return 1.0 - np.tanh(z) ** 2


SHAPES_2D = [(1, 1), (3, 7), (64, 10), (5, 33), (0, 4)]


@pytest.mark.parametrize("activation", kernels.ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES_2D)
def test_bias_activation_matches_reference(activation: str, shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(sum(shape))
    z = randn(rng, *shape, scale=3.0)
    bias = randn(rng, shape[1])
    expected = ref_activation(z.astype(np.float64) + bias, activation)
    kernels.bias_activation(z, bias, activation)
    np.testing.assert_allclose(z, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("activation", ["sigmoid", "tanh"])
def test_bias_activation_saturates_without_overflow(activation: str) -> None:
    z = np.array([[-1000.0, -90.0, 0.0, 90.0, 1000.0]], np.float32)
    with np.errstate(over="ignore"):  # the float64 reference's exp(1000) is inf, fine
        expected = ref_activation(z.astype(np.float64), activation)
    kernels.bias_activation(z, np.zeros(5, np.float32), activation)
    assert np.all(np.isfinite(z))
    np.testing.assert_allclose(z, expected, atol=ATOL)


def _backward_case(activation: str, shape: tuple[int, int], seed: int):
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(shape) * 2.0
    out = ref_activation(z, activation).astype(np.float32)
    dout = randn(rng, *shape)
    dz_expected = dout * ref_derivative(z, activation)
    return out, dout, dz_expected


@pytest.mark.parametrize("activation", kernels.ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES_2D)
def test_activation_backward_matches_reference(activation: str,
                                               shape: tuple[int, int]) -> None:
    out, dout, dz_expected = _backward_case(activation, shape, seed=sum(shape) + 1)
    dz, dbias = nan_like(dout), np.full(shape[1], np.nan, np.float32)
    kernels.activation_backward(out, dout, activation, dz, dbias)
    # Derivatives from the float32 output, not from z: tolerance for that rounding.
    np.testing.assert_allclose(dz, dz_expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dbias, dz.astype(np.float64).sum(axis=0), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("activation", kernels.ACTIVATIONS)
def test_activation_backward_in_place_and_without_dbias(activation: str) -> None:
    out, dout, dz_expected = _backward_case(activation, (9, 13), seed=5)
    separate = nan_like(dout)
    kernels.activation_backward(out, dout, activation, separate)  # dbias=None path
    np.testing.assert_allclose(separate, dz_expected, rtol=1e-4, atol=1e-5)

    dbias = np.full(13, np.nan, np.float32)
    kernels.activation_backward(out, dout, activation, dout, dbias)  # dz is dout
    np.testing.assert_array_equal(dout, separate)
    np.testing.assert_allclose(dbias, separate.astype(np.float64).sum(axis=0), rtol=1e-5,
                               atol=1e-5)


def test_activation_backward_empty_batch_zeroes_dbias() -> None:
    out = np.zeros((0, 4), np.float32)
    dbias = np.full(4, np.nan, np.float32)
    kernels.activation_backward(out, out.copy(), "relu", out.copy(), dbias)
    np.testing.assert_array_equal(dbias, 0.0)


# ---------------------------------------------------------------------------------------
# Softmax cross-entropy

def ref_softmax_ce(logits: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    x = logits.astype(np.float64)
    shifted = x - x.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(shifted).sum(axis=1))
    rows = np.arange(len(labels))
    loss = float(np.mean(log_z - shifted[rows, labels]))
    grad = np.exp(shifted - log_z[:, None])
    grad[rows, labels] -= 1.0
    return loss, grad / len(labels)


@pytest.mark.parametrize("shape", [(1, 1), (1, 10), (64, 10), (7, 3), (33, 101)])
@pytest.mark.parametrize("label_dtype", [np.int64, np.int32, np.uint8, np.int16])
def test_softmax_cross_entropy_matches_reference(shape: tuple[int, int],
                                                 label_dtype: type) -> None:
    rng = np.random.default_rng(shape[0] * 1000 + shape[1])
    logits = randn(rng, *shape, scale=4.0)
    labels = rng.integers(0, shape[1], shape[0]).astype(label_dtype)
    loss_expected, grad_expected = ref_softmax_ce(logits, labels)
    grad = nan_like(logits)
    loss = kernels.softmax_cross_entropy(logits, labels, grad)
    assert isinstance(loss, float)
    assert loss == pytest.approx(loss_expected, rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(grad, grad_expected, rtol=1e-4, atol=1e-7)


def test_softmax_cross_entropy_in_place_and_stable() -> None:
    # Logits of 1e4 overflow a naive exp; grad is written over logits.
    logits = np.array([[1e4, 0.0, -1e4], [5.0, 5.0, 5.0], [-3e4, -3e4 + 2.0, -3e4]],
                      np.float32)
    labels = np.array([1, 2, 1])
    loss_expected, grad_expected = ref_softmax_ce(logits, labels)
    loss = kernels.softmax_cross_entropy(logits, labels, logits)
    assert np.isfinite(loss)
    assert loss == pytest.approx(loss_expected, rel=1e-6)
    np.testing.assert_allclose(logits, grad_expected, rtol=1e-5, atol=1e-7)


def test_softmax_cross_entropy_gradient_is_finite_difference_of_loss() -> None:
    rng = np.random.default_rng(11)
    logits = randn(rng, 4, 5)
    labels = rng.integers(0, 5, 4)
    grad = nan_like(logits)
    kernels.softmax_cross_entropy(logits, labels, grad)
    x = logits.astype(np.float64)
    h = 1e-5
    numeric = np.empty_like(x)
    for idx in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[idx] += h
        minus[idx] -= h
        numeric[idx] = (ref_softmax_ce(plus, labels)[0] - ref_softmax_ce(minus, labels)[0]) / (
            2 * h)
    np.testing.assert_allclose(grad, numeric, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------
# Locally connected layer

def ref_patches(x: np.ndarray, kernel: int, stride: int) -> np.ndarray:
    """(N, Ho, Wo, kernel*kernel*Cin) patches in (row, col, channel) order, float64."""
    n, h, w, c = x.shape
    out_h, out_w = (h - kernel) // stride + 1, (w - kernel) // stride + 1
    patches = np.empty((n, out_h, out_w, kernel * kernel * c))
    for i in range(out_h):
        for j in range(out_w):
            block = x[:, i * stride: i * stride + kernel, j * stride: j * stride + kernel, :]
            patches[:, i, j] = block.reshape(n, -1)
    return patches


def ref_local_forward(x, weights, kernel, stride) -> np.ndarray:
    return np.einsum("nijr,ijro->nijo", ref_patches(x.astype(np.float64), kernel, stride),
                     weights.astype(np.float64))


def ref_local_backward(x, weights, dout, kernel, stride) -> tuple[np.ndarray, np.ndarray]:
    patches = ref_patches(x.astype(np.float64), kernel, stride)
    dweights = np.einsum("nijr,nijo->ijro", patches, dout.astype(np.float64))
    dpatches = np.einsum("ijro,nijo->nijr", weights.astype(np.float64), dout)
    dx = np.zeros(x.shape)
    n, c = x.shape[0], x.shape[3]
    for i in range(dout.shape[1]):
        for j in range(dout.shape[2]):
            dx[:, i * stride: i * stride + kernel, j * stride: j * stride + kernel, :] += (
                dpatches[:, i, j].reshape(n, kernel, kernel, c))
    return dweights, dx


# (N, H, W, Cin, kernel, stride, Cout): odd sizes, stride 2 and 3 with uncovered edge
# pixels, one output position, a Fashion-MNIST-sized first layer, and stride = kernel.
LOCAL_CASES = [
    (1, 3, 3, 1, 3, 1, 1),
    (2, 7, 9, 3, 3, 2, 5),
    (3, 8, 8, 2, 3, 2, 7),
    (2, 10, 11, 4, 4, 3, 16),
    (1, 6, 5, 5, 2, 1, 33),
    (5, 9, 9, 3, 3, 1, 9),     # full and partial register tiles in every direction
    (4, 28, 28, 1, 5, 2, 8),
    (6, 8, 8, 16, 4, 4, 12),   # R = 256 floats: a power-of-two row in the packed blocks
]


def _local_inputs(case, seed=0):
    n, h, w, cin, kernel, stride, cout = case
    rng = np.random.default_rng(seed + sum(case))
    out_h, out_w = (h - kernel) // stride + 1, (w - kernel) // stride + 1
    x = randn(rng, n, h, w, cin)
    weights = randn(rng, out_h, out_w, kernel * kernel * cin, cout, scale=0.3)
    dout = randn(rng, n, out_h, out_w, cout)
    return x, weights, dout, kernel, stride


@pytest.mark.parametrize("case", LOCAL_CASES)
def test_local_forward_matches_reference(case) -> None:
    x, weights, dout, kernel, stride = _local_inputs(case)
    out = nan_like(dout)
    kernels.local_forward(x, weights, out, kernel, stride)
    np.testing.assert_allclose(out, ref_local_forward(x, weights, kernel, stride),
                               rtol=RTOL, atol=1e-5)


@pytest.mark.parametrize("case", LOCAL_CASES)
def test_local_backward_matches_reference(case) -> None:
    x, weights, dout, kernel, stride = _local_inputs(case, seed=1)
    dweights_expected, dx_expected = ref_local_backward(x, weights, dout, kernel, stride)
    dweights, dx = nan_like(weights), nan_like(x)
    kernels.local_backward(x, weights, dout, dweights, dx, kernel, stride)
    np.testing.assert_allclose(dweights, dweights_expected, rtol=RTOL, atol=1e-5)
    np.testing.assert_allclose(dx, dx_expected, rtol=RTOL, atol=1e-5)

    dweights_only = nan_like(weights)
    kernels.local_backward(x, weights, dout, dweights_only, None, kernel, stride)
    np.testing.assert_array_equal(dweights_only, dweights)


def test_local_backward_is_finite_difference_of_reference_forward() -> None:
    # The loss sum(forward(x, w) * dout) has gradients (dx, dweights). Central differences
    # of the float64 reference forward check the kernel against the definition itself.
    x, weights, dout, kernel, stride = _local_inputs((2, 7, 6, 2, 3, 2, 3), seed=2)
    dweights, dx = nan_like(weights), nan_like(x)
    kernels.local_backward(x, weights, dout, dweights, dx, kernel, stride)
    x64, w64, g64 = x.astype(np.float64), weights.astype(np.float64), dout.astype(np.float64)

    def loss(xv, wv):
        return float(np.sum(ref_local_forward(xv, wv, kernel, stride) * g64))

    h = 1e-3
    rng = np.random.default_rng(3)
    for _ in range(25):
        idx = tuple(int(rng.integers(0, s)) for s in x.shape)
        plus, minus = x64.copy(), x64.copy()
        plus[idx] += h
        minus[idx] -= h
        numeric = (loss(plus, w64) - loss(minus, w64)) / (2 * h)
        assert dx[idx] == pytest.approx(numeric, rel=1e-4, abs=1e-5)
    for _ in range(25):
        idx = tuple(int(rng.integers(0, s)) for s in weights.shape)
        plus, minus = w64.copy(), w64.copy()
        plus[idx] += h
        minus[idx] -= h
        numeric = (loss(x64, plus) - loss(x64, minus)) / (2 * h)
        assert dweights[idx] == pytest.approx(numeric, rel=1e-4, abs=1e-5)
    # Column 5 (W=6, kernel 3, stride 2) lies in no patch: its gradient is exactly zero.
    np.testing.assert_array_equal(dx[:, :, 5, :], 0.0)


def test_local_backward_empty_batch_zeroes_dweights() -> None:
    x, weights, dout, kernel, stride = _local_inputs((0, 5, 5, 1, 3, 1, 2))
    dweights = nan_like(weights)
    kernels.local_backward(x, weights, dout, dweights, nan_like(x), kernel, stride)
    np.testing.assert_array_equal(dweights, 0.0)


# ---------------------------------------------------------------------------------------
# Validation

def _f32(*shape: int) -> np.ndarray:
    return np.zeros(shape, np.float32)


def test_optimizer_updates_reject_bad_input() -> None:
    p = _f32(8)
    with pytest.raises(TypeError, match="params must have dtype float32"):
        kernels.adagrad_update(p.astype(np.float64), _f32(8), _f32(8), 0.1)
    with pytest.raises(TypeError, match="numpy array"):
        kernels.adagrad_update([0.0] * 8, _f32(8), _f32(8), 0.1)
    with pytest.raises(ValueError, match="grad must have shape"):
        kernels.adagrad_update(p, _f32(8), _f32(9), 0.1)
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.adagrad_update(_f32(16)[::2], _f32(8), _f32(8), 0.1)
    with pytest.raises(ValueError, match="1-D"):
        kernels.adagrad_update(_f32(2, 4), _f32(2, 4), _f32(2, 4), 0.1)
    with pytest.raises(ValueError, match="finite"):
        kernels.adagrad_update(p, _f32(8), _f32(8), float("nan"))
    with pytest.raises(TypeError, match="eps must be a real number"):
        kernels.adagrad_update(p, _f32(8), _f32(8), 0.1, eps="1e-10")
    with pytest.raises(ValueError, match="params must not overlap accum"):
        both = _f32(16)
        kernels.adagrad_update(both[:8], both[4:12], _f32(8), 0.1)
    with pytest.raises(ValueError, match="writeable"):
        ro = _f32(8)
        ro.flags.writeable = False
        kernels.sgd_update(ro, _f32(8), 0.1)
    with pytest.raises(TypeError, match="grad must have dtype float32"):
        kernels.sgd_update(p, np.zeros(8, np.float16), 0.1)


def test_activation_kernels_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="activation must be one of"):
        kernels.bias_activation(_f32(2, 3), _f32(3), "softplus")
    with pytest.raises(ValueError, match="bias must have shape"):
        kernels.bias_activation(_f32(2, 3), _f32(4), "relu")
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.bias_activation(_f32(3, 2).T, _f32(3), "relu")
    with pytest.raises(TypeError, match="z must have dtype float32"):
        kernels.bias_activation(np.zeros((2, 3)), _f32(3), "relu")
    with pytest.raises(ValueError, match="activation must be one of"):
        kernels.activation_backward(_f32(2, 3), _f32(2, 3), "Relu", _f32(2, 3))
    with pytest.raises(ValueError, match="dz must have shape"):
        kernels.activation_backward(_f32(2, 3), _f32(2, 3), "relu", _f32(3, 2))
    with pytest.raises(ValueError, match="dbias must have shape"):
        kernels.activation_backward(_f32(2, 3), _f32(2, 3), "relu", _f32(2, 3), _f32(2))
    shared = _f32(3, 3)
    with pytest.raises(ValueError, match="dz must not overlap dout"):
        kernels.activation_backward(_f32(2, 3), shared[:2], "relu", shared[1:])


def test_softmax_cross_entropy_rejects_bad_input() -> None:
    logits = _f32(3, 4)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 4\), got 4"):
        kernels.softmax_cross_entropy(logits, np.array([0, 4, 1]), _f32(3, 4))
    with pytest.raises(ValueError, match=r"labels must be in \[0, 4\), got -1"):
        kernels.softmax_cross_entropy(logits, np.array([0, -1, 1]), _f32(3, 4))
    with pytest.raises(ValueError, match="got 4294967296"):
        # Range is checked before the int32 cast, so a huge label cannot wrap to 0.
        kernels.softmax_cross_entropy(logits, np.array([0, 2**32, 1]), _f32(3, 4))
    with pytest.raises(TypeError, match="integer dtype"):
        kernels.softmax_cross_entropy(logits, np.array([0.0, 1.0, 2.0]), _f32(3, 4))
    with pytest.raises(ValueError, match="labels must have shape"):
        kernels.softmax_cross_entropy(logits, np.array([0, 1]), _f32(3, 4))
    with pytest.raises(ValueError, match="grad must have shape"):
        kernels.softmax_cross_entropy(logits, np.array([0, 1, 2]), _f32(4, 3))
    with pytest.raises(ValueError, match="at least one row"):
        kernels.softmax_cross_entropy(_f32(0, 4), np.zeros(0, np.int64), _f32(0, 4))


def test_local_kernels_reject_bad_input() -> None:
    x, weights, out = _f32(2, 7, 7, 1), _f32(3, 3, 9, 4), _f32(2, 3, 3, 4)
    kernels.local_forward(x, weights, out, 3, 2)  # the valid call, for contrast
    with pytest.raises(ValueError, match="weights must have shape"):
        kernels.local_forward(x, weights, out, 3, 1)
    with pytest.raises(ValueError, match="out must have shape"):
        kernels.local_forward(x, weights, _f32(2, 3, 3, 5), 3, 2)
    with pytest.raises(ValueError, match="smaller than the kernel"):
        kernels.local_forward(x, weights, out, 8, 2)
    with pytest.raises(ValueError, match="stride must be at least 1"):
        kernels.local_forward(x, weights, out, 3, 0)
    with pytest.raises(TypeError, match="kernel must be an integer"):
        kernels.local_forward(x, weights, out, 3.0, 2)
    with pytest.raises(TypeError, match="x must have dtype float32"):
        kernels.local_forward(x.astype(np.float64), weights, out, 3, 2)
    with pytest.raises(ValueError, match="x must be 4-D"):
        kernels.local_forward(x[0], weights, out, 3, 2)
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.local_forward(_f32(2, 7, 14, 1)[:, :, ::2], weights, out, 3, 2)
    with pytest.raises(ValueError, match="dout must have shape"):
        kernels.local_backward(x, weights, _f32(2, 3, 3, 3), _f32(3, 3, 9, 4), None, 3, 2)
    with pytest.raises(ValueError, match="dx must have shape"):
        kernels.local_backward(x, weights, out, _f32(3, 3, 9, 4), _f32(2, 7, 7, 2), 3, 2)
    with pytest.raises(ValueError, match="dweights must not overlap weights"):
        kernels.local_backward(x, weights, out, weights, None, 3, 2)


# ---------------------------------------------------------------------------------------
# Missing or stale extension

def _setup_source_hash(pyx_dir: Path) -> str:
    """Run setup.py's own source_hash() (without running setup()) on pyx_dir."""
    tree = ast.parse((REPO / "setup.py").read_text())
    func = next(node for node in tree.body
                if isinstance(node, ast.FunctionDef) and node.name == "source_hash")
    namespace = {"hashlib": hashlib, "PYX_DIR": pyx_dir}
    # Runs only setup.py's own source_hash(), so this test cannot drift from the build.
    code = compile(ast.Module(body=[func], type_ignores=[]), "setup.py", "exec")
    exec(code, namespace)  # noqa: S102
    return namespace["source_hash"]()


def test_source_hash_agrees_with_setup_and_the_build() -> None:
    assert kernels.pyx_source_hash(kernels.PYX_DIR) == _setup_source_hash(kernels.PYX_DIR)
    assert kernels.pyx_source_hash(kernels.PYX_DIR) == _kernels.SOURCE_HASH


def test_stale_kernels_are_detected(tmp_path: Path) -> None:
    pyx_dir = tmp_path / "pyx"
    shutil.copytree(kernels.PYX_DIR, pyx_dir, ignore=shutil.ignore_patterns("*.c", "*.html"))
    compiled = _setup_source_hash(pyx_dir)
    kernels.check_kernels_current(pyx_dir, compiled)  # unchanged sources pass

    source = next(pyx_dir.glob("*.pyx"))
    source.write_text(source.read_text() + "\n# edited\n")
    with pytest.raises(ImportError, match=r"pip install -e \."):
        kernels.check_kernels_current(pyx_dir, compiled)

    source.write_text(source.read_text().removesuffix("\n# edited\n"))
    kernels.check_kernels_current(pyx_dir, compiled)
    (pyx_dir / "extra.pxd").write_text("cdef int x\n")  # a new .pxd counts too
    with pytest.raises(ImportError, match="older than the sources"):
        kernels.check_kernels_current(pyx_dir, compiled)


def test_no_pyx_folder_means_nothing_to_compare(tmp_path: Path) -> None:
    kernels.check_kernels_current(tmp_path / "absent", "any hash")


def test_missing_extension_names_the_fix() -> None:
    code = ("import sys; sys.modules['distbelief.model._kernels'] = None\n"
            "import distbelief.model.kernels")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode != 0
    assert ("ImportError: The compiled kernels (distbelief.model._kernels) are missing"
            in proc.stderr)
    assert "pip install -e ." in proc.stderr
