"""DiLoCo (`algorithm = "diloco"`), both forms, end to end through the command line as MPI
jobs under timeouts, checked against a numpy reference; plus the pure pieces in-process.

- the outer step: Nesterov against torch's formula, SGD at rate 1 is the plain average;
- the configuration: its keys, their errors, the config hash;
- synchronous (every rank a replica) at R = 2 and R = 3: the final parameters are those of
  a numpy reference (R replicas, H inner Adagrad steps each, the outer Nesterov step on the
  averaged delta); an exact resume; bytes on the wire in summary.json; a lost replica ends
  the run with one line;
- asynchronous (shards + replicas): one replica is the synchronous reference at R = 1 on
  both transports; 2 shards + 3 replicas train, and a killed replica does not stop them;
- delayed Nesterov (Async Local-SGD's outer rule): every R deltas make one Nesterov step on
  their mean, however they are folded and across a resume; at R = 1 it is Nesterov.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import DELAY, exit_statuses, set_args
from helpers.mpi_jobs import job_env, run_mpi, survive_a_death

from distbelief.algorithms.diloco.synchronous import OuterStep
from distbelief.config import (
    build_network,
    build_outer_optimizer,
    config_from_dict,
    config_hash,
    load_config,
)
from distbelief.data.hdf5 import TrainShard, open_dataset
from distbelief.errors import ConfigError
from distbelief.model import kernels
from distbelief.model.optimizers import DelayedNesterov, Momentum, make_optimizer
from distbelief.records import checkpoint as ckpt
from distbelief.records.report import THROUGHPUT_FIGURE, load_run, plot_runs
from distbelief.runtime.launching.faults import ENV as FAULTS

TIMEOUT = 150
H = 4


@pytest.fixture(scope="module")
def data_dir(synthetic_folder, small_config) -> Path:
    return synthetic_folder("diloco", {"synth.toml": small_config(
        16, optimizer={"algorithm": "diloco", "inner_steps": H}, cluster=None,
        run={"max_steps": 1000, "eval_every_seconds": 0.5, "progress_every_seconds": 1})},
        n_train=3000, input_shape=(12,), seed=7)


def train_job(n: int, data_dir: Path, out: Path, *overrides: str, faults: str = "",
              survive: bool = False, env: dict[str, str] | None = None):
    args = ["train", data_dir / "synth.toml",
            *set_args(f'run.out_dir="{out}"', "run.heartbeat_timeout_seconds=5", *overrides)]
    return run_mpi(n, [Path(__file__).parent / "mpi_programs" / "cli_exit_status.py", *args],
                   timeout=TIMEOUT, env={**job_env(), FAULTS: faults, **(env or {})},
                   launcher_options=survive_a_death() if survive else ())


def reference_diloco(data_dir: Path, replicas: int, rounds: int, lr: float = 0.7,
                     momentum: float = 0.9, narrow: bool = False) -> np.ndarray:
    """DiLoCo in one process: R replicas from theta, H Adagrad steps each on its own part
    of the data (its Adagrad state kept across rounds), then Nesterov on the mean delta,
    torch's form: buf = m buf + d; theta -= lr (d + m buf). With `narrow`, float32 all
    through: each replica's delta rounded to bfloat16, their mean summed in replica order
    times 1/R, the outer step, as a shard folds a narrowed push (R = 1) or the
    synchronous form averages all-gathered deltas. Returns theta."""
    config = load_config(data_dir / "synth.toml", [])
    info = open_dataset(data_dir / "synth.h5")
    network = build_network(config, info)
    theta = network.init_params(config.run.seed).astype(np.float64)
    buf = np.zeros_like(theta)
    optimizers = [make_optimizer(True, config.optimizer.learning_rate, theta.size)
                  for _ in range(replicas)]
    shards = [TrainShard(info, r, replicas, config.run.seed) for r in range(replicas)]
    grad = np.zeros(theta.size, np.float32)
    outer = Momentum(theta.size, lr, momentum, nesterov=True)
    for _ in range(rounds):
        finals = []
        for optimizer, shard in zip(optimizers, shards, strict=True):
            x = theta.astype(np.float32)
            for _ in range(H):
                xs, ys = shard.next_batch(config.data.batch_size)
                network.loss_and_grad(x, xs, ys, grad)
                optimizer.step(x, grad)
            finals.append(x.astype(np.float64))
        if narrow:  # float32 all through, as the replica and the shard compute it
            theta32 = theta.astype(np.float32)
            mean = np.zeros_like(theta32)
            for x in finals:
                delta32 = theta32 - x.astype(np.float32)
                kernels.bf16_round(delta32, delta32)
                mean += delta32
            if replicas > 1:
                mean *= np.float32(1.0 / replicas)
            outer.step(theta32, mean)
            theta = theta32.astype(np.float64)
            continue
        delta = theta - np.mean(finals, axis=0)
        buf = momentum * buf + delta
        theta = theta - lr * (delta + momentum * buf)
    return theta.astype(np.float32)


def final_params(out: Path) -> np.ndarray:
    return ckpt.find_latest(ckpt.checkpoint_root(out))[0].read_state()[0]


# -- the pure pieces -----------------------------------------------------------------------


def raw_config(**optimizer) -> dict:
    return {"model": {"layers": [{"type": "dense", "units": 4, "activation": "softmax"}]},
            "data": {"path": "x.h5"}, "optimizer": {"algorithm": "diloco", **optimizer},
            "run": {"max_steps": 10}}


def test_the_outer_step_is_nesterov_on_the_delta_and_sgd_at_rate_1_averages() -> None:
    rng = np.random.default_rng(0)
    theta = rng.standard_normal(40).astype(np.float32)
    step = OuterStep(config_from_dict(raw_config()), theta)
    buf, want = np.zeros(40), theta.astype(np.float64)
    for _ in range(3):
        average = (want + 0.1 * rng.standard_normal(40)).astype(np.float32)
        delta = want - average
        buf = 0.9 * buf + delta
        want = want - 0.7 * (delta + 0.9 * buf)
        step.apply(average)  # in place: the average becomes the new theta
        np.testing.assert_allclose(average, want, rtol=1e-5, atol=1e-6)
    assert step.rounds == 3 and set(step.state()) == {"outer_buf"}
    plain = OuterStep(config_from_dict(raw_config(outer_update="sgd",
                                                  outer_learning_rate=1.0)), theta)
    average = (theta + 1.0).astype(np.float32)
    expected = average.copy()
    plain.apply(average)
    np.testing.assert_allclose(average, expected, rtol=1e-6)  # parameter averaging
    # The asynchronous form's rule weighs a delta 1/R.
    half = build_outer_optimizer(config_from_dict(raw_config(outer_update="sgd")), 40, 2)
    assert half.rate(0) == pytest.approx(0.35)


def test_delayed_nesterov_makes_one_nesterov_step_per_period_on_the_mean() -> None:
    rng = np.random.default_rng(3)
    size, period, lr, momentum = 50, 3, 0.7, 0.9
    deltas = rng.standard_normal((2 * period, size)).astype(np.float32)
    theta = rng.standard_normal(size).astype(np.float32)
    delayed, nesterov = DelayedNesterov(size, lr, momentum, period), \
        Momentum(size, lr, momentum, nesterov=True)
    mine, want = theta.copy(), theta.copy()
    for block in range(2):
        for k in range(period):
            before = mine.copy()
            delayed.step(mine, deltas[block * period + k], update=block * period + k)
            if k < period - 1:  # between milestones: the delta alone, at lr / period
                np.testing.assert_allclose(
                    mine, before - lr / period * deltas[block * period + k], rtol=1e-6)
        nesterov.step(want, deltas[block * period:(block + 1) * period].mean(axis=0))
        np.testing.assert_allclose(mine, want, rtol=1e-5, atol=1e-6)
    assert not np.any(delayed.pending)
    # Period 1 is Nesterov itself.
    one, plain = DelayedNesterov(size, lr, momentum, 1), Momentum(size, lr, momentum,
                                                                  nesterov=True)
    a, b = theta.copy(), theta.copy()
    for k, delta in enumerate(deltas):
        one.step(a, delta, update=k)
        plain.step(b, delta)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_delayed_nesterov_in_blocks_is_the_same_step(monkeypatch) -> None:
    """A shard's slice is updated in blocks (bounded temporaries): 7-value blocks over 50
    values give the same parameters as one pass."""
    from distbelief.model import optimizers

    rng = np.random.default_rng(5)
    deltas = rng.standard_normal((5, 50)).astype(np.float32)
    theta = rng.standard_normal(50).astype(np.float32)
    results = []
    for block in (optimizers.BLOCK_VALUES, 7):
        monkeypatch.setattr(optimizers, "BLOCK_VALUES", block)
        rule, x = DelayedNesterov(50, 0.7, 0.9, 2), theta.copy()
        for k, delta in enumerate(deltas):
            rule.step(x, delta, update=k)
        results.append(x)
    np.testing.assert_array_equal(results[0], results[1])
    assert not np.array_equal(results[0], theta)


def test_delayed_nesterov_counts_folded_deltas_and_resumes_at_its_place() -> None:
    """An RMA shard may sum several deltas into one step (pushes=k), and a resumed shard
    knows only its count of deltas applied and the saved state: the milestones stay put
    (a fold that ends on one is exact)."""
    rng = np.random.default_rng(4)
    size, period = 20, 4
    deltas = rng.standard_normal((8, size)).astype(np.float32)
    theta = rng.standard_normal(size).astype(np.float32)
    one_by_one, folded = DelayedNesterov(size, 0.7, 0.9, period), \
        DelayedNesterov(size, 0.7, 0.9, period)
    a, b = theta.copy(), theta.copy()
    for k, delta in enumerate(deltas):
        one_by_one.step(a, delta, update=k)
    folded.step(b, deltas[0] + deltas[1], update=0, pushes=2)
    folded.step(b, deltas[2], update=2)
    state = {key: value.copy() for key, value in folded.state().items()}
    resumed = DelayedNesterov(size, 0.7, 0.9, period)
    resumed.load_state(state)
    copy = np.zeros_like(b)
    resumed.step(b, deltas[3], update=3, copy=copy)  # the milestone: a block of 4 ends
    np.testing.assert_array_equal(copy, b)
    resumed.step(b, deltas[4], update=4)
    resumed.step(b, deltas[5] + deltas[6] + deltas[7], update=5, pushes=3)  # ends at 8
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    # A fold that runs past a milestone puts all its deltas in the block that ends there.
    past = DelayedNesterov(size, 0.7, 0.9, period)
    c = theta.copy()
    past.step(c, deltas[:3].sum(axis=0), update=0, pushes=3)
    past.step(c, deltas[3] + deltas[4], update=3, pushes=2)
    assert not np.any(past.pending)  # deltas[4] went into the first block's mean
    assert set(state) == {"buf", "pending"} and np.any(state["pending"])
    with pytest.raises(ValueError, match="needs update="):
        resumed.step(b, deltas[0])
    with pytest.raises(ValueError, match="period must be >= 1"):
        DelayedNesterov(size, 0.7, 0.9, 0)


def test_the_configuration_names_its_keys_and_refuses_what_does_not_apply() -> None:
    config = config_from_dict(raw_config())
    opt = config.optimizer
    assert (opt.inner_steps, opt.outer_update, opt.outer_learning_rate, opt.outer_momentum,
            opt.asynchronous) == (50, "nesterov", 0.7, 0.9, False)
    assert config.cluster.ps_shards == 0
    asynchronous = config_from_dict(raw_config(asynchronous=True))
    assert asynchronous.cluster.ps_shards == 1
    assert asynchronous.optimizer.outer_momentum == 0.5  # its own default
    assert config_from_dict(raw_config(asynchronous=True, outer_momentum=0.8)
                            ).optimizer.outer_momentum == 0.8
    with pytest.raises(ConfigError, match="outer_momentum applies only to outer_update"):
        config_from_dict(raw_config(outer_update="sgd", outer_momentum=0.5))
    with pytest.raises(ConfigError, match="inner_steps applies only to algorithm = "
                                          "\"diloco\", not \"downpour\""):
        config_from_dict({**raw_config(inner_steps=5),
                          "optimizer": {"algorithm": "downpour", "inner_steps": 5}})
    with pytest.raises(ConfigError, match="ps_shards = 2, but algorithm = \"diloco\" with "
                                          "asynchronous = false"):
        config_from_dict({**raw_config(), "cluster": {"ps_shards": 2}})
    with pytest.raises(ConfigError, match="outer_update = \"adam\" is invalid"):
        config_from_dict(raw_config(outer_update="adam"))
    # push_dtype belongs to Downpour and DiLoCo both, and is hashed for each when narrowed.
    for algorithm, more in (("downpour", {}), ("diloco", {}), ("diloco", {"asynchronous": True})):
        narrow = config_from_dict({**raw_config(), "optimizer": {
            "algorithm": algorithm, "push_dtype": "bfloat16", **more}})
        wide = config_from_dict({**raw_config(), "optimizer": {"algorithm": algorithm,
                                                               **more}})
        assert config_hash(narrow) != config_hash(wide)
    with pytest.raises(ConfigError, match="push_dtype applies only to algorithm = "
                                          "\"downpour\" or \"diloco\""):
        config_from_dict({**raw_config(), "optimizer": {"algorithm": "sync",
                                                        "push_dtype": "bfloat16"}})
    # What DiLoCo trains is in the hash; outer_momentum only where Nesterov reads it.
    base = config_hash(config)
    assert config_hash(config_from_dict(raw_config(inner_steps=20))) != base
    assert config_hash(config_from_dict(raw_config(outer_learning_rate=0.5))) != base
    assert config_hash(config_from_dict(raw_config(asynchronous=True))) != base
    sgd = config_from_dict(raw_config(outer_update="sgd"))
    assert "outer_momentum" not in json.dumps(ckpt_settings(sgd))
    # Delayed Nesterov: asynchronous only, the full momentum 0.9 by default, hashed.
    delayed = config_from_dict(raw_config(asynchronous=True, outer_update="delayed_nesterov"))
    assert delayed.optimizer.outer_momentum == 0.9
    assert config_hash(delayed) != config_hash(asynchronous)
    assert ckpt_settings(config_from_dict(raw_config(
        asynchronous=True, outer_update="delayed_nesterov", outer_momentum=0.8))
        )["outer_momentum"] == 0.8
    with pytest.raises(ConfigError, match="needs optimizer.asynchronous = true"):
        config_from_dict(raw_config(outer_update="delayed_nesterov"))
    assert isinstance(build_outer_optimizer(delayed, 10, 3), DelayedNesterov)
    assert build_outer_optimizer(delayed, 10, 3).period == 3


def ckpt_settings(config) -> dict:
    from distbelief.config import hashed_settings

    return hashed_settings(config)["optimizer"]


# -- synchronous ---------------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [2, 3])
def test_synchronous_diloco_matches_the_reference(data_dir: Path, tmp_path: Path,
                                                  replicas: int) -> None:
    rounds, out = 5, tmp_path / "out"
    proc = train_job(replicas, data_dir, out, f"run.max_steps={replicas * H * rounds}")
    assert exit_statuses(proc) == [0] * replicas, proc.stderr[-3000:]
    np.testing.assert_allclose(final_params(out), reference_diloco(data_dir, replicas, rounds),
                               rtol=1e-4, atol=1e-5)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == "diloco" and summary["asynchronous"] is False
    assert summary["rounds"] == rounds and summary["inner_steps"] == H
    # Bytes on the wire: each round every replica hands the all-reduce its parameters
    # (float32) and the loss and decision values, and gets as much back.
    per_round = 4 * summary["num_params"] + 2 * 8 + 3 * 4
    assert [r["bytes_sent"] for r in summary["replica_bytes"]] == [rounds * per_round] * replicas
    assert summary["bytes_received"] == summary["bytes_sent"] == replicas * rounds * per_round
    assert summary["bytes_sent_per_sample"] == pytest.approx(
        summary["bytes_sent"] / summary["samples"])
    # metrics.jsonl's lines carry the bytes so far; the last, after the last round, all.
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [line for line in lines if line["kind"] in ("train", "eval")]
    assert logged and all("bytes_sent" in line for line in logged)
    assert logged[-1]["bytes_sent"] == summary["bytes_sent"]


@pytest.mark.parametrize("replicas", [2, 3])
def test_synchronous_narrowed_deltas_are_all_gathered_and_averaged_in_float32(
        data_dir: Path, tmp_path: Path, replicas: int) -> None:
    rounds, out = 5, tmp_path / "out"
    proc = train_job(replicas, data_dir, out, 'optimizer.push_dtype="bfloat16"',
                     f"run.max_steps={replicas * H * rounds}")
    assert exit_statuses(proc) == [0] * replicas, proc.stderr[-3000:]
    want = reference_diloco(data_dir, replicas, rounds, narrow=True)
    np.testing.assert_allclose(final_params(out), want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(want, reference_diloco(data_dir, replicas, rounds),
                           rtol=1e-6, atol=1e-7)  # the rounding shows
    summary = json.loads((out / "summary.json").read_text())
    small = 2 * 8 + 3 * 4
    n = summary["num_params"]
    for entry in summary["replica_bytes"]:  # 2 bytes a value out, R x 2 back
        assert entry["bytes_sent"] == rounds * (2 * n + small)
        assert entry["bytes_received"] == rounds * (replicas * 2 * n + small)


def test_a_resumed_synchronous_run_continues_exactly(data_dir: Path, tmp_path: Path) -> None:
    """Stopped after 2 rounds and resumed to 5, the parameters are the uninterrupted run's:
    the outer momentum came back with the checkpoint, each replica's Adagrad state too."""
    out = tmp_path / "out"
    proc = train_job(3, data_dir, out, f"run.max_steps={3 * H * 2}")
    assert exit_statuses(proc) == [0, 0, 0], proc.stderr[-3000:]
    proc = train_job(3, data_dir, out, f"run.max_steps={3 * H * 5}")
    assert exit_statuses(proc) == [0, 0, 0], proc.stderr[-3000:]
    assert "resuming from" in proc.stdout
    np.testing.assert_allclose(final_params(out), reference_diloco(data_dir, 3, 5),
                               rtol=1e-4, atol=1e-5)


