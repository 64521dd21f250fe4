"""distbelief: DistBelief (Dean et al., NIPS 2012) on MPI.

Downpour SGD over a sharded parameter server (MPI one-sided RMA), Sandblaster L-BFGS,
model parallelism, Cython kernels and HDF5 checkpoints. See README.md and docs/.

The package's public Python API (distbelief.api) is a trained model without MPI:
`load_model(path)` returns a `Model` with `predict`, `evaluate`, `layers` and
`named_parameters`. Importing distbelief never initialises MPI.
"""

__version__ = "0.1.0"

from distbelief.api import Evaluation, Model, load_model

__all__ = ["Evaluation", "Model", "__version__", "load_model"]
