"""The three sparse workloads against their peers, every figure measured in the same run:
time to a common test-loss target, the loss reached, and samples per second.

- **Sparse logistic regression vs Vowpal Wabbit** (`pip install vowpalwabbit`; the Python
  package's own driver, the same C++ learner as the `vw` binary). The training rows are
  written as VW text (`label | id:value ...`, labels -1/+1, the default namespace, so
  feature id i is VW's weight i: `-b` is chosen with no collision, the constant's slot
  included) and VW builds its binary cache in one untimed pass over the text (reported
  for scale). VW then trains from the cache with its defaults (`--loss_function logistic`,
  adaptive, normalized and invariant updates, learning rate 0.5, a constant) and
  `--holdout_off`, on a ladder of budgets (a fraction of one pass with `--examples`, then
  whole `--passes`), bisected to the smallest budget whose model reaches the target on
  the test rows (`-t -i model -p preds`, the log-loss of the raw scores computed here).
  VW's figure is that run's time from start to the model written, in its own process;
  writing the text, building the cache and scoring the test rows are not counted.
  Ours: examples/sparse_logistic.toml with 1 replica (sgd), 2 replicas (downpour,
  `mpiexec -n 3`: 1 shard + 2 replicas) and Hogwild with 2 workers (`mpiexec -n 2`).
- **Matrix factorisation vs PyTorch**: examples/matrix_factorisation.toml's model (a user
  and an item row of `dim`, their dot product plus one scalar bias, mse) as
  `nn.Embedding(sparse=True)` (users and items in one table, items after users) and
  `torch.optim.Adagrad` (sparse gradients) at our learning rate and batch size, one
  process and torch's Hogwild (torch.multiprocessing, 2 processes, model and Adagrad
  state in shared memory), against ours with sgd and Hogwild on 2 ranks.
- **Embeddings feeding a dense tower vs PyTorch**: examples/embeddings_tower.toml's model
  (a table per field, the rows concatenated plus a bias, Linear + tanh, Linear, binary
  cross-entropy) as one `nn.Embedding(sparse=True)` with per-field offsets and
  `nn.Linear` layers, one Adagrad over all of them, one process and Hogwild.

Same data, init rule (tables uniform in +-sqrt(3/dim), Glorot for the dense layers, biases
0), batch size, learning rate and update rule on both sides; one thread per process
(OPENBLAS_NUM_THREADS=1, torch.set_num_threads(1)). Ours and torch evaluate the whole test
split every 0.25 s, evaluation time counted, and stop at the target, so their times are
rounded up to that cadence; ours' figure is summary.json's time_to_target (from the start
of training: process start, MPI set-up and data loading excluded), torch's from the
moment every process is ready (data already in memory). Targets are the planted model's
test loss (the floor) times a factor: log-loss 1.1x the floor for the logistic and tower
workloads, mse 1.5x for matrix factorisation. Ours on the logistic workload runs at
Adagrad rate --logistic-lr (0.5, VW's own default rate); the example's 0.2 needs several
passes where VW needs one.

    python benchmarks/bench_sparse.py                  # all three, 3 rounds: about 4 min
    python benchmarks/bench_sparse.py --only mf        # one workload
    python benchmarks/bench_sparse.py --quick          # smoke run on small data, < 1 min

Prints a markdown table per workload: each row's medians over --repeats interleaved
rounds, every round's time in the note. "vs peer" is the peer's median time to target over
ours (below 1: the peer is faster), the peer being VW for every logistic row, torch's one
process for our one process and torch's Hogwild for ours. "samples to target" counts the
samples of every worker; "whole command" is ours' `distbelief train` from launch to exit
(interpreter and MPI start-up, data loading, the final test and checkpoint included); the
load is the highest 1-minute load average seen before a run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
VW_CONSTANT_HASH = 11650396
"""VW's constant feature's hash (its `constant` in the source): its weight sits at this
modulo 2**bits, which must not be a feature id's slot."""
VW_TIMER = ("import sys, time, vowpalwabbit\n"
            "start = time.perf_counter()\n"
            "vowpalwabbit.Workspace(arg_list=sys.argv[1:]).finish()\n"
            "print(time.perf_counter() - start)\n")
"""VW's driver in a process of its own, timed from the workspace's creation (which reads
the data and learns) to the model written by finish(): no interpreter start-up."""


