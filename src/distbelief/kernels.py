"""Validated Python entry points to the compiled kernels in pyx/_kernels.pyx.

CONTRACT (fixed; other modules code against it). All arrays float32 and C-contiguous unless
said otherwise; outputs are caller-allocated and written in place; nothing is returned
except where stated. Every function validates dtype, shape and contiguity and raises
ValueError/TypeError in plain words; the compiled kernel then runs without the GIL.

STUB: bodies are filled in by the kernels work.
"""

from __future__ import annotations

import numpy as np

ACTIVATIONS = ("linear", "relu", "sigmoid", "tanh")


def adagrad_update(params: np.ndarray, accum: np.ndarray, grad: np.ndarray,
                   lr: float, eps: float = 1e-10) -> None:
    """One fused pass: accum += grad**2; params -= lr * grad / (sqrt(accum) + eps).

    1-D arrays of equal length. Same rule and eps as torch.optim.Adagrad (no initial
    accumulator value, no decay).
    """
    raise NotImplementedError


def sgd_update(params: np.ndarray, grad: np.ndarray, lr: float) -> None:
    """params -= lr * grad (1-D, equal length), one pass."""
    raise NotImplementedError


def bias_activation(z: np.ndarray, bias: np.ndarray, activation: str) -> None:
    """z[n, u] = act(z[n, u] + bias[u]) in place. z is (N, U), bias is (U,).

    activation is one of ACTIVATIONS.
    """
    raise NotImplementedError


def activation_backward(out: np.ndarray, dout: np.ndarray, activation: str,
                        dz: np.ndarray, dbias: np.ndarray | None = None) -> None:
    """dz = dout * act'(z), written in terms of the activation's output `out`.

    out, dout, dz are (N, U); dz may be the same array as dout. If dbias (U,) is given it is
    overwritten with dz summed over the batch (the bias gradient), in the same pass.
    """
    raise NotImplementedError


def softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray, grad: np.ndarray) -> float:
    """Mean cross-entropy of softmax(logits) against integer labels; returns the loss.

    logits (N, C) float32; labels (N,) any integer dtype (cast to int32 if needed), each in
    [0, C); grad (N, C) is overwritten with d(mean loss)/d(logits) = (softmax - onehot) / N.
    grad may be the same array as logits. Numerically stable (max subtracted).
    """
    raise NotImplementedError


def local_forward(x: np.ndarray, weights: np.ndarray, out: np.ndarray,
                  kernel: int, stride: int) -> None:
    """Locally connected 2-D layer, no bias: out[n,i,j,:] = patch(n,i,j) @ weights[i,j].

    x (N, H, W, Cin); weights (Ho, Wo, kernel*kernel*Cin, Cout), untied per output
    position; out (N, Ho, Wo, Cout), overwritten. Valid padding: Ho = (H - kernel)//stride
    + 1, likewise Wo. patch(n,i,j) is x[n, i*stride : i*stride+kernel,
    j*stride : j*stride+kernel, :] flattened in (row, col, channel) order.
    """
    raise NotImplementedError


def local_backward(x: np.ndarray, weights: np.ndarray, dout: np.ndarray,
                   dweights: np.ndarray, dx: np.ndarray | None,
                   kernel: int, stride: int) -> None:
    """Gradients of local_forward. dout (N, Ho, Wo, Cout).

    dweights (same shape as weights) is overwritten with sum_n patch^T dout.
    dx (same shape as x) is overwritten with the input gradient; pass None to skip it
    (first layer). The bias gradient comes from activation_backward's dbias.
    """
    raise NotImplementedError
