"""How far along its budget a run is (progress lines and `status`, with an ETA), and a run
that collapses says so (distbelief.records.collapse; run.stop_on_collapse)."""

from __future__ import annotations

import io
import json
import math
import re
import sys
import time

import numpy as np
import pytest
from helpers import finished
from helpers.configs import small_config_text
from helpers.mpi_jobs import run_cli, run_mpi, start_in_background, wait_for_training, wait_or_kill

from distbelief.data.arrays import write_dataset
from distbelief.records.collapse import AT_CHANCE, EXPLODED, MIN_LINES, CollapseWatch
from distbelief.records.metrics import (
    TREND_MIN_EVALS,
    RunRecorder,
    budget_fraction,
    budget_text,
    duration_text,
    next_stop,
    target_seconds_left,
)
from distbelief.records.status import describe, run_status
from distbelief.runtime.health import ownership

# -- the budget and the ETA ------------------------------------------------------------------

def test_budget_fraction_is_the_limit_that_comes_first():
    assert budget_fraction(250, 10.0, 1000, 0) == 0.25
    assert budget_fraction(250, 30.0, 1000, 60.0) == 0.5
    assert budget_fraction(2000, 1.0, 1000, 0) == 1.0
    assert budget_fraction(250, 10.0, 0, 0) is None


def test_the_budget_left_is_the_sooner_limit_at_the_step_rate():
    assert next_stop(250, 10.0, 1000, 0, step_rate=25.0) == (30.0, "max_steps")
    assert next_stop(250, 10.0, 1000, 20.0, step_rate=25.0) == (10.0, "max_seconds")
    assert next_stop(250, 10.0, 1000, 0, step_rate=0.0) is None
    assert next_stop(250, 10.0, 0, 0, step_rate=25.0) is None


def test_durations_read_as_a_person_writes_them():
    assert [duration_text(s) for s in (4.4, 65, 3600 + 7 * 60 + 1)] == ["4s", "1m05s", "1h07m"]
    assert budget_text(500, 5.0, 1000, 0, 100.0) == "  50% of budget, ETA 5s (max_steps)"
    assert budget_text(500, 5.0, 1000, 8.0, 100.0) == "  62% of budget, ETA 3s (max_seconds)"
    assert budget_text(500, 5.0, 0, 0, 100.0) == ""


# Evaluations every second for 8 s, 0.40 + 0.1 ln(t): a curve that flattens, as accuracy
# does. It reaches 0.65 at t = e^2.5, 0.70 at t = e^3.
RISING = [(float(t), 0.40 + 0.1 * math.log(t)) for t in range(1, 9)]
TO_65, TO_70 = math.exp(2.5) - 8.0, math.exp(3.0) - 8.0  # seconds left at t = 8


def test_the_target_eta_extrapolates_a_rising_trend():
    assert target_seconds_left(RISING, 0.65, now=8.0) == pytest.approx(TO_65)
    assert target_seconds_left(RISING, 0.70, now=8.5) == pytest.approx(TO_70 - 0.5)
    # Noise of +-0.005 around the same curve, and one evaluation far off: still about there.
    rng = np.random.default_rng(0)
    noisy = [(t, a + rng.uniform(-0.005, 0.005)) for t, a in RISING]
    noisy[5] = (noisy[5][0], 0.90)
    assert target_seconds_left(noisy, 0.70, now=8.0) == pytest.approx(TO_70, rel=0.2)
    # Only the newest TREND_EVALS count: an early steep climb does not make it hopeful.
    early = [(t / 10, t / 10) for t in range(1, 5)]  # +1.0 a second, t = 0.1..0.4
    assert target_seconds_left(early + RISING, 0.70, now=8.0) == pytest.approx(TO_70)


def test_no_target_eta_without_a_rising_trend():
    rng = np.random.default_rng(1)
    flat = [(float(t), 0.70 + rng.normal(0, 0.01)) for t in range(1, 9)]
    falling = [(t, 1.0 - a) for t, a in RISING]
    assert target_seconds_left(flat, 0.88, now=8.0) is None  # noise around a level
    assert target_seconds_left(falling, 0.88, now=8.0) is None
    assert target_seconds_left(RISING[:TREND_MIN_EVALS - 1], 0.88, now=3.0) is None
    assert target_seconds_left(RISING, 0.55, now=8.0) is None  # reached: it stops now
    assert target_seconds_left(RISING, 5.0, now=8.0) is None  # decades away: no forecast
    assert target_seconds_left([*RISING[:-1], (8.0, math.nan)], 0.65, now=8.0) \
        == pytest.approx(TO_65)  # a NaN evaluation is left out


