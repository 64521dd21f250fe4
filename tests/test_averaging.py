"""Parameter averaging (`algorithm = "averaging"`) and EASGD (`elastic_alpha` set), end to
end through the command line as MPI jobs under timeouts, checked against reference
computations in numpy; plus the pure pieces in-process.

- collective averaging at R = 2 and R = 3: every replica holds the same parameters right
  after every average, and they are those of a numpy reference that trains R replicas on
  the same data parts and averages them every tau steps;
- a lost replica ends a collective averaging run with one line and a non-zero exit;
- EASGD: the elastic update against its formula; one replica against a numpy reference of
  the exchange; 3 replicas train, and a killed one does not stop the others.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import exit_statuses, set_args
from helpers.mpi_jobs import REPO, job_env, run_mpi, survive_a_death

from distbelief.algorithms.averaging.collective import check_job
from distbelief.algorithms.averaging.elastic import CenterUpdate, elastic_step
from distbelief.config import build_network, load_config
from distbelief.data.hdf5 import TrainShard, open_dataset
from distbelief.errors import DataError
from distbelief.model.optimizers import make_optimizer
from distbelief.records import checkpoint as ckpt
from distbelief.records.report import THROUGHPUT_FIGURE, load_run, plot_runs
from distbelief.runtime.launching.faults import ENV as FAULTS

PROGRAMS = REPO / "tests" / "mpi_programs"
TIMEOUT = 120
TAU = 4


@pytest.fixture(scope="module")
def data_dir(synthetic_folder, small_config) -> Path:
    return synthetic_folder("averaging", {"synth.toml": small_config(
        16, optimizer={"algorithm": "averaging", "average_every": TAU}, cluster=None,
        run={"max_steps": 1000, "eval_every_seconds": 0.5, "progress_every_seconds": 1})},
        n_train=3000, input_shape=(12,), seed=7)


def train_job(n: int, data_dir: Path, out: Path, *overrides: str, program: list | None = None,
              faults: str = "", survive: bool = False):
    env = {**job_env(), FAULTS: faults}
    args = ["train", data_dir / "synth.toml",
            *set_args(f'run.out_dir="{out}"', "run.heartbeat_timeout_seconds=5", *overrides)]
    return run_mpi(n, [*(program or [PROGRAMS / "cli_exit_status.py"]), *args],
                   timeout=TIMEOUT, env=env,
                   launcher_options=survive_a_death() if survive else ())


def reference_averages(data_dir: Path, replicas: int, averages: int) -> list[np.ndarray]:
    """Collective averaging computed in one process: R replicas, each on its own part of
    the data with its own Adagrad, averaged (float64 mean) every TAU steps."""
    config = load_config(data_dir / "synth.toml", [])
    info = open_dataset(data_dir / "synth.h5")
    network = build_network(config, info)
    start = network.init_params(config.run.seed)
    params = [start.copy() for _ in range(replicas)]
    optimizers = [make_optimizer(True, config.optimizer.learning_rate, start.size)
                  for _ in range(replicas)]
    shards = [TrainShard(info, r, replicas, config.run.seed) for r in range(replicas)]
    grad, out = np.zeros_like(start), []
    for _ in range(averages):
        for p, optimizer, shard in zip(params, optimizers, shards, strict=True):
            for _ in range(TAU):
                x, y = shard.next_batch(config.data.batch_size)
                network.loss_and_grad(p, x, y, grad)
                optimizer.step(p, grad)
        mean = np.mean(params, axis=0, dtype=np.float64).astype(np.float32)
        for p in params:
            p[:] = mean
        out.append(mean)
    return out


@pytest.mark.parametrize("replicas", [2, 3])
def test_averaged_replicas_agree_and_match_the_reference(data_dir: Path, tmp_path: Path,
                                                         replicas: int) -> None:
    averages = 6
    out, trace = tmp_path / "out", tmp_path / "trace"
    trace.mkdir()
    proc = train_job(replicas, data_dir, out, f"run.max_steps={replicas * TAU * averages}",
                     program=[PROGRAMS / "averaging_trace.py", trace])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [np.load(trace / f"rank-{r}.npy") for r in range(replicas)]
    assert rows[0].shape[0] == averages
    for other in rows[1:]:  # identical right after every average, bit for bit
        np.testing.assert_array_equal(other, rows[0])
    reference = reference_averages(data_dir, replicas, averages)
    for k, (got, want) in enumerate(zip(rows[0], reference, strict=True)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"average {k}")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == "averaging" and summary["replicas"] == replicas
    assert summary["steps"] == replicas * TAU * averages and summary["averages"] == averages
    final = ckpt.find_latest(ckpt.checkpoint_root(out))[0]
    np.testing.assert_array_equal(final.read_state(with_optimizer=False)[0], rows[0][-1])
    assert final.num_replicas == replicas


def test_a_resumed_averaging_run_continues_exactly(data_dir: Path, tmp_path: Path) -> None:
    """Stopped at 3 averages and resumed to 6, the parameters are those of an
    uninterrupted run: each replica's own optimizer state and data position came back."""
    out, trace = tmp_path / "out", tmp_path / "trace"
    trace.mkdir()
    proc = train_job(3, data_dir, out, f"run.max_steps={3 * TAU * 3}")
    assert exit_statuses(proc) == [0, 0, 0], proc.stderr[-3000:]
    proc = train_job(3, data_dir, out, f"run.max_steps={3 * TAU * 6}",
                     program=[PROGRAMS / "averaging_trace.py", trace])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stdout
    resumed = np.load(trace / "rank-0.npy")
    assert resumed.shape[0] == 3
    np.testing.assert_allclose(resumed[-1], reference_averages(data_dir, 3, 6)[-1],
                               rtol=1e-5, atol=1e-6)
    proc = train_job(2, data_dir, out, f"run.max_steps={3 * TAU * 9}")
    assert exit_statuses(proc) == [2, 2], proc.stdout + proc.stderr
    assert "resumes on 3 ranks (mpiexec -n 3)" in proc.stderr


