"""Checkpoints: a directory of HDF5 part files plus a JSON manifest, committed atomically by
one rank after several writers, loaded back whatever the shard count.

FORMAT (version 1)

    out_dir/checkpoints/
        ckpt-0000001500/            a committed checkpoint (the name carries the step)
            manifest.json
            shard-0000.h5           one per parameter-server shard: its slice of the vector
            shard-0001.h5 ...
            replicas.h5             every model replica's data position, RNG, counters,
                                    when one rank writes them all (a row per replica)
            replica-0000.h5         or one file per model replica (its own rank writes it)
        ckpt-0000002000.partial/    being written (or left by a killed run: never loaded)
        ckpt-0000000500.deleting/   an old checkpoint being removed (retention)
        ckpt-0000001800.damaged/    failed verification at a resume; set aside, not deleted
        best-0000001200/            the model with the best evaluation so far (run.keep_best)

shard-NNNN.h5 (plain datasets and attributes; `h5ls -r`, `h5dump -A` read them):
    attributes  format = "distbelief-checkpoint-part", version = 1, kind = "shard",
                index, start, stop, step, config_hash
    /params              float32 (stop - start,)   the slice [start, stop) of the vector
    /optimizer/<name>    float32 (stop - start,)   per-parameter optimizer state (Adagrad:
                                                    "accum"; SGD: none)
    /counters            group whose integer attributes are the shard's counters
replica-NNNN.h5:
    attributes  format, version, kind = "replica", index, step, config_hash
    /counters            integer attributes (step, samples, ...)
    /data                integer attributes: distbelief.data.hdf5.TrainShard.state()
    /rng                 attribute `state_json`: a numpy bit generator's state, as JSON
                         (present only when the replica has an RNG of its own)
    /arrays/<name>       any further arrays of the replica
replicas.h5 (tables, so its size and write time grow with R by bytes, not by objects):
    attributes  format, version, kind = "replicas", index = 0, step, config_hash
    /index               int64 (R,)        the replicas, row by row
    /counters, /data     int64 (R, K)      the integer attributes of a replica-NNNN.h5's
                                            groups, one column per name (attribute `keys`:
                                            the names, JSON)
    /replica-NNNN/rng, /replica-NNNN/arrays/<name>   only for a replica that has them

manifest.json: format, version, step, samples, wall_seconds (training time so far),
created (UTC, for people), config_hash, config (the hashed settings, so a refused resume
can say what changed), algorithm, num_params, layout (ParamLayout.to_records()),
optimizer_state (names), shards [{index, start, stop, part}], replicas [{index, part,
and in replicas.h5 its row}], lost_replicas (indices without a part: lost), with
cluster.release_spares_at unreleased_replicas (without a part: not yet released; only
when there are some), parts {name: {size, sha256}}, and manifest_sha256 over all the
other fields (canonical JSON), so a flipped digit in the step cannot pass as valid.

WRITING (the order every rank follows; no MPI in this module)

    committer (rank 0):  clean_leftovers(root)                    once, at start-up
      -- all ranks agree to checkpoint now and on one CheckpointMeta (step, samples,
         wall_seconds, config_hash): e.g. rank 0 decides and broadcasts --
    committer:           partial = prepare(root, meta.step)       before any writer
      -- writers learn that `partial` exists (the same bcast, or a barrier after it) --
    each shard rank:     record = write_shard_part(partial, meta, index, start, stop,
                                                   params, optimizer_state, counters)
    each replica leader: record = write_replica_part(partial, meta, index, data_state,
                                                     rng_state, counters)
      (or one rank for all: record = write_replicas_part(partial, meta, states): one
       file to create, sync and hash whatever the replica count)
      -- the committer gathers every PartRecord (gather; a writer that failed sends
         None, and then the committer does not commit: the .partial is cleaned later) --
    committer:           commit(root, meta, settings=..., layout=..., shard_ranges=...,
                                parts=records, num_replicas=R, keep=N)

THE BEST (run.keep_best): `save_best` writes the parameters an evaluation scored, at each
evaluation that beats every earlier one, as best-<step>/: the same manifest and shard part
(the whole vector; no optimizer state and no replica part: it is a model, not a point to
resume from) plus a manifest key `best` (the evaluation: step, split, accuracy, loss). It
is committed like a checkpoint (.partial, renamed once complete), and only then is the
previous best removed (.deleting), so a crash leaves one best or two, never none (but for
a best of the same step, which a resumed run scored higher: the old one goes first). Its name
is not ckpt-*, so `list_checkpoints`, `find_latest` (resume) and the pruning of old
checkpoints never see it; `find_best` reads it.

`save_local` is this sequence in one process; distbelief.algorithms.downpour spreads it over the
ranks of an MPI job (its CHECKPOINTS section: the agreement, then these steps).

A part is written under a temporary name, fsynced and renamed; commit checks that every
expected part is there with the size its writer reported, writes the manifest the same
way, renames the directory to its final name, fsyncs the parent, and only then deletes
checkpoints beyond the newest `keep`. A crash at any point leaves the previous checkpoint
untouched; a checkpoint counts only once its directory has no suffix and its manifest
and part checksums verify.

LOADING

    found, damaged = find_latest(root)      newest checkpoint that verifies, and the newer
                                            ones that did not (each with its reason)
    verify(path, parts=[...])               only some parts: each rank its own, then agree
    found.check_compatible(config, layout)  CheckpointMismatch naming both sides
    params, opt_state = found.read_range(start, stop)   any range, assembled from the
                                            overlapping shard parts: re-sharding for free
    found.read_vector(name, start, stop)    one vector's range ("params" or a state's name)
    found.read_elements(name, indices)      its values at sorted indices, one indexed read
                                            per part (a batch's table rows: records.vectors)
    replica = found.read_replica(index)

`assemble` and `split` do the same re-slicing in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import h5py
import numpy as np

from distbelief.errors import UserError
from distbelief.model.layout import DTYPE, ParamLayout
from distbelief.records.metrics import scored_text
from distbelief.runtime import counters

CHECKPOINTS_DIR = "checkpoints"
MANIFEST = "manifest.json"
FORMAT_NAME = "distbelief-checkpoint"
PART_FORMAT_NAME = "distbelief-checkpoint-part"
FORMAT_VERSION = 1
PARTIAL_SUFFIX = ".partial"
DELETING_SUFFIX = ".deleting"
DAMAGED_SUFFIX = ".damaged"
MIN_KEEP = 2

_COMMITTED = re.compile(r"^ckpt-(\d+)$")
_BEST = re.compile(r"^best-(\d+)$")
_LEFTOVER = re.compile(r"^(ckpt|best)-\d+(\.partial|\.deleting)$")
_HASH_BLOCK = 16 << 20
# What h5py raises for a damaged file (see distbelief.data.hdf5.H5_ERRORS).
_H5_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError)


class CheckpointError(UserError):
    """A checkpoint that cannot be written or read: damaged, incomplete, not a checkpoint."""


class CheckpointMismatch(CheckpointError):
    """A valid checkpoint of a different model or configuration than the run's."""


