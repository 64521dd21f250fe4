"""The losses beyond classification (distbelief.model.losses): mse and binary cross-entropy
train through the built-in network with exact gradients, their metrics are the textbook
ones, evaluations of pieces add up to the whole's, and a loss that does not fit the data
or the target is one clear ConfigError."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from distbelief.config import config_from_dict
from distbelief.errors import ConfigError, DataError
from distbelief.model.losses import (
    BinaryCrossEntropy,
    CrossEntropy,
    MeanSquaredError,
    loss_for_data,
)
from distbelief.model.network import Network
from distbelief.model.protocol import OwnModel

RNG = np.random.default_rng(0)


def dense(units: int, activation: str) -> dict:
    return {"type": "dense", "units": units, "activation": activation}


def finite_difference(net: Network, params: np.ndarray, x: np.ndarray, y: np.ndarray,
                      picks: np.ndarray, eps: float = 1e-2) -> np.ndarray:
    """Central differences of the mean loss at `picks`, in float64 from float32 steps."""
    out = []
    for i in picks:
        up, down = params.copy(), params.copy()
        up[i] += eps
        down[i] -= eps
        out.append((net.loss(up, x, y) - net.loss(down, x, y)) / (2 * eps))
    return np.array(out)


@pytest.mark.parametrize("loss, output", [(MeanSquaredError(3), "linear"),
                                          (BinaryCrossEntropy(3), "sigmoid")])
def test_the_gradient_of_a_value_loss_matches_finite_differences(loss, output) -> None:
    net = Network((5,), [dense(8, "tanh"), dense(3, output)], 3, loss=loss)
    params = net.init_params(1)
    x = RNG.normal(size=(7, 5)).astype(np.float32)
    y = (RNG.random((7, 3)) > 0.5).astype(np.float32) if output == "sigmoid" \
        else RNG.normal(size=(7, 3)).astype(np.float32)
    grad = np.empty_like(params)
    value = net.loss_and_grad(params, x, y, grad)
    assert value == pytest.approx(net.loss(params, x, y), rel=1e-6)
    picks = np.arange(0, params.size, 7)
    np.testing.assert_allclose(grad[picks], finite_difference(net, params, x, y, picks),
                               rtol=2e-2, atol=2e-4)


def test_mse_is_the_mean_squared_error_and_its_metrics_are_rmse_and_r2() -> None:
    net = Network((4,), [dense(2, "linear")], 2, loss=MeanSquaredError(2))
    params = net.init_params(3)
    x = RNG.normal(size=(50, 4)).astype(np.float32)
    y = RNG.normal(size=(50, 2)).astype(np.float32)
    predicted = net.logits(params, x).astype(np.float64)
    result = net.evaluate(params, x, y, batch_size=16)
    squared = (predicted - y) ** 2
    assert result.score_name == "r2" and result.rows == 50
    assert result.loss == pytest.approx(squared.mean(), rel=1e-5)
    assert result.figures["rmse"] == pytest.approx(np.sqrt(squared.mean()), rel=1e-5)
    r2 = np.mean(1 - squared.sum(axis=0) / ((y - y.mean(axis=0)) ** 2).sum(axis=0))
    assert result.score == pytest.approx(r2, rel=1e-5)


def test_binary_accuracy_and_auc_are_per_output_and_auc_matches_the_exact_one() -> None:
    loss = BinaryCrossEntropy(2)
    rows = 4000
    y = (RNG.random((rows, 2)) > 0.3).astype(np.float32)
    logits = (2.0 * (y - 0.5) + RNG.normal(0, 1.5, (rows, 2))).astype(np.float32)
    tally = loss.tally(logits, y, 0.0)
    figures = loss.figures(tally)
    hits = np.mean((logits > 0) == (y > 0.5))
    assert figures["accuracy"] == pytest.approx(hits)

    def exact_auc(scores: np.ndarray, labels: np.ndarray) -> float:
        pos, neg = scores[labels > 0.5], scores[labels < 0.5]
        return float((pos[:, None] > neg[None, :]).mean())

    exact = np.mean([exact_auc(logits[:, k], y[:, k]) for k in range(2)])
    assert figures["auc"] == pytest.approx(exact, abs=2e-3)  # histogram bins: ties
    # From probabilities (a model of one's own's predict): the same order, the same AUC.
    probabilities = 1 / (1 + np.exp(-logits.astype(np.float64)))
    again = loss.figures(loss.tally(probabilities, y, 0.0, probabilities=True))
    assert again["auc"] == pytest.approx(figures["auc"], abs=1e-3)
    assert again["accuracy"] == pytest.approx(hits)


@pytest.mark.parametrize("loss", [CrossEntropy(3), MeanSquaredError(3),
                                  BinaryCrossEntropy(3)])
def test_tallies_of_pieces_add_up_to_the_whole(loss) -> None:
    output = {"cross_entropy": "softmax", "mse": "linear",
              "binary_cross_entropy": "sigmoid"}[loss.name]
    net = Network((6,), [dense(5, "relu"), dense(3, output)], 3, loss=loss)
    params = net.init_params(2)
    x = RNG.normal(size=(90, 6)).astype(np.float32)
    y = (RNG.integers(0, 3, 90) if loss.name == "cross_entropy"
         else (RNG.random((90, 3)) > 0.5).astype(np.float32))
    whole = net.evaluate(params, x, y, batch_size=1000)
    pieces = net.tally(params, x[:37], y[:37], 8) + net.tally(params, x[37:], y[37:], 16)
    assert loss.evaluation(pieces).figures == pytest.approx(whole.figures, rel=1e-6)


def test_targets_that_do_not_fit_the_loss_are_one_clear_error() -> None:
    with pytest.raises(DataError, match=r"mse needs float targets of shape \(4, 2\)"):
        MeanSquaredError(2).check_targets(np.zeros(4, dtype=np.int64), 4)
    with pytest.raises(DataError, match=r"targets in \[0, 1\]"):
        BinaryCrossEntropy(1).check_targets(np.full(4, 2.0, dtype=np.float32), 4)
    with pytest.raises(DataError, match="cross_entropy trains on class labels"):
        CrossEntropy(3).check_targets(np.zeros((4, 3), dtype=np.float32), 4)
    # Binary cross-entropy on two classes' labels: one output, the label as its target.
    assert BinaryCrossEntropy(1).check_targets(np.array([0, 1, 1]), 3).shape == (3, 1)
    assert loss_for_data("binary_cross_entropy", "classes", 2, 2).width == 1
    with pytest.raises(ConfigError, match="needs two classes"):
        loss_for_data("binary_cross_entropy", "classes", 10, 10)
    with pytest.raises(ConfigError, match="needs integer class labels"):
        loss_for_data("cross_entropy", "values", 0, 3)
    with pytest.raises(ConfigError, match="needs float targets"):
        loss_for_data("mse", "classes", 10, 10)
    with pytest.raises(ConfigError, match="model.loss must be one of"):
        loss_for_data("hinge", "classes", 10, 10)


def test_the_output_layer_must_have_the_losss_activation() -> None:
    with pytest.raises(ConfigError, match="must be 'linear' \\(model.loss = 'mse'\\)"):
        Network((4,), [dense(2, "softmax")], 2, loss=MeanSquaredError(2))
    with pytest.raises(ConfigError, match="must be 'sigmoid'"):
        Network((4,), [dense(2, "linear")], 2, loss=BinaryCrossEntropy(2))
    # A sigmoid output computes logits: the loss applies the sigmoid, once.
    net = Network((4,), [dense(2, "sigmoid")], 2, loss=BinaryCrossEntropy(2))
    params = net.init_params(0)
    params[:] = 3.0
    assert (net.logits(params, np.ones((1, 4), np.float32)) > 1.0).all()


def _config(**sections) -> dict:
    base = {"model": {"layers": [dense(2, "linear")], "loss": "mse"},
            "data": {"path": "x.h5"}, "optimizer": {"algorithm": "sgd"},
            "run": {"max_steps": 5}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return base


@pytest.mark.parametrize("change, message", [
    ({"run": {"target_accuracy": 0.9}},
     "run.target_accuracy, but model.loss = \"mse\" reports loss, r2, rmse"),
    ({"run": {"target_metric": "auc", "target_value": 0.9}},
     "run.target_metric = \"auc\", but model.loss = \"mse\""),
    ({"run": {"target_metric": "r2"}}, "run.target_metric and run.target_value go together"),
    ({"run": {"target_loss": 0.1, "target_metric": "r2", "target_value": 0.9}},
     "run.target_loss and run.target_metric are two targets"),
    ({"cluster": {"partitions": 2}},
     "trains model.loss = \"cross_entropy\" only"),
    ({"model": {"loss": "hinge"}}, "model.loss"),
])
def test_a_target_or_a_split_the_loss_cannot_have_is_refused(change, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_from_dict(_config(**change), Path("c.toml"))


def test_a_loss_target_alone_ends_a_run_and_the_default_loss_keeps_old_hashes() -> None:
    config = config_from_dict(_config(run={"max_steps": 0, "target_loss": 0.01}))
    assert config.run.target_loss == 0.01 and config.model.loss == "mse"
    assert config.to_dict()["model"]["loss"] == "mse"
    plain = config_from_dict(_config(model={"loss": "cross_entropy"}))
    assert "loss" not in plain.to_dict()["model"]  # hashed as before losses existed


class Linear:
    """y = x @ W: a regression model of one's own, without an evaluate."""

    def init_params(self, rng):
        return rng.normal(0, 0.1, 8).astype(np.float32)

    def predict(self, params, x):
        return x @ params.reshape(4, 2)

    def loss_and_grad(self, params, x, y):
        error = self.predict(params, x) - y
        grad = 2 * x.T @ error / error.size
        return float((error ** 2).mean()), grad.astype(np.float32).ravel()


def test_a_model_of_ones_own_is_scored_by_its_runs_loss() -> None:
    model = OwnModel(Linear(), (4,), 2, loss=MeanSquaredError(2),
                     probe_y=np.zeros((2, 2), np.float32))
    params = model.init_params(0)
    x = RNG.normal(size=(40, 4)).astype(np.float32)
    y = RNG.normal(size=(40, 2)).astype(np.float32)
    result = model.evaluate(params, x, y, batch_size=9)
    squared = (Linear().predict(params, x) - y) ** 2
    assert result.score_name == "r2"
    assert result.loss == pytest.approx(squared.mean(), rel=1e-5)
    assert result.figures["rmse"] == pytest.approx(np.sqrt(squared.mean()), rel=1e-5)