def test_a_lost_replica_ends_averaging_with_one_line(data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = train_job(3, data_dir, out, "run.max_steps=200000", "run.checkpoint_every_steps=60",
                     faults="kill:1:100 delay:*:0:0.001s", survive=True)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "replica 1 (rank 1) is gone" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "parameter averaging needs every replica" in lines[0]
    assert re.search(r"the last checkpoint \(step \d+\) survives it", lines[0]), lines[0]
    assert ckpt.find_latest(ckpt.checkpoint_root(out))[0] is not None


# -- EASGD ---------------------------------------------------------------------------------


def test_the_elastic_step_and_the_center_rule_follow_the_paper() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(50).astype(np.float32)
    center = rng.standard_normal(50).astype(np.float32)
    x0, alpha = x.copy(), 0.3
    e = elastic_step(x, center, alpha, np.empty_like(x))
    np.testing.assert_allclose(e, alpha * (x0 - center), rtol=1e-6)
    np.testing.assert_allclose(x, x0 - alpha * (x0 - center), rtol=1e-6)
    rule, copy = CenterUpdate(), np.empty_like(center)
    moved = center.copy()
    rule.step(moved, e, copy)
    np.testing.assert_allclose(moved, center + e, rtol=1e-6)
    np.testing.assert_array_equal(copy, moved)
    # x_i + x~ is conserved by an exchange (the paper's symmetric elastic force).
    np.testing.assert_allclose(x + moved, x0 + center, rtol=1e-5, atol=1e-6)
    assert rule.state() == {}
    with pytest.raises(ValueError, match="no optimizer state"):
        rule.load_state({"accum": center})


def reference_easgd(data_dir: Path, alpha: float, exchanges: int) -> np.ndarray:
    """One EASGD replica in one process: TAU Adagrad steps, then e = alpha (x - x~),
    x -= e, x~ += e. Returns the center."""
    config = load_config(data_dir / "synth.toml", [])
    info = open_dataset(data_dir / "synth.h5")
    network = build_network(config, info)
    center = network.init_params(config.run.seed)
    x = center.copy()
    optimizer = make_optimizer(True, config.optimizer.learning_rate, x.size)
    shard, grad = TrainShard(info, 0, 1, config.run.seed), np.zeros_like(x)
    for _ in range(exchanges):
        for _ in range(TAU):
            xs, ys = shard.next_batch(config.data.batch_size)
            network.loss_and_grad(x, xs, ys, grad)
            optimizer.step(x, grad)
        e = alpha * (x - center)
        x -= e
        center += e
    return center


@pytest.mark.parametrize("transport", ["shared", "rma"])
def test_one_easgd_replica_matches_the_reference(data_dir: Path, tmp_path: Path,
                                                 transport: str) -> None:
    out, exchanges = tmp_path / "out", 8
    env_transport = {"DISTBELIEF_PS_TRANSPORT": transport}
    proc = run_mpi(2, [PROGRAMS / "cli_exit_status.py", "train", data_dir / "synth.toml",
                       *set_args(f'run.out_dir="{out}"', "optimizer.elastic_alpha=0.25",
                                 f"run.max_steps={TAU * exchanges}")],
                   timeout=TIMEOUT, env={**job_env(), **env_transport})
    assert exit_statuses(proc) == [0, 0], proc.stderr[-3000:]
    final = ckpt.find_latest(ckpt.checkpoint_root(out))[0]
    center = final.read_state()[0]
    np.testing.assert_allclose(center, reference_easgd(data_dir, 0.25, exchanges),
                               rtol=1e-5, atol=1e-6)
    summary = json.loads((out / "summary.json").read_text())
    # EASGD names itself (issue 34), and report draws Downpour's figures for it.
    assert summary["algorithm"] == "easgd" and summary["elastic_alpha"] == 0.25
    assert summary["replicas"][0]["pushes"] == exchanges
    pytest.importorskip("matplotlib")
    written = plot_runs([load_run(out)], tmp_path / "report")
    assert THROUGHPUT_FIGURE in [path.name for path in written]


@pytest.mark.both_mpis
def test_easgd_trains_and_survives_a_killed_replica(data_dir: Path, tmp_path: Path) -> None:
    out, steps = tmp_path / "out", 3000
    proc = train_job(4, data_dir, out, "optimizer.elastic_alpha=0.3",
                     f"run.max_steps={steps}", faults="kill:2:200 delay:*:0:0.0002s",
                     survive=True)
    assert exit_statuses(proc) == [0, 0, 137, 0], proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "max_steps" and steps - TAU <= summary["steps"] <= steps
    assert [x["replica"] for x in summary["lost_replicas"]] == [1]
    assert summary["final_test_accuracy"] > 0.6, summary["final_test_accuracy"]


def test_a_batch_larger_than_a_replicas_rows_names_the_validation_split(data_dir):
    # Pure: the same error on every rank before any collective (issue 42: the count after
    # the validation split was printed as the file's).
    config = load_config(data_dir / "synth.toml", ["data.batch_size=1400",
                                                   "data.validation=0.1"])
    with pytest.raises(DataError, match=r"larger than the 1350 training rows each of the 2 "
                       r"replicas gets, from the 2700 training rows after the validation "
                       r"split \(data.validation = 0.1\) of the 3000 in \S+synth.h5;"):
        check_job(config, 2, 2700, 300)
