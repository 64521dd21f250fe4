"""Sparse data (issue 44, part 1): SparseRows, the two sparse kinds of dataset file (CSR
rows, id fields) written and read back through every reader, streamed and resumed like
dense files, the libsvm and scipy .npz converters, the synthetic generators' planted
models, the file checks, and the memory plan's row bytes."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from distbelief.cli import main
from distbelief.data import stream, write_dataset
from distbelief.data.arrays import load_sparse_npz
from distbelief.data.hdf5 import (
    DatasetWriter,
    TrainShard,
    bytes_read,
    load_split,
    load_test,
    open_dataset,
    read_rows,
    read_rows_at,
    with_validation,
)
from distbelief.data.libsvm import convert_libsvm, parse_block
from distbelief.data.sparse import SparseRows, concatenate
from distbelief.data.stream import StreamingTrainShard
from distbelief.data.synthetic_sparse import Options, kind_options, make_sparse_synthetic
from distbelief.errors import DataError

# ---------------------------------------------------------------------------------------
# helpers


def random_dense(rng: np.random.Generator, rows: int, cols: int,
                 density: float = 0.15) -> np.ndarray:
    """A float32 matrix of mostly zeros, with one empty row (a row with no features is an
    example too)."""
    x = ((rng.random((rows, cols)) < density) * rng.normal(size=(rows, cols))).astype(np.float32)
    x[3] = 0
    return x


def names(batch: tuple) -> list[int]:
    """Which rows a batch holds: the sparse file's targets are the row numbers, the ids
    file's field 0."""
    x, y = batch
    return [int(v) for v in (y if isinstance(x, SparseRows) else x[:, 0])]


@pytest.fixture(scope="module")
def sparse_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    """A sparse file of 120 training and 30 test rows of 40 features whose targets are the
    row numbers, and the dense matrix it was written from (in order: no shuffle)."""
    rng = np.random.default_rng(0)
    dense = random_dense(rng, 150, 40)
    path = tmp_path_factory.mktemp("sparse") / "s.h5"
    rows = np.arange(150, dtype=np.float32)
    write_dataset(path, SparseRows.from_dense(dense[:120]), rows[:120],
                  SparseRows.from_dense(dense[120:]), rows[120:], shuffle=False)
    return path, dense


@pytest.fixture(scope="module")
def ids_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    """An ids file of 100 training and 20 test rows of 3 fields (field 0 names the row),
    class labels; and the ids."""
    rng = np.random.default_rng(1)
    ids = np.stack([np.arange(120), rng.integers(0, 7, 120), rng.integers(0, 1000, 120)], 1)
    path = tmp_path_factory.mktemp("ids") / "i.h5"
    write_dataset(path, ids[:100], ids[:100, 1] % 3, ids[100:], ids[100:, 1] % 3,
                  id_rows=[120, 7, 1000], shuffle=False)
    return path, ids


def epoch_of(shard: TrainShard | StreamingTrainShard, batch: int) -> list[int]:
    out: list[int] = []
    while len(out) < shard.n:
        out += names(shard.next_batch(batch))
    return out


# ---------------------------------------------------------------------------------------
# SparseRows


def test_sparse_rows_slice_gather_and_concatenate_as_dense_rows_do() -> None:
    rng = np.random.default_rng(2)
    dense = random_dense(rng, 20, 9)
    rows = SparseRows.from_dense(dense)
    assert rows.shape == (20, 9) and rows.nnz == np.count_nonzero(dense)
    assert np.array_equal(rows[5:12].to_dense(), dense[5:12])
    assert np.array_equal(rows[12:5].to_dense(), dense[12:5])
    assert np.array_equal(rows[::3].to_dense(), dense[::3])
    picked = np.array([7, 3, 3, 19, 0])
    assert np.array_equal(rows[picked].to_dense(), dense[picked])
    parts = [rows[:4], rows[4:4], rows[4:15], rows[15:]]
    assert np.array_equal(concatenate(parts).to_dense(), dense)
    with pytest.raises(DataError, match="slice or a 1-d integer array"):
        rows[np.ones(20, dtype=bool)]


