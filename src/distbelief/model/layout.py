"""The static layout of a model's parameters in one flat float32 vector.

Every parameter array of every layer is a view into one contiguous float32 vector, at a
fixed offset that depends only on the model (never on the number of shards or partitions).
This is what lets the parameter server shard the vector into contiguous ranges, lets a model
partition own a few slices, and lets checkpoints name what each range holds.

Within a layer, arrays are laid out so that a block of output units is one contiguous
slice: dense weights are (units_out, units_in), locally connected weights are
(out_h, out_w, kernel*kernel*channels_in, channels_out).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DTYPE = np.float32


@dataclass(frozen=True)
class ParamEntry:
    """One parameter array: which layer, its name there, its shape and where it lives."""

    layer: int
    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def stop(self) -> int:
        return self.offset + self.size


class ParamLayout:
    """An ordered list of `ParamEntry`, packed back to back from offset 0."""

    def __init__(self, arrays: list[tuple[int, str, tuple[int, ...]]]):
        """`arrays`: (layer index, name, shape) in storage order."""
        entries = []
        offset = 0
        for layer, name, shape in arrays:
            entry = ParamEntry(int(layer), str(name), tuple(int(d) for d in shape), offset)
            if entry.size <= 0:
                raise ValueError(f"parameter {name!r} of layer {layer} has empty shape {shape}")
            entries.append(entry)
            offset = entry.stop
        self.entries: tuple[ParamEntry, ...] = tuple(entries)
        self.size: int = offset
        self._by_key = {(e.layer, e.name): e for e in self.entries}
        if len(self._by_key) != len(self.entries):
            raise ValueError("duplicate (layer, name) in parameter layout")

    def entry(self, layer: int, name: str) -> ParamEntry:
        return self._by_key[(layer, name)]

    def view(self, flat: np.ndarray, layer: int, name: str) -> np.ndarray:
        """The array (layer, name) as a reshaped view of `flat`; no copy."""
        if flat.shape != (self.size,):
            raise ValueError(f"flat vector has shape {flat.shape}, layout needs ({self.size},)")
        e = self.entry(layer, name)
        return flat[e.offset : e.stop].reshape(e.shape)

    def empty(self) -> np.ndarray:
        return np.zeros(self.size, dtype=DTYPE)

    def shard_ranges(self, num_shards: int) -> list[tuple[int, int]]:
        """Contiguous, balanced [start, stop) ranges covering the vector, one per shard.

        Sizes differ by at most one element; the first `size % num_shards` shards get the
        extra one. A shard may cut through a parameter array: shards hold ranges of the
        vector, not layers.
        """
        return balanced_ranges(self.size, num_shards)

    def to_records(self) -> list[dict]:
        """JSON-friendly description (for checkpoint manifests and run summaries)."""
        return [
            {"layer": e.layer, "name": e.name, "shape": list(e.shape), "offset": e.offset}
            for e in self.entries
        ]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ParamLayout) and self.entries == other.entries

    def __repr__(self) -> str:
        return f"ParamLayout({len(self.entries)} arrays, {self.size} parameters)"


def balanced_ranges(total: int, parts: int) -> list[tuple[int, int]]:
    """Split range(total) into `parts` contiguous [start, stop) ranges of near-equal size."""
    if parts < 1:
        raise ValueError(f"need at least one part, got {parts}")
    if parts > total:
        raise ValueError(f"cannot split {total} items into {parts} non-empty parts")
    base, extra = divmod(total, parts)
    ranges = []
    start = 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges
