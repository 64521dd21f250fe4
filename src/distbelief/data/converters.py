"""Makers of dataset files (format: `data.py`, how-to: data/README.md).

`convert_idx` converts the four IDX files of Fashion-MNIST (or MNIST, same layout) into one
dataset file; `make_synthetic` labels random inputs with a random "teacher" network, for
sizes no real dataset here has. Both write atomically through `data.DatasetWriter` and
raise DataError in plain words for anything wrong with their inputs.
"""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

import numpy as np

from distbelief.data.hdf5 import IMAGE_SCALE, DatasetWriter
from distbelief.errors import DataError

IDX_NAMES = {
    ("train", "images"): "train-images-idx3-ubyte",
    ("train", "labels"): "train-labels-idx1-ubyte",
    ("test", "images"): "t10k-images-idx3-ubyte",
    ("test", "labels"): "t10k-labels-idx1-ubyte",
}
IDX_UBYTE = 0x08
IDX_NDIM = {"images": 3, "labels": 1}
GZIP_MAGIC = b"\x1f\x8b"

# The synthetic generator works on blocks of about this many input values, so that memory
# stays bounded whatever n_train is.
SYNTHETIC_BLOCK_VALUES = 1 << 22
# Inputs used to centre and scale the teacher's logits (class balance).
SYNTHETIC_CALIBRATION_ROWS = 4096


