"""Fault tolerance end to end (issue 7), with the test-only fault injection of
distbelief.runtime.launching.faults, as MPI jobs under timeouts:

- kill -9 of a Downpour replica (one of 3; with 2 shards; on the RMA transport; one
  partition of a model-parallel replica): with MPICH's launcher keeping the others alive
  (`-disable-auto-cleanup`), they finish the run, the summary and the final checkpoint
  record the lost replica, every other rank exits 0, the final accuracy is within a point
  of a run without the failure, and a rerun resumes;
- kill -9 of a shard: the job ends non-zero within seconds with a clear message, and a
  rerun resumes from the last checkpoint;
- a replica that sleeps after every step: the others do not wait for it (their
  throughput beside a 10x straggler is measured by benchmarks/bench_faults.py);
- a replica that stops responding holding a shard's lock: the stall watchdog names it and
  aborts the job; one that stops responding holding nothing is declared lost after
  run.replica_timeout_seconds, and finds itself fenced off when it wakes.
(Non-finite gradients are tested in test_downpour_checkpoint.py.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from helpers import DELAY, exit_statuses, fault_config, set_args
from helpers.mpi_jobs import (
    REPO,
    SharedMemoryWatch,
    job_env,
    mpi_under_test,
    run_mpi,
    simulated_test_nodes,
    survive_a_death,
)

from distbelief.errors import ConfigError
from distbelief.records import checkpoint as ckpt
from distbelief.runtime.health.watchdog import RankLost, Watchdog, current, watching
from distbelief.runtime.launching.faults import ENV as FAULTS
from distbelief.runtime.launching.faults import Fault, Faults, parse

PROGRAMS = REPO / "tests" / "mpi_programs"
TIMEOUT = 120
KILL_AT = 1000
STEPS = 6000


@pytest.fixture(scope="module")
def data_dir(synthetic_folder) -> Path:
    # Softmax regression (convex): the accuracy it converges to hardly depends on how the
    # asynchronous updates interleaved, so two runs can be compared to a point. Measured
    # here: 0.837-0.838 without a failure, 0.834-0.837 with one (4 runs each).
    return synthetic_folder("faults", {"linear.toml": fault_config(None),
                                       "mlp.toml": fault_config(32)},
                            n_train=12000, n_test=2000, input_shape=(32,), seed=5)


def job(n: int, config: Path, out: Path, *overrides: str, faults: str = "",
        transport: str = "shared", survive: bool = True, timeout: float = TIMEOUT,
        extra_env: dict[str, str] | None = None):
    """The real command line on every rank (each printing its exit status)."""
    env = {**job_env(), FAULTS: faults, "DISTBELIEF_PS_TRANSPORT": transport, **(extra_env or {})}
    # A dead rank on another node (simulated nodes) is found by its heartbeat: 5 s here.
    args = ["train", config, *set_args(f'run.out_dir="{out}"',
                                       "run.heartbeat_timeout_seconds=5", *overrides)]
    return run_mpi(n, [PROGRAMS / "cli_exit_status.py", *args], timeout=timeout, env=env,
                   launcher_options=survive_a_death() if survive else ())


def summary_of(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


# -- the fault injection itself ----------------------------------------------------------------


def test_faults_parse_and_apply_to_their_rank_only() -> None:
    assert parse("kill:3:100, poison:2:5+ delay:*:0:10x pause:1:7:2.5s linger:1:0:1s") == [
        Fault("kill", 3, 100), Fault("poison", 2, 5, from_then_on=True),
        Fault("delay", None, 0, factor=10.0), Fault("pause", 1, 7, extra_seconds=2.5),
        Fault("linger", 1, 0, extra_seconds=1.0)]
    faults = Faults.for_rank(2, {FAULTS: "kill:3:100 poison:2:5+ delay:*:0:0.01s"})
    assert [f.action for f in faults.faults] == ["poison", "delay"]
    assert not faults.poisons(4) and faults.poisons(5) and faults.poisons(50)
    lingers = Faults.for_rank(1, {FAULTS: "linger:1:10:0.5s"})
    assert lingers.linger_seconds(9) == 0 and lingers.linger_seconds(10) == 0.5
    assert not Faults.for_rank(1, {})


def test_a_simulated_link_sleeps_the_bytes_over_its_rate() -> None:
    assert parse("link:*:0:125e6B/s") == [Fault("link", None, 0, bytes_per_second=125e6)]
    link = Faults.for_rank(0, {FAULTS: "link:*:0:1e6B/s"})
    began = time.monotonic()
    link.after_transfer(150_000)  # 0.15 s at 1 MB/s
    assert 0.15 <= time.monotonic() - began < 1.0
    began = time.monotonic()
    Faults.for_rank(0, {FAULTS: "delay:*:0:2x"}).after_transfer(10**9)  # no link: no sleep
    assert time.monotonic() - began < 0.1


def test_a_slots_fault_sets_every_shards_push_slots() -> None:
    assert parse("slots:*:3") == [Fault("slots", None, 3)]
    for rank in (0, 3):  # every rank's
        assert Faults.for_rank(rank, {FAULTS: "delay:*:0:2x slots:*:2"}).push_slots() == 2
    assert Faults.for_rank(0, {FAULTS: "delay:*:0:2x"}).push_slots() is None
    assert Faults.for_rank(0, {}).push_slots() is None


@pytest.mark.parametrize("text", ["explode:1:2", "kill:x:1", "kill:1", "delay:1:0:0.5x",
                                  "delay:1:0:3", "pause:1:0:2x", "poison:-1:3",
                                  "linger:1:0:2x", "linger:1:0", "link:1:0:5s",
                                  "link:1:0:0B/s", "slots:1:2", "slots:*:0"])
def test_a_bad_fault_is_one_clear_error(text: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"DISTBELIEF_FAULTS: cannot read '{text}'")):
        parse(text)


# -- the watchdog in one process -----------------------------------------------------------------


def test_the_watchdog_warns_once_names_the_holder_and_aborts() -> None:
    aborted: list[str] = []
    dog = Watchdog(1, lambda rank: f"rank {rank}", warn_s=0.2, abort_s=0.6,
                   abort=aborted.append)
    with watching(dog) as installed:
        assert current() is installed
        with installed.waiting("the lock on shard 0's segment", (0,), holder=lambda: 3):
            time.sleep(1.0)
    assert current() is not dog
    assert len(dog.reports) == 1, dog.reports  # warned once
    assert dog.reports[0].startswith("stall: rank 1 has waited 0.")
    assert dog.reports[0].endswith("for the lock on shard 0's segment, held by rank 3")
    assert len(aborted) == 1 and "held by rank 3; aborting the job" in aborted[0]


def test_a_short_wait_is_not_a_stall_and_a_gone_rank_ends_a_polled_wait() -> None:
    dog = Watchdog(0, str, warn_s=0.5, abort_s=0, abort=pytest.fail,
                   gone=lambda rank: rank == 2)
    with watching(dog):
        with dog.waiting("a quick message", (1,)):
            dog.check()  # rank 1 is alive
            time.sleep(0.1)
        with (pytest.raises(RankLost, match="rank 2 is gone while waiting for a barrier"),
              dog.waiting("a barrier", (1, 2))):
            dog.check()
    assert dog.reports == []


def test_an_mpi_call_that_never_returns_is_named_and_ends_the_job() -> None:
    # Outside any declared wait (an atomic blocked on a lock a killed rank left held): the
    # thread names the call after warn_s and aborts after abort_s; a quick call is nothing,
    # and a call inside a declared wait is that wait's to report.
    aborted: list[str] = []
    dog = Watchdog(2, lambda rank: f"rank {rank}", warn_s=0.2, abort_s=0.6,
                   abort=aborted.append)
    with watching(dog):
        dog.call_began("Fetch_and_op on a shard's window")
        dog.call_ended()
        time.sleep(0.3)
        assert dog.reports == [] and aborted == []
        with dog.waiting("a message", (1,)):
            dog.call_began("Flush on a shard's window")
            time.sleep(0.3)
            dog.call_ended()
        assert [r.split(" has ")[1][:6] for r in dog.reports] == ["waited"]
        dog.call_began("Compare_and_swap on a shard's window")
        time.sleep(1.0)
        dog.call_ended()
    assert len(dog.reports) == 2, dog.reports
    assert dog.reports[1].startswith("stall: rank 2 has been inside one MPI call "
                                     "(Compare_and_swap on a shard's window) for 0.")
    assert "a rank killed inside one leaves held" in dog.reports[1]
    assert len(aborted) == 1 and "aborting the job (run.stall_abort_seconds = 0.6)" \
        in aborted[0] and "resume from the last checkpoint" in aborted[0]


# -- a lost replica -----------------------------------------------------------------------------


@pytest.mark.parametrize("n, shards, victim, transport, fetch", [
    (4, 1, 3, "shared", "own_pushes"),  # one of 3 replicas: the acceptance case, compared
                                        # with no failure
    # The acceptance case always runs; of these, a seeded sample (helpers/matrix.py).
    pytest.param(5, 2, 2, "shared", "own_pushes", marks=pytest.mark.matrix),  # 2 shards
    # The RMA transport, as multi-node jobs run (also on simulated nodes).
    pytest.param(4, 1, 2, "rma", "own_pushes", marks=[pytest.mark.nodes, pytest.mark.matrix]),
    # Every replica has a push open for a whole step: the victim's, in whatever phase it
    # took its ticket, must not be written off against another phase's take.
    pytest.param(4, 1, 2, "rma", "overlapped", marks=[pytest.mark.nodes, pytest.mark.matrix]),
], ids=["1-of-3", "2-shards", "rma", "rma-overlapped"])
@pytest.mark.both_mpis
def test_a_killed_replica_leaves_the_others_to_finish_the_run(
        data_dir: Path, tmp_path: Path, n: int, shards: int, victim: int,
        transport: str, fetch: str) -> None:
    out = tmp_path / "out"
    config = data_dir / "linear.toml"
    common = (f"cluster.ps_shards={shards}", f"run.max_steps={STEPS}",
              "run.checkpoint_every_steps=2000", f'optimizer.fetch="{fetch}"')
    with SharedMemoryWatch(out) as watch:
        proc = job(n, config, out, *common, faults=f"kill:{victim}:{KILL_AT} {DELAY}",
                   transport=transport)
    output = proc.stdout + proc.stderr
    # The killed rank's shared-memory segments, and the survivors' (which skip
    # MPI_Finalize after a death), are removed by the last guardian to leave.
    assert watch.seen and watch.left() == [], output[-3000:]
    # Under Open MPI after a death the last rank's exit line never reaches stdout (prterun
    # returns before its guardian ends: conftest._exit_files); its status file is read.
    expected = [137 if r == victim else 0 for r in range(n)]
    assert exit_statuses(proc) == expected, output
    replica = victim - shards
    assert f"replica {replica} (rank {victim}) lost at step" in proc.stdout
    # At most the victim's own push is written off, once: a live replica's never is.
    assert proc.stderr.count("never completed") <= 1, output[-3000:]
    summary = summary_of(out)
    assert summary["stop_reason"] == "max_steps"
    # The step the victim was granted and computed, but never pushed, is not trained.
    assert STEPS - 1 <= summary["steps"] <= STEPS
    lost = summary["lost_replicas"]
    assert [(x["replica"], x["ranks"]) for x in lost] == [(replica, [victim])]
    assert "is gone" in lost[0]["why"]
    others = [r for r in range(n - shards) if r != replica]
    assert [r["replica"] for r in summary["replicas"]] == others
    assert sum(r["steps"] for r in summary["replicas"]) < summary["steps"]  # + the lost one's
    final = ckpt.find_latest(ckpt.checkpoint_root(out))[0]
    assert final.step == summary["steps"] and final.manifest["lost_replicas"] == [replica]
    assert [r["index"] for r in final.manifest["replicas"]] == others
    if n != 4 or transport != "shared":
        return

    # Within a point of the same run without a failure, at the same number of steps.
    clean = tmp_path / "clean"
    proc = job(n, config, clean, *common, f"run.max_steps={summary['steps']}", faults=DELAY)
    assert exit_statuses(proc) == [0] * n, proc.stderr[-3000:]
    baseline = summary_of(clean)
    assert baseline["lost_replicas"] == [] and baseline["steps"] == summary["steps"]
    assert abs(summary["final_test_accuracy"] - baseline["final_test_accuracy"]) <= 0.01, (
        summary["final_test_accuracy"], baseline["final_test_accuracy"])

    # A rerun resumes from the final checkpoint; the lost replica starts a fresh pass.
    proc = job(n, config, out, *common, f"run.max_steps={summary['steps'] + 500}")
    assert exit_statuses(proc) == [0] * n, proc.stderr[-3000:]
    assert f"replica(s) {replica} had been lost" in proc.stdout
    resumed = summary_of(out)
    assert resumed["resumed_at_step"] == summary["steps"]
    assert resumed["steps"] == summary["steps"] + 500 and resumed["lost_replicas"] == []


# Kills inside a push (its operations issued, not completed), at moments spread over runs of
# 3000 steps: AT counts the victim's own steps (each of R replicas makes about 3000 / R),
# so these land early, in the middle and late in its share, around checkpoints (every
# 1000 steps) too; 2 to 4 replicas, 1 and 2 shards (issue 17 item 3).
KILL_PUSH_STEPS = 3000
@pytest.mark.nodes
def test_an_overlapped_push_is_written_off_for_its_own_phase_only(
        data_dir: Path, tmp_path: Path) -> None:
    # fetch = "overlapped" keeps every replica's push open for a whole step; replica 0's
    # steps take 0.1 s, so takes wait on its pushes for longer than GONE_CHECK_S (20 ms)
    # and the shard looks for gone clients then. The dead replica's push must be written
    # off once, for the phase it took its ticket in: counted against another phase it
    # would stand in for a live replica's push, and the take of its own phase would then
    # wait give_up_s (the heartbeat timeout) for it. (That misattribution needs the death
    # to fall while another phase's take waits; this run makes it likely, not certain:
    # with the check removed it passed 3 times out of 3.)
    out = tmp_path / "out"
    proc = job(4, data_dir / "linear.toml", out, "run.max_steps=300",
               "run.checkpoint_every_steps=2000", 'optimizer.fetch="overlapped"',
               faults="kill:2:40 delay:1:0:0.1s", transport="rma")
    output = proc.stdout + proc.stderr
    assert exit_statuses(proc) == [0, 0, 137, 0], output[-3000:]
    assert proc.stderr.count("never completed") == 1, output[-3000:]
    summary = summary_of(out)
    assert summary["stop_reason"] == "max_steps", output[-3000:]
    assert 299 <= summary["steps"] <= 300
    assert [x["replica"] for x in summary["lost_replicas"]] == [1]


KILLS_IN_PUSH = [
    (4, 1, 3, 40, "rma", "own_pushes"), (4, 1, 2, 330, "rma", "own_pushes"),
    (4, 1, 1, 650, "rma", "own_pushes"), (3, 1, 2, 1100, "rma", "own_pushes"),
    (5, 2, 3, 500, "rma", "own_pushes"), (6, 2, 2, 420, "rma", "own_pushes"),
    (4, 1, 3, 330, "shared", "own_pushes"),
    # its previous push still in flight, completed with this one's ticket
    (4, 1, 2, 330, "rma", "overlapped"), (5, 2, 4, 500, "rma", "overlapped"),
]


@pytest.mark.parametrize("n, shards, victim, at, transport, fetch", KILLS_IN_PUSH,
                         ids=[f"{t}-{n}ranks-{s}shards-r{v}@{a}-{f}"
                              for n, s, v, a, t, f in KILLS_IN_PUSH])
@pytest.mark.matrix
def test_a_replica_killed_inside_a_push_never_stalls_the_others(
        data_dir: Path, tmp_path: Path, n: int, shards: int, victim: int, at: int,
        transport: str, fetch: str) -> None:
    # Before issue 17 a replica killed inside an RMA push epoch left its SHARED lock on the
    # shard, whose next EXCLUSIVE lock (its fold) then waited for ever: the survivors
    # stalled until the watchdog aborted the job. Here any wait of 5 s prints a "stall:"
    # line (and one of 20 s aborts), which fails the test.
    out = tmp_path / "out"
    proc = job(n, data_dir / "linear.toml", out, f"cluster.ps_shards={shards}",
               f"run.max_steps={KILL_PUSH_STEPS}", "run.checkpoint_every_steps=1000",
               "run.stall_warn_seconds=5", "run.stall_abort_seconds=20",
               f'optimizer.fetch="{fetch}"', faults=f"killpush:{victim}:{at} {DELAY}",
               transport=transport)
    output = proc.stdout + proc.stderr
    assert f"test-only kill -9 of rank {victim} in a push" in proc.stderr, output[-3000:]
    assert exit_statuses(proc) == [137 if r == victim else 0 for r in range(n)], output[-3000:]
    assert "stall:" not in output, output[-3000:]
    if transport == "rma":
        # Its slot was claimed, its data never marked FULL: the shards wrote the push off.
        assert "never completed (its process is gone; push slot" in proc.stderr, output[-3000:]
    summary = summary_of(out)
    replica = victim - shards
    assert summary["stop_reason"] == "max_steps", output[-3000:]
    assert [(x["replica"], x["ranks"]) for x in summary["lost_replicas"]] == [(replica, [victim])]
    # The victim's last step was granted but its push never completed: at most that one
    # step is missing; every completed push is counted exactly once.
    assert KILL_PUSH_STEPS - 1 <= summary["steps"] <= KILL_PUSH_STEPS, summary["steps"]
    assert [r["replica"] for r in summary["replicas"]] == [
        r for r in range(n - shards) if r != replica]
    final = ckpt.find_latest(ckpt.checkpoint_root(out))[0]
    assert final.step == summary["steps"] and final.manifest["lost_replicas"] == [replica]


def _worker_pid(tag: str, rank: int) -> int | None:
    """The pid of the worker (the guardian's child, which does the MPI work) of world rank
    `rank` of the job whose environment holds KILL_TAG=`tag`, or None yet."""
    procs = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        env = dict(item.split(b"=", 1) for item in environ if b"=" in item)
        if env.get(b"KILL_TAG") != tag.encode():
            continue
        ranks = [env.get(name) for name in (b"PMI_RANK", b"OMPI_COMM_WORLD_RANK")]
        if str(rank).encode() in ranks:
            procs[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])  # its parent
    children = [pid for pid, parent in procs.items() if parent in procs]
    return children[0] if children else None


def _kill_when_training(tag: str, rank: int, out: Path, delay_s: float,
                        killed: list[float]) -> None:
    """SIGKILL rank `rank`'s worker `delay_s` after training began (metrics.jsonl has a
    line): a moment unrelated to its steps, in or out of any MPI call."""
    give_up = time.monotonic() + TIMEOUT
    metrics = out / "metrics.jsonl"
    while time.monotonic() < give_up:
        pid = _worker_pid(tag, rank)
        if pid is not None and metrics.exists() and metrics.stat().st_size > 0:
            time.sleep(delay_s)
            os.kill(pid, signal.SIGKILL)
            killed.append(delay_s)
            return
        time.sleep(0.05)


# Kill moments after training began, spread over a step's phases (one step is well under
# a millisecond to a few ms here, so these fall at unrelated points of the protocol).
RANDOM_KILLS = [(4, 1, 2, 0.137, "own_pushes"), (4, 1, 3, 0.611, "overlapped"),
                (5, 2, 3, 0.293, "own_pushes"), (4, 1, 1, 1.049, "asynchronous")]


@pytest.mark.nodes
@pytest.mark.both_mpis
@pytest.mark.parametrize("n, shards, victim, delay_s, fetch", RANDOM_KILLS,
                         ids=[f"{n}ranks-{s}shards-r{v}@{d}s-{f}"
                              for n, s, v, d, f in RANDOM_KILLS])
@pytest.mark.matrix
def test_a_replica_killed_at_any_moment_never_stalls_the_others(
        data_dir: Path, tmp_path: Path, n: int, shards: int, victim: int, delay_s: float,
        fetch: str) -> None:
    # Issue 28: on the RMA transport no lock inside MPI exists for a dying replica to
    # keep (float data by Put and Get, counters by count-1 integer atomics), so a kill
    # at any instant, in a claim, a Put, a registration or a Get, leaves the survivors
    # to finish with a summary, under every one-sided component (CI's Open MPI step forces
    # osc/ucx). Any wait of 5 s prints "stall:", which fails the test.
    out, tag, killed = tmp_path / "out", f"{os.getpid()}-{tmp_path.name}", []
    env_tag = {"KILL_TAG": tag}
    killer = threading.Thread(target=_kill_when_training,
                              args=(tag, victim, out, delay_s, killed), daemon=True)
    killer.start()
    proc = job(n, data_dir / "linear.toml", out, f"cluster.ps_shards={shards}",
               "run.max_steps=0", "run.max_seconds=4", "run.checkpoint_every_steps=100000",
               "run.stall_warn_seconds=5", "run.stall_abort_seconds=20",
               f'optimizer.fetch="{fetch}"', faults=DELAY, transport="rma", extra_env=env_tag)
    killer.join(timeout=1)
    output = proc.stdout + proc.stderr
    assert killed == [delay_s], output[-3000:]
    statuses = exit_statuses(proc)
    if simulated_test_nodes():
        # Seen once in CI on fake hosts (2026-11-27): only ranks 1 and 3 printed their
        # status line, though the run finished with its summary; every line that does
        # come must be right, and the victim's must come.
        assert 137 in statuses and all(s in (0, 137) for s in statuses), output[-3000:]
    else:
        assert statuses == [137 if r == victim else 0 for r in range(n)], output[-3000:]
    assert "stall:" not in output, output[-3000:]
    summary = summary_of(out)
    assert summary["stop_reason"] == "max_seconds", output[-3000:]
    assert [x["replica"] for x in summary["lost_replicas"]] == [victim - shards]


def test_after_a_loss_shard_0_stays_until_the_last_epoch_on_it_has_closed(
        data_dir: Path, tmp_path: Path) -> None:
    # With a replica lost nobody frees the windows (TEARDOWN_LEAVE) and shard 0 leaves on
    # its own once the others say they leave. Over RMA a rank's epoch on shard 0's window
    # completes (Unlock returns) only while shard 0 is inside MPI, and shard 0 seeing an
    # epoch's operations applied does not mean that epoch has completed. Replica 0 (rank
    # 1) holds each of its end-of-run epochs open 1 s with their operations applied (a
    # rank descheduled just before its Unlock, as under load): had shard 0 left on seeing
    # them, rank 1 would wait in its Unlock for ever (the watchdog aborts it after 10 s).
    out = tmp_path / "out"
    proc = job(4, data_dir / "linear.toml", out, "run.max_steps=3000",
               "run.stall_warn_seconds=5", "run.stall_abort_seconds=10",
               faults=f"kill:2:300 linger:1:0:1s {DELAY}", transport="rma")
    output = proc.stdout + proc.stderr
    assert exit_statuses(proc) == [0, 0, 137, 0], output
    assert "stall:" not in output, output
    summary = summary_of(out)
    assert [x["replica"] for x in summary["lost_replicas"]] == [1]
    assert summary["stop_reason"] == "max_steps"


@pytest.mark.nodes  # there found by its heartbeat
def test_a_replica_killed_in_the_collective_teardown_ends_the_job_by_name(
        data_dir: Path, tmp_path: Path) -> None:
    # The run has ended and shard 0 decided that every rank frees the windows together;
    # rank 2 dies just then. Freeing is collective, so the others would wait inside
    # Win_free for ever, but the wait is declared (the parameter server's free): the job
    # ends, naming the rank, and the run's records stand. CI at stop 47 hung 120 s after a
    # replica was killed as its run ended, on simulated nodes; not this moment, it is covered.
    out = tmp_path / "out"
    proc = job(4, data_dir / "linear.toml", out, "run.max_steps=200", faults="killfree:2:0",
               transport="rma", timeout=60)
    output = proc.stdout + proc.stderr
    assert "test-only kill -9 of rank 2 as the windows are to be freed" in output, output[-3000:]
    assert "is gone while this rank waited for every rank, to free the parameter server's " \
        "windows" in output, output[-3000:]
    statuses = exit_statuses(proc)
    assert 137 in statuses and proc.returncode != 0, output[-3000:]
    assert summary_of(out)["stop_reason"] == "max_steps"


@pytest.mark.nodes  # also on simulated nodes (conftest.py: DISTBELIEF_TEST_NODES)
def test_a_killed_partition_loses_its_replica_and_the_run_goes_on(data_dir: Path,
                                                                  tmp_path: Path) -> None:
    # 1 shard + 2 replicas x 2 partitions: rank 4 is partition 1 of replica 1. Its partner
    # (rank 3) must notice while it waits for the activations that never come.
    out = tmp_path / "out"
    proc = job(5, data_dir / "mlp.toml", out, "cluster.partitions=2", "run.max_steps=3000",
               faults=f"kill:4:300 {DELAY}")
    assert exit_statuses(proc) == [0, 0, 0, 0, 137], proc.stdout + proc.stderr[-3000:]
    summary = summary_of(out)
    assert [(x["replica"], x["ranks"]) for x in summary["lost_replicas"]] == [(1, [3, 4])]
    assert summary["stop_reason"] == "max_steps" and summary["steps"] >= 2999
    assert {r["replica"] for r in summary["replicas"]} == {0}


@pytest.mark.parametrize("fetch", ["own_pushes", "overlapped"])
@pytest.mark.both_mpis
@pytest.mark.matrix
def test_losing_the_only_replica_near_the_end_is_exit_2_not_a_crash(
        data_dir: Path, tmp_path: Path, fetch: str) -> None:
    # 1 shard + 1 replica x 2 partitions; rank 2, partition 1, dies at step 2800 of 3000.
    # The last notes saw mpiexec exit 139 here and took it for a segfault: it is hydra
    # OR-ing the ranks' statuses, 137 | 2. Each rank's own status is checked instead.
    out = tmp_path / "out"
    proc = job(3, data_dir / "mlp.toml", out, "cluster.partitions=2", "run.max_steps=3000",
               f'optimizer.fetch="{fetch}"', faults=f"kill:2:2800 {DELAY}")
    output = proc.stdout + proc.stderr
    statuses = exit_statuses(proc)
    if mpi_under_test() == "mpich":
        assert statuses == [2, 2, 137], output[-3000:]
        assert proc.returncode == 137 | 2
    else:  # PRRTE ends the job at the first non-zero exit: a survivor may go by SIGTERM
        assert 137 in statuses and all(s in (2, 137, 143) for s in statuses), output[-3000:]
    assert "killed by SIGSEGV" not in output and "Segmentation" not in output
    assert "replica 0 (ranks 1, 2) lost at step" in proc.stdout, output[-3000:]
    assert "every replica was lost, so the run stopped (its last state is checkpointed)" \
        in proc.stderr
    summary = summary_of(out)
    assert summary["stop_reason"] == "replicas_lost" and summary["steps"] >= 2790
    assert ckpt.find_latest(ckpt.checkpoint_root(out))[0].step == summary["steps"]


def test_losing_replica_0_during_the_warm_start_lets_the_others_start(data_dir: Path,
                                                                      tmp_path: Path) -> None:
    # The others wait for replica 0's first 500 steps; it dies at its step 100.
    out = tmp_path / "out"
    proc = job(4, data_dir / "mlp.toml", out, "optimizer.warm_start_steps=500",
               "run.max_steps=2000", faults=f"kill:1:100 {DELAY}")
    assert exit_statuses(proc) == [0, 137, 0, 0], proc.stdout + proc.stderr[-3000:]
    summary = summary_of(out)
    assert [x["replica"] for x in summary["lost_replicas"]] == [0]
    assert summary["stop_reason"] == "max_steps" and summary["steps"] >= 1999
    assert {r["replica"] for r in summary["replicas"]} == {1, 2}


# -- a lost shard --------------------------------------------------------------------------------


@pytest.mark.both_mpis
@pytest.mark.nodes  # also on simulated nodes (conftest.py: DISTBELIEF_TEST_NODES)
def test_a_killed_shard_ends_the_job_with_a_message_and_a_rerun_resumes(
        data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    config = data_dir / "mlp.toml"
    t0 = time.monotonic()
    # Shard 1 dies after 600 updates; a checkpoint every 150 steps. (Few updates: on
    # simulated nodes, over RMA through MPI's network module, they come far slower.)
    with SharedMemoryWatch(out) as watch:
        proc = job(4, config, out, "cluster.ps_shards=2", "run.max_steps=0",
                   "run.max_seconds=60", "run.checkpoint_every_steps=150",
                   faults=f"kill:1:600 {DELAY}")
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    # An aborted job is cleaned on the aborting rank's node only (its cleaner knows the
    # files it maps); on several (simulated) nodes the others' are the site's to clean.
    if not simulated_test_nodes():
        assert watch.seen and watch.left() == [], (watch.left(0), proc.stderr[-3000:])
    assert elapsed < 30, (f"{elapsed:.1f} s to end the job: {proc.timeline}\n"
                          f"{proc.stderr[-3000:]}")
    assert ("parameter-server shard 1 (world rank 1) is gone: its slice of the parameters "
            "cannot be recovered without it") in proc.stderr, proc.stderr[-3000:]
    saved = [step for step, _ in ckpt.list_checkpoints(ckpt.checkpoint_root(out))]
    assert saved, "checkpoints were written before the kill"
    proc = job(4, config, out, "cluster.ps_shards=2", f"run.max_steps={saved[0] + 200}")
    assert exit_statuses(proc) == [0] * 4, proc.stderr[-3000:]
    assert f"at step {saved[0]}," in proc.stdout
    assert summary_of(out)["steps"] == saved[0] + 200


@pytest.mark.parametrize("fault", ["kill:1:1500", "killwrite:2:0"],
                         ids=["mid-run", "in-the-final-checkpoint"])
@pytest.mark.both_mpis
def test_a_killed_shard_with_a_standby_is_adopted_and_the_run_loses_no_update(
        data_dir: Path, tmp_path: Path, fault: str) -> None:
    # cluster.standby_shards, 3 shards + 2 replicas on shared memory: shard 1 dies after
    # 1500 updates. Its segment outlives it, the replicas fold on into it, shard 0 adopts
    # it (checkpoints, the final gather) and the run ends as asked, without a restart.
    # Or shard 2 dies writing its part of the final checkpoint (the only one: none
    # periodic): the others regroup and write that checkpoint again, shard 0 its part.
    out = tmp_path / "out"
    config = data_dir / "linear.toml"
    victim = int(fault.split(":")[1])
    every = 1000 if victim == 1 else 0
    common = ("cluster.ps_shards=3", f"run.max_steps={STEPS // 2}",
              f"run.checkpoint_every_steps={every}")
    with SharedMemoryWatch(out) as watch:
        proc = job(5, config, out, *common, "cluster.standby_shards=true",
                   faults=f"{fault} {DELAY}")
    output = proc.stdout + proc.stderr
    assert exit_statuses(proc) == [137 if r == victim else 0 for r in range(5)], output[-3000:]
    assert watch.seen and watch.left() == [], output[-3000:]
    assert f"parameter-server shard {victim} is lost; shard 0 serves its slice" in proc.stdout
    summary = summary_of(out)
    assert summary["stop_reason"] == "max_steps" and summary["steps"] == STEPS // 2
    assert [(x["shard"], x["adopted_by"]) for x in summary["lost_shards"]] == [(victim, 0)]
    assert "is gone" in summary["lost_shards"][0]["why"]
    # No update lost: every push folds into every slice (n_push = 1), the lost shard's too.
    shards = summary["shards"]
    assert [s["rank"] for s in shards] == [0, 1, 2]
    # (shard 2 died after the statistics were gathered: its own entry)
    assert shards[victim].get("adopted_by") == (0 if victim == 1 else None)
    assert shards[0]["version"] == shards[1]["version"] == shards[2]["version"] == sum(
        r["pushes"] for r in summary["replicas"]), shards
    # The checkpoints written after the loss hold the adopted slice, and a rerun (without
    # the standby: shard 1 is a live rank again) resumes from the final one.
    saved = ckpt.list_checkpoints(ckpt.checkpoint_root(out))  # newest first
    assert saved[0][0] == STEPS // 2
    if victim == 2:  # the final checkpoint, written again: the only one, and whole
        assert len(saved) == 1 and not list(ckpt.checkpoint_root(out).glob("*.partial"))
        manifest = json.loads((saved[0][1] / "manifest.json").read_text())
        assert sorted(manifest["parts"]) == ["replicas.h5", "shard-0000.h5",
                                             "shard-0001.h5", "shard-0002.h5"]
        return
    # Shard 1 died at about step 1500 (its 1500th update; one per push): the periodic
    # checkpoint after it (about step 2000) and the final one were written by shard 0.
    assert len([step for step, _ in saved if step > 1600]) >= 2, saved
    for step, path in saved:
        manifest = json.loads((path / "manifest.json").read_text())
        assert sorted(manifest["parts"]) == ["replicas.h5", "shard-0000.h5",
                                             "shard-0001.h5", "shard-0002.h5"], step
    if mpi_under_test() == "openmpi":
        return  # the resume and the accuracy are the MPI's no more than the above
    proc = job(5, config, out, *common, f"run.max_steps={STEPS // 2 + 300}")
    assert exit_statuses(proc) == [0] * 5, proc.stderr[-3000:]
    resumed = summary_of(out)
    assert resumed["resumed_at_step"] == STEPS // 2 and resumed["lost_shards"] == []
    # Within a point of the same run without a failure, at the same number of steps.
    clean = tmp_path / "clean"
    proc = job(5, config, clean, *common, faults=DELAY)
    assert exit_statuses(proc) == [0] * 5, proc.stderr[-3000:]
    assert abs(summary["final_test_accuracy"] - summary_of(clean)["final_test_accuracy"]) \
        <= 0.01, (summary["final_test_accuracy"], summary_of(clean)["final_test_accuracy"])


@pytest.mark.nodes  # on simulated nodes: the transport left to choose, and refused
def test_standby_shards_over_rma_are_refused_in_one_line_on_every_rank(
        data_dir: Path, tmp_path: Path) -> None:
    # Across nodes (RMA) an operation in flight to a dead shard never returns: refused,
    # whether RMA is asked for or the ranks are on several nodes.
    nodes = simulated_test_nodes()
    proc = job(4, data_dir / "linear.toml", tmp_path / "out", "cluster.ps_shards=2",
               "cluster.standby_shards=true", "run.max_steps=50",
               transport="auto" if nodes else "rma")
    assert exit_statuses(proc) == [2] * 4, proc.stderr[-3000:]  # a configuration error
    assert proc.stderr.count("cluster.standby_shards = true needs the shared-memory parameter "
                             "server") == 1, proc.stderr[-3000:]
    why = ("here the ranks are on more than one node" if nodes
           else "here DISTBELIEF_PS_TRANSPORT=rma asks for RMA")
    assert why in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("algorithm, optimizer, shards, refused", [
    ("sandblaster", {}, 2, "cannot survive a lost shard"),
    ("sync", {"backup_workers": 1}, 2, "cannot survive a lost shard"),
    ("averaging", {}, 0, "cannot survive a lost shard"),  # periodic averaging: no shards
    ("diloco", {}, 0, "cannot survive a lost shard"),  # synchronous DiLoCo: no shards
    ("downpour", {}, 1, "needs cluster.ps_shards >= 2, got 1: shard 0 runs the job"),
    ("averaging", {"elastic_alpha": 0.1}, 2, None),  # EASGD
    ("diloco", {"asynchronous": True}, 2, None),
    ("downpour", {}, 2, None)])
def test_standby_shards_need_downpours_shards_and_two_of_them(
        tmp_path: Path, algorithm: str, optimizer: dict, shards: int,
        refused: str | None) -> None:
    from helpers.configs import small_config_text

    from distbelief.config import load_config

    path = tmp_path / "c.toml"
    path.write_text(small_config_text(optimizer={"algorithm": algorithm, **optimizer},
                                      cluster={"ps_shards": shards, "standby_shards": True}))
    if refused is None:
        assert load_config(path, check_data=False).cluster.standby_shards is True
        return
    with pytest.raises(ConfigError, match=re.escape(refused)):
        load_config(path, check_data=False)


# -- stragglers ----------------------------------------------------------------------------------


@pytest.mark.nodes  # also on simulated nodes (conftest.py: DISTBELIEF_TEST_NODES)
def test_a_slow_replica_does_not_hold_the_others_back(data_dir: Path, tmp_path: Path) -> None:
    # 1 shard + 3 replicas for 3 s; replica 2 (rank 3) sleeps 0.1 s after every step, so it
    # makes at most 30. Replicas never wait for each other, so each of the others makes
    # many times that (about 2,000 on this busy 2-core machine; 3x leaves room for a far
    # busier one), where replicas that waited for the slowest would make as many as it.
    # How much throughput the others keep beside a 10x straggler, against a run without
    # it, is a ratio of timings: benchmarks/bench_faults.py --only straggler measures it.
    out = tmp_path / "out"
    proc = job(4, data_dir / "mlp.toml", out, "run.max_steps=0", "run.max_seconds=3",
               faults="delay:3:0:0.1s")
    assert exit_statuses(proc) == [0] * 4, proc.stderr[-3000:]
    steps = {r["replica"]: r["steps"] for r in summary_of(out)["replicas"]}
    assert sorted(steps) == [0, 1, 2] and 0 < steps[2] <= 31, steps
    assert min(steps[0], steps[1]) >= 3 * steps[2], steps


@pytest.mark.nodes  # on simulated nodes RMA, and the dead rank found by its heartbeat
def test_a_staleness_bound_holds_beside_a_straggler_and_a_killed_replica(
        data_dir: Path, tmp_path: Path) -> None:
    # optimizer.max_staleness = 1, 1 shard + 3 replicas: replica 2 (rank 3) takes 20 ms
    # longer per step, replica 1 (rank 2) is killed at its step 30. Replica 0 waits for the
    # straggler, never more than 1 clock ahead of it; the killed replica drops out of the
    # lowest clock once it is found lost, or the others would wait for it for ever.
    out = tmp_path / "out"
    proc = job(4, data_dir / "mlp.toml", out, "run.max_steps=240",
               "optimizer.max_staleness=1", faults="delay:3:0:0.02s kill:2:30")
    output = proc.stdout + proc.stderr
    assert exit_statuses(proc) == [0, 0, 137, 0], output[-3000:]
    summary = summary_of(out)
    assert summary["stop_reason"] == "max_steps", output[-3000:]
    assert [x["replica"] for x in summary["lost_replicas"]] == [1]
    fast, slow = summary["replicas"]
    assert (fast["replica"], slow["replica"]) == (0, 2)
    lead = summary["clock_lead"]
    assert lead["bound"] == 1 and lead["max"] <= 1, lead
    assert all(r["clock_bound"]["lead_max"] <= 1 for r in (fast, slow))
    assert fast["clock_bound"]["waits"] > 0 and fast["clock_bound"]["wait_seconds"] > 0
    # What the replicas did, whatever they report of their waits: the fast one pushed at
    # most the bound + 1 times more than the straggler, beside which it had all the time.
    assert fast["pushes"] <= slow["pushes"] + 2, (fast["pushes"], slow["pushes"])
    assert slow["steps"] >= 40
    expected = "rma" if simulated_test_nodes() else "shared"
    assert summary["shards"][0]["transport"] == expected


# -- stalls ----------------------------------------------------------------------------------


@pytest.mark.both_mpis
def test_the_watchdog_names_a_replica_that_hangs_holding_a_shard(data_dir: Path,
                                                                 tmp_path: Path) -> None:
    # Replica 2 (rank 3) stops responding in the middle of its push at step 100, holding
    # the lock on shard 0's segment: shard 0 and the other replicas wait for that lock.
    out = tmp_path / "out"
    t0 = time.monotonic()
    proc = job(4, data_dir / "mlp.toml", out, "run.max_steps=0", "run.max_seconds=60",
               "run.stall_warn_seconds=1", "run.stall_abort_seconds=3",
               faults=f"hang:3:100 {DELAY}")
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert elapsed < 30, f"{elapsed:.1f} s to end the job"
    stderr = proc.stderr
    assert "test-only hang of rank 3 in a push, holding the lock on shard 0" in stderr
    assert "lock on shard 0's segment, held by rank 3 (replica 2)" in stderr, stderr[-3000:]
    warned = [line for line in stderr.splitlines() if "stall:" in line and "has waited" in line]
    assert warned, stderr[-3000:]
    assert "aborting the job (run.stall_abort_seconds = 3)" in stderr


# Not on simulated nodes: there (RMA through MPI's network module, a loaded machine) shard
# 0's wait for the fenced-off replica to read the end of the run once took over the 1.5 s
# stall abort this test sets (1 run in 2).
def test_a_replica_that_stops_responding_is_lost_and_fenced_off(data_dir: Path,
                                                                tmp_path: Path) -> None:
    # Replica 2 (rank 3) sleeps 4 s at its step 100, holding nothing. After 1 s without news
    # it is lost; the others train on. When it wakes it reads that it is lost, stops, and
    # waits ~2 s for the end of the run, which the stall watchdog must not take for a
    # stall (shard 0 answers every poll), and leaves with everyone at the end (exit 0:
    # nothing failed on any rank).
    out = tmp_path / "out"
    proc = job(4, data_dir / "mlp.toml", out, "run.max_steps=0", "run.max_seconds=7",
               "run.replica_timeout_seconds=1", "run.stall_warn_seconds=0.5",
               "run.stall_abort_seconds=1.5", faults=f"pause:3:100:4s {DELAY}")
    assert exit_statuses(proc) == [0] * 4, proc.stdout + proc.stderr[-3000:]
    assert "test-only pause of rank 3 for 4 s at step 100" in proc.stderr, proc.stderr[-3000:]
    summary = summary_of(out)
    lost = summary["lost_replicas"]
    assert [(x["replica"], x["ranks"]) for x in lost] == [(2, [3])]
    assert "no news from it for 1 s" in lost[0]["why"]
    # Not before its 1 s without news. (That it was declared lost while it slept, not
    # after, follows from the rest: awake, it would have sent news again and trained on.)
    assert lost[0]["at_seconds"] >= 1, lost
    assert summary["stop_reason"] == "max_seconds"
    assert {r["replica"] for r in summary["replicas"]} == {0, 1}
    # Fenced off: the run's steps are the two others' plus the 100 replica 2 made before
    # its pause (+1: the step it computed before sleeping may be pushed as it wakes), not
    # the hundreds it would have added in the 2 s it was awake had it gone on training.
    others = sum(r["steps"] for r in summary["replicas"])
    assert 100 <= summary["steps"] - others <= 101, (summary["steps"], others)