def test_sparse_rows_from_a_scipy_matrix() -> None:
    sp = pytest.importorskip("scipy.sparse")
    matrix = sp.random(30, 50, density=0.1, format="coo", random_state=3)
    rows = SparseRows.from_scipy(matrix)
    assert np.array_equal(rows.to_dense(), matrix.toarray().astype(np.float32))


# ---------------------------------------------------------------------------------------
# writing and reading back


def test_a_sparse_file_reads_back_through_every_reader(sparse_file) -> None:
    path, dense = sparse_file
    info = open_dataset(path)
    assert (info.features, info.input_shape, info.n_train, info.n_test) == \
        ("sparse", (40,), 120, 30)
    assert info.nnz_per_row == pytest.approx(np.count_nonzero(dense[:120]) / 120)
    with h5py.File(path) as f:  # the layout the FORMAT docstring promises
        assert f.attrs["features"] == "sparse" and f.attrs["n_features"] == 40
        assert [f[f"train/x/{k}"].dtype for k in ("indptr", "indices", "values")] == \
            [np.int64, np.int32, np.float32]
    x, y = read_rows(info, "train", 10, 37)
    assert isinstance(x, SparseRows) and np.array_equal(x.to_dense(), dense[10:37])
    assert np.array_equal(y, np.arange(10, 37))
    x, _ = read_rows_at(info, "test", np.array([29, 0, 4, 5, 6]))
    assert np.array_equal(x.to_dense(), dense[120:][[29, 0, 4, 5, 6]])
    x, _ = load_test(info, limit=7)
    assert np.array_equal(x.to_dense(), dense[120:127])
    x, _ = load_split(with_validation(info, 0.25), "validation")
    assert np.array_equal(x.to_dense(), dense[90:120])


def test_reading_a_range_reads_only_its_share(sparse_file) -> None:
    path, dense = sparse_file
    info = open_dataset(path, labels=False)
    before = bytes_read()
    _, y = read_rows(info, "train", 30, 60)
    # indptr's 31 offsets, then 4 + 4 bytes an entry of these rows only, and their targets
    assert bytes_read() - before == 31 * 8 + 8 * np.count_nonzero(dense[30:60]) + y.nbytes


def test_an_ids_file_reads_back_as_int64(ids_file) -> None:
    path, ids = ids_file
    info = open_dataset(path)
    assert (info.features, info.input_shape, info.id_rows, info.num_classes) == \
        ("ids", (3,), (120, 7, 1000), 3)
    with h5py.File(path) as f:
        assert f["train/x"].dtype == np.int32 and list(f.attrs["id_rows"]) == [120, 7, 1000]
    x, y = read_rows(info, "train", 5, 50)
    assert x.dtype == np.int64 and np.array_equal(x, ids[5:50])
    x, _ = read_rows_at(info, "test", np.array([3, 1]))
    assert np.array_equal(x, ids[[103, 101]])
    x, y = load_split(with_validation(info, 0.1), "validation")
    assert x.dtype == np.int64 and np.array_equal(x, ids[90:100])
    assert np.array_equal(y, ids[90:100, 1] % 3)


def test_a_written_val_split_and_the_writer_checks(tmp_path: Path) -> None:
    rows = SparseRows.from_dense(np.eye(6, 5, dtype=np.float32))
    y = np.arange(6, dtype=np.float32)
    with DatasetWriter(tmp_path / "v.h5", input_shape=(5,), n_train=3, n_test=2, n_val=1,
                       stored_dtype="float32", scale=1.0, source="test", targets="values",
                       features="sparse") as writer:
        with pytest.raises(ValueError, match="SparseRows of 5 features"):
            writer.append("train", np.eye(3, 5), y[:3])
        for split, a, b in (("train", 0, 3), ("test", 3, 5), ("val", 5, 6)):
            writer.append(split, rows[a:b], y[a:b])
        info = writer.commit()
    assert info.n_val == 1
    assert np.array_equal(load_split(info, "validation")[0].to_dense(), rows[5:].to_dense())
    with pytest.raises(ValueError, match="id_rows must give"):
        DatasetWriter(tmp_path / "w.h5", input_shape=(2,), n_train=1, n_test=1,
                      stored_dtype="int32", scale=1.0, source="t", features="ids",
                      id_rows=(3,))


