"""A trained model leaves the tool: `distbelief evaluate`, `distbelief export` and
`distbelief.load_model`, on runs of every algorithm, 1 and 3 shards, 1 and 2 partitions,
dense and locally connected models; PyTorch and plain numpy/h5py as the readers."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import flip_bytes
from helpers.mpi_jobs import job_env, run_cli, run_mpi
from helpers.torch_reference import REQUIRE_TORCH

import distbelief
from distbelief.data.converters import convert_idx, make_synthetic
from distbelief.errors import UserError
from distbelief.records import checkpoint as ckpt
from distbelief.records import export
from distbelief.records.export import TrainedModel, read_export, read_trained, write_export

TIMEOUT = 180

DENSE = """
[model]
layers = [
    { type = "dense", units = 32, activation = "relu" },
    { type = "dense", units = 16, activation = "tanh" },
    { type = "dense", units = 4, activation = "softmax" },
]
[data]
path = "dense.h5"
batch_size = 32
[optimizer]
learning_rate = 0.05
[run]
max_steps = 150
checkpoint_every_steps = 50
eval_every_seconds = 0.5
threads = 1
"""

LOCAL = """
[model]
layers = [
    { type = "local", kernel = 3, channels = 4, activation = "relu" },
    { type = "local", kernel = 2, stride = 2, channels = 3, activation = "sigmoid" },
    { type = "dense", units = 4, activation = "softmax" },
]
[data]
path = "local.h5"
batch_size = 32
[optimizer]
learning_rate = 0.05
[run]
max_steps = 100
eval_every_seconds = 0.5
threads = 1
"""

# name: (config, ranks (0: no mpiexec), overrides). Together: every algorithm, 1 and 3
# shards, 1 and 2 partitions, dense and locally connected layers. (A single replica over
# partitions, algorithm "sgd" with cluster.partitions > 1, writes no checkpoints yet.)
RUNS = {
    "sgd": ("dense", 0, []),
    "downpour-3-shards": ("dense", 4, ['optimizer.algorithm="downpour"',
                                       "cluster.ps_shards=3"]),
    "sandblaster": ("dense", 3, ['optimizer.algorithm="sandblaster"', "run.max_steps=4"]),
    "local-sgd": ("local", 0, []),
    "local-downpour-3-shards-2-partitions": ("local", 5, [
        'optimizer.algorithm="downpour"', "cluster.ps_shards=3", "cluster.partitions=2"]),
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("export")
    make_synthetic(folder / "dense.h5", n_train=3000, n_test=700, input_shape=(16,),
                   num_classes=4, seed=5)
    make_synthetic(folder / "local.h5", n_train=2000, n_test=300, input_shape=(10, 10, 1),
                   num_classes=4, seed=6)
    (folder / "dense.toml").write_text(DENSE)
    (folder / "local.toml").write_text(LOCAL)
    return folder


def train(data_dir: Path, name: str) -> Path:
    """The run folder of RUNS[name], trained once per module."""
    out = data_dir / "runs" / name
    if (out / "summary.json").exists():
        return out
    config, ranks, overrides = RUNS[name]
    args = ["train", data_dir / f"{config}.toml", "--set", f'run.out_dir="{out}"',
            *[a for o in overrides for a in ("--set", o)]]
    if ranks:
        proc = run_mpi(ranks, ["-m", "distbelief", *args], timeout=TIMEOUT)
    else:
        proc = run_cli(args, timeout=TIMEOUT)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module", params=list(RUNS))
def run(request: pytest.FixtureRequest, data_dir: Path) -> Path:
    return train(data_dir, request.param)


@pytest.fixture
def torch_or_none():
    """PyTorch when installed (required under DISTBELIEF_REQUIRE_TORCH=1), else None: the
    full-size test checks everything else without it."""
    try:
        import torch
    except ImportError:
        if os.environ.get(REQUIRE_TORCH) == "1":
            pytest.fail(f"{REQUIRE_TORCH}=1 but PyTorch is not installed", pytrace=False)
        return None
    torch.set_num_threads(1)
    return torch


@pytest.fixture(scope="module")
def dense_run(data_dir: Path) -> Path:
    return train(data_dir, "sgd")


@pytest.fixture(scope="module")
def local_run(data_dir: Path) -> Path:
    return train(data_dir, "local-sgd")


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def config(run: Path) -> dict:
    return json.loads((run / "config.json").read_text())


def data_file(run: Path) -> str:
    return config(run)["data"]["path"]


def held_out(run: Path) -> tuple[np.ndarray, np.ndarray]:
    """The run's test set as the file stores it (uint8)."""
    with h5py.File(data_file(run), "r") as f:
        return f["test/x"][()], f["test/y"][()]