# ---------------------------------------------------------------------------------------
# Names


def checkpoint_root(out_dir: str | Path) -> Path:
    """Where a run's checkpoints live: out_dir/checkpoints."""
    return Path(out_dir) / CHECKPOINTS_DIR


def checkpoint_name(step: int) -> str:
    """ckpt-<step, zero-padded to 10 digits>; longer steps simply get more digits."""
    return f"ckpt-{step:010d}"


def best_name(step: int) -> str:
    """best-<step, zero-padded to 10 digits>: the folder of the best model (save_best)."""
    return f"best-{step:010d}"


def shard_part_name(index: int) -> str:
    return f"shard-{index:04d}.h5"


def replica_part_name(index: int) -> str:
    return f"replica-{index:04d}.h5"


REPLICAS_PART = "replicas.h5"
"""The part holding every replica's state when one rank writes them all."""


def replica_group_name(index: int) -> str:
    """Replica `index`'s group of extras (RNG, arrays) in REPLICAS_PART."""
    return f"replica-{index:04d}"


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Committed checkpoint directories (by name; not verified) as (step, path), newest
    first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _COMMITTED.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found, reverse=True)


def list_best(root: str | Path) -> list[tuple[int, Path]]:
    """Committed best-model folders (by name; not verified) as (step, path), newest first:
    one, or two when a run was killed between writing a new best and removing the old."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _BEST.match(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def list_leftovers(root: str | Path) -> list[Path]:
    """.partial and .deleting directories: what a killed run left behind."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _LEFTOVER.match(p.name) and p.is_dir())


# ---------------------------------------------------------------------------------------
# Writing


@dataclass(frozen=True)
class CheckpointMeta:
    """What every writer and the committer agree on before a checkpoint is written."""

    step: int
    samples: int
    wall_seconds: float
    config_hash: str


@dataclass(frozen=True)
class PartRecord:
    """A part file as its writer left it: the committer puts these in the manifest."""

    name: str
    size: int
    sha256: str


def clean_leftovers(root: str | Path) -> list[Path]:
    """Remove .partial and .deleting directories; returns what was removed.

    Only the committer calls this, and only while no writer is active (at start-up): an
    incomplete checkpoint is never loaded, so removing it loses nothing.
    """
    removed = list_leftovers(root)
    for path in removed:
        shutil.rmtree(path)
    return removed


def prepare(root: str | Path, step: int, name: str | None = None) -> Path:
    """Create an empty ckpt-<step>.partial/ (or `name`.partial) for the writers (committer
    only, before them).

    A .partial of the same step from a killed run is removed first. Raises
    CheckpointError if the checkpoint exists already (its step was committed).
    """
    root = Path(root)
    final = root / (name or checkpoint_name(step))
    if final.exists():
        raise CheckpointError(f"checkpoint {final} exists already; a step is checkpointed "
                              "once")
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    try:
        root.mkdir(parents=True, exist_ok=True)
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir()
    except OSError as exc:
        raise CheckpointError(f"cannot create checkpoint folder {partial}: "
                              f"{exc.strerror or exc}") from exc
    return partial


def write_shard_part(partial: str | Path, meta: CheckpointMeta, index: int, start: int,
                     stop: int, params: np.ndarray, optimizer_state: Mapping[str, np.ndarray],
                     counters: Mapping[str, int] | None = None) -> PartRecord:
    """Write shard `index`'s slice [start, stop) and its optimizer state (each shard rank).

    No communication. Returns the record the committer needs.
    """
    length = stop - start
    _check_vector(params, length, "params")
    for name, values in optimizer_state.items():
        _check_vector(values, length, f"optimizer state {name!r}")

    def fill(f: h5py.File) -> None:
        _part_attrs(f, "shard", index, meta)
        f.attrs["start"], f.attrs["stop"] = np.int64(start), np.int64(stop)
        f.create_dataset("params", data=params)
        group = f.create_group("optimizer")
        for name in sorted(optimizer_state):
            group.create_dataset(name, data=optimizer_state[name])
        _int_attrs(f.create_group("counters"), counters or {})

    return _write_part(Path(partial), shard_part_name(index), fill)


def write_replica_part(partial: str | Path, meta: CheckpointMeta, index: int,
                       data_state: Mapping[str, int], rng_state: Mapping[str, Any] | None = None,
                       counters: Mapping[str, int] | None = None,
                       arrays: Mapping[str, np.ndarray] | None = None) -> PartRecord:
    """Write replica `index`'s state (its leader rank): the data position
    (TrainShard.state()), the state of its own RNG if it has one (a numpy
    `bit_generator.state`), counters, and any further arrays. No communication."""
    def fill(f: h5py.File) -> None:
        _part_attrs(f, "replica", index, meta)
        _fill_replica(f, ReplicaState(index, dict(counters or {}), dict(data_state),
                                      rng_state, dict(arrays or {})))

    return _write_part(Path(partial), replica_part_name(index), fill)


