"""A researcher's own data in (issue 30 item 2): `distbelief.data.write_dataset` from numpy
arrays, memory maps and h5py datasets, and `distbelief prepare arrays` from an .npz, a pair
of .npy files or another HDF5 file; every mistake is one line that says what to do."""

from __future__ import annotations

import re
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers.mpi_jobs import REPO, run_cli

from distbelief.algorithms.sgd import train
from distbelief.config import load_config
from distbelief.data import arrays, write_dataset
from distbelief.data.converters import make_synthetic
from distbelief.data.hdf5 import (
    IMAGE_SCALE,
    TrainShard,
    load_split,
    load_test,
    open_dataset,
    with_validation,
)
from distbelief.errors import DataError

N, FEATURES, CLASSES = 600, 6, 3


def numbered_rows(n: int = N) -> tuple[np.ndarray, np.ndarray]:
    """x whose first feature is the row's number, y = number % CLASSES: every written row
    can be traced back to its source row."""
    x = np.random.default_rng(0).random((n, FEATURES))
    x[:, 0] = np.arange(n)
    return x, np.arange(n) % CLASSES


def written(path: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    x, y = load_split(open_dataset(path), split)
    return x, y


def test_float_arrays_with_a_held_out_fraction(tmp_path: Path) -> None:
    x, y = numbered_rows()
    info = write_dataset(tmp_path / "d.h5", x, y, test_fraction=0.25, seed=4)
    assert (info.n_train, info.n_test, info.num_classes) == (450, 150, CLASSES)
    assert (info.stored_dtype, info.scale, info.input_shape) == ("float32", 1.0, (FEATURES,))
    train_x, train_y = written(tmp_path / "d.h5", "train")
    test_x, test_y = written(tmp_path / "d.h5", "test")
    train_ids, test_ids = train_x[:, 0].astype(int), test_x[:, 0].astype(int)
    # Every row exactly once, in one split or the other, its label and values kept.
    assert sorted([*train_ids, *test_ids]) == list(range(N))
    np.testing.assert_array_equal(train_y, train_ids % CLASSES)
    np.testing.assert_array_equal(test_y, test_ids % CLASSES)
    np.testing.assert_allclose(train_x, x[train_ids].astype(np.float32))
    # Shuffled by default (a class-sorted source still gives every block every class).
    assert not np.all(np.diff(train_ids) > 0)
    # The same seed gives the same file; another seed another split.
    write_dataset(tmp_path / "again.h5", x, y, test_fraction=0.25, seed=4)
    np.testing.assert_array_equal(written(tmp_path / "again.h5", "train")[0], train_x)
    write_dataset(tmp_path / "other.h5", x, y, test_fraction=0.25, seed=5)
    assert set(written(tmp_path / "other.h5", "test")[0][:, 0]) != set(test_ids)


def test_uint8_images_keep_their_bytes_and_no_shuffle_keeps_the_order(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (40, 4, 4, 1), dtype=np.uint8)
    y = rng.integers(0, 5, 40)
    x_test, y_test = x[:7], y[:7]
    info = write_dataset(tmp_path / "img.h5", x, y, x_test, y_test, shuffle=False,
                         num_classes=5)
    assert (info.stored_dtype, info.scale, info.num_classes) == ("uint8", IMAGE_SCALE, 5)
    with h5py.File(tmp_path / "img.h5") as f:
        np.testing.assert_array_equal(f["train/x"][:], x)
        np.testing.assert_array_equal(f["train/y"][:], y)
        np.testing.assert_array_equal(f["test/x"][:], x_test)


@pytest.mark.parametrize("shuffle", [True, False])
def test_memory_maps_and_h5py_datasets_are_read_in_blocks(tmp_path: Path, shuffle: bool,
                                                          monkeypatch) -> None:
    # Blocks of 10 rows here, so the copy takes many blocks (as one larger than memory does).
    monkeypatch.setattr(arrays, "BLOCK_BYTES", 10 * 4 * FEATURES)
    x, y = numbered_rows()
    np.save(tmp_path / "x.npy", x)
    with h5py.File(tmp_path / "src.h5", "w") as f:
        f["feats"], f["labels"] = x, y
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    write_dataset(tmp_path / "from_npy.h5", mapped, y, test_fraction=0.1, shuffle=shuffle)
    with h5py.File(tmp_path / "src.h5") as f:
        write_dataset(tmp_path / "from_h5.h5", f["feats"], f["labels"], test_fraction=0.1,
                      shuffle=shuffle)
    for name in ("from_npy.h5", "from_h5.h5"):
        train_x, train_y = written(tmp_path / name, "train")
        ids = train_x[:, 0].astype(int)
        np.testing.assert_allclose(train_x, x[ids].astype(np.float32))
        np.testing.assert_array_equal(train_y, y[ids])
        assert np.all(np.diff(ids) > 0) != shuffle


@pytest.mark.parametrize("change, message", [
    (lambda x, y: (x[:, 0], y), "expected (rows, *input_shape)"),
    (lambda x, y: (x, y[:-1]), "600 rows but y has 599 labels"),
    (lambda x, y: (x, np.eye(CLASSES, dtype=int)[y]), "one-hot labels: take their argmax first"),
    (lambda x, y: (x, np.eye(CLASSES, dtype=int)[y]), ("regression targets are floats: pass y "
                                                      "as float (y.astype(np.float32))")),
    (lambda x, y: (x, y - 1), "negative label, -1"),
    (lambda x, y: (x, y.astype(str)), "map names to indices first"),
    (lambda x, y: (x, np.zeros_like(y)), "a single class"),
    # float y: values targets
    (lambda x, y: (x, np.where(np.arange(N) == 123, np.nan, y / 2)),
     "y row 123 holds nan: targets must be finite"),
    (lambda x, y: (x, np.where(np.arange(N) == 9, 1e39, y / 2)),   # too large for float32
     "y row 9 holds 1e+39: targets must be finite float32"),
    (lambda x, y: (x, np.zeros((N, 0))), "targets are (N,) or (N, k)"),
    (lambda x, y: (x, np.zeros((N, 2, 2))), "targets are (N,) or (N, k)"),
])
def test_bad_arrays_are_one_clear_error_and_leave_no_file(tmp_path: Path, change,
                                                         message: str) -> None:
    x, y = change(*numbered_rows())
    with pytest.raises(DataError, match=re.escape(message)):
        write_dataset(tmp_path / "d.h5", x, y, test_fraction=0.1)
    assert list(tmp_path.iterdir()) == []


def values_rows(width: int | None) -> tuple[np.ndarray, np.ndarray]:
    """numbered_rows' x with float targets (N,) (width None) or (N, width) that say which
    row they belong to: row i's targets are i + 0.25 * j."""
    x, _ = numbered_rows()
    y = np.arange(N)[:, None] + 0.25 * np.arange(width or 1)
    return x, (y[:, 0] if width is None else y)


@pytest.mark.parametrize("width", [None, 1, 3])
def test_float_targets_make_a_values_dataset(tmp_path: Path, width: int | None) -> None:
    x, y = values_rows(width)
    info = write_dataset(tmp_path / "v.h5", x, y, test_fraction=0.25, seed=2)
    shape = () if width is None else (width,)
    assert (info.targets, info.target_shape, info.num_classes) == ("values", shape, 0)
    assert info.outputs == (width or 1) and open_dataset(tmp_path / "v.h5") == info
    for split in ("train", "test"):
        split_x, split_y = load_split(info, split)
        assert split_y.dtype == np.float32 and split_y.shape == (len(split_x), *shape)
        np.testing.assert_array_equal(split_y, y[split_x[:, 0].astype(int)])
    shard = TrainShard(info, rank=1, num_ranks=2, seed=3)
    batch_x, batch_y = shard.next_batch(50)
    assert batch_y.dtype == np.float32 and batch_y.shape == (50, *shape)
    np.testing.assert_array_equal(batch_y, y[batch_x[:, 0].astype(int)])
    held = with_validation(info, 0.2)
    val_x, val_y = load_split(held, "validation")
    assert val_y.shape == (held.n_val, *shape) == (90, *shape)
    np.testing.assert_array_equal(val_y, y[val_x[:, 0].astype(int)])
    assert TrainShard(held).next_batch(held.n_train)[1].shape == (held.n_train, *shape)


def test_bool_targets_are_values_and_integer_ones_classes_unless_told(tmp_path: Path) -> None:
    x, y = numbered_rows()
    multi = np.stack([y == 0, y == 1], axis=1)                # multi-label, (N, 2) bool
    info = write_dataset(tmp_path / "b.h5", x, multi, test_fraction=0.1)
    assert (info.targets, info.target_shape) == ("values", (2,))
    assert set(np.unique(load_test(info)[1])) == {0.0, 1.0}
    info = write_dataset(tmp_path / "i.h5", x, multi.astype(np.int64), test_fraction=0.1,
                         targets="values")
    assert (info.targets, info.outputs) == ("values", 2)
    # Float class labels: whole numbers are classes when asked (targets or num_classes).
    for kwargs, name in (({"targets": "classes"}, "c1.h5"), ({"num_classes": 4}, "c2.h5")):
        info = write_dataset(tmp_path / name, x, y.astype(np.float64), test_fraction=0.1,
                             **kwargs)
        assert info.targets == "classes" and load_test(info)[1].dtype == np.int32
    with pytest.raises(DataError, match="labels must be whole numbers"):
        write_dataset(tmp_path / "d.h5", x, y + 0.5, test_fraction=0.1, targets="classes")
    with pytest.raises(DataError, match="num_classes is for class labels"):
        write_dataset(tmp_path / "d.h5", x, y + 0.5, test_fraction=0.1, targets="values",
                      num_classes=3)
    with pytest.raises(DataError, match="targets must be 'classes' .* got 'regression'"):
        write_dataset(tmp_path / "d.h5", x, y + 0.5, test_fraction=0.1, targets="regression")
    assert not (tmp_path / "d.h5").exists()


def test_a_test_split_needs_the_same_targets_per_row(tmp_path: Path) -> None:
    x, y = values_rows(3)
    with pytest.raises(DataError, match=r"y has targets of shape \(600, 3\) but y_test has "
                                        r"\(50, 2\)"):
        write_dataset(tmp_path / "d.h5", x, y, x[:50], y[:50, :2])
    with pytest.raises(DataError, match=r"y has targets of shape \(600, 1\) but y_test has "
                                        r"\(50,\)"):
        write_dataset(tmp_path / "d.h5", x, y[:, :1], x[:50], y[:50, 0])
    assert list(tmp_path.iterdir()) == []


def test_the_test_split_is_given_or_held_out_not_both(tmp_path: Path) -> None:
    x, y = numbered_rows()
    with pytest.raises(DataError, match="there is no test split"):
        write_dataset(tmp_path / "d.h5", x, y)
    with pytest.raises(DataError, match="not both"):
        write_dataset(tmp_path / "d.h5", x, y, x[:5], y[:5], test_fraction=0.1)
    with pytest.raises(DataError, match=r"outside \[0, 2\)"):
        write_dataset(tmp_path / "d.h5", x, y, test_fraction=0.1, num_classes=2)
    assert list(tmp_path.iterdir()) == []


# -- the command line ---------------------------------------------------------------------


def one_error_line(result, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distbelief: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_prepare_arrays_from_a_keras_style_npz_then_train(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    x = rng.integers(0, 256, (500, 8, 8, 1), dtype=np.uint8)
    y = (x.reshape(500, -1).mean(axis=1) > 127.5).astype(np.int64)  # learnable
    np.savez(tmp_path / "mine.npz", x_train=x[:400], y_train=y[:400], x_test=x[400:],
             y_test=y[400:])
    out = tmp_path / "mine.h5"
    result = run_cli(["prepare", "arrays", tmp_path / "mine.npz", "--out", out])
    assert result.returncode == 0, result.stderr
    assert f"wrote {out}: 400 training and 100 test rows of shape (8, 8, 1), 2 classes, " \
           f"stored as uint8" in result.stdout
    (tmp_path / "mine.toml").write_text(
        '[model]\nlayers = [{ type = "dense", units = 2, activation = "softmax" }]\n'
        '[data]\npath = "mine.h5"\nbatch_size = 20\n'
        '[optimizer]\nalgorithm = "sgd"\nlearning_rate = 0.05\n'
        f'[run]\nmax_steps = 60\nout_dir = "{tmp_path / "run"}"\n')
    trained = run_cli(["train", tmp_path / "mine.toml"], timeout=120)
    assert trained.returncode == 0, trained.stderr
    assert (tmp_path / "run" / "summary.json").exists()
    # An existing dataset is never overwritten.
    one_error_line(run_cli(["prepare", "arrays", tmp_path / "mine.npz", "--out", out]),
                   f"{out} exists")


def test_prepare_arrays_from_npy_files_and_from_named_hdf5_datasets(tmp_path: Path) -> None:
    x, y = numbered_rows()
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    result = run_cli(["prepare", "arrays", "--x", tmp_path / "x.npy", "--y",
                      tmp_path / "y.npy", "--test-fraction", "0.2", "--out", tmp_path / "a.h5"])
    assert result.returncode == 0, result.stderr
    assert open_dataset(tmp_path / "a.h5").n_test == 120
    with h5py.File(tmp_path / "rec.h5", "w") as f:
        f["train/X"], f["train/labels"] = x, y
        f["eval/X"], f["eval/labels"] = x[:50], y[:50]
    result = run_cli(["prepare", "arrays", tmp_path / "rec.h5", "--x", "train/X", "--y",
                      "train/labels", "--x-test", "eval/X", "--y-test", "eval/labels",
                      "--out", tmp_path / "b.h5"])
    assert result.returncode == 0, result.stderr
    info = open_dataset(tmp_path / "b.h5")
    assert (info.n_train, info.n_test) == (N, 50)


def test_prepare_arrays_with_float_targets_says_they_are_values(tmp_path: Path) -> None:
    x, y = values_rows(3)
    np.savez(tmp_path / "reg.npz", x_train=x, y_train=y)
    out = tmp_path / "reg.h5"
    result = run_cli(["prepare", "arrays", tmp_path / "reg.npz", "--test-fraction", "0.1",
                      "--out", out])
    assert result.returncode == 0, result.stderr
    assert "3 float targets a row (values: regression or multi-label; for class labels pass " \
           "integers or --targets classes)" in result.stdout
    assert open_dataset(out).target_shape == (3,)
    np.savez(tmp_path / "onehot.npz", x_train=x, y_train=np.eye(3, dtype=np.int64)[
        np.arange(N) % 3])
    one_error_line(run_cli(["prepare", "arrays", tmp_path / "onehot.npz", "--test-fraction",
                            "0.1", "--out", tmp_path / "o.h5"]),
                   "take their argmax first", "--targets values")
    result = run_cli(["prepare", "arrays", tmp_path / "onehot.npz", "--test-fraction", "0.1",
                      "--targets", "values", "--out", tmp_path / "o.h5"])
    assert result.returncode == 0, result.stderr
    assert "3 float targets a row" in result.stdout


def test_prepare_arrays_mistakes_name_what_to_do(tmp_path: Path) -> None:
    x, y = numbered_rows()
    np.savez(tmp_path / "odd.npz", feats=x, labels=y)
    out = tmp_path / "o.h5"
    one_error_line(run_cli(["prepare", "arrays", tmp_path / "odd.npz", "--out", out]),
                   "holds feats, labels", "--x NAME --y NAME")
    one_error_line(run_cli(["prepare", "arrays", tmp_path / "odd.npz", "--x", "feats",
                            "--y", "labls", "--out", out]), "no array 'labls'")
    one_error_line(run_cli(["prepare", "arrays", tmp_path / "odd.npz", "--x", "feats",
                            "--y", "labels", "--out", out]), "--test-fraction 0.1")
    (tmp_path / "notes.csv").write_text("1,2,3\n")
    one_error_line(run_cli(["prepare", "arrays", tmp_path / "notes.csv", "--out", out]),
                   "docs/your-own-data.md")
    one_error_line(run_cli(["prepare", "arrays", "--out", out]), "--x X.npy --y Y.npy")
    assert not out.exists()


def test_training_on_unconverted_arrays_points_to_the_converter(tmp_path: Path) -> None:
    x, y = numbered_rows()
    np.savez(tmp_path / "raw.npz", x_train=x, y_train=y)
    with h5py.File(tmp_path / "keras.h5", "w") as f:
        f["X_train"], f["y_train"] = x, y
    for name in ("raw.npz", "keras.h5"):
        with pytest.raises(DataError, match="distbelief prepare arrays"):
            open_dataset(tmp_path / name)


FEATURES_CONFIG = REPO / "configs" / "features_7class.toml"


def test_the_feature_vector_example_config_fits_its_data_and_learns(tmp_path: Path) -> None:
    # configs/features_7class.toml (issue 42): flat features and 7 classes, the shipped
    # example that is neither images nor 10 classes. Its data, as its own comment makes it
    # (fewer rows), must fit its model, and a short run must beat chance widely.
    text = FEATURES_CONFIG.read_text()
    prepare = " ".join(line.lstrip("# ").rstrip("\\ ") for line in text.splitlines()
                       if line.startswith(("# Data:", "#    ")))
    shape, classes = re.search(r"--shape (\d+) --classes (\d+)", prepare).groups()
    data = tmp_path / "features.h5"
    make_synthetic(data, 3000, 500, (int(shape),), int(classes))
    config = load_config(FEATURES_CONFIG, [f'data.path="{data}"',
                                           f'run.out_dir="{tmp_path / "run"}"'])
    assert int(classes) != 10 and open_dataset(data).input_shape == (int(shape),)
    assert config.model.layers[-1]["units"] == int(classes)
    assert config.optimizer.algorithm == "downpour" and config.data.validation > 0
    # The page that points here gives the same commands.
    page = (REPO / "docs" / "your-own-data.md").read_text()
    assert "mpiexec -n 3 python -m distbelief train configs/features_7class.toml" in page
    assert "--shape 54 --classes 7" in page and f"--shape {shape} --classes {classes}" in text
    # The same model and data in one process (Downpour needs ranks; one replica of it is
    # this sequential SGD): 300 steps.
    sgd = load_config(FEATURES_CONFIG, [f'data.path="{data}"', 'optimizer.algorithm="sgd"',
                                        "cluster.ps_shards=0", "run.max_steps=300",
                                        "run.target_accuracy=0.99",
                                        f'run.out_dir="{tmp_path / "sgd"}"'])
    summary = train(sgd, stream=None)
    assert summary["steps"] == 300
    assert summary["final_val_accuracy"] > 3 / int(classes), summary  # chance: 1/7
