"""Models of the user's own for tests/test_own_model.py, as `--model own_models:NAME`
finds them (the job runs in this folder): the example's logistic regression, and models
that break the protocol in one way each."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from logistic import Logistic

from distbelief.runtime.launching.launcher import launcher_rank

FEATURES, CLASSES = 24, 4  # the tests' synthetic data


def logistic() -> Logistic:
    return Logistic(FEATURES, CLASSES)


class ShortGradient(Logistic):
    name = "short-gradient"

    def loss_and_grad(self, params, x, y):
        loss, grad = super().loss_and_grad(params, x, y)
        return loss, grad[:-1]


class RaisesOnRank2(Logistic):
    """Fails at its 20th step on launcher rank 2 only: a replica's bug mid-run."""

    name = "raises-on-rank-2"
    calls = 0

    def loss_and_grad(self, params, x, y):
        self.calls += 1
        if launcher_rank() == "2" and self.calls == 20:
            raise RuntimeError("boom at step 20")
        return super().loss_and_grad(params, x, y)


def short_gradient() -> ShortGradient:
    return ShortGradient(FEATURES, CLASSES)


def raises_on_rank_2() -> RaisesOnRank2:
    return RaisesOnRank2(FEATURES, CLASSES)


def float64_gradient():
    model = Logistic(FEATURES, CLASSES)
    plain = model.loss_and_grad
    model.loss_and_grad = lambda params, x, y: (plain(params, x, y)[0],
                                                plain(params, x, y)[1].astype(np.float64))
    return model
