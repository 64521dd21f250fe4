"""The layers a researcher's own model expects besides the paper's: convolution (tied
weights, by im2col), dropout and layer normalization.

Kernels against float64 numpy references and finite differences, and the conv layer
against PyTorch's conv2d; the layers inside a Network (gradients by finite differences,
conv -> dense through the implicit flatten, config keys and errors); dropout's masks keyed
on (seed, step), identity in evaluation, and a resumed sgd run that trains bit for bit as
an uninterrupted one; and the refusal of model parallelism for these layers.
"""

from __future__ import annotations

import io
import tomllib
from pathlib import Path

import numpy as np
import pytest

from distbelief.errors import ConfigError
from distbelief.model import kernels
from distbelief.model.cost_model import Link, predict
from distbelief.model.layers import Conv, Dropout, LayerNorm
from distbelief.model.network import Network
from distbelief.model.partition import Partitioning, partition_pieces


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


# ---------------------------------------------------------------------------------------
# The conv layer: forward, backward, the chunks its im2col goes through


def conv_layer(case, filters=4, activation="linear"):
    _, h, w, c, k, s, padding = case
    return Conv((h, w, c), k, s, filters, padding, activation)


def conv_run(layer, n, seed=0, dx=True):
    """x, weights, bias, out, dout (the forward's gradient), dweights, dbias, dx."""
    rng = np.random.default_rng(seed)
    x = randn(rng, n, layer.in_size)
    (_, wshape), (_, bshape) = layer.param_shapes()
    weights, bias = randn(rng, *wshape), randn(rng, *bshape)
    out = np.full((n, layer.out_size), np.nan, dtype=np.float32)
    layer.forward(x, weights, bias, out)
    dout = randn(rng, n, layer.out_size)
    grads = [np.full_like(weights, np.nan), np.full_like(bias, np.nan),
             np.full_like(x, np.nan) if dx else None]
    layer.backward(x, out, dout.copy(), weights, *grads)
    return x, weights, bias, out, dout, *grads


@pytest.mark.parametrize("case", CONV_CASES)
def test_conv_layer_matches_reference_and_finite_differences(case):
    n, h, w, c, k, s, padding = case
    layer = conv_layer(case)
    x, weights, bias, out, dout, dweights, dbias, dx = conv_run(layer, n)
    x4 = x.reshape(n, h, w, c)
    want = ref_conv(x4, weights.astype(np.float64), bias.astype(np.float64), k, s, padding)
    np.testing.assert_allclose(out, want.reshape(n, -1), rtol=1e-5, atol=1e-5)
    g64 = dout.astype(np.float64).reshape(want.shape)
    np.testing.assert_allclose(dbias, g64.sum(axis=(0, 1, 2)), rtol=1e-5, atol=1e-4)

    def loss(xv, wv):
        return np.sum(ref_conv(xv, wv, bias.astype(np.float64), k, s, padding) * g64)

    rng = np.random.default_rng(3)
    h_step = 1e-3
    for target, grad in ((x4, dx.reshape(x4.shape)), (weights, dweights)):
        for _ in range(15):
            idx = tuple(int(rng.integers(0, d)) for d in target.shape)
            plus, minus = target.astype(np.float64), target.astype(np.float64)
            plus[idx] += h_step
            minus[idx] -= h_step
            args = ((plus, weights.astype(np.float64)), (minus, weights.astype(np.float64)))
            if target is weights:
                args = ((x4.astype(np.float64), plus), (x4.astype(np.float64), minus))
            numeric = (loss(*args[0]) - loss(*args[1])) / (2 * h_step)
            assert grad[idx] == pytest.approx(numeric, rel=1e-3, abs=1e-3)


def test_conv_goes_through_chunks_of_samples_with_one_reused_buffer(monkeypatch):
    """A batch larger than the columns buffer holds goes through in chunks: the same
    result as one chunk, the buffer grown once and reused, a gradient over all samples."""
    case = (9, 8, 8, 3, 3, 1, "same")
    whole = conv_run(conv_layer(case), 9, seed=4)
    monkeypatch.setattr(Conv, "COLUMNS_BYTES", 4 * 64 * 27 * 2)  # 2 samples' columns
    layer = conv_layer(case)
    assert layer.chunk == 2
    chunked = conv_run(layer, 9, seed=4)
    buffer = layer._columns
    assert buffer.shape == (2 * 64, 27)
    for a, b in zip(whole[3:], chunked[3:]):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    conv_run(layer, 5, seed=5)
    assert layer._columns is buffer
    assert layer.scratch_bytes(9) == 4 * 27 * (2 * 64 + 4)


