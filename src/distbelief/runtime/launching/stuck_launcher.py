"""A launcher that has stopped collecting its ranks: found, and ended.

Open MPI's `prterun` once stayed for ever after a lost shard had ended the job, one of its
exited children never collected, so a batch job would have waited out its time limit
(docs/checkpoints-and-reliability.md, "A launcher that never returns"). A launcher whose
children have all exited but which has collected none of them for `grace_s` (GRACE_ENV,
else 30 s) is in that state: a live launcher collects an exited child at once (SIGCHLD).
`watch` ends such a launcher with SIGKILL, after one line. slurm/one_node.sbatch runs it
beside mpiexec:

    python3 -m distbelief.runtime.launching.stuck_launcher PID [GRACE_S]

`distbelief compare` watches each run's launcher the same way, and the tests' run_mpi asks
`all_children_exited` between its reads of the job's output.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

GRACE_S = 30.0  # a launcher that collects nothing for this long is stuck
GRACE_ENV = "DISTBELIEF_STUCK_LAUNCHER_SECONDS"
POLL_S = 1.0


def grace_s() -> float:
    """The grace: GRACE_ENV if set (a positive number), else GRACE_S."""
    text = os.environ.get(GRACE_ENV)
    if text is None:
        return GRACE_S
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if value > 0:
        return value
    _to_stderr(f"distbelief: {GRACE_ENV}={text!r} is not a positive number of seconds; "
               f"using {GRACE_S:g}")
    return GRACE_S


def process_stats(proc: Path = Path("/proc")) -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/PID/stat after the command name: state, ppid, pgrp,
    session, ...) for every process that could be read."""
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        yield int(entry.name), fields


def children(pid: int, proc: Path = Path("/proc")) -> dict[int, str]:
    """{child's pid: its state letter (Z for exited, uncollected)} for process `pid`'s
    children that could be read."""
    return {child: fields[0] for child, fields in process_stats(proc)
            if len(fields) > 1 and fields[1] == str(pid)}


def all_children_exited(pid: int, proc: Path = Path("/proc")) -> bool:
    """True if process `pid` has children and every one has exited uncollected (a zombie);
    False otherwise, or when this cannot be read."""
    states = children(pid, proc).values()
    return bool(states) and all(state == "Z" for state in states)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def watch(pid: int, grace: float = GRACE_S,
          report: Callable[[str], None] = _to_stderr) -> bool:
    """Until process `pid` ends: if all its children have exited and stayed uncollected for
    `grace` seconds, `report` one line and kill it. True if it was killed."""
    since = None
    while _alive(pid):
        now = time.monotonic()
        if all_children_exited(pid):
            since = now if since is None else since
            if now - since >= grace:
                report(f"distbelief: the launcher (pid {pid}) has not collected its ranks for "
                       f"{grace:g} s after they all ended: it is stuck (seen with Open MPI "
                       f"5.0.11's prterun); ending it")
                os.kill(pid, signal.SIGKILL)
                return True
        else:
            since = None
        time.sleep(POLL_S)
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or not argv[0].isdigit():
        print("usage: python3 -m distbelief.runtime.launching.stuck_launcher PID [GRACE_S]\n"
              "Ends process PID (an mpiexec) if it stops collecting its exited children for "
              f"GRACE_S seconds (default: {GRACE_ENV}, else {GRACE_S:g}).", file=sys.stderr)
        return 2
    grace = float(argv[1]) if len(argv) == 2 else grace_s()
    watch(int(argv[0]), grace)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
