"""Adagrad, SGD, SGD with momentum and Adam: same updates as torch.optim, on any 1-D float32
slice, and state that round-trips through state()/load_state(); the learning-rate
Schedule's values and the optimizers stepping on it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from distbelief.model.optimizers import (
    SGD,
    Adagrad,
    Adam,
    AdaRevision,
    Momentum,
    Schedule,
    make_optimizer,
    optimizer_for,
)


def _torch_steps(torch, opt_class, params0: np.ndarray, grads: list[np.ndarray], **kwargs):
    """Run torch's optimizer over the gradient sequence; return final params and state."""
    p = torch.nn.Parameter(torch.from_numpy(params0.copy()))
    opt = opt_class([p], **kwargs)
    for g in grads:
        p.grad = torch.from_numpy(g.copy())
        opt.step()
    return p.detach().numpy(), opt.state[p]


def _gradients(rng: np.random.Generator, size: int, steps: int) -> list[np.ndarray]:
    # Mixed scales and some exact zeros: zeros exercise eps (0 / (0 + eps) must stay 0).
    grads = []
    for _ in range(steps):
        g = (rng.standard_normal(size) * rng.choice([1e-3, 1.0, 30.0], size)).astype(np.float32)
        g[rng.random(size) < 0.1] = 0.0
        grads.append(g)
    return grads


@pytest.mark.parametrize("size", [1, 7, 1000, 4099, 100_003])
def test_adagrad_matches_torch(torch, size: int) -> None:
    rng = np.random.default_rng(size)
    params0 = rng.standard_normal(size).astype(np.float32)
    grads = _gradients(rng, size, steps=5)
    lr = 0.05
    expected, torch_state = _torch_steps(torch, torch.optim.Adagrad, params0, grads, lr=lr)

    opt = Adagrad(size, lr)
    params = params0.copy()
    for g in grads:
        opt.step(params, g)
    # torch fuses multiply-adds (FMA), we do not: a few ulps apart. Each step moves a
    # parameter by at most lr (|g| / sqrt(sum g^2) <= 1), so rounding is measured against
    # that for parameters near zero.
    np.testing.assert_allclose(opt.accum, torch_state["sum"].numpy(), rtol=1e-6)
    np.testing.assert_allclose(params, expected, rtol=1e-6, atol=1e-5 * lr * len(grads))
    assert not np.array_equal(params, params0)  # it did move


def test_adagrad_default_eps_is_torchs(torch) -> None:
    assert Adagrad(3, 0.1).eps == torch.optim.Adagrad([torch.zeros(1)]).defaults["eps"]


def test_sgd_matches_torch(torch) -> None:
    rng = np.random.default_rng(1)
    params0 = rng.standard_normal(513).astype(np.float32)
    grads = _gradients(rng, 513, steps=4)
    expected, _ = _torch_steps(torch, torch.optim.SGD, params0, grads, lr=0.1)
    opt = SGD(0.1)
    params = params0.copy()
    for g in grads:
        opt.step(params, g)
    np.testing.assert_allclose(params, expected, rtol=1e-6, atol=1e-7)


def test_adagrad_on_a_shard_slice_leaves_the_rest() -> None:
    # A parameter-server shard owns [start, stop) of the flat vector and updates only that.
    rng = np.random.default_rng(2)
    flat = rng.standard_normal(100).astype(np.float32)
    before = flat.copy()
    grad = rng.standard_normal(100).astype(np.float32)
    start, stop = 30, 71
    opt = Adagrad(stop - start, 0.1)
    opt.step(flat[start:stop], grad[start:stop])

    ref = Adagrad(stop - start, 0.1)
    expected = before[start:stop].copy()
    ref.step(expected, grad[start:stop].copy())
    np.testing.assert_array_equal(flat[start:stop], expected)
    np.testing.assert_array_equal(flat[:start], before[:start])
    np.testing.assert_array_equal(flat[stop:], before[stop:])


def test_adagrad_state_round_trip_continues_identically() -> None:
    rng = np.random.default_rng(3)
    grads = _gradients(rng, 50, steps=4)
    params_a = rng.standard_normal(50).astype(np.float32)
    params_b = params_a.copy()
    a = Adagrad(50, 0.1)
    for g in grads[:2]:
        a.step(params_a, g)
    params_b[:] = params_a
    saved = {k: v.copy() for k, v in a.state().items()}  # as a checkpoint would store it

    b = Adagrad(50, 0.1)
    b.load_state(saved)
    for g in grads[2:]:
        a.step(params_a, g)
        b.step(params_b, g)
    np.testing.assert_array_equal(params_a, params_b)
    np.testing.assert_array_equal(a.accum, b.accum)