def test_conv_backward_reuses_the_forwards_columns_only_for_that_very_input():
    """A batch in one chunk: backward reads the columns its forward left (no second
    im2col), but not after a forward of another input, nor after a backward that spent
    them on dx; every gradient is the one a fresh layer computes."""
    case = (5, 8, 8, 3, 3, 1, "same")
    fresh = conv_run(conv_layer(case), 5, seed=7)
    layer = conv_layer(case)
    calls = []
    original = kernels.im2col
    kernels.im2col = lambda *args: calls.append(1) or original(*args)
    try:
        x, weights, bias, out, dout, *_ = fresh
        layer.forward(x, weights, bias, out.copy())
        other = np.ones_like(x)
        for between in (None, other):  # nothing in between; another input's forward
            if between is not None:
                layer.forward(between, weights, bias, np.empty_like(out))
            calls.clear()
            grads = [np.empty_like(weights), np.empty_like(bias), np.empty_like(x)]
            layer.backward(x, out, dout.copy(), weights, *grads)
            assert len(calls) == (0 if between is None else 1)
            for got, want in zip(grads, fresh[5:]):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            layer.forward(x, weights, bias, out.copy())
        calls.clear()
        layer.backward(x, out, dout.copy(), weights, *grads)
        layer.backward(x, out, dout.copy(), weights, *grads)  # the columns went to dx
        assert len(calls) == 1
        np.testing.assert_allclose(grads[0], fresh[5], rtol=1e-5, atol=1e-5)
    finally:
        kernels.im2col = original


def test_conv_backward_of_an_empty_batch_zeroes_the_weight_gradient():
    layer = conv_layer(CONV_CASES[0])
    *_, dweights, dbias, dx = conv_run(layer, 0)
    assert np.all(dweights == 0.0) and np.all(dbias == 0.0) and dx.size == 0


# ---------------------------------------------------------------------------------------
# Against PyTorch (1 thread, float64 references from float32 inputs)


def nchw(torch, a: np.ndarray):
    return torch.from_numpy(a).double().permute(0, 3, 1, 2).contiguous()


def nhwc(t) -> np.ndarray:
    return t.detach().permute(0, 2, 3, 1).numpy()


