"""Small sparse inputs and one model of each sparse kind, for the sparse models' tests
(test_sparse_models.py, test_sparse_rows.py)."""

from __future__ import annotations

import numpy as np

from distbelief.data.sparse import SparseRows

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