def test_state_is_live_and_load_copies() -> None:
    opt = Adagrad(4, 0.1)
    assert opt.state()["accum"] is opt.accum
    source = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    opt.load_state({"accum": source})
    source[:] = 0.0
    np.testing.assert_array_equal(opt.accum, [1.0, 2.0, 3.0, 4.0])
    assert opt.accum.dtype == np.float32


def test_sgd_state_is_empty() -> None:
    opt = SGD(0.1)
    assert opt.state() == {}
    opt.load_state({})
    with pytest.raises(ValueError, match="keys"):
        opt.load_state({"accum": np.zeros(3, np.float32)})


@pytest.mark.parametrize("state, error, match", [
    ({}, ValueError, "keys"),
    ({"accum": np.zeros(4, np.float32), "extra": np.zeros(1)}, ValueError, "keys"),
    ({"accum": np.zeros(5, np.float32)}, ValueError, "shape"),
    ({"accum": np.array([1.0, -1.0, 0.0, 0.0], np.float32)}, ValueError, "non-negative"),
    ({"accum": np.array([1.0, np.nan, 0.0, 0.0], np.float32)}, ValueError, "finite"),
    ({"accum": np.zeros(4, np.int64)}, TypeError, "floating"),
    ([np.zeros(4, np.float32)], TypeError, "dict"),
])
def test_adagrad_load_state_rejects_bad_state(state, error, match) -> None:
    opt = Adagrad(4, 0.1)
    opt.accum[:] = 7.0
    with pytest.raises(error, match=match):
        opt.load_state(state)
    np.testing.assert_array_equal(opt.accum, 7.0)  # untouched on failure


def test_make_optimizer() -> None:
    opt = make_optimizer(True, 0.02, 10)
    assert isinstance(opt, Adagrad) and opt.size == 10 and opt.learning_rate == 0.02
    opt = make_optimizer(False, 0.5, 10)
    assert isinstance(opt, SGD) and opt.learning_rate == 0.5
    with pytest.raises(TypeError, match="adagrad"):
        make_optimizer("yes", 0.1, 10)


@pytest.mark.parametrize("learning_rate, error", [
    (0.0, ValueError), (-0.1, ValueError), (float("nan"), ValueError),
    (float("inf"), ValueError), ("0.1", TypeError), (True, TypeError),
])
def test_bad_learning_rate(learning_rate, error) -> None:
    with pytest.raises(error, match="learning_rate"):
        Adagrad(3, learning_rate)
    with pytest.raises(error, match="learning_rate"):
        SGD(learning_rate)


def test_bad_size_and_eps() -> None:
    with pytest.raises(ValueError, match="size"):
        Adagrad(-1, 0.1)
    with pytest.raises(TypeError, match="size"):
        Adagrad(3.0, 0.1)
    with pytest.raises(ValueError, match="eps"):
        Adagrad(3, 0.1, eps=-1e-3)


def test_step_rejects_wrong_length_and_dtype() -> None:
    opt = Adagrad(5, 0.1)
    with pytest.raises(ValueError, match="shape"):
        opt.step(np.zeros(6, np.float32), np.zeros(6, np.float32))
    with pytest.raises(TypeError, match="float32"):
        opt.step(np.zeros(5, np.float64), np.zeros(5, np.float32))
    with pytest.raises(TypeError, match="float32"):
        SGD(0.1).step(np.zeros(5, np.float32), np.zeros(5, np.float64))


# -- the learning-rate schedule -----------------------------------------------------------


def test_a_plain_rate_is_the_constant_schedule() -> None:
    schedule = Schedule(0.02)
    assert schedule.constant
    assert [schedule(t) for t in (0, 1, 10**9)] == [0.02, 0.02, 0.02]
    assert not Schedule(0.02, warmup_steps=1).constant
    assert not Schedule(0.02, kind="cosine", decay_steps=5).constant


def test_warmup_ramps_linearly_to_the_rate_then_holds() -> None:
    schedule = Schedule(0.1, warmup_steps=4)
    rates = [schedule(t) for t in range(7)]
    np.testing.assert_allclose(rates, [0.025, 0.05, 0.075, 0.1, 0.1, 0.1, 0.1], rtol=1e-15)
    assert rates[0] > 0  # the first update moves the parameters


