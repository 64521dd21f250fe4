"""Small sparse inputs and one model of each sparse kind, for the sparse models' tests
(test_sparse_models.py, test_sparse_rows.py)."""

from __future__ import annotations

import numpy as np

from distbelief.data.sparse import SparseRows
from distbelief.model.losses import make_loss
from distbelief.model.sparse_network import SparseNetwork

SOFTMAX_3 = {"type": "dense", "units": 3, "activation": "softmax"}


def sparse_rows(rng: np.random.Generator, n: int, features: int, nnz: int = 5) -> SparseRows:
    x = np.zeros((n, features), np.float32)
    for i in range(n):
        if i != 2:  # row 2 stays empty: a row with no features is an example too
            x[i, rng.choice(features, nnz, replace=False)] = rng.normal(size=nnz)
    return SparseRows.from_dense(x)


MODELS = {
    "sparse_linear logistic": ("sparse", [{"type": "sparse_linear", "units": 1,
                                           "activation": "sigmoid"}], "binary_cross_entropy"),
    "sparse_linear and a tower": ("sparse", [{"type": "sparse_linear", "units": 4,
                                              "activation": "tanh"}, SOFTMAX_3], None),
    "bag mean": ("sparse", [{"type": "embedding", "dim": 4, "combine": "mean"}, SOFTMAX_3],
                 None),
    "fields concat": ("ids", [{"type": "embedding", "dim": 3},
                              {"type": "dense", "units": 5, "activation": "relu"}, SOFTMAX_3],
                      None),
    "fields sum": ("ids", [{"type": "embedding", "dim": 3, "combine": "sum"}, SOFTMAX_3], None),
    "fields mean": ("ids", [{"type": "embedding", "dim": 3, "combine": "mean"}, SOFTMAX_3],
                    None),
    "fields hashed": ("ids", [{"type": "embedding", "dim": 2, "rows": 4}, SOFTMAX_3], None),
    "matrix factorisation": ("ids", [{"type": "embedding", "dim": 4, "combine": "dot"}],
                             "mse"),
}


def model_and_batches(name: str, rng: np.random.Generator, batches: int = 1,
                      scale: int = 1) -> tuple[SparseNetwork, list[tuple]]:
    """MODELS[name] as a SparseNetwork and `batches` random batches of 16 for it: CSR rows
    of 30 * scale features, or id fields of (7, 5, 9) * scale rows, with targets its loss
    takes (each batch's x drawn, then its y)."""
    kind, layers, loss_name = MODELS[name]
    fields = 2 if loss_name == "mse" else 3
    id_rows = tuple(rows * scale for rows in (7, 5, 9)[:fields])
    out = []
    for _ in range(batches):
        if kind == "sparse":
            x, shape = sparse_rows(rng, 16, 30 * scale), (30 * scale,)
        else:
            x = np.stack([rng.integers(0, rows, 16) for rows in id_rows], 1)
            shape = (fields,)
        if loss_name == "mse":
            y, loss = rng.normal(size=16).astype(np.float32), make_loss("mse", 1)
        elif loss_name:
            y, loss = rng.integers(0, 2, 16).astype(np.float32), make_loss(loss_name, 1)
        else:
            y, loss = rng.integers(0, 3, 16).astype(np.int32), make_loss("cross_entropy", 3)
        out.append((x, y))
    net = SparseNetwork(kind, shape, layers, loss.width, loss=loss, id_rows=id_rows)
    return net, out
