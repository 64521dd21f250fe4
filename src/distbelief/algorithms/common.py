"""What every trainer shares: the run folder, the data and the evaluation set, the stop
rules and signals, and the checkpoint a run starts from.

Moved unchanged from the single-process trainer (algorithms/sgd.py), where it began, so
that Downpour, Sandblaster and the partitioned trainer import it from here rather than
from another algorithm.

    prepare_run_dir(config)          out_dir created, config.json written
    open_data(config)                (DatasetInfo, Network) checked against each other
    load_eval_set(config, info)      the samples evaluations use (validation, else test)
    run_recorder(config, info, ...)  the RunRecorder of the run's reporting rank
    StopRules.from_config(config)    max_steps / max_seconds / the target / collapse
    evaluate(network, params, eval_set) -> (loss, accuracy)
    final_test(config, summary, stream)   a run with a validation split: the test set,
                                     evaluated once at the end, into summary.json
                                     (not when a signal stopped it: SIGNAL_STOPS)
    starting_checkpoint(config, layout, resume, stream)   which checkpoint to resume from
    finished_run(config, resume, stream)   the summary of a finished run a rerun leaves be
    StopSignals()                    SIGTERM/SIGUSR1/SIGINT -> a flag the loop polls
    StopDecision()                   a lockstep step's stop / evaluate / checkpoint flags,
                                     encoded before the ranks agree, decoded after
    archive_previous_run(out_dir)    train --fresh: the previous run's files moved aside
                                     (checkpoints, metrics, summary, config, tensorboard/)
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Self

import numpy as np

from distbelief.config import Config, RunConfig, build_network, config_hash, hashed_settings
from distbelief.errors import UserError
from distbelief.model.losses import Evaluation
from distbelief.records import checkpoint as ckpt
from distbelief.records import tensorboard
from distbelief.records.collapse import CollapseWatch
from distbelief.records.console import say
from distbelief.records.metrics import (
    DISCARDED_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    ResumePoint,
    RunRecorder,
    Target,
    target_of,
)
from distbelief.records.vectors import WholeScorer, evaluate_in_blocks
from distbelief.runtime.health import watchdog
from distbelief.runtime.launching.launcher import launcher_rank

EVAL_BATCH_SIZE = 1000

STOP_CODES = {0: None, 1: "max_steps", 2: "max_seconds", 3: "SIGTERM", 4: "SIGUSR1",
              5: "SIGINT", 6: "collapse"}
"""Why a run stops, as the int code a MAX-allreduce of the ranks' votes agrees on (the
trainers whose ranks step in lockstep: partitioned sgd, sync, averaging); 0 goes on."""
STOP_CODE_OF = {reason: code for code, reason in STOP_CODES.items()}
SIGNAL_STOPS = ("SIGTERM", "SIGUSR1", "SIGINT")
"""The stop reasons of an interrupted run: a signal, not one of its own stop rules."""


class StopDecision:
    """A lockstep step's decision as the three int32 flags its ranks agree on: the stop
    code (STOP_CODES), evaluate now, checkpoint now. One encoding and one decoding for the
    trainers that agree each step (partitioned sgd, sync, averaging); the collective is
    each loop's own (a MAX-allreduce of `flags`, or a bcast from the clock's rank), and
    the properties read the agreed flags after it. No communication."""

    def __init__(self) -> None:
        self.flags = np.zeros(3, dtype=np.int32)

    def encode(self, reason: str | None = None, eval_due: bool = False,
               save_due: bool = False) -> np.ndarray:
        """This rank's vote: `reason` (a STOP_CODES reason, None goes on) and the two
        due flags, written into `flags` (returned, the collective's buffer)."""
        self.flags[:] = STOP_CODE_OF[reason], eval_due, save_due
        return self.flags

    def merge(self, reason: str | None) -> None:
        """Raise the stop code to `reason`'s if that is higher, as a MAX-allreduce of the
        two votes would (None changes nothing)."""
        self.flags[0] = max(self.flags[0], STOP_CODE_OF[reason])

    @property
    def reason(self) -> str | None:
        """Why the run stops (a STOP_CODES reason), None to go on."""
        return STOP_CODES[int(self.flags[0])]

    @property
    def eval_due(self) -> bool:
        return bool(self.flags[1])

    @property
    def save_due(self) -> bool:
        return bool(self.flags[2])


def prepare_run_dir(config: Config) -> Path:
    """Create run.out_dir and write the resolved configuration there as config.json."""
    out_dir = config.run.out_dir
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        record = {**config.to_dict(), "config_hash": config_hash(config),
                  "source": str(config.source) if config.source else None}
        (out_dir / "config.json").write_text(json.dumps(record, indent=2) + "\n")
    except OSError as e:
        raise UserError(f"cannot write to run.out_dir {out_dir}: {e.strerror or e}") from e
    return out_dir


def open_data(config: Config, part: tuple[int, int] = (0, 1),
              model: Any = None) -> tuple[Any, Any]:
    """(DatasetInfo, Network) for the config: the data file opened, the model built on it
    (or `model`, a user's, wrapped in model.protocol.OwnModel and checked on it).
    `part` = (i, k): check only the i-th of k parts of the labels (data.hdf5.open_dataset;
    the k ranks that share the check must agree on its verdict)."""
    from distbelief.data.hdf5 import open_dataset, with_validation

    info = with_validation(open_dataset(config.data.path, part=part), config.data.validation)
    if model is None:
        return info, build_network(config, info)
    from distbelief.config import data_loss
    from distbelief.model.protocol import OwnModel

    loss = data_loss(config, info)
    probe_y = (np.zeros(2, dtype=np.int64) if info.targets == "classes"
               else np.zeros((2, *info.target_shape), dtype=np.float32))
    return info, OwnModel(model, tuple(info.input_shape), loss.width, seed=config.run.seed,
                          loss=loss, probe_y=probe_y)


def train_shard(config: Config, info: Any, rank: int, num_ranks: int) -> Any:
    """Replica `rank`'s part of the training set: in memory (TrainShard), or streamed from
    the file with data.stream_memory_mb of rows in memory (data.in_memory = false)."""
    if config.data.in_memory:
        from distbelief.data.hdf5 import TrainShard

        return TrainShard(info, rank, num_ranks, config.run.seed)
    from distbelief.data.stream import StreamingTrainShard

    return StreamingTrainShard(info, rank, num_ranks, config.run.seed,
                               memory_bytes=config.data.stream_memory_mb << 20)


def eval_split(info: Any) -> str:
    """The split evaluations during training use: "validation" when the data has one
    (data.validation, or a /val group in the file), else "test"."""
    return "validation" if info.n_val else "test"


def load_eval_set(config: Config, info: Any) -> tuple[np.ndarray, np.ndarray]:
    """The samples every evaluation during training uses (the validation split when there
    is one, else the test set): the first run.eval_samples, or all."""
    from distbelief.data.hdf5 import load_split

    return load_split(info, eval_split(info), limit=config.run.eval_samples or None)


def run_recorder(config: Config, info: Any, stream: IO[str] | None,
                 resume: ResumePoint | None = None, start: float | None = None) -> RunRecorder:
    """The RunRecorder of a run's reporting rank, set up from the config: its cadence,
    target, score, budget (for the ETA), the split its evaluations are on, and its
    collapse watch (on the data's class count: none for float targets, whose loss has no
    chance level)."""
    from distbelief.model.losses import LOSSES

    run = config.run
    collapse = (CollapseWatch(info.num_classes, run.collapse_window_seconds)
                if config.model.loss == "cross_entropy" else None)
    score = LOSSES[config.model.loss].score
    return RunRecorder(run.out_dir, run.progress_every_seconds, stream, start=start,
                       resume=resume, max_steps=run.max_steps, max_seconds=run.max_seconds,
                       eval_split=eval_split(info), collapse=collapse,
                       tensorboard=run.tensorboard, target=run_target(run), score=score)


def evaluate(network: Any, params: np.ndarray,
             eval_set: tuple[np.ndarray, np.ndarray]) -> Evaluation:
    """The loss and the loss's metrics of `params` on the evaluation set."""
    x, y = eval_set
    return network.evaluate(params, x, y, batch_size=EVAL_BATCH_SIZE)


def final_test(config: Config, summary: dict[str, Any],
               stream: IO[str] | None, network: Any = None) -> dict[str, Any]:
    """A run that evaluated a validation split during training: its test set, evaluated
    once, at the end, on the run's best model (the best validation figure's: model
    selection on the validation split, which is what it is for), else on its newest
    checkpoint (every trainer writes one when it stops), into summary.json (final_test_accuracy, final_test_loss, test_step) and
    metrics.jsonl (a "test" line); returns the summary. Other runs' summaries are returned
    as they are, and so are those of a run that a signal stopped: it is interrupted, not
    over (a rerun resumes it), and a figure seen now would be a second look at the test
    set later (SIGNAL_STOPS). Call it on the rank that wrote the summary, after the
    trainer returned."""
    if summary.get("eval_split") != "validation":
        return summary
    if summary.get("stop_reason") in SIGNAL_STOPS:
        say(stream, f"distbelief: the test set was not evaluated: {summary['stop_reason']} "
                    f"interrupted the run (a rerun resumes it and evaluates it at its end; "
                    f"`distbelief evaluate {config.run.out_dir}` does it on demand)")
        return summary
    from distbelief.records.metrics import write_json_atomic

    out_dir = Path(config.run.out_dir)
    try:
        if ckpt.find_latest(ckpt.checkpoint_root(out_dir)) == (None, []):
            raise UserError("the run wrote no checkpoint to evaluate")
        tested, source = _model_to_test(config, network)
    except UserError as exc:
        why = str(exc)
        say(stream, f"distbelief: the test set was not evaluated: {why}")
        summary = {**summary, "test_not_evaluated": why}
        write_json_atomic(out_dir / SUMMARY_FILE, summary)
        return summary
    from distbelief.data.hdf5 import open_dataset, with_validation

    # The metadata only: the run checked the labels already.
    info = with_validation(open_dataset(config.data.path, labels=False),
                           config.data.validation)
    result = evaluate_in_blocks(tested, info, "test", EVAL_BATCH_SIZE, EVAL_BLOCK_BYTES)
    step = source.get("step")
    tested_figures = {f"test_{name}": value for name, value in result.figures.items()}
    summary = {**summary, **{f"final_{key}": value for key, value in tested_figures.items()},
               "test_step": step, "test_samples": result.rows,
               "test_model": source.get("which", "last")}
    line = {"kind": "test", "time": summary.get("wall_seconds"), "step": step,
            "samples": source.get("samples"), **tested_figures}
    with (out_dir / METRICS_FILE).open("a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
    tensorboard.append_line(out_dir, config.run.tensorboard, line)
    write_json_atomic(out_dir / SUMMARY_FILE, summary)
    figures = ", ".join(f"{name} {value:.4f}" for name, value in result.figures.items()
                        if name != "loss")
    say(stream, f"distbelief: test set, evaluated once at the end: {figures}, loss "
                f"{result.loss:.4f} ({result.rows:,d} samples, {which_text(source)} of step "
                f"{step:,d})")
    return summary


def _model_to_test(config: Config, network: Any) -> tuple[Any, dict[str, Any]]:
    """(what scores it, where it came from) for the run's best model, else its last
    checkpoint: the built-in network rebuilt from the checkpoint (a sparse model read a
    batch's rows at a time: records.vectors), or `network`, the run's own model (a user's
    model is not in the checkpoint, only its vector)."""
    from distbelief.records.export import read_trained

    trained = read_trained(config.run.out_dir, data=config.data.path)
    return trained.scorer(None if config.model.own is None else network), trained.source


def which_text(source: dict[str, Any]) -> str:
    """"the best model" or "the last checkpoint", as records.export.read_trained chose."""
    return "the best model" if source.get("which") == "best" else "the last checkpoint"


EVAL_BLOCK_BYTES = 64 << 20
"""evaluate_split reads this much of a split at a time (as float32), so a test set larger
than memory is evaluated too."""


def evaluate_split(network: Any, params: np.ndarray, info: Any, split: str) -> Evaluation:
    """The Evaluation of `params` on the whole of `split`, read from the file in blocks of
    whole evaluation batches (their tallies summed: model.losses)."""
    return evaluate_in_blocks(WholeScorer(network, params), info, split, EVAL_BATCH_SIZE,
                              EVAL_BLOCK_BYTES)


def figures_of(network: Any) -> Any:
    """What turns `network`'s tallies into figures (model.losses.Loss): its loss, or a
    model of one's own's evaluate (model.protocol.OwnModel.figures_of)."""
    return network.figures_of


def run_target(run: RunConfig) -> Target | None:
    """The run's target (records.metrics.target_of), or None."""
    return target_of(vars(run))


@dataclass(frozen=True)
class StopRules:
    """When a run ends. Zero means no limit; the target is checked at evaluations."""

    max_steps: int = 0
    max_seconds: float = 0.0
    target: Target | None = None
    stop_on_collapse: bool = False

    @classmethod
    def from_config(cls, config: Config) -> StopRules:
        run = config.run
        return cls(run.max_steps, run.max_seconds, run_target(run), run.stop_on_collapse)

    def budget_spent(self, step: int, elapsed: float, collapsed: bool = False) -> str | None:
        """"max_steps" or "max_seconds" once that budget is used up, "collapse" when the
        run collapsed (`collapsed`: RunRecorder.collapsed) and run.stop_on_collapse is
        set, else None."""
        if self.max_steps and step >= self.max_steps:
            return "max_steps"
        if self.max_seconds and elapsed >= self.max_seconds:
            return "max_seconds"
        if self.stop_on_collapse and collapsed:
            return "collapse"
        return None

    def target_reached(self, evaluation: Any) -> bool:
        """Whether an Evaluation (or a dict of figures) meets the run's target."""
        figures = getattr(evaluation, "figures", evaluation)
        return self.target is not None and self.target.met(figures)

    @property
    def target_reason(self) -> str:
        """The stop reason of a run its target stopped: target_accuracy, target_loss, ..."""
        return "target_accuracy" if self.target is None else self.target.reason


class TrainingDiverged(UserError):
    """The training loss became NaN or infinite (usually: the learning rate is too high)."""


RESUME_MODES = ("auto", "require", "fresh")
"""train(resume=...): "auto" continues from a valid checkpoint in out_dir if there is one
(the default, so a requeued job simply resumes); "require" (train --resume) fails without
one; "fresh" (train --fresh) moves the previous run's files aside and starts over."""


class StopSignals:
    """SIGTERM, SIGUSR1 and a first SIGINT (Ctrl-C) ask the training loop to stop after the
    current step.

    SLURM sends SIGTERM at the time limit (then SIGKILL after KillWait) and any signal
    chosen with `sbatch --signal=USR1@120` some time before it. The handler only records
    the signal's name in `received`, which the loop polls once a step; everything else
    (the checkpoint, the summary) happens in the loop, outside the handler. Handlers can
    only be installed from the main thread; elsewhere this does nothing. The previous
    handlers come back on exit.

    A first SIGINT is a SIGTERM that the command reports with exit status 130 (see
    note_interrupt and interrupted_by_user): it is also counted as a SIGTERM,
    so the trainers that agree on a stop over MPI (Downpour's run control) need no code of
    their own for it. mpiexec forwards a Ctrl-C to every rank as SIGINT. A second SIGINT
    ends the process at once (status 130), as an impatient user means it to; a checkpoint
    being written then is never half committed (distbelief.records.checkpoint commits atomically).

    A first SIGINT or SIGTERM is said in one line, naming it, by the job's first rank only
    (announce_stop). A SIGUSR1 is not: under hydra it may be the notice of a death, and the
    trainer decides what it means; the closing line names whatever stopped the run.
    """

    NAMES = ("SIGTERM", "SIGUSR1", "SIGINT")

    def __init__(self) -> None:
        self.received: str | None = None
        self.counts = dict.fromkeys(self.NAMES, 0)  # how many of each arrived
        self._previous: dict[int, Any] = {}
        if _interrupts:  # a Ctrl-C during the set-up: stop after the first step
            self._count("SIGINT")

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if name == "SIGINT":
            before = _interrupts
            note_interrupt(signum, frame)
            if _interrupts == before:
                return  # the same Ctrl-C once more
        elif name == "SIGTERM" and not self.counts["SIGTERM"]:
            # Not SIGUSR1: under hydra it may be the notice of a death, no stop at all.
            announce_stop(name)
        self._count(name)

    def _count(self, name: str) -> None:
        if name == "SIGINT":
            self.counts["SIGTERM"] += 1
        self.received = name
        self.counts[name] += 1

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for name in self.NAMES:
                number = getattr(signal, name)
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()


COLLAPSED_STATUS = 4
"""The exit status of a run that run.stop_on_collapse ended (distbelief.records.collapse);
3 is an owner that lost its folder (distbelief.runtime.health.ownership)."""

INTERRUPTED_STATUS = 130
"""The exit status of a run stopped by Ctrl-C (128 + SIGINT, as shells report it)."""

_interrupts = 0  # SIGINTs this process received (note_interrupt)
_first_interrupt = 0.0
SAME_CTRL_C_S = 1.0
"""SIGINTs this close to the first are the same Ctrl-C: a terminal signals the whole
foreground process group, and mpiexec forwards it too, so a rank may get one keypress
twice (through its guardian, distbelief.runtime.launching.guardian)."""


@contextmanager
def interrupts_noted() -> Iterator[None]:
    """note_interrupt as the SIGINT handler for a run started from Python
    (distbelief.train), with no Ctrl-C counted yet; the caller's handler and count back
    afterwards, so a script's next Ctrl-C (or its next run) is its own again."""
    global _interrupts, _first_interrupt
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers: Ctrl-C stays the caller's
        return
    before = signal.signal(signal.SIGINT, note_interrupt)
    _interrupts, _first_interrupt = 0, 0.0
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
        _interrupts, _first_interrupt = 0, 0.0


def note_interrupt(signum: int = signal.SIGINT, frame: Any = None) -> None:
    """The SIGINT handler of `train` (installed for the whole command, so that a Ctrl-C
    reaching a rank just before or after its trainer's StopSignals is not a
    KeyboardInterrupt in the middle of a collective): the first is remembered (the run
    stops after its current step, exit status 130), the second ends the process now."""
    global _interrupts, _first_interrupt
    if _interrupts and time.monotonic() - _first_interrupt < SAME_CTRL_C_S:
        return
    _interrupts += 1
    if _interrupts == 1:
        _first_interrupt = time.monotonic()
    if _interrupts > 1:
        announce("distbelief: SIGINT again: stopping now, without a checkpoint")
        os._exit(INTERRUPTED_STATUS)
    announce_stop("SIGINT")


def announces_signals(environ: Any = os.environ) -> bool:
    """Whether this process says, in one line, that a signal stops the run: the launcher's
    rank 0, or a process started without a launcher. A launcher's signal reaches every
    rank (mpiexec forwards a Ctrl-C to each, srun and slurmstepd signal every process of
    the step), so one rank saying it is one line per job; the closing line names the
    signal in any case."""
    return launcher_rank(environ) in (None, "0")


def announce(line: str) -> None:
    """Write `line` to stderr on the rank that announces signals (announces_signals);
    callable from a signal handler (one os.write, no buffered stream)."""
    if announces_signals():
        os.write(2, f"{line}\n".encode())


def announce_stop(name: str) -> None:
    """The one line that says signal `name` (SIGINT, SIGTERM) stops the run."""
    again = " (Ctrl-C again to stop at once)" if name == "SIGINT" else ""
    announce(f"distbelief: {name} received: stopping after this step with a checkpoint"
             f"{again}")


def interrupted_by_user() -> bool:
    """True once a SIGINT reached this process: `train` then exits 130."""
    return _interrupts > 0



def latest_checkpoint(root: Path, comm: Any = None
                      ) -> tuple[ckpt.Checkpoint | None, list[tuple[Path, str]]]:
    """ckpt.find_latest. With a communicator of several ranks, collectively and spread:
    rank 0 lists the candidates; each rank hashes its share of a candidate's parts (part i
    on rank i mod size) and the verdicts are allgathered, so no rank reads every byte and
    every rank returns the same answer. Collective over `comm`."""
    if comm is None or comm.Get_size() == 1:
        return ckpt.find_latest(root)
    from distbelief.runtime.communicators.agreement import wait_for_everyone

    rank, size = comm.Get_rank(), comm.Get_size()
    listed = [path for _, path in ckpt.list_checkpoints(root)] if rank == 0 else None
    candidates = comm.bcast(listed, root=0)

    def check(path: Path) -> ckpt.Checkpoint:
        manifest, problem = None, None
        try:
            manifest = ckpt.read_manifest(path)
            ckpt.verify(path, parts=sorted(manifest["parts"])[rank::size])
        except ckpt.CheckpointError as exc:
            problem = str(exc)
        wait_for_everyone(comm)  # ranks hash different amounts: wait without spinning
        problems = list(dict.fromkeys(p for p in comm.allgather(problem) if p is not None))
        if problems:
            raise ckpt.CheckpointError("; ".join(problems))
        return ckpt.Checkpoint(path, manifest)

    return ckpt.find_latest(root, check, candidates)


def starting_checkpoint(config: Config, layout: Any, resume: str,
                        stream: IO[str] | None,
                        latest: tuple[ckpt.Checkpoint | None, list[tuple[Path, str]]]
                        | None = None) -> ckpt.Checkpoint | None:
    """The checkpoint a run starts from, or None for a fresh start (see RESUME_MODES).

    Damaged checkpoints newer than the one chosen are reported and renamed to .damaged
    (kept, never loaded); leftovers of a killed commit are removed. A checkpoint of another
    model or configuration is refused (CheckpointMismatch) rather than overwritten, and so
    is a folder whose checkpoints are all damaged. Call it on the committer only (rank 0),
    before any writer starts; `latest` is what latest_checkpoint found, when the ranks
    verified the checkpoints together.
    """
    out_dir = config.run.out_dir
    root = ckpt.checkpoint_root(out_dir)
    if resume == "fresh":
        start_over(out_dir, resume, stream)
        return None
    found, damaged = latest if latest is not None else ckpt.find_latest(root)
    for _, problem in damaged:
        say(stream, f"distbelief: warning: {problem}")
    if found is None:
        if damaged:
            raise ckpt.CheckpointError(
                f"no valid checkpoint in {root}: all {len(damaged)} are damaged (see the "
                f"warnings above); train --fresh moves them aside and starts over")
        if resume == "require":
            raise ckpt.CheckpointError(f"train --resume: there is no checkpoint in {root}")
        ckpt.clean_leftovers(root)
        start_over(out_dir, resume, stream)
        return None
    try:
        found.check_compatible(hashed_settings(config), layout)
    except ckpt.CheckpointMismatch as exc:
        raise ckpt.CheckpointMismatch(f"{exc}. To train this configuration, pass --fresh "
                                      "(moves the old run aside) or choose another "
                                      "run.out_dir") from exc
    for path, _ in damaged:
        say(stream, f"distbelief: set {path.name} aside as {ckpt.set_aside(path).name}")
    ckpt.clean_leftovers(root)
    why = "" if resume == "require" else " (found in run.out_dir; train --fresh starts over)"
    say(stream, f"distbelief: resuming from {found.path} at step {found.step}, "
                   f"{found.samples:,d} samples, {found.wall_seconds:.1f}s trained{why}")
    spent = StopRules.from_config(config).budget_spent(found.step, found.wall_seconds)
    if spent:
        say(stream, f"distbelief: that run already used its budget (run.{spent} = "
                       f"{getattr(config.run, spent):g}): it stops at once. Raise run.{spent} "
                       f"to train on, or pass --fresh to start over")
    return found


def finished_run(config: Config, resume: str, stream: IO[str] | None,
                 latest: tuple[ckpt.Checkpoint | None, list[tuple[Path, str]]] | None = None,
                 ) -> dict[str, Any] | None:
    """The summary of the finished run in run.out_dir that this config would only resume to
    stop at once, else None. A finished run is one whose newest checkpoint was written
    under this config's settings and has used its budget (run.max_steps, run.max_seconds),
    or that stopped at this config's target accuracy, and whose summary.json is there.

    Such a rerun does no work, so it must change no record: the trainer is not started,
    and nothing in out_dir is written (the README's "a finished run stops at once"). Call
    it on rank 0 only, after ownership of out_dir was taken."""
    if resume == "fresh":
        return None
    out_dir = Path(config.run.out_dir)
    found, _ = latest if latest is not None else ckpt.find_latest(ckpt.checkpoint_root(out_dir))
    if found is None or found.manifest.get("config_hash") != config_hash(config):
        return None
    try:
        summary = json.loads((out_dir / SUMMARY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("config_hash", config_hash(config)) \
            != config_hash(config):
        return None
    spent = StopRules.from_config(config).budget_spent(found.step, found.wall_seconds)
    target = run_target(config.run)
    at_target = (target is not None and summary.get("stop_reason") == target.reason
                 and summary.get("target") == target.to_dict()
                 and summary.get("steps", found.step) == found.step)
    if not spent and not at_target:
        return None
    why = (f"run.{spent} = {getattr(config.run, spent):g}" if spent
           else f"the target {target.metric} {target.value:g} was reached")
    say(stream, f"distbelief: {out_dir} holds a finished run ({why}; its checkpoint is at "
                f"step {found.step}): nothing to train, and its records are left as they "
                f"are. Raise run.{spent or 'max_steps'} to train on, or pass --fresh to "
                f"start over")
    return summary


def check_replica_count(found: ckpt.Checkpoint | None, replicas: int, kind: str,
                        extra_ranks: int = 0, why: str = "") -> None:
    """Refuse a checkpoint written by another number of replicas (what it keeps per
    replica, data positions or optimizer states, fits no other count) with one
    CheckpointError that says how to resume it; `extra_ranks`: the job's ranks that are
    not replicas (a shard)."""
    if found is None or found.num_replicas == replicas:
        return
    ranks = found.num_replicas + extra_ranks
    raise ckpt.CheckpointError(
        f"checkpoint {found.path} was written by {found.num_replicas} {kind} replica(s)"
        f"{why}, so it resumes on {ranks} ranks (mpiexec -n {ranks}), not "
        f"{replicas + extra_ranks}; or pass --fresh to start over")


def start_over(out_dir: str | Path, resume: str, stream: IO[str] | None) -> None:
    """Before a run starts from step 0 in out_dir: with --fresh, move the previous run's
    files aside; without it, do the same if a previous run left metrics or a summary but
    no checkpoint to resume from (they are never overwritten), and say so in one line.
    Call it on rank 0 only, after ownership of out_dir was taken."""
    out_dir = Path(out_dir)
    if resume != "fresh" and not any((out_dir / name).exists()
                                     for name in (METRICS_FILE, SUMMARY_FILE, DISCARDED_FILE)):
        return
    moved = archive_previous_run(out_dir)
    if moved is None:
        return
    if resume == "fresh":
        say(stream, f"distbelief: --fresh: moved the previous run's files to {moved}")
    else:
        say(stream, f"distbelief: starting from step 0: {out_dir} held a previous run's "
                       f"metrics but no checkpoint to resume from; moved its files to {moved}")


ARCHIVED_NAMES = (ckpt.CHECKPOINTS_DIR, METRICS_FILE, DISCARDED_FILE, SUMMARY_FILE,
                  "config.json", tensorboard.TENSORBOARD_DIR)


def archive_previous_run(out_dir: str | Path) -> Path | None:
    """Move a previous run's files (checkpoints, metrics, summary, config, events) into
    out_dir/previous-<UTC time>/; returns that folder, or None if there was nothing."""
    out_dir = Path(out_dir)
    present = [out_dir / name for name in ARCHIVED_NAMES if (out_dir / name).exists()]
    if not present:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    target = out_dir / f"previous-{stamp}"
    n = 1
    while target.exists():
        n += 1
        target = out_dir / f"previous-{stamp}-{n}"
    target.mkdir()
    for path in present:
        os.rename(path, target / path.name)
    return target


@contextmanager
def watched_run(comm: Any, describe: Callable[[int], str],
                run: Any) -> Iterator[tuple[StopSignals, Any]]:
    """The frame an MPI trainer's loop runs in, yielding (stop signals, liveness.Peers):
    this rank's stall watchdog (watchdog.current() inside), every rank catching the stop
    signals (launchers forward them to all; the trainer decides who acts), numpy's
    overflow warnings off (a diverging run is reported once, as TrainingDiverged); the
    Peers are closed on the way out. Collective over `comm` on entry (watchdog.for_job: an
    allgather of every rank's identity; on several nodes each node beats in out_dir
    until the end, so a rank dying on another node is found within the heartbeat
    timeout). `run` is the [run] configuration, `describe(rank)` names a rank."""
    guard, peers = watchdog.for_job(comm, describe, run)
    with np.errstate(over="ignore", invalid="ignore"), watchdog.watching(guard), \
            StopSignals() as signals:
        try:
            yield signals, peers
        finally:
            peers.close()


@dataclass
class WireBytes:
    """The bytes one replica put on the wire and took off it, counted where it calls the
    transport or the collective: the payload handed in and received back (an all-reduce's
    own traffic depends on the MPI's algorithm; docs/comparing-algorithms.md, "Bytes on
    the wire")."""

    sent: int = 0
    received: int = 0

    def add(self, sent: int = 0, received: int = 0) -> None:
        self.sent += int(sent)
        self.received += int(received)

    def pair(self) -> tuple[int, int]:
        return self.sent, self.received


def apply_step(optimizer: Any, network: Any, params: np.ndarray, grad: np.ndarray,
               update: int) -> int:
    """The optimizer's step of `params` with `grad`, in place, where a replica applies its
    own gradient: a sparse model's touched coordinates alone (its batch's rows and its dense
    part: model.sparse_network) where the rule updates coordinates independently
    (ShardRule.step_at), else the whole vector. The same for Adagrad and SGD, whose step
    leaves a zero gradient's coordinates as they are; momentum and Adam then move a row
    only when a batch touches it (lazily, as PyTorch's SparseAdam). Returns how many
    parameters it wrote."""
    touched = network.touched()
    if touched is None or not optimizer.elementwise:
        optimizer.step(params, grad, update=update)
        return int(params.size)
    optimizer.step_at(params, grad, touched, update=update)
    return len(touched)


def traffic_summary(traffic: list[tuple[int, int]]) -> dict[str, Any]:
    """The summary's bytes on the wire from each replica's (bytes sent, bytes received),
    in replica order: the totals and each replica's (records.metrics adds them per sample
    trained). What counts as sent is each algorithm's to say (docs/comparing-algorithms.md,
    "Bytes on the wire"): the payload it hands the transport or the collective."""
    sent, received = sum(int(t[0]) for t in traffic), sum(int(t[1]) for t in traffic)
    return {"bytes_sent": sent, "bytes_received": received,
            "replica_bytes": [{"replica": i, "bytes_sent": int(s), "bytes_received": int(r)}
                              for i, (s, r) in enumerate(traffic)]}
