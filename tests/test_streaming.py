"""Training sets larger than memory (issue 30 item 3): `data.in_memory = false` streams each
replica's rows from the file window by window, read ahead by a thread, holding at most
data.stream_memory_mb of rows; every epoch still visits every row once, the order is
seeded, and a checkpoint's data position resumes it exactly."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers.mpi_jobs import run_cli, run_mpi

from distbelief.algorithms.sgd import train
from distbelief.config import config_from_dict, config_hash
from distbelief.data import stream
from distbelief.data.converters import make_synthetic
from distbelief.data.hdf5 import TrainShard, bytes_read, open_dataset, to_float
from distbelief.data.stream import StreamingTrainShard
from distbelief.errors import DataError
from distbelief.records import checkpoint as ckpt

ROW = (12, 12, 1)  # 144 bytes a row: chunks of 1820 rows
MB = 1 << 20


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("streaming")
    make_synthetic(folder / "s.h5", n_train=20000, n_test=300, input_shape=ROW,
                   num_classes=4, seed=2)
    return folder


@pytest.fixture
def small_reads(monkeypatch) -> None:
    """Read blocks of one chunk (1820 rows), so a shard has several windows."""
    monkeypatch.setattr(stream, "READ_BYTES", 1)


def rows_of(batch_x: np.ndarray) -> list[bytes]:
    """Each row's bytes: synthetic rows are distinct, so they name the row."""
    return [row.tobytes() for row in batch_x]


def test_rows_and_block_edges(data_dir: Path, small_reads) -> None:
    info = open_dataset(data_dir / "s.h5")
    shard = StreamingTrainShard(info, 1, 3, seed=0, memory_bytes=2 * MB)
    assert (shard.start, shard.stop) == (6667, 13334)
    assert shard.blocks[0] == (6667, 7280) and shard.blocks[-1] == (12740, 13334)
    assert all(lo % 1820 == 0 for lo, _ in shard.blocks[1:])  # whole chunks
    windows = shard.windows(0)
    # The memory bound: three windows of rows fit in memory_bytes.
    largest = max(sum(hi - lo for lo, hi in w) for w in windows)
    assert 3 * largest * 144 <= 2 * MB
    assert sum(len(w) for w in windows) == len(shard.blocks) and len(windows) > 1


def test_bytes_read_counts_the_streamed_rows(data_dir: Path, small_reads) -> None:
    """One epoch of a streamed shard reads its own rows (x uint8, y int32), counted by
    bytes_read() though a prefetch thread read them, plus at most the two windows it reads
    ahead: the file system sees about 1/3 of the set, not all of it."""
    info = open_dataset(data_dir / "s.h5")
    shard = StreamingTrainShard(info, 1, 3, seed=0, memory_bytes=MB)
    row = 144 + 4
    ahead = 2 * max(sum(hi - lo for lo, hi in w) for w in shard.windows(1))
    before = bytes_read()
    shard.next_batch(shard.n)
    read = bytes_read() - before
    shard.close()
    assert shard.n * row <= read <= (shard.n + ahead) * row
    assert read % row == 0 and bytes_read() - before <= (shard.n + ahead) * row
    assert (shard.n + ahead) * row < info.n_train * row * 2 // 3


@pytest.mark.parametrize("rank, ranks", [(0, 1), (2, 3)])
def test_every_epoch_visits_every_row_once_in_a_new_order(data_dir: Path, small_reads,
                                                          rank: int, ranks: int) -> None:
    info = open_dataset(data_dir / "s.h5")
    shard = StreamingTrainShard(info, rank, ranks, seed=4, memory_bytes=2 * MB)
    with h5py.File(data_dir / "s.h5", locking=False) as f:
        expected = sorted(rows_of(to_float(f["train/x"][shard.start:shard.stop], info.scale)))
    epochs = []
    for _ in range(2):
        seen: list[bytes] = []
        while len(seen) < shard.n:
            x, _ = shard.next_batch(min(97, shard.n - len(seen)))
            seen += rows_of(x)
        epochs.append(seen)
    for seen in epochs:
        assert sorted(seen) == expected
    assert epochs[0] != epochs[1]
    assert shard.epoch == 2 and shard.position == 0


def test_labels_travel_with_their_rows(data_dir: Path, small_reads) -> None:
    info = open_dataset(data_dir / "s.h5")
    with h5py.File(data_dir / "s.h5", locking=False) as f:
        label_of = dict(zip(rows_of(to_float(f["train/x"][:], info.scale)), f["train/y"][:],
                            strict=True))
    shard = StreamingTrainShard(info, 0, 2, seed=1, memory_bytes=2 * MB)
    for _ in range(40):
        x, y = shard.next_batch(64)
        assert [label_of[r] for r in rows_of(x)] == list(y)


