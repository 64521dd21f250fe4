"""The run skeleton: RunSession owns the lifecycle every trainer shares (the checkpoint to
start from and the run folder, the evaluation set, the recorder, the watched frame and the
abort on a lost rank, the summary), so a trainer's `train` composes it with what is its
own: its plan and roles, its loop, its checkpoints, its summary's extras. What the launch
(algorithms.launch) found once for the whole run comes in a RunSetup, so the session does
not find it again. Its steps, and which trainer uses which: docs/architecture.md, "The
run skeleton". The session is also the one seam of the test-only fault injection
(`faults`, distbelief.runtime.launching.faults): every role takes this rank's faults from
it, and hands the parameter server what it needs of them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from distbelief.algorithms.checkpointer import BestKeeper
from distbelief.algorithms.common import (
    RESUME_MODES,
    StopRules,
    StopSignals,
    TrainingDiverged,
    check_replica_count,
    latest_checkpoint,
    load_eval_set,
    open_data,
    prepare_run_dir,
    run_recorder,
    start_over,
    starting_checkpoint,
    train_shard,
    watched_run,
)
from distbelief.config import Config, config_hash
from distbelief.records import checkpoint as ckpt
from distbelief.records.console import say
from distbelief.records.metrics import (
    ResumePoint,
    RunRecorder,
    accuracy_text,
    best_last_text,
    target_text,
)
from distbelief.runtime.health import watchdog
from distbelief.runtime.launching.faults import Faults


@dataclass
class RunSetup:
    """What algorithms.launch found once for a run, on every rank, for its trainer: the
    data file's description (its labels checked) and the network built on it, what
    common.latest_checkpoint found in run.out_dir (None with --fresh) and this rank's
    Topology in the job (None for one process, or where the ranks make no layout)."""

    info: Any
    network: Any
    latest: tuple[ckpt.Checkpoint | None, list[tuple[Path, str]]] | None = None
    topology: Any = None


class RunSession:
    """One run of one trainer on this rank: its configuration, data, network, the
    checkpoint it starts from, its evaluation set and (on the reporting rank) its recorder.

    `comm` is None for a one-process trainer; with a communicator, the constructor (the
    ranks check the data file's labels together, unless `setup` brings them) and the
    methods that say so are collective over it. The reporting rank (`reporting_rank` of `comm`, rank 0
    unless the trainer's plan names another) writes the run folder, the metrics and the
    summary, and prints to `stream`. `faults` is this rank's test-only faults
    (DISTBELIEF_FAULTS, read once here; without it a Faults that arms none, whose hooks do
    nothing), the one place a run's roles get them from.
    """

    def __init__(self, algorithm: str, config: Config, comm: Any = None,
                 stream: IO[str] | None = sys.stdout, resume: str = "auto",
                 reporting_rank: int = 0, setup: RunSetup | None = None):
        if resume not in RESUME_MODES:
            raise ValueError(f"resume must be one of {RESUME_MODES}, got {resume!r}")
        self.algorithm, self.config, self.comm = algorithm, config, comm
        self.stream, self.resume = stream, resume
        self.rank = comm.Get_rank() if comm is not None else 0
        self.reporting_rank = reporting_rank
        self.setup = setup
        self.faults = Faults.for_rank(self.rank)
        if setup is not None:
            self.info, self.network = setup.info, setup.network
        else:
            # The ranks check the labels together, each its part, and agree (collective):
            # a rank reads 1/N of them, not all (at 1,000 ranks, every rank reading every
            # label was the largest read at start).
            part = (self.rank, comm.Get_size()) if comm is not None else (0, 1)
            self.info, self.network = self._agreed(lambda: open_data(config, part))
        self.rules = StopRules.from_config(config)
        self.found: ckpt.Checkpoint | None = None  # on the reporting rank
        self.start_path: str | None = None  # on every rank
        self.eval_set: tuple[np.ndarray, np.ndarray] | None = None
        self.recorder: RunRecorder | None = None

    @property
    def reporting(self) -> bool:
        return self.rank == self.reporting_rank

    @property
    def out_dir(self) -> Path:
        return self.config.run.out_dir

    def _agreed(self, setup: Callable[[], Any]) -> Any:
        if self.comm is None:
            return setup()
        from distbelief.runtime.communicators.agreement import agree  # imports mpi4py.MPI

        return agree(self.comm, setup)

    def choose_checkpoint(self, replicas: int | None = None, kind: str = "",
                          extra_ranks: int = 0, why: str = "") -> str | None:
        """The checkpoint this run starts from (its path on every rank, None for a fresh
        start), chosen on the reporting rank (starting_checkpoint; with `replicas`, one
        written by another replica count is refused: check_replica_count), which then
        prepares the run folder: a refused resume leaves the folder as it was. Collective
        (agreed, so a UserError there is raised on every rank, then a bcast of the path)."""

        # Every rank hashes its share of each candidate's parts (latest_checkpoint), once
        # a run: the launch's setup brings what it found.
        if self.resume == "fresh":
            latest = None
        elif self.setup is not None and self.setup.latest is not None:
            latest = self.setup.latest
        else:
            latest = latest_checkpoint(ckpt.checkpoint_root(self.out_dir), self.comm)

        def setup() -> ckpt.Checkpoint | None:
            if not self.reporting:
                return None
            found = starting_checkpoint(self.config, self.network.layout, self.resume,
                                        self.stream, latest)
            if replicas is not None:
                check_replica_count(found, replicas, kind, extra_ranks, why)
            prepare_run_dir(self.config)
            return found

        self.found = self._agreed(setup)
        path = str(self.found.path) if self.found is not None else None
        self.start_path = path if self.comm is None else self.comm.bcast(
            path, root=self.reporting_rank)
        return self.start_path

    def start_fresh(self) -> None:
        """For a trainer that writes no checkpoints: the reporting rank moves a previous
        run's records aside (start_over) and prepares the run folder. Collective (agreed)."""

        def setup() -> None:
            if self.reporting:
                start_over(self.out_dir, self.resume, self.stream)
                prepare_run_dir(self.config)

        self._agreed(setup)

    def start_checkpoint(self) -> ckpt.Checkpoint | None:
        """The chosen checkpoint on this rank (read from its manifest off the reporting
        rank), or None for a fresh start."""
        if self.found is None and self.start_path is not None:
            self.found = ckpt.Checkpoint(Path(self.start_path),
                                         ckpt.read_manifest(Path(self.start_path)))
        return self.found

    def train_shard(self, replica: int, replicas: int) -> Any:
        """Replica `replica`'s part of the training set, of `replicas` (common.train_shard)."""
        return train_shard(self.config, self.info, replica, replicas)

    def load_eval_set(self) -> tuple[np.ndarray, np.ndarray]:
        """The samples every evaluation uses (common.load_eval_set), kept for the summary."""
        self.eval_set = load_eval_set(self.config, self.info)
        return self.eval_set

    def resume_point(self) -> ResumePoint | None:
        """Where the recorder's records continue from: the chosen checkpoint, if any."""
        found = self.found
        return None if found is None else ResumePoint(found.step, found.samples,
                                                      found.wall_seconds, found.path.name)

    def open_recorder(self, resume: ResumePoint | None = None) -> RunRecorder | None:
        """The reporting rank's RunRecorder (None elsewhere), continuing from `resume`
        (default: the chosen checkpoint)."""
        if self.reporting:
            self.recorder = run_recorder(self.config, self.info, self.stream,
                                         resume=resume or self.resume_point())
            if self.config.run.keep_best:  # kept where the trainer logs the evaluated vector
                self.recorder.best_keeper = BestKeeper(self.config, self.network.layout,
                                                       self.config.optimizer.algorithm,
                                                       self.stream)
        return self.recorder

    def say(self, text: str) -> None:
        if self.reporting:
            say(self.stream, text)

    def describe_run(self, what: str, eval_samples: int, notes: str = "", model: str = "",
                     sep: str = ", ") -> None:
        """The opening line, on the reporting rank: the algorithm, `what` runs it, the
        data and the run folder, `notes`, then the network (and `model`, a partitioned
        network's own description)."""
        if not self.reporting:
            return
        info = self.info
        self.say(f"distbelief: {self.algorithm}, {what}{sep}data {info.path} ({info.n_train} "
                 f"train / {eval_samples} eval samples), out {self.out_dir}{notes}\n"
                 f"{self.network.describe()}" + (f"\n{model}" if model else ""))

    @contextmanager
    def watched(self, describe: Callable[[int], str],
                on_lost: Callable[[watchdog.RankLost, Any], None] | None = None
                ) -> Iterator[tuple[StopSignals, Any]]:
        """The frame the loop runs in (common.watched_run: the stall watchdog, the stop
        signals, the peers), yielding (signals, peers). A rank lost inside it ends the
        job: `on_lost(lost, peers)`, which never returns, or by default one line naming
        the lost rank and the job's abort. Collective over comm on entry."""
        with watched_run(self.comm, describe, self.config.run) as (signals, peers):
            try:
                yield signals, peers
            except watchdog.RankLost as lost:
                if on_lost is not None:
                    on_lost(lost, peers)
                watchdog.abort_and_leave(self.comm, watchdog.lost_message(describe, lost))
                raise

    def summary(self, reason: str, extras: dict[str, Any] | None = None,
                checkpoint: str | Path | None = None,
                eval_samples: int | None = None) -> dict[str, Any]:
        """The keys every summary has, then the trainer's `extras`."""
        if eval_samples is None:
            eval_samples = len(self.eval_set[1]) if self.eval_set is not None else 0
        return {"algorithm": self.algorithm, "stop_reason": reason,
                "config_hash": config_hash(self.config),
                "num_params": int(self.network.layout.size), "eval_samples": eval_samples,
                **(extras or {}),
                "resumed_from": self.start_path,
                "checkpoint": str(checkpoint) if checkpoint else None}

    def finish(self, reason: str, extras: dict[str, Any] | None = None,
               checkpoint: str | Path | None = None, *, eval_samples: int | None = None,
               steps_note: str = "", note: str = "", steps: int | None = None,
               recorder: RunRecorder | None = None,
               closing_line: bool = True) -> dict[str, Any] | None:
        """On the reporting rank: summary.json written (the shared keys, then `extras`)
        and, with `closing_line`, the closing line printed ("stopped (reason) after N
        steps`steps_note`, T s; accuracy`note`", the target, where the results are);
        returns the summary. None on the other ranks."""
        recorder = recorder or self.recorder
        if recorder is None:
            return None
        summary = recorder.finish(self.summary(reason, extras, checkpoint, eval_samples))
        if not closing_line:
            return summary
        self.say(f"distbelief: stopped ({reason}) after "
                 f"{summary['steps'] if steps is None else steps} steps{steps_note}, "
                 f"{summary['wall_seconds']:.1f}s; {accuracy_text(summary)}{note}"
                 f"{target_text(summary)}\n{_models_line(summary)}results in {self.out_dir}")
        return summary

    def diverged(self, loss_text: str, recorder: RunRecorder | None = None) -> TrainingDiverged:
        """A run whose loss is no longer finite: the reporting rank's summary says so;
        returns the error to raise (the loss `loss_text`, what to lower)."""
        recorder = recorder or self.recorder
        if recorder is not None:
            recorder.finish({"algorithm": self.algorithm, "stop_reason": "diverged"})
        return TrainingDiverged(f"training diverged: the loss is {loss_text}; lower "
                                f"optimizer.learning_rate (now "
                                f"{self.config.optimizer.learning_rate:g})")


def _models_line(summary: dict[str, Any]) -> str:
    """The closing lines' best and last models (records.metrics.best_last_text) with its
    newline, or "" when the run left none."""
    text = best_last_text(summary)
    return f"distbelief: {text}\n" if text else ""