def test_write_dataset_shuffles_and_holds_out_sparse_rows_like_dense_ones(tmp_path) -> None:
    """The same rows written dense and sparse, shuffled with a held-out test fraction,
    come back in the same order."""
    dense = random_dense(np.random.default_rng(4), 60, 12)
    y = np.arange(60) % 3
    a = write_dataset(tmp_path / "d.h5", dense, y, test_fraction=0.2, seed=5)
    b = write_dataset(tmp_path / "s.h5", SparseRows.from_dense(dense), y, test_fraction=0.2,
                      seed=5)
    for split in ("train", "test"):
        (xa, ya), (xb, yb) = load_split(a, split), load_split(b, split)
        assert np.array_equal(xa, xb.to_dense()) and np.array_equal(ya, yb)


def test_write_dataset_refuses_ids_outside_their_tables(tmp_path: Path) -> None:
    ids = np.array([[0, 1], [2, 5], [1, 0]])
    with pytest.raises(DataError, match="x row 1 field 1 has the id 5, outside"):
        write_dataset(tmp_path / "i.h5", ids, np.zeros(3), id_rows=[3, 5], test_fraction=0.4)
    with pytest.raises(DataError, match="integer ids"):
        write_dataset(tmp_path / "i.h5", ids.astype(float), np.zeros(3), id_rows=[3, 6],
                      test_fraction=0.4)
    with pytest.raises(DataError, match="no scale"):
        write_dataset(tmp_path / "i.h5", SparseRows.from_dense(np.eye(3)), np.zeros(3),
                      scale=0.5, test_fraction=0.4)
    assert not (tmp_path / "i.h5").exists()


# ---------------------------------------------------------------------------------------
# shards: in memory, streamed, resumed


@pytest.mark.parametrize("kind", ["sparse", "ids"])
def test_a_shard_serves_every_row_once_an_epoch_and_resumes(kind, sparse_file, ids_file):
    path = (sparse_file if kind == "sparse" else ids_file)[0]
    info = open_dataset(path)
    shard = TrainShard(info, 1, 2, seed=3)
    epoch = epoch_of(shard, 7)
    assert sorted(epoch[:shard.n]) == list(range(shard.start, shard.stop))
    x, y = shard.next_batch(5)
    assert (x.dtype, len(y)) == ((np.float32 if kind == "sparse" else np.int64), 5)
    saved = shard.state()
    after = [names(shard.next_batch(6)) for _ in range(4)]
    resumed = TrainShard(info, 1, 2, seed=3)
    resumed.load_state(saved)
    assert [names(resumed.next_batch(6)) for _ in range(4)] == after


@pytest.mark.parametrize("kind", ["sparse", "ids"])
def test_a_streamed_shard_serves_the_same_rows_within_its_memory(kind, sparse_file, ids_file,
                                                                monkeypatch):
    monkeypatch.setattr(stream, "READ_BYTES", 1)  # blocks of a row (sparse), a chunk (ids)
    path = (sparse_file if kind == "sparse" else ids_file)[0]
    info = with_validation(open_dataset(path), 0.1)
    block_rows = 1 if kind == "sparse" else 100  # the ids file's one chunk
    memory = 3 * 10 * block_rows * info.stored_row_bytes  # windows of 10 blocks
    streamed = StreamingTrainShard(info, 0, 2, seed=1, memory_bytes=memory)
    assert (streamed.block_rows, streamed.blocks_per_window) == (block_rows, 10)
    in_memory = TrainShard(info, 0, 2, seed=1)
    first = epoch_of(streamed, 9)
    assert sorted(first[:streamed.n]) == sorted(epoch_of(in_memory, 9)[:in_memory.n]) \
        == list(range(streamed.start, streamed.stop))  # and no held-out row
    saved = streamed.state()
    after = [names(streamed.next_batch(5)) for _ in range(6)]
    streamed.close()
    again = StreamingTrainShard(info, 0, 2, seed=1, memory_bytes=memory)
    again.load_state(saved)
    assert [names(again.next_batch(5)) for _ in range(6)] == after
    again.close()