@dataclass(frozen=True)
class Workload:
    """One sparse workload: its data, our config, the target and the evaluation cadence."""

    name: str
    kind: str               # distbelief prepare sparse-synthetic KIND
    config: str             # the example in examples/
    options: tuple[str, ...]
    quick_options: tuple[str, ...]
    target_factor: float    # the target: the floor times this
    eval_every: float       # seconds between evaluations, both sides
    title: str


WORKLOADS = {
    "logistic": Workload(
        "logistic", "logistic", "sparse_logistic.toml",
        ("--features", "20000", "--train", "500000"),
        ("--features", "2000", "--train", "60000", "--test", "5000"),
        1.1, 0.25, "Sparse logistic regression vs Vowpal Wabbit"),
    "mf": Workload(
        "mf", "mf", "matrix_factorisation.toml",
        ("--users", "2000", "--items", "1000", "--train", "1000000"),
        ("--users", "300", "--items", "200", "--train", "100000", "--test", "5000"),
        1.5, 0.25, "Matrix factorisation vs PyTorch"),
    "fields": Workload(
        "fields", "fields", "embeddings_tower.toml",
        ("--fields", "8", "--field-rows", "1000", "--train", "500000"),
        ("--fields", "4", "--field-rows", "100", "--train", "60000", "--test", "5000"),
        1.1, 0.25, "Embeddings + dense tower vs PyTorch"),
}


@dataclass
class Result:
    """One run's figures; `seconds` is None when it missed the target."""

    name: str
    seconds: float | None
    samples: int            # trained on when it stopped: at the target, if it met it
    loss: float
    samples_per_second: float
    load: float
    peer: str | None = None   # the name of the row this one is measured against
    note: str = ""
    command: float | None = None  # ours: the whole command's seconds, start-up included


# -- data ------------------------------------------------------------------------------


def prepare(work: Workload, folder: Path, quick: bool) -> tuple[Path, float]:
    """Generate the workload's synthetic data; returns the file and its floor."""
    path = folder / f"{work.name}.h5"
    options = work.quick_options if quick else work.options
    subprocess.run([sys.executable, "-m", "distbelief", "prepare", "sparse-synthetic",
                    work.kind, *options, "--out", str(path)], check=True,
                   stdout=subprocess.DEVNULL)
    return path, floor_of(path)


def floor_of(path: Path) -> float:
    """The planted model's test loss, from the file's `source` attribute."""
    import h5py

    with h5py.File(path, "r") as f:
        source = str(f.attrs["source"])
    found = re.search(r"test (?:log-loss|mse) is ([0-9.]+)", source)
    if found is None:
        raise SystemExit(f"{path}: no floor in its source attribute: {source!r}")
    return float(found.group(1))


def load(path: Path, split: str):
    """(x, y) of a split as the trainers see them: SparseRows or int64 ids, float targets."""
    from distbelief.data.hdf5 import load_split, open_dataset

    x, y = load_split(open_dataset(path), split)
    return x, np.asarray(y, dtype=np.float32).reshape(-1)


def example_config(work: Workload) -> dict:
    with open(EXAMPLES / work.config, "rb") as f:
        return tomllib.load(f)


# -- ours ------------------------------------------------------------------------------


def run_ours(work: Workload, data: Path, algorithm: str, ranks: int, target: float,
             out: Path, max_seconds: float, extra: tuple[str, ...] = ()) -> Result:
    """`distbelief train` on the workload's example, evaluating the test split; `extra`:
    more --set overrides."""
    sets = [*extra, f'data.path="{data}"', "data.validation=0",
            f'optimizer.algorithm="{algorithm}"', f"run.target_loss={target}",
            f"run.max_seconds={max_seconds}", f"run.eval_every_seconds={work.eval_every}",
            f'run.out_dir="{out}"',
            "run.threads=1", "run.checkpoint_every_seconds=0", "run.keep_best=false",
            f"cluster.ps_shards={1 if algorithm == 'downpour' else 0}"]
    cmd = [sys.executable, "-m", "distbelief", "train", str(EXAMPLES / work.config),
           "--fresh", *[a for s in sets for a in ("--set", s)]]
    if ranks > 1:
        cmd = ["mpiexec", "-n", str(ranks), *cmd]
    before, started = os.getloadavg()[0], time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **ONE_THREAD},
                          timeout=max_seconds + 180, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"distbelief failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    label = {"sgd": "ours, sgd (1 process)",
             "downpour": "ours, downpour (1 shard + 2 replicas)",
             "hogwild": f"ours, hogwild ({ranks} workers)"}[algorithm]
    return Result(label, summary["time_to_target"], summary["samples"],
                  summary["final_test_loss"], summary["samples_per_second"], before,
                  command=time.perf_counter() - started)


