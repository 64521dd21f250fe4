"""What the MPI launcher does to the other ranks when one is killed with kill -9, and with
a signal sent to the launcher itself (docs/checkpoints-and-reliability.md, the launcher
table). Uses the `mpiexec` on PATH:

    python benchmarks/probe_signals.py kill9              # kill -9 of rank 3 of 4
    python benchmarks/probe_signals.py TERM               # SIGTERM to mpiexec (also INT, USR1)
    python benchmarks/probe_signals.py kill9 -- --enable-recovery    # launcher options

Each rank logs every catchable signal it gets, with the time since it started, to a file
(the launcher may be gone before it could forward output), and lives 8 s. Printed: those
logs, which ranks lived to the end, and the launcher's exit status and time. For Open MPI,
--oversubscribe and the run-as-root variables are added.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LIFE = 8.0
RANK = """
import os, signal, sys, time
from mpi4py import MPI
rank, folder, life = MPI.COMM_WORLD.Get_rank(), sys.argv[1], float(sys.argv[2])
t0 = time.monotonic()
def note(text):
    with open(f"{folder}/rank{rank}", "a") as f:
        f.write(f"{time.monotonic() - t0:5.2f} s {text}\\n")
for number in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT, signal.SIGHUP,
               signal.SIGCONT):
    signal.signal(number, lambda s, f: note(signal.Signals(s).name))
note(f"started, pid {os.getpid()}")
while time.monotonic() - t0 < life:
    time.sleep(0.01)
note("lived to the end")
"""


def main() -> None:
    what, options = sys.argv[1] if len(sys.argv) > 1 else "kill9", sys.argv[3:]
    version = subprocess.run(["mpiexec", "--version"], capture_output=True, text=True,
                             check=False).stdout
    env = dict(os.environ)
    if "Open MPI" in version:
        options = ["--oversubscribe", *options]
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    with tempfile.TemporaryDirectory() as folder:
        program = Path(folder) / "rank.py"
        program.write_text(RANK)
        launcher = subprocess.Popen(["mpiexec", *options, "-n", "4", sys.executable,
                                     str(program), folder, str(LIFE)], env=env, start_new_session=True,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        logs = [Path(folder) / f"rank{r}" for r in range(4)]
        while not all(log.exists() for log in logs):
            time.sleep(0.05)
        time.sleep(1.0)
        sent = time.monotonic()
        if what == "kill9":
            os.kill(int(logs[3].read_text().split()[-1]), signal.SIGKILL)
        else:
            launcher.send_signal(getattr(signal, f"SIG{what}"))
        status = launcher.wait(timeout=60)
        ended = time.monotonic() - sent
        time.sleep(LIFE)  # any rank left behind logs its end
        print(version.splitlines()[0], "| mpiexec", *options, "| sent:", what)
        for rank, log in enumerate(logs):
            print(f"rank {rank}:", "; ".join(log.read_text().splitlines()))
        print(f"launcher exit status {status}, {ended:.2f} s after the kill or signal")


if __name__ == "__main__":
    main()
