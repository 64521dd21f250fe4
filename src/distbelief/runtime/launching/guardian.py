"""Each MPI rank of `train` runs as a worker process under a small guardian, so that a rank
that dies of a signal (kill -9, the OOM killer, a segfault) does not take the job down
with it where the launcher would let the others live.

Why: MPICH's hydra proxy SIGKILLs every rank of the job once a process it started died of
a signal, even under `-disable-auto-cleanup`, while a process that merely exits only gets
the others a SIGUSR1. So the process hydra starts is the guardian, which uses no MPI; it
starts the worker (the same command, which does the MPI work, inheriting the PMI
connection), and when the worker dies of signal N the guardian exits with status 128 + N
instead. Downpour then goes on without that replica. The guardian also relays signals
(`run_guarded`), bounds MPI_Init (`init_timeout`) and removes the shared memory a dead
worker leaves (`SharedSegments`). What was seen of each launcher that led here:
docs/checkpoints-and-reliability.md, "What each launcher does when a rank dies".
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Collection, Sequence
from typing import Any

from distbelief.errors import ConfigError
from distbelief.runtime.launching.launcher import launcher_rank, launcher_size, quiet_osc_ucx

WORKER_ENV = "DISTBELIEF_GUARDIAN_PID"
"""Set in the worker's environment: its guardian's process id."""

INIT_FD_ENV = "DISTBELIEF_INIT_FD"
"""Set in the worker's environment: the pipe to its guardian, written as MPI_Init starts
and once it returned."""
STATUS_FD_ENV = "DISTBELIEF_STATUS_FD"
"""Set in the worker's environment: the pipe on which it tells its guardian its exit
status before MPI_Finalize (end_process), which FINALIZE_LIMIT_S bounds."""
FINALIZE_LIMIT_ENV = "DISTBELIEF_FINALIZE_LIMIT"
"""Seconds a worker's MPI_Finalize may take (default FINALIZE_LIMIT_S; 0: no bound)."""
FINALIZE_LIMIT_S = 600
"""How long a worker's MPI_Finalize may take: MPICH's waits for every rank (a PMI
barrier), so a rank killed after the run's end but before its own MPI_Finalize holds the
others in it for ever. The worker arms SIGALRM for this many seconds; its guardian then
reports it and leaves with the status the worker had told it. Generous, because a healthy
rank also waits there for the slowest: rank 0 still writing the summary and running the
final test after the others are done (the stall watchdog's default bound)."""
INIT_TIMEOUT_ENV = "DISTBELIEF_INIT_TIMEOUT"
"""Seconds a guardian waits for its worker's MPI_Init (default INIT_TIMEOUT_S)."""
INIT_TIMEOUT_S = 120.0
INIT_TIMEOUT_PER_RANK_S = 0.1
"""The default bound grows with the job: each rank waits in MPI_Init for the last one to
arrive, and on a thousand ranks starting Python from a parallel file system the last
arrives minutes after the first (issue 32): 220 s at 1,000 ranks."""
LAUNCHER_CHECK_S = 1.0
"""How often a guardian looks whether the launcher's process that started it is gone."""

RELAYED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT, signal.SIGHUP)
PR_SET_PDEATHSIG = 1


def is_worker() -> bool:
    return WORKER_ENV in os.environ


