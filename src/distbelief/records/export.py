"""A trained model as named arrays: read from a run folder, a checkpoint or an export file,
and written as an export file (HDF5 or safetensors) that plain h5py, safetensors or numpy
reads without distbelief. No MPI in this module.

ARRAY NAMES AND ORIENTATION (version 1; the same in both formats)

    layers.<i>.weight, layers.<i>.bias     layer i's parameters, float32
        dense i:  weight (units, inputs), bias (units,): the names and shapes of PyTorch's
                  torch.nn.Linear, so a ModuleList of Linear layers load_state_dict()s them.
                  The input is the layer below's output (or the model's input) flattened
                  in (row, column, channel) order.
        local i:  weight (Ho, Wo, kernel*kernel*Cin, Cout), bias (Ho, Wo, Cout): untied
                  weights per output position; a patch is flattened in (row, column,
                  channel) order (docs/using-a-trained-model.md has a numpy forward).
        conv i:   weight (kernel, kernel, Cin, filters), bias (filters,): tied weights.
        layernorm i: weight (features,) the gain, bias (features,).
        sparse_linear 0 and embedding 0 over sparse features: table (n_features, width),
                  a row per feature id; bias (width,).
        embedding 0 over id fields: table_<f> (rows of field f, dim) per field; bias.
    optimizer.<state>.layers.<i>.weight / .bias   only when asked (Adagrad: state "accum")

The model's input is the dataset file's stored x times `input_scale` (a float32 array of
shape (N, *input_shape)); the last layer's outputs are logits (softmax gives the class
probabilities; sigmoid each output's probability for binary_cross_entropy; for mse they
are the predicted values).

HDF5 FILE: /params/<name> and /optimizer/<state>/<name> datasets; root attributes format =
"distbelief-export", version = 1, layers (the [model] layer tables as JSON text),
input_shape (int64 array), input_scale (float64), num_classes (int64: the outputs' count),
source (JSON text: where the weights came from: checkpoint path, step, samples, algorithm,
config hash), `loss` (the model.loss, when it is not cross_entropy), and for a sparse
model `features` ("sparse" or "ids") and `id_rows` (int64 array: each field's table rows,
"ids" only). A sparse model's input is the data's CSR rows or id fields, not scaled.

SAFETENSORS FILE (https://huggingface.co/docs/safetensors): 8-byte little-endian header
length, a JSON header, the raw little-endian float32 data. Tensors are named as above
(optimizer state as optimizer.<state>.<name>); the header's __metadata__ holds the same
keys as the HDF5 attributes, all strings as the format requires: format as it is, the
others as JSON text (numbers as their decimal text). Exports written before 2026-12 held
format as JSON text too ('"distbelief-export"'); the reader takes both. This module writes
and reads the format itself: it is small and fully specified, and a login node then needs
no extra package.

Files are written under a temporary name, fsynced and renamed into place; an existing
file is never overwritten.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from distbelief.data.hdf5 import H5_ERRORS, DatasetInfo, open_dataset
from distbelief.errors import ConfigError, DataError, UserError
from distbelief.model.layout import DTYPE, ParamLayout
from distbelief.model.losses import loss_for_data, make_loss
from distbelief.model.models import build_model
from distbelief.records import checkpoint as ckpt
from distbelief.records.vectors import (
    BLOCK_BYTES,
    CheckpointVectors,
    ExportVectors,
    MemoryVectors,
    scorer,
)

FORMAT_NAME = "distbelief-export"
FORMAT_VERSION = 1
FORMATS = ("hdf5", "safetensors")
PARAM_NAMES = {"weights": "weight", "bias": "bias"}
"""Layout array name -> exported name (PyTorch's); a sparse layer's tables keep theirs."""
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_MAX_HEADER = 100 << 20  # a safetensors header larger than this is not one
JSON_METADATA = ("version", "layers", "input_shape", "input_scale", "num_classes", "source",
                 "own", "layout", "id_rows")
"""The metadata keys that are not strings: JSON text in a safetensors header."""


class ExportError(UserError):
    """An export file that cannot be written or read."""


@dataclass
class TrainedModel:
    """A model's specification and weights: everything needed to run it.

    `params` and each `optimizer_state` vector are flat float32 vectors in the layout of
    `network()`; `source` says where they came from (JSON-friendly). A model read from a
    checkpoint or an export file holds its vectors in `vectors` (records.vectors) and reads
    them whole only when `params` or `optimizer_state` is asked for: `reader()` reads them
    a piece at a time instead (write_export, a sparse model's scoring).
    """

    layers: list[dict[str, Any]]
    input_shape: tuple[int, ...]
    input_scale: float
    num_classes: int
    _params: np.ndarray | None = None
    _optimizer_state: dict[str, np.ndarray] | None = None
    source: dict[str, Any] = field(default_factory=dict)
    own: dict[str, Any] | None = None
    """A model of the user's own (model.protocol): its identity; `layers` is then empty,
    `own_layout` holds the vector's named slices, and `model` the user's object."""
    own_layout: list[dict[str, Any]] | None = None
    model: Any = None
    loss: str = "cross_entropy"
    """model.loss: what the outputs were trained against (num_classes is then the number
    of outputs: targets a row for mse and binary_cross_entropy)."""
    features: str = "dense"
    """What the model reads: "dense" arrays, or "sparse" CSR rows or "ids" fields
    (data.hdf5.DatasetInfo.features), for a sparse model."""
    id_rows: tuple[int, ...] = ()
    """"ids" only: each field's table rows."""
    vectors: Any = None
    """Where `params` and `optimizer_state` are read from when they are not in memory."""

    @property
    def params(self) -> np.ndarray:
        """The whole parameter vector (read now, once, if it is stored)."""
        if self._params is None:
            self._params = (self.vectors.read("params", 0, self.layout().size)
                            if self.vectors is not None else np.empty(0, DTYPE))
        return self._params

    @params.setter
    def params(self, values: np.ndarray) -> None:
        self._params = values

    @property
    def optimizer_state(self) -> dict[str, np.ndarray]:
        """Each optimizer state's whole vector (read now, once, if they are stored)."""
        if self._optimizer_state is None:
            size = self.layout().size
            self._optimizer_state = {} if self.vectors is None else {
                name: self.vectors.read(name, 0, size) for name in self.vectors.state_names}
        return self._optimizer_state

    @optimizer_state.setter
    def optimizer_state(self, state: dict[str, np.ndarray]) -> None:
        self._optimizer_state = state

    def state_names(self) -> list[str]:
        """The optimizer states held, without reading them."""
        if self._optimizer_state is None and self.vectors is not None:
            return list(self.vectors.state_names)
        return sorted(self.optimizer_state)

    def reader(self) -> Any:
        """The vectors to read a piece at a time (records.vectors): the stored ones, or
        those in memory once they were read or set."""
        if self._params is None and self._optimizer_state is None and self.vectors is not None:
            return self.vectors
        return MemoryVectors(self.params, self.optimizer_state)

    def scorer(self, network: Any = None) -> Any:
        """What computes this model's outputs and tallies (records.vectors.scorer): a
        sparse model's batch by batch from its stored rows, any other from its whole
        vector. `network` is the model to run (default: network())."""
        return scorer(self.network() if network is None else network, self.reader())

    def loss_fn(self) -> Any:
        """The model.losses.Loss of this model's outputs."""
        return make_loss(self.loss, self.num_classes)

    def layout(self) -> ParamLayout:
        """The parameter vector's layout (no model object needed)."""
        if self.own is None:
            return self.network().layout
        return ParamLayout([(r["layer"], r["name"], tuple(r["shape"]))
                            for r in self.own_layout or []])

    def network(self) -> Any:
        """The Network of this specification (a ConfigError if it is not a valid one), or
        the user's model behind model.protocol.OwnModel; a UserError if that model was
        not given, or is not the one trained."""
        if self.own is None:
            return build_model(self.input_shape, self.layers, self.loss_fn(),
                               features=self.features, id_rows=self.id_rows)
        what = f"a model of your own ({self.own['name']}, {self.own['parameters']:,d} " \
               f"parameters)"
        if self.model is None:
            raise UserError(f"{self.source.get('path', 'this model')} holds {what}, which "
                            f"only your code can run: give it (load_model(path, model=...)"
                            f", or --model MODULE:FACTORY)")
        from distbelief.model.protocol import OwnModel

        network = OwnModel(self.model, self.input_shape, self.num_classes,
                           loss=self.loss_fn(), probe_y=self.probe_targets())
        if network.layout != self.layout():
            raise UserError(f"the model given ({network.name}, {network.layout.size:,d} "
                            f"parameters) is not the one trained: {what}")
        return network

    def probe_targets(self) -> np.ndarray:
        """Two rows of zero targets, as the data holds them (OwnModel's probe)."""
        if self.loss == "cross_entropy" or (self.loss == "binary_cross_entropy"
                                            and self.own is None):
            return np.zeros(2, dtype=np.int64)
        shape = (2,) if self.num_classes == 1 else (2, self.num_classes)
        return np.zeros(shape, dtype=DTYPE)

    def named_arrays(self, layout: ParamLayout, flat: np.ndarray | None = None
                     ) -> dict[str, np.ndarray]:
        """`flat` (default: params) as {layers.<i>.weight: view, ...} in layout order (a
        model of one's own: its slices' names)."""
        flat = self.params if flat is None else flat
        return {self.array_name(e.layer, e.name): layout.view(flat, e.layer, e.name)
                for e in layout.entries}

    def array_name(self, layer: int, name: str) -> str:
        return name if self.own is not None else array_name(layer, name)

    def metadata(self) -> dict[str, Any]:
        """The file's metadata: format, version and what rebuilds the model."""
        own = {} if self.own is None else {"own": self.own,
                                           "layout": self.layout().to_records()}
        return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "layers": self.layers,
                "input_shape": list(self.input_shape), "input_scale": self.input_scale,
                "num_classes": self.num_classes, **own,
                **({} if self.loss == "cross_entropy" else {"loss": self.loss}),
                **({} if self.features == "dense" else {"features": self.features}),
                **({"id_rows": list(self.id_rows)} if self.id_rows else {}),
                "source": {k: v for k, v in self.source.items() if k != "skipped"}}


def array_name(layer: int, name: str) -> str:
    """layers.<layer>.weight / .bias (.table for a sparse layer's): the exported name of
    a layout array."""
    return f"layers.{layer}.{PARAM_NAMES.get(name, name)}"


# ---------------------------------------------------------------------------------------
# Reading: a run folder, a checkpoint or an export


WHICH = ("best", "last")
"""Which model of a run folder: the best evaluation's (run.keep_best), or the newest
checkpoint."""


def read_trained(path: str | Path, data: str | Path | None = None,
                 with_optimizer: bool = False, which: str | None = None,
                 model: Any = None) -> TrainedModel:
    """The trained model at `path`: a run folder (its best model, else its newest valid
    checkpoint; `which` = "best" or "last" chooses), a checkpoint folder, or an export
    file (HDF5 or safetensors).

    The best model holds no optimizer state, so `with_optimizer` reads the last unless
    `which` says "best" (refused). A checkpoint does not record the input shape and scale:
    they come from the run's data file (the manifest's data.path), or from `data` when
    given. A model of the user's own is run by `model`, their object (TrainedModel.network).
    Any problem is one UserError naming the file and what is wrong.
    """
    trained = _read_trained(Path(path), data, with_optimizer, which)
    trained.model = model
    return trained


def _read_trained(path: Path, data: str | Path | None, with_optimizer: bool,
                  which: str | None) -> TrainedModel:
    if which is not None and which not in WHICH:
        raise UserError(f"which must be one of {', '.join(WHICH)}, got {which!r}")
    if not path.exists():
        raise UserError(f"{path} does not exist")
    if path.is_file():
        _no_which(path, which)
        model = read_export(path, with_optimizer)
        if with_optimizer and not model.state_names():
            raise ExportError(f"{path} holds no optimizer state; export it from the run's "
                              "checkpoint with --with-optimizer")
        return model
    found, skipped = find_checkpoint(path, which, with_optimizer)
    model = from_checkpoint(found, data, with_optimizer)
    model.source["skipped"] = [f"{p}: {why}" for p, why in skipped]
    if found.path != path:  # chosen in a run folder, not given
        model.source["which"] = "best" if found.best else "last"
    return model


def _no_which(path: Path, which: str | None) -> None:
    if which is not None:
        raise UserError(f"{path} is one model: --which {which} (which=) chooses between a "
                        "run folder's best and last; give the run folder instead")


def find_checkpoint(path: Path, which: str | None = None, with_optimizer: bool = False
                    ) -> tuple[ckpt.Checkpoint, list[tuple[Path, str]]]:
    """The checkpoint at `path` (verified), or of a run folder or a checkpoints folder its
    best model (`which` "best", or None and one was kept and `with_optimizer` is not asked)
    or its newest valid checkpoint ("last"), with the newer damaged ones passed over."""
    if (path / ckpt.MANIFEST).exists() or path.name.startswith(("ckpt-", "best-")):
        _no_which(path, which)
        return ckpt.verify(path), []
    root = ckpt.checkpoint_root(path)
    root = root if root.is_dir() else path
    if which == "best" and with_optimizer:
        raise ExportError(f"{path}: the best model holds no optimizer state (it is kept to "
                          "be used, not resumed); --which last reads the newest checkpoint's")
    passed_over: list[tuple[Path, str]] = []
    if which == "best" or (which is None and not with_optimizer):
        best, damaged = ckpt.find_best(root)
        if best is not None:
            return best, damaged
        passed_over = damaged  # a damaged best: named, and the last read instead
        if which == "best":
            why = (f"its best model is damaged: {'; '.join(w for _, w in damaged)}"
                   if damaged else "the run kept none (run.keep_best = false, a run from "
                   "before keep_best, or one that ended before its first evaluation)")
            raise ckpt.CheckpointError(f"{path} has no best model ({root}/best-*): {why}; "
                                       "--which last reads its newest checkpoint")
    found, damaged = ckpt.find_latest(root)
    damaged = passed_over + damaged
    if found is None:
        if damaged:
            raise ckpt.CheckpointError(f"{path} holds no valid checkpoint: "
                                       f"{'; '.join(why for _, why in damaged)}")
        raise ckpt.CheckpointError(f"{path} holds no checkpoint (looked for {root}/ckpt-*): "
                                   "give a run folder, a checkpoint folder or an export "
                                   "file")
    return found, damaged


def from_checkpoint(found: ckpt.Checkpoint, data: str | Path | None = None,
                    with_optimizer: bool = False) -> TrainedModel:
    """The model held by a verified checkpoint; the input shape and scale from `data` or
    the run's own data file. Its vectors stay in the checkpoint's shard parts until they
    are read (TrainedModel.vectors)."""
    layers = found.manifest["config"]["model"]["layers"]
    info = _data_info(found, data)
    own = found.manifest["config"]["model"].get("own")
    loss_name = found.manifest["config"]["model"].get("loss", "cross_entropy")
    try:
        loss = loss_for_data(loss_name, info.targets, info.num_classes, info.outputs)
    except ConfigError as exc:
        raise DataError(f"checkpoint {found.path} was trained with model.loss = "
                        f"{loss_name!r}, which does not fit {info.path}: {exc}") from exc
    vectors = CheckpointVectors(found, with_optimizer)
    if own:
        return TrainedModel([], info.input_shape, info.scale, loss.width, None, None,
                            _checkpoint_source(found, info), own, found.manifest["layout"],
                            loss=loss_name, vectors=vectors)
    try:
        found.check_layout(build_model(info.input_shape, layers, loss,
                                       features=info.features, id_rows=info.id_rows).layout)
    except (ConfigError, ckpt.CheckpointMismatch) as exc:
        shape = "x".join(map(str, info.input_shape))
        raise DataError(f"checkpoint {found.path} does not take the inputs of "
                        f"{info.path} (input {shape}, {info.num_classes} classes): "
                        f"{exc}") from exc
    return TrainedModel(list(layers), info.input_shape, info.scale, loss.width, None, None,
                        _checkpoint_source(found, info), loss=loss_name,
                        features=info.features, id_rows=tuple(info.id_rows), vectors=vectors)


def _checkpoint_source(found: ckpt.Checkpoint, info: DatasetInfo) -> dict[str, Any]:
    return {"kind": "checkpoint", "evaluation": found.best,
            "path": str(found.path.resolve()), "step": found.step, "samples": found.samples,
            "algorithm": found.manifest["algorithm"],
            "config_hash": found.manifest["config_hash"], "data": str(info.path),
            "validation": found.manifest["config"]["data"].get("validation", 0.0)}


def _data_info(found: ckpt.Checkpoint, data: str | Path | None) -> DatasetInfo:
    if data is not None:
        return open_dataset(data)
    path = found.manifest["config"]["data"]["path"]
    try:
        return open_dataset(path)
    except DataError as exc:
        raise DataError(f"checkpoint {found.path}: its input shape and scale come from the "
                        f"run's data file, which cannot be read ({exc}); give the data file "
                        "(--data FILE, or load_model(path, data=FILE))") from exc


def read_export(path: str | Path, with_optimizer: bool = True) -> TrainedModel:
    """The model in an export file, HDF5 or safetensors (told apart by their first bytes):
    its metadata and every array's name, shape and type checked; the arrays themselves stay
    in the file until they are read (TrainedModel.vectors). Without `with_optimizer` its
    optimizer state, if it holds one, is left out."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise ExportError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if head == HDF5_SIGNATURE:
        fmt, tensors = "hdf5", None
        metadata, arrays = _read_hdf5(path)
    else:
        fmt = "safetensors"
        metadata, arrays, tensors = _read_safetensors(path)
    model, names = _from_arrays(path, metadata, arrays)
    if not with_optimizer:
        names = {"params": names["params"]}
    model.vectors = ExportVectors(path, fmt, model.layout(), names, tensors)
    return model


ArraySpecs = Mapping[str, tuple[tuple[int, ...], np.dtype]]
"""An export's arrays by name: (shape, dtype) each, as the file declares them."""


def _from_arrays(path: Path, metadata: Mapping[str, Any], arrays: ArraySpecs
                 ) -> tuple[TrainedModel, dict[str, dict[Any, str]]]:
    """Check an export's metadata and arrays against the model they describe: the model
    (its vectors not read) and, per vector ("params", each optimizer state), each layout
    entry's array name."""
    if metadata.get("format") != FORMAT_NAME or metadata.get("version") != FORMAT_VERSION:
        raise ExportError(f"{path} is not a distbelief export (format "
                          f"{metadata.get('format')!r}, version {metadata.get('version')!r})")
    try:
        model = TrainedModel(list(metadata["layers"]), tuple(metadata["input_shape"]),
                             float(metadata["input_scale"]), int(metadata["num_classes"]),
                             None, None, dict(metadata.get("source") or {}),
                             metadata.get("own"), metadata.get("layout"),
                             loss=str(metadata.get("loss", "cross_entropy")),
                             features=str(metadata.get("features", "dense")),
                             id_rows=tuple(int(n) for n in metadata.get("id_rows", ())))
        layout = model.layout()
    except (KeyError, TypeError, ValueError) as exc:  # ConfigError is a ValueError
        raise ExportError(f"{path}: damaged metadata: {exc}") from exc
    state_names = sorted({name.split(".")[1] for name in arrays
                          if name.startswith("optimizer.")})
    vectors = {"params": ""} | {s: f"optimizer.{s}." for s in state_names}
    names: dict[str, dict[Any, str]] = {}
    for what, prefix in vectors.items():
        names[what] = {}
        for e in layout.entries:
            name = prefix + model.array_name(e.layer, e.name)
            shape, dtype = arrays.get(name, (None, None))
            if shape != e.shape or dtype != DTYPE:
                got = "missing" if shape is None else f"{dtype} {shape}"
                raise ExportError(f"{path}: array {name} should be float32 {e.shape}, "
                                  f"it is {got}")
            names[what][e] = name
    expected = {name for entries in names.values() for name in entries.values()}
    extra = sorted(set(arrays) - expected)
    if extra:
        raise ExportError(f"{path}: arrays the model does not have: {', '.join(extra[:5])}")
    return model, names


def _read_hdf5(path: Path) -> tuple[dict[str, Any], ArraySpecs]:
    try:
        with h5py.File(path, "r", locking=False) as f:
            attrs = dict(f.attrs)
            if attrs.get("format") != FORMAT_NAME:
                raise ExportError(f"{path} is an HDF5 file but not a distbelief export "
                                  f"(format attribute {attrs.get('format')!r}); a run folder "
                                  "or a checkpoint folder also works")
            metadata = {
                "format": attrs["format"], "version": int(attrs["version"]),
                "layers": json.loads(attrs["layers"]),
                "input_shape": [int(d) for d in attrs["input_shape"]],
                "input_scale": float(attrs["input_scale"]),
                "num_classes": int(attrs["num_classes"]),
                "source": json.loads(attrs.get("source", "{}")),
                **{key: json.loads(attrs[key]) for key in ("own", "layout") if key in attrs},
                **({"loss": str(attrs["loss"])} if "loss" in attrs else {}),
                **({"features": str(attrs["features"])} if "features" in attrs else {}),
                **({"id_rows": [int(n) for n in attrs["id_rows"]]}
                   if "id_rows" in attrs else {})}
            arrays = {name: _spec(dset) for name, dset in f["params"].items()}
            for state, group in f.get("optimizer", {}).items():
                arrays |= {f"optimizer.{state}.{name}": _spec(dset)
                           for name, dset in group.items()}
    except ExportError:
        raise
    except (*H5_ERRORS, json.JSONDecodeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ExportError(f"{path}: damaged export: {first}") from exc
    return metadata, arrays


def _spec(dset: Any) -> tuple[tuple[int, ...], np.dtype]:
    if not isinstance(dset, h5py.Dataset):
        raise TypeError(f"{dset.name} is a group, not an array")
    return tuple(dset.shape), dset.dtype


def _read_safetensors(path: Path
                      ) -> tuple[dict[str, Any], ArraySpecs, dict[str, tuple[int, tuple]]]:
    """The metadata, the arrays' specs and each array's (byte offset, shape) in the file;
    only the header is read."""
    not_one = f"{path} is neither an HDF5 nor a safetensors distbelief export"
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            first = f.read(8)
            if len(first) < 8:
                raise ExportError(not_one)
            (length,) = struct.unpack("<Q", first)
            if length > min(_MAX_HEADER, size - 8):
                raise ExportError(not_one)
            text = f.read(length)
    except OSError as exc:
        raise ExportError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        header = json.loads(text)
        metadata = _decode_metadata(header.pop("__metadata__", {}) or {})
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, TypeError) as exc:
        raise ExportError(f"{not_one} (its header does not parse: {exc})") from exc
    body, body_size = 8 + length, size - 8 - length
    arrays, tensors = {}, {}
    for name, entry in header.items():
        try:
            begin, end = (int(v) for v in entry["data_offsets"])
            shape = tuple(int(d) for d in entry["shape"])
            dtype = entry["dtype"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ExportError(f"{path}: damaged entry for {name}: {exc}") from exc
        if dtype != "F32" or not 0 <= begin <= end <= body_size or \
                end - begin != 4 * int(np.prod(shape, dtype=np.int64)):
            raise ExportError(f"{path}: tensor {name} ({dtype} {list(shape)}, bytes "
                              f"{begin}..{end} of {body_size}) is not a float32 tensor "
                              "inside the file")
        arrays[name] = (shape, np.dtype(DTYPE))
        tensors[name] = (body + begin, shape)
    return metadata, arrays, tensors


def _decode_metadata(raw: Mapping[str, str]) -> dict[str, Any]:
    """The inverse of `_encode_metadata`: JSON_METADATA keys parsed, other strings kept;
    a JSON-quoted string (format in an export written before 2026-12) unquoted."""
    metadata = {}
    for key, value in raw.items():
        if not isinstance(value, str):
            raise TypeError(f"metadata {key} is {value!r}, not a string")
        old_quoted = len(value) >= 2 and value[0] == value[-1] == '"'
        metadata[key] = json.loads(value) if key in JSON_METADATA or old_quoted else value
    return metadata


# ---------------------------------------------------------------------------------------
# Writing


FORMAT_OF_EXTENSION = {".h5": "hdf5", ".hdf5": "hdf5", ".hdf": "hdf5", ".he5": "hdf5",
                       ".safetensors": "safetensors"}


def export_format(out: str | Path, fmt: str | None) -> str:
    """The format to write `out` in: `fmt`, else the one its extension names. ExportError
    when neither says, or when they disagree (a file named .safetensors holding HDF5 would
    fail in every reader that trusts the name)."""
    if fmt is not None and fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    suffix = Path(out).suffix.lower()
    named = FORMAT_OF_EXTENSION.get(suffix)
    if fmt is None and named is None:
        raise ExportError(f"cannot tell the format of {out} from its extension: name it .h5 "
                          f"or .safetensors, or give --format {'|'.join(FORMATS)}")
    if fmt is not None and named is not None and named != fmt:
        raise ExportError(f"--format {fmt}, but {out} ends in {suffix}, a {named} name; "
                          f"choose a matching name or format")
    return fmt or named


def write_export(model: TrainedModel, out: str | Path, fmt: str | None = None) -> Path:
    """Write `model` (with its optimizer state, if it holds any) to `out` in format `fmt`
    (by default the one out's extension names: export_format); ExportError if `out`
    exists. Each array is copied in blocks of whole rows from the model's vectors
    (TrainedModel.reader: a checkpoint's shard parts, another export, or memory), so a
    table larger than memory is exported too. Atomic: a temporary file, fsynced, renamed
    into place."""
    fmt = export_format(out, fmt)
    out = Path(out)
    if out.exists():
        raise ExportError(f"{out} exists; remove it or choose another --out (an export "
                          "never overwrites a file)")
    if not out.parent.is_dir():
        raise ExportError(f"cannot write {out}: folder {out.parent} does not exist")
    layout = model.layout()
    arrays = [("params", model.array_name(e.layer, e.name), e) for e in layout.entries]
    for state in model.state_names():
        arrays += [(state, f"optimizer.{state}.{model.array_name(e.layer, e.name)}", e)
                   for e in layout.entries]
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        write = _write_hdf5 if fmt == "hdf5" else _write_safetensors
        write(tmp, model.metadata(), arrays, model.reader())
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
        ckpt.fsync_dir(out.parent)
    except OSError as exc:
        raise ExportError(f"cannot write {out}: {exc.strerror or exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)
    return out


ExportArrays = list[tuple[str, str, Any]]
"""What an export holds: (vector, array name, layout entry) per array, in file order."""


def _blocks(vectors: Any, vector: str, entry: Any) -> Any:
    """(first row, rows) of a layout entry's array, read from `vectors` in blocks of about
    BLOCK_BYTES of whole rows (along its first axis)."""
    row = math.prod(entry.shape[1:])  # values a row; 1 for a vector
    rows = entry.shape[0] if entry.shape else 1
    step = max(1, BLOCK_BYTES // (4 * max(row, 1)))
    for first in range(0, rows, step):
        last = min(rows, first + step)
        values = vectors.read(vector, entry.offset + first * row, entry.offset + last * row)
        yield first, values.reshape((last - first, *entry.shape[1:]) if entry.shape else ())


def _write_hdf5(path: Path, metadata: Mapping[str, Any], arrays: ExportArrays,
                vectors: Any) -> None:
    with h5py.File(path, "w", locking=False) as f:
        f.attrs["format"] = metadata["format"]
        f.attrs["version"] = np.int64(metadata["version"])
        f.attrs["layers"] = json.dumps(metadata["layers"])
        f.attrs["input_shape"] = np.asarray(metadata["input_shape"], dtype=np.int64)
        f.attrs["input_scale"] = np.float64(metadata["input_scale"])
        f.attrs["num_classes"] = np.int64(metadata["num_classes"])
        f.attrs["source"] = json.dumps(metadata["source"])
        for key in ("own", "layout"):  # a model of one's own: its identity and slices
            if key in metadata:
                f.attrs[key] = json.dumps(metadata[key])
        if "loss" in metadata:  # absent: cross_entropy, as every export before losses
            f.attrs["loss"] = metadata["loss"]
        if "features" in metadata:  # absent: dense, as every export before sparse models
            f.attrs["features"] = metadata["features"]
        if "id_rows" in metadata:
            f.attrs["id_rows"] = np.asarray(metadata["id_rows"], dtype=np.int64)
        params = f.create_group("params")
        for vector, name, entry in arrays:
            if name.startswith("optimizer."):
                _, state, rest = name.split(".", 2)
                group = f.require_group("optimizer").require_group(state)
            else:
                group, rest = params, name
            dset = group.create_dataset(rest, shape=entry.shape, dtype=DTYPE)
            for first, values in _blocks(vectors, vector, entry):
                if entry.shape:
                    dset[first:first + len(values)] = values
                else:
                    dset[()] = values


def _encode_metadata(metadata: Mapping[str, Any]) -> dict[str, str]:
    """safetensors metadata holds strings only: a string as it is, anything else as JSON."""
    return {key: value if isinstance(value, str) else json.dumps(value)
            for key, value in metadata.items()}


def _write_safetensors(path: Path, metadata: Mapping[str, Any], arrays: ExportArrays,
                       vectors: Any) -> None:
    header: dict[str, Any] = {"__metadata__": _encode_metadata(metadata)}
    offset = 0
    for _, name, entry in arrays:
        size = entry.size * 4
        header[name] = {"dtype": "F32", "shape": list(entry.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the spec advises
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for vector, _, entry in arrays:
            for _, values in _blocks(vectors, vector, entry):
                f.write(np.ascontiguousarray(values, dtype="<f4").tobytes())
