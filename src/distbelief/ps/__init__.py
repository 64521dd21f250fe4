"""The parameter server: shards that hold slices of the parameters, and how ranks reach them.

endpoint (the public interface, whatever the transport: ParameterServerShard,
ParameterClient, ServerSpec, and the pieces both transports compose), transport (OPENERS,
the name-to-opener table, and open_parameter_server, which picks one for the job),
stats (what a shard did; staleness), and two sibling transports: shared_memory (a job on
one node: clients update the shard's segment directly) and RMA between nodes: rma (its
opener), rma_windows (the windows, the calls allowed on each location, the registered
read of published parameters; why each is legal: docs/rma-protocol.md), rma_shard (the
fold and publish), rma_client (push, pull, catch_up). run_control (Downpour's run control
block on shard 0: step claims, reports, commands; it stays here because the transports
carry it in shard 0's windows). Sandblaster's vectors live with it:
distbelief.algorithms.sandblaster.vector_shard.
"""
