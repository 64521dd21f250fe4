"""TensorBoard events of a run: out_dir/tensorboard/, written beside metrics.jsonl.

RunRecorder feeds every metrics line here (so every trainer writes events, on the rank
that writes metrics.jsonl) and the summary at the end; `tensorboard --logdir runs/` shows
them. metrics.jsonl stays the record: the events are a view of the same numbers.

    tags                        from
    train/loss, train/<key>     each training line's numbers (learning_rate, version, ...)
    train/samples_per_second    samples between two training lines over their time apart
                                (the total over replicas)
    eval/<key>                  evaluation lines (test_accuracy, test_loss or val_...)
    test/<key>, <kind>/<key>    the final test line and marker lines' numbers
    summary/<key>               summary.json's numbers, at the last step
    replica/<r>/<key>           each replica's samples_per_second, steps and staleness
                                mean and max (Downpour's summary), at the last step
    staleness, replica/<r>/staleness   the staleness histograms, at the last step

Each line is one event (its numbers as one Summary). The writer is tensorboardX's
FileWriter: the training thread builds a small protobuf and queues it; a thread of
tensorboardX's writes and flushes the file (every FLUSH_SECONDS). A resumed run starts a
new event file in the same folder with a SessionLog START at the checkpoint's step + 1,
so TensorBoard drops the old file's events after the checkpoint (metrics.jsonl moves
those lines to metrics.discarded.jsonl) and the steps continue; a new run's START at
step 0 hides any events left in the folder (`train --fresh` moves them aside first).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import IO, Any

from distbelief.records.console import say

TENSORBOARD_DIR = "tensorboard"
WRITER_PACKAGE = "tensorboardX"
INSTALL_HINT = "pip install 'distbelief[tensorboard]'"
FLUSH_SECONDS = 5
"""How often the writer's thread flushes the file: how far TensorBoard lags the run."""
QUEUE_SIZE = 1000
"""Events waiting for the writer's thread; a full queue would block the training loop."""
NOT_PLOTTED = {"time", "step"}
"""Keys of a metrics line that are not scalars of their own (the step is the x axis)."""
TRAINING_ONLY = {"samples", "loss"}
"""Keys written only from training lines: other lines repeat them."""


def writer_installed() -> bool:
    """Whether tensorboardX can be imported (without importing it)."""
    return importlib.util.find_spec(WRITER_PACKAGE) is not None


def open_events(out_dir: str | Path, wanted: bool | None, resume_step: int | None,
                stream: IO[str] | None) -> TensorBoardEvents | None:
    """The run's event writer, or None. `wanted` is run.tensorboard: True (say one line
    if tensorboardX is missing, and train on), False, or None (write events when
    tensorboardX is installed). `resume_step`: the step of the checkpoint a resumed run
    starts from; TensorBoard drops the folder's earlier events after it (all of them for
    a new run, None)."""
    if wanted is False:
        return None
    if not writer_installed():
        if wanted:
            say(stream, f"distbelief: run.tensorboard = true, but {WRITER_PACKAGE} is not "
                        f"installed ({INSTALL_HINT}): no TensorBoard events, metrics.jsonl "
                        f"has every figure")
        return None
    return TensorBoardEvents(Path(out_dir) / TENSORBOARD_DIR,
                             purge_from=0 if resume_step is None else resume_step + 1)


def append_line(out_dir: str | Path, wanted: bool | None, line: dict[str, Any]) -> None:
    """One more metrics line written after the run's recorder closed (the final test) as
    events, in a file of its own, when the run writes events."""
    if wanted is False or not writer_installed():
        return
    events = TensorBoardEvents(Path(out_dir) / TENSORBOARD_DIR)
    try:
        events.line(line)
    finally:
        events.close()


def _import_tensorboardx() -> tuple[Any, Any, Any]:
    """tensorboardX's FileWriter and protobuf modules, without torch. tensorboardX imports
    torch when it is installed, only to accept torch tensors in its add_* calls; we write
    floats. That import cost every run's metrics rank about 250 MB and seconds of start-up
    wherever torch sat in the environment (CI's later steps: shard 0 at 337 MB against 90
    predicted). Unless this process already imported torch (a torch model), the import is
    refused for the moment tensorboardX loads."""
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None  # `import torch` raises ImportError meanwhile
    try:
        from tensorboardX import FileWriter
        from tensorboardX.proto import event_pb2, summary_pb2
    finally:
        if blocked:
            del sys.modules["torch"]
    return FileWriter, event_pb2, summary_pb2


