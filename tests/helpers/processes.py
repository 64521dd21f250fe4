"""Every process an MPI job started, followed while it runs, so that a test that gives up on
a job ends all of it and says where each rank was.

Why not the launcher's process group or session: hydra's proxies and every rank they fork
call setsid (seen with `-launcher fork` on simulated nodes: each has a session of its own),
so killing mpiexec's group left the ranks of a timed-out job spinning in MPICH's busy-poll,
and every later test on the 2 cores crawled (CI at stop 47: one timeout, then four failures).
An orphan is reparented to init and its ancestry lost, so the tree is sampled while the
launcher lives and remembered.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from distbelief.runtime.launching import stuck_launcher

PROC = Path("/proc")
CLEANER = "from distbelief.runtime.launching.guardian import"
"""In the command line of a guardian's cleaner (`python -c "from ... import ..."`)."""


def _start_time(fields: list[str]) -> str:
    """A process's start time in clock ticks (field 22 of /proc/PID/stat): with the pid,
    an identity that a reused pid cannot take."""
    return fields[19] if len(fields) > 19 else ""


def _command(pid: int) -> str:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


class JobTree:
    """The descendants of a launcher, sampled by `sample()` while the job runs."""

    def __init__(self, launcher: int):
        self.launcher = launcher
        self.seen: dict[int, tuple[str, int]] = {}  # pid: (start time, parent pid)

    def sample(self) -> None:
        """Remember every live descendant of the launcher (or of one already remembered)."""
        stats = {pid: fields for pid, fields in stuck_launcher.process_stats(PROC)
                 if len(fields) > 1}
        family = {self.launcher, *self._running(stats)}
        grew = True
        while grew:
            grew = False
            for pid, fields in stats.items():
                if pid not in family and int(fields[1]) in family and fields[0] != "Z":
                    family.add(pid)
                    self.seen[pid] = (_start_time(fields), int(fields[1]))
                    grew = True

    def alive(self, stats: dict[int, list[str]] | None = None) -> list[int]:
        """The remembered processes that still run (zombies, processes exiting and reused
        pids do not count), but for the guardians' node cleaners, which outlive the job by
        design (they remove its /dev/shm files once no process maps them,
        distbelief.runtime.launching.guardian)."""
        if stats is None:
            stats = dict(stuck_launcher.process_stats(PROC))
        # An empty command line is a process on its way out (its memory already released:
        # CI warned of a cleaner so, "state R" and no command, as it exited).
        return [pid for pid in self._running(stats)
                if (command := _command(pid)) and CLEANER not in command]

    def _running(self, stats: dict[int, list[str]]) -> list[int]:
        """The remembered processes in `stats` that still run, cleaners included (what
        `sample` extends the family from, every poll: no command line read)."""
        return [pid for pid, (start, _) in self.seen.items()
                if pid in stats and stats[pid][0] != "Z" and _start_time(stats[pid]) == start]

    def wait_gone(self, timeout_s: float) -> None:
        """Until none of the job's processes runs, or `timeout_s`: ranks still on their way
        out (an abort's teardown, MPI's own unlinking of its /dev/shm files) end by
        themselves, and a kill then would leave those files behind."""
        deadline = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)

    def describe(self) -> str:
        """One line per live process: pid, parent, state, command."""
        stats = dict(stuck_launcher.process_stats(PROC))
        return "\n".join(f"  pid {pid} (parent {self.seen[pid][1]}) state {stats[pid][0]}: "
                         f"{_command(pid)[:160]}" for pid in self.alive(stats))

    def dump_python_stacks(self, wait_s: float = 2.0) -> int:
        """SIGUSR2 to each live Python process of the job that started no Python process
        (a rank, or a rank's worker under its guardian): helpers/stack_dump (on conftest's
        job_env's PYTHONPATH) makes it print every thread's stack to its stderr, which the
        launcher forwards, and go on (none dies, so the launcher forwards every stack before
        the caller kills the job). Returns how many were signalled."""
        live = self.alive()
        pythons = {pid for pid in live if "python" in _command(pid).split(" ")[0]}
        parents = {self.seen[pid][1] for pid in live}
        leaves = [pid for pid in pythons if pid not in parents]
        for pid in leaves:
            _signal(pid, signal.SIGUSR2)
        if leaves:
            time.sleep(wait_s)
        return len(leaves)

    def kill(self) -> None:
        """SIGKILL every live process of the job, the launcher's group included."""
        _signal_group(self.launcher, signal.SIGKILL)
        for pid in self.alive():
            _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def machine_load(sample_s: float = 0.5, top: int = 8) -> str:
    """The load average and the processes that used the most CPU over `sample_s`: what a
    failed timing-sensitive test ran beside (CI at stop 47: replicas made 1-3 steps in 3 s,
    about a thousandth of their speed, and nothing said why)."""
    def cpu_ticks() -> dict[int, tuple[str, int]]:
        return {pid: (_start_time(fields), int(fields[11]) + int(fields[12]))
                for pid, fields in stuck_launcher.process_stats(PROC) if len(fields) > 19}
    before = cpu_ticks()
    time.sleep(sample_s)
    after = cpu_ticks()
    ticks = os.sysconf("SC_CLK_TCK")
    used = sorted(((t - before[pid][1], pid) for pid, (start, t) in after.items()
                   if pid in before and before[pid][0] == start), reverse=True)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [f"load average {load} on {os.cpu_count()} CPUs; the busiest over {sample_s:g} s:"]
    lines += [f"  {100 * d / ticks / sample_s:5.0f}% pid {pid}: {_command(pid)[:120]}"
              for d, pid in used[:top] if d > 0]
    return "\n".join(lines)
