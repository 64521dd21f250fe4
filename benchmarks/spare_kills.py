"""Hot spares (cluster.spare_replicas; docs/checkpoints-and-reliability.md, "Hot spares"),
killed at random moments: a standalone search for bugs in the takeovers, not a test (the
fixed-moment cases are in tests/test_spares.py). Each job is Downpour on the spare tests'
data (synthetic, 6,000 training rows of 32 features, 4 classes; softmax regression, batch
128: tests/helpers.fault_config), 3,000 steps, through the command line with the launcher
keeping the others alive after a death, as the tests run it (MPICH's
-disable-auto-cleanup; DISTBELIEF_TEST_MPI=openmpi with Open MPI's mpiexec and mpi4py
first on PATH for Open MPI). Every job draws its transport (shared, rma) and its moments
from its own seed; the scenarios take turns:

(a) 1 shard + 2 replicas + 1 spare (4 ranks): a replica killed -9 at a random step
    (`kill`), in the middle of a random push (`killpush`), or at a random time up to 2 s
    after the run started (`time`: SIGKILL from outside to its worker; a run trains for
    about 1 s on the shared-memory transport here, 2-3 s over RMA);
(b) 1 shard + 2 replicas + 2 spares (5 ranks): a replica killed at a random step, then
    spare 0, the one that takes its part over, killed during the takeover: after its
    first steps (`kill`), in one of its first pushes (`killpush`) or at a random time up
    to 1.5 s after the replica's worker is gone (`time`);
(c) 1 shard + 2 replicas + 2 spares (5 ranks): both replicas killed close together (a few
    steps or a fraction of a second apart), each part taken over by a spare.

Each job runs under --timeout and is checked: the killed ranks exit non-zero and every
other rank 0; the run stops at max_steps with as many training replicas as it started
with (the spares always suffice here); summary.json's `spares` names distinct spares,
each replacing a replica that was killed (or whose spare was), the killed ones without
statistics and the others with pushes; no /dev/shm file of the job is left (the job's own,
sampled while it ran, and the folder's before and after). One line per job, a tally per
scenario and transport at the end; a failure prints the command that reruns it (the job's
scenario and seed) and the tail of its output. SKIP: a kill that never happened (the
victim's steps, or the run, ended first), the job otherwise right; LATE: a kill that
landed as the ranks free the windows together after the run ended, which ends the job
naming the rank, by design (its records stand).

    python benchmarks/spare_kills.py                      # 20 jobs, seed 1
    python benchmarks/spare_kills.py --jobs 30 --seed 7
    python benchmarks/spare_kills.py --scenarios b --job-seed 123456   # rerun one job
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers import DELAY, exit_statuses, fault_config, set_args
from helpers.mpi_jobs import SharedMemoryWatch, job_env, run_mpi, survive_a_death

from distbelief.data.converters import make_synthetic
from distbelief.runtime.launching.faults import ENV as FAULTS
from distbelief.runtime.launching.guardian import WORKER_ENV
from distbelief.runtime.launching.launcher import RANK_VARIABLES

STEPS = 3000
REPLICAS = 2
SHM = Path("/dev/shm")
TEARDOWN_LOSS = "while this rank waited for every rank, to free the parameter server's windows"


@dataclass
class TimedKill:
    """SIGKILL rank `rank`'s worker `delay` s after the run started (shard 0 created
    metrics.jsonl, every rank ready; `after` None) or after rank `after`'s worker is gone."""

    rank: int
    delay: float
    after: int | None = None


@dataclass
class Job:
    scenario: str
    seed: int
    transport: str
    spares: int
    faults: list[str] = field(default_factory=list)
    timed: list[TimedKill] = field(default_factory=list)

    @property
    def ranks(self) -> int:
        return 1 + REPLICAS + self.spares

    @property
    def victims(self) -> set[int]:
        return {int(f.split(":")[1]) for f in self.faults} | {k.rank for k in self.timed}

    def moment(self) -> str:
        timed = [f"time:{k.rank}:+{k.delay:.2f}s" + (f"(after rank {k.after})"
                                                      if k.after is not None else "")
                 for k in self.timed]
        return " ".join(self.faults + timed)


