"""What a parameter-server shard did, and the staleness of the gradients a client pushed:
the statistics both transports keep and Downpour reports."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

STALENESS_BINS = 64  # histogram bins 0..62, and the last for 63 or more


@dataclass
class ShardStats:
    """What a shard did: folds, pushes folded, pulls served (as of the last poll), polls,
    its fold sections (on "rma", each take and each publish counts one: `hold` is its own
    time, `wait` the time a take waited after its flip for the closed phase's pushes to
    complete; the names are from the lock-based scheme before issue 17), CPU and wall
    time served, and the transport ("rma" or "shared"). On the shared transport the
    clients fold, and folds/pushes/pulls are read from the segment."""

    folds: int = 0
    pushes: int = 0
    pulls: int = 0
    polls: int = 0
    exclusive_sections: int = 0
    holds: int = 0  # publishes that waited for a buffer without readers (RMA; rma_shard)
    publishes_in_place: int = 0  # into the newest buffer, around a stuck reader (RMA)
    hold_max_s: float = 0.0
    hold_total_s: float = 0.0
    wait_max_s: float = 0.0
    wait_total_s: float = 0.0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    transport: str = "rma"

    def exclusive(self, wait: float, hold: float) -> None:
        self.exclusive_sections += 1
        self.hold_max_s = max(self.hold_max_s, hold)
        self.hold_total_s += hold
        self.wait_max_s = max(self.wait_max_s, wait)
        self.wait_total_s += wait


@dataclass
class StalenessStats:
    """Staleness of pushed gradients, one sample per (push, shard): the number of updates
    the shard applied after the version the gradient was computed from, before it.

    `histogram[k]` counts samples of staleness k, the last bin those of STALENESS_BINS - 1
    or more."""

    samples: int = 0
    total: int = 0
    max: int = 0
    histogram: np.ndarray = field(
        default_factory=lambda: np.zeros(STALENESS_BINS, dtype=np.int64), repr=False)

    @property
    def mean(self) -> float:
        return self.total / self.samples if self.samples else 0.0

    def add(self, staleness: np.ndarray) -> None:
        self.samples += int(staleness.size)
        self.total += int(staleness.sum())
        self.max = max(self.max, int(staleness.max(initial=0)))
        self.histogram += np.bincount(np.minimum(staleness, STALENESS_BINS - 1),
                                      minlength=STALENESS_BINS)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: samples, mean, max, and the histogram with its trailing zeros cut."""
        used = int(np.flatnonzero(self.histogram)[-1]) + 1 if self.samples else 0
        return {"samples": self.samples, "mean": self.mean, "max": self.max,
                "histogram": [int(c) for c in self.histogram[:used]],
                "histogram_cap": STALENESS_BINS - 1}