def find_idx_file(src_dir: Path, name: str) -> Path:
    """`name` or `name.gz` in src_dir; the uncompressed file wins when both exist."""
    for candidate in (src_dir / name, src_dir / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise DataError(f"no {name}(.gz) in {src_dir}")


def _read_bytes(path: Path) -> bytes:
    """The file's bytes, decompressed if it is gzip (by content, not by name)."""
    try:
        raw = path.read_bytes()
        if raw[:2] != GZIP_MAGIC:
            return raw
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: cannot read (truncated or corrupt gzip?): {exc}") from exc


def read_idx(path: str | os.PathLike, ndim: int) -> np.ndarray:
    """An IDX file of unsigned bytes with `ndim` dimensions, validated against its header.

    IDX: two zero bytes, a type byte (0x08 = unsigned byte), the number of dimensions, then
    each dimension as a big-endian uint32, then the data, row-major.
    """
    path = Path(path)
    data = _read_bytes(path)
    magic = int.from_bytes(data[:4], "big") if len(data) >= 4 else None
    expected_magic = (IDX_UBYTE << 8) | ndim
    if magic != expected_magic:
        found = "a file shorter than 4 bytes" if magic is None else f"0x{magic:08x}"
        raise DataError(f"{path}: bad IDX magic number {found}, expected 0x{expected_magic:08x} "
                        f"(unsigned bytes, {ndim} dimension{'s' if ndim > 1 else ''})")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(f"{path}: truncated IDX header")
    dims = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    size = int(np.prod(dims, dtype=np.int64))
    if len(data) - header != size:
        what = "truncated" if len(data) - header < size else "has trailing bytes"
        raise DataError(f"{path}: {what}: header says {dims} = {size} bytes of data, "
                        f"found {len(data) - header}")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def _load_split(src_dir: Path, split: str) -> tuple[np.ndarray, np.ndarray, Path, Path]:
    """Images (N, H, W) and labels (N,) of one split, checked to agree."""
    image_path = find_idx_file(src_dir, IDX_NAMES[(split, "images")])
    label_path = find_idx_file(src_dir, IDX_NAMES[(split, "labels")])
    images = read_idx(image_path, IDX_NDIM["images"])
    labels = read_idx(label_path, IDX_NDIM["labels"])
    if images.shape[0] != labels.shape[0]:
        raise DataError(f"{image_path} has {images.shape[0]} images but {label_path} has "
                        f"{labels.shape[0]} labels")
    if images.size == 0:
        raise DataError(f"{image_path}: no images (shape {images.shape})")
    return images, labels, image_path, label_path


def convert_idx(src_dir: str | os.PathLike, out_path: str | os.PathLike) -> Path:
    """Convert the four IDX files in src_dir (gzipped or not) into a dataset file.

    Images become (N, H, W, 1) uint8 with scale 1/255; num_classes is the largest label + 1
    (10 for Fashion-MNIST and MNIST). Returns out_path. Raises DataError, leaving no file at
    out_path, if anything is missing or inconsistent.
    """
    src_dir, out_path = Path(src_dir), Path(out_path)
    if not src_dir.is_dir():
        raise DataError(f"{src_dir}: no such folder")
    splits = {split: _load_split(src_dir, split) for split in ("train", "test")}
    train_images, test_images = splits["train"][0], splits["test"][0]
    if train_images.shape[1:] != test_images.shape[1:]:
        raise DataError(f"{splits['train'][2]} has {train_images.shape[1:]} images but "
                        f"{splits['test'][2]} has {test_images.shape[1:]}")
    num_classes = 1 + max(int(splits[s][1].max()) for s in splits)
    if num_classes < 2:
        raise DataError(f"{src_dir}: the labels hold a single class")
    sources = ", ".join(p.name for s in splits for p in splits[s][2:])
    with DatasetWriter(out_path, input_shape=(*train_images.shape[1:], 1),
                       num_classes=num_classes, n_train=len(train_images),
                       n_test=len(test_images), stored_dtype="uint8", scale=IMAGE_SCALE,
                       source=f"IDX files {sources} from {src_dir.resolve()}") as writer:
        for split, (images, labels, _, _) in splits.items():
            writer.append(split, images[..., np.newaxis], labels)
        writer.commit()
    return out_path


class Teacher:
    """A random one-hidden-layer tanh network that labels inputs by the argmax of its
    outputs: logits = standardise(tanh((x - 0.5) @ w1) @ w2).

    Inputs are the scaled values in [0, 1]. The hidden layer's weights give pre-activations
    of unit variance for uniform inputs (tanh neither linear nor saturated). Each logit is
    standardised (mean 0, std 1 over a calibration sample) so that no class wins most
    inputs: without it, one class can take four times its share.
    """

    def __init__(self, num_inputs: int, hidden: int, num_classes: int, seed: int):
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0,)))
        # Uniform [0, 1] inputs have variance 1/12.
        self.w1 = rng.standard_normal((num_inputs, hidden)) * np.sqrt(12.0 / num_inputs)
        self.w2 = rng.standard_normal((hidden, num_classes)) / np.sqrt(hidden)
        self.mean = np.zeros(num_classes)
        self.std = np.ones(num_classes)
        calibration = random_inputs(seed, "calibration", 0, SYNTHETIC_CALIBRATION_ROWS,
                                    num_inputs) * IMAGE_SCALE
        logits = self.logits(calibration)
        self.mean = logits.mean(axis=0)
        # A class whose logit never varies (possible with tiny `hidden`) keeps std 1.
        std = logits.std(axis=0)
        self.std = np.where(std > 0, std, 1.0)

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Standardised logits of x, (B, num_inputs) scaled values, in float64."""
        return (np.tanh((x - 0.5) @ self.w1) @ self.w2 - self.mean) / self.std

    def labels(self, x: np.ndarray) -> np.ndarray:
        return np.argmax(self.logits(x), axis=1).astype(np.int32)


_STREAMS = {"train": 1, "test": 2, "calibration": 3}


def random_inputs(seed: int, stream: str, block: int, rows: int, num_inputs: int) -> np.ndarray:
    """Block `block` of a stream of uniformly random uint8 inputs, (rows, num_inputs).

    Each block has its own generator keyed by (seed, stream, block), so any block can be
    made without the ones before it.
    """
    seq = np.random.SeedSequence(seed, spawn_key=(_STREAMS[stream], block))
    return np.random.default_rng(seq).integers(0, 256, size=(rows, num_inputs), dtype=np.uint8)


def synthetic_block_rows(num_inputs: int) -> int:
    """Rows per generated block: bounded memory whatever the dataset size."""
    return max(1, SYNTHETIC_BLOCK_VALUES // num_inputs)


def _check_synthetic_args(n_train: int, n_test: int, input_shape: tuple[int, ...],
                          num_classes: int, seed: int, hidden: int) -> tuple[int, ...]:
    def positive(value: object, what: str, low: int = 1) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise DataError(f"synthetic dataset: {what} must be an integer >= {low}, "
                            f"got {value!r}")

    positive(n_train, "n_train")
    positive(n_test, "n_test")
    positive(num_classes, "num_classes", 2)
    positive(hidden, "hidden")
    positive(seed, "seed", 0)
    shape = tuple(input_shape)
    if not shape:
        raise DataError("synthetic dataset: input_shape must have at least one dimension")
    for dim in shape:
        positive(dim, f"every input_shape dimension (shape {shape})")
    return tuple(int(d) for d in shape)


def make_synthetic(out_path: str | os.PathLike, n_train: int, n_test: int,
                   input_shape: tuple[int, ...], num_classes: int, seed: int = 0,
                   hidden: int = 64) -> Path:
    """A dataset of uniformly random inputs labelled by a random teacher network.

    x is uint8 with scale 1/255 (values k/255, uniform over 0..255): a quarter of the bytes
    of float32, so large sets stay manageable, and the same reading path as images. Rows
    are generated and written in blocks, so n_train may exceed memory. The same arguments
    give the same file contents. Returns out_path.
    """
    input_shape = _check_synthetic_args(n_train, n_test, input_shape, num_classes, seed,
                                        hidden)
    out_path = Path(out_path)
    num_inputs = int(np.prod(input_shape))
    teacher = Teacher(num_inputs, int(hidden), int(num_classes), int(seed))
    block_rows = synthetic_block_rows(num_inputs)
    source = (f"synthetic: uniform uint8 inputs labelled by a random tanh teacher "
              f"(seed={seed}, hidden={hidden}, input_shape={input_shape}, "
              f"num_classes={num_classes})")
    with DatasetWriter(out_path, input_shape=input_shape, num_classes=num_classes,
                       n_train=n_train, n_test=n_test, stored_dtype="uint8",
                       scale=IMAGE_SCALE, source=source) as writer:
        for split, rows in (("train", int(n_train)), ("test", int(n_test))):
            for block, start in enumerate(range(0, rows, block_rows)):
                count = min(block_rows, rows - start)
                x = random_inputs(int(seed), split, block, count, num_inputs)
                y = teacher.labels(x * IMAGE_SCALE)
                writer.append(split, x.reshape(count, *input_shape), y)
        writer.commit()
    return out_path
