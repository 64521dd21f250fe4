"""Tests of the data layer: IDX conversion, the synthetic generator, file validation, and
training shards (disjoint, complete, reproducible, resumable)."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import struct
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import exit_statuses
from helpers.mpi_jobs import REPO, run_cli, run_mpi

from distbelief.data import converters as datasets
from distbelief.data.hdf5 import (
    DatasetInfo,
    DatasetWriter,
    TrainShard,
    bytes_read,
    load_test,
    open_dataset,
    read_rows,
    read_rows_at,
    with_validation,
)
from distbelief.data.stream import StreamingTrainShard
from distbelief.errors import DataError

# ---------------------------------------------------------------------------------------
# helpers


def idx_bytes(array: np.ndarray) -> bytes:
    """An IDX file of unsigned bytes, written by hand (independent of the converter)."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def parse_idx(raw: bytes) -> np.ndarray:
    ndim = raw[3]
    dims = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    return np.frombuffer(raw[4 + 4 * ndim :], dtype=np.uint8).reshape(dims)


def write_idx_set(folder: Path, n_train: int = 5, n_test: int = 3, gz: bool = False,
                  seed: int = 0) -> dict[str, np.ndarray]:
    """Four tiny IDX files (3x2 images, labels in 0..3); returns what was written."""
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 3, 2)),
        "train-labels-idx1-ubyte": np.arange(n_train) % 4,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 3, 2)),
        "t10k-labels-idx1-ubyte": np.arange(n_test) % 3,
    }
    for name, array in arrays.items():
        raw = idx_bytes(array)
        if gz:
            (folder / f"{name}.gz").write_bytes(gzip.compress(raw))
        else:
            (folder / name).write_bytes(raw)
    return arrays


def write_indexed(path: Path, n_train: int = 23, n_test: int = 7, num_classes: int = 5,
                  chunk_rows: int | None = None) -> DatasetInfo:
    """A float32 dataset whose row i is [i, i + 0.5, -i] with label i % num_classes, so a
    batch says which rows it came from."""
    def rows(n: int) -> tuple[np.ndarray, np.ndarray]:
        i = np.arange(n, dtype=np.float32)
        return np.stack([i, i + 0.5, -i], axis=1), np.arange(n) % num_classes

    with DatasetWriter(path, input_shape=(3,), num_classes=num_classes, n_train=n_train,
                       n_test=n_test, stored_dtype="float32", scale=1.0, source="test",
                       chunk_rows=chunk_rows) as writer:
        writer.append("train", *rows(n_train))
        writer.append("test", *rows(n_test))
        return writer.commit()


def write_values(path: Path, width: int | None = 3, n_train: int = 50, n_test: int = 20,
                 n_val: int = 0, chunk_rows: int | None = None) -> DatasetInfo:
    """A float32 dataset of "values" targets: row i is [i, i + 0.5, -i] as in write_indexed,
    its targets i + 0.25 * j, j < width ((N,) when width is None)."""
    shape = () if width is None else (width,)

    def rows(n: int) -> tuple[np.ndarray, np.ndarray]:
        i = np.arange(n, dtype=np.float32)
        y = (i[:, None] + 0.25 * np.arange(width or 1, dtype=np.float32)).reshape(n, *shape)
        return np.stack([i, i + 0.5, -i], axis=1), y

    with DatasetWriter(path, input_shape=(3,), n_train=n_train, n_test=n_test, n_val=n_val,
                       stored_dtype="float32", scale=1.0, source="test", targets="values",
                       target_shape=shape, chunk_rows=chunk_rows) as writer:
        for split, n in (("train", n_train), ("test", n_test), ("val", n_val)):
            if n:
                writer.append(split, *rows(n))
        return writer.commit()


def values_of(x: np.ndarray, info: DatasetInfo) -> np.ndarray:
    """The targets write_values gave the rows x."""
    i = row_ids(x).astype(np.float32)
    width = info.target_shape[0] if info.target_shape else 1
    return (i[:, None] + 0.25 * np.arange(width, dtype=np.float32)).reshape(
        len(x), *info.target_shape)


def row_ids(x: np.ndarray) -> np.ndarray:
    return x[:, 0].astype(np.int64)


def leftovers(folder: Path) -> list[str]:
    """Temporary files a writer left behind."""
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def flip_chunk_byte(path: Path, dataset: str, chunk: int) -> None:
    """Flip one byte inside a stored chunk of `dataset`."""
    with h5py.File(path, "r") as f:
        info = f[dataset].id.get_chunk_info(chunk)
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset)
        byte = fh.read(1)
        fh.seek(info.byte_offset)
        fh.write(bytes([byte[0] ^ 0xFF]))


# ---------------------------------------------------------------------------------------
# IDX conversion