class TensorBoardEvents:
    """Writes metrics lines and a run's summary as TensorBoard events in `logdir`.
    `purge_from`: TensorBoard discards the folder's earlier events from this step on."""

    def __init__(self, logdir: str | Path, purge_from: int | None = None):
        FileWriter, event_pb2, summary_pb2 = _import_tensorboardx()

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        logdir = Path(logdir)
        logdir.mkdir(parents=True, exist_ok=True)
        # tensorboardX names a file by the second and host only: a second writer within
        # the same second (a quick resume) would truncate the first one's file.
        suffix = f".{sum(1 for _ in logdir.glob('events.out.tfevents.*')):04d}.{os.getpid()}"
        self._writer = FileWriter(str(logdir), max_queue=QUEUE_SIZE,
                                  flush_secs=FLUSH_SECONDS, filename_suffix=suffix)
        self.logdir = logdir
        self._last_train: tuple[float, int] | None = None  # (time, samples)
        if purge_from is not None:
            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            self._writer.add_event(event_pb2.Event(session_log=start), step=purge_from)

    def line(self, line: dict[str, Any]) -> None:
        """One metrics line (as RunRecorder writes it) as one event at its step."""
        kind = line.get("kind", "line")
        values = dict(scalar_values(line))
        if kind == "train":
            rate = self._train_rate(line)
            if rate is not None:
                values["samples_per_second"] = rate
        if values:
            self._write({f"{kind}/{key}": value for key, value in values.items()},
                        int(line["step"]))

    def summary(self, summary: dict[str, Any]) -> None:
        """The run's summary (as summary.json holds it) at its last step: its numbers, each
        replica's throughput and staleness, and the staleness histograms."""
        step = int(summary.get("steps") or 0)
        scalars = {f"summary/{key}": value for key, value in scalar_values(summary)}
        for staleness in ([summary["staleness"]] if isinstance(summary.get("staleness"), dict)
                          else []):
            scalars["summary/staleness_mean"] = float(staleness["mean"])
            scalars["summary/staleness_max"] = float(staleness["max"])
            self._histogram("staleness", staleness, step)
        # Downpour's summary lists its replicas; the synchronous ones' count them.
        replicas = summary.get("replicas")
        for replica in replicas if isinstance(replicas, list) else []:
            name = replica_name(replica)
            for key in ("samples_per_second", "steps", "samples"):
                if _is_number(replica.get(key)):
                    scalars[f"{name}/{key}"] = float(replica[key])
            staleness = replica.get("staleness")
            if isinstance(staleness, dict):
                scalars[f"{name}/staleness_mean"] = float(staleness["mean"])
                scalars[f"{name}/staleness_max"] = float(staleness["max"])
                self._histogram(f"{name}/staleness", staleness, step)
        if scalars:
            self._write(scalars, step)

    def close(self) -> None:
        """Write what is queued and close the file."""
        self._writer.close()

    def _train_rate(self, line: dict[str, Any]) -> float | None:
        now, samples = float(line["time"]), int(line["samples"])
        last, self._last_train = self._last_train, (now, samples)
        if last is None or now <= last[0] or samples < last[1]:
            return None
        return (samples - last[1]) / (now - last[0])

    def _write(self, scalars: dict[str, float], step: int) -> None:
        Value = self._summary_pb2.Summary.Value
        summary = self._summary_pb2.Summary(
            value=[Value(tag=tag, simple_value=value) for tag, value in scalars.items()])
        self._writer.add_summary(summary, global_step=step, walltime=time.time())

    def _histogram(self, tag: str, staleness: dict[str, Any], step: int) -> None:
        """A staleness distribution (StalenessStats.to_dict) as a histogram, one bucket
        per staleness value (the last counts those at histogram_cap or more)."""
        counts = [float(c) for c in staleness.get("histogram") or []]
        if not sum(counts):
            return
        values = range(len(counts))
        proto = self._summary_pb2.HistogramProto(
            min=float(next(v for v in values if counts[v])), max=float(staleness["max"]),
            num=sum(counts), sum=sum(v * c for v, c in zip(values, counts)),
            sum_squares=sum(v * v * c for v, c in zip(values, counts)),
            bucket_limit=[float(v) for v in values], bucket=counts)
        summary = self._summary_pb2.Summary(
            value=[self._summary_pb2.Summary.Value(tag=tag, histo=proto)])
        self._writer.add_summary(summary, global_step=step, walltime=time.time())


def scalar_values(line: dict[str, Any]) -> list[tuple[str, float]]:
    """The (key, value) pairs of a metrics line or summary that are scalars: numbers, not
    booleans, without time and step (nor, off training lines, samples and loss)."""
    skip = NOT_PLOTTED if line.get("kind") == "train" else NOT_PLOTTED | TRAINING_ONLY
    if "kind" not in line:  # a summary: its steps and samples are figures of the run
        skip = set()
    return [(key, float(value)) for key, value in line.items()
            if key not in skip and _is_number(value)]


def replica_name(replica: dict[str, Any]) -> str:
    """replica/0, or replica/0.1 for partition 1 of replica 0 (model parallelism)."""
    partition = replica.get("partition")
    suffix = "" if partition is None else f".{partition}"
    return f"replica/{replica['replica']}{suffix}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
