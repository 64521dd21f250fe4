"""Tests of distbelief.model.network and .layers: gradients against finite differences
of an independent float64 numpy reference and against torch autograd, the flat parameter
layout, initialisation, configuration errors, and evaluation."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from distbelief.errors import ConfigError, DataError
from distbelief.model.layers import Local
from distbelief.model.network import Network

# -- an independent float64 reference ---------------------------------------------------
# Written from the spec alone (its own shapes and offsets), so it also checks the layout.


def ref_activation(z: np.ndarray, activation: str) -> np.ndarray:
    if activation == "relu":
        return np.maximum(z, 0.0)
    if activation == "sigmoid":
        return 1.0 / (1.0 + np.exp(-z))
    if activation == "tanh":
        return np.tanh(z)
    return z  # linear, and softmax's logits


def ref_local(x: np.ndarray, w: np.ndarray, b: np.ndarray, kernel: int,
              stride: int) -> np.ndarray:
    """Locally connected layer by explicit loops over output positions."""
    n, _, _, _ = x.shape
    out_h, out_w, _, cout = w.shape
    out = np.empty((n, out_h, out_w, cout))
    for i in range(out_h):
        for j in range(out_w):
            patch = x[:, i * stride:i * stride + kernel, j * stride:j * stride + kernel, :]
            out[:, i, j, :] = patch.reshape(n, -1) @ w[i, j] + b[i, j]
    return out


def ref_take(flat: np.ndarray, offset: int, shape: tuple[int, ...]) -> tuple[np.ndarray, int]:
    size = int(np.prod(shape))
    return flat[offset:offset + size].reshape(shape), offset + size


def ref_logits(input_shape, specs, params: np.ndarray, x: np.ndarray) -> np.ndarray:
    h = x.astype(np.float64)
    shape = tuple(input_shape)
    offset = 0
    for spec in specs:
        if spec["type"] == "dense":
            h = h.reshape(len(h), -1)
            units_in = h.shape[1]
            w, offset = ref_take(params, offset, (spec["units"], units_in))
            b, offset = ref_take(params, offset, (spec["units"],))
            h = ref_activation(h @ w.T + b, spec["activation"])
            shape = (spec["units"],)
        else:
            k, s, c = spec["kernel"], spec.get("stride", 1), spec["channels"]
            height, width, cin = shape
            shape = ((height - k) // s + 1, (width - k) // s + 1, c)
            w, offset = ref_take(params, offset, (shape[0], shape[1], k * k * cin, c))
            b, offset = ref_take(params, offset, shape)
            h = ref_local(h.reshape(len(h), height, width, cin), w, b, k, s)
            h = ref_activation(h, spec["activation"])
    assert offset == len(params), "reference consumed a different number of parameters"
    return h.reshape(len(h), -1)


def ref_loss(input_shape, specs, params: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    z = ref_logits(input_shape, specs, params, x)
    zmax = z.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z - zmax).sum(axis=1)) + zmax[:, 0]
    return float(np.mean(lse - z[np.arange(len(y)), y]))


def central_differences(f, v: np.ndarray, h: float = 1e-6) -> np.ndarray:
    v = v.astype(np.float64).copy()
    g = np.empty_like(v)
    for i in range(v.size):
        old = v.flat[i]
        v.flat[i] = old + h
        up = f(v)
        v.flat[i] = old - h
        down = f(v)
        v.flat[i] = old
        g.flat[i] = (up - down) / (2 * h)
    return g


def assert_grad_close(got: np.ndarray, want: np.ndarray) -> None:
    """Float32 analytic gradient against a float64 reference, relative to its scale."""
    scale = np.abs(want).max()
    assert scale > 1e-3, "degenerate test: the reference gradient is ~0"
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale)


def random_problem(input_shape, specs, num_classes, n=5, seed=0):
    """A network, float32 params with random (non-zero) biases, inputs and labels."""
    net = Network(input_shape, specs, num_classes)
    rng = np.random.default_rng(seed)
    params = net.init_params(rng)
    for entry in net.layout.entries:
        if entry.name == "bias":
            params[entry.offset:entry.stop] = rng.uniform(-0.5, 0.5, entry.size)
    x = rng.standard_normal((n, *input_shape)).astype(np.float32)
    y = rng.integers(0, num_classes, n)
    return net, params, x, y


def dense(units, activation):
    return {"type": "dense", "units": units, "activation": activation}


def local(kernel, channels, activation, stride=None):
    spec = {"type": "local", "kernel": kernel, "channels": channels, "activation": activation}
    if stride is not None:
        spec["stride"] = stride
    return spec


GRADIENT_CASES = {
    "dense, every activation": (
        (7,), [dense(6, "relu"), dense(5, "sigmoid"), dense(5, "tanh"), dense(4, "linear"),
               dense(3, "softmax")], 3),
    "dense on image input": ((3, 4, 2), [dense(5, "tanh"), dense(4, "softmax")], 4),
    "local stride 1, odd sizes": (
        (7, 5, 3), [local(3, 4, "tanh", stride=1), dense(3, "softmax")], 3),
    "local stride 2, then local": (
        (9, 7, 2), [local(3, 3, "sigmoid", stride=2), local(2, 2, "relu"),
                    dense(3, "softmax")], 3),
    "local linear, relu, then dense": (
        (6, 7, 2), [local(2, 3, "linear"), local(3, 2, "relu", stride=2), dense(5, "relu"),
                    dense(4, "softmax")], 4),
    "local output layer": ((5, 6, 2), [local(3, 2, "tanh"), local(2, 1, "softmax")], 6),
}


@pytest.mark.parametrize("case", GRADIENT_CASES)
def test_gradient_matches_finite_differences(case):
    input_shape, specs, num_classes = GRADIENT_CASES[case]
    net, params, x, y = random_problem(input_shape, specs, num_classes)
    grad = np.full(net.layout.size, np.nan, dtype=np.float32)
    loss = net.loss_and_grad(params, x, y, grad)

    def f(p):
        return ref_loss(input_shape, specs, p, x, y)

    want_loss = f(params.astype(np.float64))
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert net.loss(params, x, y) == pytest.approx(want_loss, rel=1e-5)
    np.testing.assert_allclose(net.logits(params, x),
                               ref_logits(input_shape, specs, params.astype(np.float64), x),
                               rtol=1e-4, atol=1e-5)
    assert_grad_close(grad, central_differences(f, params))


@pytest.mark.parametrize("stride", [1, 2])
def test_input_gradient_through_two_local_layers(stride):
    """Local.backward's dx, chained through a second local layer, against finite
    differences with respect to the input image."""
    rng = np.random.default_rng(3)
    first = Local((8, 7, 2), kernel=3, stride=stride, channels=3, activation="tanh")
    second = Local(first.out_shape, kernel=2, stride=1, channels=2, activation="sigmoid")
    arrays = []
    for layer in (first, second):
        shapes = dict(layer.param_shapes())
        arrays.append([rng.standard_normal(shapes["weights"]).astype(np.float32),
                       rng.uniform(-0.5, 0.5, shapes["bias"]).astype(np.float32)])
    n = 3
    x = rng.standard_normal((n, first.in_size)).astype(np.float32)
    probe = rng.standard_normal((n, second.out_size))  # loss = sum(probe * output)

    h1 = np.empty((n, first.out_size), np.float32)
    h2 = np.empty((n, second.out_size), np.float32)
    first.forward(x, *arrays[0], h1)
    second.forward(h1, *arrays[1], h2)
    dh2 = probe.astype(np.float32)
    dh1 = np.full_like(h1, np.nan)
    dx = np.full_like(x, np.nan)
    grads = [[np.empty_like(a) for a in pair] for pair in arrays]
    second.backward(h1, h2, dh2, arrays[1][0], *grads[1], dh1)
    first.backward(x, h1, dh1, arrays[0][0], *grads[0], dx)

    def f(xv):
        image = xv.reshape(n, *first.in_shape)
        a = ref_activation(ref_local(image, *arrays[0], 3, stride), "tanh")
        b = ref_activation(ref_local(a, *arrays[1], 2, 1), "sigmoid")
        return float(np.sum(probe * b.reshape(n, -1)))

    assert_grad_close(dx, central_differences(f, x))


# -- against torch autograd -------------------------------------------------------------

def torch_loss_and_grads(torch, net: Network, specs, params: np.ndarray, x: np.ndarray,
                         y: np.ndarray):
    """Loss and flat gradient from torch autograd in float64, from the same flat params."""
    flat = torch.tensor(params, dtype=torch.float64)
    tensors = []
    for entry in net.layout.entries:
        t = flat[entry.offset:entry.stop].reshape(entry.shape).clone().requires_grad_(True)
        tensors.append(t)
    h = torch.tensor(x, dtype=torch.float64)
    acts = {"relu": torch.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh}
    for i, spec in enumerate(specs):
        w, b = tensors[2 * i], tensors[2 * i + 1]
        if spec["type"] == "dense":
            h = h.reshape(len(h), -1) @ w.T + b
        else:
            k, s = spec["kernel"], spec.get("stride", 1)
            out_h, out_w, _, cout = w.shape
            cin = h.shape[-1]
            # unfold wants NCHW and orders a patch (channel, row, col); ours is (row, col,
            # channel).
            cols = torch.nn.functional.unfold(h.permute(0, 3, 1, 2), k, stride=s)
            cols = cols.reshape(len(h), cin, k, k, out_h * out_w).permute(0, 4, 2, 3, 1)
            cols = cols.reshape(len(h), out_h * out_w, k * k * cin)
            out = torch.einsum("nlp,lpo->nlo", cols, w.reshape(out_h * out_w, -1, cout))
            h = out.reshape(len(h), out_h, out_w, cout) + b
        h = acts.get(spec["activation"], lambda t: t)(h)
    loss = torch.nn.functional.cross_entropy(h.reshape(len(h), -1),
                                             torch.tensor(y, dtype=torch.long))
    loss.backward()
    return loss.item(), torch.cat([t.grad.reshape(-1) for t in tensors]).numpy()


TORCH_CASES = {
    "reference MLP": ((784,), [dense(512, "relu"), dense(512, "relu"), dense(10, "softmax")],
                      10),
    "local layers then dense": (
        (12, 11, 3), [local(5, 4, "relu"), local(3, 6, "tanh", stride=2),
                      dense(7, "sigmoid"), dense(5, "softmax")], 5),
}


@pytest.mark.parametrize("case", TORCH_CASES)
def test_matches_torch_autograd(torch, case):
    input_shape, specs, num_classes = TORCH_CASES[case]
    net, params, x, y = random_problem(input_shape, specs, num_classes, n=16, seed=7)
    grad = np.full(net.layout.size, np.nan, dtype=np.float32)
    loss = net.loss_and_grad(params, x, y, grad)
    want_loss, want_grad = torch_loss_and_grads(torch, net, specs, params, x, y)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert_grad_close(grad, want_grad)


# -- layout, buffers, initialisation ----------------------------------------------------

MIXED = ((9, 8, 2), [local(3, 4, "relu", stride=2), dense(6, "tanh"), dense(3, "softmax")], 3)


def test_layout_shapes_and_offsets():
    net = Network(*MIXED)
    want = [(0, "weights", (4, 3, 3 * 3 * 2, 4)), (0, "bias", (4, 3, 4)),
            (1, "weights", (6, 48)), (1, "bias", (6,)),
            (2, "weights", (3, 6)), (2, "bias", (3,))]
    assert [(e.layer, e.name, e.shape) for e in net.layout.entries] == want
    offsets = np.cumsum([0] + [int(np.prod(s)) for _, _, s in want])
    assert [e.offset for e in net.layout.entries] == list(offsets[:-1])
    assert net.layout.size == offsets[-1]
    lines = net.describe().splitlines()
    assert len(lines) == 3
    assert "local" in lines[0] and "4x3x4" in lines[0] and f"{4 * 3 * (18 * 4 + 4):,}" in lines[0]
    assert "dense" in lines[2] and "softmax" in lines[2]


def test_model_reads_params_and_writes_grad_in_place():
    net, params, x, y = random_problem(*MIXED, n=4)
    w = net.layout.view(params, 2, "weights")
    assert np.shares_memory(w, params)
    before = net.logits(params, x)
    w[1, :] += 1.0  # a write through the view must change output unit 1 only
    after = net.logits(params, x)
    assert not np.allclose(before[:, 1], after[:, 1])
    np.testing.assert_array_equal(before[:, [0, 2]], after[:, [0, 2]])

    grad = np.full(net.layout.size, np.nan, dtype=np.float32)
    net.loss_and_grad(params, x, y, grad)
    assert np.isfinite(grad).all(), "some gradient entries were not written"
    dw = net.layout.view(grad, 1, "weights")
    assert np.shares_memory(dw, grad) and np.abs(dw).max() > 0


def test_buffers_reused_across_batch_sizes():
    """A model that has seen bigger and smaller batches gives the same results as a
    fresh one: cached buffers never leak values between calls."""
    net, params, x, y = random_problem(*MIXED, n=9)
    for n in (9, 2, 5):
        fresh = Network(*MIXED)
        g_used, g_fresh = (np.empty(net.layout.size, np.float32) for _ in range(2))
        assert net.loss_and_grad(params, x[:n], y[:n], g_used) == \
            fresh.loss_and_grad(params, x[:n], y[:n], g_fresh)
        np.testing.assert_array_equal(g_used, g_fresh)
    first = net.logits(params, x[:3])
    net.logits(params, x[3:6])
    np.testing.assert_array_equal(first, Network(*MIXED).logits(params, x[:3]))
    other = params * np.float32(0.5)  # a different vector: views must not be stale
    np.testing.assert_array_equal(net.logits(other, x[:3]), Network(*MIXED).logits(other, x[:3]))
    assert not np.array_equal(net.logits(other, x[:3]), first)


def test_init_deterministic_and_scaled():
    net = Network((50,), [dense(400, "relu"), dense(300, "tanh"), dense(10, "softmax")], 10)
    a, b = net.init_params(1), net.init_params(np.random.default_rng(1))
    np.testing.assert_array_equal(a, b)
    assert a.dtype == np.float32 and a.shape == (net.layout.size,)
    assert not np.array_equal(a, net.init_params(2))
    for i, (fan_in, fan_out, relu) in enumerate([(50, 400, True), (400, 300, False)]):
        w = net.layout.view(a, i, "weights")
        limit = np.sqrt(6 / fan_in) if relu else np.sqrt(6 / (fan_in + fan_out))
        assert np.abs(w).max() <= limit
        assert np.std(w) == pytest.approx(limit / np.sqrt(3), rel=0.02)  # uniform(-l, l)
        assert not net.layout.view(a, i, "bias").any()


def test_constructor_is_cheap():
    """The config checker builds paper-sized models; no parameters may be allocated.
    Measured in bytes (numpy reports its buffers to tracemalloc), not in seconds: the
    parameters would be 8 GB, the layout is a few kB."""
    tracemalloc.start()
    try:
        net = Network((200, 200, 3), [local(10, 64, "relu"), local(10, 64, "relu", stride=2),
                                      dense(1000, "relu"), dense(1000, "softmax")], 1000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert net.layout.size > 2**31
    assert peak < 10 * 2**20, f"{peak} bytes allocated building the model"


# -- evaluation and input checks --------------------------------------------------------


def test_evaluate_separable_batch():
    """One dense softmax layer with identity weights classifies one-hot inputs exactly."""
    net = Network((4,), [dense(4, "softmax")], 4)
    params = net.layout.empty()
    net.layout.view(params, 0, "weights")[...] = 5 * np.eye(4)
    labels = np.array([0, 1, 2, 3, 2, 1, 0])
    x = np.eye(4, dtype=np.float32)[labels]
    result = net.evaluate(params, x, labels, batch_size=3)
    loss, acc = result.loss, result.score
    assert result.score_name == "accuracy" and result.rows == 7
    assert acc == 1.0
    assert loss == pytest.approx(np.log(1 + 3 * np.exp(-5.0)), rel=1e-5)
    wrong = (labels + 1) % 4
    wrong[:3] = labels[:3]  # 3 of 7 right
    result = net.evaluate(params, x, wrong, batch_size=2)
    loss_w, acc_w = result.loss, result.figures["accuracy"]
    assert acc_w == pytest.approx(3 / 7)
    assert loss_w == pytest.approx(net.loss(params, x, wrong), rel=1e-6)


def test_bad_inputs_raise():
    net, params, x, y = random_problem(*MIXED, n=3)
    with pytest.raises(DataError, match="shape"):
        net.loss(params, x[:, :8], y)
    with pytest.raises(DataError, match="float32"):
        net.loss(params, x.astype(np.float64), y)
    with pytest.raises(DataError, match="labels"):
        net.loss(params, x, y[:2])
    with pytest.raises(ValueError, match="grad"):
        net.loss_and_grad(params, x, y, np.empty(net.layout.size, np.float64))
    with pytest.raises(ValueError, match="params"):
        net.loss(params[:-1], x, y)
    with pytest.raises(ValueError, match="overlap"):
        net.loss_and_grad(params, x, y, params)


# -- configuration errors ---------------------------------------------------------------

CONFIG_ERRORS = [
    # (input_shape, layers, num_classes, text the message must contain)
    ((4,), [{"type": "lstm", "units": 3, "activation": "softmax"}], 3, ("layer 0", "'type'")),
    ((4,), [dense(5, "relu"), {"units": 3, "activation": "softmax"}], 3, ("layer 1", "'type'")),
    ((4,), [dense(5, "relu"), {**dense(3, "softmax"), "kernel": 2}], 3, ("layer 1", "'kernel'")),
    ((4,), [{"type": "dense", "activation": "softmax"}], 3, ("layer 0", "'units'")),
    ((4,), [{"type": "dense", "units": 3}], 3, ("layer 0", "'activation'")),
    ((4,), [dense(0, "relu"), dense(3, "softmax")], 3, ("layer 0", "'units'")),
    ((4,), [dense("8", "relu"), dense(3, "softmax")], 3, ("layer 0", "'units'")),
    ((4,), [dense(True, "relu"), dense(3, "softmax")], 3, ("layer 0", "'units'")),
    ((4,), [dense(5, "gelu"), dense(3, "softmax")], 3, ("layer 0", "'activation'")),
    ((4,), [dense(5, "softmax"), dense(3, "softmax")], 3, ("layer 0", "'activation'")),
    ((4,), [dense(5, "relu"), dense(3, "relu")], 3, ("layer 1", "'activation'")),
    ((4,), [dense(5, "relu"), dense(4, "softmax")], 3, ("layer 1", "'units'")),
    ((8, 8, 1), [local(3, 2, "relu"), local(3, 2, "softmax")], 3, ("layer 1", "'channels'")),
    ((8, 8, 1), [local(3, 2, "relu", stride=0), dense(3, "softmax")], 3,
     ("layer 0", "'stride'")),
    ((8, 8, 1), [local(-1, 2, "relu"), dense(3, "softmax")], 3, ("layer 0", "'kernel'")),
    ((8, 8, 1), [local(3, 2.5, "relu"), dense(3, "softmax")], 3, ("layer 0", "'channels'")),
    ((8, 5, 1), [local(6, 2, "relu"), dense(3, "softmax")], 3, ("layer 0", "'kernel'")),
    ((8, 8, 1), [local(3, 2, "relu"), local(7, 2, "relu"), dense(3, "softmax")], 3,
     ("layer 1", "'kernel'")),
    ((8, 8, 1), [dense(16, "relu"), local(2, 2, "relu"), dense(3, "softmax")], 3,
     ("layer 1", "after a dense layer")),
    ((64,), [local(2, 2, "relu"), dense(3, "softmax")], 3, ("layer 0", "3-D")),
    ((4,), ["dense"], 3, ("layer 0",)),
    ((4,), [], 3, ("layers",)),
    ((4, 4), [dense(3, "softmax")], 3, ("input_shape",)),
    ((4, 0, 1), [dense(3, "softmax")], 3, ("input_shape",)),
    ((4,), [dense(1, "softmax")], 1, ("num_classes",)),
]


@pytest.mark.parametrize("input_shape, layers, num_classes, words", CONFIG_ERRORS)
def test_config_errors_name_layer_and_key(input_shape, layers, num_classes, words):
    with pytest.raises(ConfigError) as info:
        Network(input_shape, layers, num_classes)
    for word in words:
        assert word in str(info.value)


def test_valid_spec_from_toml():
    import tomllib

    config = tomllib.loads("""
        layers = [
          {type = "local", kernel = 5, stride = 1, channels = 8, activation = "relu"},
          {type = "dense", units = 32, activation = "sigmoid"},
          {type = "dense", units = 10, activation = "softmax"},
        ]
    """)
    net = Network((28, 28, 1), config["layers"], 10)
    assert [layer.out_shape for layer in net.layers] == [(24, 24, 8), (32,), (10,)]
