"""Running a comparison's runs one after another, and resuming an interrupted comparison.

THE FOLDER (owned by one live `compare` at a time, as train's run.out_dir:
runtime.health.ownership):
    compare.json   the comparison's state, rewritten atomically before and after each run:
                   the base configuration and, per run, its settings, command, state
                   ("running", "finished", "failed", "interrupted") and exit status
    runs/NAME/     each run's run.out_dir, exactly as `distbelief train` writes it
    logs/NAME.log  each run's output (stdout and stderr), appended to on every attempt

RESUME. A run counts as done when its state is "finished" for the same settings (the
base file's contents and the run's overrides, hashed) and its summary.json is there; it
is not run again. Any other run is started again with train's default resume: from the
newest valid checkpoint in its folder when there is one (an interrupted run continues,
its metrics continued by train), from scratch otherwise. A run whose settings changed
since its folder was written starts with `train --fresh`, which moves the old files
aside (nothing is deleted).

SIGNALS. The run's launcher is started in a process group of its own, so a Ctrl-C at the
terminal reaches `compare` alone. A first SIGINT, SIGTERM or SIGUSR1 is passed on to the
launcher as SIGUSR1, the one stop signal that mpiexec (Hydra, Open MPI) and srun all pass
to the ranks (srun answers a SIGTERM by killing them, and a first SIGINT only makes it
print its status): train stops after the current step, writes its checkpoint and exits;
`compare` records the run as interrupted and starts no other. A second SIGINT kills the
launcher's process group at once (the run resumes from its last checkpoint, which was
committed atomically). Run the same command again to resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Self

from distbelief.compare.plan import PlannedRun
from distbelief.config import apply_overrides, read_toml
from distbelief.errors import ConfigError
from distbelief.records.console import say
from distbelief.records.metrics import (
    LOWER_IS_BETTER,
    SUMMARY_FILE,
    score_name,
    summary_target,
    write_json_atomic,
)
from distbelief.runtime.launching import stuck_launcher

STATE_FILE = "compare.json"
RUNS_DIR = "runs"
LOGS_DIR = "logs"
DEFAULT_LAUNCHER = "mpiexec -n {n}"
RANKS_PLACEHOLDER = "{n}"
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def launcher_argv(template: str, ranks: int) -> list[str]:
    """The launcher's words for a run of `ranks` ranks: `{n}` in the template replaced by
    the rank count (e.g. "srun --mpi=pmix -n {n}" -> srun --mpi=pmix -n 3)."""
    words = shlex.split(template)
    if not any(RANKS_PLACEHOLDER in word for word in words):
        raise ConfigError(f"--launcher {template!r} has no {RANKS_PLACEHOLDER}: write where "
                          f"the rank count goes, e.g. --launcher \"srun --mpi=pmix -n {{n}}\"")
    return [word.replace(RANKS_PLACEHOLDER, str(ranks)) for word in words]


def check_launcher(template: str) -> None:
    """ConfigError when the launcher template is unusable (checked before any run)."""
    words = launcher_argv(template, 1)
    if not words or words[0] == RANKS_PLACEHOLDER:
        raise ConfigError(f"--launcher {template!r}: expected a command, e.g. \"mpiexec -n {{n}}\"")


def settings_key(config_path: Path, run: PlannedRun) -> str:
    """sha256 of what decides a run's result: the base file's bytes and its overrides."""
    digest = hashlib.sha256(Path(config_path).read_bytes())
    digest.update(json.dumps(list(run.overrides)).encode())
    return digest.hexdigest()


@dataclass
class Progress:
    """Where the comparison is, for its progress lines."""

    total: int
    started: float
    stream: IO[str] | None

    def line(self, index: int, text: str) -> None:
        elapsed = time.monotonic() - self.started
        say(self.stream, f"[{index}/{self.total}] {text}  (comparison {_clock(elapsed)})")


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Stopper:
    """Passes the first stop signal (SIGINT, SIGTERM, SIGUSR1) on to the current run's
    launcher as SIGUSR1, and remembers it so that no further run starts; a second SIGINT
    kills the launcher's process group. Main thread only; handlers restored on exit."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.child: subprocess.Popen | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Self:
        for sig in FORWARDED_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        again = self.received is not None
        if not again:
            self.received = signum
        child = self.child
        if child is None or child.poll() is not None:
            return
        try:
            if not again:
                child.send_signal(signal.SIGUSR1)
            elif signum == signal.SIGINT:
                os.killpg(child.pid, signal.SIGKILL)  # its own group: process_group=0
        except ProcessLookupError:
            pass