# -- Vowpal Wabbit ---------------------------------------------------------------------


def vw_bits(n_features: int) -> int:
    """The fewest hash bits that hold every feature id apart from the constant's slot."""
    bits = max(1, math.ceil(math.log2(n_features + 1)))
    while VW_CONSTANT_HASH % 2**bits < n_features:
        bits += 1
    return bits


def join_pieces(pieces: list[bytes], sequence: np.ndarray) -> bytes:
    """b"".join(pieces[i] for i in sequence), gathered with numpy."""
    lengths = np.array([len(p) for p in pieces], dtype=np.int64)
    table = np.frombuffer(b"".join(pieces), dtype=np.uint8)
    starts = np.cumsum(lengths) - lengths
    sizes = lengths[sequence]
    out_starts = np.cumsum(sizes) - sizes
    index = np.repeat(starts[sequence] - out_starts, sizes) + np.arange(sizes.sum())
    return table[index].tobytes()


def vw_text(x, y: np.ndarray) -> bytes:
    """Rows of SparseRows as VW text: `1 | 17:0.25 40:0.5` (labels -1/+1)."""
    indptr = x.indptr - x.indptr[0]
    values, value_index = np.unique(x.values, return_inverse=True)
    pieces = ([b"-1 |", b"1 |", b"\n"] + [f" {i}:".encode() for i in range(x.n_features)]
              + [f"{v:.7g}".encode() for v in values])
    rows, nnz = len(y), int(indptr[-1])
    sequence = np.empty(2 * rows + 2 * nnz, dtype=np.int64)
    row_of = np.repeat(np.arange(rows), np.diff(indptr))
    entry = 2 * np.arange(nnz) + 2 * row_of
    sequence[entry + 1] = 3 + x.indices
    sequence[entry + 2] = 3 + x.n_features + value_index.reshape(-1)
    sequence[2 * indptr[:-1] + 2 * np.arange(rows)] = (y > 0.5).astype(np.int64)
    sequence[2 * indptr[1:] + 2 * np.arange(rows) + 1] = 2
    return join_pieces(pieces, sequence)


def write_vw(x, y: np.ndarray, path: Path, block: int = 20_000) -> None:
    with open(path, "wb") as f:
        f.writelines(vw_text(x[start:start + block], y[start:start + block])
                     for start in range(0, len(y), block))


