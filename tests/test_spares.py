"""Hot spares (cluster.spare_replicas; issue 46 item 1; algorithms.downpour.spares).

- unit: the layout counts the spares (and refuses a job with none left to train), the
  algorithms that cannot use spares refuse them in one line, a waiting spare reads its
  takeover through the run control block, shard 0's pool gives a lost trainer's part to
  the first free live spare (a spare lost in turn hands it to the next; none left: the
  part is unserved), and a checkpoint after a takeover writes the part's position under
  the replaced replica's index (what a resume restores);
- MPI: a replica killed mid-run is replaced by a spare (the run ends with as many training
  replicas as it started with, the summary names the takeover and the time from the loss
  to the spare's first push), on both transports and MPIs, and on simulated nodes; with
  2 spares, killing the spare while it takes over is survived too; an EASGD spare joins
  the center the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import DELAY, exit_statuses, fault_config, set_args
from helpers.mpi_jobs import (
    REPO,
    SharedMemoryWatch,
    job_env,
    run_mpi,
    simulated_test_nodes,
    survive_a_death,
)

from distbelief.algorithms.downpour.spares import SparePool, part_start
from distbelief.errors import ConfigError
from distbelief.ps import run_control as rc
from distbelief.runtime.communicators.topology import Topology
from distbelief.runtime.launching.faults import ENV as FAULTS

PROGRAMS = REPO / "tests" / "mpi_programs"

# -- unit ----------------------------------------------------------------------------------


def test_the_layout_counts_the_spares_and_one_replica_must_train() -> None:
    # 1 shard + (2 replicas + 2 spares) x 2 partitions
    t = Topology(9, 7, 1, partitions=2, spares=2)
    assert (t.num_groups, t.num_replicas, t.replica_index, t.is_spare) == (4, 2, 3, True)
    assert not Topology(9, 3, 1, partitions=2, spares=2).is_spare
    assert list(t.replica_ranks(3)) == [7, 8]
    assert t.describe_rank(8) == "rank 8 (spare 1, partition 1)"
    assert "2 replica(s) + 2 spare(s) x 2 partition(s)" in t.describe()
    with pytest.raises(ConfigError, match=r"5 MPI rank\(s\) leave 2 replica group\(s\) of 2 "
                                          r"rank\(s\).*spare_replicas = 2 .*at least 7 ranks"):
        Topology(5, 0, 1, partitions=2, spares=2)


@pytest.mark.parametrize("algorithm, more", [
    ("sync", {}), ("hogwild", {}), ("sgd", {}),
    ("averaging", {}), ("diloco", {})])  # periodic averaging; synchronous DiLoCo
def test_algorithms_that_cannot_use_spares_refuse_them(tmp_path: Path, algorithm: str,
                                                        more: dict) -> None:
    from helpers.configs import small_config_text

    from distbelief.config import load_config

    (tmp_path / "c.toml").write_text(small_config_text(
        optimizer={"algorithm": algorithm, **more}, cluster={"spare_replicas": 1}))
    with pytest.raises(ConfigError, match=rf"cluster.spare_replicas = 1, but algorithm = "
                                          rf"\"{algorithm}\" cannot use spare replicas: "):
        load_config(tmp_path / "c.toml", check_data=False)


def test_the_memory_plan_and_status_count_the_spares(tmp_path: Path) -> None:
    from helpers.configs import small_config_text

    from distbelief.algorithms.memory_plan import layout_of
    from distbelief.config import load_config
    from distbelief.model.memory_model import Workload, replica_memory
    from distbelief.model.network import Network
    from distbelief.records.status import describe, run_status

    (tmp_path / "c.toml").write_text(small_config_text(cluster={"spare_replicas": 1}))
    config = load_config(tmp_path / "c.toml", check_data=False)
    layout = layout_of(config, 4)
    assert (layout.replicas, layout.spares, layout.ranks) == (2, 1, 4)
    assert layout.describe() == "1 shard(s) + 2 replica(s) + 1 spare(s)"
    assert layout_of(config, 2) is None  # 1 group, held back as the spare
    # Every replica rank, spares too, is planned holding 1/R of the data.
    network = Network((5,), [{"type": "dense", "units": 3, "activation": "softmax"}], 3)
    work = Workload(batch=1, state_arrays=1, transport="shared", train_rows=1000,
                    row_bytes=8)
    role = replica_memory(network, 1, work, 2, spares=1)
    assert role.count == 3 and role.parts["training data"] == 500 * 8
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text(
        '{"kind": "replica_lost", "time": 1.0, "step": 40, "samples": 40, "replica": 1}\n'
        '{"kind": "spare_took_over", "time": 1.1, "step": 42, "samples": 42, "spare": 0, '
        '"replaced": 1, "seconds": 0.05}\n')
    state = run_status(out)
    assert state["replicas_lost"] == [1]
    assert "replicas lost:     1; spare 0 took replica 1's part at step 42" in describe(state)


def test_a_waiting_spare_reads_its_takeover_from_the_block() -> None:
    block = np.zeros(rc.block_slots(3), dtype=np.int64)
    spare = rc.ControlExchange(2, spare=True)
    spare.apply(block.copy())
    assert spare.takes_over is None
    for slot, value in ((rc.FROM_EPOCH, 3), (rc.FROM_POSITION, 17), (rc.FROM_STEPS, 40),
                        (rc.TAKES_OVER, 2)):
        block[rc.replica_slot(2, slot)] += value
    spare.publish(serving=2).apply(block)
    assert (spare.takes_over, spare.takeover_start) == (1, (2, 17, 40))
    assert block[rc.replica_slot(2, rc.SERVING)] == 2
    replica = rc.ControlExchange(1)  # a replica's exchange reads none of it
    replica.apply(block)
    assert replica.takes_over is None


class _Shard:
    """What SparePool writes: shard 0's run control block."""

    def __init__(self, groups: int):
        self.block = np.zeros(rc.block_slots(groups), dtype=np.int64)

    def add_run_control(self, slot: int, value: int) -> None:
        self.block[slot] += value

    def rows(self) -> np.ndarray:
        return self.block[rc.GLOBAL_SLOTS:].reshape(-1, rc.REPLICA_SLOTS)