def test_the_eta_is_to_the_stop_rule_that_comes_first():
    # The target at 0.65 comes in 4 s, before run.max_seconds = 300 (292 s left).
    found = next_stop(400, 8.0, 0, 300.0, 50.0, 0.65, RISING)
    assert found[0] == pytest.approx(TO_65) and found[1] == "target 0.65 at the current trend"
    # 0.70 in 12 s, but max_steps = 600 comes in 4 s at 50 steps a second.
    assert next_stop(400, 8.0, 600, 300.0, 50.0, 0.70, RISING) == (4.0, "max_steps")
    # Not rising: back to the budget, and nothing at all without one.
    flat = [(t, 0.7) for t, _ in RISING]
    assert next_stop(400, 8.0, 0, 300.0, 50.0, 0.88, flat) == (292.0, "max_seconds")
    assert next_stop(400, 8.0, 0, 0.0, 50.0, 0.88, flat) is None
    assert budget_text(400, 8.0, 0, 0.0, 50.0, 0.70, RISING) == \
        f"  ETA {duration_text(TO_70)} (target 0.7 at the current trend)"


def test_progress_lines_show_the_budget_and_eta(tmp_path):
    stream = io.StringIO()
    recorder = RunRecorder(tmp_path, progress_every_seconds=0.0, stream=stream,
                           max_steps=1000, start=time.monotonic() - 10.0)
    recorder.progress(250, 250 * 32, 0.5)
    line = stream.getvalue().strip()
    # 250 steps in about 10 s: 750 to go at ~25 steps/s, about 30 s.
    found = re.search(r"(\d+)% of budget, ETA (\d+)s \(max_steps\)$", line)
    assert found, line
    assert int(found[1]) == 25 and 25 <= int(found[2]) <= 31
    assert " samples/s (all replicas) " in line, line


def test_progress_lines_count_down_to_a_target_that_comes_first(tmp_path):
    stream = io.StringIO()
    recorder = RunRecorder(tmp_path, progress_every_seconds=0.0, stream=stream,
                           max_seconds=300.0, target_accuracy=0.7,
                           start=time.monotonic() - 8.0)
    for t, accuracy in RISING:  # evaluations logged t seconds into the run
        recorder.start = time.monotonic() - t
        recorder.log_eval(int(t * 50), int(t * 1600), 0.5, {"loss": 0.4, "accuracy": accuracy})
    recorder.start = time.monotonic() - 8.0
    recorder.progress(400, 400 * 32, 0.5)
    # 0.7 at the trend: about 12 s from now; max_seconds: 292 s.
    found = re.search(r"\d+% of budget, ETA (\d+)s \(target 0.7 at the current trend\)$",
                      stream.getvalue().strip())
    assert found and abs(int(found[1]) - TO_70) <= 1, stream.getvalue()


# -- collapse --------------------------------------------------------------------------------

def _feed(watch: CollapseWatch, losses, every: float = 0.5):
    found = []
    for i, loss in enumerate(losses):
        hit = watch.add(i * every, i, loss)
        if hit is not None:
            found.append(hit)
    return found


def test_a_loss_at_chance_for_a_window_is_a_collapse_once():
    watch = CollapseWatch(num_classes=10, window_seconds=5.0)
    found = _feed(watch, [math.log(10) + 0.01] * 40)
    assert len(found) == 1 and found[0].kind == "at chance"
    assert found[0].time == pytest.approx(5.0)  # as soon as one window is full
    assert "learning rate" in found[0].describe()


def test_a_learning_run_is_not_a_collapse():
    watch = CollapseWatch(num_classes=10, window_seconds=5.0)
    losses = [2.3 * math.exp(-i / 10) + 0.2 for i in range(60)]
    assert _feed(watch, losses) == [] and watch.summary() is None


