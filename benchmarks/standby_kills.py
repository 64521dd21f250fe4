"""Standby shards (cluster.standby_shards; docs/checkpoints-and-reliability.md, "A standby
for a lost shard") killed at random moments: a standalone search for bugs in the
adoption, not a test (the fixed-moment case is in tests/test_fault_tolerance.py). Each job
is Downpour on the fault tests' data (synthetic, 6,000 training rows of 32 features, 4
classes; softmax regression, batch 128: tests/helpers.fault_config), 3 shards + 2
replicas on the shared-memory transport, 3,000 steps, a checkpoint every 250 steps
(written in the background or not, drawn), through the command line with the launcher
keeping the others alive after a death, as the tests run it. The scenarios take turns:

(a) shard 1 or 2 killed -9: after a random number of its updates (`kill`) or at a random
    time up to 1.5 s after the run started (`time`: SIGKILL from outside to its worker;
    a run trains for about 1-2 s here);
(b) shards 1 and 2 both killed, a few updates or a fraction of a second apart: shard 0
    ends the run alone;
(c) a shard and a replica killed close together (no spare: the replica's part is lost,
    as without standbys).

Each job runs under --timeout and is checked: the killed ranks exit non-zero and every
other rank 0; the run stops at max_steps (one step less when a replica was killed);
summary.json's `lost_shards` names exactly the killed shards, each adopted by shard 0;
every shard's slice holds the same number of updates (every push folds into every slice:
none lost; a replica killed inside its push may have folded into some slices only, so
they may differ by one there); the newest checkpoint is the final step and holds every
shard's part; no /dev/shm file of the job is left. One line per job and a tally per
scenario; a failure prints the command that reruns it and the tail of its output. SKIP:
a kill that never happened (the run ended first); LATE: a kill that landed as the ranks
free the windows together after the run ended, which ends the job naming the rank, by
design (its records stand). A kill after the windows are freed holds the others in
MPI_Finalize for the bound set here (DISTBELIEF_FINALIZE_LIMIT=30, s); they then leave
with their own status: such a job passes, about 30 s longer.

    python benchmarks/standby_kills.py                     # 30 jobs, seed 1
    python benchmarks/standby_kills.py --jobs 45 --seed 7
    python benchmarks/standby_kills.py --scenarios b --job-seed 123456   # rerun one job
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from helpers import DELAY, exit_statuses, set_args
from helpers.mpi_jobs import SharedMemoryWatch, job_env, run_mpi, survive_a_death
from spare_kills import TEARDOWN_LOSS, Killer, TimedKill, run_batch, shm_files

from distbelief.records import checkpoint as ckpt
from distbelief.runtime.launching.faults import ENV as FAULTS
from distbelief.runtime.launching.guardian import FINALIZE_LIMIT_ENV

STEPS = 3000
SHARDS, REPLICAS = 3, 2


@dataclass
class Job:
    scenario: str
    seed: int
    background: bool
    faults: list[str] = field(default_factory=list)
    timed: list[TimedKill] = field(default_factory=list)
    ranks: int = SHARDS + REPLICAS

    @property
    def victims(self) -> set[int]:
        return {int(f.split(":")[1]) for f in self.faults} | {k.rank for k in self.timed}

    def moment(self) -> str:
        return " ".join(self.faults + [f"time:{k.rank}:+{k.delay:.2f}s" for k in self.timed])


def draw(scenario: str, seed: int) -> Job:
    """The job `scenario` and `seed` stand for (the same on every machine)."""
    rng = random.Random(f"standby-{scenario}-{seed}")
    job = Job(scenario, seed, background=rng.random() < 0.5)
    timed = rng.random() < 0.5
    if scenario == "a":
        victims = [rng.choice((1, 2))]
    elif scenario == "b":
        victims = [1, 2]
        rng.shuffle(victims)
    elif scenario == "c":
        victims = [rng.choice((1, 2)), rng.choice(range(SHARDS, SHARDS + REPLICAS))]
        rng.shuffle(victims)
    else:
        raise ValueError(f"unknown scenario {scenario!r}")
    if timed:
        at = rng.uniform(0.0, 1.5)
        for victim in victims:
            job.timed.append(TimedKill(victim, at))
            at += rng.uniform(0.0, 0.3)
    else:  # a shard counts its updates (every push), a replica its own steps (about half)
        at = rng.randint(1, STEPS - 100)
        for victim in victims:
            job.faults.append(f"kill:{victim}:{at if victim < SHARDS else at // REPLICAS}")
            at += rng.randint(0, 60)
    return job


def run_job(job: Job, data: Path, out: Path, timeout: float) -> tuple[str, str]:
    """(result, details): "ok", or what failed and the tail of the job's output."""
    env = {**job_env(), FAULTS: " ".join([*job.faults, DELAY]),
           "DISTBELIEF_PS_TRANSPORT": "shared", FINALIZE_LIMIT_ENV: "30"}
    args = ["train", data / "linear.toml",
            *set_args(f'run.out_dir="{out}"', f"run.max_steps={STEPS}",
                      f"cluster.ps_shards={SHARDS}", "cluster.standby_shards=true",
                      "run.checkpoint_every_steps=250",
                      f"run.checkpoint_in_background={str(job.background).lower()}")]
    before = shm_files()
    killer = Killer(job, out, str(out))
    with SharedMemoryWatch(out) as watch:
        killer.start()
        try:
            proc = run_mpi(job.ranks, [REPO / "tests" / "mpi_programs" / "cli_exit_status.py",
                                       *args], timeout=timeout, env=env,
                           launcher_options=survive_a_death())
        except pytest.fail.Exception as exc:  # the job timed out: a hang
            out.mkdir(parents=True, exist_ok=True)
            (out / "hang.txt").write_text(str(exc))  # every rank's stacks, in full
            return "HANG", str(exc)[-6000:]
        finally:
            killer.stop.set()
            killer.join()
    output = proc.stdout + "\n" + proc.stderr
    fired = {r for r in job.victims if f"test-only kill -9 of rank {r} " in output}
    killed = fired | killer.killed
    problems = check(proc, out, killed, late=bool(job.timed))
    deadline = time.monotonic() + 5
    new = shm_files() - before
    while new and time.monotonic() < deadline:  # the guardians' cleaners, just after
        time.sleep(0.1)
        new = shm_files() - before
    left = watch.left()
    if left or new:
        problems.append(f"/dev/shm left: {sorted(set(left) | {f'/dev/shm/{n}' for n in new})}")
    if problems and (TEARDOWN_LOSS in output or _lost_in_teardown(out, output, killed)):
        return "LATE", "; ".join(problems + [killer.note])
    if problems:
        return "FAIL", "; ".join(problems + [killer.note]) + "\n" + output[-4000:]
    if killed != job.victims:
        return "SKIP", f"killed {sorted(killed)} of {sorted(job.victims)}; {killer.note}"
    return "ok", ""


