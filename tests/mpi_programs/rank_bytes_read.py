"""The real command line (distbelief.cli.main), then one line with this rank's bytes read
from dataset files (distbelief.data.hdf5.bytes_read), so a test can check who read what.

    mpiexec -n N python tests/mpi_programs/rank_bytes_read.py train CONFIG [--set ...]
"""

import sys

from mpi4py import MPI

from distbelief.cli import main
from distbelief.data.hdf5 import bytes_read

if __name__ == "__main__":
    status = main(sys.argv[1:])
    print(f"rank {MPI.COMM_WORLD.Get_rank()} bytes_read {bytes_read()}", flush=True)
    sys.exit(status)
