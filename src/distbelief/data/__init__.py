"""Training data: the HDF5 dataset format and its reader (hdf5: DatasetWriter, open_dataset,
TrainShard, load_test, load_split), and the converters that write it (converters:
Fashion-MNIST IDX files, synthetic data).
"""