def one_error_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """The command failed with exit 2 and one line `distbelief: error: ...` on stderr."""
    assert proc.returncode == 2, f"{proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distbelief: error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def evaluate_json(*args: object) -> dict:
    proc = run_cli(["evaluate", *args, "--json"])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# -- evaluate ----------------------------------------------------------------------------


def test_evaluate_gives_the_runs_own_final_figures(run: Path) -> None:
    figures = evaluate_json(run, "--which", "last")  # the newest; the best is test_best's
    final = summary(run)
    newest, _ = ckpt.find_latest(ckpt.checkpoint_root(run))
    assert figures["checkpoint"] == str(newest.path.resolve())
    assert figures["step"] == final["steps"]
    assert figures["samples"] == len(held_out(run)[1])  # the runs evaluate all of it
    assert figures["accuracy"] == final["final_test_accuracy"]
    assert figures["loss"] == pytest.approx(final["final_test_loss"], rel=1e-5)


def test_evaluate_prints_one_line_and_reads_the_train_split(dense_run: Path) -> None:
    proc = run_cli(["evaluate", dense_run])
    assert proc.returncode == 0, proc.stderr
    line, = proc.stdout.strip().splitlines()
    assert line.startswith("loss ") and "accuracy" in line and "/test (700 samples)" in line
    train = evaluate_json(dense_run, "--split", "train")
    assert train["split"] == "train" and train["samples"] == 3000
    model = distbelief.load_model(dense_run)
    with h5py.File(train["data"], "r") as f:
        x, y = f["train/x"][()], f["train/y"][()]
    assert model.evaluate(x, y).accuracy == train["accuracy"]


def test_evaluate_on_a_file_that_does_not_fit_is_one_error(dense_run: Path,
                                                           local_run: Path) -> None:
    other = data_file(local_run)
    one_error_line(run_cli(["evaluate", dense_run, "--data", other]),
                   "does not take the inputs of", other)
    # A run without a validation split, asked for it: one line, not a traceback.
    one_error_line(run_cli(["evaluate", dense_run, "--split", "validation"]),
                   "has no validation split")


# -- export and load round trips ---------------------------------------------------------


@pytest.mark.parametrize("fmt", ["hdf5", "safetensors"])
def test_export_and_load_round_trip(run: Path, tmp_path: Path, fmt: str) -> None:
    out = tmp_path / f"model.{fmt}"
    proc = run_cli(["export", run, "--out", out, "--format", fmt, "--which", "last"])
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out}" in proc.stdout
    from_run, from_file = distbelief.load_model(run, which="last"), distbelief.load_model(out)
    newest, _ = ckpt.find_latest(ckpt.checkpoint_root(run))
    flat, _ = newest.read_state()
    ours = dict(from_run.named_parameters())
    theirs = dict(from_file.named_parameters())
    assert list(ours) == list(theirs)
    # The named arrays are the checkpoint's flat vector, cut by the layout, in order.
    assert np.array_equal(np.concatenate([a.reshape(-1) for a in theirs.values()]), flat)
    for name, values in ours.items():
        assert theirs[name].dtype == np.float32 and np.array_equal(values, theirs[name])
    assert from_file.layers == from_run.layers == config(run)["model"]["layers"]
    assert from_file.input_shape == from_run.input_shape
    assert from_file.input_scale == from_run.input_scale == pytest.approx(1 / 255)
    assert from_file.num_classes == 4
    assert from_file.source["step"] == newest.step
    x, y = held_out(run)
    probabilities = from_file.predict(x)
    assert np.array_equal(probabilities, from_run.predict(x))
    assert probabilities.shape == (len(x), 4)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1, rtol=1e-5)
    accuracy = float(np.mean(probabilities.argmax(axis=1) == y))
    assert from_file.evaluate(x, y).accuracy == accuracy == summary(run)["final_test_accuracy"]


