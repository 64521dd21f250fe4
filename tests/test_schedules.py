"""Learning-rate warmup and schedules in training runs: the rate each algorithm steps with
follows the configured schedule (metrics.jsonl's `learning_rate`), and a run stopped
half-way and resumed steps at the same rates as an unbroken one (single-process sgd, and
Downpour, whose shards continue their gradient count from the checkpoint)."""

from __future__ import annotations

import io
import json
import tomllib
from pathlib import Path

import numpy as np
import pytest
from helpers import exit_statuses, set_args
from helpers.configs import small_config_text
from helpers.mpi_jobs import REPO, job_env, run_mpi

from distbelief.config import apply_overrides, build_schedule, config_from_dict
from distbelief.records import checkpoint as ckpt
from distbelief.records.metrics import read_metrics

PROGRAMS = REPO / "tests" / "mpi_programs"
TIMEOUT = 120

# A warmup, then a cosine decay to a floor, over 200 updates: a run of 200 steps stopped at
# 100 is mid-decay, where a count that restarted would step at other rates.
SCHEDULE = ["optimizer.warmup_steps=50", 'optimizer.schedule="cosine"',
            "optimizer.decay_steps=100", "optimizer.min_learning_rate=0.005"]
SGD_TOML = small_config_text(
    24, 3, data={"batch_size": 16},
    optimizer={"algorithm": None, "learning_rate": 0.05},
    cluster=None,
    run={"max_steps": 200, "eval_every_seconds": 0.05, "progress_every_seconds": 0.05})


@pytest.fixture(scope="module")
def sgd_dir(synthetic_folder) -> Path:
    return synthetic_folder("schedule_sgd", {"exp.toml": SGD_TOML}, n_train=500, n_test=100,
                            input_shape=(10,), num_classes=3, seed=5)


def sgd_config(folder: Path, out: Path, *overrides: str):
    raw = apply_overrides(tomllib.loads(SGD_TOML), [f'run.out_dir="{out}"', *overrides])
    return config_from_dict(raw, folder / "exp.toml")


def train_sgd(folder: Path, out: Path, *overrides: str) -> dict:
    from distbelief.algorithms.sgd import train

    return train(sgd_config(folder, out, *overrides), stream=io.StringIO())


def newest(out: Path) -> ckpt.Checkpoint:
    found, damaged = ckpt.find_latest(ckpt.checkpoint_root(out))
    assert found is not None and damaged == []
    return found


def train_lines(out: Path) -> list[dict]:
    return [x for x in read_metrics(out / "metrics.jsonl") if x["kind"] == "train"]


def test_sgd_steps_on_the_schedule_and_a_resume_continues_it_bit_for_bit(
        sgd_dir: Path, tmp_path: Path) -> None:
    schedule = build_schedule(sgd_config(sgd_dir, tmp_path, *SCHEDULE))
    straight, halves, constant = tmp_path / "straight", tmp_path / "halves", tmp_path / "c"
    assert train_sgd(sgd_dir, straight, *SCHEDULE)["steps"] == 200
    assert train_sgd(sgd_dir, halves, *SCHEDULE, "run.max_steps=100")["steps"] == 100
    assert train_sgd(sgd_dir, halves, *SCHEDULE)["resumed_from"].endswith(
        ckpt.checkpoint_name(100))
    train_sgd(sgd_dir, constant)
    # Every training line names the rate of the last update before it.
    for out in (straight, halves):
        lines = train_lines(out)
        assert lines and all(x["learning_rate"] == schedule(x["step"] - 1) for x in lines)
        assert lines[-1]["step"] == 200 and lines[-1]["learning_rate"] == 0.005
    assert [x["learning_rate"] for x in train_lines(halves) if x["step"] == 100] == [
        pytest.approx(0.005 + 0.045 * 0.5 * (1 + np.cos(np.pi * 49 / 100)), rel=1e-12)]
    assert {x["learning_rate"] for x in train_lines(constant)} == {0.05}
    # The resumed run computed exactly what the unbroken one did; the schedule mattered.
    a, b, c = (newest(out).read_state() for out in (straight, halves, constant))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1]["accum"], b[1]["accum"])
    assert not np.array_equal(a[0], c[0])


# -- MPI runs -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mpi_dir(synthetic_folder, small_config) -> Path:
    return synthetic_folder("schedule_mpi", {"synth.toml": small_config()})


