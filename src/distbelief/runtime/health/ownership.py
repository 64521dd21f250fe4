"""One live run per run directory: who owns run.out_dir, found without MPI or file locks.

A run claims run.out_dir (`claim`) before it writes anything there and keeps the claim
until its last write. A second run on the same folder (a job submitted twice, a job array
sharing a config, a second terminal, `train --fresh`) is refused with one line naming the
owner; an owner taken for dead (`is_dead`) is taken over (`_take_over`), and a live owner
whose file was replaced stops at once (`Ownership`). The rules, and what they assume of
the file system and the cluster: docs/checkpoints-and-reliability.md, "Reliability: what
is guarded and what is not".

ASSUMED: out_dir's file system gives atomic link/rename and close-to-open consistency
(NFS, Lustre, GPFS do); host names are unique across the nodes that mount it; clocks
agree to within a small part of run.owner_timeout_seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distbelief.errors import UserError

OWNER_FILE = "owner.json"
DEFAULT_TIMEOUT_S = 120.0
HEARTBEAT_S = 10.0
"""How often the owner refreshes its heartbeat: every 10 s, or every tenth of
run.owner_timeout_seconds when that is shorter (as in tests)."""
LOST_EXIT_STATUS = 3
PF_EXITING = 0x4
"""Kernel task flag set as a process starts to exit: its files close before it turns into
a zombie, so a launcher reacting to that can act while it is still being torn down."""


class RunDirBusy(UserError):
    """run.out_dir belongs to another live run."""


def process_start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22), or None
    if it is gone, exiting or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The 2nd field, (comm), may hold spaces and parentheses: split after the last ')'.
    fields = stat.rsplit(b")", 1)[1].split()
    if fields[0] in (b"Z", b"X") or int(fields[6]) & PF_EXITING:  # zombie, dead, exiting
        return None
    return int(fields[19])


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def this_process() -> dict[str, Any]:
    """The owner record this process would write (heartbeat and token included)."""
    now = time.time()
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start_ticks": process_start_time(pid),
            "boot_id": _boot_id(), "slurm_job_id": os.environ.get("SLURM_JOB_ID") or None,
            "restart_count": _int(os.environ.get("SLURM_RESTART_COUNT")),
            "started_at": now, "heartbeat": now, "token": secrets.token_hex(8)}


def _int(text: str | None) -> int:
    try:
        return int(text or 0)
    except ValueError:
        return 0


def read_owner(out_dir: str | Path) -> dict[str, Any] | None:
    """The owner record in out_dir, {} if the file exists but cannot be read as one, None
    if there is no owner file."""
    path = Path(out_dir) / OWNER_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return record if isinstance(record, dict) and "token" in record else {}


def is_dead(owner: dict[str, Any], me: dict[str, Any], timeout_s: float,
            path: Path | None = None, now: float | None = None) -> str | None:
    """Why `owner` is taken for dead as seen from `me`, or None while it may be alive.
    Local. The rules, and why each is safe:
    - Same host (host name and boot id equal): the owner is dead when its process is gone,
      a zombie, exiting, or its id now belongs to a process with another start time.
      Exact: /proc is the kernel's own answer, and the start time defeats pid reuse.
      `kill -9` or an OOM kill is therefore found at once.
    - Same host name, another boot id: the machine rebooted since, so the process is gone.
    - Same SLURM job id and a higher SLURM_RESTART_COUNT: a requeue of the same job. SLURM
      starts a requeued instance only after it ended the earlier one (it kills the job's
      processes on every node, and a node that comes back kills the jobs it no longer
      runs), so the earlier instance is its own past and can be taken over at once.
    - Otherwise (another host): the owner refreshes its heartbeat every HEARTBEAT_S;
      silent for longer than run.owner_timeout_seconds (default 120) it is taken for dead.
      Safe while the hosts' clocks agree to well within that bound (NTP on clusters does,
      to milliseconds) and no live owner stalls for that long (the heartbeat is a thread of
      its own, independent of training). 0 turns the rule off: a silent owner on another
      host is then never taken over and the user removes owner.json by hand.
    - An owner file that cannot be read (a run killed while a fallback O_EXCL file was
      being written) is dead once its modification time is older than the bound."""
    now = time.time() if now is None else now
    if not owner:  # unreadable: judge by the file's age
        try:
            age = now - path.stat().st_mtime if path is not None else 0.0
        except OSError:
            return "its owner file is gone"
        if timeout_s and age > timeout_s:
            return f"its owner file is unreadable and {age:.0f}s old"
        return None
    if owner.get("host") == me["host"]:
        if owner.get("boot_id") and me["boot_id"] and owner["boot_id"] != me["boot_id"]:
            return "its host rebooted since"
        if process_start_time(int(owner.get("pid", 0))) != owner.get("start_ticks"):
            return f"process {owner.get('pid')} on this host is gone"
        if owner.get("pid") != me["pid"]:
            return None  # alive, on this host: exact, whatever the heartbeat says
    job = owner.get("slurm_job_id")
    if job and job == me["slurm_job_id"] and me["restart_count"] > owner.get("restart_count",
                                                                             0):
        return (f"it is SLURM job {job}'s restart {owner.get('restart_count', 0)} and this "
                f"is restart {me['restart_count']}")
    silent = now - float(owner.get("heartbeat", 0.0))
    if timeout_s and silent > timeout_s:
        return f"its heartbeat is {silent:.0f}s old (run.owner_timeout_seconds = {timeout_s:g})"
    return None


def describe_owner(owner: dict[str, Any], now: float | None = None,
                   heartbeat: bool = True) -> str:
    """'host H, process P, SLURM job J, running since T (heartbeat Ns ago)'; without the
    heartbeat when `heartbeat` is false (`status` says it beside the newer metrics)."""
    if not owner:
        return "an owner whose owner.json cannot be read"
    now = time.time() if now is None else now
    parts = [f"host {owner.get('host')}", f"process {owner.get('pid')}"]
    if owner.get("slurm_job_id"):
        restart = owner.get("restart_count", 0)
        parts.append(f"SLURM job {owner['slurm_job_id']}"
                     + (f" (restart {restart})" if restart else ""))
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC",
                          time.gmtime(float(owner.get("started_at", 0.0))))
    text = f"{', '.join(parts)}, running since {since}"
    if not heartbeat:
        return text
    beat = now - float(owner.get("heartbeat", 0.0))
    return f"{text} (heartbeat {beat:.0f}s ago)"


def _write_private(out_dir: Path, record: dict[str, Any]) -> Path:
    """The record in a new temporary file of this process, flushed to disk."""
    temp = out_dir / f".{OWNER_FILE}.{record['token']}.{secrets.token_hex(4)}"
    with open(temp, "x", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return temp


def _create_exclusive(out_dir: Path, record: dict[str, Any]) -> bool:
    """Make `record` out_dir's owner file if there is none; False if there is one.

    out_dir/owner.json holds the owner's host, process id, process start time (clock ticks
    since boot, /proc/PID/stat), boot id, SLURM job id and restart count, when it started,
    a heartbeat (UTC seconds) and a random token. It is created complete or not at all:
    written to a private temporary file, flushed, then hard-linked to owner.json (link(2)
    fails with EEXIST when the name exists, atomically, on NFSv3+, Lustre and GPFS alike;
    an O_EXCL create is the fallback where links are not allowed). fcntl/flock locks are
    not used: on cluster file systems they may be missing, or local to one node."""
    path = out_dir / OWNER_FILE
    temp = _write_private(out_dir, record)
    try:
        os.link(temp, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # no hard links here: an exclusive create, written in place
        try:
            with open(path, "x", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
            return True
        except FileExistsError:
            return False
    finally:
        with contextlib.suppress(OSError):
            temp.unlink()


def _take_over(out_dir: Path, dead: dict[str, Any]) -> None:
    """Move the owner file judged dead out of the way. Local.

    A rename of owner.json to a unique aside name (atomic: of two runs racing, one rename
    finds nothing and that run starts over), then a check that the file moved is the one
    judged dead (if a live claim slipped in between, it is put back); the caller then
    makes its own claim (_create_exclusive)."""
    path = out_dir / OWNER_FILE
    aside = out_dir / f".{OWNER_FILE}.dead.{secrets.token_hex(4)}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # another run moved it first
    moved = read_owner_file(aside)
    if dead and moved.get("token") != dead.get("token"):
        # A live claim slipped in after the judgement: give it back.
        with contextlib.suppress(OSError):
            os.link(aside, path)
    with contextlib.suppress(OSError):
        aside.unlink()


def read_owner_file(path: Path) -> dict[str, Any]:
    """The record in `path`, {} if it cannot be read as one."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