def run_comparison(config_path: str | Path, runs: Sequence[PlannedRun], out_dir: str | Path,
                   launcher: str = DEFAULT_LAUNCHER, stream: IO[str] | None = sys.stdout,
                   env: dict[str, str] | None = None,
                   run_timeout: float | None = None) -> int | None:
    """Run every run not already finished, one after another, in `out_dir` (which the
    caller owns); a run still going `run_timeout` seconds after its start (default: its
    run.max_seconds plus a grace, run_time_limit) is ended and recorded as timed out.
    Returns None when all were attempted, or the signal number that stopped the
    comparison."""
    config_path = Path(config_path).resolve()
    out = Path(out_dir)
    (out / RUNS_DIR).mkdir(parents=True, exist_ok=True)
    (out / LOGS_DIR).mkdir(exist_ok=True)
    state = read_state(out)
    records = {r["folder"]: r for r in state.get("runs", [])}
    progress = Progress(len(runs), time.monotonic(), stream)
    with Stopper() as stopper:
        for index, run in enumerate(runs, start=1):
            if stopper.received is not None:
                break
            key = settings_key(config_path, run)
            previous = records.get(run.folder)
            if is_finished(out, run, previous, key):
                progress.line(index, f"{run.describe()}: finished earlier, not run again")
                continue
            fresh = previous is not None and previous.get("key") != key
            record = _record(run, key, "running")
            records[run.folder] = record
            _write_state(out, config_path, runs, records)
            argv = train_command(config_path, run, out, launcher, fresh)
            record["command"] = shlex.join(argv)
            progress.line(index, f"{run.describe()}: starting")
            say(stream, f"    {record['command']}")
            started = time.monotonic()
            limit = run_timeout if run_timeout is not None \
                else run_time_limit(config_path, run)
            status, timed_out = _launch(argv, out / LOGS_DIR / f"{run.folder}.log", stream,
                                        stopper, env, limit)
            record["seconds"] = round(time.monotonic() - started, 3)
            record["exit_status"] = status
            summary = read_summary(out / RUNS_DIR / run.folder)
            record["state"] = "timed out" if timed_out \
                else run_state(status, summary, stopper.received is not None)
            _write_state(out, config_path, runs, records)
            progress.line(index, f"{run.describe()}: {outcome_text(record, summary, out)}")
    return stopper.received


GRACE_S = 120.0
"""A run may take this long past its run.max_seconds (start-up, the last evaluation, the
final checkpoint), and half its budget more on long runs, before compare ends it."""
KILL_AFTER_S = 10.0
"""After the SIGTERM of a run past its limit, this long until SIGKILL."""


def run_time_limit(config_path: Path, run: PlannedRun) -> float | None:
    """How long a run may go on: its run.max_seconds plus a grace (GRACE_S, or half the
    budget when that is more); None when it has no time budget."""
    budget = apply_overrides(read_toml(config_path), run.overrides).get("run", {}) \
        .get("max_seconds", 0)
    if not isinstance(budget, (int, float)) or budget <= 0:
        return None
    return float(budget) + max(GRACE_S, 0.5 * float(budget))


def run_state(status: int, summary: dict[str, Any] | None, signalled: bool) -> str:
    """"finished", "interrupted" (a stop signal: resumable) or "failed"."""
    if signalled or status == 130:
        return "interrupted"
    if status == 0 and summary is not None:
        # A signal sent to the ranks themselves (scancel --signal) stops train cleanly too.
        stopped = str(summary.get("stop_reason", "")).startswith("SIG")
        return "interrupted" if stopped else "finished"
    return "failed"


def is_finished(out: Path, run: PlannedRun, record: dict[str, Any] | None, key: str) -> bool:
    """Whether the run finished earlier with the same settings (and its summary is there)."""
    return (record is not None and record.get("state") == "finished"
            and record.get("key") == key
            and (out / RUNS_DIR / run.folder / SUMMARY_FILE).is_file())


def train_command(config_path: Path, run: PlannedRun, out: Path, launcher: str,
                  fresh: bool = False) -> list[str]:
    """`[launcher] python -m distbelief train CONFIG --set ...` for one run."""
    run_dir = (out / RUNS_DIR / run.folder).resolve()
    argv = launcher_argv(launcher, run.ranks) if run.uses_launcher else []
    argv += [sys.executable, "-m", "distbelief", "train", str(config_path)]
    for override in (*run.overrides, f"run.out_dir={json.dumps(str(run_dir))}"):
        argv += ["--set", override]
    if fresh:
        argv.append("--fresh")
    return argv


