"""The paper's image layers: pooling (max, L2) and local contrast normalization.

Kernels against float64 numpy references and finite differences, against PyTorch
(max_pool2d, lp_pool2d with p = 2, and LCN composed from conv2d with the fixed Gaussian);
an LCN row band against the whole image; input validation; the layers inside a Network
(gradients by finite differences, config keys and errors); and the partitioning's halo
rows. The partitioned network against the unpartitioned one runs under MPI in
test_model_parallel.py (tests/mpi_programs/mp_gradients.py, networks "image" and
"image-first").
"""

from __future__ import annotations

import json
import tomllib
import tracemalloc

import numpy as np
import pytest
from helpers.mpi_jobs import run_cli, run_mpi

from distbelief.data.converters import make_synthetic
from distbelief.errors import ConfigError
from distbelief.model import kernels
from distbelief.model.cost_model import Link, layer_flops, predict
from distbelief.model.layers import Lcn, Pool
from distbelief.model.network import Network
from distbelief.model.partition import Partitioning, input_window, needed_inputs

# ---------------------------------------------------------------------------------------
# float64 references, written from the definitions


def ref_pool(x: np.ndarray, kernel: int, stride: int, mode: str) -> np.ndarray:
    n, height, width, channels = x.shape
    out_h, out_w = (height - kernel) // stride + 1, (width - kernel) // stride + 1
    out = np.empty((n, out_h, out_w, channels))
    for i in range(out_h):
        for j in range(out_w):
            win = x[:, i * stride:i * stride + kernel, j * stride:j * stride + kernel, :]
            out[:, i, j] = (win.max(axis=(1, 2)) if mode == "max"
                            else np.sqrt((win ** 2).sum(axis=(1, 2))))
    return out


def ref_blur(maps: np.ndarray, kernel: int) -> np.ndarray:
    """(N, H, W) maps convolved with the 2-D Gaussian, zero padding, same size."""
    g = kernels.gaussian_window(kernel).astype(np.float64)
    w = np.outer(g, g)
    pad = kernel // 2
    padded = np.pad(maps, ((0, 0), (pad, pad), (pad, pad)))
    out = np.zeros_like(maps)
    for p in range(kernel):
        for q in range(kernel):
            out += w[p, q] * padded[:, p:p + maps.shape[1], q:q + maps.shape[2]]
    return out


def ref_lcn(x: np.ndarray, kernel: int, floor: float) -> np.ndarray:
    x = x.astype(np.float64)
    mean = ref_blur(x.mean(axis=3), kernel)[..., None]
    v = x - mean
    sigma = np.sqrt(ref_blur((v ** 2).mean(axis=3), kernel))[..., None]
    return v / np.maximum(sigma, floor)