def test_a_lost_replica_ends_synchronous_diloco_with_one_line(data_dir: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = train_job(3, data_dir, out, "run.max_steps=200000",
                     "run.checkpoint_every_steps=60",
                     faults="kill:1:100 delay:*:0:0.001s", survive=True)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "replica 1 (rank 1) is gone" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "synchronous DiLoCo needs every replica" in lines[0]
    assert "optimizer.asynchronous = true" in lines[0]
    assert re.search(r"the last checkpoint \(step \d+\) survives it", lines[0]), lines[0]


# -- asynchronous --------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["shared", "rma"])
def test_one_asynchronous_replica_is_the_synchronous_reference(data_dir: Path,
                                                               tmp_path: Path,
                                                               transport: str) -> None:
    """1 shard + 1 replica: the replica's delta lands on the shard's outer Nesterov with
    nothing in between, so it is the synchronous algorithm at R = 1 (at the asynchronous
    form's default momentum, 0.5)."""
    rounds, out = 6, tmp_path / "out"
    proc = train_job(2, data_dir, out, "optimizer.asynchronous=true",
                     f"run.max_steps={H * rounds}",
                     env={"DISTBELIEF_PS_TRANSPORT": transport})
    assert exit_statuses(proc) == [0, 0], proc.stderr[-3000:]
    np.testing.assert_allclose(final_params(out),
                               reference_diloco(data_dir, 1, rounds, momentum=0.5),
                               rtol=1e-4, atol=1e-5)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == "diloco" and summary["asynchronous"] is True
    replica = summary["replicas"][0]
    assert replica["pushes"] == rounds and replica["steps"] == H * rounds
    # One delta pushed and one parameter vector pulled per round (the first pull too).
    num_params = summary["num_params"]
    assert replica["bytes_sent"] == rounds * 4 * num_params
    assert replica["bytes_received"] >= (rounds + 1) * 4 * num_params
    # distbelief report draws Downpour's per-replica figures for it.
    pytest.importorskip("matplotlib")
    written = plot_runs([load_run(out)], tmp_path / "report")
    assert THROUGHPUT_FIGURE in [path.name for path in written]


def test_narrowed_deltas_put_half_the_bytes_and_fold_in_float32(data_dir: Path,
                                                                tmp_path: Path) -> None:
    """push_dtype = "bfloat16" over RMA: each delta is rounded to bfloat16 and Put as 2
    bytes a value; the shard widens it and steps its float32 Nesterov (the reference)."""
    rounds, out = 6, tmp_path / "out"
    proc = train_job(2, data_dir, out, "optimizer.asynchronous=true",
                     'optimizer.push_dtype="bfloat16"', f"run.max_steps={H * rounds}",
                     env={"DISTBELIEF_PS_TRANSPORT": "rma"})
    assert exit_statuses(proc) == [0, 0], proc.stderr[-3000:]
    want = reference_diloco(data_dir, 1, rounds, momentum=0.5, narrow=True)
    np.testing.assert_allclose(final_params(out), want, rtol=1e-4, atol=1e-5)
    wide = reference_diloco(data_dir, 1, rounds, momentum=0.5)
    assert not np.allclose(want, wide, rtol=1e-6, atol=1e-7)  # the rounding shows
    summary = json.loads((out / "summary.json").read_text())
    assert summary["push_dtype"] == "bfloat16"
    assert summary["replicas"][0]["bytes_sent"] == rounds * 2 * summary["num_params"]


@pytest.mark.parametrize("transport", ["shared", "rma"])
def test_delayed_nesterov_at_one_replica_is_the_reference(data_dir: Path, tmp_path: Path,
                                                          transport: str) -> None:
    """At R = 1 the delayed rule's period is 1: Nesterov at momentum 0.9 on each delta,
    the synchronous reference, on both transports."""
    rounds, out = 6, tmp_path / "out"
    proc = train_job(2, data_dir, out, "optimizer.asynchronous=true",
                     'optimizer.outer_update="delayed_nesterov"', f"run.max_steps={H * rounds}",
                     env={"DISTBELIEF_PS_TRANSPORT": transport})
    assert exit_statuses(proc) == [0, 0], proc.stderr[-3000:]
    np.testing.assert_allclose(final_params(out), reference_diloco(data_dir, 1, rounds),
                               rtol=1e-4, atol=1e-5)
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["outer_update"], summary["outer_momentum"]) == ("delayed_nesterov", 0.9)
    assert "outer delayed_nesterov lr 0.7 momentum 0.9" in proc.stdout


