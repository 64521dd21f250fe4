"""The real command line (distbelief.cli.main), then one line with this rank's exit status,
so a test can check that every rank exits with the same status (mpiexec reports only one).

    mpiexec -n N python tests/mpi_programs/cli_exit_status.py train CONFIG [--set ...]
"""

import sys

from distbelief.cli import main
from distbelief.runtime.launcher import launcher_rank

if __name__ == "__main__":
    status = main(sys.argv[1:])
    print(f"rank {launcher_rank()} exit {status}", flush=True)
    sys.exit(status)
