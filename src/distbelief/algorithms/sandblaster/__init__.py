"""Sandblaster L-BFGS: roles (train, start, finish; the design in its docstring), plan
(validation, tags, pieces, batch rows), shards, replica, coordinator (the roles' loops),
lbfgs (L-BFGS on scalars: the coordinator's side), work_units (dynamic load balancing with
backup copies), vector_shard (one shard's slice of the L-BFGS vectors and history).
"""