def test_the_hdf5_export_reads_with_plain_h5py(dense_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.h5"
    assert run_cli(["export", dense_run, "--out", out]).returncode == 0
    with h5py.File(out, "r") as f:
        assert f.attrs["format"] == "distbelief-export" and f.attrs["version"] == 1
        layers = json.loads(f.attrs["layers"])
        assert [layer["units"] for layer in layers] == [32, 16, 4]
        assert list(f.attrs["input_shape"]) == [16] and f.attrs["num_classes"] == 4
        assert f.attrs["input_scale"] == pytest.approx(1 / 255)
        assert json.loads(f.attrs["source"])["algorithm"] == "sgd"
        shapes = {name: d.shape for name, d in f["params"].items()}
        assert "optimizer" not in f  # never without --with-optimizer
    assert shapes == {"layers.0.weight": (32, 16), "layers.0.bias": (32,),
                      "layers.1.weight": (16, 32), "layers.1.bias": (16,),
                      "layers.2.weight": (4, 16), "layers.2.bias": (4,)}


def test_safetensors_reads_the_safetensors_export(dense_run: Path, tmp_path: Path) -> None:
    numpy_reader = pytest.importorskip("safetensors.numpy", reason="needs the safetensors "
                                       "package as the reference: pip install safetensors")
    out = tmp_path / "model.safetensors"
    assert run_cli(["export", dense_run, "--out", out, "--format", "safetensors"]).returncode == 0
    tensors = numpy_reader.load_file(str(out))
    ours = dict(distbelief.load_model(dense_run).named_parameters())
    assert sorted(tensors) == sorted(ours)
    for name, values in tensors.items():
        assert np.array_equal(values, ours[name])
    from safetensors import safe_open

    with safe_open(str(out), framework="numpy") as f:
        metadata = f.metadata()
    assert metadata["format"] == "distbelief-export"  # a plain string, not JSON text
    assert json.loads(metadata["input_shape"]) == [16]
    assert metadata["num_classes"] == "4"


@pytest.mark.parametrize("fmt", ["hdf5", "safetensors"])
def test_with_optimizer_adds_the_optimizer_state(dense_run: Path, tmp_path: Path,
                                                 fmt: str) -> None:
    out = tmp_path / f"model.{fmt}"
    proc = run_cli(["export", dense_run, "--out", out, "--format", fmt, "--with-optimizer"])
    assert proc.returncode == 0 and "optimizer state accum" in proc.stdout, proc.stderr
    trained = read_trained(out, with_optimizer=True)
    newest, _ = ckpt.find_latest(ckpt.checkpoint_root(dense_run))
    params, state = newest.read_state()
    assert list(trained.optimizer_state) == ["accum"]
    assert np.array_equal(trained.optimizer_state["accum"], state["accum"])
    assert np.array_equal(trained.params, params)
    # Loading for use leaves it out.
    assert read_trained(out).optimizer_state == {}


def test_export_never_overwrites(dense_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.h5"
    out.write_text("precious")
    one_error_line(run_cli(["export", dense_run, "--out", out]), "exists")
    assert out.read_text() == "precious"
    assert list(tmp_path.iterdir()) == [out]  # and no temporary file left beside it


def test_export_with_optimizer_from_a_file_without_it_is_one_error(dense_run: Path,
                                                                  tmp_path: Path) -> None:
    plain = tmp_path / "plain.h5"
    assert run_cli(["export", dense_run, "--out", plain]).returncode == 0
    one_error_line(run_cli(["export", plain, "--out", tmp_path / "again.h5",
                            "--with-optimizer"]), "holds no optimizer state")


# -- the readers a user has ----------------------------------------------------------------


def torch_model(torch, layers: list[dict], inputs: int):
    """The PyTorch module docs/using-a-trained-model.md shows for a dense model."""
    activations = {"relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
                   "linear": lambda t: t, "softmax": lambda t: torch.softmax(t, dim=1)}

    class Dense(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            sizes = [inputs] + [layer["units"] for layer in layers]
            self.layers = torch.nn.ModuleList(
                torch.nn.Linear(a, b) for a, b in itertools.pairwise(sizes))
            self.acts = [activations[layer["activation"]] for layer in layers]

        def forward(self, x):
            x = x.reshape(len(x), -1)
            for linear, act in zip(self.layers, self.acts, strict=True):
                x = act(linear(x))
            return x

    return Dense()


@pytest.mark.parametrize("fmt", ["hdf5", "safetensors"])
def test_pytorch_loads_the_dense_export_and_predicts_the_same_classes(
        torch, dense_run: Path, tmp_path: Path, fmt: str) -> None:
    """Each format read into PyTorch the way docs/using-a-trained-model.md shows."""
    out = tmp_path / f"model.{fmt}"
    assert run_cli(["export", dense_run, "--out", out, "--format", fmt]).returncode == 0
    if fmt == "safetensors":
        torch_reader = pytest.importorskip("safetensors.torch", reason="needs the "
                                           "safetensors package: pip install safetensors")
        state = torch_reader.load_file(str(out))
    else:
        with h5py.File(out, "r") as f:
            state = {k: torch.from_numpy(v[()]) for k, v in f["params"].items()}
    model = distbelief.load_model(out)
    net = torch_model(torch, model.layers, int(np.prod(model.input_shape)))
    net.load_state_dict(state)  # strict: every name and shape matches nn.Linear's
    x, _ = held_out(dense_run)
    with torch.no_grad():
        theirs = net(torch.from_numpy(x.astype(np.float32) * np.float32(model.input_scale)))
    ours = model.predict(x)
    assert np.array_equal(theirs.numpy().argmax(axis=1), ours.argmax(axis=1))
    np.testing.assert_allclose(theirs.numpy(), ours, atol=1e-5)


def numpy_forward(path: Path, x: np.ndarray) -> np.ndarray:
    """The numpy forward of docs/using-a-trained-model.md: an export read with plain h5py."""
    acts = {"relu": lambda z: np.maximum(z, 0), "tanh": np.tanh, "linear": lambda z: z,
            "sigmoid": lambda z: 1 / (1 + np.exp(-z)), "softmax": lambda z: z}
    with h5py.File(path, "r") as f:
        layers = json.loads(f.attrs["layers"])
        h = x.astype(np.float32) * np.float32(f.attrs["input_scale"])
        for i, layer in enumerate(layers):
            weight, bias = f[f"params/layers.{i}.weight"][()], f[f"params/layers.{i}.bias"][()]
            if layer["type"] == "dense":
                z = h.reshape(len(h), -1) @ weight.T + bias
            else:  # local: untied weights per output position (i, j)
                k, s = layer["kernel"], layer.get("stride", 1)
                out_h, out_w, _, _ = weight.shape
                z = np.stack([np.stack([
                    h[:, r * s:r * s + k, c * s:c * s + k, :].reshape(len(h), -1)
                    @ weight[r, c] + bias[r, c] for c in range(out_w)], axis=1)
                    for r in range(out_h)], axis=1)
            h = acts[layer["activation"]](z)
    logits = h.reshape(len(h), -1)
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_the_documented_numpy_forward_matches_a_locally_connected_model(
        local_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.h5"
    assert run_cli(["export", local_run, "--out", out]).returncode == 0
    with h5py.File(out, "r") as f:
        assert f["params/layers.0.weight"].shape == (8, 8, 9, 4)  # (Ho, Wo, k*k*Cin, Cout)
        assert f["params/layers.0.bias"].shape == (8, 8, 4)
        assert f["params/layers.1.weight"].shape == (4, 4, 16, 3)
        assert f["params/layers.2.weight"].shape == (4, 48)  # after (row, col, chan) flatten
    x, _ = held_out(local_run)
    model = distbelief.load_model(out)
    np.testing.assert_allclose(numpy_forward(out, x), model.predict(x), atol=1e-5)


def test_the_readme_example_runs_without_mpi(dense_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    assert run_cli(["export", dense_run, "--out", out, "--format", "safetensors"]).returncode == 0
    data = data_file(dense_run)
    script = f"""
import sys, h5py, distbelief
for path in ({str(dense_run)!r}, {str(out)!r}, {str(ckpt.list_checkpoints(
    ckpt.checkpoint_root(dense_run))[0][1])!r}):
    model = distbelief.load_model(path)
    with h5py.File({data!r}, "r") as f:
        x, y = f["test/x"][:], f["test/y"][:]
    print(model.predict(x).argmax(axis=1)[:5], model.evaluate(x, y).accuracy)
    assert [name for name, _ in model.named_parameters()][:2] == ["layers.0.weight",
                                                                  "layers.0.bias"]
print("mpi4py.MPI" in sys.modules, "mpi4py" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=job_env(), check=False)
    assert proc.returncode == 0, proc.stderr
    *results, mpi = proc.stdout.strip().splitlines()
    assert mpi == "False False"
    accuracy = summary(dense_run)["final_test_accuracy"]
    assert [float(line.split()[-1]) for line in results] == [accuracy] * 3


# -- damaged input -----------------------------------------------------------------------


@pytest.fixture
def copied_run(dense_run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(dense_run, out)
    return out


def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_used(
        copied_run: Path) -> None:
    (newest_step, newest), (step, _), *_ = ckpt.list_checkpoints(
        ckpt.checkpoint_root(copied_run))
    flip_bytes(newest / ckpt.shard_part_name(0))
    proc = run_cli(["evaluate", copied_run, "--json", "--which", "last"])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["step"] == step < newest_step
    assert "skipped a damaged checkpoint" in proc.stderr and newest.name in proc.stderr
    with pytest.warns(UserWarning, match=f"skipped a damaged checkpoint: .*{newest.name}"):
        model = distbelief.load_model(copied_run, which="last")
    assert model.source["step"] == step


def test_the_format_follows_the_extension_and_a_mismatch_is_refused(dense_run: Path,
                                                                     tmp_path: Path) -> None:
    # Issue 30: `--out guess.safetensors` once wrote HDF5 without a word.
    out = tmp_path / "guess.safetensors"
    proc = run_cli(["export", dense_run, "--out", out])
    assert proc.returncode == 0, proc.stderr
    assert "(safetensors;" in proc.stdout
    from safetensors import safe_open

    with safe_open(str(out), framework="numpy") as f:
        assert f.metadata()["format"] == "distbelief-export"
    out = tmp_path / "guess.HDF5"
    assert run_cli(["export", dense_run, "--out", out]).returncode == 0
    with h5py.File(out) as f:
        assert f.attrs["format"] == "distbelief-export"
    one_error_line(run_cli(["export", dense_run, "--out", tmp_path / "m.safetensors",
                            "--format", "hdf5"]), "--format hdf5", "a safetensors name")
    one_error_line(run_cli(["export", dense_run, "--out", tmp_path / "model.bin"]),
                   "cannot tell the format", "--format hdf5|safetensors")
    assert run_cli(["export", dense_run, "--out", tmp_path / "model.bin", "--format",
                    "safetensors"]).returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["guess.HDF5", "guess.safetensors",
                                                          "model.bin"]


def test_a_damaged_checkpoint_is_one_clear_error(copied_run: Path, tmp_path: Path) -> None:
    checkpoints = [path for _, path in ckpt.list_checkpoints(ckpt.checkpoint_root(copied_run))]
    for path in checkpoints:
        flip_bytes(path / ckpt.shard_part_name(0))
    line = one_error_line(run_cli(["evaluate", copied_run, "--which", "last"]),
                          "holds no valid checkpoint", "sha256")
    assert checkpoints[0].name in line
    one_error_line(run_cli(["evaluate", checkpoints[0]]), "is damaged", "sha256")
    one_error_line(run_cli(["export", copied_run, "--out", tmp_path / "m.h5", "--which",
                            "last"]), "no valid checkpoint")
    assert not (tmp_path / "m.h5").exists()
    with pytest.raises(UserError, match="damaged"):
        distbelief.load_model(checkpoints[0])


@pytest.mark.parametrize("fmt", ["hdf5", "safetensors"])
def test_a_damaged_export_is_one_clear_error(dense_run: Path, tmp_path: Path,
                                             fmt: str) -> None:
    out = tmp_path / "model"
    assert run_cli(["export", dense_run, "--out", out, "--format", fmt]).returncode == 0
    data = out.read_bytes()
    out.write_bytes(data[: len(data) // 2])
    one_error_line(run_cli(["evaluate", out, "--data",
                            data_file(dense_run)]), str(out))
    (tmp_path / "notes.txt").write_text("not a model\n")
    one_error_line(run_cli(["evaluate", tmp_path / "notes.txt"]), "not", "export")
    one_error_line(run_cli(["evaluate", tmp_path / "missing"]), "does not exist")


def test_a_checkpoint_whose_data_file_moved_says_how_to_name_it(copied_run: Path,
                                                               tmp_path: Path) -> None:
    data = Path(data_file(copied_run))
    moved = tmp_path / "moved.h5"
    shutil.copy(data, moved)
    newest = ckpt.list_checkpoints(ckpt.checkpoint_root(copied_run))[0][1]
    manifest = json.loads((newest / ckpt.MANIFEST).read_text())
    manifest["config"]["data"]["path"] = str(tmp_path / "gone.h5")
    manifest["manifest_sha256"] = ckpt._manifest_digest(manifest)
    (newest / ckpt.MANIFEST).write_text(json.dumps(manifest))
    one_error_line(run_cli(["evaluate", newest]), "gone.h5", "--data FILE")
    figures = evaluate_json(newest, "--data", moved)
    assert figures["accuracy"] == summary(copied_run)["final_test_accuracy"]
    assert distbelief.load_model(newest, data=moved).num_classes == 4


# -- at full size ------------------------------------------------------------------------


def test_fashion_mnist_mlp_end_to_end(fashion_mnist_dir: Path, tmp_path: Path,
                                      torch_or_none) -> None:
    """The reference MLP (784-512-512-10) on Fashion-MNIST: evaluate gives the run's
    final_test_accuracy, and the export predicts the same classes in PyTorch."""
    data = convert_idx(fashion_mnist_dir, tmp_path / "fashion_mnist.h5")
    out = tmp_path / "run"
    proc = run_cli(["train", Path(__file__).parents[1] / "configs" / "fashion_mnist_mlp.toml",
                    "--set", f'data.path="{data}"', "--set", f'run.out_dir="{out}"',
                    "--set", "run.max_steps=300", "--set", "run.max_seconds=0"],
                   timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    final = summary(out)
    figures = evaluate_json(out)
    assert figures["samples"] == 10000 and figures["step"] == 300
    assert figures["accuracy"] == final["final_test_accuracy"] > 0.7
    assert figures["loss"] == pytest.approx(final["final_test_loss"], rel=1e-5)
    export = tmp_path / "mlp.safetensors"
    assert run_cli(["export", out, "--out", export, "--format",
                    "safetensors"]).returncode == 0
    model = distbelief.load_model(export)
    assert model.input_shape == (28, 28, 1) and model.num_classes == 10
    x, y = held_out(out)
    assert model.evaluate(x, y).accuracy == final["final_test_accuracy"]
    if torch_or_none is None:
        return
    torch = torch_or_none
    net = torch_model(torch, model.layers, 784)
    net.load_state_dict({name: torch.from_numpy(values.copy())
                         for name, values in model.named_parameters()})
    with torch.no_grad():
        theirs = net(torch.from_numpy(x.astype(np.float32) * np.float32(model.input_scale)))
    agree = np.mean(theirs.numpy().argmax(axis=1) == model.predict(x).argmax(axis=1))
    assert agree == 1.0


# -- in one process, no run needed ---------------------------------------------------------


def random_model(seed: int = 0) -> TrainedModel:
    layers = [{"type": "local", "kernel": 3, "stride": 2, "channels": 2, "activation": "tanh"},
              {"type": "dense", "units": 5, "activation": "softmax"}]
    model = TrainedModel(layers, (7, 7, 3), 1 / 255, 5, np.empty(0, np.float32))
    network = model.network()
    model.params = network.init_params(seed)
    model.optimizer_state = {"accum": np.random.default_rng(seed).random(
        network.layout.size, dtype=np.float32)}
    return model


@pytest.mark.parametrize("fmt", ["hdf5", "safetensors"])
def test_write_and_read_keep_every_array_and_the_metadata(tmp_path: Path, fmt: str) -> None:
    model = random_model()
    path = write_export(model, tmp_path / "m", fmt)
    back = read_export(path)
    assert np.array_equal(back.params, model.params)
    assert np.array_equal(back.optimizer_state["accum"], model.optimizer_state["accum"])
    assert (back.layers, back.input_shape, back.input_scale, back.num_classes) == \
        (model.layers, (7, 7, 3), 1 / 255, 5)
    assert dict(distbelief.Model(back).named_parameters())["layers.0.weight"].shape == \
        (3, 3, 27, 2)


def safetensors_metadata(path: Path) -> dict[str, str]:
    """The raw __metadata__ of a safetensors file, read as the format's spec says."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + length])["__metadata__"]


def test_safetensors_metadata_holds_plain_strings_and_old_exports_still_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = random_model()
    new = write_export(model, tmp_path / "new.safetensors", "safetensors")
    meta = safetensors_metadata(new)
    assert meta["format"] == "distbelief-export"  # once '"distbelief-export"' (issue 42)
    assert (meta["version"], meta["num_classes"]) == ("1", "5")
    assert json.loads(meta["layers"]) == model.layers
    assert json.loads(meta["input_shape"]) == [7, 7, 3]
    # An export written before the change: every value JSON text, the string quoted.
    monkeypatch.setattr(export, "_encode_metadata",
                        lambda metadata: {k: json.dumps(v) for k, v in metadata.items()})
    old = write_export(model, tmp_path / "old.safetensors", "safetensors")
    assert safetensors_metadata(old)["format"] == '"distbelief-export"'
    for path in (new, old):
        back = read_export(path)
        assert (back.layers, back.input_shape, back.input_scale, back.num_classes) == \
            (model.layers, (7, 7, 3), 1 / 255, 5), path
        assert np.array_equal(back.params, model.params)


def test_predict_takes_the_stored_arrays_and_refuses_others() -> None:
    model = distbelief.Model(random_model())
    x = np.random.default_rng(1).integers(0, 256, (6, 7, 7, 3), dtype=np.uint8)
    scaled = x.astype(np.float32) * np.float32(1 / 255)
    logits = model._network.logits(model._params, scaled)
    expected = np.exp(logits - logits.max(axis=1, keepdims=True))
    np.testing.assert_allclose(model.predict(x),
                               expected / expected.sum(axis=1, keepdims=True), rtol=1e-6)
    # float32 x is the file's stored values too: multiplied by the same scale.
    np.testing.assert_allclose(model.predict(x.astype(np.float32)), model.predict(x))
    assert np.array_equal(model.predict(x, batch_size=4), model.predict(x))
    with pytest.raises(UserError, match="uint8 or float32"):
        model.predict(x.astype(np.float64))
    with pytest.raises(UserError, match=r"needs \(N > 0, 7, 7, 3\)"):
        model.predict(x.reshape(6, -1))
    with pytest.raises(ValueError, match="batch_size"):
        model.evaluate(x, np.zeros(6, np.int64), batch_size=0)