def test_step_decay_changes_exactly_at_its_boundaries() -> None:
    schedule = Schedule(1.0, kind="step", decay_steps=3, decay_rate=0.5)
    assert [schedule(t) for t in range(10)] == [1, 1, 1, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25,
                                                0.125]
    # After a warmup the decay counts from the warmup's end.
    warm = Schedule(1.0, warmup_steps=2, kind="step", decay_steps=3, decay_rate=0.5)
    assert [warm(t) for t in range(8)] == [0.5, 1, 1, 1, 1, 0.5, 0.5, 0.5]
    floored = Schedule(1.0, kind="step", decay_steps=1, decay_rate=0.1,
                       min_learning_rate=0.05)
    assert [floored(t) for t in range(4)] == [1.0, 0.1, 0.05, 0.05]


def test_cosine_runs_from_the_rate_to_the_minimum_and_stays() -> None:
    schedule = Schedule(0.1, kind="cosine", decay_steps=10, min_learning_rate=0.01)
    assert schedule(0) == 0.1
    assert schedule(5) == pytest.approx(0.055, rel=1e-12)  # half-way: the mean
    assert schedule(10) == pytest.approx(0.01, rel=1e-12)
    assert schedule(11) == schedule(10**6) == pytest.approx(0.01, rel=1e-12)
    rates = [schedule(t) for t in range(12)]
    assert (np.diff(rates[:11]) < 0).all()  # strictly down to the end
    assert Schedule(0.1, kind="cosine", decay_steps=4)(4) == 0.0  # default minimum 0
    warm = Schedule(0.1, warmup_steps=3, kind="cosine", decay_steps=10)
    assert [warm(t) for t in range(4)] == pytest.approx([0.1 / 3, 0.2 / 3, 0.1, 0.1])
    assert warm(3 + 10) == 0.0
    assert warm(3 + 5) == pytest.approx(0.05 * (1 + math.cos(math.pi / 2)))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"kind": "linear"}, ValueError, "kind"),
    ({"kind": "cosine"}, ValueError, "decay_steps"),
    ({"kind": "step", "decay_steps": 0}, ValueError, "decay_steps"),
    ({"kind": "step", "decay_steps": 2.0}, TypeError, "decay_steps"),
    ({"warmup_steps": -1}, ValueError, "warmup_steps"),
    ({"kind": "step", "decay_steps": 2, "decay_rate": 1.0}, ValueError, "decay_rate"),
    ({"kind": "step", "decay_steps": 2, "decay_rate": 0.0}, ValueError, "decay_rate"),
    ({"kind": "cosine", "decay_steps": 2, "min_learning_rate": 0.1}, ValueError,
     "min_learning_rate"),
    ({"kind": "cosine", "decay_steps": 2, "min_learning_rate": -0.01}, ValueError,
     "min_learning_rate"),
])
def test_bad_schedules(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        Schedule(0.1, **kwargs)


def test_schedule_rejects_a_negative_update() -> None:
    with pytest.raises(ValueError, match="update"):
        Schedule(0.1)(-1)


def test_optimizers_step_at_the_scheduled_rate() -> None:
    schedule = Schedule(0.4, warmup_steps=4)
    params = np.zeros(3, np.float32)
    sgd = SGD(schedule)
    assert sgd.learning_rate == 0.4 and sgd.schedule is schedule
    for update, expected in [(0, -0.1), (1, -0.3), (3, -0.7)]:
        sgd.step(params, np.ones(3, np.float32), update=update)
        np.testing.assert_allclose(params, expected, rtol=1e-6)
    # Adagrad on a schedule takes exactly the step of Adagrad at that update's rate.
    rng = np.random.default_rng(5)
    grads = [rng.standard_normal(50).astype(np.float32) for _ in range(6)]
    scheduled = Adagrad(50, Schedule(0.1, kind="step", decay_steps=2, decay_rate=0.5))
    a = np.ones(50, np.float32)
    b = a.copy()
    fixed = [Adagrad(50, lr) for lr in (0.1, 0.1, 0.05, 0.05, 0.025, 0.025)]
    for t, g in enumerate(grads):
        fixed[t].accum[:] = scheduled.accum  # the same history before this step
        scheduled.step(a, g, update=t)
        fixed[t].step(b, g)
        np.testing.assert_array_equal(a, b)


def test_a_scheduled_step_needs_its_update_number() -> None:
    params, grad = np.zeros(2, np.float32), np.ones(2, np.float32)
    for opt in (SGD(Schedule(0.1, warmup_steps=2)),
                Adagrad(2, Schedule(0.1, kind="cosine", decay_steps=3))):
        with pytest.raises(ValueError, match="update="):
            opt.step(params, grad)
    revising = AdaRevision(2, Schedule(0.1, warmup_steps=2))
    with pytest.raises(ValueError, match="update="):
        revising.step(params, grad, version=0, fetched=0)
    revising.step(params, grad, version=0, fetched=0, update=0)
    np.testing.assert_allclose(params, -0.05, rtol=1e-5)  # lr/2 * g/sqrt(g^2)
    # A constant schedule keeps working without a count, as before schedules existed.
    SGD(0.1).step(params, grad)


def test_factories_take_a_schedule() -> None:
    schedule = Schedule(0.3, warmup_steps=3)
    assert make_optimizer(True, schedule, 4).schedule is schedule
    assert make_optimizer(False, schedule, 4).schedule is schedule
    for update in ("adagrad", "sgd", "adarevision"):
        opt = optimizer_for(update, schedule, 4)
        assert opt.schedule is schedule and opt.rate(0) == pytest.approx(0.1)


# -- SGD with momentum and Adam ------------------------------------------------------

def _numpy_momentum(params, grads, lr, mu, nesterov):
    p, buf = params.astype(np.float64), np.zeros(len(params))
    for g in grads:
        buf = mu * buf + g
        p -= lr * (g + mu * buf if nesterov else buf)
    return p


def _numpy_adam(params, grads, lr, b1, b2, eps):
    p, m, v = params.astype(np.float64), np.zeros(len(params)), np.zeros(len(params))
    for t, g in enumerate(grads, 1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p -= lr / (1 - b1 ** t) * m / (np.sqrt(v) / np.sqrt(1 - b2 ** t) + eps)
    return p


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_follows_its_rule(nesterov):
    rng = np.random.default_rng(3)
    params0 = rng.standard_normal(777).astype(np.float32)
    grads = _gradients(rng, 777, steps=20)
    opt = Momentum(777, 0.01, momentum=0.9, nesterov=nesterov)
    params, copy = params0.copy(), np.empty_like(params0)
    for t, g in enumerate(grads):
        opt.step(params, g, copy, update=t)
    assert np.array_equal(params, copy)
    np.testing.assert_allclose(params, _numpy_momentum(params0, grads, 0.01, 0.9, nesterov),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.9)])  # both sides of torch's lerp