def draw(scenario: str, seed: int) -> Job:
    """The job `scenario` and `seed` stand for (the same on every machine)."""
    rng = random.Random(f"{scenario}-{seed}")
    transport = rng.choice(("shared", "rma"))
    how = rng.choice(("kill", "killpush", "time"))
    victim = rng.choice(range(1, 1 + REPLICAS))
    if scenario == "a":
        job = Job(scenario, seed, transport, spares=1)
        if how == "time":
            job.timed.append(TimedKill(victim, rng.uniform(0.0, 2.0)))
        else:
            job.faults.append(f"{how}:{victim}:{rng.randint(1, 1000)}")
        return job
    job = Job(scenario, seed, transport, spares=2)
    if scenario == "b":
        job.faults.append(f"{rng.choice(('kill', 'killpush'))}:{victim}:"
                          f"{rng.randint(20, 800)}")
        spare = 1 + REPLICAS  # spare 0: the first free one takes the part
        if how == "time":
            job.timed.append(TimedKill(spare, rng.uniform(0.0, 1.5), after=victim))
        else:
            job.faults.append(f"{how}:{spare}:{rng.randint(1, 3)}")
        return job
    if scenario == "c":
        first, second = rng.sample(range(1, 1 + REPLICAS), 2)
        if how == "time":
            at = rng.uniform(0.0, 1.5)
            job.timed += [TimedKill(first, at), TimedKill(second, at + rng.uniform(0, 0.5))]
        else:
            at = rng.randint(20, 800)
            job.faults += [f"{how}:{first}:{at}",
                           (f"{rng.choice(('kill', 'killpush'))}:{second}:"
                            f"{at + rng.randint(0, 30)}")]
        return job
    raise ValueError(f"unknown scenario {scenario!r}")


# -- killing a rank from outside ------------------------------------------------------------


def worker_pid(marker: str, rank: int) -> int | None:
    """The pid of rank `rank`'s worker (not its guardian) in the job whose command lines
    hold `marker`."""
    for pid in (name for name in os.listdir("/proc") if name.isdigit()):
        try:
            if marker.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            environ = dict(item.split(b"=", 1) for item in
                           Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                           if b"=" in item)
        except OSError:
            continue
        if WORKER_ENV.encode() not in environ:
            continue
        if any(environ.get(v.encode()) == str(rank).encode() for v in RANK_VARIABLES):
            return int(pid)
    return None


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


class Killer(threading.Thread):
    """Does a job's TimedKills while the job runs; `killed` the ranks it did kill."""

    def __init__(self, job: Job, out: Path, marker: str):
        super().__init__(daemon=True)
        self.job, self.out, self.marker = job, out, marker
        self.killed: set[int] = set()
        self.note = ""
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # noqa: BLE001 - reported with the job
            self.note = f"killer: {exc!r}"

    def _pid(self, rank: int) -> int | None:
        while not self.stop.is_set():
            pid = worker_pid(self.marker, rank)
            if pid is not None:
                return pid
            time.sleep(0.02)
        return None

    def _run(self) -> None:
        metrics = self.out / "metrics.jsonl"
        while not self.stop.is_set() and not metrics.exists():  # the run's clock starts
            time.sleep(0.02)
        started = time.monotonic()
        for kill in sorted(self.job.timed, key=lambda k: (k.after is not None, k.delay)):
            pid = self._pid(kill.rank)
            if kill.after is None:
                self.stop.wait(max(0.0, started + kill.delay - time.monotonic()))
            else:
                other = self._pid(kill.after)
                while other is not None and not gone(other) and not self.stop.is_set():
                    time.sleep(0.005)
                self.stop.wait(kill.delay)
            if self.stop.is_set() or pid is None or gone(pid):
                self.note = f"rank {kill.rank} was gone before its timed kill"
                return
            os.kill(pid, signal.SIGKILL)
            self.killed.add(kill.rank)


# -- one job ----------------------------------------------------------------------------------


def shm_files() -> set[str]:
    return set(os.listdir(SHM)) if SHM.is_dir() else set()