def write_replicas_part(partial: str | Path, meta: CheckpointMeta,
                        states: Sequence[ReplicaState]) -> PartRecord:
    """Write every replica's state into one part, replicas.h5 (a table row per replica),
    for a rank that writes them all: one file and a few datasets to create, sync and hash,
    not R files. Every state has the same counter and data names. No communication."""
    tables = {what: _table(states, what) for what in ("counters", "data_state")}

    def fill(f: h5py.File) -> None:
        _part_attrs(f, "replicas", 0, meta)
        f.create_dataset("index", data=np.array([s.index for s in states], dtype=np.int64))
        for what, name in (("counters", "counters"), ("data_state", "data")):
            keys, rows = tables[what]
            f.create_dataset(name, data=rows).attrs["keys"] = json.dumps(keys)
        for state in states:
            if state.rng_state is not None or state.arrays:
                _fill_extras(f.create_group(replica_group_name(state.index)), state)

    return _write_part(Path(partial), REPLICAS_PART, fill)


def _table(states: Sequence[ReplicaState], what: str) -> tuple[list[str], np.ndarray]:
    """(names, an int64 row per state) of the states' `what` dicts, which must agree."""
    keys = sorted(getattr(states[0], what)) if states else []
    rows = np.zeros((len(states), len(keys)), dtype=np.int64)
    for row, state in enumerate(states):
        values = getattr(state, what)
        if sorted(values) != keys:
            raise ValueError(f"replica {state.index}'s {what} names {sorted(values)}, "
                             f"replica {states[0].index}'s {keys}")
        rows[row] = [int(values[k]) for k in keys]
    return keys, rows


def _fill_replica(group: h5py.Group, state: ReplicaState) -> None:
    _int_attrs(group.create_group("counters"), state.counters)
    _int_attrs(group.create_group("data"), state.data_state)
    _fill_extras(group, state)


def _fill_extras(group: h5py.Group, state: ReplicaState) -> None:
    if state.rng_state is not None:
        group.create_group("rng").attrs["state_json"] = json.dumps(state.rng_state,
                                                                   sort_keys=True)
    arrays = group.create_group("arrays")
    for name in sorted(state.arrays):
        arrays.create_dataset(name, data=state.arrays[name])


def _check_vector(values: np.ndarray, length: int, what: str) -> None:
    if not isinstance(values, np.ndarray) or values.dtype != DTYPE or values.shape != (length,):
        shape = getattr(values, "shape", None)
        dtype = getattr(values, "dtype", type(values).__name__)
        raise ValueError(f"{what} must be float32 of shape ({length},), got {dtype} {shape}")


def _part_attrs(f: h5py.File, kind: str, index: int, meta: CheckpointMeta) -> None:
    f.attrs["format"] = PART_FORMAT_NAME
    f.attrs["version"] = np.int64(FORMAT_VERSION)
    f.attrs["kind"] = kind
    f.attrs["index"] = np.int64(index)
    f.attrs["step"] = np.int64(meta.step)
    f.attrs["config_hash"] = meta.config_hash


def _int_attrs(group: h5py.Group, values: Mapping[str, int]) -> None:
    for key, value in values.items():
        group.attrs[key] = np.int64(value)


def _write_part(partial: Path, name: str, fill: Callable[[h5py.File], None]) -> PartRecord:
    """Write a part under a temporary name, fsync it, rename it into place."""
    if not partial.is_dir():
        raise CheckpointError(f"checkpoint folder {partial} does not exist; the committer "
                              "calls prepare() before the writers start")
    tmp = partial / f".{name}.tmp"
    counters.add("checkpoint_files")
    try:
        with h5py.File(tmp, "w", locking=False) as f:
            fill(f)
        size, digest = _sync_and_digest(tmp)
        os.replace(tmp, partial / name)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write checkpoint part {partial / name}: "
                              f"{exc.strerror or exc}") from exc
    return PartRecord(name, size, digest)


def _sync_and_digest(path: Path) -> tuple[int, str]:
    """fsync a file and return (size, sha256). The hash reads the file back from the page
    cache while the fsync waits for the disk, on another thread: both release the GIL."""
    with path.open("rb") as f, ThreadPoolExecutor(1) as pool:
        synced = pool.submit(os.fsync, f.fileno())
        size, digest = _digest(f)
        synced.result()
    return size, digest


def _digest(f: Any) -> tuple[int, str]:
    h = hashlib.sha256()
    buf = bytearray(_HASH_BLOCK)
    view = memoryview(buf)
    size = 0
    while n := f.readinto(buf):
        h.update(view[:n])
        size += n
    return size, h.hexdigest()


def _file_digest(path: Path) -> tuple[int, str]:
    with path.open("rb") as f:
        return _digest(f)


def _write_file_atomic(folder: Path, name: str, data: bytes) -> None:
    tmp = folder / f".{name}.tmp"
    counters.add("checkpoint_files")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / name)