def run_guarded(argv: Sequence[str]) -> int:
    """Run `python -m distbelief ARGV` as the worker; return its exit status (128 + N if a
    signal N killed it). Call before MPI is initialised in this process.

    The guardian relays SIGTERM, SIGUSR1, SIGUSR2, SIGINT and SIGHUP to the worker, which
    runs in a process group of its own: a signal meant for the rank reaches the worker
    whether the launcher signals the rank's process or its process group (hydra signals
    process groups; SLURM's slurmstepd signals every process of the step, so there the
    worker gets it twice, which is harmless: a stop request is a stop request, and a
    SIGINT arriving twice within a second counts as one Ctrl-C, see
    distbelief.algorithms.common.note_interrupt). The worker dies with its guardian
    (PR_SET_PDEATHSIG), so a launcher that kills the job leaves nothing behind."""
    bound = init_timeout()
    env = dict(os.environ)
    env[WORKER_ENV] = str(os.getpid())
    pmi_fds = _pmi_fds()
    started, told = os.pipe()
    env[INIT_FD_ENV] = str(told)
    ended, says = os.pipe()
    env[STATUS_FD_ENV] = str(says)
    # The interpreter's own options (-X, -O, -W) carry over, as multiprocessing does it.
    python = [sys.executable, *subprocess._args_from_interpreter_flags()]
    worker = subprocess.Popen([*python, "-m", "distbelief", *argv], env=env,
                              pass_fds=[*pmi_fds, told, says], process_group=0)
    for fd in [*pmi_fds, told, says]:
        # The launcher must see the PMI connection close when the worker dies.
        os.close(fd)
    for number in RELAYED:
        signal.signal(number, lambda signum, frame: _relay(worker, signum))
    launcher = os.getppid()
    timed_out = _init_timed_out(started, bound)
    segments = SharedSegments(worker.pid, keeper=keeps_the_node_clean())
    if timed_out:
        print(f"distbelief: rank {launcher_rank() or '?'}: MPI_Init did not return within "
              f"{bound:g} s (a rank of the job failed to start, see its error; or a node "
              f"cannot be reached); ending this rank ({INIT_TIMEOUT_ENV} sets the bound)",
              file=sys.stderr, flush=True)
        segments.note()  # what the worker mapped inside MPI_Init, before it is killed
        _kill_worker(worker)
    segments.note()  # what MPI_Init mapped, before a first poll a second from now
    status = _wait_while_launcher_lives(worker, launcher, segments.note)
    removed = segments.remove_orphaned()
    if removed and status != 0:
        print(f"distbelief: rank {launcher_rank() or '?'}: removed {len(removed)} shared-"
              f"memory segment(s) the job left behind: {', '.join(removed)}",
              file=sys.stderr, flush=True)
    for number in RELAYED:
        # A launcher may go on signalling (hydra sends several SIGUSR1s per death); dying
        # of one now would be a death by signal, the very thing this process prevents.
        signal.signal(number, signal.SIG_IGN)
    if timed_out:
        return 1
    told_status = _told_status(ended)
    if status == -signal.SIGALRM and told_status is not None:
        print(f"distbelief: rank {launcher_rank() or '?'}: MPI_Finalize did not return "
              f"within {finalize_limit()} s (a rank of the job ended without it: killed "
              f"after the run's end?); this rank leaves with its own status, {told_status}",
              file=sys.stderr, flush=True)
        return told_status
    if status < 0:
        name = signal.Signals(-status).name
        print(f"distbelief: the worker of rank {launcher_rank() or '?'} was killed "
              f"by {name}", file=sys.stderr, flush=True)
        status = 128 - status
    return status


def init_timeout() -> float:
    """The bound on MPI_Init from INIT_TIMEOUT_ENV, or else INIT_TIMEOUT_S plus
    INIT_TIMEOUT_PER_RANK_S for each rank of the job (the launcher's count); a bad value is
    an error on every rank alike (they share the environment).

    Why a bound: a worker that dies before MPI_Init (it cannot even start) leaves the other
    ranks waiting in MPI_Init for ever under `-disable-auto-cleanup` (hydra only notifies
    them, and the stall watchdog starts after MPI_Init), and under Open MPI's
    `--enable-recovery` too; the default launch would end the job. The worker cannot bound
    its own MPI_Init: mpi4py holds the interpreter lock through it, so no Python thread
    runs (tried). So the guardian does: the worker writes one byte into a pipe as it calls
    MPI_Init and one once it returned, and a guardian that has read the first but not the
    second within the bound says so in one line, kills the worker and exits 1. (The
    worker's start-up before MPI_Init is not bounded: on a loaded node it can take seconds,
    and it is no hang.)"""
    text = os.environ.get(INIT_TIMEOUT_ENV, "")
    if not text:
        return INIT_TIMEOUT_S + INIT_TIMEOUT_PER_RANK_S * launcher_size()
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"{INIT_TIMEOUT_ENV} must be a positive number of seconds, "
                          f"got {text!r}")
    return value


def _init_timed_out(started: int, bound: float) -> bool:
    """Wait for the worker's first byte on `started` (it calls MPI_Init), then up to
    `bound` s for the second (MPI_Init returned); True if the second did not come in
    time. End of file (the worker ended; its exit status says the rest) is not a time-out."""
    try:
        if os.read(started, 1) != b"i":
            return False
        ready, _, _ = select.select([started], [], [], bound)
        return not ready
    finally:
        os.close(started)