class VowpalWabbit:
    """VW on one training file and its cache, and the test rows it is scored on."""

    def __init__(self, folder: Path, data: Path):
        self.folder = folder
        x, y = load(data, "train")
        self.n_train, self.bits = len(y), vw_bits(x.n_features)
        self.train = folder / "train.vw"
        write_vw(x, y, self.train)
        del x
        test_x, self.test_y = load(data, "test")
        self.test = folder / "test.vw"
        write_vw(test_x, self.test_y, self.test)
        self.cache = folder / "train.vw.cache"
        self.text_pass_seconds = self._train(["--passes", "1"])  # builds the cache

    def _train(self, budget: list[str]) -> float:
        model = self.folder / "vw.model"
        args = ["-d", str(self.train), "--cache_file", str(self.cache), "-b", str(self.bits),
                "--loss_function", "logistic", "--holdout_off", "--quiet",
                "-f", str(model), *budget]
        done = subprocess.run([sys.executable, "-c", VW_TIMER, *args], capture_output=True,
                              text=True, check=True, env={**os.environ, **ONE_THREAD})
        return float(done.stdout.split()[-1])

    def test_loss(self) -> float:
        preds = self.folder / "vw.preds"
        subprocess.run([sys.executable, "-m", "vowpalwabbit", "-d", str(self.test), "-t",
                        "-i", str(self.folder / "vw.model"), "-p", str(preds), "--quiet"],
                       check=True, capture_output=True)
        margin = np.loadtxt(preds, ndmin=1)
        signed = np.where(self.test_y > 0.5, margin, -margin)
        return float(np.mean(np.logaddexp(0.0, -signed)))

    def run(self, samples: int) -> tuple[float, float]:
        """(seconds, test log-loss) of one fresh run over `samples` examples: a prefix of
        one pass, or whole passes."""
        if samples <= self.n_train:
            budget = ["--passes", "1", "--examples", str(samples)]
        else:
            budget = ["--passes", str(samples // self.n_train)]
        seconds = self._train(budget)
        return seconds, self.test_loss()

    def budgets(self) -> list[int]:
        fractions = [self.n_train // 2**k for k in (5, 4, 3, 2, 1)]
        return fractions + [self.n_train * p for p in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)]

    def time_to_target(self, target: float) -> Result:
        """The smallest budget on the ladder that reaches the target, bisected three times
        between it and the budget below."""
        before, low, found = os.getloadavg()[0], 0, None
        for samples in self.budgets():
            seconds, loss = self.run(samples)
            if loss <= target:
                found = (samples, seconds, loss)
                break
            low = samples
        if found is None:
            return Result("Vowpal Wabbit", None, samples, loss, samples / seconds, before,
                          note=f"missed in {samples // self.n_train} passes")
        for _ in range(3):
            middle = self._middle(low, found[0])
            if middle is None:
                break
            seconds, loss = self.run(middle)
            if loss <= target:
                found = (middle, seconds, loss)
            else:
                low = middle
        samples, seconds, loss = found
        return Result("Vowpal Wabbit", seconds, samples, loss, samples / seconds, before)

    def _middle(self, low: int, high: int) -> int | None:
        if high <= self.n_train:
            middle = (low + high) // 2
        else:
            middle = self.n_train * ((low + high) // (2 * self.n_train))
        return middle if low < middle < high else None


# -- PyTorch ---------------------------------------------------------------------------


def torch_models():
    """The two torch models, built on first use (torch is imported only for them)."""
    import torch
    from torch import nn

    def glorot(layer: nn.Linear) -> nn.Linear:
        limit = math.sqrt(6.0 / (layer.in_features + layer.out_features))
        nn.init.uniform_(layer.weight, -limit, limit)
        nn.init.zeros_(layer.bias)
        return layer

    class Tables(nn.Module):
        """One nn.Embedding(sparse=True) for every field's table, field f's rows after
        field f-1's: a (B, F) id batch gives (B, F, dim)."""

        def __init__(self, id_rows: list[int], dim: int):
            super().__init__()
            self.table = nn.Embedding(sum(id_rows), dim, sparse=True)
            limit = math.sqrt(3.0 / dim)
            nn.init.uniform_(self.table.weight, -limit, limit)
            self.register_buffer("offsets", torch.tensor(np.cumsum([0, *id_rows[:-1]])))

        def forward(self, ids):
            return self.table(ids + self.offsets)

    class MatrixFactorisation(nn.Module):
        def __init__(self, id_rows: list[int], dim: int):
            super().__init__()
            self.tables = Tables(id_rows, dim)
            self.bias = nn.Parameter(torch.zeros(1))

        def forward(self, ids):
            rows = self.tables(ids)
            return (rows[:, 0] * rows[:, 1]).sum(1) + self.bias

    class Tower(nn.Module):
        def __init__(self, id_rows: list[int], dim: int, hidden: int):
            super().__init__()
            self.tables = Tables(id_rows, dim)
            self.bias = nn.Parameter(torch.zeros(len(id_rows) * dim))
            self.hidden = glorot(nn.Linear(len(id_rows) * dim, hidden))
            self.out = glorot(nn.Linear(hidden, 1))

        def forward(self, ids):
            z = self.tables(ids).flatten(1) + self.bias
            return self.out(torch.tanh(self.hidden(z))).squeeze(1)

    return MatrixFactorisation, Tower


@dataclass(frozen=True)
class TorchJob:
    """What every torch worker needs: data, batch, cadence, target, budget."""

    x: object
    y: object
    test_x: object
    test_y: object
    loss: str               # "mse" or "bce"
    batch_size: int
    lr: float
    eval_every: float
    target: float
    max_seconds: float
    workers: int
    seed: int = 0


def torch_loss(job: TorchJob, out, y):
    import torch.nn.functional as F

    if job.loss == "mse":
        return F.mse_loss(out, y)
    return F.binary_cross_entropy_with_logits(out, y)


def torch_train(rank: int, job: TorchJob, model, optimizer, stop, start: float) -> dict:
    """Train on this worker's contiguous part of the rows (a fresh permutation of it each
    epoch) until `stop`; worker 0 evaluates every job.eval_every seconds, counted from
    the end of the previous evaluation, and sets `stop` at the target or the budget."""
    import torch

    torch.set_num_threads(1)
    n = len(job.y)
    lo, hi = n * rank // job.workers, n * (rank + 1) // job.workers
    rng = np.random.default_rng([job.seed, rank])
    steps, out = 0, {"loss": math.nan, "seconds": None}
    next_eval = start + job.eval_every
    while not stop.is_set():
        order = torch.from_numpy(lo + rng.permutation(hi - lo))
        for first in range(0, len(order) - job.batch_size + 1, job.batch_size):
            batch = order[first:first + job.batch_size]
            optimizer.zero_grad()
            torch_loss(job, model(job.x[batch]), job.y[batch]).backward()
            optimizer.step()
            steps += 1
            if rank == 0 and time.perf_counter() >= next_eval:
                finish_or_go_on(job, model, out, stop, start)
                next_eval = time.perf_counter() + job.eval_every
            if stop.is_set():
                break
    out["steps"], out["wall"] = steps, time.perf_counter() - start
    return out


def finish_or_go_on(job: TorchJob, model, out: dict, stop, start: float) -> None:
    """One evaluation of the whole test split: stop at the target or past the budget."""
    import torch

    with torch.no_grad():
        out["loss"] = float(torch_loss(job, model(job.test_x), job.test_y))
    elapsed = time.perf_counter() - start
    if out["loss"] <= job.target:
        out["seconds"] = elapsed
        stop.set()
    elif elapsed >= job.max_seconds:
        stop.set()


def _hogwild_worker(rank, job, model, optimizer, ready, stop, queue) -> None:
    ready.wait()
    queue.put((rank, torch_train(rank, job, model, optimizer, stop, time.perf_counter())))


def run_torch(job: TorchJob, model) -> Result:
    """One process, or torch's Hogwild over job.workers processes sharing the model and
    the Adagrad state; returns worker 0's figures with every worker's samples."""
    import threading

    import torch
    import torch.multiprocessing as mp

    torch.sparse.check_sparse_tensor_invariants.disable()  # opted out: torch's default
    torch.set_num_threads(1)  # here too: no thread pool in a process that forks
    optimizer = torch.optim.Adagrad(model.parameters(), lr=job.lr)
    before = os.getloadavg()[0]
    if job.workers == 1:
        results = {0: torch_train(0, job, model, optimizer, threading.Event(),
                                  time.perf_counter())}
        name = "torch, one process"
    else:
        model.share_memory()
        optimizer.share_memory()  # the Adagrad sums are shared too
        ctx = mp.get_context("fork")
        ready, stop, queue = ctx.Barrier(job.workers), ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_hogwild_worker,
                             args=(r, job, model, optimizer, ready, stop, queue))
                 for r in range(job.workers)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=job.max_seconds + 120) for _ in procs)
        for p in procs:
            p.join()
        name = f"torch, hogwild ({job.workers} processes)"
    first = results[0]
    samples = sum(r["steps"] for r in results.values()) * job.batch_size
    return Result(name, first["seconds"], samples, first["loss"], samples / first["wall"],
                  before)


