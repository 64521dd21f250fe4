"""A guardian, as the project's (src/distbelief/runtime/launching/guardian.py): hydra
SIGKILLs every rank once a process it started died of a signal, even under
-disable-auto-cleanup, so the process hydra starts runs no MPI; it starts the worker (same
environment, PMI fd inherited), relays SIGUSR1/SIGTERM, and exits 128+N when the worker
dies of signal N. usage: python guard.py PROGRAM ARGS..."""
import os
import signal
import subprocess
import sys

child = subprocess.Popen([sys.executable, *sys.argv[1:]], close_fds=False)
for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
    signal.signal(s, lambda n, _f: child.send_signal(n))
status = child.wait()
sys.stdout.flush()
# os._exit: Python's finalization restores SIGUSR1's default action (death), and hydra
# (-disable-auto-cleanup) SIGUSR1s every rank as the first one ends
os._exit(128 - status if status < 0 else status)