def test_streamed_sparse_batches_are_the_dense_ones(sparse_file, tmp_path, monkeypatch):
    """Given the same block layout, a streamed sparse file serves the very batches a streamed
    dense file of the same rows does: the order depends on the seed and the blocks only."""
    path, dense = sparse_file
    monkeypatch.setattr(stream, "_block_rows", lambda info, row_bytes: 8)
    rows = np.arange(150, dtype=np.float32)
    dense_info = write_dataset(tmp_path / "d.h5", dense[:120], rows[:120], dense[120:],
                               rows[120:], shuffle=False)
    shards = []
    for info in (open_dataset(path), dense_info):
        shards.append(StreamingTrainShard(info, 0, 1, seed=2,
                                          memory_bytes=3 * 8 * 2 * info.stored_row_bytes))
    assert shards[0].blocks_per_window == shards[1].blocks_per_window == 2
    for _ in range(20):
        (xs, ys), (xd, yd) = (shard.next_batch(11) for shard in shards)
        assert np.array_equal(xs.to_dense(), xd) and np.array_equal(ys, yd)
    for shard in shards:
        shard.close()


# ---------------------------------------------------------------------------------------
# corrupt files


def _corrupt_copy(source: Path, tmp_path: Path, change) -> Path:
    path = tmp_path / "bad.h5"
    path.write_bytes(source.read_bytes())
    with h5py.File(path, "r+") as f:
        change(f)
    return path


def _set(name: str, index: int, value) -> object:
    def change(f: h5py.File) -> None:
        f[name][index] = value
    return change


@pytest.mark.parametrize("change, message", [
    (_set("train/x/indices", 4, 40), r"/train/x row \d+ has the feature id 40, outside"),
    (_set("train/x/indices", 2, -1), r"/train/x row \d+ has the feature id -1"),
    (_set("train/x/indptr", 5, 0), r"/train/x/indptr decreases at row"),
    (_set("test/x/indptr", 30, 3), r"/test/x/indptr runs from 0 to 3,"),
    (_set("train/x/values", 0, np.nan), r"/train/x row \d+ holds the value nan"),
    (lambda f: f.attrs.__delitem__("n_features"), "root attribute 'n_features'"),
    (lambda f: f.attrs.__setitem__("features", "bags"), "root attribute 'features' is 'bags'"),
    (lambda f: f.__delitem__("test/x/values"), "/test/x/values is missing"),
])
def test_a_corrupt_sparse_file_is_one_data_error(sparse_file, tmp_path, change, message):
    path = _corrupt_copy(sparse_file[0], tmp_path, change)
    with pytest.raises(DataError, match=message) as caught:
        open_dataset(path)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


def test_ranks_share_the_content_check_each_reading_its_part(sparse_file, tmp_path) -> None:
    """open_dataset(part=(i, k)) checks only the i-th of k parts of the entries: a bad id
    in the first rows is found by part 0 alone."""
    path = _corrupt_copy(sparse_file[0], tmp_path, _set("train/x/indices", 1, 99))
    open_dataset(path, part=(1, 2))
    with pytest.raises(DataError, match="feature id 99"):
        open_dataset(path, part=(0, 2))
    assert open_dataset(path, labels=False).features == "sparse"  # metadata only


@pytest.mark.parametrize("change, message", [
    (lambda f: f.attrs.__delitem__("id_rows"), "root attribute 'id_rows' is missing"),
    (lambda f: f.attrs.__setitem__("id_rows", [120, 7]), r"has shape \(100, 3\), expected"),
    (_set("train/x", (8, 1), 7), r"/train/x row 8 field 1 has the id 7, outside \[0, 7\)"),
    (_set("test/x", (2, 2), -3), r"/test/x row 2 field 2 has the id -3"),
])
def test_a_corrupt_ids_file_is_one_data_error(ids_file, tmp_path, change, message):
    path = _corrupt_copy(ids_file[0], tmp_path, change)
    with pytest.raises(DataError, match=message) as caught:
        open_dataset(path)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


# ---------------------------------------------------------------------------------------
# libsvm