def test_a_loss_that_starts_at_chance_is_judged_only_after_a_window():
    watch = CollapseWatch(num_classes=4, window_seconds=5.0)
    # At chance for 4 s, then learning: never a full window at chance.
    losses = [math.log(4)] * 8 + [AT_CHANCE * math.log(4) * 0.8] * 30
    assert _feed(watch, losses) == []


def test_a_non_finite_loss_is_a_collapse_at_once_and_recovery_is_noted():
    watch = CollapseWatch(num_classes=10, window_seconds=2.0)
    assert [c.kind for c in _feed(watch, [1.0, float("nan")])] == ["non-finite"]
    watch = CollapseWatch(num_classes=10, window_seconds=2.0)
    _feed(watch, [2.4] * 10 + [0.5] * 10)
    summary = watch.summary()
    assert summary["kind"] == "at chance" and summary["recovered_at"] is not None


def test_a_finite_explosion_is_reported_at_once_not_after_the_window():
    """The issue's speech run: 9.06 at the start, then 41-77 (chance 9.01 for 8192 classes),
    with a 300 s window. Reported on the fifth line, as an explosion."""
    watch = CollapseWatch(num_classes=8192, window_seconds=300.0)
    losses = [9.06, 9.09, 54.4, 41.0, 77.0, 60.0, 45.0] + [50.0] * 20
    found = _feed(watch, losses)
    assert [c.kind for c in found] == ["exploded"]
    assert found[0].step == MIN_LINES - 1  # lines 0-4 average 38.1, over 2 x 9.01
    assert found[0].time < 5.0 and found[0].loss >= EXPLODED * math.log(8192)
    assert "exploded" in found[0].describe()
    # It recovers when the recent lines fall below chance again.
    _feed_more = [watch.add(100.0 + i, 100 + i, 3.0) for i in range(MIN_LINES)]
    assert not any(_feed_more) and watch.summary()["recovered_at"] is not None


def test_a_high_first_loss_that_falls_is_no_explosion():
    """A badly scaled start (30 against chance 2.3) that learns is not an explosion: the
    bar is twice the larger of chance and the first loss."""
    watch = CollapseWatch(num_classes=10, window_seconds=60.0)
    losses = [30.0, 28.0, 20.0, 12.0, 6.0] + [2.0 * math.exp(-i / 10) + 0.2 for i in range(40)]
    assert _feed(watch, losses) == []
    # Twice chance, held, from a start at chance is one.
    watch = CollapseWatch(num_classes=10, window_seconds=60.0)
    assert [c.kind for c in _feed(watch, [2.3] + [EXPLODED * 2.31] * MIN_LINES)] == ["exploded"]


def _random_labels(folder, n=3000, features=16, classes=4):
    """A data set whose labels carry no signal: no model can leave chance on it."""
    rng = np.random.default_rng(1)
    write_dataset(folder / "noise.h5", rng.normal(size=(n, features)).astype(np.float32),
                  rng.integers(0, classes, n), test_fraction=0.1)


def test_sgd_on_noise_reports_a_collapse_and_can_stop_on_it(tmp_path):
    _random_labels(tmp_path)
    (tmp_path / "c.toml").write_text(small_config_text(
        None, data={"path": "noise.h5"}, optimizer={"algorithm": "sgd"}, cluster=None,
        run={"max_steps": None, "max_seconds": 8, "collapse_window_seconds": 3}))
    out = tmp_path / "runs" / "c"
    proc = run_cli(["train", tmp_path / "c.toml"], cwd=tmp_path)
    summary, _ = finished(proc, out)  # reported, not stopped: exit 0, the whole budget
    assert summary["stop_reason"] == "max_seconds"
    assert summary["collapse"]["kind"] == "at chance"
    assert proc.stdout.count("warning: the run collapsed") == 1
    assert "[collapsed: at chance]" in proc.stdout
    stopped = run_cli(["train", tmp_path / "c.toml", "--fresh", "--set",
                       "run.stop_on_collapse=true"], cwd=tmp_path)
    assert stopped.returncode == 4, stopped.stdout + stopped.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "collapse" and summary["wall_seconds"] < 6


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.matrix
def test_downpour_stops_on_a_collapse_on_every_rank(tmp_path, n):
    _random_labels(tmp_path)
    (tmp_path / "c.toml").write_text(small_config_text(
        None, data={"path": "noise.h5"},
        run={"max_steps": None, "max_seconds": 30, "collapse_window_seconds": 3,
             "stop_on_collapse": True}))
    proc = run_mpi(n, ["-m", "distbelief", "train", tmp_path / "c.toml"], cwd=tmp_path,
                   timeout=120)
    assert proc.returncode != 0, proc.stdout
    summary = json.loads((tmp_path / "runs" / "c" / "summary.json").read_text())
    assert summary["stop_reason"] == "collapse"
    assert summary["collapse"]["kind"] == "at chance" and summary["wall_seconds"] < 20
    assert "stopped (collapse)" in proc.stdout