# -- the workloads ---------------------------------------------------------------------


def logistic(work: Workload, folder: Path, args: argparse.Namespace) -> list[Result]:
    data, floor = prepare(work, folder, args.quick)
    target = round(floor * work.target_factor, 4)
    vw = VowpalWabbit(folder, data)
    rate = (f"optimizer.learning_rate={args.logistic_lr}",)
    rounds = []
    for _ in range(args.repeats):  # interleaved, so load drifts hit every row alike
        results = [vw.time_to_target(target)]
        for algorithm, ranks in (("sgd", 1), ("downpour", 3), ("hogwild", 2)):
            results.append(run_ours(work, data, algorithm, ranks, target,
                                    folder / f"run-{algorithm}", args.max_seconds, rate))
            results[-1].peer = results[0].name
        rounds.append(results)
    heading(work, floor, target, f"{vw.n_train:,d} training rows; ours at learning rate "
            f"{args.logistic_lr:g}; VW's one pass over the text, building its cache (not "
            f"counted): {vw.text_pass_seconds:.2f} s")
    return medians(rounds)


def embeddings(work: Workload, folder: Path, args: argparse.Namespace) -> list[Result]:
    import torch

    data, floor = prepare(work, folder, args.quick)
    target = round(floor * work.target_factor, 4)
    config = example_config(work)
    layers = config["model"]["layers"]
    (x, y), (test_x, test_y) = load(data, "train"), load(data, "test")
    from distbelief.data.hdf5 import open_dataset

    id_rows = [int(r) for r in open_dataset(data).id_rows]
    job = TorchJob(torch.from_numpy(x.astype(np.int64)), torch.from_numpy(y),
                   torch.from_numpy(test_x.astype(np.int64)), torch.from_numpy(test_y),
                   "mse" if config["model"]["loss"] == "mse" else "bce",
                   config["data"]["batch_size"], config["optimizer"]["learning_rate"],
                   work.eval_every, target, args.max_seconds, workers=1)
    mf_model, tower_model = torch_models()

    def build():
        torch.manual_seed(0)
        if work.name == "mf":
            return mf_model(id_rows, layers[0]["dim"])
        return tower_model(id_rows, layers[0]["dim"], layers[1]["units"])

    rounds = []
    for _ in range(args.repeats):  # interleaved, so load drifts hit every row alike
        results = []
        for workers, algorithm in ((1, "sgd"), (2, "hogwild")):
            theirs = run_torch(replace(job, workers=workers), build())
            ours = run_ours(work, data, algorithm, workers, target,
                            folder / f"run-{algorithm}", args.max_seconds)
            ours.peer = theirs.name
            results += [theirs, ours]
        rounds.append(results)
    heading(work, floor, target, f"{len(y):,d} training rows")
    return medians(rounds)


