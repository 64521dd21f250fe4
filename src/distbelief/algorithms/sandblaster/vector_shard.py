"""One shard's slice of every Sandblaster L-BFGS vector, and the operations on it.

A `VectorShard` holds, for the contiguous range [start, stop) of the flat parameter vector
(distbelief.model.layout.balanced_ranges), in float64:

    x        the parameters (the current iterate)
    g        the batch gradient at x
    d        the search direction
    xt, gt   the trial point x + t d of the line search and its gradient, summed from the
             replicas' pushes (`add_gradient`) and divided by the batch size at the end
    s[m], y[m]  the history pairs, a ring of m slots

plus float32 copies that replicas fetch: `trial32` (xt) and `snapshot32` (x, for
evaluations). float64 because L-BFGS takes differences of nearby iterates and gradients
(s, y) and dot products of long vectors; the replicas compute in float32.

Each operation the coordinator commands returns this slice's partial sums (numpy float64
arrays); the coordinator adds them over the shards (algorithms.sandblaster.lbfgs). Nothing here
communicates: distbelief.algorithms.sandblaster.shards moves the commands and the pushes.
"""

from __future__ import annotations

import numpy as np


class VectorShard:
    """The L-BFGS vectors of one slice [start, stop) of the parameters."""

    def __init__(self, initial: np.ndarray, start: int, m: int):
        """`initial`: this slice of the initial parameters."""
        n = len(initial)
        self.start, self.stop, self.m = start, start + n, m
        self.x = np.asarray(initial, dtype=np.float64).copy()
        self.g = np.zeros(n)
        self.d = np.zeros(n)
        self.xt = self.x.copy()
        self.gt = np.zeros(n)
        self.s = np.zeros((m, n))
        self.y = np.zeros((m, n))
        self.trial32 = self.xt.astype(np.float32)
        self.snapshot32 = self.x.astype(np.float32)
        self.trial_id = -1
        self.snapshot_id = -1
        self.units = 0  # work units summed into gt since begin_trial

    def begin_trial(self, trial_id: int, t: float) -> np.ndarray:
        """xt = x + t d (exactly x for t = 0); gt = 0. A new trial32 array, so a send of
        the previous one still in flight keeps its buffer."""
        np.multiply(self.d, t, out=self.xt)
        self.xt += self.x
        self.gt.fill(0.0)
        self.units = 0
        self.trial_id = trial_id
        self.trial32 = self.xt.astype(np.float32)
        return np.zeros(0)

    def add_gradient(self, partial: np.ndarray, units: int,
                     segments: list[tuple[int, int]] | None = None) -> None:
        """Add a replica's gradient sum over `units` work units of the current trial: the
        whole slice, or with `segments` ([start, stop) offsets in this slice: a model
        partition's parameters here) those segments, given back to back in `partial`."""
        if segments is None:
            self.gt += partial
        else:
            at = 0
            for a, b in segments:
                self.gt[a:b] += partial[at:at + b - a]
                at += b - a
            if at != len(partial):
                raise ValueError(f"segments cover {at} values, the push holds {len(partial)}")
        self.units += units

    def finish_trial(self, batch_size: int) -> np.ndarray:
        """gt = mean gradient over the batch; returns [gt . d]."""
        self.gt /= batch_size
        return np.array([self.gt @ self.d])

    def accept(self, slot: int) -> np.ndarray:
        """Move to the trial point: s = xt - x, y = gt - g into `slot`; x = xt, g = gt.
        Returns the 6m+1 dots distbelief.algorithms.sandblaster.lbfgs.Gram.update_pair takes."""
        s, y = self.s[slot], self.y[slot]
        np.subtract(self.xt, self.x, out=s)
        np.subtract(self.gt, self.g, out=y)
        self.x[:] = self.xt
        self.g[:] = self.gt
        return np.concatenate([self.s @ s, self.y @ s, self.s @ y, self.y @ y,
                               self.s @ self.g, self.y @ self.g, [self.g @ self.g]])

    def take_gradient(self) -> np.ndarray:
        """g = gt (the last trial, evaluated at t = 0 on a new batch). Returns the 2m+1 dots
        distbelief.algorithms.sandblaster.lbfgs.Gram.update_gradient takes."""
        self.g[:] = self.gt
        return np.concatenate([self.s @ self.g, self.y @ self.g, [self.g @ self.g]])

    def set_direction(self, coefficients: np.ndarray) -> np.ndarray:
        """d = sum_j c_j b_j over [s_0..s_{m-1}, y_0..y_{m-1}, g]; returns [g . d, d . d]."""
        m = self.m
        c = np.asarray(coefficients, dtype=np.float64)
        if c.shape != (2 * m + 1,):
            raise ValueError(f"direction needs 2m+1 = {2 * m + 1} coefficients, got {c.shape}")
        np.multiply(self.g, c[2 * m], out=self.d)
        self.d += c[:m] @ self.s
        self.d += c[m:2 * m] @ self.y
        return np.array([self.g @ self.d, self.d @ self.d])

    def take_snapshot(self, snapshot_id: int) -> np.ndarray:
        """snapshot32 = x, for an evaluation task (a new array, as for trial32)."""
        self.snapshot32 = self.x.astype(np.float32)
        self.snapshot_id = snapshot_id
        return np.zeros(0)

    def gram(self) -> np.ndarray:
        """All dots among the history vectors, flattened: s_i.s_j, s_i.y_j, y_i.y_j
        (3 m^2 numbers; once, after a resume)."""
        return np.concatenate([(self.s @ self.s.T).ravel(), (self.s @ self.y.T).ravel(),
                               (self.y @ self.y.T).ravel()])

    def checkpoint_arrays(self, order: list[int]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(params, state) for distbelief.records.checkpoint.write_shard_part: x, and the history
        pairs in `order` (oldest first) renamed 0..k-1, each float64 vector v stored as two
        float32 arrays, v ~ hi + lo (about 48 bits: a resume continues almost exactly)."""
        params, state = _hi(self.x), {"x_lo": _lo(self.x)}
        for k, slot in enumerate(order):
            for name, v in (("s", self.s[slot]), ("y", self.y[slot])):
                state[f"{name}{k:03d}"], state[f"{name}{k:03d}_lo"] = _hi(v), _lo(v)
        return params, state

    def load_checkpoint(self, params: np.ndarray, state: dict[str, np.ndarray]) -> int:
        """Restore what `checkpoint_arrays` wrote; the pairs go to slots 0..k-1. Returns k."""
        self.x[:] = params.astype(np.float64) + state["x_lo"]
        k = 0
        while f"s{k:03d}" in state:
            self.s[k] = state[f"s{k:03d}"].astype(np.float64) + state[f"s{k:03d}_lo"]
            self.y[k] = state[f"y{k:03d}"].astype(np.float64) + state[f"y{k:03d}_lo"]
            k += 1
        self.xt[:] = self.x
        return k


def _hi(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float32)


def _lo(v: np.ndarray) -> np.ndarray:
    return (v - v.astype(np.float32).astype(np.float64)).astype(np.float32)