def run_job(job: Job, data: Path, out: Path, timeout: float) -> tuple[str, str]:
    """(result, details): "ok", or what failed and the tail of the job's output."""
    env = {**job_env(), FAULTS: " ".join([*job.faults, DELAY]),
           "DISTBELIEF_PS_TRANSPORT": job.transport}
    args = ["train", data / "linear.toml",
            *set_args(f'run.out_dir="{out}"', "run.heartbeat_timeout_seconds=5",
                      f"run.max_steps={STEPS}", f"cluster.spare_replicas={job.spares}")]
    before = shm_files()
    killer = Killer(job, out, str(out))
    with SharedMemoryWatch(out) as watch:
        killer.start()
        try:
            proc = run_mpi(job.ranks, [REPO / "tests" / "mpi_programs" / "cli_exit_status.py",
                                       *args], timeout=timeout, env=env,
                           launcher_options=survive_a_death())
        except pytest.fail.Exception as exc:  # the job timed out: a hang
            return "HANG", str(exc)[-6000:]
        finally:
            killer.stop.set()
            killer.join()
    output = proc.stdout + "\n" + proc.stderr
    tail = output[-4000:]
    # A kill that never fired (the victim's steps ended before its AT, or the run before
    # its time) makes another job, still checked: SKIP if that one is right.
    fired = {r for r in job.victims if f"test-only kill -9 of rank {r} " in output}
    killed = fired | killer.killed
    problems = check(job, proc, out, killed)
    left = watch.left()
    deadline = time.monotonic() + 5
    new = shm_files() - before
    while new and time.monotonic() < deadline:  # the guardians' cleaners, just after
        time.sleep(0.1)
        new = shm_files() - before
    if left or new:
        problems.append(f"/dev/shm left: {sorted(set(left) | {str(SHM / n) for n in new})}")
    if problems and TEARDOWN_LOSS in output:
        # Killed as the ranks free the windows together, after the run ended: the job
        # ends naming the rank (docs/checkpoints-and-reliability.md), by design.
        return "LATE", "; ".join(problems + [killer.note])
    if problems:
        return "FAIL", "; ".join(problems + [killer.note]) + "\n" + tail
    if killed != job.victims:
        return "SKIP", f"killed {sorted(killed)} of {sorted(job.victims)}; {killer.note}"
    return "ok", ""


def check(job: Job, proc: object, out: Path, killed: set[int]) -> list[str]:
    """What is wrong with a finished job whose ranks `killed` were killed."""
    problems = []
    statuses = exit_statuses(proc)
    expected_ok = [r for r in range(job.ranks) if r not in killed]
    if len(statuses) != job.ranks or any(statuses[r] != 0 for r in expected_ok) or any(
            statuses[r] == 0 for r in killed if r < len(statuses)):
        problems.append(f"exit statuses {statuses}, killed {sorted(killed)}")
    summary_path = out / "summary.json"
    if not summary_path.exists():
        return [*problems, "no summary.json"]
    summary = json.loads(summary_path.read_text())
    if summary.get("stop_reason") != "max_steps":
        problems.append(f"stop_reason {summary.get('stop_reason')!r}")
    first_spare = 1 + REPLICAS
    if len(killed) <= job.spares and summary.get("training_replicas_at_end") != REPLICAS:
        problems.append(f"training_replicas_at_end {summary.get('training_replicas_at_end')}")
    if summary.get("spare_replicas") != job.spares:
        problems.append(f"spare_replicas {summary.get('spare_replicas')}")
    spares = summary.get("spares", [])
    used = [t["spare"] for t in spares]
    if len(set(used)) != len(used) or not all(0 <= s < job.spares for s in used):
        problems.append(f"spares used {used}")
    # group g of a lost trainer: a replica g < R (rank g + 1), or a spare R + i
    killed_groups = {r - 1 for r in killed}
    for t in spares:
        rank = first_spare + t["spare"]
        if t["lost_group"] not in killed_groups:
            problems.append(f"spare {t['spare']} replaced group {t['lost_group']}, not killed")
        if t["ranks"] != [rank]:
            problems.append(f"spare {t['spare']} ranks {t['ranks']}")
        if rank in killed and t["pushes"] is not None:
            problems.append(f"killed spare {t['spare']} has pushes {t['pushes']}")
        if rank not in killed and not t["pushes"]:
            problems.append(f"spare {t['spare']} pushed {t['pushes']}")
    for victim in killed:
        if victim < first_spare:  # each killed replica's part ends with a live spare
            serving = [t for t in spares if t["replaced"] == victim - 1
                       and first_spare + t["spare"] not in killed]
            if len(killed) <= job.spares and len(serving) != 1:
                problems.append(f"replica {victim - 1}'s part served by {serving}")
    return problems


