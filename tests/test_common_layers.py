"""The layers a researcher's own model expects besides the paper's: convolution (tied
weights, by im2col), dropout and layer normalization.

Kernels against float64 numpy references and finite differences, and the conv layer
against PyTorch's conv2d; the layers inside a Network (gradients by finite differences,
conv -> dense through the implicit flatten, config keys and errors); dropout's masks keyed
on (seed, step), identity in evaluation, and a resumed sgd run that trains bit for bit as
an uninterrupted one; and the refusal of model parallelism for these layers.
"""

from __future__ import annotations

import numpy as np
import pytest

from distbelief.model import kernels


def randn(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------------------
# float64 references, written from the definitions


def pads(size: int, kernel: int, stride: int, padding: str) -> tuple[int, int, int]:
    """(outputs, zeros before, zeros after): TensorFlow's "same", or "valid"."""
    if padding == "valid":
        return (size - kernel) // stride + 1, 0, 0
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return out, total // 2, total - total // 2


def ref_columns(x: np.ndarray, kernel: int, stride: int, padding: str) -> np.ndarray:
    n, h, w, c = x.shape
    out_h, top, bottom = pads(h, kernel, stride, padding)
    out_w, left, right = pads(w, kernel, stride, padding)
    padded = np.pad(x.astype(np.float64), ((0, 0), (top, bottom), (left, right), (0, 0)))
    cols = np.empty((n, out_h, out_w, kernel * kernel * c))
    for i in range(out_h):
        for j in range(out_w):
            patch = padded[:, i * stride:i * stride + kernel, j * stride:j * stride + kernel]
            cols[:, i, j] = patch.reshape(n, -1)
    return cols.reshape(n * out_h * out_w, -1)


def ref_conv(x, weights, bias, kernel, stride, padding):
    """(N, Ho, Wo, F) in float64, no activation."""
    n, h, w, _ = x.shape
    out_h, out_w = pads(h, kernel, stride, padding)[0], pads(w, kernel, stride, padding)[0]
    filters = weights.shape[-1]
    out = ref_columns(x, kernel, stride, padding) @ weights.reshape(-1, filters) + bias
    return out.reshape(n, out_h, out_w, filters)


def ref_layernorm(x, gain, bias, eps=kernels.LAYERNORM_EPS):
    x = x.astype(np.float64)
    mean = x.mean(axis=1, keepdims=True)
    var = x.var(axis=1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gain + bias


CONV_CASES = [  # (N, H, W, Cin, kernel, stride, padding)
    (2, 7, 6, 3, 3, 1, "same"),
    (2, 9, 8, 2, 4, 2, "same"),     # even kernel: the odd zero after
    (3, 8, 9, 2, 3, 2, "valid"),
    (1, 5, 5, 1, 5, 3, "same"),
    (2, 4, 4, 2, 6, 1, "same"),     # kernel wider than the image: every window padded
    (2, 10, 7, 5, 2, 3, "valid"),   # stride > kernel: inputs no window reads
]


# ---------------------------------------------------------------------------------------
# Kernels


def test_conv_extent_is_tensorflows_same_and_valid():
    assert kernels.conv_extent(28, 5, 1, "same") == (28, 2)
    assert kernels.conv_extent(28, 5, 1, "valid") == (24, 0)
    assert kernels.conv_extent(9, 4, 2, "same") == (5, 1)   # 3 zeros: 1 before, 2 after
    assert kernels.conv_extent(7, 2, 2, "same") == (4, 0)   # 1 zero, after
    assert kernels.conv_extent(10, 2, 3, "valid") == (3, 0)
    with pytest.raises(ValueError, match="padding must be one of"):
        kernels.conv_extent(8, 3, 1, "full")
    with pytest.raises(ValueError, match="at least the kernel"):
        kernels.conv_extent(4, 5, 1, "valid")


@pytest.mark.parametrize("case", CONV_CASES)
def test_im2col_and_col2im_match_references(case):
    n, h, w, c, k, s, padding = case
    rng = np.random.default_rng(0)
    x = randn(rng, n, h, w, c)
    want = ref_columns(x, k, s, padding)
    columns = np.full(want.shape, np.nan, dtype=np.float32)
    kernels.im2col(x, columns, k, s, padding)
    np.testing.assert_array_equal(columns, want.astype(np.float32))
    # col2im is the adjoint: <im2col(x), g> == <x, col2im(g)>, for every x; so it is the
    # transpose of the copy, which scatters each row back into its patch.
    g = randn(rng, *columns.shape)
    dx = np.full_like(x, np.nan)
    kernels.col2im(g, dx, k, s, padding)
    eye_dx = np.zeros(x.size)
    for at in rng.choice(x.size, 25, replace=False):
        probe = np.zeros(x.size)
        probe[at] = 1.0
        eye_dx[at] = np.sum(ref_columns(probe.reshape(x.shape), k, s, padding) * g)
        assert dx.reshape(-1)[at] == pytest.approx(eye_dx[at], rel=1e-5, abs=1e-5)
    assert float(np.sum(want * g)) == pytest.approx(float(np.sum(x * dx.astype(np.float64))),
                                                    rel=1e-5)


def test_conv_kernels_reject_bad_input():
    x = np.zeros((2, 6, 6, 3), dtype=np.float32)
    columns = np.zeros((2 * 36, 27), dtype=np.float32)
    with pytest.raises(ValueError, match="columns must have shape"):
        kernels.im2col(x, columns, 3, 1, "valid")
    with pytest.raises(ValueError, match="padding"):
        kernels.im2col(x, columns, 3, 1, "SAME")
    with pytest.raises(TypeError, match="float32"):
        kernels.im2col(x.astype(np.float64), columns, 3, 1, "same")
    shared = np.zeros(9 * 27, dtype=np.float32)  # a 3x3x3 image's columns, and the image
    with pytest.raises(ValueError, match="overlap"):
        kernels.col2im(shared.reshape(9, 27), shared[:27].reshape(1, 3, 3, 3), 3, 1, "same")
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.col2im(columns[:, ::-1], x, 3, 1, "same")


def test_dropout_kernel_keeps_the_draws_at_least_rate_and_scales_them():
    rng = np.random.default_rng(1)
    x = randn(rng, 50, 40)
    draws = rng.random((50, 40), dtype=np.float32)
    out = np.full_like(x, np.nan)
    kernels.dropout(x, draws, 0.3, out)
    kept = draws >= np.float32(0.3)
    np.testing.assert_allclose(out[kept], x[kept] / 0.7, rtol=1e-6)
    assert np.all(out[~kept] == 0.0) and 0.25 < 1 - kept.mean() < 0.35
    kernels.dropout(x, draws, 0.3, x)   # in place
    np.testing.assert_array_equal(x, out)
    with pytest.raises(ValueError, match="rate"):
        kernels.dropout(x, draws, 1.0, out)
    with pytest.raises(ValueError, match="overlap"):
        kernels.dropout(x, draws, 0.3, draws)


@pytest.mark.parametrize("shape", [(3, 1), (4, 7), (2, 1000), (0, 5)])
def test_layernorm_kernels_match_reference_and_finite_differences(shape):
    rng = np.random.default_rng(2)
    x = randn(rng, *shape) * 3 + 1
    gain, bias = randn(rng, shape[1]), randn(rng, shape[1])
    out = np.full_like(x, np.nan)
    kernels.layernorm_forward(x, gain, bias, out)
    np.testing.assert_allclose(out, ref_layernorm(x, gain, bias), rtol=1e-4, atol=1e-5)
    dout = randn(rng, *shape)
    dgain, dbias, dx = (np.full_like(gain, np.nan), np.full_like(bias, np.nan),
                        np.full_like(x, np.nan))
    kernels.layernorm_backward(x, gain, dout, dgain, dbias, dx)
    g64 = dout.astype(np.float64)
    np.testing.assert_allclose(dbias, g64.sum(axis=0), rtol=1e-5, atol=1e-5)
    xhat = ref_layernorm(x, np.ones(shape[1]), np.zeros(shape[1]))
    np.testing.assert_allclose(dgain, (g64 * xhat).sum(axis=0), rtol=1e-4, atol=1e-4)
    h = 1e-4
    for _ in range(20 if shape[0] else 0):
        idx = tuple(int(rng.integers(0, d)) for d in shape)
        plus, minus = x.astype(np.float64), x.astype(np.float64)
        plus[idx] += h
        minus[idx] -= h
        numeric = (np.sum(ref_layernorm(plus, gain, bias) * g64)
                   - np.sum(ref_layernorm(minus, gain, bias) * g64)) / (2 * h)
        assert dx[idx] == pytest.approx(numeric, rel=1e-3, abs=1e-3)
    skipped = np.full_like(gain, np.nan)
    kernels.layernorm_backward(x, gain, dout, skipped, dbias, None)
    np.testing.assert_array_equal(skipped, dgain)