def _pool(replicas: int, spares: int, release: tuple[int, ...] = ()) -> tuple[SparePool,
                                                                            _Shard]:
    topology = Topology(1 + replicas + spares, 0, 1, spares=spares)
    plan = SimpleNamespace(num_replicas=replicas + len(release), first_spare=replicas,
                           num_groups=replicas + spares, topology=topology,
                           release_spares_at=release)
    shard = _Shard(replicas + spares)
    return SparePool(plan, shard, lambda part: (9, 0, 0)), shard


def test_a_lost_part_goes_to_the_first_free_live_spare_and_on_when_it_is_lost() -> None:
    pool, shard = _pool(2, 2)  # groups 0, 1 train; 2, 3 are spares
    rows, lost = shard.rows(), np.zeros(4, dtype=bool)
    rows[1, [rc.ACKED, rc.EPOCH, rc.POSITION, rc.LOCAL_STEPS]] = 1, 0, 250, 31
    lost[2] = True  # spare 0 lost while waiting: it leaves the pool
    assert pool.lost(2, rows, lost, 10, lambda g: [1 + g]) is None
    lost[1] = True  # replica 1, which paused for a checkpoint: spare 1 starts where it was
    takeover = pool.lost(1, rows, lost, 50, lambda g: [1 + g])
    assert (takeover.spare, takeover.group, takeover.replaced, takeover.ranks,
            takeover.start) == (1, 3, 1, [4], (0, 250, 31))
    assert rows[3, rc.TAKES_OVER] == 2 and rows[3, rc.FROM_EPOCH] == 1
    assert rows[3, rc.FROM_POSITION] == 250 and rows[3, rc.FROM_STEPS] == 31
    assert pool.training() == 2 and pool.unserved() == []
    # A checkpoint before the spare opened the part writes where it was told to start...
    assert pool.positions(rows)[1] == (3, (0, 250, 31))
    # ... and after, the spare's own position, under replica 1's index: a resume at this
    # layout restores part 1 there (run._restore_replica reads replica 1's entry).
    rows[3, [rc.SERVING, rc.EPOCH, rc.POSITION, rc.LOCAL_STEPS]] = 2, 1, 12, 70
    assert pool.serving(rows, 1e12)[0] is takeover and takeover.takeover_seconds > 0
    assert pool.positions(rows) == {0: (0, (0, 0, 0)), 1: (3, (1, 12, 70))}
    # The serving spare is lost too: no spare left, the part is unserved from then on.
    lost[3] = True
    assert pool.lost(3, rows, lost, 90, lambda g: [1 + g]) is None
    assert pool.training() == 1 and pool.unserved() == [1]
    assert list(pool.positions(rows)) == [0]