def mpi_init_begins() -> None:
    """In the worker, just before MPI_Init: start the guardian's clock."""
    _tell_guardian(b"i", close=False)


def mpi_init_returned() -> None:
    """In the worker, once MPI_Init returned: stop the guardian's clock (and close)."""
    _tell_guardian(b"1", close=True)


def start_mpi() -> Any:
    """Initialise MPI; returns COMM_WORLD. With several ranks, make any unhandled exception
    (main thread or not) print its traceback and abort the whole job."""
    # Open MPI without InfiniBand: no osc/ucx error line per rank and window (the user's
    # own OMPI_MCA_osc wins; distbelief.runtime.launching.launcher.quiet_osc_ucx says why).
    quiet_osc_ucx()
    mpi_init_begins()  # the guardian bounds MPI_Init (init_timeout says why)
    from mpi4py import MPI

    mpi_init_returned()
    world = MPI.COMM_WORLD
    if world.Get_size() > 1:
        def abort_job(exc_type: type, exc: BaseException, tb: Any) -> None:
            # The cause first, in one line: when the launcher tears the job down it may cut
            # the tail of the traceback (seen with hydra under load).
            name = getattr(exc_type, "__name__", str(exc_type))
            print(f"distbelief: rank {world.Get_rank()} failed, aborting the job: "
                  f"{name}: {exc}", file=sys.stderr)
            traceback.print_exception(exc_type, exc, tb)
            sys.stderr.flush()
            clean_up_after_abort()
            time.sleep(0.2)  # let the launcher forward the output before Abort kills it
            world.Abort(1)

        sys.excepthook = abort_job
        threading.excepthook = lambda a: abort_job(a.exc_type, a.exc_value, a.exc_traceback)
    return world


def _told_status(ended: int) -> int | None:
    """The exit status the worker wrote on `ended` before its MPI_Finalize, if any."""
    try:
        ready, _, _ = select.select([ended], [], [], 0)
        text = os.read(ended, 16).decode() if ready else ""
    except OSError:
        text = ""
    finally:
        os.close(ended)
    return int(text) if text.strip().isdigit() else None


def _tell_guardian(byte: bytes, close: bool) -> None:
    fd = os.environ.get(INIT_FD_ENV, "")
    if not fd.isdigit():
        return
    try:
        os.write(int(fd), byte)
        if close:
            os.close(int(fd))
            del os.environ[INIT_FD_ENV]
    except OSError:
        pass


def _wait_while_launcher_lives(worker: subprocess.Popen, launcher: int,
                               every_check: Callable[[], None] = lambda: None) -> int:
    """worker.wait(), unless the launcher's process that started this one (`launcher`,
    its parent) goes first: then SIGKILL the worker and return 1. Seen under Open MPI: a
    hung worker ignored the SIGTERM its guardian relayed after MPI_Abort, PRRTE's daemon
    left without a SIGKILL, and guardian and worker lived on as orphans. Waits on a pidfd,
    looking at the parent (and calling `every_check`) every LAUNCHER_CHECK_S (no
    spinning)."""
    try:
        pidfd = os.pidfd_open(worker.pid)
    except (AttributeError, OSError):
        return worker.wait()  # no pidfd (old kernel): wait as before
    try:
        while not select.select([pidfd], [], [], LAUNCHER_CHECK_S)[0]:
            every_check()
            if os.getppid() != launcher:
                print(f"distbelief: rank {launcher_rank() or '?'}: the launcher is gone; "
                      "ending this rank's worker", file=sys.stderr, flush=True)
                _kill_worker(worker)
                worker.wait()
                return 1
    finally:
        os.close(pidfd)
    return worker.wait()


SHM_DIR = "/dev/shm"


