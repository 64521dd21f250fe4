"""Training data: the HDF5 dataset format and its reader (hdf5: DatasetWriter, open_dataset,
TrainShard, load_test, load_split), and the converters that write it (converters:
Fashion-MNIST IDX files, synthetic data; arrays: your own numpy or HDF5 arrays).

`write_dataset(path, x, y, x_test, y_test, ...)` is the one call that turns arrays into a
dataset file (docs/your-own-data.md).
"""

from distbelief.data.arrays import write_dataset

__all__ = ["write_dataset"]