def test_a_released_spare_trains_a_part_of_its_own() -> None:
    # cluster.release_spares_at = [100]: 1 replica + 2 spares, the data in 2 parts; part 1
    # waits until spare 0 is released for it. Waiting is not lost: a checkpoint lists it
    # as unreleased (pending), not in lost_replicas (unserved).
    pool, shard = _pool(1, 2, release=(100,))
    rows, lost = shard.rows(), np.zeros(3, dtype=bool)
    assert pool.training() == 1 and pool.unserved() == [] and pool.pending == [1]
    released = pool.release(rows, lost, 100, lambda g: [1 + g])
    assert (released.spare, released.replaced, released.lost_group) == (0, 1, None)
    assert rows[1, rc.TAKES_OVER] == 2 and pool.training() == 2 and pool.pending == []
    # The replica is lost: the other spare takes part 0.
    lost[0] = True
    assert pool.lost(0, rows, lost, 150, lambda g: [1 + g]).group == 2
    assert pool.training() == 2


def test_a_spare_is_counted_in_the_staleness_bound_when_it_takes_over() -> None:
    # optimizer.max_staleness: 2 replicas and a spare; the spare holds MIN_CLOCK back
    # neither while it waits nor once counted in, at the lowest clock then.
    from distbelief.algorithms.downpour.clocks import ClockWatch

    shard = _Shard(3)
    clocks = ClockWatch(shard, 2, 3, [], spares=[2])
    rows, lost = shard.rows(), np.zeros(3, dtype=bool)
    rows[:, rc.CLOCK] = 7, 5, 0
    clocks.saw(rows, lost, warm_over=True)
    assert clocks.min_clock == 5  # the waiting spare's clock 0 is not counted
    clocks.join(2)
    assert rows[2, rc.JOINED] == 6  # 1 + the clock it starts at
    rows[2, rc.CLOCK] = 1
    clocks.saw(rows, lost, warm_over=True)
    assert clocks.min_clock == 5 and not clocks.waiting


def test_a_part_nobody_published_starts_at_the_checkpoints_rule() -> None:
    plan = SimpleNamespace(num_replicas=2)
    assert part_start(None, plan, 1000, 1, 2500) == (3, 0, 0)  # a pass no epoch used
    saved = SimpleNamespace(data_state={"epoch": 4, "position": 8},
                            counters={"local_steps": 6})
    found = SimpleNamespace(num_replicas=2, has_replica=lambda r: r == 1,
                            read_replica=lambda r: saved)
    assert part_start(found, plan, 1000, 1, 2500) == (4, 8, 6)
    assert part_start(found, plan, 1000, 0, 2500) == (3, 0, 0)  # lost when it was written


# -- MPI -----------------------------------------------------------------------------------

STEPS = 1500
TIMEOUT = 120


@pytest.fixture(scope="module")
def data_dir(synthetic_folder) -> Path:
    return synthetic_folder("spares", {"linear.toml": fault_config(None)},
                            n_train=6000, n_test=500, input_shape=(32,), seed=5)


def job(n: int, data_dir: Path, out: Path, *overrides: str, faults: str,
        transport: str) -> object:
    env = {**job_env(), FAULTS: faults, "DISTBELIEF_PS_TRANSPORT": transport}
    args = ["train", data_dir / "linear.toml",
            *set_args(f'run.out_dir="{out}"', "run.heartbeat_timeout_seconds=5",
                      f"run.max_steps={STEPS}", *overrides)]
    return run_mpi(n, [PROGRAMS / "cli_exit_status.py", *args], timeout=TIMEOUT, env=env,
                   launcher_options=survive_a_death())


@pytest.mark.parametrize("transport", [
    "shared", pytest.param("rma", marks=[pytest.mark.nodes, pytest.mark.matrix])])