@pytest.mark.parametrize("case", CONV_CASES)
def test_conv_layer_matches_torch_conv2d(torch, case):
    n, h, w, c, k, s, padding = case
    layer = conv_layer(case, filters=5, activation="tanh")
    x, weights, bias, out, dout, dweights, dbias, dx = conv_run(layer, n, seed=6)
    fn = torch.nn.functional
    xt = nchw(torch, x.reshape(n, h, w, c)).requires_grad_(True)
    wt = torch.from_numpy(weights).double().permute(3, 2, 0, 1).contiguous()
    wt.requires_grad_(True)
    bt = torch.from_numpy(bias).double().requires_grad_(True)
    if padding == "same" and s == 1 and k % 2:
        yt = fn.conv2d(xt, wt, bt, padding="same")   # torch's own (stride 1, odd kernel)
    else:
        _, top, bottom = pads(h, k, s, padding)
        _, left, right = pads(w, k, s, padding)
        yt = fn.conv2d(fn.pad(xt, (left, right, top, bottom)), wt, bt, stride=s)
    yt = torch.tanh(yt)
    yt.backward(nchw(torch, dout.reshape(n, *layer.out_shape)))
    np.testing.assert_allclose(out.reshape(n, *layer.out_shape), nhwc(yt), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(dx.reshape(n, h, w, c), nhwc(xt.grad), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dweights, wt.grad.permute(2, 3, 1, 0).numpy(), rtol=1e-4,
                               atol=1e-4)
    np.testing.assert_allclose(dbias, bt.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_conv_to_dense_flattens_as_torch_does_in_nhwc_order(torch):
    """conv -> dense needs no flatten layer: the dense layer reads the conv's (H, W, C)
    output in row, column, channel order, which is torch's NCHW output permuted to NHWC
    and flattened."""
    net = Network((6, 6, 2), [CONV, {"type": "dense", "units": 3, "activation": "softmax"}],
                  3)
    rng = np.random.default_rng(7)
    params = net.init_params(rng)
    params += randn(rng, params.size) * 0.1
    x, y = randn(rng, 4, 6, 6, 2), rng.integers(0, 3, 4)
    grad = np.empty_like(params)
    loss = net.loss_and_grad(params, x, y, grad)
    views = net._views(params, "params")
    (cw, cb), (dw, db) = views
    tensors = [torch.from_numpy(a).double().requires_grad_(True) for a in (cw, cb, dw, db)]
    twc, tcb, tdw, tdb = tensors
    fn = torch.nn.functional
    h = torch.relu(fn.conv2d(nchw(torch, x), twc.permute(3, 2, 0, 1), tcb, padding="same"))
    logits = h.permute(0, 2, 3, 1).reshape(4, -1) @ tdw.T + tdb
    want = fn.cross_entropy(logits, torch.from_numpy(y))
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-5)
    np.testing.assert_allclose(net.logits(params, x), logits.detach().numpy(), rtol=1e-4,
                               atol=1e-5)
    flat = np.concatenate([t.grad.numpy().reshape(-1) for t in tensors])
    np.testing.assert_allclose(grad, flat, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------
# The layers in a network

CONV = {"type": "conv", "filters": 4, "kernel": 3, "padding": "same", "activation": "relu"}
# Smooth activations and L2 pooling: no kinks for the finite differences to straddle.
NET = [{"type": "conv", "filters": 3, "kernel": 3, "padding": "same", "activation": "tanh"},
       {"type": "pool", "mode": "l2", "kernel": 2},
       {"type": "conv", "filters": 4, "kernel": 2, "stride": 2, "activation": "tanh"},
       {"type": "layernorm"},
       {"type": "dropout", "rate": 0.3},
       {"type": "dense", "units": 5, "activation": "tanh"},
       {"type": "layernorm"},
       {"type": "dense", "units": 3, "activation": "softmax"}]


def test_network_gradient_through_conv_layernorm_and_a_fixed_dropout_mask():
    """Finite differences of the training loss at one step (its dropout mask fixed:
    every call at the same step draws the same mask)."""
    net = Network((8, 8, 2), NET, 3, seed=11)
    assert [layer.kind for layer in net.layers] == [
        "conv", "pool", "conv", "layernorm", "dropout", "dense", "layernorm", "dense"]
    assert net.layers[2].out_shape == (2, 2, 4)
    rng = np.random.default_rng(8)
    params = net.init_params(rng)
    params += randn(rng, params.size) * 0.1
    x, y = randn(rng, 4, 8, 8, 2), rng.integers(0, 3, 4)
    grad = np.full(net.layout.size, np.nan, dtype=np.float32)
    scratch = np.empty_like(grad)
    net.step = 7
    loss = net.loss_and_grad(params, x, y, grad)
    assert net.step == 8 and np.isfinite(grad).all()

    def training_loss(p):
        net.step = 7
        return net.loss_and_grad(p, x, y, scratch)

    assert training_loss(params) == loss
    h = 1e-2
    for i in range(net.layout.size):  # 254: every parameter of every layer
        plus, minus = params.copy(), params.copy()
        plus[i] += h
        minus[i] -= h
        numeric = (training_loss(plus) - training_loss(minus)) / (2 * h)
        assert grad[i] == pytest.approx(numeric, rel=2e-2, abs=2e-4), i


def test_dropout_masks_follow_the_seed_and_the_step():
    def grads(seed, step):
        net = Network((8, 8, 2), NET, 3, seed=seed)
        params = net.init_params(0)
        x = randn(np.random.default_rng(9), 6, 8, 8, 2)
        grad = np.empty_like(params)
        net.step = step
        net.loss_and_grad(params, x, np.arange(6) % 3, grad)
        return grad, net._saved.rows(6)[4].copy()

    grad, mask = grads(1, 5)
    again, same = grads(1, 5)
    assert np.array_equal(grad, again) and np.array_equal(mask, same)
    for other in (grads(1, 6), grads(2, 5)):
        assert not np.array_equal(other[1], mask)
    # Masks are drawn per sample row: the first rows do not depend on the batch size.
    net = Network((8, 8, 2), NET, 3, seed=1)
    rows = np.empty((6, net.layers[4].out_size), dtype=np.int32)
    net.layers[4].draw(net.dropout_rng(5, 4), rows)
    np.testing.assert_array_equal(rows, mask)
    small = np.empty((2, rows.shape[1]), dtype=np.int32)
    net.layers[4].draw(net.dropout_rng(5, 4), small)
    np.testing.assert_array_equal(small, mask[:2])


def test_evaluation_passes_through_dropout_and_draws_nothing():
    with_dropout = Network((8, 8, 2), NET, 3, seed=3)
    without = Network((8, 8, 2), [layer for layer in NET if layer["type"] != "dropout"], 3)
    assert with_dropout.layout.size == without.layout.size
    params = with_dropout.init_params(0)
    rng = np.random.default_rng(10)
    x, y = randn(rng, 20, 8, 8, 2), rng.integers(0, 3, 20)
    first = with_dropout.evaluate(params, x, y, batch_size=8)
    assert with_dropout.step == 0
    assert with_dropout.evaluate(params, x, y, batch_size=8) == first
    assert without.evaluate(params, x, y, batch_size=8) == first
    np.testing.assert_array_equal(with_dropout.logits(params, x), without.logits(params, x))
    assert with_dropout.loss(params, x, y) == without.loss(params, x, y)
    # A training step in between changes nothing evaluation computes.
    with_dropout.loss_and_grad(params, x, y, np.empty_like(params))
    assert with_dropout.evaluate(params, x, y, batch_size=8) == first


def test_dropout_backward_needs_its_forwards_draws():
    layer = Dropout((4,), 0.5)
    x = np.ones((2, 4), dtype=np.float32)
    with pytest.raises(ValueError, match="draws its forward used"):
        layer.backward(x, x, x, None, None, None, np.empty_like(x), None)


def test_layernorm_initialises_gain_one_and_init_slice_follows_the_stream():
    net = Network((8, 8, 2), NET, 3)
    params = net.init_params(4)
    gain = net.layout.view(params, 3, "weights")
    assert isinstance(net.layers[3], LayerNorm) and np.all(gain == 1.0)
    assert np.all(net.layout.view(params, 3, "bias") == 0.0)
    # The layers after it draw as if it were not there: the stream skips fixed weights.
    entry = net.layout.entry(3, "weights")
    for start, stop in ((0, params.size), (5, 40), (entry.offset + 3, entry.stop + 50),
                        (params.size - 7, params.size)):
        np.testing.assert_array_equal(net.init_slice(4, start, stop), params[start:stop])
    assert "layernorm" in net.describe() and "5x5" not in net.describe()


CONV_CONFIG_ERRORS = [
    ([{**CONV, "padding": "full"}, {"type": "dense", "units": 3, "activation": "softmax"}],
     ("layer 0", "'padding'")),
    ([{**CONV, "filters": 0}, {"type": "dense", "units": 3, "activation": "softmax"}],
     ("layer 0", "'filters'")),
    ([{**CONV, "stride": 1.5}, {"type": "dense", "units": 3, "activation": "softmax"}],
     ("layer 0", "'stride'")),
    ([{**CONV, "padding": "valid", "kernel": 9},
      {"type": "dense", "units": 3, "activation": "softmax"}], ("layer 0", "'kernel'", "larger")),
    ([{**CONV, "channels": 3}, {"type": "dense", "units": 3, "activation": "softmax"}],
     ("layer 0", "unknown key 'channels'")),
    ([{"type": "dense", "units": 8, "activation": "relu"}, CONV,
      {"type": "dense", "units": 3, "activation": "softmax"}], ("layer 1", "3-D")),
    ([CONV, {**CONV, "activation": "softmax"}], ("layer 1", "'filters'")),
    ([{"type": "dropout", "rate": 1.0}, {"type": "dense", "units": 3, "activation": "softmax"}],
     ("layer 0", "'rate'")),
    ([{"type": "dropout", "rate": True}, {"type": "dense", "units": 3, "activation": "softmax"}],
     ("layer 0", "'rate'")),
    ([{"type": "dropout"}, {"type": "dense", "units": 3, "activation": "softmax"}],
     ("layer 0", "missing key 'rate'")),
    ([CONV, {"type": "dropout", "rate": 0.5}], ("layer 1", "last layer")),
    ([CONV, {"type": "layernorm"}], ("layer 1", "last layer")),
    ([{"type": "layernorm", "eps": 0.1}, {"type": "dense", "units": 3, "activation": "softmax"}],
     ("layer 0", "unknown key 'eps'")),
]


@pytest.mark.parametrize("layers, words", CONV_CONFIG_ERRORS)
def test_config_errors_name_layer_and_key(layers, words):
    with pytest.raises(ConfigError) as info:
        Network((8, 8, 1), layers, 3)
    for word in words:
        assert word in str(info.value)


def test_layers_from_toml_and_conv_as_the_output_layer():
    config = tomllib.loads("""
        layers = [
          {type = "conv", filters = 6, kernel = 5, padding = "same", activation = "relu"},
          {type = "dropout", rate = 0.1},
          {type = "layernorm"},
          {type = "conv", filters = 3, kernel = 4, stride = 4, activation = "softmax"},
        ]""")
    net = Network((8, 8, 1), config["layers"], 12)
    assert [layer.kind for layer in net.layers] == ["conv", "dropout", "layernorm", "conv"]
    assert net.layers[0].out_shape == (8, 8, 6) and net.layers[3].out_shape == (2, 2, 3)
    assert net.layers[3].padding == "valid" and net.layers[1].rate == 0.1
    params = net.init_params(0)
    logits = net.logits(params, np.ones((2, 8, 8, 1), dtype=np.float32))
    assert logits.shape == (2, 12)


# ---------------------------------------------------------------------------------------
# Training: a resumed sgd run draws the dropout masks an uninterrupted one does

CONV_TOML = """
[model]
layers = [
    { type = "conv", filters = 4, kernel = 3, padding = "same", activation = "relu" },
    { type = "pool", mode = "max", kernel = 2 },
    { type = "dropout", rate = 0.25 },
    { type = "layernorm" },
    { type = "dense", units = 4, activation = "softmax" },
]
[data]
path = "synth.h5"
batch_size = 16
[optimizer]
algorithm = "sgd"
learning_rate = 0.05
[run]
max_steps = 40
eval_every_seconds = 30
checkpoint_every_seconds = 0
threads = 1
"""


@pytest.fixture(scope="module")
def conv_data(synthetic_folder) -> Path:
    return synthetic_folder("common_layers", {"conv.toml": CONV_TOML}, n_train=600,
                            n_test=100, input_shape=(8, 8, 1), num_classes=4, seed=5)


def sgd_run(folder: Path, out: Path, *overrides: str) -> tuple[dict, str]:
    from distbelief.algorithms.sgd import train
    from distbelief.config import load_config

    config = load_config(folder / "conv.toml", [f'run.out_dir="{out}"', *overrides])
    stream = io.StringIO()
    return train(config, stream=stream), stream.getvalue()


def test_a_resumed_sgd_run_with_dropout_trains_bit_for_bit_as_a_straight_one(conv_data,
                                                                            tmp_path):
    from distbelief.records import checkpoint as ckpt

    def final(out):
        found, _ = ckpt.find_latest(ckpt.checkpoint_root(out))
        return found.step, found.read_state()[0]

    straight, _ = sgd_run(conv_data, tmp_path / "straight")
    sgd_run(conv_data, tmp_path / "halves", "run.max_steps=20")
    resumed, printed = sgd_run(conv_data, tmp_path / "halves")
    assert "resuming from" in printed and resumed["steps"] == straight["steps"] == 40
    step, params = final(tmp_path / "straight")
    assert step == 40
    again = final(tmp_path / "halves")
    assert again[0] == 40 and np.array_equal(again[1], params)
    assert resumed["final_test_loss"] == straight["final_test_loss"]


# ---------------------------------------------------------------------------------------
# Model parallelism refuses them; the cost model prices them on one partition


@pytest.mark.parametrize("layer, kind", [(CONV, "conv"), ({"type": "dropout", "rate": 0.5},
                                                          "dropout"),
                                         ({"type": "layernorm"}, "layernorm")])
def test_partitions_refuse_conv_dropout_and_layernorm(layer, kind):
    net = Network((8, 8, 2), [{"type": "local", "kernel": 3, "channels": 4,
                               "activation": "relu"}, layer,
                              {"type": "dense", "units": 3, "activation": "softmax"}], 3)
    Partitioning(net.layers, net.layout, 1)
    for refuse in (lambda: Partitioning(net.layers, net.layout, 2),
                   lambda: partition_pieces(net.layers, net.layout, 2),
                   lambda: predict(net, 2, 8, 1e9, Link(1e9, 1e-6))):
        with pytest.raises(ConfigError) as info:
            refuse()
        message = str(info.value)
        assert f"layer 1 ({kind}) is not split over partitions" in message
        assert "use partitions = 1" in message and "\n" not in message
    single = predict(net, 1, 8, 1e9, Link(1e9, 1e-6))
    assert single.step_seconds > 0 and single.bytes_per_step == 0


def test_cluster_partitions_with_a_conv_layer_is_a_one_line_config_error(conv_data):
    from distbelief.config import load_config

    with pytest.raises(ConfigError) as info:
        load_config(conv_data / "conv.toml", ["cluster.partitions=2"])
    assert str(info.value).startswith("cluster.partitions = 2: layer 0 (conv) is not split")
    assert "\n" not in str(info.value)