def test_convert_fashion_mnist(fashion_mnist_dir: Path, tmp_path: Path) -> None:
    out = datasets.convert_idx(fashion_mnist_dir, tmp_path / "fm.h5")
    info = open_dataset(out)
    assert (info.n_train, info.n_test) == (60000, 10000)
    assert info.input_shape == (28, 28, 1)
    assert info.num_classes == 10
    assert info.stored_dtype == "uint8" and info.scale == pytest.approx(1 / 255)

    def raw(name: str) -> np.ndarray:
        return parse_idx(gzip.decompress((fashion_mnist_dir / f"{name}.gz").read_bytes()))

    train_images, test_labels = raw("train-images-idx3-ubyte"), raw("t10k-labels-idx1-ubyte")
    with h5py.File(out, "r") as f:
        stored = f["train/x"][0]
        np.testing.assert_array_equal(f["train/y"][:], raw("train-labels-idx1-ubyte"))
        np.testing.assert_array_equal(np.unique(f["test/y"][:]), np.arange(10))
    assert hashlib.sha256(stored[..., 0].tobytes()).hexdigest() == \
        hashlib.sha256(train_images[0].tobytes()).hexdigest()
    x, y = load_test(info, limit=100)
    np.testing.assert_array_equal(y, test_labels[:100])
    assert x.dtype == np.float32 and x.shape == (100, 28, 28, 1)
    np.testing.assert_allclose(x[..., 0], raw("t10k-images-idx3-ubyte")[:100] / 255, rtol=1e-6)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_round_trip(tmp_path: Path, gz: bool) -> None:
    arrays = write_idx_set(tmp_path, gz=gz)
    info = open_dataset(datasets.convert_idx(tmp_path, tmp_path / "tiny.h5"))
    assert info.input_shape == (3, 2, 1)
    assert (info.n_train, info.n_test, info.num_classes) == (5, 3, 4)
    with h5py.File(info.path, "r") as f:
        np.testing.assert_array_equal(f["train/x"][..., 0], arrays["train-images-idx3-ubyte"])
        np.testing.assert_array_equal(f["test/x"][..., 0], arrays["t10k-images-idx3-ubyte"])
        np.testing.assert_array_equal(f["train/y"][:], arrays["train-labels-idx1-ubyte"])
        np.testing.assert_array_equal(f["test/y"][:], arrays["t10k-labels-idx1-ubyte"])
        assert "train-images-idx3-ubyte" in f.attrs["source"]
        assert f.attrs["format"] == "distbelief-dataset" and f.attrs["version"] == 1


def test_idx_gzip_detected_by_content(tmp_path: Path) -> None:
    """A gzipped file without the .gz suffix is still read."""
    arrays = write_idx_set(tmp_path)
    name = "train-images-idx3-ubyte"
    (tmp_path / name).write_bytes(gzip.compress((tmp_path / name).read_bytes()))
    info = open_dataset(datasets.convert_idx(tmp_path, tmp_path / "tiny.h5"))
    with h5py.File(info.path, "r") as f:
        np.testing.assert_array_equal(f["train/x"][..., 0], arrays[name])


def expect_idx_error(src: Path, out: Path, match: str) -> None:
    """convert_idx fails with `match`, and leaves neither the output nor a temp file."""
    with pytest.raises(DataError, match=match):
        datasets.convert_idx(src, out)
    assert not out.exists()
    assert leftovers(out.parent) == []


def test_idx_missing_file(tmp_path: Path) -> None:
    write_idx_set(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    expect_idx_error(tmp_path, tmp_path / "o.h5",
                     rf"no t10k-labels-idx1-ubyte\(\.gz\) in {tmp_path}")


def test_idx_missing_folder(tmp_path: Path) -> None:
    expect_idx_error(tmp_path / "nope", tmp_path / "o.h5", "no such folder")


def test_idx_truncated(tmp_path: Path) -> None:
    write_idx_set(tmp_path)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-7])
    expect_idx_error(tmp_path, tmp_path / "o.h5", rf"{path}: truncated: .* 30 bytes .* found 23")


def test_idx_trailing_bytes(tmp_path: Path) -> None:
    write_idx_set(tmp_path)
    path = tmp_path / "t10k-labels-idx1-ubyte"
    path.write_bytes(path.read_bytes() + b"\0")
    expect_idx_error(tmp_path, tmp_path / "o.h5", rf"{path}: has trailing bytes")


def test_idx_truncated_gzip(tmp_path: Path) -> None:
    write_idx_set(tmp_path, gz=True)
    path = tmp_path / "train-labels-idx1-ubyte.gz"
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    expect_idx_error(tmp_path, tmp_path / "o.h5", rf"{path}: cannot read")


@pytest.mark.parametrize("header", [b"\x00\x00\x08\x01", b"\x12\x34\x08\x03", b"\x00\x00\x0d\x03",
                                    b"\x00"])
def test_idx_bad_magic(tmp_path: Path, header: bytes) -> None:
    """Wrong dimension count, non-zero leading bytes, float elements, a stub of a file."""
    write_idx_set(tmp_path)
    path = tmp_path / "train-images-idx3-ubyte"
    stub = len(header) < 4
    path.write_bytes(header if stub else header + path.read_bytes()[len(header):])
    expect_idx_error(tmp_path, tmp_path / "o.h5", rf"{path}: bad IDX magic number")


def test_idx_count_mismatch(tmp_path: Path) -> None:
    write_idx_set(tmp_path)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros(4)))
    expect_idx_error(tmp_path, tmp_path / "o.h5", "has 5 images but .* has 4 labels")


def test_idx_image_size_mismatch(tmp_path: Path) -> None:
    write_idx_set(tmp_path)
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(idx_bytes(np.zeros((3, 2, 3))))
    expect_idx_error(tmp_path, tmp_path / "o.h5", r"has \(3, 2\) images but .* has \(2, 3\)")


def test_failed_conversion_keeps_existing_file(tmp_path: Path) -> None:
    write_idx_set(tmp_path)
    out = tmp_path / "o.h5"
    out.write_bytes(b"previous contents")
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"\0\0\x08\x03")
    with pytest.raises(DataError):
        datasets.convert_idx(tmp_path, out)
    assert out.read_bytes() == b"previous contents"