# -- status ----------------------------------------------------------------------------------

def test_status_counts_down_to_the_target_at_the_trend(tmp_path):
    """`status` on a live run (faked in process: this process owns the folder) whose
    evaluations rise toward its target: the ETA is the target's, named; without a budget
    too."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "owner.json").write_text(json.dumps(ownership.this_process()))
    lines = [{"kind": kind, "time": t, "step": int(50 * t), "samples": int(1600 * t),
              "loss": 0.5, **({"val_accuracy": a, "val_loss": 0.4} if kind == "eval" else {})}
             for t, a in RISING for kind in ("train", "eval")]
    (out / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    for run, spent in [({"max_seconds": 300, "target_accuracy": 0.7},
                        "3% of run.max_seconds = 300"),
                       ({"target_accuracy": 0.7}, "no run.max_steps or run.max_seconds")]:
        (out / "config.json").write_text(json.dumps({"run": run}))
        state = run_status(out)
        assert state["budget"]["eta_rule"] == "target 0.7 at the current trend", state
        assert state["budget"]["seconds_left"] == pytest.approx(TO_70)
        assert f"  budget:            {spent}; ETA {duration_text(TO_70)} (target 0.7 at " \
               f"the current trend)" in describe(state).splitlines(), describe(state)


def test_status_counts_down_to_a_loss_target_as_the_loss_falls(tmp_path):
    """A falling metric's target (run.target_loss): the trend is the loss's, negated."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "owner.json").write_text(json.dumps(ownership.this_process()))
    lines = [{"kind": kind, "time": t, "step": int(50 * t), "samples": int(1600 * t),
              "loss": 0.5, **({"val_r2": 0.9, "val_loss": 1.0 - a} if kind == "eval" else {})}
             for t, a in RISING for kind in ("train", "eval")]
    (out / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (out / "config.json").write_text(json.dumps({"run": {"target_loss": 0.3}}))
    state = run_status(out)
    assert state["budget"]["eta_rule"] == "target loss 0.3 at the current trend", state
    assert state["budget"]["seconds_left"] == pytest.approx(TO_70)
    assert "last evaluation:   validation r2 0.9000" in describe(state)


def test_status_of_a_live_run_shows_its_budget_and_eta(synthetic_folder):
    config = small_config_text(32, optimizer={"algorithm": "sgd"}, cluster=None,
                               run={"max_steps": None, "max_seconds": 25})
    folder = synthetic_folder("statuseta", {"c.toml": config})
    out = folder / "runs" / "c"
    log = folder / "log.txt"
    proc = start_in_background([sys.executable, "-m", "distbelief", "train",
                                folder / "c.toml", "--set", f"run.out_dir={str(out)!r}"], log)
    try:
        wait_for_training(proc, out, log)
        time.sleep(2.0)
        state = json.loads(run_cli(["status", out, "--json"]).stdout)
        text = run_cli(["status", out]).stdout
    finally:
        proc.terminate()
        wait_or_kill(proc)
    budget = state["budget"]
    assert budget["max_seconds"] == 25 and 0 < budget["fraction"] < 1
    assert 0 < budget["seconds_left"] <= 25
    assert re.search(r"budget: +\d+% of run.max_seconds = 25; ETA \d+s \(max_seconds\)",
                     text), text
    assert budget["eta_rule"] == "max_seconds"