def fsync_dir(path: Path) -> None:
    """Make the renames and deletions in folder `path` durable (fsync of the folder)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(root: str | Path, meta: CheckpointMeta, *, settings: Mapping[str, Any],
           algorithm: str, layout: ParamLayout, shard_ranges: Sequence[tuple[int, int]],
           optimizer_state: Sequence[str], parts: Sequence[PartRecord], num_replicas: int,
           keep: int, lost_replicas: Sequence[int] = (),
           unreleased_replicas: Sequence[int] = (),
           best: Mapping[str, Any] | None = None) -> Path:
    """Publish ckpt-<step> (committer only, after every writer has returned its record);
    with `best` (an evaluation), best-<step> instead (save_best).

    `settings` is distbelief.config.hashed_settings(config); its hash must be
    meta.config_hash. `shard_ranges` must tile the layout's vector; `parts` holds one
    record per shard and per replica, except the `lost_replicas` (Downpour replicas that
    died: they have no part, and a resume starts them on a fresh pass) and the
    `unreleased_replicas` (Downpour parts waiting for a spare's release,
    cluster.release_spares_at: no part either, and nothing lost). Checks the parts,
    writes the manifest, renames the folder, fsyncs the parent, then keeps only the newest
    `keep` checkpoints (a best: removes the older bests). Returns the committed folder.
    """
    from distbelief.config import settings_hash

    root = Path(root)
    if keep < MIN_KEEP:
        raise ValueError(f"keep must be at least {MIN_KEEP}, got {keep}")
    if settings_hash(dict(settings)) != meta.config_hash:
        raise ValueError("meta.config_hash is not the hash of `settings`")
    name = checkpoint_name(meta.step) if best is None else best_name(meta.step)
    partial = root / (name + PARTIAL_SUFFIX)
    ranges = [(int(a), int(b)) for a, b in shard_ranges]
    _check_tiling(ranges, 0, layout.size)
    lost = sorted({int(r) for r in lost_replicas})
    unreleased = sorted({int(r) for r in unreleased_replicas} - set(lost))
    kept = [i for i in range(num_replicas) if i not in lost and i not in unreleased]
    together = any(r.name == REPLICAS_PART for r in parts)
    records = _check_parts(partial, len(ranges), kept, parts, together)
    replicas = ([{"index": i, "part": REPLICAS_PART, "row": row}
                 for row, i in enumerate(kept)] if together
                else [{"index": i, "part": replica_part_name(i)} for i in kept])
    manifest = {
        "format": FORMAT_NAME, "version": FORMAT_VERSION, "step": int(meta.step),
        "samples": int(meta.samples), "wall_seconds": float(meta.wall_seconds),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config_hash": meta.config_hash, "config": dict(settings), "algorithm": algorithm,
        "num_params": int(layout.size), "layout": layout.to_records(),
        "optimizer_state": sorted(optimizer_state),
        "shards": [{"index": i, "start": a, "stop": b, "part": shard_part_name(i)}
                   for i, (a, b) in enumerate(ranges)],
        "replicas": replicas,
        "lost_replicas": lost,
        **({"unreleased_replicas": unreleased} if unreleased else {}),
        "parts": {r.name: {"size": r.size, "sha256": r.sha256} for r in records},
        **({"best": dict(best)} if best is not None else {}),
    }
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    try:
        _write_manifest(partial, manifest)
        final = _publish(partial)
    except OSError as exc:
        raise CheckpointError(f"cannot commit checkpoint {partial}: "
                              f"{exc.strerror or exc}") from exc
    try:
        if best is None:
            _prune(root, keep)
        else:
            _remove([path for _, path in list_best(root) if path != final], root)
    except OSError as exc:
        raise CheckpointError(f"committed {final}, but could not remove an old checkpoint: "
                              f"{exc.strerror or exc}") from exc
    return final


def _check_parts(partial: Path, num_shards: int, replicas: Sequence[int],
                 parts: Sequence[PartRecord], together: bool = False) -> list[PartRecord]:
    """Every expected part reported once and on disk at its reported size (the replicas'
    in one REPLICAS_PART when `together`, and it then exists even with none kept)."""
    by_name = {r.name: r for r in parts}
    expected = ([shard_part_name(i) for i in range(num_shards)]
                + ([REPLICAS_PART] if together else [replica_part_name(i) for i in replicas]))
    if len(by_name) != len(parts) or set(by_name) != set(expected):
        raise CheckpointError(f"checkpoint {partial}: writers reported parts "
                              f"{sorted(by_name)}, expected {expected}")
    for name in expected:
        path = partial / name
        size = path.stat().st_size if path.is_file() else None
        if size != by_name[name].size:
            raise CheckpointError(f"checkpoint {partial}: part {name} is "
                                  f"{'missing' if size is None else f'{size} bytes'}, its "
                                  f"writer reported {by_name[name].size} bytes")
    return [by_name[name] for name in expected]


def _manifest_digest(manifest: Mapping[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


def _write_manifest(partial: Path, manifest: Mapping[str, Any]) -> None:
    _write_file_atomic(partial, MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    fsync_dir(partial)  # the parts' and the manifest's renames


def _publish(partial: Path) -> Path:
    final = partial.with_name(partial.name.removesuffix(PARTIAL_SUFFIX))
    # rename() would also replace an empty folder silently; a step is committed once.
    if final.exists():
        raise CheckpointError(f"checkpoint {final} exists already")
    os.rename(partial, final)
    fsync_dir(final.parent)
    return final


def _prune(root: Path, keep: int) -> list[Path]:
    """Delete committed checkpoints beyond the newest `keep`, oldest first. Each is renamed
    to .deleting first, so a crash half-way through never leaves a damaged checkpoint
    under a committed name."""
    return _remove([path for _, path in reversed(list_checkpoints(root)[keep:])], root)


def _remove(paths: Sequence[Path], root: Path) -> list[Path]:
    """Delete committed folders, each renamed to .deleting first."""
    for path in paths:
        doomed = path.with_name(path.name + DELETING_SUFFIX)
        os.rename(path, doomed)
        fsync_dir(root)
        shutil.rmtree(doomed)
    return list(paths)


# ---------------------------------------------------------------------------------------
# Verifying and loading


@dataclass
class PartStatus:
    """One part file as found on disk against the manifest."""

    name: str
    size: int
    sha256: str
    found_size: int | None = None
    found_sha256: str | None = None

    @property
    def ok(self) -> bool:
        return self.found_size == self.size and self.found_sha256 == self.sha256

    def problem(self) -> str | None:
        if self.found_size is None:
            return f"part {self.name} is missing"
        if self.found_size != self.size:
            return (f"part {self.name} is {self.found_size} bytes, the manifest says "
                    f"{self.size} (truncated?)")
        if self.found_sha256 != self.sha256:
            return f"part {self.name} fails its sha256 checksum (corrupt)"
        return None


@dataclass
class Inspection:
    """What `inspect_checkpoint` found: the manifest (None if unreadable), the status of
    each part, and every problem in words. Valid when there are no problems."""

    path: Path
    manifest: dict[str, Any] | None
    parts: list[PartStatus] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.problems and self.manifest is not None


def inspect_checkpoint(path: str | Path, parts: Collection[str] | None = None) -> Inspection:
    """Read and check a checkpoint folder without raising: manifest, shard ranges, and the
    size and sha256 of every part (or only of `parts`, names like "shard-0003.h5")."""
    path = Path(path)
    report = Inspection(path, None)
    if path.name.endswith(PARTIAL_SUFFIX):
        report.problems.append("incomplete: its writers never committed it (.partial)")
    try:
        manifest = read_manifest(path)
    except CheckpointError as exc:
        report.problems.append(str(exc).removeprefix(f"checkpoint {path}: "))
        return report
    report.manifest = manifest
    try:
        _check_tiling([(s["start"], s["stop"]) for s in manifest["shards"]], 0,
                      manifest["num_params"])
    except ValueError as exc:
        report.problems.append(f"shard {exc}")
    unknown = set(parts or ()) - set(manifest["parts"])
    if unknown:
        report.problems.append(f"has no part {', '.join(sorted(unknown))}")
    for name, entry in manifest["parts"].items():
        if parts is not None and name not in parts:
            continue
        status = PartStatus(name, entry["size"], entry["sha256"])
        part = path / name
        if part.is_file():
            status.found_size = part.stat().st_size
            # Hashing a file of the wrong size would only confirm what the size says.
            if status.found_size == status.size:
                status.found_size, status.found_sha256 = _file_digest(part)
                counters.add("checkpoint_parts_hashed")
        report.parts.append(status)
        if (problem := status.problem()) is not None:
            report.problems.append(problem)
    return report


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder, checked for shape and its own checksum."""
    path = Path(path)
    file = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: not a folder")
    try:
        manifest = json.loads(file.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable "
                              f"({type(exc).__name__}: {exc})") from exc
    problem = _manifest_problem(manifest)
    if problem:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} {problem}")
    return manifest