def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure half-way through writing leaves no output and no temporary file."""
    monkeypatch.setattr(datasets, "SYNTHETIC_BLOCK_VALUES", 40)
    calls = []

    def failing_labels(self: datasets.Teacher, x: np.ndarray) -> np.ndarray:
        calls.append(len(x))
        if len(calls) == 3:
            raise RuntimeError("disk on fire")
        return np.zeros(len(x), dtype=np.int32)

    monkeypatch.setattr(datasets.Teacher, "labels", failing_labels)
    out = tmp_path / "syn.h5"
    with pytest.raises(RuntimeError, match="disk on fire"):
        datasets.make_synthetic(out, 100, 10, (4,), 3)
    assert len(calls) == 3
    assert not out.exists()
    assert leftovers(tmp_path) == []


def test_writer_needs_an_existing_folder(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="folder .*nope does not exist"):
        datasets.make_synthetic(tmp_path / "nope" / "syn.h5", 10, 10, (4,), 3)


def test_writer_refuses_incomplete_file(tmp_path: Path) -> None:
    out = tmp_path / "part.h5"
    writer = DatasetWriter(out, input_shape=(2,), num_classes=2, n_train=4, n_test=2,
                           stored_dtype="float32", scale=1.0, source="")
    with pytest.raises(ValueError, match="expected"), writer:
        writer.append("train", np.zeros((4, 2)), np.zeros(4))
        writer.commit()
    assert not out.exists() and leftovers(tmp_path) == []


# ---------------------------------------------------------------------------------------
# validation of dataset files


@pytest.fixture
def valid_file(tmp_path: Path) -> Path:
    return datasets.make_synthetic(tmp_path / "valid.h5", 50, 20, (6,), 10, seed=3)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=rf"{tmp_path}/absent.h5: no such file"):
        open_dataset(tmp_path / "absent.h5")


def test_not_hdf5(tmp_path: Path) -> None:
    path = tmp_path / "notes.h5"
    path.write_text("these are not the bytes you are looking for\n" * 20)
    with pytest.raises(DataError, match=rf"{path}: not a readable HDF5 file"):
        open_dataset(path)


def test_truncated_hdf5(valid_file: Path) -> None:
    raw = valid_file.read_bytes()
    valid_file.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataError, match=rf"{valid_file}: not a readable HDF5 file"):
        open_dataset(valid_file)


def test_flipped_superblock(valid_file: Path) -> None:
    raw = bytearray(valid_file.read_bytes())
    raw[0:8] = bytes(b ^ 0xFF for b in raw[0:8])
    valid_file.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=rf"{valid_file}: not a readable HDF5 file"):
        open_dataset(valid_file)


def test_flipped_label_bytes(valid_file: Path) -> None:
    flip_chunk_byte(valid_file, "test/y", 0)
    with pytest.raises(DataError, match=rf"{valid_file}: corrupt HDF5 file"):
        open_dataset(valid_file)


def test_flipped_input_bytes(valid_file: Path) -> None:
    """x is not read by open_dataset (too big); the shard that reads it reports the damage."""
    flip_chunk_byte(valid_file, "train/x", 0)
    info = open_dataset(valid_file)
    with pytest.raises(DataError, match=rf"{valid_file}: cannot read rows 0..50 of /train/x"):
        TrainShard(info)
    flip_chunk_byte(valid_file, "test/x", 0)
    with pytest.raises(DataError, match=rf"{valid_file}: cannot read rows 0..20 of /test/x"):
        load_test(info)


def _set_attr(name: str, value: object):
    def mutate(f: h5py.File) -> None:
        f.attrs[name] = value
    return mutate


def _replace(name: str, make):
    def mutate(f: h5py.File) -> None:
        old = f[name][:]
        attrs = dict(f[name].attrs)
        del f[name]
        f[name] = make(old)
        for key, value in attrs.items():
            f[name].attrs[key] = value
    return mutate


def _delete(name: str):
    def mutate(f: h5py.File) -> None:
        del f[name]
    return mutate


def _set_label(split: str, value: int):
    def mutate(f: h5py.File) -> None:
        f[f"{split}/y"][7] = value
    return mutate


BROKEN_FILES = {
    "missing test/y": (_delete("test/y"), "dataset /test/y is missing"),
    "missing train/x": (_delete("train/x"), "dataset /train/x is missing"),
    "missing train group": (_delete("train"), "dataset /train/x is missing"),
    "short y": (_replace("train/y", lambda y: y[:-1]), "/train/x has 50 rows but /train/y has 49"),
    "long x": (_replace("test/x", lambda x: np.concatenate([x, x[:1]])),
               "/test/x has 21 rows but /test/y has 20"),
    "label too big": (_set_label("train", 10), r"/train/y has label 10 outside \[0, 10\)"),
    "negative label": (_set_label("test", -1), r"/test/y has label -1 outside \[0, 10\)"),
    "float labels": (_replace("test/y", lambda y: y.astype(np.float32)),
                     "/test/y has dtype float32, expected integer labels"),
    "2-D labels": (_replace("test/y", lambda y: y[:, None]), r"/test/y has shape \(20, 1\)"),
    "1-D x": (_replace("train/x", lambda x: x[:, 0]), r"/train/x has shape \(50,\)"),
    "float64 x": (_replace("train/x", lambda x: x.astype(np.float64)),
                  "/train/x has dtype float64, expected uint8 or float32"),
    "uint8 without scale": (lambda f: f["train/x"].attrs.__delitem__("scale"),
                            "/train/x is uint8 but has no 'scale' attribute"),
    "zero scale": (lambda f: f["test/x"].attrs.__setitem__("scale", 0.0),
                   "attribute 'scale' must be positive"),
    "shapes differ": (_replace("test/x", lambda x: x[:, :5]),
                      r"train inputs have shape \(6,\) but test inputs have \(5,\)"),
    "dtypes differ": (_replace("test/x", lambda x: (x / 255).astype(np.float32)),
                      "train x is uint8 .* but test x is float32"),
    "wrong format": (_set_attr("format", "something-else"), "not a distbelief dataset"),
    "no format": (lambda f: f.attrs.__delitem__("format"), "not a distbelief dataset"),
    "version 2": (_set_attr("version", 2), "format version 2 is not supported"),
    "no num_classes": (lambda f: f.attrs.__delitem__("num_classes"),
                       "root attribute 'num_classes' is missing"),
    "text num_classes": (_set_attr("num_classes", "ten"), "'num_classes' must be an integer"),
    "one class": (_set_attr("num_classes", 1), "num_classes is 1, need at least 2"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_FILES))
def test_broken_file(valid_file: Path, case: str) -> None:
    mutate, message = BROKEN_FILES[case]
    with h5py.File(valid_file, "a") as f:
        mutate(f)
    with pytest.raises(DataError, match=rf"^{valid_file}: .*{message}"):
        open_dataset(valid_file)


def test_valid_file_description(valid_file: Path) -> None:
    info = open_dataset(valid_file)
    assert info == DatasetInfo(path=valid_file, input_shape=(6,), num_classes=10, n_train=50,
                               n_test=20, stored_dtype="uint8", scale=1 / 255)


def test_hand_written_file_is_accepted(tmp_path: Path) -> None:
    """The documented format, written with plain h5py (no chunking, no checksums, float32
    without scale, int64 labels), is readable."""
    path = tmp_path / "hand.h5"
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f.attrs.update(format="distbelief-dataset", version=1, num_classes=3, source="hand")
        for split, n in (("train", 8), ("test", 4)):
            f[f"{split}/x"] = rng.standard_normal((n, 2, 2, 2)).astype(np.float32)
            f[f"{split}/y"] = np.arange(n, dtype=np.int64) % 3
        expected = f["test/x"][:]
    info = open_dataset(path)
    assert (info.stored_dtype, info.scale, info.input_shape) == ("float32", 1.0, (2, 2, 2))
    x, y = load_test(info)
    np.testing.assert_array_equal(x, expected)
    assert y.dtype == np.int32 and list(y) == [0, 1, 2, 0]


# ---------------------------------------------------------------------------------------
# training shards


@pytest.fixture
def indexed(tmp_path: Path) -> DatasetInfo:
    return write_indexed(tmp_path / "indexed.h5")


def one_epoch_rows(shard: TrainShard) -> np.ndarray:
    x, y = shard.next_batch(shard.n)
    ids = row_ids(x)
    np.testing.assert_array_equal(y, ids % 5)
    return ids


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 5, 7, 23])
def test_shards_are_disjoint_and_cover(indexed: DatasetInfo, num_ranks: int) -> None:
    blocks = [np.sort(one_epoch_rows(TrainShard(indexed, rank, num_ranks, seed=rank)))
              for rank in range(num_ranks)]
    sizes = [len(block) for block in blocks]
    assert max(sizes) - min(sizes) <= 1
    for block in blocks:
        np.testing.assert_array_equal(block, np.arange(block[0], block[0] + len(block)))
    np.testing.assert_array_equal(np.concatenate(blocks), np.arange(indexed.n_train))


def test_shard_reads_only_its_rows(tmp_path: Path) -> None:
    """Every chunk outside rank 2's rows is corrupted: rank 2 still loads (so it read none of
    them), while rank 0, whose rows are damaged, fails."""
    info = write_indexed(tmp_path / "chunked.h5", n_train=40, chunk_rows=5)
    with h5py.File(info.path, "r") as f:
        assert f["train/x"].chunks[0] == 5 and f["train/x"].id.get_num_chunks() == 8
    for chunk in (0, 1, 2, 3, 6, 7):      # rank 2 of 4 holds rows 20..29: chunks 4 and 5
        flip_chunk_byte(info.path, "train/x", chunk)
    shard = TrainShard(info, rank=2, num_ranks=4)
    assert shard.n == 10
    np.testing.assert_array_equal(np.sort(one_epoch_rows(shard)), np.arange(20, 30))
    with pytest.raises(DataError, match="cannot read rows 0..10 of /train/x"):
        TrainShard(info, rank=0, num_ranks=4)


def test_epoch_visits_each_row_once(indexed: DatasetInfo) -> None:
    shard = TrainShard(indexed, rank=0, num_ranks=2, seed=1)    # rows 0..11
    assert shard.n == 12
    batches = [row_ids(shard.next_batch(5)[0]).copy() for _ in range(12)]  # 60 = 5 epochs
    stream = np.concatenate(batches).reshape(5, 12)
    for epoch in stream:
        np.testing.assert_array_equal(np.sort(epoch), np.arange(12))
    assert len({tuple(epoch) for epoch in stream}) == 5    # a fresh order every epoch
    assert shard.state()["epoch"] == 5 and shard.state()["position"] == 0


def test_batches_are_scaled_float32(tmp_path: Path) -> None:
    info = open_dataset(datasets.make_synthetic(tmp_path / "s.h5", 30, 5, (4, 4, 2), 3))
    with h5py.File(info.path, "r") as f:
        stored = f["train/x"][:]
    shard = TrainShard(info, seed=2)
    x, y = shard.next_batch(7)
    assert x.dtype == np.float32 and x.shape == (7, 4, 4, 2) and x.flags.c_contiguous
    assert y.dtype == np.int32 and y.shape == (7,)
    # Each batch row is some stored row times 1/255.
    matches = (np.abs(stored[None].astype(np.float32) / 255 - x[:, None]) < 1e-7)
    assert matches.reshape(7, 30, -1).all(axis=2).any(axis=1).all()
    assert 0.0 <= x.min() and x.max() <= 1.0


def test_same_seed_same_batches(indexed: DatasetInfo) -> None:
    def sequence(seed: int, rank: int = 1) -> list[list[int]]:
        shard = TrainShard(indexed, rank=rank, num_ranks=3, seed=seed)
        return [row_ids(shard.next_batch(3)[0]).tolist() for _ in range(10)]

    assert sequence(7) == sequence(7)
    assert sequence(7) != sequence(8)


def test_state_resumes_identical_sequence(indexed: DatasetInfo) -> None:
    shard = TrainShard(indexed, rank=2, num_ranks=3, seed=11)    # 7 rows
    for _ in range(4):                       # 20 rows: mid-way through the third epoch
        shard.next_batch(5)
    saved = json.loads(json.dumps(shard.state()))
    expected = [row_ids(shard.next_batch(5)[0]).tolist() for _ in range(6)]

    resumed = TrainShard(indexed, rank=2, num_ranks=3, seed=11)
    resumed.load_state(saved)
    assert [row_ids(resumed.next_batch(5)[0]).tolist() for _ in range(6)] == expected
    assert resumed.state() == shard.state()


def test_state_of_another_shard_is_refused(indexed: DatasetInfo) -> None:
    state = TrainShard(indexed, rank=0, num_ranks=3, seed=1).state()
    with pytest.raises(ValueError, match="seed=1, this shard has seed=2"):
        TrainShard(indexed, rank=0, num_ranks=3, seed=2).load_state(state)
    with pytest.raises(ValueError, match="rank=0, this shard has rank=1"):
        TrainShard(indexed, rank=1, num_ranks=3, seed=1).load_state(state)
    with pytest.raises(ValueError, match="out of range"):
        TrainShard(indexed, rank=0, num_ranks=3, seed=1).load_state({**state, "position": 99})
    with pytest.raises(ValueError, match="not a TrainShard state"):
        TrainShard(indexed).load_state({"epoch": 1})


def test_shard_argument_errors(indexed: DatasetInfo) -> None:
    with pytest.raises(DataError, match="23 training rows in .* cannot be split into 24 "):
        TrainShard(indexed, rank=0, num_ranks=24)
    held = with_validation(indexed, 0.2)  # 18 rows trained on, 5 held out
    with pytest.raises(DataError, match=r"the 18 training rows after the validation split "
                       r"\(data.validation\) of the 23 in .* cannot be split into 19 shards"):
        TrainShard(held, rank=0, num_ranks=19)
    for rank in (-1, 3, 1.0):
        with pytest.raises(ValueError, match="rank must be an integer in"):
            TrainShard(indexed, rank=rank, num_ranks=3)
    with pytest.raises(ValueError, match="num_ranks must be a positive integer"):
        TrainShard(indexed, rank=0, num_ranks=0)
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        TrainShard(indexed, seed=-1)
    shard = TrainShard(indexed, rank=0, num_ranks=4)    # 6 rows
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="batch_size must be a positive integer"):
            shard.next_batch(bad)
    with pytest.raises(ValueError, match="batch_size 7 is larger than this shard"):
        shard.next_batch(7)


def test_load_test(indexed: DatasetInfo) -> None:
    x, y = load_test(indexed)
    assert x.dtype == np.float32 and y.dtype == np.int32
    np.testing.assert_array_equal(row_ids(x), np.arange(7))
    np.testing.assert_array_equal(y, np.arange(7) % 5)
    assert len(load_test(indexed, limit=3)[0]) == 3
    assert len(load_test(indexed, limit=1000)[0]) == 7
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="test limit"):
            load_test(indexed, limit=bad)


def test_bytes_read_counts_what_was_read(indexed: DatasetInfo) -> None:
    """bytes_read() grows by exactly the stored bytes of each read: x float32 (3 values a
    row) and y int32 as stored, whatever the reader then converts them to."""
    row = 3 * 4 + 4
    before = bytes_read()
    x, y = read_rows(indexed, "train", 5, 12)
    assert len(x) == 7 and bytes_read() - before == 7 * row == x.nbytes + y.nbytes
    before = bytes_read()
    TrainShard(indexed, rank=1, num_ranks=3)                 # rows 8..15
    assert bytes_read() - before == 8 * row
    before = bytes_read()
    load_test(indexed, limit=3)
    assert bytes_read() - before == 3 * row
    before = bytes_read()
    open_dataset(indexed.path, labels=False)                 # metadata only
    assert bytes_read() == before
    open_dataset(indexed.path)                               # every label of both splits
    assert bytes_read() - before == (23 + 7) * 4


def test_read_rows_at_reads_those_rows_in_their_order(indexed: DatasetInfo) -> None:
    rows = np.array([17, 3, 9, 4])
    before = bytes_read()
    x, y = read_rows_at(indexed, "train", rows)
    np.testing.assert_array_equal(row_ids(x), rows)
    np.testing.assert_array_equal(y, rows % 5)
    assert y.dtype == np.int32 and bytes_read() - before == 4 * (3 * 4 + 4)
    x, y = read_rows_at(indexed, "train", np.array([], dtype=np.intp))
    assert x.shape == (0, 3) and len(y) == 0
    with pytest.raises(ValueError, match="distinct"):
        read_rows_at(indexed, "train", np.array([2, 2]))


def test_a_shard_given_its_rows_reads_nothing(indexed: DatasetInfo) -> None:
    """TrainShard(rows=...) (a partner partition's rows, partitioned_sgd): the same
    batches as a shard that read them, no read; rows of another shape are refused."""
    read = TrainShard(indexed, 1, 3, seed=4)
    before = bytes_read()
    given = TrainShard(indexed, 1, 3, seed=4, rows=read.stored_rows)
    assert bytes_read() == before
    np.testing.assert_array_equal(given.next_batch(5)[0], read.next_batch(5)[0])
    x, y = read.stored_rows
    with pytest.raises(ValueError, match="not rows 8..16"):
        TrainShard(indexed, 1, 3, rows=(x[1:], y[1:]))


def test_file_replaced_after_open(indexed: DatasetInfo, tmp_path: Path) -> None:
    other = write_indexed(tmp_path / "other.h5", n_train=30)
    shutil.copyfile(other.path, indexed.path)
    with pytest.raises(DataError, match="changed since the file was opened"):
        TrainShard(indexed)


# ---------------------------------------------------------------------------------------
# synthetic generator


def read_all(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        return {name: f[name][:] for name in ("train/x", "train/y", "test/x", "test/y")}


def test_synthetic_is_deterministic(tmp_path: Path) -> None:
    args = {"n_train": 300, "n_test": 50, "input_shape": (5, 5, 1), "num_classes": 4,
            "hidden": 16}
    a = read_all(datasets.make_synthetic(tmp_path / "a.h5", seed=9, **args))
    b = read_all(datasets.make_synthetic(tmp_path / "b.h5", seed=9, **args))
    c = read_all(datasets.make_synthetic(tmp_path / "c.h5", seed=10, **args))
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    assert not np.array_equal(a["train/x"], c["train/x"])
    assert not np.array_equal(a["train/y"], c["train/y"])
    assert a["train/x"].shape == (300, 5, 5, 1) and a["test/x"].shape == (50, 5, 5, 1)
    assert not np.array_equal(a["train/x"][:50], a["test/x"])    # separate streams


def test_synthetic_labels_are_the_teachers(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Written in many blocks (memory bound); every label is the teacher's argmax."""
    monkeypatch.setattr(datasets, "SYNTHETIC_BLOCK_VALUES", 7 * 12)    # 7 rows per block
    path = datasets.make_synthetic(tmp_path / "s.h5", 100, 30, (12,), 5, seed=4, hidden=8)
    info = open_dataset(path)
    assert (info.n_train, info.n_test, info.num_classes, info.input_shape) == (100, 30, 5, (12,))
    assert (info.stored_dtype, info.scale) == ("uint8", 1 / 255)
    teacher = datasets.Teacher(12, 8, 5, seed=4)
    stored = read_all(path)
    for split in ("train", "test"):
        x = stored[f"{split}/x"].astype(np.float64) / 255
        np.testing.assert_array_equal(stored[f"{split}/y"], teacher.labels(x))


@pytest.mark.parametrize("num_classes,features", [(2, 30), (10, 50), (10, 784)])
def test_synthetic_classes_are_balanced(tmp_path: Path, num_classes: int,
                                        features: int) -> None:
    path = datasets.make_synthetic(tmp_path / "s.h5", 10000, 10, (features,), num_classes,
                                   seed=1)
    with h5py.File(path, "r") as f:
        share = np.bincount(f["train/y"][:], minlength=num_classes) / 10000 * num_classes
    assert share.min() > 0.6 and share.max() < 1.4, share


def test_synthetic_is_learnable(tmp_path: Path) -> None:
    """Labels depend on the inputs: even a linear least-squares fit beats chance widely."""
    info = open_dataset(datasets.make_synthetic(tmp_path / "s.h5", 3000, 1000, (20,), 4,
                                                seed=2))
    shard = TrainShard(info)
    x, y = (a.copy() for a in shard.next_batch(shard.n))
    design = np.c_[x, np.ones(len(x))]
    weights = np.linalg.lstsq(design, np.eye(4)[y], rcond=None)[0]
    x_test, y_test = load_test(info)
    accuracy = np.mean(np.argmax(np.c_[x_test, np.ones(len(x_test))] @ weights, 1) == y_test)
    assert accuracy > 0.6, accuracy    # chance is 0.25


@pytest.mark.parametrize("kwargs,message", [
    ({"n_train": 0}, "n_train must be an integer >= 1"),
    ({"n_test": -1}, "n_test must be an integer >= 1"),
    ({"num_classes": 1}, "num_classes must be an integer >= 2"),
    ({"hidden": 0}, "hidden must be an integer >= 1"),
    ({"seed": -5}, "seed must be an integer >= 0"),
    ({"input_shape": ()}, "input_shape must have at least one dimension"),
    ({"input_shape": (4, 0)}, "every input_shape dimension"),
])
def test_synthetic_bad_arguments(tmp_path: Path, kwargs: dict, message: str) -> None:
    args = {"n_train": 10, "n_test": 10, "input_shape": (4,), "num_classes": 3, "seed": 0,
            "hidden": 4}
    out = tmp_path / "s.h5"
    with pytest.raises(DataError, match=message):
        datasets.make_synthetic(out, **{**args, **kwargs})
    assert not out.exists()



def test_metadata_only_reads_no_label(valid_file: Path, monkeypatch) -> None:
    from distbelief.data import hdf5

    read = []
    real = hdf5._check_labels
    monkeypatch.setattr(hdf5, "_check_labels", lambda *a: read.append(a[2]) or real(*a))
    assert open_dataset(valid_file, labels=False) == open_dataset(valid_file)
    assert read == ["train/y", "test/y"]  # the second call's only


def test_ranks_check_the_labels_in_parts_and_each_reads_only_its_own(
        valid_file: Path) -> None:
    from distbelief.data import hdf5

    with h5py.File(valid_file, "a") as f:
        f["train/y"][45] = 10  # in the last third of 50 rows: rows 33-49
    with h5py.File(valid_file, "r") as f:
        itemsize = f["train/y"].dtype.itemsize
    before = hdf5.bytes_read()
    open_dataset(valid_file, part=(0, 3))
    # rows 0-15 of 50 training labels and 0-5 of 20 test labels: a third of each
    assert hdf5.bytes_read() - before == (16 + 6) * itemsize
    open_dataset(valid_file, part=(1, 3))
    with pytest.raises(DataError, match="/train/y has label 10 outside"):
        open_dataset(valid_file, part=(2, 3))
    with pytest.raises(DataError, match="/train/y has label 10 outside"):
        open_dataset(valid_file)
    with pytest.raises(ValueError, match="part"):
        open_dataset(valid_file, part=(3, 3))


def test_a_bad_label_in_one_ranks_part_stops_every_rank(valid_file: Path,
                                                        tmp_path: Path) -> None:
    # Three sync ranks check a third of the labels each: only rank 2's part holds the bad
    # one, and every rank exits 2 with the one message.
    with h5py.File(valid_file, "a") as f:
        f["train/y"][45] = 10
    (tmp_path / "c.toml").write_text(
        f'[model]\nlayers = [{{ type = "dense", units = 10, activation = "softmax" }}]\n'
        f'[data]\npath = "{valid_file}"\nbatch_size = 8\n[optimizer]\nalgorithm = "sync"\n'
        f'[run]\nmax_steps = 5\nout_dir = "{tmp_path / "out"}"\n')
    proc = run_mpi(3, [REPO / "tests" / "mpi_programs" / "cli_exit_status.py", "train",
                       tmp_path / "c.toml"],
                   timeout=120, cwd=tmp_path)
    assert exit_statuses(proc) == [2, 2, 2], proc.stdout + proc.stderr[-3000:]
    assert proc.stderr.count("/train/y has label 10 outside [0, 10)") == 1, proc.stderr


def test_a_bad_label_passes_the_metadata_check_and_stops_the_run(valid_file: Path,
                                                                tmp_path: Path) -> None:
    with h5py.File(valid_file, "a") as f:
        _set_label("train", 10)(f)
    (tmp_path / "c.toml").write_text(
        f'[model]\nlayers = [{{ type = "dense", units = 10, activation = "softmax" }}]\n'
        f'[data]\npath = "{valid_file}"\nbatch_size = 8\n[run]\nmax_steps = 5\n')
    from distbelief.config import load_config

    load_config(tmp_path / "c.toml")  # the metadata fit
    proc = run_cli(["train", tmp_path / "c.toml"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "/train/y has label 10 outside [0, 10)" in proc.stderr


# ---------------------------------------------------------------------------------------
# "values" targets: float32 y of shape (N,) or (N, k)


@pytest.mark.parametrize("width", [None, 1, 3])
def test_values_file_reads_back_in_every_reader(tmp_path: Path, width: int | None) -> None:
    info = write_values(tmp_path / "v.h5", width, n_val=6)
    shape = () if width is None else (width,)
    assert (info.targets, info.target_shape, info.num_classes, info.outputs) == \
        ("values", shape, 0, width or 1)
    assert info.target_dtype == np.float32 and open_dataset(info.path) == info
    with h5py.File(info.path) as f:
        assert "num_classes" not in f.attrs and f.attrs["targets"] == "values"
    x, y = read_rows(info, "train", 5, 12)
    assert y.dtype == np.float32 and y.shape == (7, *shape)
    np.testing.assert_array_equal(y, values_of(x, info))
    x, y = read_rows_at(info, "test", np.array([9, 2, 4]))
    np.testing.assert_array_equal(y, values_of(x, info))
    assert read_rows_at(info, "test", np.array([], dtype=np.intp))[1].shape == (0, *shape)
    for limit in (None, 3):
        x, y = load_test(info, limit)
        np.testing.assert_array_equal(y, values_of(x, info))
    shard = TrainShard(info, rank=0, num_ranks=2, seed=1)
    for _ in range(4):  # 4 x 10 rows of 25: the batches cross an epoch
        x, y = shard.next_batch(10)
        assert y.dtype == np.float32 and y.shape == (10, *shape) and y.flags.c_contiguous
        np.testing.assert_array_equal(y, values_of(x, info))
    resumed = TrainShard(info, rank=0, num_ranks=2, seed=1)
    resumed.load_state(shard.state())
    np.testing.assert_array_equal(resumed.next_batch(7)[1], shard.next_batch(7)[1])


def test_values_with_a_validation_split_and_streamed(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from distbelief.data import stream

    monkeypatch.setattr(stream, "READ_BYTES", 1)               # blocks of one 5-row chunk
    info = write_values(tmp_path / "v.h5", 3, chunk_rows=5)
    held = with_validation(info, 0.2)                  # rows 40..49 of /train
    x, y = read_rows(held, "validation", 0, held.n_val)
    np.testing.assert_array_equal(row_ids(x), np.arange(40, 50))
    np.testing.assert_array_equal(y, values_of(x, held))
    # Windows of 2 blocks (3 windows of 2 x 5 rows of 12 bytes in memory).
    streamed = StreamingTrainShard(held, rank=1, num_ranks=2, seed=2, memory_bytes=360)
    try:
        seen = []
        for _ in range(5):                             # 2.5 epochs of 20 rows
            x, y = streamed.next_batch(8)
            assert y.dtype == np.float32 and y.shape == (8, 3)
            np.testing.assert_array_equal(y, values_of(x, held))
            seen.extend(row_ids(x))
        assert streamed.blocks_per_window == 2
        assert sorted(seen[:20]) == list(range(20, 40))
    finally:
        streamed.close()


def _values_file(tmp_path: Path) -> Path:
    return write_values(tmp_path / "v.h5", 3, n_val=6).path


BROKEN_VALUES_FILES = {
    "nan": (lambda f: f["train/y"].__setitem__((7, 1), np.nan),
            r"/train/y row 7 holds nan: targets must be finite numbers"),
    "infinity": (lambda f: f["val/y"].__setitem__((2, 0), -np.inf), r"/val/y row 2 holds -inf"),
    "unknown targets": (_set_attr("targets", "labels"),
                        "root attribute 'targets' is 'labels', expected 'classes' or 'values'"),
    "float64": (_replace("test/y", lambda y: y.astype(np.float64)),
                "/test/y has dtype float64, expected float32"),
    "int": (_replace("test/y", lambda y: y.astype(np.int32)),
            "/test/y has dtype int32, expected float32"),
    "3-D": (_replace("train/y", lambda y: y[:, :, None]),
            r"/train/y has shape \(50, 3, 1\), expected \(N,\) or \(N, k\)"),
    "no targets a row": (_replace("train/y", lambda y: y[:, :0]), r"has shape \(50, 0\)"),
    "test narrower": (_replace("test/y", lambda y: y[:, :2]),
                      (r"/train/y is \(N, 3\) but /test/y is \(N, 2\): every split needs the "
                      "same number of targets per row")),
    "val 1-D": (_replace("val/y", lambda y: y[:, 0]), (r"/train/y is \(N, 3\) but /val/y is "
                                                       r"\(N,\)")),
    "short y": (_replace("train/y", lambda y: y[:-1]),
                "/train/x has 50 rows but /train/y has 49 rows"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_VALUES_FILES))
def test_broken_values_file(tmp_path: Path, case: str) -> None:
    path = _values_file(tmp_path)
    mutate, message = BROKEN_VALUES_FILES[case]
    with h5py.File(path, "a") as f:
        mutate(f)
    with pytest.raises(DataError, match=rf"^{path}: .*{message}") as error:
        open_dataset(path)
    assert "\n" not in str(error.value)


def test_values_ignore_num_classes_and_classes_stay_the_default(tmp_path: Path,
                                                               valid_file: Path) -> None:
    path = _values_file(tmp_path)
    with h5py.File(path, "a") as f:
        f.attrs["num_classes"] = 7
    assert open_dataset(path).num_classes == 0
    with h5py.File(valid_file, "r") as f:                     # written today: no attribute
        assert "targets" not in f.attrs
    info = open_dataset(valid_file)
    assert (info.targets, info.target_shape, info.outputs) == ("classes", (), 10)
    with h5py.File(valid_file, "a") as f:
        f.attrs["targets"] = "classes"
    assert open_dataset(valid_file) == info


def test_float_labels_fail_the_metadata_check_too(valid_file: Path) -> None:
    # A classes file's y dtype is metadata: caught without reading a label, not later as a
    # file that "changed since it was opened".
    with h5py.File(valid_file, "a") as f:
        _replace("test/y", lambda y: y.astype(np.float32))(f)
    with pytest.raises(DataError, match="/test/y has dtype float32, expected integer labels"):
        open_dataset(valid_file, labels=False)


def test_ranks_check_the_values_in_parts(tmp_path: Path) -> None:
    from distbelief.data import hdf5

    path = write_values(tmp_path / "v.h5", 2).path
    with h5py.File(path, "a") as f:
        f["train/y"][45, 1] = np.nan                         # in the last third: rows 33-49
    before = hdf5.bytes_read()
    open_dataset(path, part=(0, 3))
    assert hdf5.bytes_read() - before == (16 + 6) * 2 * 4   # a third of each split's y
    open_dataset(path, part=(1, 3))
    open_dataset(path, labels=False)
    for part in ((2, 3), (0, 1)):
        with pytest.raises(DataError, match="/train/y row 45 holds nan"):
            open_dataset(path, part=part)


def test_values_checked_in_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from distbelief.data import hdf5

    monkeypatch.setattr(hdf5, "LABEL_CHECK_ROWS", 12)        # 4 rows of 3 a block
    path = write_values(tmp_path / "v.h5", 3).path
    open_dataset(path)
    with h5py.File(path, "a") as f:
        f["train/y"][37, 2] = np.inf
    with pytest.raises(DataError, match="/train/y row 37 holds inf"):
        open_dataset(path)


def test_a_values_file_written_by_hand(tmp_path: Path) -> None:
    path = tmp_path / "hand.h5"
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f.attrs.update(format="distbelief-dataset", version=1, targets="values", source="hand")
        for split, n in (("train", 8), ("test", 4)):
            f[f"{split}/x"] = rng.standard_normal((n, 5)).astype(np.float32)
            f[f"{split}/y"] = rng.standard_normal(n).astype(np.float32)
        expected = f["test/y"][:]
    info = open_dataset(path)
    assert (info.targets, info.target_shape, info.outputs) == ("values", (), 1)
    np.testing.assert_array_equal(load_test(info)[1], expected)


def test_file_replaced_by_one_of_other_targets(tmp_path: Path) -> None:
    info = write_values(tmp_path / "v.h5", None, n_train=23, n_test=7)
    shutil.copyfile(write_indexed(tmp_path / "c.h5").path, info.path)    # same shapes, labels
    with pytest.raises(DataError, match="changed since the file was opened"):
        TrainShard(info)


def test_writer_checks_the_targets(tmp_path: Path) -> None:
    args = {"input_shape": (2,), "n_train": 4, "n_test": 2, "stored_dtype": "float32",
            "scale": 1.0, "source": ""}
    for kwargs, message in (({"targets": "regression"}, "targets must be one of"),
                            ({"targets": "values", "target_shape": (2, 2)}, "target_shape"),
                            ({"num_classes": 3, "target_shape": (2,)}, "one per row"),
                            ({}, "num_classes must be at least 2")):
        with pytest.raises(ValueError, match=message):
            DatasetWriter(tmp_path / "w.h5", **args, **kwargs)
    x = np.zeros((4, 2))
    with DatasetWriter(tmp_path / "w.h5", **args, targets="values", target_shape=(3,)) as w:
        for y, message in ((np.zeros((4, 2)), r"rows of shape \(2,\), expected \(3,\)"),
                           (np.zeros(4), r"rows of shape \(\), expected \(3,\)"),
                           (np.zeros((4, 3), dtype=int), "dtype int64, expected floats"),
                           (np.where(np.arange(12).reshape(4, 3) == 5, np.nan, 0.0),
                            "train row 1 holds a target that is not a finite number")):
            with pytest.raises(ValueError, match=message):
                w.append("train", x, y)
    assert leftovers(tmp_path) == [] and not (tmp_path / "w.h5").exists()