def _lost_in_teardown(out: Path, output: str, killed: set[int]) -> bool:
    """A shard killed after the run ended whole (its summary complete, no shard lost in
    it) and before the ranks freed the windows together: they end the job naming it."""
    path = out / "summary.json"
    if not path.exists():
        return False
    summary = json.loads(path.read_text())
    late = [r for r in killed if r < SHARDS
            and r not in {x["shard"] for x in summary["lost_shards"]}]
    return (summary["stop_reason"] == "max_steps" and summary["steps"] == STEPS and late != []
            and any(f"(world rank {r}) is gone" in output for r in late))


def check(proc: object, out: Path, killed: set[int], late: bool) -> list[str]:
    """What is wrong with a finished job whose ranks `killed` were killed (`late`: timed
    kills, which may land after the run's end)."""
    problems = []
    statuses = exit_statuses(proc)
    if len(statuses) != SHARDS + REPLICAS or any(
            (statuses[r] == 0) == (r in killed) for r in range(len(statuses))):
        problems.append(f"exit statuses {statuses}, killed {sorted(killed)}")
    path = out / "summary.json"
    if not path.exists():
        return [*problems, "no summary.json"]
    summary = json.loads(path.read_text())
    replica_killed = any(r >= SHARDS for r in killed)
    if summary["stop_reason"] != "max_steps" or not (
            STEPS - replica_killed <= summary["steps"] <= STEPS):
        problems.append(f"stopped ({summary['stop_reason']}) at step {summary['steps']}")
    # A shard killed after the run's end (a timed kill) is not in lost_shards.
    shards_killed = {r for r in killed if r < SHARDS}
    lost = {x["shard"]: x["adopted_by"] for x in summary["lost_shards"]}
    if set(lost.values()) - {0} or not set(lost) <= shards_killed or (
            set(lost) != shards_killed and not late):
        problems.append(f"lost_shards {lost}, killed shards {sorted(shards_killed)}")
    versions = [s["version"] for s in summary["shards"]]
    if max(versions) - min(versions) > replica_killed:
        problems.append(f"the shards' updates differ: {versions}")
    saved = ckpt.list_checkpoints(ckpt.checkpoint_root(out))
    if not saved or saved[0][0] != summary["steps"]:
        problems.append(f"newest checkpoint {saved[:1]}, steps {summary['steps']}")
    else:
        parts = sorted(json.loads((saved[0][1] / "manifest.json").read_text())["parts"])
        if parts != ["replicas.h5", *(f"shard-{s:04d}.h5" for s in range(SHARDS))]:
            problems.append(f"final checkpoint parts {parts}")
    return problems


def main() -> None:
    run_batch("standby_kills.py", __doc__, draw, run_job, default_jobs=30,
              describe=lambda job: (f"{'background' if job.background else 'paused':10s}"
                                    f"  {job.moment():32s}"),
              group=lambda job: job.scenario, grouped_by="scenario")


if __name__ == "__main__":
    main()