def test_adam_follows_its_rule(betas):
    rng = np.random.default_rng(4)
    params0 = rng.standard_normal(1001).astype(np.float32)
    grads = _gradients(rng, 1001, steps=20)
    opt = Adam(1001, 1e-3, *betas)
    params = params0.copy()
    for t, g in enumerate(grads):
        opt.step(params, g, update=t)
    np.testing.assert_allclose(params, _numpy_adam(params0, grads, 1e-3, *betas, 1e-8),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_matches_torch(torch, nesterov):
    rng = np.random.default_rng(5)
    params0 = rng.standard_normal(4099).astype(np.float32)
    grads = _gradients(rng, 4099, steps=10)
    expected, state = _torch_steps(torch, torch.optim.SGD, params0, grads, lr=0.01,
                                   momentum=0.9, nesterov=nesterov)
    opt = Momentum(4099, 0.01, 0.9, nesterov)
    params = params0.copy()
    for t, g in enumerate(grads):
        opt.step(params, g, update=t)
    np.testing.assert_allclose(opt.buf, state["momentum_buffer"].numpy(), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(params, expected, rtol=1e-5, atol=1e-5)


def test_adam_matches_torch(torch):
    rng = np.random.default_rng(6)
    params0 = rng.standard_normal(4099).astype(np.float32)
    grads = _gradients(rng, 4099, steps=10)
    expected, state = _torch_steps(torch, torch.optim.Adam, params0, grads, lr=1e-3)
    opt = Adam(4099, 1e-3)
    params = params0.copy()
    for t, g in enumerate(grads):
        opt.step(params, g, update=t)
    # m averages gradients of up to ~100 that cancel: float32 rounding of those, ~1e-5.
    np.testing.assert_allclose(opt.exp_avg, state["exp_avg"].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(opt.exp_avg_sq, state["exp_avg_sq"].numpy(), rtol=1e-5)
    # Where v is tiny (gradients of 1e-3 and exact zeros), m / sqrt(v) magnifies the ulps
    # torch's FMAs save: within 0.1% of one step (lr) of each other.
    np.testing.assert_allclose(params, expected, rtol=1e-6, atol=1e-3 * 1e-3)
    assert opt.eps == torch.optim.Adam([torch.zeros(1)]).defaults["eps"]


def test_state_round_trips_and_bad_state_is_refused():
    for opt in (Momentum(5, 0.1), Adam(5, 0.1)):
        for t in range(3):
            opt.step(np.ones(5, np.float32), np.arange(5, dtype=np.float32), update=t)
        saved = {k: v.copy() for k, v in opt.state().items()}
        fresh = type(opt)(5, 0.1)
        fresh.load_state(saved)
        for k, v in fresh.state().items():
            assert np.array_equal(v, saved[k]) and np.any(v != 0)
        with pytest.raises(ValueError, match="must have"):
            fresh.load_state({k: v[:3] for k, v in saved.items()})
        with pytest.raises(ValueError, match="finite"):
            fresh.load_state({k: np.full(5, np.nan, np.float32) for k in saved})
    with pytest.raises(ValueError, match="needs update="):
        Adam(5, 0.1).step(np.ones(5, np.float32), np.ones(5, np.float32))
    with pytest.raises(ValueError, match="momentum"):
        Momentum(5, 0.1, momentum=1.0)
    assert isinstance(optimizer_for("adam", 0.1, 5, beta1=0.8), Adam)


@pytest.mark.parametrize("make", [
    lambda rate: Adagrad(6, rate), lambda rate: SGD(rate), lambda rate: Momentum(6, rate),
    lambda rate: AdaRevision(6, rate, history=8)],
    ids=["adagrad", "sgd", "momentum", "adarevision"])
def test_inverse_staleness_divides_the_rate_of_a_stale_update(make) -> None:
    import copy

    from distbelief.algorithms.downpour.options import STALENESS_SCALINGS
    from distbelief.model import optimizers

    assert STALENESS_SCALINGS == optimizers.STALENESS_SCALINGS
    rng = np.random.default_rng(0)
    params, grad = rng.normal(size=6).astype(np.float32), rng.normal(size=6).astype(np.float32)
    info = optimizers.StepInfo(update=3, version=5, fetched=1)  # 4 updates since its fetch
    scaled, reference = make(0.1), make(0.025)
    scaled.staleness_scaling = "inverse"
    piece = copy.copy(scaled)  # a shared-memory client's rule for a piece of the slice
    assert piece.staleness_scaling == "inverse"
    got, expected = params.copy(), params.copy()
    scaled.apply(got, grad, info)
    reference.apply(expected, grad, info)  # the same rule at a quarter of the rate
    assert np.allclose(got, expected, rtol=1e-6)
    assert scaled.rate(3) == pytest.approx(0.1)  # only the update apply applies is scaled
    fresh = optimizers.StepInfo(update=4, version=6, fetched=5)  # one update: full rate
    assert optimizers.staleness_scale("inverse", fresh) == 1.0
    scaled.apply(got, grad, fresh)
    assert scaled.scaling_stats() == {"scaling": "inverse", "updates": 2,
                                      "rate_scale_mean": pytest.approx(0.625)}
    assert reference.scaling_stats() is None


def test_dcasgd_compensates_each_gradient_with_the_last_steps_curvature() -> None:
    from distbelief.model.optimizers import DCASGD

    rng = np.random.default_rng(1)
    rule = DCASGD(5, 0.1, dc_lambda=0.5)
    params = rng.normal(size=5).astype(np.float32)
    expected, last = params.astype(np.float64), np.zeros(5)
    for update in range(3):
        grad = rng.normal(size=5).astype(np.float32)
        g = grad.astype(np.float64)
        last = -0.1 * (g + 0.5 * g * g * last)  # the first update is plain SGD (last = 0)
        expected += last
        copy = np.empty_like(params)
        rule.step(params, grad, copy, update=update)
        assert np.allclose(params, expected, rtol=1e-5) and np.array_equal(copy, params)
    saved = {k: v.copy() for k, v in rule.state().items()}
    again = optimizer_for("dcasgd", 0.1, 5, dc_lambda=0.5)
    again.load_state(saved)
    assert np.array_equal(again.last_step, rule.last_step)
    with pytest.raises(ValueError, match="dc_lambda must be a non-negative"):
        DCASGD(5, 0.1, dc_lambda=-1.0)
