"""TensorBoard events (records.tensorboard), read back with TensorBoard's own reader: every
metrics line's numbers at its step, the summary, a resume that purges what the killed run
wrote after its checkpoint, and the final test line. In-process single-process runs; the
Downpour per-replica figures are checked on test_downpour.py's timed run."""

from __future__ import annotations

import io
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.configs import small_config_text
from tensorboard.backend.event_processing.event_accumulator import (
    HISTOGRAMS,
    SCALARS,
    EventAccumulator,
)

from distbelief.algorithms import sgd
from distbelief.algorithms.common import archive_previous_run, final_test
from distbelief.config import apply_overrides, config_from_dict
from distbelief.records import checkpoint as ckpt
from distbelief.records.metrics import RunRecorder, read_metrics
from distbelief.records.tensorboard import TENSORBOARD_DIR, TensorBoardEvents, open_events

TOML = small_config_text(
    24, 3, data={"batch_size": 16, "validation": 0.2}, optimizer={"algorithm": None},
    cluster=None, run={"eval_every_seconds": 0.02, "progress_every_seconds": 10.0,
                       "checkpoint_every_steps": 200, "tensorboard": True})


@pytest.fixture(scope="module")
def data_dir(synthetic_folder) -> Path:
    return synthetic_folder("tensorboard", n_train=500, n_test=100, input_shape=(10,),
                            num_classes=3, seed=5)


def train(data_dir: Path, out: Path, *overrides: str) -> dict:
    """An in-process run, and its test set evaluated at the end (as `train` does)."""
    import tomllib

    raw = apply_overrides(tomllib.loads(TOML), [f'run.out_dir="{out}"', *overrides])
    config = config_from_dict(raw, data_dir / "exp.toml")
    return final_test(config, sgd.train(config, stream=None), None)


def read_events(logdir: Path) -> EventAccumulator:
    """Every event of `logdir`, as TensorBoard reads them (no sampling)."""
    events = EventAccumulator(str(logdir), size_guidance={SCALARS: 0, HISTOGRAMS: 0})
    events.Reload()
    return events


def scalars(events: EventAccumulator, tag: str) -> tuple[list[int], np.ndarray]:
    found = events.Scalars(tag)
    return [e.step for e in found], np.array([e.value for e in found], dtype=np.float32)


def assert_matches(events: EventAccumulator, lines: list[dict], tag: str, key: str) -> None:
    """Tag `tag` holds `key` of `lines`: the same steps, the values to float32."""
    steps, values = scalars(events, tag)
    assert steps == [x["step"] for x in lines]
    expected = np.array([math.nan if x[key] is None else x[key] for x in lines], np.float32)
    np.testing.assert_array_equal(values, expected)


@pytest.fixture(scope="module")
def resumed_run(data_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """600 steps, checkpoints every 200; the newest removed, as if killed after step 400's
    checkpoint; resumed to 800 steps. Training lines every 10 ms, so each part has many."""
    out = tmp_path_factory.mktemp("tb") / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sgd, "LOG_EVERY_SECONDS", 0.01)
        train(data_dir, out, "run.max_steps=600")
        killed = read_metrics(out / "metrics.jsonl")
        shutil.rmtree(out / "checkpoints" / ckpt.checkpoint_name(600))
        summary = train(data_dir, out, "run.max_steps=800")
    return out, killed, summary, read_metrics(out / "metrics.jsonl")


def test_every_metrics_line_is_in_the_events(resumed_run) -> None:
    out, _, _, lines = resumed_run
    events = read_events(out / TENSORBOARD_DIR)
    train_lines = [x for x in lines if x["kind"] == "train"]
    eval_lines = [x for x in lines if x["kind"] == "eval"]
    # Lines come every 10 ms, so how many depends on the machine's speed (9 in a CI run
    # on a quiet machine): enough to compare, not a count.
    assert len(train_lines) >= 3 and len(eval_lines) >= 2
    assert_matches(events, train_lines, "train/loss", "loss")
    assert_matches(events, train_lines, "train/samples", "samples")
    assert_matches(events, train_lines, "train/learning_rate", "learning_rate")
    # The run evaluates its validation split: val_ keys.
    assert_matches(events, eval_lines, "eval/val_accuracy", "val_accuracy")
    assert_matches(events, eval_lines, "eval/val_loss", "val_loss")
    assert "eval/loss" not in events.Tags()[SCALARS]  # the training loss: train/loss has it


def test_samples_per_second_is_the_rate_between_training_lines(resumed_run) -> None:
    out, _, _, lines = resumed_run
    steps, rates = scalars(read_events(out / TENSORBOARD_DIR), "train/samples_per_second")
    train_lines = [x for x in lines if x["kind"] == "train"]
    by_step = {x["step"]: x for x in train_lines}
    # Every training line but the first of each part (the resumed one starts a new writer)
    assert len(steps) == len(train_lines) - 2
    for step, rate in zip(steps, rates):
        line = by_step[step]
        before = train_lines[train_lines.index(line) - 1]
        expected = (line["samples"] - before["samples"]) / (line["time"] - before["time"])
        assert rate == pytest.approx(expected, rel=1e-6)


