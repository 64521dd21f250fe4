"""Optimizers that update a flat float32 parameter vector in place: Adagrad and plain SGD.

They work on any 1-D float32 array, so a parameter-server shard runs one on its own range
of the parameter vector, and a single process runs one on the whole vector. The update
itself is one fused pass in the compiled kernels (distbelief.model.kernels). Each optimizer's
state is a dict of named float32 arrays, which checkpoints save and load back.
"""

from __future__ import annotations

import math

import numpy as np

from distbelief.model import kernels


def _check_learning_rate(learning_rate: object) -> float:
    if isinstance(learning_rate, bool) or not isinstance(
            learning_rate, (int, float, np.integer, np.floating)):
        raise TypeError(f"learning_rate must be a number, got {type(learning_rate).__name__}")
    if not math.isfinite(learning_rate) or learning_rate <= 0:
        raise ValueError(f"learning_rate must be a positive finite number, got {learning_rate}")
    return float(learning_rate)


def _check_size(size: object) -> int:
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        raise TypeError(f"size must be an integer, got {type(size).__name__}")
    if size < 0:
        raise ValueError(f"size must be non-negative, got {size}")
    return int(size)


def _check_state_keys(name: str, state: object, expected: set[str]) -> None:
    if not isinstance(state, dict):
        raise TypeError(f"{name} state must be a dict of arrays, got {type(state).__name__}")
    if set(state) != expected:
        raise ValueError(f"{name} state must have keys {sorted(expected)}, "
                         f"got {sorted(map(str, state))}")


class Adagrad:
    """Adagrad as in the DistBelief paper and torch.optim.Adagrad with default arguments.

    Per parameter: accum += g**2; param -= learning_rate * g / (sqrt(accum) + eps).
    accum starts at zero; no learning-rate decay, no weight decay.
    """

    def __init__(self, size: int, learning_rate: float, eps: float = 1e-10) -> None:
        self.size = _check_size(size)
        self.learning_rate = _check_learning_rate(learning_rate)
        if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)):
            raise TypeError(f"eps must be a number, got {type(eps).__name__}")
        if not math.isfinite(eps) or eps < 0:
            raise ValueError(f"eps must be a non-negative finite number, got {eps}")
        self.eps = float(eps)
        self.accum = np.zeros(self.size, np.float32)

    def step(self, params: np.ndarray, grad: np.ndarray,
             copy: np.ndarray | None = None) -> None:
        """Update params (1-D float32, length size) in place with grad, one fused pass;
        with `copy`, also store the new params there in the same pass."""
        kernels.adagrad_update(params, self.accum, grad, self.learning_rate, self.eps, copy)

    def state(self) -> dict[str, np.ndarray]:
        """The live state arrays (not copies): {"accum": sum of squared gradients}."""
        return {"accum": self.accum}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore state saved by state(); checks shape and values, copies into accum."""
        _check_state_keys("Adagrad", state, {"accum"})
        accum = state["accum"]
        if not isinstance(accum, np.ndarray) or not np.issubdtype(accum.dtype, np.floating):
            raise TypeError("Adagrad state 'accum' must be a floating-point numpy array")
        if accum.shape != (self.size,):
            raise ValueError(f"Adagrad state 'accum' must have shape ({self.size},), "
                             f"got {accum.shape}")
        # A sum of squares is finite and non-negative; anything else is a corrupt file.
        if not np.all(np.isfinite(accum)) or np.any(accum < 0):
            raise ValueError("Adagrad state 'accum' must be finite and non-negative")
        np.copyto(self.accum, accum, casting="same_kind")


class SGD:
    """Plain SGD at a fixed learning rate: param -= learning_rate * g. It has no state."""

    def __init__(self, learning_rate: float) -> None:
        self.learning_rate = _check_learning_rate(learning_rate)

    def step(self, params: np.ndarray, grad: np.ndarray,
             copy: np.ndarray | None = None) -> None:
        """Update params (1-D float32) in place with grad of the same length; with `copy`,
        also store the new params there in the same pass."""
        kernels.sgd_update(params, grad, self.learning_rate, copy)

    def state(self) -> dict[str, np.ndarray]:
        """SGD keeps no state: an empty dict."""
        return {}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Accepts only the empty state that state() returns."""
        _check_state_keys("SGD", state, set())


def make_optimizer(adagrad: bool, learning_rate: float, size: int) -> Adagrad | SGD:
    """Adagrad over `size` parameters if adagrad, else SGD (which needs no size)."""
    if not isinstance(adagrad, (bool, np.bool_)):
        raise TypeError(f"adagrad must be True or False, got {type(adagrad).__name__}")
    if adagrad:
        return Adagrad(size, learning_rate)
    _check_size(size)
    return SGD(learning_rate)
