"""distbelief: DistBelief (Dean et al., NIPS 2012) on MPI.

Downpour SGD over a sharded parameter server (MPI one-sided RMA), Sandblaster L-BFGS,
model parallelism, Cython kernels and HDF5 checkpoints. See README.md and docs/.

The package's public Python API: `train(config, model=None)` trains (distbelief.training;
a model of your own: distbelief.model.protocol), and `load_model(path)` returns a trained
`Model` with `predict`, `evaluate`, `layers` and `named_parameters` (distbelief.api,
without MPI). Importing distbelief never initialises MPI.
"""

__version__ = "0.1.0"

__all__ = ["Evaluation", "Model", "__version__", "load_model", "train"]

_API = ("Evaluation", "Model", "load_model")


def __getattr__(name: str) -> object:  # PEP 562
    # distbelief.api brings numpy, h5py and the kernels. The command line and every rank's
    # guardian process import this package too, and most of them never need those: load
    # the API on first use (`distbelief.load_model`, `from distbelief import Model`).
    if name in _API:
        from distbelief import api
        return getattr(api, name)
    if name == "train":  # distbelief.training: the API that trains (MPI when launched so)
        from distbelief.training import train
        return train
    raise AttributeError(f"module 'distbelief' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API, "train"])
