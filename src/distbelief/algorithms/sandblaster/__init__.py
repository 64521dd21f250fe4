"""Sandblaster L-BFGS: roles (the shards', coordinator's and replicas' loops, and train),
lbfgs (L-BFGS on scalars: the coordinator's side), work_units (dynamic load balancing with
backup copies).
"""
