"""A model of the user's own (distbelief.model.protocol): trained by distbelief.train in
this process and under mpiexec, by `train --model` on several ranks, resumed and refused
like a built-in one; every way a model can break the protocol is one clear error."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import exit_statuses, set_args
from helpers.mpi_jobs import REPO, job_env, run_mpi, survive_a_death

import distbelief
from distbelief.cli import main
from distbelief.errors import ConfigError, DataError, UserError
from distbelief.model.protocol import ModelError, OwnModel
from distbelief.records import checkpoint as ckpt

PROGRAMS = REPO / "tests" / "mpi_programs"
sys.path.insert(0, str(PROGRAMS))
import own_models

TIMEOUT = 90


@pytest.fixture(scope="module")
def data_dir(synthetic_folder, small_config) -> Path:
    text = small_config(None, optimizer={"algorithm": "downpour", "learning_rate": 0.1},
                        cluster=None, run={"max_steps": 300, "eval_every_seconds": 0.5},
                        data={"validation": 0.1})
    # The model is the user's: the config has no [model] section.
    text = text.split("[data]", 1)[1]
    return synthetic_folder("own", {"own.toml": "[data]" + text}, n_train=3000, n_test=600,
                            input_shape=(own_models.FEATURES,), seed=7)


@pytest.fixture
def keep_sigint():
    """distbelief.train takes Ctrl-C for itself, as `distbelief train` does: give it back."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


def config_dict(data_dir: Path, out: Path, **run) -> dict:
    return {"data": {"path": str(data_dir / "synth.h5"), "batch_size": 32},
            "optimizer": {"algorithm": "sgd", "learning_rate": 0.1},
            "run": {"max_steps": 200, "out_dir": str(out), **run}}


def test_a_numpy_model_trains_in_this_process_resumes_and_is_its_own_in_the_hash(
        data_dir: Path, tmp_path: Path, keep_sigint, capsys) -> None:
    out = tmp_path / "run"
    handler = signal.getsignal(signal.SIGINT)
    summary = distbelief.train(config_dict(data_dir, out), model=own_models.logistic())
    assert signal.getsignal(signal.SIGINT) is handler  # Ctrl-C is the script's again
    assert summary["stop_reason"] == "max_steps" and summary["steps"] == 200
    assert summary["final_test_accuracy"] > 0.6  # 4 classes: chance is 0.25
    recorded = json.loads((out / "config.json").read_text())["model"]
    assert recorded == {"layers": [], "own": {"name": "logistic", "version": "1",
                                              "parameters": 24 * 4 + 4}}
    found = ckpt.find_latest(ckpt.checkpoint_root(out))[0]
    assert [(e["name"], e["shape"]) for e in found.manifest["layout"]] == [
        ("weights", [24, 4]), ("bias", [4])]
    check_the_trained_model(out, summary, capsys)
    # A longer budget resumes where the run stopped.
    summary = distbelief.train(config_dict(data_dir, out, max_steps=300),
                               model=own_models.logistic())
    assert summary["steps"] == 300 and "ckpt-0000000200" in summary["resumed_from"]
    # Another model (here: a new version) is another run: its checkpoints are not resumed.
    other = own_models.logistic()
    other.version = "2"
    with pytest.raises(UserError, match="model.own"):
        distbelief.train(config_dict(data_dir, out, max_steps=400), model=other)


