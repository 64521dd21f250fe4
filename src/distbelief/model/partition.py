"""How one model replica is split over P ranks (model parallelism): who owns which units,
which parameters, and which activations cross between partitions. Pure: no MPI.

UNITS. Each layer is split into P contiguous blocks of *split units*, one block per
partition (Dean et al. 2012, Figure 1):

    dense layer            split unit = one output unit       (block = units [u0, u1))
    image layers (local,   split unit = one row of the        (block = rows [r0, r1) of
    pool, lcn)             output map (all its columns and     the Ho x Wo x Cout map)
                           channels)

Both blocks are one contiguous range of the layer's flattened output (dense: units;
local: (row, column, channel) order) and one contiguous slice of each of the layer's
parameter arrays (dense weights are (units, inputs), local weights (Ho, Wo, patch, Cout),
both output-major; layout.py; pool and lcn layers have none). So a partition owns 2
contiguous ranges of the flat
parameter vector per layer (weights, bias), and in Downpour it pulls and pushes exactly
those (the paper's Figure 2). Blocks may differ in size and may be empty (an output layer
of 10 classes on 16 partitions); every partition must own units in at least one layer
with parameters.
Row bands rather than 2-D tiles keep every block and every parameter slice contiguous;
the price is a larger halo per partition once bands get thin (cost_model.py counts it).

NOT SPLIT. Conv, dropout and layernorm layers are refused with P > 1 (`check_splittable`,
a ConfigError every rank raises alike before any message): a conv layer's weights are tied,
so a band of its output rows would own no slice of them (every band needs all of them,
and the bands' gradients would have to be summed); a layernorm layer normalises over all
of a sample's features, which a split spreads over the partitions; and the partitioned
network draws no dropout masks.

INPUTS. Partition p's block of layer l is connected to a set of layer l-1 outputs:
all of them for a dense layer; for an image layer, the union of its positions' receptive
fields: rows r*s .. r*s+k-1 for its rows r of a local or pool layer, and the columns any
position reads (columns or rows that no window covers, when (W-k) % s != 0 or s > k, are
not needed); rows r-(k-1) .. r+(k-1) of an lcn layer, whose standard deviation is taken
over a window of the mean-subtracted values, each a window wide (all columns).
The inputs a partition needs and does not own are received from their owners, each value
once per step even when several of the partition's units read it (the paper: "its state
is only sent to the machine on that other side once"). The number of such (value,
receiving partition) pairs is the number of cut edges counted that way; forward, each
costs 4 bytes per sample; backward, the gradient flows back over the same edge (another
4 bytes). The network's input (the data batch) is read by every partition of a replica,
so layer 0 receives nothing.

`Partitioning` computes all of that once per (network, P, splits): per layer and partition
a `LayerPart` with its unit block, its input window (a contiguous range of the previous
layer's flattened output covering everything it needs, so a local layer's window is whole
input rows and feeds the kernel as one sub-image), and its messages as sorted arrays of
flat indices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

from distbelief.errors import ConfigError
from distbelief.model.layers import Conv, Dropout, ImageLayer, Layer, LayerNorm
from distbelief.model.layout import ParamLayout

UNSPLIT = {
    Conv: "its weights are tied: every band of output rows needs all of them",
    LayerNorm: "it normalises over all of a sample's features",
    Dropout: "the partitioned network draws no dropout masks",
}
"""The layer types model parallelism does not split, and why."""


def split_units(layer: Layer) -> int:
    """How many split units a layer has: output units (dense) or output rows (local)."""
    return layer.out_shape[0]


def unit_width(layer: Layer) -> int:
    """Flattened outputs per split unit: 1 (dense) or Wo * Cout (local)."""
    return layer.out_size // split_units(layer)


def balanced_splits(units: int, parts: int) -> list[int]:
    """Boundaries [0, b1, ..., units] of `parts` near-equal blocks (some empty when
    units < parts: the first `units` blocks get one each)."""
    base, extra = divmod(units, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def needed_inputs(layer: Layer, start: int, stop: int) -> np.ndarray:
    """Boolean mask over the layer's flattened input: the inputs that split units
    [start, stop) are connected to (nothing for an empty block)."""
    mask = np.zeros(layer.in_size, dtype=bool)
    if start >= stop:
        return mask
    if not isinstance(layer, ImageLayer):  # dense, and the unsplit dropout and layernorm
        mask[:] = True
        return mask
    rows = np.zeros(layer.in_shape[0], dtype=bool)
    for r in range(start, stop):
        first, last = layer.input_rows(r, r + 1)
        rows[first:last] = True
    cols = layer.input_columns()
    grid = rows[:, None, None] & cols[None, :, None]
    return np.broadcast_to(grid, layer.in_shape).reshape(-1).copy()


def input_window(layer: Layer, start: int, stop: int) -> tuple[int, int]:
    """The contiguous range of flattened inputs a partition holds for split units [start,
    stop): all inputs (dense), or the whole input rows its windows span (image layers)."""
    if start >= stop:
        return 0, 0
    if not isinstance(layer, ImageLayer):
        return 0, layer.in_size
    row = layer.in_shape[1] * layer.in_shape[2]
    first, last = layer.input_rows(start, stop)
    return first * row, last * row


def check_splittable(layers: Sequence[Layer], partitions: int) -> None:
    """ConfigError when partitions > 1 and a layer is of a type model parallelism does not
    split (UNSPLIT, the module's docstring). Cheap: configuration checks call it."""
    if partitions <= 1:
        return
    for i, layer in enumerate(layers):
        reason = UNSPLIT.get(type(layer))
        if reason is not None:
            raise ConfigError(
                f"partitions = {partitions}: layer {i} ({layer.kind}) is not split over "
                f"partitions ({reason}); model parallelism splits dense, local, pool and "
                f"lcn layers: use partitions = 1 with this model")


def check_every_partition_owns_units(layers: Sequence[Layer],
                                     splits: Sequence[Sequence[int]]) -> None:
    """ConfigError unless every partition owns units of some layer with parameters (a
    partition holding only pool or lcn rows would have no parameters to train). Cheap (no
    masks), so configuration checks can call it with balanced splits of P partitions."""
    partitions = len(splits[0]) - 1
    trained = [i for i, layer in enumerate(layers) if layer.num_params]
    idle = [p for p in range(partitions)
            if all(splits[i][p] == splits[i][p + 1] for i in trained)]
    if idle:
        most = max(split_units(layers[i]) for i in trained)
        raise ConfigError(
            f"partitions = {partitions}: partition(s) {idle} would own no units of any "
            f"layer with parameters (dense layers split into blocks of units, locally "
            f"connected layers into blocks of output rows; the widest splits into at "
            f"most {most}); use at most {most} partitions")


def checked_splits(layers: Sequence[Layer], partitions: int,
                   splits: Sequence[Sequence[int]] | None) -> list[list[int]]:
    """`splits` (per layer, the P+1 block boundaries in split units) as lists of ints,
    balanced ones when None; ConfigError when they do not fit the layers, or a layer is
    not split (check_splittable)."""
    check_splittable(layers, partitions)
    if splits is None:
        return [balanced_splits(split_units(layer), partitions) for layer in layers]
    if len(splits) != len(layers):
        raise ConfigError(f"splits: need one list of boundaries per layer "
                          f"({len(layers)}), got {len(splits)}")
    checked = []
    for i, (layer, bounds) in enumerate(zip(layers, splits)):
        bounds = [int(b) for b in bounds]
        units = split_units(layer)
        if (len(bounds) != partitions + 1 or bounds[0] != 0 or bounds[-1] != units
                or any(a > b for a, b in pairwise(bounds))):
            raise ConfigError(f"splits: layer {i} needs {partitions + 1} "
                              f"non-decreasing boundaries from 0 to {units}, got {bounds}")
        checked.append(bounds)
    return checked


def layer_pieces(layer: Layer, layout: ParamLayout, index: int, start: int,
                 stop: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of the flat parameter vector (weights, bias) that split units
    [start, stop) of layer `index` own (empty ranges for an empty block; none for a layer
    without parameters)."""
    pieces = []
    for name in [name for name, _ in layer.param_shapes()]:
        entry = layout.entry(index, name)
        per_unit = entry.size // split_units(layer)
        pieces.append((entry.offset + start * per_unit, entry.offset + stop * per_unit))
    return pieces


def partition_pieces(layers: Sequence[Layer], layout: ParamLayout, partitions: int,
                     splits: Sequence[Sequence[int]] | None = None
                     ) -> list[list[tuple[int, int]]]:
    """Per partition, the non-empty ranges of the flat parameter vector it owns, in layout
    order: what `Partitioning(...).pieces(p)` gives, without building any message (cheap
    for huge models, so a parameter-server shard can call it). `splits` as Partitioning's
    (None: balanced); ConfigError when they do not fit."""
    checked = checked_splits(layers, partitions, splits)
    check_every_partition_owns_units(layers, checked)
    return [[piece for i, layer in enumerate(layers)
             for piece in layer_pieces(layer, layout, i, checked[i][p], checked[i][p + 1])
             if piece[0] < piece[1]] for p in range(partitions)]


@dataclass(frozen=True)
class Message:
    """Values one partition sends another for one layer: `indices` are sorted flat indices
    into the previous layer's output (the sender owns them, the receiver needs them)."""

    peer: int
    indices: np.ndarray

    @property
    def size(self) -> int:
        return len(self.indices)

    def columns(self, origin: int) -> slice | np.ndarray:
        """The indices relative to `origin`, as a slice when they are contiguous (cheaper
        to copy with), else as an index array."""
        first, last = int(self.indices[0]), int(self.indices[-1])
        if last - first + 1 == len(self.indices):
            return slice(first - origin, last + 1 - origin)
        return self.indices - origin


@dataclass
class LayerPart:
    """Partition `partition`'s share of layer `layer`."""

    layer: int
    partition: int
    units: tuple[int, int]          # split units [start, stop)
    outputs: tuple[int, int]        # flattened outputs it owns [lo, hi)
    window: tuple[int, int]         # flattened inputs it holds [lo, hi)
    own_inputs: tuple[int, int]     # inputs it owns itself (its block of layer-1), clipped
    pieces: list[tuple[int, int]]   # [start, stop) in the flat parameter vector: W, bias
    recv: list[Message] = field(default_factory=list)  # forward: inputs from peers
    send: list[Message] = field(default_factory=list)  # forward: own layer-1 outputs to peers

    @property
    def empty(self) -> bool:
        return self.units[0] >= self.units[1]

    @property
    def received(self) -> int:
        """Values received per sample in the forward pass (= sent back in backward)."""
        return sum(m.size for m in self.recv)


class Partitioning:
    """The split of a network's layers over P partitions; see the module docstring.

    `splits`: per layer, the boundaries [0, b1, ..., units] of the P blocks in split
    units (None: balanced). Raises ConfigError when the splits do not fit the network.
    """

    def __init__(self, layers: Sequence[Layer], layout: ParamLayout, partitions: int,
                 splits: Sequence[Sequence[int]] | None = None):
        if partitions < 1:
            raise ConfigError(f"partitions must be at least 1, got {partitions}")
        self.layers = list(layers)
        self.partitions = partitions
        self.splits = self._check_splits(splits)
        self._check_every_partition_owns_units()
        self.parts: list[list[LayerPart]] = [
            [self._part(i, p, layout) for p in range(partitions)]
            for i in range(len(self.layers))]
        for i in range(1, len(self.layers)):
            self._messages(i)

    def _check_splits(self, splits: Sequence[Sequence[int]] | None) -> list[list[int]]:
        return checked_splits(self.layers, self.partitions, splits)

    def _check_every_partition_owns_units(self) -> None:
        check_every_partition_owns_units(self.layers, self.splits)

    def _part(self, i: int, p: int, layout: ParamLayout) -> LayerPart:
        layer = self.layers[i]
        start, stop = self.splits[i][p], self.splits[i][p + 1]
        width = unit_width(layer)
        pieces = layer_pieces(layer, layout, i, start, stop)
        window = input_window(layer, start, stop)
        if i == 0:
            own = window  # the data batch: every partition has all of it
        else:
            below = self.layers[i - 1]
            b0, b1 = self.splits[i - 1][p], self.splits[i - 1][p + 1]
            w = unit_width(below)
            own = (max(window[0], b0 * w), min(window[1], b1 * w))
            if own[0] >= own[1]:
                own = (window[0], window[0])
        return LayerPart(i, p, (start, stop), (start * width, stop * width), window, own,
                         pieces)

    def _messages(self, i: int) -> None:
        """Fill recv/send of layer i: p receives from q what p's block is connected to
        among q's outputs of layer i-1."""
        layer, below = self.layers[i], self.layers[i - 1]
        width = unit_width(below)
        for p, part in enumerate(self.parts[i]):
            mask = needed_inputs(layer, *part.units)
            for q in range(self.partitions):
                lo, hi = self.splits[i - 1][q] * width, self.splits[i - 1][q + 1] * width
                if q == p or lo >= hi:
                    continue
                indices = np.flatnonzero(mask[lo:hi]) + lo
                if len(indices):
                    part.recv.append(Message(q, indices))
                    self.parts[i][q].send.append(Message(p, indices))

    # -- queries ------------------------------------------------------------------------

    def part(self, layer: int, partition: int) -> LayerPart:
        return self.parts[layer][partition]

    def pieces(self, partition: int) -> list[tuple[int, int]]:
        """The non-empty [start, stop) ranges of the flat parameter vector partition owns,
        in layout order."""
        return [piece for parts in self.parts for piece in parts[partition].pieces
                if piece[0] < piece[1]]

    def exchanged_values(self, layer: int) -> int:
        """Values crossing partitions per sample for layer `layer`'s inputs, one way."""
        return sum(part.received for part in self.parts[layer])

    def describe(self) -> str:
        """One line per layer: its blocks and the values it exchanges per sample."""
        lines = []
        for i, layer in enumerate(self.layers):
            sizes = [b - a for a, b in pairwise(self.splits[i])]
            what = "rows" if isinstance(layer, ImageLayer) else "units"
            lines.append(f"{i:>3} {layer.kind:<6} {what} per partition {sizes}; "
                         f"{self.exchanged_values(i):,d} values/sample cross")
        return "\n".join(lines)
