"""The parameter server: shards that hold slices of the parameters, and how ranks reach them.

parameter_server (the shard and client over MPI one-sided RMA, or shared-memory windows on
one node; open_parameter_server picks the transport), run_control (Downpour's run control
block on shard 0: step claims, reports, commands), vector_shard (one shard's slice of the
Sandblaster L-BFGS vectors).
"""