def test_a_saved_position_resumes_the_same_batches(data_dir: Path, small_reads) -> None:
    info = open_dataset(data_dir / "s.h5")
    shard = StreamingTrainShard(info, 1, 2, seed=3, memory_bytes=2 * MB)
    for _ in range(130):  # past the first epoch (10000 rows) and into a later window
        shard.next_batch(80)
    state = shard.state()
    ahead = [shard.next_batch(80)[0].copy() for _ in range(60)]
    again = StreamingTrainShard(info, 1, 2, seed=3, memory_bytes=2 * MB)
    again.load_state(state)
    for expected in ahead:
        np.testing.assert_array_equal(again.next_batch(80)[0], expected)
    # A state of the in-memory shard, or of another window shape, is refused.
    with pytest.raises(ValueError, match="data.in_memory = true"):
        again.load_state(TrainShard(info, 1, 2, seed=3).state())
    with pytest.raises(ValueError, match="blocks_per_window"):
        StreamingTrainShard(info, 1, 2, seed=3, memory_bytes=4 * MB).load_state(state)


def test_too_little_memory_and_a_corrupt_file_are_clear_errors(data_dir: Path, tmp_path: Path,
                                                               small_reads) -> None:
    info = open_dataset(data_dir / "s.h5")
    with pytest.raises(DataError, match="stream_memory_mb"):
        StreamingTrainShard(info, 0, 1, memory_bytes=100_000)
    broken = tmp_path / "broken.h5"
    broken.write_bytes((data_dir / "s.h5").read_bytes())
    with h5py.File(broken) as f:
        offset = f["train/x"].id.get_offset() or f["train/x"].id.get_chunk_info(3).byte_offset
    with broken.open("r+b") as f:  # flip bytes in the middle of /train/x's 4th chunk
        f.seek(offset + 1000)
        f.write(b"\xff" * 64)
    shard = StreamingTrainShard(open_dataset(broken), 0, 1, seed=0, memory_bytes=2 * MB)
    with pytest.raises(DataError, match="cannot read training rows"):
        for _ in range(400):  # one epoch reads every chunk
            shard.next_batch(64)


def config(data_dir: Path, out: Path, **data: object) -> object:
    return config_from_dict({
        "model": {"layers": [{"type": "dense", "units": 16, "activation": "relu"},
                             {"type": "dense", "units": 4, "activation": "softmax"}]},
        "data": {"path": str(data_dir / "s.h5"), "batch_size": 32, **data},
        "optimizer": {"algorithm": "sgd", "learning_rate": 0.05},
        "run": {"max_steps": 60, "out_dir": str(out), "checkpoint_every_steps": 30}})


def test_the_setting_is_hashed_only_when_it_streams(data_dir: Path, tmp_path: Path) -> None:
    plain = config_hash(config(data_dir, tmp_path))
    assert config_hash(config(data_dir, tmp_path, in_memory=True,
                              stream_memory_mb=64)) == plain
    streamed = config_hash(config(data_dir, tmp_path, in_memory=False))
    assert streamed != plain
    assert config_hash(config(data_dir, tmp_path, in_memory=False,
                              stream_memory_mb=64)) != streamed


def test_a_streamed_run_resumes_bit_identically(data_dir: Path, tmp_path: Path) -> None:
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    train(config(data_dir, straight, in_memory=False, stream_memory_mb=4), stream=io.StringIO())
    second = config(data_dir, halves, in_memory=False, stream_memory_mb=4)
    first = replace(second, run=replace(second.run, max_steps=30))
    train(first, stream=io.StringIO())
    summary = train(second, stream=io.StringIO())
    assert summary["steps"] == 60 and summary["resumed_from"].endswith("ckpt-0000000030")
    a, _ = ckpt.find_latest(ckpt.checkpoint_root(straight))
    b, _ = ckpt.find_latest(ckpt.checkpoint_root(halves))
    assert a.step == b.step == 60
    np.testing.assert_array_equal(a.read_state()[0], b.read_state()[0])
    assert a.read_replica(0).data_state == b.read_replica(0).data_state
    assert "blocks_per_window" in a.read_replica(0).data_state


def test_downpour_and_sync_train_from_a_streamed_file(data_dir: Path, tmp_path: Path) -> None:
    toml = data_dir / "stream.toml"
    toml.write_text('[model]\nlayers = [{ type = "dense", units = 16, activation = "relu" }, '
                    '{ type = "dense", units = 4, activation = "softmax" }]\n'
                    '[data]\npath = "s.h5"\nbatch_size = 32\nin_memory = false\n'
                    'stream_memory_mb = 8\n[optimizer]\nalgorithm = "downpour"\n'
                    'learning_rate = 0.05\n[run]\nmax_steps = 80\n')
    for ranks, algorithm in ((3, "downpour"), (2, "sync")):
        out = tmp_path / algorithm
        sets = ["--set", f'run.out_dir="{out}"', "--set", f'optimizer.algorithm="{algorithm}"']
        if algorithm == "sync":
            sets += ["--set", "cluster.ps_shards=0"]
        proc = run_mpi(ranks, ["-m", "distbelief", "train", toml, *sets], timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert (out / "summary.json").exists()
    # Sandblaster reads the whole set on every replica: refused, in one line.
    proc = run_cli(["train", toml, "--set", 'optimizer.algorithm="sandblaster"'])
    assert proc.returncode == 2 and "leave data.in_memory = true" in proc.stderr