@pytest.mark.both_mpis
def test_a_spare_takes_a_killed_replicas_part_over(data_dir: Path, tmp_path: Path,
                                                    transport: str) -> None:
    # 1 shard, replicas 0 and 1 (ranks 1, 2), spare 0 (rank 3); replica 1 is killed at
    # its step 200 (of about 750).
    out = tmp_path / "out"
    with SharedMemoryWatch(out) as watch:
        proc = job(4, data_dir, out, "cluster.spare_replicas=1",
                   faults=f"kill:2:200 {DELAY}", transport=transport)
    output = proc.stdout + proc.stderr
    assert exit_statuses(proc) == [0, 0, 137, 0], output[-3000:]
    assert watch.left() == [], output[-3000:]  # the dead rank's segments too
    assert "replica 1 (rank 2) lost at step" in proc.stdout, output[-3000:]
    assert "spare 0 (rank 3) takes its part over; training goes on with 2" in proc.stdout
    assert "distbelief: spare replica 0 (rank 3) takes over replica 1's part" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "max_steps" and summary["steps"] >= STEPS - 1
    assert summary["spare_replicas"] == 1 and summary["training_replicas_at_end"] == 2
    [taken] = summary["spares"]
    assert (taken["spare"], taken["ranks"], taken["replaced"]) == (0, [3], 1)
    assert taken["pushes"] > 0 and taken["takeover_seconds"] is not None
    # The goal on one node is 2 s after the loss is detected; across simulated nodes the
    # loss is detected by the heartbeat, which this figure starts after too.
    assert 0 < taken["loss_to_first_push_seconds"] < 2 + 3 * (simulated_test_nodes() > 0)
    spare = next(r for r in summary["replicas"] if r["rank"] == 3)
    assert spare["spare"] and spare["replaced"] == 1 and spare["steps"] > 0
    roles = {figure["rank"]: figure["role"] for figure in summary["peak_rss"]}
    assert roles[3] == "spare 0" and roles[1] == "replica 0", roles
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["replaced"] for e in events if e.get("kind") == "spare_took_over"] == [1]


def test_released_spares_grow_the_job_from_one_replica_to_three(data_dir: Path,
                                                                tmp_path: Path) -> None:
    # cluster.release_spares_at (issue 46 item 2): 1 shard, replica 0 alone, then spares
    # 0 and 1 released as replicas 1 and 2 at steps 200 and 400; the data is in 3 parts.
    # A checkpoint every 100 steps, all kept: some come before the releases.
    out = tmp_path / "out"
    proc = job(4, data_dir, out, "cluster.spare_replicas=2",
               "cluster.release_spares_at=[200, 400]", "run.checkpoint_every_steps=100",
               "run.keep_checkpoints=10", faults=DELAY, transport="shared")
    output = proc.stdout + proc.stderr
    assert exit_statuses(proc) == [0, 0, 0, 0], output[-3000:]
    assert "spare replica 0 (rank 2) released at step 2" in proc.stdout, output[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_replicas"] == 3 and summary["training_replicas_at_end"] == 3
    assert [(t["spare"], t["replaced"], t["lost_group"]) for t in summary["spares"]] == [
        (0, 1, None), (1, 2, None)]
    assert all(t["pushes"] > 0 for t in summary["spares"])
    started = {r["rank"]: r["started_at_step"] for r in summary["replicas"]}
    assert started[1] == 0 and 200 <= started[2] < started[3] and started[3] >= 400
    # The final checkpoint holds all three parts' positions.
    import distbelief.records.checkpoint as ckpt

    final = ckpt.find_latest(ckpt.checkpoint_root(out))[0]
    assert final.num_replicas == 3 and final.manifest["lost_replicas"] == []
    # Every checkpoint lists a part waiting for its release as unreleased, never as lost
    # (a resume prints no loss for it and releases it at its step), and holds the position
    # of each released one. Which checkpoints come before a release depends on timing, so
    # the rule is checked on each one the run wrote (the unit tests in test_checkpoint.py
    # and above hold it deterministically).
    for step, path in ckpt.list_checkpoints(ckpt.checkpoint_root(out)):
        found = ckpt.verify(path)
        assert found.num_replicas == 3 and found.manifest["lost_replicas"] == [], step
        waiting = found.manifest.get("unreleased_replicas", [])
        assert found.has_replica(0) and waiting in ([], [2], [1, 2]), (step, waiting)
        assert all(found.has_replica(p) == (p not in waiting) for p in (1, 2)), step
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["replica"] for e in events if e.get("kind") == "spare_released"] == [1, 2]