def randn(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


POOL_CASES = [  # (N, H, W, C, kernel, stride)
    (2, 8, 8, 3, 2, 2),      # the usual non-overlapping 2x2
    (3, 9, 7, 5, 3, 2),      # overlapping windows, odd sizes, a leftover column
    (1, 7, 9, 1, 3, 1),      # one channel, stride 1
    (2, 10, 11, 17, 2, 3),   # stride > kernel: rows and columns no window reads
]


def pool_run(case, mode, seed=0):
    """x, out, dout, dx of a training step: max pooling's forward saves its argmax."""
    n, h, w, c, k, s = case
    rng = np.random.default_rng(seed)
    x = randn(rng, n, h, w, c)
    out = np.full((n, (h - k) // s + 1, (w - k) // s + 1, c), np.nan, dtype=np.float32)
    argmax = np.full(out.shape, -1, dtype=np.int32) if mode == "max" else None
    kernels.pool_forward(x, out, k, s, mode, argmax)
    dout = randn(rng, *out.shape)
    dx = np.full_like(x, np.nan)
    kernels.pool_backward(x, out, dout, dx, k, s, mode, argmax)
    return x, out, dout, dx


def ref_max_pool_backward(x: np.ndarray, dout: np.ndarray, kernel: int,
                          stride: int) -> np.ndarray:
    """What the backward computed before it kept the argmax: each window's maximum found
    again from x, the gradient to its first maximum in (row, column) order."""
    n, channels = x.shape[0], x.shape[3]
    dx = np.zeros(x.shape)
    rows, cols = np.meshgrid(np.arange(n), np.arange(channels), indexing="ij")
    for i in range(dout.shape[1]):
        for j in range(dout.shape[2]):
            win = x[:, i * stride:i * stride + kernel, j * stride:j * stride + kernel, :]
            first = win.reshape(n, kernel * kernel, channels).argmax(axis=1)  # first max
            dy, dxx = i * stride + first // kernel, j * stride + first % kernel
            np.add.at(dx, (rows, dy, dxx, cols), dout[:, i, j])
    return dx


@pytest.mark.parametrize("mode", ["max", "l2"])
@pytest.mark.parametrize("case", POOL_CASES)
def test_pool_matches_reference_and_finite_differences(case, mode):
    x, out, dout, dx = pool_run(case, mode)
    k, s = case[4], case[5]
    np.testing.assert_allclose(out, ref_pool(x, k, s, mode), rtol=1e-6, atol=1e-6)
    x64, g64 = x.astype(np.float64), dout.astype(np.float64)
    h = 1e-4
    rng = np.random.default_rng(1)
    for _ in range(30):
        idx = tuple(int(rng.integers(0, d)) for d in x.shape)
        plus, minus = x64.copy(), x64.copy()
        plus[idx] += h
        minus[idx] -= h
        numeric = (np.sum(ref_pool(plus, k, s, mode) * g64)
                   - np.sum(ref_pool(minus, k, s, mode) * g64)) / (2 * h)
        assert dx[idx] == pytest.approx(numeric, rel=1e-3, abs=1e-4)
    if s > k:  # input rows no window covers get exactly zero
        np.testing.assert_array_equal(dx[:, k:s], 0.0)


def test_max_pool_routes_ties_to_the_first_maximum():
    x = np.zeros((1, 2, 2, 1), dtype=np.float32)
    out = np.empty((1, 1, 1, 1), dtype=np.float32)
    argmax = np.empty(out.shape, dtype=np.int32)
    kernels.pool_forward(x, out, 2, 2, "max", argmax)
    dx = np.full_like(x, np.nan)
    kernels.pool_backward(x, out, np.ones_like(out), dx, 2, 2, "max", argmax)
    np.testing.assert_array_equal(dx.reshape(-1), [1, 0, 0, 0])


# Channel counts that take every path of the forward: blocks of 8, a block of 4, and the
# one-by-one tail (1, 3, 5, 12 = 8 + 4, 13 = 8 + 4 + 1, 19 = 2 x 8 + 3).
@pytest.mark.parametrize("channels", [1, 3, 4, 5, 8, 12, 13, 19])
@pytest.mark.parametrize("window", [(2, 2), (3, 2), (3, 1), (2, 3)])
def test_max_pool_argmax_backward_equals_finding_the_maximum_again(channels, window):
    k, s = window
    rng = np.random.default_rng(channels)
    # Few distinct values, so most windows hold ties, some several.
    x = rng.integers(-2, 3, (3, 9, 8, channels)).astype(np.float32)
    x[0] = 0.0  # whole windows of ties
    out = np.empty((3, (9 - k) // s + 1, (8 - k) // s + 1, channels), dtype=np.float32)
    argmax = np.full(out.shape, -1, dtype=np.int32)
    kernels.pool_forward(x, out, k, s, "max", argmax)
    plain = np.empty_like(out)
    kernels.pool_forward(x, plain, k, s, "max")  # evaluation: no argmax
    np.testing.assert_array_equal(out, plain)
    np.testing.assert_array_equal(out, ref_pool(x, k, s, "max"))
    # Each saved offset points at its output's value, inside its own sample.
    flat = x.reshape(3, -1)
    np.testing.assert_array_equal(
        np.take_along_axis(flat, argmax.reshape(3, -1), axis=1), out.reshape(3, -1))
    dout = randn(rng, *out.shape)
    dx = np.full_like(x, np.nan)
    kernels.pool_backward(x, out, dout, dx, k, s, "max", argmax)
    np.testing.assert_allclose(dx, ref_max_pool_backward(x, dout, k, s), rtol=1e-6,
                               atol=1e-6)


def test_max_pool_backward_refuses_a_missing_or_foreign_argmax():
    x = randn(np.random.default_rng(0), 2, 4, 4, 3)
    out = np.empty((2, 2, 2, 3), dtype=np.float32)
    argmax = np.empty(out.shape, dtype=np.int32)
    kernels.pool_forward(x, out, 2, 2, "max", argmax)
    dx = np.empty_like(x)
    with pytest.raises(ValueError, match="needs the argmax its forward saved"):
        kernels.pool_backward(x, out, out, dx, 2, 2, "max")
    with pytest.raises(TypeError, match="argmax must have dtype int32"):
        kernels.pool_backward(x, out, out, dx, 2, 2, "max", argmax.astype(np.int64))
    with pytest.raises(ValueError, match="argmax must have shape"):
        kernels.pool_backward(x, out, out, dx, 2, 2, "max", argmax[:1])
    with pytest.raises(ValueError, match="'max' only"):
        kernels.pool_forward(x, out, 2, 2, "l2", argmax)
    with pytest.raises(ValueError, match="writeable"):
        argmax.flags.writeable = False
        kernels.pool_forward(x, out, 2, 2, "max", argmax)
    foreign = argmax.copy()
    foreign[1, 1, 0, 2] = x[0].size      # one past its sample: never written
    foreign[0, 0, 0, 0] = -1
    with pytest.raises(ValueError, match="2 offsets outside"):
        kernels.pool_backward(x, out, out, dx, 2, 2, "max", foreign)


def test_l2_pool_of_zeros_has_zero_gradient():
    x = np.zeros((1, 2, 2, 3), dtype=np.float32)
    out = np.empty((1, 1, 1, 3), dtype=np.float32)
    kernels.pool_forward(x, out, 2, 2, "l2")
    dx = np.full_like(x, np.nan)
    kernels.pool_backward(x, out, np.ones_like(out), dx, 2, 2, "l2")
    np.testing.assert_array_equal(dx, 0.0)


LCN_CASES = [  # (N, H, W, C, kernel, floor)
    (2, 9, 8, 3, 3, 0.5),
    (2, 12, 10, 4, 5, 0.1),
    (1, 7, 7, 1, 5, 1.0),     # one channel; the floor holds in places
    (2, 6, 11, 16, 9, 0.2),   # window wider than the image is tall
]


def lcn_run(case, seed=0):
    n, h, w, c, k, floor = case
    rng = np.random.default_rng(seed)
    x = randn(rng, n, h, w, c)
    out = np.full_like(x, np.nan)
    kernels.lcn_forward(x, out, k, floor)
    dout = randn(rng, *x.shape)
    dx = np.full_like(x, np.nan)
    kernels.lcn_backward(x, dout, dx, k, floor)
    return x, out, dout, dx


@pytest.mark.parametrize("case", LCN_CASES)
def test_lcn_matches_reference_and_finite_differences(case):
    x, out, dout, dx = lcn_run(case)
    k, floor = case[4], case[5]
    want = ref_lcn(x, k, floor)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    x64, g64 = x.astype(np.float64), dout.astype(np.float64)
    h = 1e-5
    rng = np.random.default_rng(2)
    for _ in range(30):
        idx = tuple(int(rng.integers(0, d)) for d in x.shape)
        plus, minus = x64.copy(), x64.copy()
        plus[idx] += h
        minus[idx] -= h
        numeric = (np.sum(ref_lcn(plus, k, floor) * g64)
                   - np.sum(ref_lcn(minus, k, floor) * g64)) / (2 * h)
        assert dx[idx] == pytest.approx(numeric, rel=1e-3, abs=1e-4)


def test_lcn_output_is_centred_and_the_floor_bounds_it():
    # A constant image: no contrast anywhere, so the output is 0 away from the border.
    x = np.full((1, 9, 9, 2), 3.0, dtype=np.float32)
    out = np.empty_like(x)
    kernels.lcn_forward(x, out, 3, 0.5)
    np.testing.assert_allclose(out[:, 2:-2, 2:-2], 0.0, atol=1e-6)
    # Faint texture under the floor is only centred: out = v / floor.
    rng = np.random.default_rng(4)
    faint = (rng.standard_normal((1, 9, 9, 2)) * 1e-3).astype(np.float32)
    kernels.lcn_forward(faint, out, 3, 0.5)
    mean = ref_blur(faint.astype(np.float64).mean(axis=3), 3)[..., None]
    np.testing.assert_allclose(out, (faint - mean) / 0.5, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("band", [(0, 3), (2, 5), (4, 9), (8, 12), (0, 12), (5, 6)])
@pytest.mark.parametrize("kernel", [3, 5])
def test_lcn_row_band_equals_the_whole_image(band, kernel):
    """A band of output rows from the input rows it reads (widened by kernel - 1, clipped)
    equals those rows of the whole image, forward and backward, bit for bit."""
    n, h, w, c = 2, 12, 7, 3
    rng = np.random.default_rng(5)
    x = randn(rng, n, h, w, c)
    o0, o1 = band
    reach = kernel - 1
    a, b = max(0, o0 - reach), min(h, o1 + reach)
    whole = np.empty_like(x)
    kernels.lcn_forward(x, whole, kernel, 0.3)
    part = np.full((n, o1 - o0, w, c), np.nan, dtype=np.float32)
    xb = np.ascontiguousarray(x[:, a:b])
    kernels.lcn_forward(xb, part, kernel, 0.3, off=o0 - a)
    np.testing.assert_array_equal(part, whole[:, o0:o1])
    dout = randn(rng, n, o1 - o0, w, c)
    padded = np.zeros_like(x)
    padded[:, o0:o1] = dout
    dx_whole = np.empty_like(x)
    kernels.lcn_backward(x, padded, dx_whole, kernel, 0.3)
    dx_band = np.full_like(xb, np.nan)
    kernels.lcn_backward(xb, dout, dx_band, kernel, 0.3, off=o0 - a)
    np.testing.assert_allclose(dx_band, dx_whole[:, a:b], rtol=1e-6, atol=1e-6)
    # Rows outside the band's reach get no gradient from it.
    np.testing.assert_array_equal(dx_whole[:, :a], 0.0)
    np.testing.assert_array_equal(dx_whole[:, b:], 0.0)


def test_gaussian_window_sums_to_one_and_is_symmetric():
    for k in (1, 3, 5, 9):
        g = kernels.gaussian_window(k)
        assert g.dtype == np.float32 and g.shape == (k,)
        assert float(g.sum()) == pytest.approx(1.0, abs=1e-6)
        np.testing.assert_array_equal(g, g[::-1])
        assert k == 1 or g[k // 2] > g[0]


def test_image_kernels_reject_bad_input():
    x = np.zeros((2, 6, 6, 3), dtype=np.float32)
    out = np.zeros((2, 3, 3, 3), dtype=np.float32)
    with pytest.raises(ValueError, match="mode"):
        kernels.pool_forward(x, out, 2, 2, "mean")
    with pytest.raises(ValueError, match="out must have shape"):
        kernels.pool_forward(x, out, 3, 1, "max")
    with pytest.raises(ValueError, match="smaller than the kernel"):
        kernels.pool_forward(x, out, 7, 1, "max")
    with pytest.raises(TypeError, match="float32"):
        kernels.pool_forward(x.astype(np.float64), out, 2, 2, "max")
    with pytest.raises(ValueError, match="dx must have shape"):
        kernels.pool_backward(x, out, out, out, 2, 2, "l2")
    with pytest.raises(ValueError, match="overlap"):
        kernels.lcn_forward(x, x, 3, 0.1)
    same = np.zeros_like(x)
    with pytest.raises(ValueError, match="odd"):
        kernels.lcn_forward(x, same, 4, 0.1)
    with pytest.raises(ValueError, match="floor"):
        kernels.lcn_forward(x, same, 3, 0.0)
    with pytest.raises(ValueError, match="out must be"):
        kernels.lcn_forward(x, same[:, :4], 3, 0.1, off=3)
    with pytest.raises(ValueError, match="off"):
        kernels.lcn_backward(x, same, np.zeros_like(x), 3, 0.1, off=-1)


# ---------------------------------------------------------------------------------------
# Against PyTorch (1 thread, float64 references from float32 inputs)


def nchw(torch, a: np.ndarray):
    return torch.from_numpy(a).double().permute(0, 3, 1, 2).contiguous()


def nhwc(t) -> np.ndarray:
    return t.detach().permute(0, 2, 3, 1).numpy()


@pytest.mark.torch
@pytest.mark.parametrize("mode", ["max", "l2"])
@pytest.mark.parametrize("case", POOL_CASES)
def test_pool_matches_torch(torch, case, mode):
    x, out, dout, dx = pool_run(case, mode, seed=3)
    k, s = case[4], case[5]
    xt = nchw(torch, x).requires_grad_(True)
    fn = torch.nn.functional
    yt = fn.max_pool2d(xt, k, s) if mode == "max" else fn.lp_pool2d(xt, 2, k, s)
    yt.backward(nchw(torch, dout))
    np.testing.assert_allclose(out, nhwc(yt), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, nhwc(xt.grad), rtol=1e-5, atol=1e-5)


def torch_lcn(torch, xt, kernel: int, floor: float):
    """LCN from conv2d: the fixed Gaussian over the window and all channels."""
    channels = xt.shape[1]
    g = torch.from_numpy(kernels.gaussian_window(kernel)).double()
    weight = (torch.outer(g, g) / channels).expand(1, channels, kernel, kernel)
    conv = torch.nn.functional.conv2d
    v = xt - conv(xt, weight, padding=kernel // 2)
    sigma = torch.sqrt(conv(v * v, weight, padding=kernel // 2))
    return v / torch.clamp(sigma, min=floor)


@pytest.mark.torch
@pytest.mark.parametrize("case", LCN_CASES)
def test_lcn_matches_torch_conv2d(torch, case):
    x, out, dout, dx = lcn_run(case, seed=6)
    k, floor = case[4], case[5]
    xt = nchw(torch, x).requires_grad_(True)
    yt = torch_lcn(torch, xt, k, floor)
    yt.backward(nchw(torch, dout))
    np.testing.assert_allclose(out, nhwc(yt), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, nhwc(xt.grad), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------
# The layers in a network


def pool(mode, kernel, stride=None):
    spec = {"type": "pool", "mode": mode, "kernel": kernel}
    if stride is not None:
        spec["stride"] = stride
    return spec


def lcn(kernel, floor=None):
    spec = {"type": "lcn", "kernel": kernel}
    if floor is not None:
        spec["floor"] = floor
    return spec


LOCAL = {"type": "local", "kernel": 3, "channels": 4, "activation": "tanh"}
PAPER_SHAPE = [LOCAL, pool("l2", 2), lcn(3, 0.2),
               {"type": "local", "kernel": 2, "channels": 3, "activation": "tanh"},
               pool("max", 2, 1), lcn(3), {"type": "dense", "units": 4, "activation": "softmax"}]


def test_network_gradient_through_pool_and_lcn_matches_finite_differences():
    net = Network((10, 10, 2), PAPER_SHAPE, 4)
    rng = np.random.default_rng(8)
    params = net.init_params(rng)
    params += (rng.standard_normal(params.shape) * 0.05).astype(np.float32)
    x = randn(rng, 3, 10, 10, 2)
    y = rng.integers(0, 4, 3)
    grad = np.full(net.layout.size, np.nan, dtype=np.float32)
    loss = net.loss_and_grad(params, x, y, grad)
    assert np.isfinite(grad).all()
    h = 1e-2
    for i in rng.choice(net.layout.size, 40, replace=False):
        plus, minus = params.copy(), params.copy()
        plus[i] += h
        minus[i] -= h
        numeric = (net.loss(plus, x, y) - net.loss(minus, x, y)) / (2 * h)
        assert grad[i] == pytest.approx(numeric, rel=2e-2, abs=2e-4), i
    assert net.loss(params, x, y) == pytest.approx(loss, rel=1e-6)


MAX_POOLED = [LOCAL, pool("max", 2), {"type": "local", "kernel": 2, "channels": 3,
                                      "activation": "relu"},
              pool("max", 3, 1), {"type": "dense", "units": 4, "activation": "softmax"}]


def test_max_pool_saves_its_argmax_in_buffers_reused_step_after_step():
    """Training steps allocate nothing that stays: the argmax buffers are made once per
    training batch size, and evaluation (no backward, larger batches) neither fills nor
    grows them."""
    net = Network((12, 12, 2), MAX_POOLED, 4)
    assert [layer.saved_per_output for layer in net.layers] == [0, 1, 0, 1, 0]
    rng = np.random.default_rng(4)
    params = net.init_params(rng)
    x, y = randn(rng, 16, 12, 12, 2), rng.integers(0, 4, 16)
    grad = np.empty(net.layout.size, dtype=np.float32)
    x_eval, y_eval = np.concatenate([x] * 4), np.concatenate([y] * 4)
    first = net.loss_and_grad(params, x, y, grad)
    net.evaluate(params, x_eval, y_eval, batch_size=64)  # grows the activations, once
    saved = net._saved.rows(16)
    buffers = [a.base if a.base is not None else a for a in saved]
    argmax_bytes = sum(a.nbytes for a in saved)
    assert argmax_bytes == 16 * 4 * (net.layers[1].out_size + net.layers[3].out_size)

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        probe = np.empty(argmax_bytes // 4, dtype=np.int32)  # numpy's arrays are traced
        assert tracemalloc.get_traced_memory()[0] - base >= probe.nbytes
        del probe
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(20):
            assert net.loss_and_grad(params, x, y, grad) == first
            net.evaluate(params, x_eval, y_eval, batch_size=64)
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert grown < argmax_bytes, f"{grown} bytes stayed after 20 steps"
    assert net._saved.capacity == 16
    assert all(a.base is b or a is b for a, b in zip(net._saved.rows(16), buffers))

    # What the max pooling layers were handed: one buffer each step after step, None in
    # evaluation.
    handed: list = []
    for layer in (net.layers[1], net.layers[3]):
        def spy(*args, _forward=layer.forward):
            handed.append(args[4])
            _forward(*args)
        layer.forward = spy
    net.loss_and_grad(params, x, y, grad)
    net.loss_and_grad(params, x, y, grad)
    net.evaluate(params, x_eval, y_eval, batch_size=64)
    assert handed[4:] == [None, None]
    assert [np.shares_memory(a, b) for a, b in zip(handed[:2], buffers[1::2])] == [True] * 2
    assert all(handed[i] is handed[i + 2] for i in range(2))


def test_network_backward_through_saved_argmax_equals_finding_the_maximum_again():
    """The whole network's gradient with max pooling over ties (relu zeros, integer
    inputs) equals one computed with the kernels' reference: the first maximum of each
    window found again from x."""
    net = Network((9, 9, 2), [pool("max", 2, 1), LOCAL, pool("max", 3, 2),
                              {"type": "dense", "units": 3, "activation": "softmax"}], 3)
    rng = np.random.default_rng(9)
    params = net.init_params(rng)
    x = np.round(randn(rng, 5, 9, 9, 2))
    y = rng.integers(0, 3, 5)
    grad = np.empty(net.layout.size, dtype=np.float32)
    net.loss_and_grad(params, x, y, grad)
    # Rebuild the gradient with the layers' forward and the reference backward for pooling.
    views = net._views(params, "params")
    acts = [x.reshape(5, -1)]
    for layer, (w, b) in zip(net.layers, views):
        out = np.empty((5, layer.out_size), dtype=np.float32)
        layer.forward(acts[-1], w, b, out)  # no saved: evaluation's forward
        acts.append(out)
    dout = np.empty_like(acts[-1])
    kernels.softmax_cross_entropy(acts[-1], y, dout)
    want = np.empty_like(grad)
    grad_views = net._views(want, "grad")
    for i in reversed(range(len(net.layers))):
        layer, dx = net.layers[i], (np.empty_like(acts[i]) if i else None)
        if isinstance(layer, Pool):
            if dx is not None:
                dx[...] = ref_max_pool_backward(
                    acts[i].reshape(5, *layer.in_shape), dout.reshape(5, *layer.out_shape),
                    layer.kernel, layer.stride).reshape(5, -1)
        else:
            layer.backward(acts[i], acts[i + 1], dout, views[i][0], *grad_views[i], dx)
        dout = dx
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-6)


def test_pool_and_lcn_keep_no_parameters_and_describe_themselves():
    net = Network((10, 10, 2), PAPER_SHAPE, 4)
    with_pool = sum(layer.num_params for layer in net.layers)
    assert with_pool == net.layout.size
    assert [e.layer for e in net.layout.entries] == [0, 0, 3, 3, 6, 6]
    assert isinstance(net.layers[1], Pool) and net.layers[1].stride == 2  # default: kernel
    assert isinstance(net.layers[2], Lcn) and net.layers[2].floor == 0.2
    assert net.layers[5].floor == 0.1
    text = net.describe()
    assert "pool" in text and "l2 2x2/2" in text and "lcn" in text and "floor 0.2" in text
    # init_params draws nothing for them: the stream is that of the layers with parameters.
    plain = Network((10, 10, 2), [LOCAL, {"type": "dense", "units": 4,
                                          "activation": "softmax"}], 4)
    assert np.array_equal(net.init_params(3)[:net.layout.entries[1].stop],
                          plain.init_params(3)[:plain.layout.entries[1].stop])


IMAGE_CONFIG_ERRORS = [
    ([pool("mean", 2), {"type": "dense", "units": 3, "activation": "softmax"}],
     ("layer 0", "'mode'")),
    ([pool("max", 0), {"type": "dense", "units": 3, "activation": "softmax"}],
     ("layer 0", "'kernel'")),
    ([pool("max", 2, -1), {"type": "dense", "units": 3, "activation": "softmax"}],
     ("layer 0", "'stride'")),
    ([pool("max", 9), {"type": "dense", "units": 3, "activation": "softmax"}],
     ("layer 0", "'kernel'", "larger")),
    ([{**pool("max", 2), "activation": "relu"},
      {"type": "dense", "units": 3, "activation": "softmax"}], ("layer 0", "'activation'")),
    ([lcn(4), {"type": "dense", "units": 3, "activation": "softmax"}], ("layer 0", "odd")),
    ([lcn(3, 0), {"type": "dense", "units": 3, "activation": "softmax"}],
     ("layer 0", "'floor'")),
    ([lcn(3, "1"), {"type": "dense", "units": 3, "activation": "softmax"}],
     ("layer 0", "'floor'")),
    ([{"type": "lcn"}, {"type": "dense", "units": 3, "activation": "softmax"}],
     ("layer 0", "missing key 'kernel'")),
    ([{"type": "dense", "units": 5, "activation": "relu"}, pool("max", 2),
      {"type": "dense", "units": 3, "activation": "softmax"}], ("layer 1", "3-D")),
    ([LOCAL, lcn(3)], ("layer 1", "last layer")),
]


@pytest.mark.parametrize("layers, words", IMAGE_CONFIG_ERRORS)
def test_image_layer_config_errors_name_layer_and_key(layers, words):
    with pytest.raises(ConfigError) as info:
        Network((8, 8, 1), layers, 3)
    for word in words:
        assert word in str(info.value)


def test_image_layers_from_toml():
    config = tomllib.loads("""
        layers = [
          {type = "local", kernel = 3, channels = 4, activation = "relu"},
          {type = "pool", mode = "max", kernel = 2},
          {type = "lcn", kernel = 3, floor = 0.5},
          {type = "dense", units = 3, activation = "softmax"},
        ]""")
    net = Network((8, 8, 1), config["layers"], 3)
    assert [layer.kind for layer in net.layers] == ["local", "pool", "lcn", "dense"]
    assert net.layers[2].out_shape == (3, 3, 4)


# ---------------------------------------------------------------------------------------
# Partitioning: halo rows and cost


def test_pool_and_lcn_need_only_the_rows_their_windows_read():
    net = Network((12, 10, 2), [LOCAL, pool("max", 3, 2), lcn(3),
                                {"type": "dense", "units": 3, "activation": "softmax"}], 3)
    pooled, normed = net.layers[1], net.layers[2]   # input 10x8x4 -> 4x3x4 -> 4x3x4
    mask = needed_inputs(pooled, 1, 2).reshape(pooled.in_shape)
    assert np.flatnonzero(mask.any(axis=(1, 2))).tolist() == [2, 3, 4]
    assert np.flatnonzero(mask.any(axis=(0, 2))).tolist() == list(range(7))  # col 7: no window
    row = 8 * 4
    assert input_window(pooled, 1, 3) == (2 * row, 7 * row)
    # lcn k3: the mean reads 1 row each side, the deviation 1 more: 2 each side, clipped.
    mask = needed_inputs(normed, 1, 2).reshape(normed.in_shape)
    assert np.flatnonzero(mask.any(axis=(1, 2))).tolist() == [0, 1, 2, 3]
    assert mask[[0, 1, 2, 3]].all()
    assert input_window(normed, 2, 3) == (0, 4 * 3 * 4)


def test_partitioning_messages_carry_exactly_the_halo_rows():
    net = Network((14, 6, 1), [{"type": "local", "kernel": 3, "channels": 2,
                                "activation": "relu"}, lcn(5),
                               {"type": "dense", "units": 3, "activation": "softmax"}], 3)
    plan = Partitioning(net.layers, net.layout, 3)
    # 12 rows in blocks of 4; lcn k5 reaches 4 rows each side; a row is 4 x 2 = 8 values.
    row = 4 * 2
    middle = plan.part(1, 1)
    assert [(m.peer, m.size) for m in middle.recv] == [(0, 4 * row), (2, 4 * row)]
    first = plan.part(1, 0)
    assert [(m.peer, m.size) for m in first.recv] == [(1, 4 * row)]  # rows 4-7 only
    assert [(m.peer, m.size) for m in plan.part(1, 2).recv] == [(1, 4 * row)]
    assert plan.pieces(1) != [] and all(not part.pieces for part in plan.parts[1])


def test_cost_model_counts_pool_and_lcn_work_and_halo_bytes():
    net = Network((20, 20, 2), [LOCAL, pool("l2", 2), lcn(5),
                                {"type": "dense", "units": 4, "activation": "softmax"}], 4)
    pooled, normed = net.layers[1], net.layers[2]
    assert layer_flops(pooled, 0, 9, 8, first=False) > 0
    assert layer_flops(normed, 0, 9, 8, first=False) > layer_flops(normed, 0, 3, 8, False)
    link = Link(1e9, 1e-6)
    single = predict(net, 1, 8, 1e9, link)
    split = predict(net, 3, 8, 1e9, link)
    plan = Partitioning(net.layers, net.layout, 3)
    values = sum(plan.exchanged_values(i) for i in range(len(net.layers)))
    assert split.bytes_per_step == 2 * values * 8 * 4 + 3 * 3 * 8 * 4
    assert single.bytes_per_step == 0 and split.speedup > 1


def test_partition_owning_only_pool_or_lcn_rows_is_a_config_error():
    # 8 pool rows but only 2 local rows: 3 partitions would leave one without parameters.
    net = Network((10, 10, 1), [{"type": "local", "kernel": 3, "channels": 2,
                                 "activation": "relu"}, pool("max", 1), lcn(3),
                                {"type": "local", "kernel": 7, "channels": 1,
                                 "activation": "softmax"}], 4)
    Partitioning(net.layers, net.layout, 8)
    with pytest.raises(ConfigError, match=r"partition\(s\) \[8\] would own no units of any "
                                          r"layer with parameters.*at most 8"):
        Partitioning(net.layers, net.layout, 9)


# ---------------------------------------------------------------------------------------
# Training through the command line: one rank, partitions, Downpour (Sandblaster's
# partitioned gradient with an image network: test_sandblaster_partitions.py, "image")

IMAGE_TOML = """
[model]
layers = [
    { type = "local", kernel = 3, channels = 4, activation = "relu" },
    { type = "pool", mode = "l2", kernel = 2 },
    { type = "lcn", kernel = 3 },
    { type = "local", kernel = 2, channels = 4, activation = "relu" },
    { type = "pool", mode = "max", kernel = 2, stride = 1 },
    { type = "lcn", kernel = 3, floor = 0.2 },
    { type = "dense", units = 4, activation = "softmax" },
]
[data]
path = "synth.h5"
batch_size = 32
[optimizer]
algorithm = "sgd"
learning_rate = 0.05
[run]
max_steps = 60
eval_every_seconds = 0.5
progress_every_seconds = 0.5
threads = 1
"""
TIMEOUT = 120


@pytest.fixture(scope="module")
def image_data(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("image_layers")
    make_synthetic(folder / "synth.h5", n_train=3000, n_test=400, input_shape=(12, 12, 1),
                   num_classes=4, seed=5)
    (folder / "image.toml").write_text(IMAGE_TOML)
    return folder


def image_train(folder, out, *overrides: str) -> list:
    sets = [arg for o in (f'run.out_dir="{out}"', *overrides) for arg in ("--set", o)]
    return ["train", folder / "image.toml", *sets]


def image_summary(proc, out) -> dict:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def image_single(image_data) -> dict:
    out = image_data / "single"
    return image_summary(run_cli(image_train(image_data, out), timeout=TIMEOUT), out)


@pytest.mark.parametrize("partitions", [2, 3])
def test_image_network_trains_over_partitions_like_one_rank(image_data, image_single,
                                                             tmp_path, partitions):
    out = tmp_path / "out"
    proc = run_mpi(partitions, ["-m", "distbelief", *image_train(
        image_data, out, f"cluster.partitions={partitions}")], timeout=TIMEOUT)
    summary = image_summary(proc, out)
    assert summary["steps"] == image_single["steps"] == 60
    assert summary["final_test_loss"] == pytest.approx(image_single["final_test_loss"],
                                                       rel=1e-5)
    # It learned: 4 classes, chance 0.25 (400 test samples: one sigma 0.02); 0.35 measured.
    assert image_single["final_test_accuracy"] > 0.3
    traffic = summary["model_parallel"]
    # The pool and lcn layers' halos travel too (layer 0 reads the data).
    assert all(b > 0 for b in traffic["forward_bytes_per_step"][1:])
    assert traffic["forward_bytes_per_step"] == traffic["backward_bytes_per_step"]


def test_image_network_downpour_one_partitioned_replica_is_sequential_sgd(
        image_data, image_single, tmp_path):
    out = tmp_path / "out"
    proc = run_mpi(3, ["-m", "distbelief", *image_train(
        image_data, out, 'optimizer.algorithm="downpour"', "cluster.ps_shards=1",
        "cluster.partitions=2")], timeout=TIMEOUT)
    summary = image_summary(proc, out)
    assert summary["steps"] == 60
    assert summary["final_test_loss"] == pytest.approx(image_single["final_test_loss"],
                                                       rel=1e-5)