@pytest.mark.nodes
def test_delayed_nesterov_trains_three_replicas_and_resumes(data_dir: Path,
                                                            tmp_path: Path) -> None:
    """2 shards + 3 replicas on RMA: the shards step the delayed rule (period 3), checkpoint
    both of its arrays, and a resume goes on from them."""
    out, steps = tmp_path / "out", 1200
    sets = ("optimizer.asynchronous=true", "cluster.ps_shards=2",
            'optimizer.outer_update="delayed_nesterov"')
    rma = {"DISTBELIEF_PS_TRANSPORT": "rma"}
    proc = train_job(5, data_dir, out, *sets, f"run.max_steps={steps}", env=rma)
    assert exit_statuses(proc) == [0] * 5, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_test_accuracy"] > 0.6, summary["final_test_accuracy"]
    latest = ckpt.find_latest(ckpt.checkpoint_root(out))[0]
    assert sorted(latest.manifest["optimizer_state"]) == ["buf", "pending"]
    proc = train_job(5, data_dir, out, *sets, f"run.max_steps={steps + 300}", env=rma)
    assert exit_statuses(proc) == [0] * 5, proc.stderr[-3000:]
    assert "resuming from" in proc.stdout


@pytest.mark.both_mpis
def test_asynchronous_diloco_trains_and_survives_a_killed_replica(data_dir: Path,
                                                                 tmp_path: Path) -> None:
    """2 shards + 3 replicas (an odd split); replica 1 (rank 3) is killed; the others
    finish, the shards checkpoint the outer momentum, and a resume goes on from it."""
    out, steps = tmp_path / "out", 3000
    proc = train_job(5, data_dir, out, "optimizer.asynchronous=true", "cluster.ps_shards=2",
                     f"run.max_steps={steps}", faults=f"kill:3:200 {DELAY}", survive=True)
    assert exit_statuses(proc) == [0, 0, 0, 137, 0], proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "max_steps" and steps - H <= summary["steps"] <= steps
    assert [x["replica"] for x in summary["lost_replicas"]] == [1]
    assert summary["final_test_accuracy"] > 0.6, summary["final_test_accuracy"]
    assert summary["staleness"]["samples"] > 0
    latest = ckpt.find_latest(ckpt.checkpoint_root(out))[0]
    assert latest.manifest["optimizer_state"] == ["buf"]
    proc = train_job(5, data_dir, out, "optimizer.asynchronous=true", "cluster.ps_shards=2",
                     f"run.max_steps={steps + 300}")
    assert exit_statuses(proc) == [0] * 5, proc.stderr[-3000:]
    assert "resuming from" in proc.stdout
