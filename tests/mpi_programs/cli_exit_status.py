"""The real command line (distbelief.cli.main), then one line with this rank's exit status,
so a test can check that every rank exits with the same status (mpiexec reports only one).

    mpiexec -n N python tests/mpi_programs/cli_exit_status.py train CONFIG [--set ...]
"""

import os
import sys
from pathlib import Path

from distbelief.cli import main
from distbelief.runtime.launching.launcher import launcher_rank

EXIT_DIR = "DISTBELIEF_TEST_EXIT_DIR"  # conftest.run_mpi sets it: the status in a file too

if __name__ == "__main__":
    status = main(sys.argv[1:])
    rank = launcher_rank()
    if os.environ.get(EXIT_DIR) and rank is not None:
        path = Path(os.environ[EXIT_DIR], f"rank-{rank}")
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(str(status))
        os.replace(tmp, path)
    print(f"rank {rank} exit {status}", flush=True)
    sys.exit(status)
