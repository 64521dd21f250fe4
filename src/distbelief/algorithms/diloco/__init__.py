"""DiLoCo (`optimizer.algorithm = "diloco"`): Douillard et al. (2023), arXiv 2311.08105.
Each replica trains `inner_steps` local steps, then an outer optimizer applies the
replicas' deltas. Two forms, chosen by `optimizer.asynchronous` (the registry's line
picks the trainer):

    false  synchronous.py: every rank a replica (cluster.ps_shards = 0), the deltas
           averaged each round; built on averaging's collective (averaging.collective,
           its `Variant` with an outer step). A lost replica stops the run.
    true   asynchronous.py: each delta applied as it lands by the outer optimizer on the
           parameter-server shards (Async Local-SGD); built on Downpour's machinery (a
           replica role, the shards' update rule). A lost replica does not stop the others.

options.py holds the [optimizer] keys DiLoCo owns. Both forms build on another
algorithm's public machinery, one way (tests/test_layers.py, BUILDS_ON): neither
averaging nor Downpour knows DiLoCo. This `__init__` imports nothing, so that config can
read options.py without MPI.
"""
