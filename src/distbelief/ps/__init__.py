"""The parameter server: shards that hold slices of the parameters, and how ranks reach them.

endpoint (what both transports share: the optimizer interface, the endpoint base, the
transport names), stats (what a shard did; staleness), the RMA transport between nodes:
rma_windows (the windows, the calls allowed on each location, the registered read of
published parameters; why each is legal: docs/rma-protocol.md), rma_shard (the fold and
publish), rma_client (push, pull, catch_up); shared_memory (the transport for a job on one node: clients update the shard's
segment directly), transport (which transport a job uses: open_parameter_server),
run_control (Downpour's run control block on shard 0: step claims, reports, commands;
it stays here because the transports carry it in shard 0's windows). Sandblaster's
vectors live with it: distbelief.algorithms.sandblaster.vector_shard.
"""
