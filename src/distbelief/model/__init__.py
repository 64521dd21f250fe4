"""The model: what one replica computes, with no MPI except in partitioned_network (and
calibrate's timing of a transport round).

layout (the flat float32 parameter vector and its balanced ranges), kernels (validated entry
points to the compiled Cython kernels, _kernels, built from pyx/), layers and network (loss,
gradient, logits), optimizers (the local Adagrad and SGD updates a shard or a process runs),
partition and partitioned_network (one replica split over P ranks: model parallelism), and
cost_model (the predicted step time of such a split, and of S shards x R replicas x P
partitions), memory_model (each rank's predicted memory) and calibrate (costmodel
--measure).
"""