def test_libsvm_labels_decide_the_targets(tmp_path: Path) -> None:
    cases = {"+1 1:0.5\n-1 2:1\n+1 3:2\n-1 1:1\n": ("values", [1, 0, 1, 0]),
             "1 1:0.5\n0 2:1\n1 3:2\n0 1:1\n": ("values", [1, 0, 1, 0]),
             "2 1:0.5\n0 2:1\n5 3:2\n1 1:1\n": ("classes", [2, 0, 5, 1]),
             "2.5 1:0.5\n-1 2:1\n0.25 3:2\n1 1:1\n": ("values", [2.5, -1, 0.25, 1])}
    for i, (text, (targets, labels)) in enumerate(cases.items()):
        (tmp_path / f"{i}.svm").write_text(text)
        info = convert_libsvm(tmp_path / f"{i}.svm", tmp_path / f"{i}.h5", test_fraction=0.25,
                              shuffle=False)
        assert (info.targets, info.input_shape) == (targets, (4,))
        y = np.concatenate([load_split(info, "train")[1], load_split(info, "test")[1]])
        assert sorted(y.tolist()) == sorted(labels)
    (tmp_path / "neg.svm").write_text("0 1:1\n2 1:1\n# c\n-1 1:1\n")
    with pytest.raises(DataError, match=r"neg.svm, line 4 has the label -1: .* must be >= 0"):
        convert_libsvm(tmp_path / "neg.svm", tmp_path / "neg.h5")


def test_libsvm_reads_qid_comments_and_blank_lines(tmp_path: Path) -> None:
    text = ("# a header\n1 qid:4 3:0.5 10:2 # a comment\n\n0 qid:4 1:1e-3\r\n"
            "1 2:-1.5   4:1\n0\n")
    labels, lengths, ids, values, lines = parse_block(text.encode(), 1, tmp_path / "t.svm")
    assert labels.tolist() == [1, 0, 1, 0] and lengths.tolist() == [2, 1, 2, 0]
    assert ids.tolist() == [3, 10, 1, 2, 4] and values.tolist() == [0.5, 2, 1e-3, -1.5, 1]
    assert lines.tolist() == [2, 4, 5, 6]


@pytest.mark.parametrize("line, message", [
    ("abc 1:2", "the label 'abc' is not a number"),
    ("1 3:", "'3:' is not id:value"),
    ("1 :3", "':3' is not id:value"),
    ("1 2:3 4", "'4' is not id:value"),
    ("1 2.5:3", "the feature id 2.5 is not a whole number"),
    ("1 -2:3", "the feature id -2 is not a whole number"),
    ("1 2:nan", "the value nan is not a finite"),
    ("1,2 3:1", "the label .1,2. lists several labels"),
])
def test_a_bad_libsvm_line_is_one_error_naming_it(tmp_path: Path, line: str, message: str):
    (tmp_path / "t.svm").write_text(f"1 1:1\n# fine\n0 2:1\n{line}\n1 1:1\n")
    with pytest.raises(DataError, match=f"t.svm, line 4: {message}"):
        convert_libsvm(tmp_path / "t.svm", tmp_path / "t.h5")
    assert not (tmp_path / "t.h5").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["t.svm"]  # no scratch left behind


def test_libsvm_with_a_test_file_shares_the_table_and_features_bounds_it(tmp_path: Path):
    (tmp_path / "a.svm").write_text("1 1:1 5:2\n0 2:1\n1 3:1\n")
    (tmp_path / "b.svm").write_text("0 9:1\n1 1:1\n")
    info = convert_libsvm(tmp_path / "a.svm", tmp_path / "ab.h5", test=tmp_path / "b.svm")
    assert (info.input_shape, info.n_train, info.n_test) == ((10,), 3, 2)
    assert load_test(info)[0].to_dense()[0, 9] == 1
    with pytest.raises(DataError, match=r"b.svm, line 1: the feature id 9 is not below "
                                        r"--features 8"):
        convert_libsvm(tmp_path / "a.svm", tmp_path / "x.h5", test=tmp_path / "b.svm",
                       features=8)
    info = convert_libsvm(tmp_path / "a.svm", tmp_path / "c.h5", test=tmp_path / "b.svm",
                          features=100)
    assert info.input_shape == (100,)