def train_mpi(n: int, folder: Path, out: Path, *overrides: str,
              transport: str | None = None) -> dict:
    """summary.json of `distbelief train` on n ranks, every rank exiting 0."""
    env = job_env()
    if transport is not None:
        env["DISTBELIEF_PS_TRANSPORT"] = transport
    proc = run_mpi(n, [PROGRAMS / "cli_exit_status.py", "train", folder / "synth.toml",
                       *set_args(f'run.out_dir="{out}"', *overrides)],
                   timeout=TIMEOUT, env=env)
    assert exit_statuses(proc) == [0] * n, f"{proc.stdout}\n{proc.stderr[-3000:]}"
    return json.loads((out / "summary.json").read_text())


# Downpour counts each shard's applied gradients: 1 replica pushing every step gives one
# per step, so 300 steps stopped at 150 are mid-decay.
DOWNPOUR_SCHEDULE = ["optimizer.warmup_steps=60", 'optimizer.schedule="cosine"',
                     "optimizer.decay_steps=200", "optimizer.min_learning_rate=0.005"]


@pytest.mark.parametrize("first, second, transport", [
    (1, 1, "shared"),
    (1, 1, "rma"),
    (1, 2, "shared"),  # re-sharded: each new shard continues its parts' count
], ids=["shared", "rma", "1-to-2-shards"])
@pytest.mark.matrix
def test_downpour_resumed_continues_the_shards_schedule_exactly(
        mpi_dir: Path, tmp_path: Path, first: int, second: int, transport: str) -> None:
    # One replica that reads its own pushes is sequential SGD on the shards, so the
    # resumed run must compute what the unbroken one did: only if every shard's
    # schedule continues from its count at the checkpoint.
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    common = [*DOWNPOUR_SCHEDULE, "run.checkpoint_every_seconds=0"]
    train_mpi(first + 1, mpi_dir, straight, *common, f"cluster.ps_shards={first}",
              "run.max_steps=300", transport=transport)
    train_mpi(first + 1, mpi_dir, halves, *common, f"cluster.ps_shards={first}",
              "run.max_steps=150", transport=transport)
    counters = [c["gradients_applied"] for c in newest(halves).shard_counters(0, 1 << 40)]
    assert counters == [150] * first
    summary = train_mpi(second + 1, mpi_dir, halves, *common, f"cluster.ps_shards={second}",
                        "run.max_steps=300", transport=transport)
    assert summary["steps"] == 300 and summary["resumed_at_step"] == 150
    a, b = newest(straight), newest(halves)
    assert a.step == b.step == 300
    (params_a, state_a), (params_b, state_b) = a.read_state(), b.read_state()
    assert np.array_equal(params_a, params_b)
    assert np.array_equal(state_a["accum"], state_b["accum"])
    assert [c["gradients_applied"] for c in b.shard_counters(0, 1 << 40)] == [300] * second
    # The last line after the decay, at the floor, in both.
    for out in (straight, halves):
        assert train_lines(out)[-1]["learning_rate"] == 0.005


STEP_SCHEDULE = ["optimizer.learning_rate=0.05", "optimizer.warmup_steps=5",
                 'optimizer.schedule="step"', "optimizer.decay_steps=10",
                 "optimizer.decay_rate=0.5", "optimizer.min_learning_rate=0.01"]
"""After 35 updates the rate is at its floor, 0.01 (0.05 / 8 would be below it)."""


@pytest.mark.parametrize("algorithm, n, overrides", [
    ("downpour", 3, ["cluster.ps_shards=1"]),
    ("sync", 2, ["cluster.ps_shards=0"]),
    ("sync", 3, ["cluster.ps_shards=1", "optimizer.backup_workers=1"]),
    ("averaging", 2, ["cluster.ps_shards=0", "optimizer.average_every=5"]),
    ("hogwild", 2, ["cluster.ps_shards=0"]),
    ("sgd", 2, ["cluster.partitions=2"]),  # model parallel: one replica over 2 ranks
])
def test_every_algorithm_with_a_rate_steps_on_the_schedule(
        mpi_dir: Path, tmp_path: Path, algorithm: str, n: int, overrides: list) -> None:
    out = tmp_path / "out"
    schedule = build_schedule(config_from_dict(
        apply_overrides(tomllib.loads(small_config_text()), STEP_SCHEDULE),
        mpi_dir / "synth.toml"))
    summary = train_mpi(n, mpi_dir, out, f'optimizer.algorithm="{algorithm}"',
                        *overrides, *STEP_SCHEDULE, "run.max_steps=300")
    assert summary["steps"] >= 300
    rates = [x["learning_rate"] for x in train_lines(out)]
    assert rates and rates[-1] == 0.01  # at the floor by the end
    assert all(r in {schedule(t) for t in range(40)} for r in rates)
    # It learned (4 classes: chance is 0.25).
    assert summary["final_test_accuracy"] > 0.5


