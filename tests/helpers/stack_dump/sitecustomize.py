"""Loaded by every Python process the tests start (conftest's job_env puts this folder on
PYTHONPATH): SIGUSR2 prints every thread's stack to stderr and the process goes on.

A timed-out MPI job's ranks are asked for their stacks this way (helpers.processes
JobTree.dump_python_stacks), not by SIGABRT: a rank that died of SIGABRT made hydra tear
the job down while the other ranks' stacks were still unread in its proxies' pipes, and a
stack was lost (CI, test_launcher's timed-out job: 2 of 3 stacks)."""

import faulthandler
import signal

faulthandler.register(signal.SIGUSR2, all_threads=True)