def test_a_resume_drops_the_events_after_its_checkpoint(resumed_run) -> None:
    out, killed, summary, lines = resumed_run
    assert summary["resumed_from"].endswith(ckpt.checkpoint_name(400))
    # The killed run logged steps after 400 that the resumed run trained again.
    assert [x for x in killed if x["kind"] == "train" and 400 < x["step"]]
    assert len(list((out / TENSORBOARD_DIR).glob("events.out.tfevents.*"))) >= 2
    events = read_events(out / TENSORBOARD_DIR)
    steps, _ = scalars(events, "train/loss")
    assert steps == sorted(set(steps))  # no step twice, none of the killed run's after 400
    assert steps == [x["step"] for x in lines if x["kind"] == "train"]
    # The summary: the resumed run's, at its last step (the first run's, at 600, dropped).
    summary_steps, values = scalars(events, "summary/steps")
    assert summary_steps == [800] and values.tolist() == [800]
    _, wall = scalars(events, "summary/wall_seconds")
    assert wall == pytest.approx([summary["wall_seconds"]])


def test_the_final_test_line_is_in_the_events(resumed_run) -> None:
    out, _, summary, lines = resumed_run
    (test_line,) = [x for x in lines if x["kind"] == "test"][-1:]
    events = read_events(out / TENSORBOARD_DIR)
    steps, accuracy = scalars(events, "test/test_accuracy")
    # The test set scores the best model (run.keep_best), so its line is at the best's step.
    assert steps[-1] == test_line["step"] == summary["test_step"] == summary["best"]["step"]
    assert accuracy[-1] == np.float32(summary["final_test_accuracy"])


def test_fresh_moves_the_events_aside(tmp_path: Path) -> None:
    with RunRecorder(tmp_path, stream=None, tensorboard=True) as recorder:
        recorder.log(10, 160, 1.5)
    moved = archive_previous_run(tmp_path)
    assert moved is not None and not (tmp_path / TENSORBOARD_DIR).exists()
    steps, values = scalars(read_events(moved / TENSORBOARD_DIR), "train/loss")
    assert steps == [10] and values.tolist() == [1.5]


def test_a_new_run_hides_events_left_in_the_folder(tmp_path: Path) -> None:
    with RunRecorder(tmp_path, stream=None, tensorboard=True) as recorder:
        recorder.log(50, 800, 2.0)
    with RunRecorder(tmp_path, stream=None, tensorboard=True) as recorder:
        recorder.log(5, 80, 1.0)
    assert scalars(read_events(tmp_path / TENSORBOARD_DIR), "train/loss")[0] == [5]


def test_tensorboard_false_writes_nothing_and_missing_writer_says_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with RunRecorder(tmp_path, stream=None, tensorboard=False) as recorder:
        recorder.log(1, 16, 1.0)
    assert not (tmp_path / TENSORBOARD_DIR).exists()
    monkeypatch.setattr("distbelief.records.tensorboard.writer_installed", lambda: False)
    stream = io.StringIO()
    assert open_events(tmp_path, None, None, stream) is None
    assert stream.getvalue() == ""  # unset: events only when the writer is there
    assert open_events(tmp_path, True, None, stream) is None
    assert stream.getvalue() == ("distbelief: run.tensorboard = true, but tensorboardX is "
                                 "not installed (pip install 'distbelief[tensorboard]'): no "
                                 "TensorBoard events, metrics.jsonl has every figure\n")
    assert not (tmp_path / TENSORBOARD_DIR).exists()


def test_replica_figures_and_staleness_histogram(tmp_path: Path) -> None:
    """A Downpour-like summary (two replicas) as events: throughput and staleness per
    replica, and the histograms, whose counts are the summary's."""
    replicas = [{"replica": r, "rank": r + 1, "steps": 100 + r, "samples": 1600 + 16 * r,
                 "samples_per_second": 900.0 + r,
                 "staleness": {"samples": 100, "mean": 0.5 + r, "max": 2 + r,
                               "histogram": [50, 40, 10] if r == 0 else [0, 50, 40, 10]}}
                for r in range(2)]
    events = TensorBoardEvents(tmp_path)
    events.summary({"steps": 201, "samples_per_second": 1800.0, "reached_target": True,
                    "staleness": {"mean": 1.0, "max": 3, "histogram": [50, 90, 50, 10]},
                    "replicas": replicas})
    events.close()
    read = read_events(tmp_path)
    for r in range(2):
        assert scalars(read, f"replica/{r}/samples_per_second")[1].tolist() == [900.0 + r]
        assert scalars(read, f"replica/{r}/staleness_max")[1].tolist() == [2 + r]
        (histogram,) = read.Histograms(f"replica/{r}/staleness")
        assert histogram.step == 201
        assert list(histogram.histogram_value.bucket) == replicas[r]["staleness"]["histogram"]
    assert "summary/reached_target" not in read.Tags()[SCALARS]  # a bool is no figure
    (combined,) = read.Histograms("staleness")
    assert combined.histogram_value.num == 200 and combined.histogram_value.max == 3


def test_the_events_writer_does_not_import_torch(tmp_path: Path) -> None:
    # tensorboardX imports torch when it can; with torch installed that cost the metrics
    # rank about 250 MB and seconds of start-up. A stand-in torch on the path says whether
    # anything imported it; a process that already has torch keeps it.
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "import sys\nsys.stderr.write('torch imported\\n')\nTensor = object\n")
    code = ("import sys\nfrom distbelief.records.tensorboard import TensorBoardEvents\n"
            f"events = TensorBoardEvents({str(tmp_path / 'tb')!r})\nevents.close()\n"
            "print('torch' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(fake.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=60, check=True)
    assert done.stdout.strip() == "False" and "torch imported" not in done.stderr
    first = subprocess.run([sys.executable, "-c", "import torch\n" + code],
                           capture_output=True, text=True, env=env, timeout=60, check=True)
    assert first.stdout.strip() == "True"  # imported before: left as it is