class SharedSegments:
    """The shared-memory files (under /dev/shm) a worker maps, remembered while it lives,
    so that once it is gone the ones no live process maps any more can be removed.

    MPICH and Open MPI unlink their node's segments in MPI_Finalize; a rank killed by a
    signal, or a survivor that must skip MPI_Finalize after a death, never does, and the
    files hold the node's memory until reboot. Each guardian outlives its worker, so the
    last one of the node to finish finds no process mapping them and removes them. A
    launcher that ends a job kills every guardian too (hydra SIGKILLs the whole job when
    one rank dies of a signal), so the guardian of the node's first rank (`keeper`)
    also tells a cleaner outside the job's process groups what its worker maps; the
    cleaner acts once that guardian is gone (clean_after_job). Only files this worker
    mapped are ever touched (never another job's), and only when no process maps them.
    A node whose every process of the job, cleaner included, is killed keeps them: that
    is the site's per-job cleanup (docs/checkpoints-and-reliability.md)."""

    def __init__(self, pid: int, keeper: bool = False):
        self.pid = pid
        self.seen: set[str] = set()
        self.keeper = keeper
        self._cleaner: int | None = None  # the pipe to this node's cleaner
        self._started = False

    def note(self) -> None:
        """Remember what the worker maps now (called every LAUNCHER_CHECK_S)."""
        new = shm_files_mapped_by(self.pid) - self.seen
        if not new:
            return
        self.seen |= new
        if self.keeper:
            self._tell_cleaner(new)

    def _tell_cleaner(self, paths: set[str]) -> None:
        if self._cleaner is None and not self._started:
            self._started = True
            self._cleaner = start_cleaner()
        if self._cleaner is None:
            return
        try:
            os.write(self._cleaner, "".join(f"{path}\n" for path in sorted(paths)).encode())
        except OSError:  # the cleaner is gone: the guardian still cleans what it can
            os.close(self._cleaner)
            self._cleaner = None

    def remove_orphaned(self) -> list[str]:
        """Remove the remembered files that still exist and that no live process maps;
        returns their names."""
        return remove_unmapped(self.seen)


def remove_unmapped(paths: Collection[str]) -> list[str]:
    """Remove those of `paths` that still exist and that no live process maps; returns
    their names."""
    left = [path for path in sorted(paths) if os.path.exists(path)]
    if not left:
        return []
    mapped = mapped_by_anyone()
    removed = []
    for path in left:
        if path in mapped:
            continue
        try:
            os.unlink(path)
            removed.append(os.path.basename(path))
        except OSError:  # gone already (another guardian), or not ours to remove
            pass
    return removed


def mapped_by_anyone() -> set[str]:
    """The /dev/shm files some live process maps now."""
    return set().union(*(shm_files_mapped_by(pid) for pid in _live_pids()))


ABORT_CLEANUP_S = 30.0
"""How long the cleaner an aborting rank leaves behind waits for the job's processes to be
gone before it gives up (they are killed within a second or two of MPI_Abort)."""


def clean_up_after_abort() -> None:
    """Just before MPI_Abort: leave a process behind, outside the job's process groups,
    that removes the shared-memory files this process maps once no process maps them.
    The launcher kills every rank and guardian of an aborted job with SIGKILL, so nothing
    of the job can do it afterwards."""
    paths = sorted(shm_files_mapped_by(os.getpid()))
    if not paths:
        return
    code = ("import sys; from distbelief.runtime.launching.guardian import remove_when_unmapped; "
            f"remove_when_unmapped(sys.argv[1:], {ABORT_CLEANUP_S!r})")
    try:
        subprocess.Popen([sys.executable, "-c", code, *paths], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, close_fds=True)
    except OSError:
        pass  # no cleaner: the files stay, as before


