"""The parameter server: shards that hold slices of the parameters, and how ranks reach them.

parameter_server (the shard and client interface, their RMA implementation between nodes,
and the correctness argument for both transports), shared_memory (the transport for a job
on one node: clients update the shard's segment directly), transport (which transport a job
uses: open_parameter_server), run_control (Downpour's run control block on shard 0: step
claims, reports, commands), vector_shard (one shard's slice of the Sandblaster L-BFGS
vectors).
"""
