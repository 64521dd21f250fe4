"""distbelief: DistBelief (Dean et al., NIPS 2012) on MPI.

Downpour SGD over a sharded parameter server (MPI one-sided RMA), Sandblaster L-BFGS,
model parallelism, Cython kernels and HDF5 checkpoints. See README.md and docs/.
"""

__version__ = "0.1.0"