def keeps_the_node_clean(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether this rank's guardian starts its node's cleaner: the node's first rank, as
    the launcher numbers them (hydra: MPI_LOCALRANKID, Open MPI: OMPI_COMM_WORLD_LOCAL_RANK,
    srun: SLURM_LOCALID); every rank when the launcher says nothing."""
    for name in LOCAL_RANK_VARIABLES:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return value == "0"
    return True


LOCAL_RANK_VARIABLES = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
CLEANER_POLL_S = 2.0
"""How often a cleaner looks whether the job's files are still mapped, once its guardian
is gone (a look reads every process's maps: not more often)."""
CLEANER_GIVE_UP_S = 24 * 3600.0
"""A cleaner whose files are still mapped this long after its guardian went leaves them."""
FINALIZE_GRACE_S = 1.0
"""Files found unmapped are removed only if they are still there this much later: a rank
in MPI_Finalize unmaps its segment just before it unlinks it itself."""


def start_cleaner() -> int | None:
    """Start a cleaner (clean_after_job) in a session of its own, which the launcher's kill
    of the job does not reach; returns the pipe it reads paths from (it acts once the
    pipe's write end is closed: when this process ends, however it ends), or None."""
    read, write = os.pipe()
    code = "from distbelief.runtime.launching.guardian import clean_after_job; clean_after_job()"
    try:
        subprocess.Popen([sys.executable, "-c", code], stdin=read, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         close_fds=True)
    except OSError:
        os.close(write)
        return None
    finally:
        os.close(read)
    return write


def clean_after_job() -> None:
    """A node's cleaner: read /dev/shm paths from stdin until its guardian is gone (end of
    file), then wait until no process maps them and remove those still there."""
    paths = {line.strip() for line in sys.stdin if line.strip().startswith(SHM_DIR + "/")}
    deadline = time.monotonic() + CLEANER_GIVE_UP_S
    while time.monotonic() < deadline:
        left = {path for path in paths if os.path.exists(path)}
        if not left:
            return
        if not mapped_by_anyone() & left:
            time.sleep(FINALIZE_GRACE_S)
            remove_unmapped(left)
            return
        time.sleep(CLEANER_POLL_S)


def remove_when_unmapped(paths: Sequence[str], timeout: float) -> None:
    """Wait (polling every 0.2 s, at most `timeout` s) until no live process maps any of
    `paths`, then remove those that still exist (run by clean_up_after_abort)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and mapped_by_anyone() & set(paths):
        time.sleep(0.2)
    remove_unmapped(paths)


def shm_files_mapped_by(pid: int) -> set[str]:
    """The /dev/shm files process `pid` maps (empty if it is gone or not readable)."""
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    found = set()
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith(SHM_DIR + "/") \
                and not parts[5].endswith(" (deleted)"):
            found.add(parts[5])
    return found


def _live_pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def _kill_worker(worker: subprocess.Popen) -> None:
    try:
        os.killpg(worker.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _relay(worker: subprocess.Popen, signum: int) -> None:
    try:
        worker.send_signal(signum)
    except ProcessLookupError:
        pass


def _pmi_fds() -> list[int]:
    """The file descriptor of the PMI connection the launcher passed (MPICH's hydra and
    SLURM's PMI-1/PMI-2 name it in PMI_FD); PMIx launchers connect by address instead."""
    text = os.environ.get("PMI_FD", "")
    if not text.isdigit():
        return []
    try:
        os.fstat(int(text))
    except OSError:
        return []
    return [int(text)]


def bind_to_guardian() -> None:
    """In the worker: ignore SIGUSR1 until a trainer handles it (a launcher's notice of a
    death, or an early stop request, must not kill it before or after training), die with
    the guardian (SIGKILL when it exits), and exit now if it is gone already. Linux only
    for the last two."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    guardian = int(os.environ.get(WORKER_ENV, "0"))
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if guardian and os.getppid() != guardian:
        print(f"distbelief: the guardian (process {guardian}) of this worker is gone, or "
              f"{WORKER_ENV} was inherited from another distbelief run; not starting",
              file=sys.stderr, flush=True)
        os._exit(1)


_skip_finalize = False


def skip_mpi_finalize() -> None:
    """This process must end without MPI_Finalize: a rank of the job is dead, and MPICH's
    MPI_Finalize waits (a PMI barrier) for every rank, so it would never return. Call
    `end_process` with the exit status to leave."""
    global _skip_finalize
    _skip_finalize = True


def _bound_finalize(status: int) -> None:
    """Under a guardian, with MPI initialised: tell it `status`, and end this process by
    SIGALRM if MPI_Finalize (at the interpreter's exit) takes FINALIZE_LIMIT_S. A Python
    thread cannot do it: mpi4py holds the interpreter's lock in MPI_Finalize."""
    fd = os.environ.get(STATUS_FD_ENV, "")
    mpi = sys.modules.get("mpi4py.MPI")
    if not fd.isdigit() or mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    try:
        os.write(int(fd), str(status).encode())
        os.close(int(fd))
    except OSError:
        return
    if finalize_limit():
        signal.alarm(finalize_limit())


def finalize_limit() -> int:
    """The bound on MPI_Finalize in whole seconds: FINALIZE_LIMIT_ENV, or else
    FINALIZE_LIMIT_S (a bad value: the default)."""
    value = os.environ.get(FINALIZE_LIMIT_ENV, "")
    return int(value) if value.isdigit() else FINALIZE_LIMIT_S


def end_process(status: int) -> None:
    """If MPI_Finalize must be skipped, flush and leave now with `status` (os._exit: no
    interpreter shutdown, so mpi4py's exit hook that finalizes MPI does not run); else
    return and let the interpreter end normally."""
    if not _skip_finalize:
        _bound_finalize(status)
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)