# -- the runs --------------------------------------------------------------------------------


def main() -> None:
    run_batch("spare_kills.py", __doc__, draw, run_job, default_jobs=20,
              describe=lambda job: f"{job.transport:6s}  {job.moment():40s}",
              group=lambda job: f"{job.scenario} {job.transport:6s}",
              grouped_by="scenario, transport")


def run_batch(script: str, doc: str, draw: Callable[[str, int], Any],
              run_job: Callable[[Any, Path, Path, float], tuple[str, str]],
              default_jobs: int, describe: Callable[[Any], str],
              group: Callable[[Any], str], grouped_by: str) -> None:
    """The command line of a kill benchmark (this one, standby_kills.py): draw the jobs
    (`draw(scenario, seed)`), make the fault tests' data, run each (`run_job(job, data
    folder, out, timeout)` -> (result, details)), print a line per job (`describe(job)`
    between its scenario and its result) and a tally per `group(job)`; exit 1 if a job
    failed or hung."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=default_jobs)
    parser.add_argument("--seed", type=int, default=1, help="draws each job's seed")
    parser.add_argument("--scenarios", default="abc", help="which take turns (a, b, c)")
    parser.add_argument("--job-seed", type=int, help="run only this job (with --scenarios X)")
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--keep", type=Path, help="keep each job's output folder here")
    args = parser.parse_args()
    if args.job_seed is not None:
        jobs = [draw(args.scenarios[0], args.job_seed)]
    else:
        rng = random.Random(args.seed)
        jobs = [draw(args.scenarios[i % len(args.scenarios)], rng.randrange(10**6))
                for i in range(args.jobs)]
    mpi = os.environ.get("DISTBELIEF_TEST_MPI", "") or "default MPI"
    drawn = f"job seed {args.job_seed}" if args.job_seed is not None else f"seed {args.seed}"
    print(f"{len(jobs)} jobs, {drawn}, {mpi}", flush=True)
    tally: Counter[tuple[str, str]] = Counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_synthetic(folder / "synth.h5", n_train=6000, n_test=500, input_shape=(32,),
                       num_classes=4, seed=5)
        (folder / "linear.toml").write_text(fault_config(None))
        for i, job in enumerate(jobs):
            out = (args.keep or folder) / f"job{i}-{job.scenario}-{job.seed}"
            t0 = time.monotonic()
            result, details = run_job(job, folder, out, args.timeout)
            tally[group(job), result] += 1
            print(f"job {i + 1:3d}  seed {job.seed:6d}  scenario {job.scenario}  "
                  f"{describe(job)}  {result:4s}  {time.monotonic() - t0:5.1f} s", flush=True)
            if result in ("SKIP", "LATE"):
                print(f"  {details}", flush=True)
            elif result != "ok":
                print(f"  rerun: python benchmarks/{script} --scenarios {job.scenario} "
                      f"--job-seed {job.seed}\n" + "\n".join(
                          "  | " + line for line in details.splitlines()), flush=True)
    print(f"tally ({grouped_by}: ok / failed / hung / a kill that did not happen / "
          "killed in the teardown):")
    for label in sorted({label for label, _ in tally}):
        counts = [tally[label, r] for r in ("ok", "FAIL", "HANG", "SKIP", "LATE")]
        print(f"  {label}: " + " / ".join(map(str, counts)))
    bad = sum(n for (_, r), n in tally.items() if r in ("FAIL", "HANG"))
    print(f"{sum(tally.values()) - bad} of {sum(tally.values())} jobs without a failure")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
