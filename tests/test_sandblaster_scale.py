"""Sandblaster's control plane as the replicas grow: the trial point goes down a relay
tree over the replicas (the shards' bytes per trial do not grow with R), units are granted
in bulk (one coordinator answer for a push's worth), and the work-unit table answers in
O(1) per unit. Pure pieces in-process; end to end as MPI jobs under timeouts at 2 and 5
replicas on the convex problem of test_sandblaster.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import finished
from helpers.sandblaster import network_for, scipy_optimum, toml, train, training_set, write

from distbelief.algorithms.sandblaster.plan import (
    HEADER,
    RELAY_FANOUT,
    relay_children,
    relay_parent,
)
from distbelief.algorithms.sandblaster.work_units import COMMIT, HOLD, WorkUnitTable

# -- pure pieces -----------------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [1, 2, 3, 7, 1000])
def test_the_relay_tree_reaches_every_replica_once_from_the_first_fanout(replicas: int) -> None:
    parents = [relay_parent(r) for r in range(replicas)]
    assert [r for r, p in enumerate(parents) if p is None] == list(
        range(min(RELAY_FANOUT, replicas)))
    for r in range(replicas):
        assert all(relay_parent(c) == r for c in relay_children(r, replicas))
        assert len(relay_children(r, replicas)) <= RELAY_FANOUT
        assert parents[r] is None or parents[r] < r  # a parent comes first: no cycle
    assert sum(len(relay_children(r, replicas)) for r in range(replicas)) == max(
        0, replicas - RELAY_FANOUT)


def test_units_are_granted_in_bulk_and_backups_one_at_a_time() -> None:
    table = WorkUnitTable(10, push_every=4, backup_copies=2,
                          owners=[0] * 5 + [1] * 5)
    assert table.next_units(0, 4, now=1.0) == [0, 1, 2, 3]
    assert table.next_units(1, 4, now=1.0) == [5, 6, 7, 8]
    assert table.next_units(0, 4, now=1.0) == [4, 9] and table.tail  # its last, then stolen
    assert table.stats.issued == 10 and table.stolen == 1
    assert table.settle(1, [5, 6, 7, 8], now=2.0) == COMMIT
    assert table.next_units(1, 4, now=2.0) == [0]  # one backup copy, the longest out
    assert table.stats.backups_issued == 1
    assert table.settle(0, [0, 1, 2, 3], now=3.0) == COMMIT
    assert table.settle(1, [0], now=3.0) == "drop"
    assert table.settle(0, [4, 9], now=3.0) == COMMIT and table.complete


def test_a_short_grant_is_held_until_a_push_is_worth_it() -> None:
    table = WorkUnitTable(8, push_every=4)
    assert table.next_units(0, 2, now=1.0) == [0, 1]
    assert table.settle(0, [0, 1], now=1.5) == HOLD and not table.tail
    assert table.next_units(0, 2, now=1.5) == [2, 3]
    assert table.settle(0, [0, 1, 2, 3], now=2.0) == COMMIT


def test_a_lost_replica_gives_back_only_what_it_holds_alone() -> None:
    table = WorkUnitTable(6, push_every=2, backup_copies=2)
    assert table.next_units(0, 2, now=0.0) == [0, 1]
    assert table.next_units(1, 2, now=0.0) == [2, 3]
    assert table.next_units(2, 2, now=0.0) == [4, 5]
    assert table.next_units(2, 2, now=5.0) == [0]  # a backup of replica 0's first
    assert table.release(0) == [1] and table.next_units(1, 2, now=5.0) == [1]
    assert table.held[2] == {0, 4, 5}


# -- end to end -----------------------------------------------------------------------------

RUNS = {  # name: (replicas, push_every_units)
    "R2": (2, 4), "R5": (5, 4), "R5-push1": (5, 1)}


@pytest.fixture(scope="module")
def data_dir(synthetic_folder) -> Path:
    return synthetic_folder("sandblaster_scale", n_train=3000)


@pytest.fixture(scope="module")
def runs(data_dir: Path, tmp_path_factory) -> dict[str, dict]:
    """summary.json of each run in RUNS: 1 shard, the coordinator and R replicas on the
    convex problem until it converges (30 units of 100 rows per evaluation)."""
    config = write(data_dir, "scale.toml", toml(gradient_tolerance=1e-5))
    out = {}
    for name, (replicas, push) in RUNS.items():
        folder = tmp_path_factory.mktemp(name)
        proc = train(replicas + 2, config, folder, "run.max_steps=150",
                     f"optimizer.push_every_units={push}")
        out[name] = finished(proc, folder)[0]
    return out


def trials(summary: dict) -> int:
    return summary["gradient_evaluations"] + summary["restarted_evaluations"]


def test_results_are_those_of_the_optimum_at_any_replica_count(data_dir: Path,
                                                             runs: dict) -> None:
    net = network_for(data_dir / "synth.h5", [{"type": "dense", "units": 4,
                                               "activation": "softmax"}])
    optimum = scipy_optimum(net, *training_set(data_dir / "synth.h5"))
    for name, summary in runs.items():
        assert summary["final_loss"] == pytest.approx(optimum, abs=5e-5), name
        assert summary["final_test_accuracy"] > 0.6, name


def test_the_shards_send_each_trial_point_to_at_most_the_fanout(runs: dict) -> None:
    per_trial = {}
    for name, summary in runs.items():
        (shard,) = summary["shards"]
        message = 4 * (HEADER + shard["stop"] - shard["start"])
        assert shard["trial_bytes"] == shard["trial_fetches"] * message
        assert shard["trial_fetches"] <= RELAY_FANOUT * trials(summary), (name, shard)
        per_trial[name] = shard["trial_bytes"] / trials(summary)
    # Five replicas cost the shard no more per trial than two (each root fetches once).
    assert per_trial["R5"] <= per_trial["R2"] * 1.05, per_trial
    # Below the fanout's roots, every trial point came from a relay parent.
    replicas = runs["R5"]["replicas"]
    for entry in replicas:
        assert entry["relay_fallbacks"] == 0, entry
        if relay_parent(entry["replica"]) is not None:
            assert entry["shard_fetches"] == entry["evaluations"], entry  # snapshots only
    assert all(replicas[r]["relayed"] > 0 for r in range(RELAY_FANOUT)), replicas


def test_bulk_grants_cut_the_coordinators_messages_per_unit(runs: dict) -> None:
    per_unit = {name: s["coordinator_traffic"]["replica_messages"] / s["units_issued"]
                for name, s in runs.items()}
    # One request and one answer per unit without bulk grants; per grant of up to
    # push_every (4) with, plus a wake-up, a last commit and a parking request per
    # replica and evaluation whatever the grants (6 units per replica here at R = 5).
    assert per_unit["R5-push1"] >= 1.9, per_unit
    assert per_unit["R5"] < 0.6 * per_unit["R5-push1"], per_unit
    assert per_unit["R2"] < 0.45 * per_unit["R5-push1"], per_unit