@dataclass
class Ownership:
    """This process's claim on a run directory; `release()` gives it up (idempotent).

    A live owner whose file was replaced (a requeue took over, or its node was cut off for
    longer than the bound) stops at once without writing again: its heartbeat thread sees
    another token, prints one line and ends the process."""

    out_dir: Path
    record: dict[str, Any]
    created_dir: bool
    took_over: str | None = None  # why the previous owner was taken for dead
    _stop: threading.Event | None = None
    _thread: threading.Thread | None = None

    def start_heartbeat(self, interval_s: float) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(interval_s,),
                                        name="distbelief-owner-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self, interval_s: float) -> None:
        path = self.out_dir / OWNER_FILE
        while not self._stop.wait(interval_s):
            current = read_owner(self.out_dir)
            if current and current.get("token") != self.record["token"]:
                self._lost(current)
            if current is None:  # removed by hand: claim it again
                _create_exclusive(self.out_dir, self.record)
                continue
            self.record["heartbeat"] = time.time()
            try:
                temp = _write_private(self.out_dir, self.record)
                if read_owner(self.out_dir).get("token") != self.record["token"]:
                    temp.unlink()
                    continue  # judged on the next beat
                os.replace(temp, path)
            except OSError:
                continue  # a full or unreachable disk: the run itself will say so

    def _lost(self, current: dict[str, Any]) -> None:
        print(f"distbelief: error: run.out_dir {self.out_dir} was taken over by "
              f"{describe_owner(current)}; this run stops now, without writing there again",
              file=sys.stderr, flush=True)
        os._exit(LOST_EXIT_STATUS)

    def release(self) -> None:
        """Stop the heartbeat and remove the owner file if it is still ours (and out_dir if
        this claim created it and nothing else was written). Local."""
        if self._stop is not None:
            self._stop.set()
            self._thread.join()
            self._stop = None
        current = read_owner(self.out_dir)
        if current and current.get("token") == self.record["token"]:
            with contextlib.suppress(OSError):
                (self.out_dir / OWNER_FILE).unlink()
        if self.created_dir:
            with contextlib.suppress(OSError):
                self.out_dir.rmdir()  # only if empty: a run that failed before writing
            self.created_dir = False