def test_libsvm_writes_what_write_dataset_writes(tmp_path: Path) -> None:
    """The converter is write_dataset over the parsed rows: the same hold-out and shuffle."""
    rng = np.random.default_rng(6)
    dense = random_dense(rng, 40, 15)
    y = (rng.random(40) < 0.5).astype(np.float32)
    lines = [f"{int(label)} " + " ".join(f"{j}:{float(row[j])!r}" for j in np.flatnonzero(row))
             for label, row in zip(y, dense, strict=True)]
    (tmp_path / "t.svm").write_text("\n".join(lines) + "\n")
    assert main(["prepare", "libsvm", str(tmp_path / "t.svm"), "--out",
                 str(tmp_path / "t.h5"), "--features", "15", "--seed", "3"]) == 0
    direct = write_dataset(tmp_path / "d.h5", SparseRows.from_dense(dense), y,
                           test_fraction=0.1, seed=3)
    got = open_dataset(tmp_path / "t.h5")
    for split in ("train", "test"):
        (xa, ya), (xb, yb) = load_split(got, split), load_split(direct, split)
        assert np.array_equal(xa.to_dense(), xb.to_dense()) and np.array_equal(ya, yb)


# ---------------------------------------------------------------------------------------
# scipy .npz files


def _save_npz(path: Path, fmt: str, shape, data, indices, indptr) -> None:
    """What scipy.sparse.save_npz writes, with numpy alone."""
    np.savez(path, format=np.array(fmt.encode()), shape=np.array(shape), data=data,
             indices=indices, indptr=indptr)


def test_an_npz_from_save_npz_reads_as_csr_or_csc(tmp_path: Path) -> None:
    dense = random_dense(np.random.default_rng(7), 12, 6)
    csr = SparseRows.from_dense(dense)
    _save_npz(tmp_path / "r.npz", "csr", dense.shape, csr.values.astype(np.float64),
              csr.indices, csr.indptr.astype(np.int32))
    assert np.array_equal(load_sparse_npz(tmp_path / "r.npz").to_dense(), dense)
    by_column = SparseRows.from_dense(dense.T)  # CSC of dense is CSR of its transpose
    _save_npz(tmp_path / "c.npz", "csc", dense.shape, by_column.values, by_column.indices,
              by_column.indptr)
    assert np.array_equal(load_sparse_npz(tmp_path / "c.npz").to_dense(), dense)
    _save_npz(tmp_path / "o.npz", "coo", dense.shape, csr.values, csr.indices, csr.indptr)
    with pytest.raises(DataError, match="a scipy.sparse coo matrix; only CSR and CSC"):
        load_sparse_npz(tmp_path / "o.npz")
    np.save(tmp_path / "y.npy", np.arange(12) % 2)
    assert main(["prepare", "arrays", "--x", str(tmp_path / "c.npz"), "--y",
                 str(tmp_path / "y.npy"), "--test-fraction", "0.25", "--out",
                 str(tmp_path / "c.h5")]) == 0
    info = open_dataset(tmp_path / "c.h5")
    assert (info.features, info.n_train, info.num_classes) == ("sparse", 9, 2)


def test_a_scipy_matrix_round_trips(tmp_path: Path) -> None:
    sp = pytest.importorskip("scipy.sparse")
    matrix = sp.random(50, 30, density=0.2, format="csr", random_state=8)
    sp.save_npz(tmp_path / "m.npz", matrix.tocsc())
    assert np.array_equal(load_sparse_npz(tmp_path / "m.npz").to_dense(),
                          matrix.toarray().astype(np.float32))
    info = write_dataset(tmp_path / "m.h5", matrix, np.arange(50), x_test=matrix[:5],
                         y_test=np.arange(5), shuffle=False)
    x, _ = load_split(info, "train")
    assert np.array_equal(x.to_dense(), matrix.toarray().astype(np.float32))
    assert np.array_equal(load_test(info)[0].to_dense(), matrix[:5].toarray().astype(np.float32))


# ---------------------------------------------------------------------------------------
# synthetic data with a planted model


def test_the_logistic_planted_model_is_far_better_than_a_constant(tmp_path: Path) -> None:
    made = make_sparse_synthetic("logistic", tmp_path / "l.h5",
                                 Options(train=2000, test=4000, features=5000, nnz=20))
    info = made.info
    assert info.features == "sparse" and info.nnz_per_row == pytest.approx(20, abs=0.5)
    x, y = load_test(info)
    with h5py.File(info.path) as f:
        weights, bias = f["planted/weights"][:], f["planted/bias"][()]
        assert "synthetic" in f.attrs["source"] and "Floor" in f.attrs["source"]
    rows = np.repeat(np.arange(len(x)), np.diff(x.indptr))
    logit = np.bincount(rows, weights=weights[x.indices] * x.values, minlength=len(x)) + bias
    p = np.clip(1 / (1 + np.exp(-logit)), 1e-7, 1 - 1e-7)
    planted = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    rate = y.mean()
    constant = -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate))
    assert planted == pytest.approx(made.floor, rel=1e-3)
    assert planted < constant - 0.15 and made.baseline == pytest.approx(constant, rel=1e-3)
    counts = np.bincount(x.indices, minlength=5000)  # Zipf: a few ids carry many entries
    assert np.sort(counts)[-50:].sum() > 0.3 * counts.sum()


