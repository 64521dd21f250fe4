"""The built-in model of a [model] layer list on data with a given kind of features: one
place that chooses between model.network's dense Network and model.sparse_network's
SparseNetwork, for training, checkpoints, exports and the memory plan alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from distbelief.errors import ConfigError
from distbelief.model.losses import Loss
from distbelief.model.network import Network
from distbelief.model.sparse_network import SparseNetwork, is_sparse

FEATURE_TEXT = {"sparse": "sparse features (CSR rows)", "ids": "id fields"}


def build_model(input_shape: Sequence[int], layers: Sequence[dict], loss: Loss, seed: int = 0,
                features: str = "dense", id_rows: Sequence[int] = ()) -> Any:
    """A Network, or a SparseNetwork when the first layer reads ids (sparse_linear,
    embedding); a ConfigError when the layers do not fit the data's `features` ("dense",
    "sparse" or "ids", data.hdf5.DatasetInfo's)."""
    layers = [dict(layer) for layer in layers]
    if is_sparse(layers):
        return SparseNetwork(features, tuple(input_shape), layers, loss.width, seed=seed,
                             loss=loss, id_rows=tuple(id_rows))
    if features != "dense":
        raise ConfigError(f"the data has {FEATURE_TEXT[features]}: the first layer must be "
                          f"sparse_linear or embedding (docs/sparse-models.md)")
    return Network(tuple(input_shape), layers, loss.width, seed=seed, loss=loss)
