"""Softmax (multinomial logistic) regression written in numpy: a model of your own for
distbelief (docs/your-own-model.md). Train it with

    distbelief train examples/logistic.toml --model logistic:model      (from examples/)
    mpiexec -n 3 python -m distbelief train logistic.toml --model logistic:model

or from Python with distbelief.train("logistic.toml", model=logistic.model()).
"""

import numpy as np

INPUTS, CLASSES = 784, 10  # Fashion-MNIST: 28x28 pixels, 10 classes


class Logistic:
    name, version = "logistic", "1"

    def __init__(self, inputs: int = INPUTS, classes: int = CLASSES):
        self.inputs, self.classes = inputs, classes

    def named_slices(self):
        return [("weights", (self.inputs, self.classes)), ("bias", (self.classes,))]

    def init_params(self, rng):
        weights = rng.normal(0, 0.01, (self.inputs, self.classes))
        return np.concatenate([weights.ravel(), np.zeros(self.classes)]).astype(np.float32)

    def _split(self, params):
        cut = self.inputs * self.classes
        return params[:cut].reshape(self.inputs, self.classes), params[cut:]

    def predict(self, params, x):
        weights, bias = self._split(params)
        logits = x.reshape(len(x), -1) @ weights + bias
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        return p / p.sum(axis=1, keepdims=True)

    def loss_and_grad(self, params, x, y):
        x = x.reshape(len(x), -1)
        p = self.predict(params, x)
        loss = -np.log(p[np.arange(len(y)), y] + 1e-12).mean()
        p[np.arange(len(y)), y] -= 1  # d loss / d logits, times the batch size
        p /= len(y)
        grad = np.concatenate([(x.T @ p).ravel(), p.sum(axis=0)])
        return float(loss), grad.astype(np.float32)


def model() -> Logistic:
    """The factory `--model logistic:model` calls."""
    return Logistic()