@pytest.mark.matrix
def test_an_easgd_spare_joins_the_center_in_a_lost_replicas_place(data_dir: Path,
                                                                  tmp_path: Path) -> None:
    # EASGD runs on Downpour's machinery: the spare pulls the center as its x_i, and its
    # elastic exchanges count as pushes (asynchronous DiLoCo's replicas are the same kind).
    out = tmp_path / "out"
    proc = job(4, data_dir, out, "cluster.spare_replicas=1", 'optimizer.algorithm="averaging"',
               "optimizer.elastic_alpha=0.1", faults=f"kill:2:200 {DELAY}", transport="shared")
    output = proc.stdout + proc.stderr
    assert exit_statuses(proc) == [0, 0, 137, 0], output[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "max_steps" and summary["training_replicas_at_end"] == 2
    [taken] = summary["spares"]
    assert taken["replaced"] == 1 and taken["pushes"] > 0
    assert taken["loss_to_first_push_seconds"] is not None


def test_a_killed_spare_that_took_over_is_replaced_by_the_next(data_dir: Path,
                                                                tmp_path: Path) -> None:
    # 1 shard, replicas 0 and 1 (ranks 1, 2), spares 0 and 1 (ranks 3, 4): replica 1 is
    # killed at its step 150, spare 0 while it takes replica 1's part over: once it has
    # opened the part and computed its first step, before its first push.
    out = tmp_path / "out"
    with SharedMemoryWatch(out) as watch:
        proc = job(5, data_dir, out, "cluster.spare_replicas=2",
                   faults=f"kill:2:150 kill:3:1 {DELAY}", transport="shared")
    output = proc.stdout + proc.stderr
    assert exit_statuses(proc) == [0, 0, 137, 137, 0], output[-3000:]
    assert watch.left() == [], output[-3000:]
    assert "spare replica 0 (rank 3) lost at step" in proc.stdout, output[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "max_steps"
    assert [(t["spare"], t["replaced"], t["lost_group"]) for t in summary["spares"]] == [
        (0, 1, 1), (1, 1, 2)]
    assert summary["spares"][0]["pushes"] is None  # lost: no statistics
    assert summary["spares"][1]["pushes"] > 0
    assert summary["training_replicas_at_end"] == 2


def test_sandblaster_spares_serve_a_lost_replicas_queue_and_refuse_growth() -> None:
    # Sandblaster (docs/sandblaster.md, "Spares"): a spare that took replica 1's units over
    # is granted replica 1's queued units first, as replica 1 was; its spares are not
    # released to grow the job.
    import tomllib

    from helpers.configs import small_config_text

    from distbelief.algorithms.sandblaster.plan import plan_run
    from distbelief.algorithms.sandblaster.replica import decode_answer, encode_answer
    from distbelief.algorithms.sandblaster.work_units import WorkUnitTable
    from distbelief.config import apply_overrides, config_from_dict

    # A partitioned spare's lead shares the takeover with its other partitions.
    assert decode_answer(encode_answer("hold", ("take_over", 1),
                                       np.zeros(8, dtype=np.int64))) == ("hold", ("take_over", 1))
    table = WorkUnitTable(8, push_every=2, owners=[0] * 4 + [1] * 4)
    assert table.next_units(2, 2, owner=1) == [4, 5]
    assert table.next_units(0, 2) == [0, 1]

    def plan(*overrides: str):
        raw = apply_overrides(tomllib.loads(small_config_text()),
                              ['optimizer.algorithm="sandblaster"', *overrides])
        return plan_run(config_from_dict(raw, Path("/cfg/x.toml")), 6, 0, 1000, 100)

    topology = plan("cluster.spare_replicas=2").topology
    assert (topology.num_replicas, topology.spares) == (2, 2)
    with pytest.raises(ConfigError, match="release_spares_at: Sandblaster's spares only"):
        plan("cluster.spare_replicas=1", "cluster.release_spares_at=[10]")