def claim(out_dir: str | Path, timeout_s: float = DEFAULT_TIMEOUT_S,
          heartbeat_s: float | None = None) -> Ownership:
    """Make this process the owner of out_dir (created if missing) and start its heartbeat;
    RunDirBusy naming the owner when a live run holds it. Local: call it on one rank."""
    out_dir = Path(out_dir)
    created = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write to run.out_dir {out_dir}: {e.strerror or e}") from e
    me = this_process()
    took_over = None
    for _ in range(10):  # each pass either claims, refuses, or moves a dead owner aside
        try:
            if _create_exclusive(out_dir, me):
                break
        except OSError as e:
            raise UserError(f"cannot write to run.out_dir {out_dir}: "
                            f"{e.strerror or e}") from e
        owner = read_owner(out_dir)
        if owner is None:
            continue  # released meanwhile
        why = is_dead(owner, me, timeout_s, out_dir / OWNER_FILE)
        if why is None:
            if created:
                with contextlib.suppress(OSError):
                    out_dir.rmdir()
            raise RunDirBusy(f"run.out_dir {out_dir} belongs to a live run: "
                             f"{describe_owner(owner)}; nothing there was changed. Wait for "
                             f"it to end, stop it, or choose another run.out_dir")
        took_over = why
        _take_over(out_dir, owner)
    else:
        raise RunDirBusy(f"run.out_dir {out_dir}: could not claim it after 10 attempts "
                         f"(other runs are claiming it at the same moment)")
    ownership = Ownership(out_dir, me, created, took_over)
    if heartbeat_s is None:
        heartbeat_s = min(HEARTBEAT_S, timeout_s / 10) if timeout_s else HEARTBEAT_S
    ownership.start_heartbeat(max(heartbeat_s, 0.05))
    return ownership