def test_the_mf_planted_model_has_the_noise_as_its_error(tmp_path: Path) -> None:
    made = make_sparse_synthetic("mf", tmp_path / "m.h5",
                                 Options(train=3000, test=20000, users=300, items=200,
                                         noise=0.2, seed=4))
    info = made.info
    assert (info.features, info.id_rows, info.targets) == ("ids", (300, 200), "values")
    x, y = load_test(info)
    with h5py.File(info.path) as f:
        users, items = f["planted/users"][:], f["planted/items"][:]
    mse = np.mean((np.sum(users[x[:, 0]] * items[x[:, 1]], axis=1) - y) ** 2)
    assert mse == pytest.approx(0.04, rel=0.05) and made.floor == pytest.approx(0.04, rel=0.05)
    assert made.baseline > 10 * made.floor
    assert made.summary().startswith(f"{info.path}: 3,000 training and 20,000 test rows (2 id "
                                     "fields of 300, 200 rows); the planted model's test mse")


def test_the_fields_generator_and_its_command(tmp_path: Path, capsys) -> None:
    out = tmp_path / "f.h5"
    assert main(["prepare", "sparse-synthetic", "fields", "--out", str(out), "--fields", "3",
                 "--field-rows", "50", "--train", "500", "--test", "2000"]) == 0
    printed = capsys.readouterr().out
    assert "3 id fields of 50 rows each" in printed and "planted model's test log-loss" \
        in printed
    info = open_dataset(out)
    assert info.id_rows == (50, 50, 50) and load_test(info)[0].dtype == np.int64
    again = make_sparse_synthetic("fields", tmp_path / "g.h5",
                                  Options(train=500, test=2000, fields=3, field_rows=50))
    assert again.floor < again.baseline - 0.1
    assert np.array_equal(load_test(info)[0], load_test(again.info)[0])  # seeded
    assert main(["prepare", "sparse-synthetic", "mf", "--out", str(tmp_path / "x.h5"),
                 "--nnz", "3"]) == 2
    assert "--nnz: not an option of mf" in capsys.readouterr().err


def test_a_kind_takes_only_its_own_options() -> None:
    # Keys that are no kind's own (out, train, ...) pass by; None means not given.
    assert kind_options("mf", {"users": 30, "nnz": None, "out": "x.h5", "train": 9}) == \
        {"users": 30}
    with pytest.raises(DataError, match=r"^--field-rows, --nnz: not an option of mf \("):
        kind_options("mf", {"users": 30, "nnz": 3, "field_rows": 5})
    with pytest.raises(DataError, match="unknown synthetic kind 'dense'"):
        kind_options("dense", {})


# ---------------------------------------------------------------------------------------
# the memory plan


def test_the_memory_plan_counts_a_sparse_row_by_its_entries(sparse_file, tmp_path) -> None:
    from helpers.configs import small_config_text

    from distbelief.algorithms.memory_plan import workload
    from distbelief.config import load_config
    from distbelief.model.memory_model import activation_bytes

    (tmp_path / "c.toml").write_text(small_config_text(
        data={"path": str(sparse_file[0]), "batch_size": 16}))
    config = load_config(tmp_path / "c.toml", open_data=False)
    info = open_dataset(sparse_file[0])
    work = workload(config, info, "rma")
    assert work.row_bytes == info.stored_row_bytes + 8 == \
        int(np.ceil(8 * info.nnz_per_row)) + 16
    assert work.input_values == -(-info.stored_row_bytes // 4)

    class Net:
        layers, input_shape = [], (10**6,)

    assert activation_bytes(Net(), 16, input_values=work.input_values) == \
        4 * 16 * work.input_values