_MANIFEST_KEYS = ("format", "version", "step", "samples", "wall_seconds", "config_hash",
                  "config", "algorithm", "num_params", "layout", "optimizer_state", "shards",
                  "replicas", "parts", "manifest_sha256")


def _manifest_problem(manifest: Any) -> str | None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        return "is not a distbelief checkpoint manifest"
    if manifest.get("version") != FORMAT_VERSION:
        return (f"has format version {manifest.get('version')!r}; this reader knows "
                f"version {FORMAT_VERSION}")
    missing = [k for k in _MANIFEST_KEYS if k not in manifest]
    if missing:
        return f"lacks {', '.join(missing)}"
    if manifest["manifest_sha256"] != _manifest_digest(manifest):
        return "fails its own checksum (edited or corrupt)"
    return None


@dataclass(frozen=True)
class ReplicaState:
    """What write_replica_part saved for one replica."""

    index: int
    counters: dict[str, int]
    data_state: dict[str, int]
    rng_state: dict[str, Any] | None
    arrays: dict[str, np.ndarray]


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint whose manifest and part checksums verified (see `verify`)."""

    path: Path
    manifest: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def samples(self) -> int:
        return int(self.manifest["samples"])

    @property
    def wall_seconds(self) -> float:
        return float(self.manifest["wall_seconds"])

    @property
    def best(self) -> dict[str, Any] | None:
        """The evaluation that made this the run's best model (save_best), else None."""
        return self.manifest.get("best")

    @property
    def num_replicas(self) -> int:
        """Replicas of the run that wrote it, lost and unreleased ones included."""
        m = self.manifest
        return (len(m["replicas"]) + len(m.get("lost_replicas", []))
                + len(m.get("unreleased_replicas", [])))

    def has_replica(self, index: int) -> bool:
        """Whether replica `index` wrote a part (a lost or unreleased replica did not)."""
        return any(r["index"] == index for r in self.manifest["replicas"])

    @property
    def shard_ranges(self) -> list[tuple[int, int]]:
        return [(s["start"], s["stop"]) for s in self.manifest["shards"]]

    def check_compatible(self, settings: Mapping[str, Any], layout: ParamLayout) -> None:
        """CheckpointMismatch unless this checkpoint holds `layout` and was written under
        the same hashed settings (distbelief.config.hashed_settings)."""
        from distbelief.config import settings_diff, settings_hash

        self.check_layout(layout)
        theirs, ours = self.manifest["config_hash"], settings_hash(dict(settings))
        if theirs != ours:
            changes = settings_diff(self.manifest["config"], dict(settings))
            raise CheckpointMismatch(
                f"checkpoint {self.path} was written by a different configuration "
                f"(config hash {theirs[:12]}, this run's {ours[:12]}): "
                f"{'; '.join(changes) or 'settings differ'}")

    def check_layout(self, layout: ParamLayout) -> None:
        """CheckpointMismatch unless this checkpoint holds `layout` (the model only; the
        settings are check_compatible's)."""
        problem = _layout_difference(self.manifest["layout"], layout)
        if problem:
            raise CheckpointMismatch(f"checkpoint {self.path} holds a different model: "
                                     f"{problem}")

    def read_range(self, start: int, stop: int, with_optimizer: bool = True
                   ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Parameters and optimizer state of [start, stop), assembled from the shard parts
        that overlap it, whatever their number: a shard of a run with another shard count
        reads its own range here. Without `with_optimizer` the state is not read ({})."""
        if not 0 <= start < stop <= int(self.manifest["num_params"]):
            raise ValueError(f"range [{start}, {stop}) is outside the "
                             f"{self.manifest['num_params']} parameters")
        state = self.manifest["optimizer_state"] if with_optimizer else []
        names = ["params", *(f"optimizer/{n}" for n in state)]
        out = {name: np.empty(stop - start, DTYPE) for name in names}
        for shard in self.manifest["shards"]:
            lo, hi = max(start, shard["start"]), min(stop, shard["stop"])
            if lo < hi:
                self._read_slices(shard, lo - shard["start"], hi - shard["start"],
                                  {n: a[lo - start : hi - start] for n, a in out.items()})
        params = out.pop("params")
        return params, {n.removeprefix("optimizer/"): a for n, a in out.items()}

    def read_vector(self, name: str, start: int, stop: int,
                    parts: OpenParts | None = None) -> np.ndarray:
        """[start, stop) of one vector: "params" or an optimizer state's name, read from
        the shard parts that overlap it (a block of an export, the dense part); from
        `parts` if given (kept open), else each opened for the call."""
        if not 0 <= start <= stop <= int(self.manifest["num_params"]):
            raise ValueError(f"range [{start}, {stop}) is outside the "
                             f"{self.manifest['num_params']} parameters")
        dataset = self._dataset_name(name)
        out = np.empty(stop - start, DTYPE)
        for shard in self.manifest["shards"]:
            lo, hi = max(start, shard["start"]), min(stop, shard["stop"])
            if lo < hi:
                self._read_slices(shard, lo - shard["start"], hi - shard["start"],
                                  {dataset: out[lo - start:hi - start]}, parts)
        return out

    def read_elements(self, name: str, indices: np.ndarray,
                      parts: OpenParts | None = None) -> np.ndarray:
        """The values of one vector at `indices` (sorted, distinct int64): one indexed read
        per shard part they fall in, so only those values are read (a batch's table rows);
        from `parts` if given (kept open), else each opened for the call."""
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and (indices[0] < 0 or indices[-1] >= int(self.manifest["num_params"])
                             or np.any(indices[1:] <= indices[:-1])):
            raise ValueError("indices must be sorted, distinct and inside the vector")
        dataset = self._dataset_name(name)
        out = np.empty(len(indices), DTYPE)
        for shard in self.manifest["shards"]:
            lo, hi = np.searchsorted(indices, [shard["start"], shard["stop"]])
            if lo == hi:
                continue
            path = self.path / shard["part"]
            with self._shard_part(shard, parts) as f:
                try:
                    dset = f[dataset]
                    self._check_dataset(path, shard, dset)
                    out[lo:hi] = dset[indices[lo:hi] - shard["start"]]
                except _H5_ERRORS as exc:
                    raise CheckpointError(f"checkpoint part {path}: cannot read: "
                                          f"{_first_line(exc)}") from exc
        return out

    def _dataset_name(self, name: str) -> str:
        if name == "params":
            return name
        if name not in self.manifest["optimizer_state"]:
            raise CheckpointError(f"checkpoint {self.path} holds no optimizer state {name!r} "
                                  f"(it holds {self.manifest['optimizer_state'] or 'none'})")
        return f"optimizer/{name}"

    def shard_counters(self, start: int, stop: int) -> list[dict[str, int]]:
        """The counters of the shard parts that overlap [start, stop) (one, when the shard
        count is the checkpoint's), in the order of the manifest."""
        found = []
        for shard in self.manifest["shards"]:
            if max(start, shard["start"]) < min(stop, shard["stop"]):
                path = self.path / shard["part"]
                with self._open_part(path, "shard", shard["index"]) as f:
                    try:
                        found.append({k: int(v) for k, v in f["counters"].attrs.items()})
                    except _H5_ERRORS as exc:
                        raise CheckpointError(f"checkpoint part {path}: cannot read: "
                                              f"{_first_line(exc)}") from exc
        return found

    def read_state(self, with_optimizer: bool = True
                   ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The full parameter vector and (unless not `with_optimizer`) optimizer state."""
        return self.read_range(0, int(self.manifest["num_params"]), with_optimizer)

    def _read_slices(self, shard: Mapping[str, Any], lo: int, hi: int,
                     into: Mapping[str, np.ndarray], parts: OpenParts | None = None) -> None:
        path = self.path / shard["part"]
        with self._shard_part(shard, parts) as f:
            try:
                for name, dest in into.items():
                    dset = f[name]
                    self._check_dataset(path, shard, dset)
                    dset.read_direct(dest, np.s_[lo:hi])
            except _H5_ERRORS as exc:
                raise CheckpointError(f"checkpoint part {path}: cannot read: "
                                      f"{_first_line(exc)}") from exc

    @staticmethod
    def _check_dataset(path: Path, shard: Mapping[str, Any], dset: h5py.Dataset) -> None:
        if dset.shape != (shard["stop"] - shard["start"],) or dset.dtype != DTYPE:
            raise CheckpointError(f"checkpoint part {path}: {dset.name} has shape "
                                  f"{dset.shape} {dset.dtype}, the manifest "
                                  f"says ({shard['stop'] - shard['start']},)")

    def read_replica(self, index: int) -> ReplicaState:
        """The saved state of replica `index`."""
        entries = {r["index"]: r for r in self.manifest["replicas"]}
        if index not in entries:
            raise CheckpointError(f"checkpoint {self.path} has no replica {index} "
                                  f"(it has {len(entries)})")
        entry = entries[index]
        path = self.path / entry["part"]
        if "row" in entry:  # a row of REPLICAS_PART
            return self._read_replica_row(path, index, int(entry["row"]))
        with self._open_part(path, "replica", index) as f:
            try:
                rng = f.get("rng")
                return ReplicaState(
                    index=index,
                    counters={k: int(v) for k, v in f["counters"].attrs.items()},
                    data_state={k: int(v) for k, v in f["data"].attrs.items()},
                    rng_state=json.loads(rng.attrs["state_json"]) if rng is not None else None,
                    arrays={k: v[()] for k, v in f["arrays"].items()})
            except (*_H5_ERRORS, json.JSONDecodeError) as exc:
                raise CheckpointError(f"checkpoint part {path}: cannot read: "
                                      f"{_first_line(exc)}") from exc

    def _read_replica_row(self, path: Path, index: int, row: int) -> ReplicaState:
        with self._open_part(path, "replicas", 0) as f:
            try:
                if int(f["index"][row]) != index:
                    raise CheckpointError(f"checkpoint part {path}: row {row} holds replica "
                                          f"{int(f['index'][row])}, the manifest says {index}")

                def row_of(name: str) -> dict[str, int]:
                    keys = json.loads(f[name].attrs["keys"])
                    return {k: int(v) for k, v in zip(keys, f[name][row], strict=True)}

                extras = f.get(replica_group_name(index))
                rng = extras.get("rng") if extras is not None else None
                return ReplicaState(
                    index=index, counters=row_of("counters"), data_state=row_of("data"),
                    rng_state=json.loads(rng.attrs["state_json"]) if rng is not None else None,
                    arrays=({k: v[()] for k, v in extras["arrays"].items()}
                            if extras is not None else {}))
            except (*_H5_ERRORS, json.JSONDecodeError, ValueError, IndexError) as exc:
                raise CheckpointError(f"checkpoint part {path}: cannot read replica "
                                      f"{index}: {_first_line(exc)}") from exc

    def open_parts(self) -> OpenParts:
        """The shard parts kept open across reads until closed (a context manager): an
        evaluation reads each batch's rows from them, not opening them per batch."""
        return OpenParts(self)

    @contextmanager
    def _shard_part(self, shard: Mapping[str, Any],
                    parts: OpenParts | None) -> Iterator[h5py.File]:
        """A shard's part: from `parts` (left open), else opened and closed here."""
        if parts is not None:
            yield parts.file(shard)
            return
        with self._open_part(self.path / shard["part"], "shard", shard["index"]) as f:
            yield f

    def _open_part(self, path: Path, kind: str, index: int) -> h5py.File:
        """Open a part and check that its header is the one the manifest promises."""
        try:
            f = h5py.File(path, "r", locking=False)
        except _H5_ERRORS as exc:
            raise CheckpointError(f"checkpoint part {path}: not a readable HDF5 file: "
                                  f"{_first_line(exc)}") from exc
        header = {k: f.attrs.get(k) for k in ("format", "kind", "index", "step", "config_hash")}
        expected = {"format": PART_FORMAT_NAME, "kind": kind, "index": index,
                    "step": self.step, "config_hash": self.manifest["config_hash"]}
        if header != expected:
            f.close()
            raise CheckpointError(f"checkpoint part {path}: header {header} does not match "
                                  f"the manifest ({expected})")
        return f


class OpenParts:
    """A checkpoint's shard parts, each opened (its header checked) at its first read and
    kept open until close(); a context manager (Checkpoint.open_parts). One thread."""

    def __init__(self, found: Checkpoint):
        self.found = found
        self.files: dict[str, h5py.File] = {}

    def file(self, shard: Mapping[str, Any]) -> h5py.File:
        f = self.files.get(shard["part"])
        if f is None:
            f = self.found._open_part(self.found.path / shard["part"], "shard",
                                      shard["index"])
            self.files[shard["part"]] = f
        return f

    def close(self) -> None:
        files, self.files = list(self.files.values()), {}
        for f in files:
            f.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _layout_difference(records: list[dict[str, Any]], layout: ParamLayout) -> str | None:
    """None if the saved layout records describe `layout`, else the first difference."""
    ours = layout.to_records()
    if records == ours:
        return None
    for i, (a, b) in enumerate(zip(records, ours, strict=False)):
        if a != b:
            return (f"parameter array {i} is layer {a['layer']} {a['name']!r} "
                    f"{tuple(a['shape'])} in the checkpoint, layer {b['layer']} "
                    f"{b['name']!r} {tuple(b['shape'])} in this run's model")
    size = sum(int(np.prod(r["shape"])) for r in records)
    return (f"the checkpoint has {len(records)} parameter arrays ({size:,d} parameters), "
            f"this run's model {len(ours)} ({layout.size:,d})")


def verify(path: str | Path, parts: Collection[str] | None = None) -> Checkpoint:
    """The checkpoint at `path` if its manifest and every part's size and sha256 check
    out; CheckpointError saying which checkpoint and what is wrong otherwise.

    With `parts`, only those parts are checked: in an MPI run each rank verifies the parts
    it reads, and the ranks agree on the verdict (allreduce) before anyone loads, instead
    of one rank reading every byte.
    """
    report = inspect_checkpoint(path, parts)
    if not report.valid:
        raise CheckpointError(f"checkpoint {report.path} is damaged: "
                              f"{'; '.join(report.problems)}")
    return Checkpoint(report.path, report.manifest)


def find_latest(root: str | Path, check: Callable[[Path], Checkpoint] | None = None,
                candidates: Sequence[Path] | None = None,
                ) -> tuple[Checkpoint | None, list[tuple[Path, str]]]:
    """The newest committed checkpoint that verifies (None if there is none), and the
    newer ones that failed, each with what is wrong with it (newest first).

    .partial and .deleting folders are never considered. `check` verifies one (`verify`
    by default; an MPI run spreads the parts over its ranks), `candidates` are the folders
    to try, newest first (by default list_checkpoints(root)'s).
    """
    check = check or verify
    if candidates is None:
        candidates = [path for _, path in list_checkpoints(root)]
    damaged = []
    for path in candidates:
        try:
            return check(path), damaged
        except CheckpointError as exc:
            damaged.append((path, str(exc)))
    return None, damaged


def set_aside(path: str | Path) -> Path:
    """Rename a damaged checkpoint to <name>.damaged (or .damaged-2, ...) so that it is
    neither loaded nor counted nor overwritten, and not lost either. Returns the new path."""
    path = Path(path)
    target = path.with_name(path.name + DAMAGED_SUFFIX)
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{DAMAGED_SUFFIX}-{n}")
    os.rename(path, target)
    fsync_dir(path.parent)
    return target


# ---------------------------------------------------------------------------------------
# Re-slicing


def _check_tiling(ranges: Sequence[tuple[int, int]], start: int, stop: int) -> None:
    """ValueError unless `ranges`, in order, cover [start, stop) exactly, none empty."""
    at = start
    for a, b in ranges:
        if a != at or b <= a:
            raise ValueError(f"ranges {list(ranges)} do not tile [{start}, {stop}): "
                             f"[{a}, {b}) where {at} was expected")
        at = b
    if at != stop:
        raise ValueError(f"ranges {list(ranges)} end at {at}, expected {stop}")


def assemble(pieces: Sequence[tuple[int, int, np.ndarray]], total: int) -> np.ndarray:
    """One vector of length `total` from (start, stop, values) pieces that tile it (in any
    order): S shards' slices -> the full vector."""
    ordered = sorted(pieces, key=lambda p: p[0])
    _check_tiling([(a, b) for a, b, _ in ordered], 0, total)
    out = np.empty(total, dtype=ordered[0][2].dtype if ordered else DTYPE)
    for a, b, values in ordered:
        if values.shape != (b - a,):
            raise ValueError(f"piece [{a}, {b}) has shape {values.shape}")
        out[a:b] = values
    return out


def split(vector: np.ndarray, ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]:
    """The slices of `vector` for `ranges` (which must tile it): the full vector -> S'
    shards' slices. Views, not copies."""
    _check_tiling(ranges, 0, len(vector))
    return [vector[a:b] for a, b in ranges]


# ---------------------------------------------------------------------------------------
# One process: the whole sequence above


def save_local(root: str | Path, meta: CheckpointMeta, *, settings: Mapping[str, Any],
               algorithm: str, layout: ParamLayout, params: np.ndarray,
               optimizer_state: Mapping[str, np.ndarray], data_state: Mapping[str, int],
               counters: Mapping[str, int], keep: int,
               rng_state: Mapping[str, Any] | None = None) -> Path:
    """A single-process checkpoint: one shard part for the whole vector and one replica
    part, committed. The same calls, in the same order, that an MPI run spreads over its
    ranks."""
    partial = prepare(root, meta.step)
    records = [
        write_shard_part(partial, meta, 0, 0, layout.size, params, optimizer_state, counters),
        write_replica_part(partial, meta, 0, data_state, rng_state, counters),
    ]
    return commit(root, meta, settings=settings, algorithm=algorithm, layout=layout,
                  shard_ranges=[(0, layout.size)], optimizer_state=list(optimizer_state),
                  parts=records, num_replicas=1, keep=keep)


def save_best(root: str | Path, meta: CheckpointMeta, *, settings: Mapping[str, Any],
              algorithm: str, layout: ParamLayout, params: np.ndarray,
              evaluation: Mapping[str, Any]) -> Path:
    """Keep `params`, which `evaluation` scored (its step, split, accuracy, loss), as the
    run's best model: best-<step>/, committed, then the previous best removed (see THE
    BEST above). One process, no communication: the rank that evaluated holds the whole
    vector."""
    root = Path(root)
    final = root / best_name(meta.step)
    if final.exists():  # a resumed run scored this step again, higher: moved aside first
        _remove([final], root)
    partial = prepare(root, meta.step, best_name(meta.step))
    record = write_shard_part(partial, meta, 0, 0, layout.size, params, {})
    return commit(root, meta, settings=settings, algorithm=algorithm, layout=layout,
                  shard_ranges=[(0, layout.size)], optimizer_state=[], parts=[record],
                  num_replicas=0, keep=MIN_KEEP, best=evaluation)


def find_best(root: str | Path) -> tuple[Checkpoint | None, list[tuple[Path, str]]]:
    """The run's best model (the newest best-* folder that verifies: a newer best is
    always a higher one), or None, and the newer ones that failed verification."""
    return find_latest(root, candidates=[path for _, path in list_best(root)])


# ---------------------------------------------------------------------------------------
# Inspecting (the `distbelief inspect` command)


def inspect_path(path: str | Path) -> list[Inspection]:
    """Inspections for a checkpoint folder, a checkpoints folder or a run's out_dir:
    every committed checkpoint (newest first), then leftovers (.partial, .deleting).
    CheckpointError if `path` holds none of these."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if (path / MANIFEST).exists() or _COMMITTED.match(path.name) or \
            _BEST.match(path.name) or path.name.endswith(PARTIAL_SUFFIX):
        return [inspect_checkpoint(path)]
    root = path / CHECKPOINTS_DIR if (path / CHECKPOINTS_DIR).is_dir() else path
    folders = ([p for _, p in list_checkpoints(root)] + [p for _, p in list_best(root)]
               + list_leftovers(root))
    if not folders:
        raise CheckpointError(f"{path} holds no checkpoint (looked for {root}/ckpt-*)")
    return [inspect_checkpoint(p) for p in folders]


def describe(report: Inspection, max_arrays: int = 12) -> str:
    """A human-readable account of one inspected checkpoint."""
    verdict = "VALID" if report.valid else "NOT VALID"
    lines = [f"{report.path}: {verdict}"]
    lines += [f"  problem: {p}" for p in report.problems]
    m = report.manifest
    if m is None:
        return "\n".join(lines)
    lines.append(f"  step {m['step']:,d}, {m['samples']:,d} samples, "
                 f"{m['wall_seconds']:.1f}s of training, written {m.get('created', '?')}, "
                 f"algorithm {m['algorithm']}")
    if m.get("best"):
        lines.append(f"  the run's best model: {scored_text(m['best'])} at step "
                     f"{m['best']['step']:,d} "
                     f"(holds no optimizer state; a run never resumes from it)")
    lines.append(f"  config hash {m['config_hash']}")
    lines.append(f"  layout: {len(m['layout'])} arrays, {m['num_params']:,d} parameters; "
                 f"optimizer state: {', '.join(m['optimizer_state']) or 'none'}")
    for r in m["layout"][:max_arrays]:
        shape = "x".join(str(d) for d in r["shape"])
        lines.append(f"    layer {r['layer']:<3d} {r['name']:<10s} {shape:<18s} "
                     f"offset {r['offset']:,d}")
    if len(m["layout"]) > max_arrays:
        lines.append(f"    ... {len(m['layout']) - max_arrays} more")
    lines.append(f"  shards: {len(m['shards'])}")
    lines += [f"    shard {s['index']}: [{s['start']:,d}, {s['stop']:,d})  {s['part']}"
              for s in m["shards"]]
    lines.append(f"  replicas: {len(m['replicas'])}")
    lines += [f"    replica {r['index']}: {r['part']}" + (f" row {r['row']}" if "row" in r else "")
              for r in m["replicas"]]
    if m.get("lost_replicas"):
        lines.append(f"  lost replicas (no part; a resume starts them afresh): "
                     f"{', '.join(str(r) for r in m['lost_replicas'])}")
    if m.get("unreleased_replicas"):
        lines.append(f"  unreleased replicas (no part; cluster.release_spares_at releases "
                     f"them): {', '.join(str(r) for r in m['unreleased_replicas'])}")
    lines.append("  parts:")
    for part in report.parts:
        status = "ok" if part.ok else (part.problem() or "?").removeprefix(f"part {part.name} ")
        lines.append(f"    {part.name:<16s} {part.size:>14,d} bytes  sha256 {part.sha256[:16]}  "
                     f"{status}")
    return "\n".join(lines)