def medians(rounds: list[list[Result]]) -> list[Result]:
    """Each row's medians over the rounds; a missed target counts as the slowest time,
    and a row that missed it in most rounds is reported missed. The note lists every
    round's time, the load column holds the highest load."""
    merged = []
    for runs in zip(*rounds):
        times = [math.inf if r.seconds is None else r.seconds for r in runs]
        seconds = statistics.median(times)
        listed = ", ".join("missed" if t == math.inf else f"{t:.2f}" for t in times)
        merged.append(Result(
            runs[0].name, None if seconds == math.inf else seconds,
            int(statistics.median(r.samples for r in runs)),
            statistics.median(r.loss for r in runs),
            statistics.median(r.samples_per_second for r in runs),
            max(r.load for r in runs), runs[0].peer,
            f"{listed} s" if len(runs) > 1 else "",
            None if runs[0].command is None else statistics.median(r.command for r in runs)))
    return merged


# -- printing --------------------------------------------------------------------------


def heading(work: Workload, floor: float, target: float, size: str) -> None:
    metric = "mse" if work.name == "mf" else "log-loss"
    print(f"\n### {work.title}\n\n{size}; the planted model's test {metric} (the floor) "
          f"{floor:.4f}; target {target:.4f} ({work.target_factor:g}x the floor); "
          f"evaluation every {work.eval_every:g} s\n", flush=True)


TABLE_HEADER = ("| run | to target (s) | samples to target | test loss | samples/s | vs peer "
                "| whole command (s) | load (max) | note |")


def table(results: list[Result]) -> str:
    by_name = {r.name: r for r in results}
    lines = [TABLE_HEADER, "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        peer = by_name.get(r.peer) if r.peer else None
        ratio = (f"{peer.seconds / r.seconds:.2f}" if peer and peer.seconds and r.seconds
                 else "")
        seconds = f"{r.seconds:.2f}" if r.seconds is not None else "missed"
        command = "" if r.command is None else f"{r.command:.1f}"
        lines.append(f"| {r.name} | {seconds} | {r.samples:,d} | {r.loss:.4f} "
                     f"| {r.samples_per_second:,.0f} | {ratio} | {command} | {r.load:.2f} "
                     f"| {r.note} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=sorted(WORKLOADS))
    parser.add_argument("--quick", action="store_true",
                        help="small data and a short budget: a smoke run")
    parser.add_argument("--logistic-lr", type=float, default=0.5,
                        help="ours' Adagrad rate on the logistic workload (default 0.5, "
                             "VW's own default rate; the example's is 0.2)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="rounds of every row, interleaved; the table has medians "
                             "(default 3, --quick 1)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="each run's budget (default 120, --quick 20)")
    args = parser.parse_args()
    if args.max_seconds is None:
        args.max_seconds = 20.0 if args.quick else 120.0
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    runners = {"logistic": logistic, "mf": embeddings, "fields": embeddings}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-sparse-") as tmp:
        for name in [args.only] if args.only else list(WORKLOADS):
            folder = Path(tmp) / name
            folder.mkdir()
            results = runners[name](WORKLOADS[name], folder, args)
            print(table(results), flush=True)
    print(f"\n(total {time.perf_counter() - started:.0f} s; load average now "
          f"{os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