def test_easgd_replicas_step_on_the_schedule(mpi_dir: Path, tmp_path: Path) -> None:
    # The center on the shards takes the elastic differences as they are (no rate), so
    # shard 0 logs no learning_rate; each replica's local optimizer follows the schedule
    # over its local steps (a step without its count would raise: the run would fail).
    out = tmp_path / "out"
    summary = train_mpi(3, mpi_dir, out, 'optimizer.algorithm="averaging"',
                        "optimizer.elastic_alpha=0.3", "optimizer.average_every=5",
                        "cluster.ps_shards=1", *STEP_SCHEDULE, "run.max_steps=300")
    assert summary["final_test_accuracy"] > 0.5
    assert train_lines(out) and all("learning_rate" not in x for x in train_lines(out))


def test_a_checkpoint_of_another_schedule_is_refused_naming_the_change(
        sgd_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    train_sgd(sgd_dir, out, *SCHEDULE, "run.max_steps=20")
    with pytest.raises(ckpt.CheckpointMismatch, match=r"optimizer\.warmup_steps: 50 -> 80"):
        train_sgd(sgd_dir, out, *SCHEDULE, "optimizer.warmup_steps=80")
    with pytest.raises(ckpt.CheckpointMismatch, match=r'optimizer\.schedule: "cosine" -> null'):
        train_sgd(sgd_dir, out, "optimizer.warmup_steps=50")


# -- SGD with momentum and Adam in runs ------------------------------------------

@pytest.mark.parametrize("update", ["momentum", "adam"])
def test_sgd_resumed_is_bit_identical(sgd_dir, tmp_path, update):
    rule = [f'optimizer.update="{update}"', "optimizer.learning_rate=0.01"]
    straight = train_sgd(sgd_dir, tmp_path / "a", *rule)
    train_sgd(sgd_dir, tmp_path / "b", *rule, "run.max_steps=90")
    resumed = train_sgd(sgd_dir, tmp_path / "b", *rule)
    assert straight["steps"] == resumed["steps"] == 200
    (pa, sa), (pb, sb) = newest(tmp_path / "a").read_state(), newest(tmp_path / "b").read_state()
    assert np.array_equal(pa, pb) and sa.keys() == sb.keys() and sa
    assert all(np.array_equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("update, transport", [("adam", "rma"), ("momentum", "shared")])
@pytest.mark.matrix
def test_downpour_shards_resume_adam_and_momentum_exactly(mpi_dir, tmp_path, update,
                                                          transport):
    rule = [f'optimizer.update="{update}"', "optimizer.learning_rate=0.01",
            "run.checkpoint_every_seconds=0", "cluster.ps_shards=2"]
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    train_mpi(3, mpi_dir, straight, *rule, "run.max_steps=300", transport=transport)
    train_mpi(3, mpi_dir, halves, *rule, "run.max_steps=150", transport=transport)
    summary = train_mpi(3, mpi_dir, halves, *rule, "run.max_steps=300", transport=transport)
    assert summary["final_test_accuracy"] > 0.5
    (pa, sa), (pb, sb) = newest(straight).read_state(), newest(halves).read_state()
    assert np.array_equal(pa, pb) and sa.keys() == sb.keys() and sa
    assert all(np.array_equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("algorithm, n, overrides", [
    ("sync", 3, ["cluster.ps_shards=1", "optimizer.backup_workers=1"]),
    ("averaging", 2, ["cluster.ps_shards=0", "optimizer.average_every=5"]),
    ("hogwild", 2, ["cluster.ps_shards=0"]),
    ("averaging", 3, ["cluster.ps_shards=1", "optimizer.elastic_alpha=0.5"]),
])
def test_every_algorithm_trains_with_adam(mpi_dir, tmp_path, algorithm, n, overrides):
    summary = train_mpi(n, mpi_dir, tmp_path / "out", f'optimizer.algorithm="{algorithm}"',
                        *overrides, 'optimizer.update="adam"', "optimizer.learning_rate=0.003",
                        "run.max_steps=600")
    assert summary["final_test_accuracy"] > 0.5