def check_the_trained_model(out: Path, summary: dict, capsys) -> None:
    """evaluate, export and load_model of a run of own_models.logistic."""
    # Only the user's code can run the model: load_model asks for it instead of guessing.
    with pytest.raises(UserError, match="holds a model of your own \\(logistic, 100 "
                                        "parameters\\), which only your code can run"):
        distbelief.load_model(out)
    with pytest.raises(UserError, match="is not the one trained"):
        distbelief.load_model(out, model=own_models.Logistic(24, 3))
    loaded = distbelief.load_model(out, model=own_models.logistic())
    assert [name for name, _ in loaded.named_parameters()] == ["weights", "bias"]
    # The test set is scored as the run scored it at its end (the same best model).
    capsys.readouterr()
    assert main(["evaluate", str(out), "--model", "own_models:logistic", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["accuracy"] == pytest.approx(
        summary["final_test_accuracy"], abs=1e-6)
    # An export of it reads back with the model, predicting what the run's model does.
    export = out.parent / "logistic.safetensors"
    assert main(["export", str(out), "--out", str(export)]) == 0
    x = np.random.default_rng(0).random((7, 24), dtype=np.float32)
    assert main(["export", str(out), "--out", str(export.with_suffix(".h5"))]) == 0
    for path in (export, export.with_suffix(".h5")):
        again = distbelief.load_model(path, model=own_models.logistic())
        np.testing.assert_array_equal(again.predict(x), loaded.predict(x))
    params = dict(loaded.named_parameters())
    flat = np.concatenate([params["weights"].ravel(), params["bias"]])
    scaled = x * np.float32(loaded.input_scale)  # predict takes x as the file stores it
    np.testing.assert_allclose(loaded.predict(x),
                               own_models.logistic().predict(flat, scaled), rtol=1e-5)


@pytest.mark.parametrize("break_it, message", [
    (lambda m: setattr(m, "predict", None), "no predict method"),
    (lambda m: setattr(m, "loss_and_grad", lambda p, x, y: (1.0, np.zeros(3, np.float32))),
     "loss_and_grad returned a gradient of 3 values; the model has 100 parameters"),
    (lambda m: setattr(m, "loss_and_grad", lambda p, x, y: (1.0, np.zeros(100))),
     ("loss_and_grad returned a gradient of float64 of shape \\(100,\\); it must be a "
      "flat float32")),
    (lambda m: setattr(m, "loss_and_grad", lambda p, x, y: 1 / 0),
     "loss_and_grad raised ZeroDivisionError: division by zero"),
    (lambda m: setattr(m, "loss_and_grad",
                       lambda p, x, y: (float("nan"), np.zeros(100, np.float32))),
     "loss_and_grad returned the loss nan"),
    (lambda m: setattr(m, "init_params", lambda rng: [0.0] * 100),
     "init_params returned list; it must be a flat float32 vector"),
    (lambda m: setattr(m, "predict", lambda p, x: np.zeros((1, 4))),
     "predict returned shape \\(1, 4\\) for 2 rows"),
    (lambda m: setattr(m, "named_slices", lambda: [("w", (24, 4)), ("w", (4,))]),
     "named_slices\\(\\) names \\['w'\\] more than once"),
])
def test_a_model_that_breaks_the_protocol_is_one_error_naming_it_and_the_call(
        data_dir: Path, tmp_path: Path, keep_sigint, break_it, message: str) -> None:
    model = own_models.logistic()
    break_it(model)
    with pytest.raises(ModelError, match=f"model logistic: {message}"):
        distbelief.train(config_dict(data_dir, tmp_path / "run"), model=model)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_configuration_that_does_not_go_with_a_model_of_ones_own_is_refused(
        data_dir: Path, tmp_path: Path, keep_sigint) -> None:
    config = config_dict(data_dir, tmp_path / "run")
    layered = {**config, "model": {"layers": [{"type": "dense", "units": 4}]}}
    with pytest.raises(ConfigError, match="model.layers describe the built-in network"):
        distbelief.train(layered, model=own_models.logistic())
    with pytest.raises(ConfigError, match="cluster.partitions = 2: model parallelism"):
        distbelief.train({**config, "optimizer": {"algorithm": "sgd"},
                          "cluster": {"partitions": 2}}, model=own_models.logistic())
    with pytest.raises(ConfigError, match="\\[model\\] must be a table"):
        distbelief.train({**config, "model": 3}, model=own_models.logistic())
    with pytest.raises(ConfigError, match="config must be a TOML path or a dict"):
        distbelief.train(42, model=own_models.logistic())


def test_own_model_evaluates_by_its_outputs_argmax_or_by_its_own_evaluate() -> None:
    model = own_models.logistic()
    wrapped = OwnModel(model, (24,), 4)
    params = wrapped.init_params(0)
    x = np.random.default_rng(1).normal(size=(50, 24)).astype(np.float32)
    y = np.random.default_rng(2).integers(0, 4, 50)
    result = wrapped.evaluate(params, x, y, batch_size=16)
    loss, accuracy = result.loss, result.score
    expected = float(np.mean(model.predict(params, x).argmax(axis=1) == y))
    assert accuracy == pytest.approx(expected)
    assert loss == pytest.approx(model.loss_and_grad(params, x, y)[0], rel=1e-5)
    assert wrapped.step == 0  # the probe's call is not a training step, nor evaluation's
    model.evaluate = lambda p, xb, yb: {"loss": 7.0, "accuracy": 0.5}
    assert wrapped.evaluate(params, x, y).figures == {"loss": 7.0, "accuracy": 0.5}
    model.evaluate = lambda p, xb, yb: {"loss": 7.0, "accuracy": float("nan")}
    with pytest.raises(ModelError, match="evaluate returned the accuracy nan"):
        wrapped.evaluate(params, x, y)
    with pytest.raises(DataError, match="equal, non-zero numbers"):
        wrapped.evaluate(params, x[:0], y[:0])


def test_the_python_api_trains_a_model_of_ones_own_with_downpour_on_three_ranks(
        data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_mpi(3, [PROGRAMS / "own_model_train.py", data_dir / "own.toml", out],
                   timeout=TIMEOUT, cwd=PROGRAMS)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == "downpour" and len(summary["replicas"]) == 2
    assert summary["final_test_accuracy"] > 0.6
    # Every rank gets the summary, from the rank that wrote it; a rerun of the finished run
    # returns it untouched, on every rank too.
    for call in ("first", "again"):
        for rank in range(3):
            line = (f"rank {rank} {call} summary: max_steps "
                    f"{summary['final_test_accuracy']!r}")
            assert line in proc.stdout, proc.stdout


def cli_job(n: int, data_dir: Path, out: Path, model: str, *overrides: str):
    args = ["train", data_dir / "own.toml", "--model", f"own_models:{model}",
            *set_args(f'run.out_dir="{out}"', *overrides)]
    return run_mpi(n, [PROGRAMS / "cli_exit_status.py", *args], timeout=TIMEOUT,
                   cwd=PROGRAMS, env=job_env(), launcher_options=survive_a_death())


def test_train_model_trains_with_sync_on_one_shard_and_three_replicas(
        data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = cli_job(4, data_dir, out, "logistic", 'optimizer.algorithm="sync"',
                   "optimizer.backup_workers=1")
    assert exit_statuses(proc) == [0] * 4, proc.stdout + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["replicas"] == 3 and summary["final_test_accuracy"] > 0.6


def test_a_model_refused_at_its_check_exits_2_on_every_rank_in_one_line(
        data_dir: Path, tmp_path: Path) -> None:
    proc = cli_job(3, data_dir, tmp_path / "run", "short_gradient")
    assert exit_statuses(proc) == [2, 2, 2], proc.stdout + proc.stderr[-3000:]
    line = ("model short-gradient: loss_and_grad returned a gradient of 99 values; the "
            "model has 100 parameters")
    assert proc.stderr.count(line) == 1, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.nodes  # a model's error crosses nodes too
def test_a_model_that_fails_on_one_replica_mid_run_ends_the_job_in_one_line(
        data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = cli_job(3, data_dir, out, "raises_on_rank_2", "run.max_steps=100000")
    assert proc.returncode != 0, proc.stdout + proc.stderr[-3000:]
    line = "model raises-on-rank-2: loss_and_grad raised RuntimeError: boom at step 20"
    assert proc.stderr.count(line) == 1, proc.stderr[-3000:]
    assert not (out / "summary.json").exists()  # no summary claims a run that broke


# -- a PyTorch module (distbelief.torch.TorchModel) ----------------------------------------

IMAGE = (8, 8, 1)


def cnn(torch, seed: int = 0):
    sys.path.insert(0, str(REPO / "examples"))
    from torch_cnn import CNN

    torch.manual_seed(seed)
    return CNN(*IMAGE, classes=4)


@pytest.mark.torch
def test_torch_model_lays_the_parameters_out_in_order_and_its_gradient_is_autograds(
        torch) -> None:
    from distbelief.torch import TorchModel

    net = cnn(torch)
    model = TorchModel(net, torch.nn.CrossEntropyLoss())
    params = model.init_params(np.random.default_rng(5))
    assert np.array_equal(params, model.init_params(np.random.default_rng(5)))
    assert model.named_slices() == [(n, tuple(p.shape)) for n, p in net.named_parameters()]
    wrapped = OwnModel(model, IMAGE, 4)  # the protocol's checks and its probe
    x = np.random.default_rng(1).random((6, *IMAGE), dtype=np.float32)
    y = np.random.default_rng(2).integers(0, 4, 6)
    grad = np.empty_like(params)
    loss = wrapped.loss_and_grad(params, x, y, grad)
    # The reference: a fresh module holding the same values, plain autograd.
    reference = cnn(torch, seed=9)
    values = iter(np.split(params, np.cumsum(
        [p.numel() for p in reference.parameters()])[:-1]))
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.from_numpy(next(values)).view_as(p))
    expected = torch.nn.functional.cross_entropy(
        reference(torch.from_numpy(x)), torch.from_numpy(y))
    expected.backward()
    assert loss == pytest.approx(float(expected.detach()), rel=1e-6)
    want = np.concatenate([p.grad.numpy().ravel() for p in reference.parameters()])
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)
    assert np.abs(grad).sum() > 0


@pytest.mark.torch
def test_a_torch_cnn_trains_with_downpour_and_loads_back_into_its_module(
        torch, synthetic_folder, small_config, tmp_path: Path) -> None:
    from distbelief.torch import TorchModel

    text = small_config(None, optimizer={"algorithm": "downpour", "learning_rate": 0.01},
                        cluster=None, run={"max_steps": 1200, "eval_every_seconds": 1.0})
    folder = synthetic_folder("torch", {"cnn.toml": "[data]" + text.split("[data]", 1)[1]},
                              n_train=2000, n_test=400, input_shape=IMAGE, seed=4)
    out = tmp_path / "run"
    proc = run_mpi(3, [PROGRAMS / "torch_train.py", folder / "cnn.toml", out, *IMAGE, 4],
                   timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == "downpour" and summary["final_test_accuracy"] > 0.45
    # The trained vector, loaded into a fresh module, predicts what the run's model did.
    net = cnn(torch, seed=3)
    found = TorchModel.load_into(net, out)
    params, _ = found.read_state()
    x = np.random.default_rng(0).random((5, *IMAGE), dtype=np.float32)
    with torch.no_grad():
        loaded = net(torch.from_numpy(x)).numpy()
    model = TorchModel(cnn(torch, seed=4), torch.nn.CrossEntropyLoss())
    np.testing.assert_array_equal(loaded, model.predict(params, x))
    with pytest.raises(ValueError, match="parameters are not those of"):
        TorchModel.load_into(torch.nn.Linear(3, 2), out)


@pytest.mark.torch
def test_a_torch_module_with_buffers_is_refused_by_name(torch) -> None:
    from distbelief.torch import TorchModel

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match="has buffers \\(1.running_mean"):
        TorchModel(net, torch.nn.CrossEntropyLoss())
