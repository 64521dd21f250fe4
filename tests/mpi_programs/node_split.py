"""Print, from rank 0, distbelief's node split of COMM_WORLD and the parameter-server
transport open_parameter_server picks on it, as one JSON line.

    mpiexec [-launcher fork -hosts h1,h2] -n N python tests/mpi_programs/node_split.py
"""

import json

import numpy as np
from mpi4py import MPI

from distbelief.model.optimizers import make_optimizer
from distbelief.ps.endpoint import ServerSpec
from distbelief.ps.transport import open_parameter_server
from distbelief.runtime.communicators.topology import Topology
from distbelief.runtime.health.liveness import Peers

if __name__ == "__main__":
    world = MPI.COMM_WORLD
    peers = Peers.gather(world)
    topology = Topology(world.Get_size(), world.Get_rank(), ps_shards=1)
    endpoint = open_parameter_server(world, ServerSpec(topology, 64,
                                                      lambda n: make_optimizer(True, 0.1, n),
                                                      np.zeros(64, dtype=np.float32)))
    transport = world.bcast(getattr(getattr(endpoint, "stats", None), "transport", None))
    if world.Get_rank() == 0:
        on_my_node = [r for r in range(world.Get_size()) if peers.on_this_node(r)]
        print(json.dumps({"node_of": list(peers.nodes.node_of), "simulated":
                          peers.nodes.simulated, "on_rank_0s_node": on_my_node,
                          "transport": transport}), flush=True)
    endpoint.free()