def _launch(argv: list[str], log_path: Path, stream: IO[str] | None, stopper: Stopper,
            env: dict[str, str] | None, limit: float | None = None) -> tuple[int, bool]:
    """Run one training command to its end, its output (stdout and stderr, line by line)
    appended to log_path and shown indented on `stream`; past `limit` seconds its process
    group gets SIGTERM, then SIGKILL. (exit status, whether it was ended for its time);
    status 127 when the launcher cannot be started (said in the log)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONUNBUFFERED"] = "1"  # progress lines as they happen, not at the end
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(argv)}\n")
        log.flush()
        try:
            # A process group of its own: a terminal's Ctrl-C reaches compare only, which
            # passes it on as SIGUSR1 (Stopper says why).
            child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, errors="replace",
                                     env=env, process_group=0)
        except OSError as e:
            message = f"distbelief: compare: cannot start {argv[0]!r}: {e.strerror or e}"
            log.write(message + "\n")
            say(stream, f"    {message}")
            return 127, False
        stopper.child = child
        timer = _Deadline(child, limit)
        stuck: list[str] = []  # a launcher stuck after its ranks ended is ended sooner
        threading.Thread(target=stuck_launcher.watch,
                         args=(child.pid, stuck_launcher.grace_s(), stuck.append),
                         daemon=True).start()
        try:
            for line in child.stdout:
                log.write(line)
                log.flush()
                say(stream, f"    {line.rstrip()}")
            status = child.wait()
        finally:
            timer.cancel()
            stopper.child = None
        for message in stuck:
            log.write(message + "\n")
            say(stream, f"    {message}")
        if timer.fired:
            message = (f"distbelief: compare: the run was still going {limit:g} s after its "
                       f"start (its run.max_seconds and a grace): ended its processes")
            log.write(message + "\n")
            say(stream, f"    {message}")
        return status, timer.fired


class _Deadline:
    """Ends a child's process group `limit` seconds from now: SIGTERM, then SIGKILL after
    KILL_AFTER_S (a hung launcher holds its output open, so reading it never ends)."""

    def __init__(self, child: subprocess.Popen, limit: float | None):
        self.fired = False
        self._child = child
        self._timers = []
        if limit is not None:
            self._timers = [threading.Timer(limit, self._end, (signal.SIGTERM,)),
                            threading.Timer(limit + KILL_AFTER_S, self._end, (signal.SIGKILL,))]
            for timer in self._timers:
                timer.daemon = True
                timer.start()

    def _end(self, sig: int) -> None:
        if self._child.poll() is not None:
            return
        self.fired = True
        try:
            os.killpg(self._child.pid, sig)
        except ProcessLookupError:
            pass

    def cancel(self) -> None:
        for timer in self._timers:
            timer.cancel()


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / SUMMARY_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def outcome_text(record: dict[str, Any], summary: dict[str, Any] | None, out: Path) -> str:
    """One line on how a run ended."""
    took = f"after {record['seconds']:.1f}s, exit status {record['exit_status']}"
    if record["state"] == "failed":
        last = _last_line(out / LOGS_DIR / f"{record['folder']}.log")
        return f"FAILED {took}: {last} (log: {LOGS_DIR}/{record['folder']}.log)"
    if record["state"] == "interrupted":
        return f"interrupted {took}; run the same command again to resume"
    if record["state"] == "timed out":
        return (f"TIMED OUT {took}: ended past its time limit (log: {LOGS_DIR}/"
                f"{record['folder']}.log); run the same command again to retry it")
    reached = summary.get("time_to_target")
    target = summary_target(summary)
    metric = target["metric"] if target else score_name(summary)
    goal = "" if target is None else \
        f"{'' if metric == 'accuracy' else metric + ' '}{target['value']:g}"
    text = (f"reached {goal} in {reached:.1f}s" if reached is not None
            else f"did not reach {goal}" if target is not None else "no target")
    final = summary.get(f"final_test_{metric}")
    final_text = f"{final:{value_format(metric)}}" if final is not None else "-"
    return f"finished {took}: {text}, final {metric} {final_text}"


def value_format(metric: str) -> str:
    """How a metric's value is shown: 4 decimals for one that rises to at most 1
    (accuracy 0.8824, r2, AUC), 4 significant digits for a loss or an rmse, which may be
    any size (0.0105, 2.317)."""
    return ".4g" if metric in LOWER_IS_BETTER else ".4f"


def _last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines()]
    except OSError:
        return "(no log)"
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or [line for line in lines if line] or ["(no output)"])[-1]


def read_state(out: Path) -> dict[str, Any]:
    """compare.json of a comparison folder ({} when there is none yet)."""
    path = out / STATE_FILE
    if not path.is_file():
        return {}
    try:
        state = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e}); move it aside to start the "
                          "comparison's bookkeeping over (run folders are kept)") from e
    return state if isinstance(state, dict) else {}


def _record(run: PlannedRun, key: str, state: str) -> dict[str, Any]:
    record = asdict(run)
    record["overrides"] = list(run.overrides)
    record.update(key=key, state=state, exit_status=None, seconds=None, command=None)
    return record


def _write_state(out: Path, config_path: Path, runs: Sequence[PlannedRun],
                 records: dict[str, dict[str, Any]]) -> None:
    """compare.json: this plan's runs first, in order, then any earlier plan's records
    (kept, so that narrowing a comparison forgets nothing)."""
    planned = [r.folder for r in runs]
    ordered = [records[f] for f in planned if f in records]
    ordered += [rec for f, rec in records.items() if f not in planned]
    write_json_atomic(out / STATE_FILE, {"config": str(config_path), "runs": ordered})
