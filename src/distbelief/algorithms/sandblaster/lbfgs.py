"""L-BFGS driven by scalars only: the coordinator's side of Sandblaster.

The vectors (parameters x, gradient g, search direction d, history pairs s_i, y_i) live
elsewhere, sliced over parameter-server shards (distbelief.algorithms.sandblaster.vector_shard.VectorShard); this
module sees only dot products and sends only coefficients, so what crosses the network
per iteration is O(m) numbers, whatever the parameter count.

TWO-LOOP RECURSION IN COEFFICIENT SPACE. Every vector of the two-loop recursion (Nocedal
and Wright, Algorithm 7.4) is a linear combination of the 2m+1 basis vectors
b = [s_0..s_{m-1}, y_0..y_{m-1}, g], so it can be run on coefficient vectors given the
Gram matrix G[i, j] = b_i . b_j: q . s_i = c . G[:, s_i] for q = sum_j c_j b_j. This is the
"vector-free" formulation of Chen et al., "Large-scale L-BFGS using MapReduce" (NIPS
2014). Only the rows of G that involve the newest pair and the new gradient change per
iteration: 6m+1 partial dot products per shard (`Gram.update_pair`, `Gram.update_gradient`),
summed by the coordinator. The direction then costs one command carrying 2m+1
coefficients (d = sum c_j b_j, computed on every shard for its slice). Two round trips
per iteration plus one per line-search trial, instead of 2m+1 for a dot-per-step
recursion.

Slots are a ring of m entries; `Gram.order` lists the valid ones oldest first. A pair
whose curvature s.y is not clearly positive is not kept (the slot is reused), so the
implicit inverse Hessian stays positive definite.

LINE SEARCH (`LineSearch`): weak Wolfe by bisection and doubling (Lewis and Overton,
"Nonsmooth optimization via quasi-Newton methods", 2013), or Armijo backtracking (halving
only). Every trial is x + t d, evaluated on the same batch; a trial is accepted only
right after it was evaluated, so the shards' trial vectors are always the ones to keep.

`minimize` runs the whole method against a `Backend` (the MPI coordinator, or
`LocalBackend` in one process for tests), and calls back once per iteration.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

CURVATURE_EPS = 1e-10
"""A pair is kept only if s.y > CURVATURE_EPS * y.y (else the update could lose positive
definiteness to rounding)."""


class Gram:
    """The dot products among the history pairs and the gradient, for m ring slots."""

    def __init__(self, m: int):
        if m < 1:
            raise ValueError(f"history size m must be at least 1, got {m}")
        self.m = m
        self.ss = np.zeros((m, m))  # s_i . s_j
        self.sy = np.zeros((m, m))  # s_i . y_j
        self.yy = np.zeros((m, m))  # y_i . y_j
        self.gs = np.zeros(m)       # g . s_i
        self.gy = np.zeros(m)       # g . y_i
        self.gg = 0.0
        self.order: list[int] = []  # valid slots, oldest first

    def next_slot(self) -> int:
        """The slot the next pair goes to: a free one, else the oldest."""
        if len(self.order) < self.m:
            used = set(self.order)
            return next(i for i in range(self.m) if i not in used)
        return self.order[0]

    def update_pair(self, slot: int, dots: np.ndarray) -> bool:
        """Take the 6m+1 dots of a new pair in slot p: s_p.s_j, s_p.y_j, s_j.y_p, y_p.y_j,
        g.s_j, g.y_j (each for j = 0..m-1), g.g; keep the pair if its curvature is
        positive. Returns whether it was kept. The gradient's dots are taken either way."""
        m = self.m
        ss, sy_row, ys_col, yy, gs, gy, gg = _split(dots, m)
        if slot in self.order:
            self.order.remove(slot)
        self.ss[slot, :] = ss
        self.ss[:, slot] = ss
        self.sy[slot, :] = sy_row    # s_slot . y_j
        self.sy[:, slot] = ys_col    # s_j . y_slot
        self.yy[slot, :] = yy
        self.yy[:, slot] = yy
        self.sy[slot, slot] = sy_row[slot]
        self._set_gradient(gs, gy, gg)
        curvature = self.sy[slot, slot]
        kept = bool(curvature > CURVATURE_EPS * self.yy[slot, slot] and curvature > 0)
        if kept:
            self.order.append(slot)
        return kept

    def update_gradient(self, dots: np.ndarray) -> None:
        """Take the 2m+1 dots of a new gradient: g.s_j, g.y_j (j = 0..m-1), g.g."""
        m = self.m
        self._set_gradient(dots[:m], dots[m:2 * m], float(dots[2 * m]))

    def _set_gradient(self, gs: np.ndarray, gy: np.ndarray, gg: float) -> None:
        self.gs[:] = gs
        self.gy[:] = gy
        self.gg = float(gg)

    def load(self, dots: np.ndarray, pairs: int) -> None:
        """Take the 3 m^2 dots of VectorShard.gram (after a resume); pairs 0..pairs-1 are
        the history, oldest first."""
        m = self.m
        self.ss, self.sy, self.yy = (dots[i * m * m:(i + 1) * m * m].reshape(m, m).copy()
                                     for i in range(3))
        self.order = list(range(pairs))

    def reset(self) -> None:
        """Forget the history (steepest descent next)."""
        self.order = []

    def matrix(self) -> np.ndarray:
        """The full (2m+1)x(2m+1) Gram matrix of [s_0..s_{m-1}, y_0..y_{m-1}, g]."""
        m = self.m
        g = np.empty((2 * m + 1, 2 * m + 1))
        g[:m, :m], g[:m, m:2 * m], g[m:2 * m, m:2 * m] = self.ss, self.sy, self.yy
        g[m:2 * m, :m] = self.sy.T
        g[2 * m, :m] = g[:m, 2 * m] = self.gs
        g[2 * m, m:2 * m] = g[m:2 * m, 2 * m] = self.gy
        g[2 * m, 2 * m] = self.gg
        return g


def _split(dots: np.ndarray, m: int) -> tuple:
    if dots.shape != (6 * m + 1,):
        raise ValueError(f"pair dots must have 6m+1 = {6 * m + 1} entries, got {dots.shape}")
    parts = [dots[i * m:(i + 1) * m] for i in range(6)]
    return (*parts, float(dots[6 * m]))


def direction_coefficients(gram: Gram) -> np.ndarray:
    """Coefficients c of d = sum_j c_j b_j = -H g over the basis [s.., y.., g], by the
    two-loop recursion run on coefficients (see the module docstring). With no history,
    d = -g."""
    m = gram.m
    big = gram.matrix()
    c = np.zeros(2 * m + 1)
    c[2 * m] = 1.0  # q = g
    alpha = {}
    for i in reversed(gram.order):
        rho = 1.0 / gram.sy[i, i]
        alpha[i] = rho * (c @ big[:, i])
        c[m + i] -= alpha[i]
    if gram.order:
        newest = gram.order[-1]
        c *= gram.sy[newest, newest] / gram.yy[newest, newest]
    for i in gram.order:
        rho = 1.0 / gram.sy[i, i]
        beta = rho * (c @ big[:, m + i])
        c[i] += alpha[i] - beta
    return -c


# ------------------------------------------------------------------------------------------
# Line search


@dataclass
class LineSearch:
    """Weak Wolfe (or Armijo) line search as a state machine: `next_step()` is the step
    to evaluate, `tell(t, f, gtd)` says what it gave; `done` once a step is accepted or
    the evaluations are used up (`accepted` says which)."""

    f0: float
    gtd0: float
    t: float
    c1: float = 1e-4
    c2: float = 0.9
    wolfe: bool = True
    max_evals: int = 20
    lo: float = 0.0
    hi: float = math.inf
    evals: int = 0
    done: bool = False
    accepted: bool = False

    def tell(self, t: float, f: float, gtd: float) -> None:
        """The loss and directional derivative at step t (the step just evaluated)."""
        self.evals += 1
        if not math.isfinite(f) or f > self.f0 + self.c1 * t * self.gtd0:
            self.hi = t  # not enough decrease: shorter
        elif self.wolfe and gtd < self.c2 * self.gtd0:
            self.lo = t  # still steeply downhill: longer
        else:
            self.done = self.accepted = True
            return
        if self.evals >= self.max_evals:
            # Out of evaluations: keep the last trial if it at least lowered the loss.
            self.done = True
            self.accepted = math.isfinite(f) and f < self.f0
            return
        self.t = (self.lo + self.hi) / 2 if math.isfinite(self.hi) else 2 * self.lo


# ------------------------------------------------------------------------------------------
# The method


class Backend(Protocol):
    """Where the vectors are. Every call returns scalars already summed over the shards."""

    def evaluate(self, t: float, batch: int) -> tuple[float, float]:
        """Set the trial point x + t d, compute the loss and gradient there on batch
        `batch`; return (loss, g_trial . d)."""

    def accept(self, slot: int) -> np.ndarray:
        """Move to the trial point: s = x_t - x, y = g_t - g into `slot`, x = x_t,
        g = g_t; return the 6m+1 pair dots (Gram.update_pair)."""

    def take_gradient(self) -> np.ndarray:
        """g = the gradient of the last evaluation (at t = 0); return its 2m+1 dots
        (Gram.update_gradient)."""

    def set_direction(self, coefficients: np.ndarray) -> tuple[float, float]:
        """d = sum_j c_j b_j; return (g . d, d . d)."""


@dataclass(frozen=True)
class LbfgsOptions:
    m: int = 10
    c1: float = 1e-4
    c2: float = 0.9
    wolfe: bool = True
    max_line_search: int = 20
    gradient_tolerance: float = 1e-6
    max_iterations: int = 0  # 0 = no limit
    full_batch: bool = True


@dataclass
class Iteration:
    """What one iteration did, for metrics."""

    step: int
    loss: float
    grad_norm: float
    step_size: float
    line_search_evals: int
    pair_kept: bool
    restarted: bool = False
    order: list[int] = field(default_factory=list)  # history slots in use, oldest first


def minimize(backend: Backend, options: LbfgsOptions,
             on_iteration: Callable[[Iteration], str | None] | None = None,
             step: int = 0, gram: Gram | None = None) -> str:
    """Run L-BFGS from the backend's current point; returns why it stopped: "max_steps",
    "converged" (gradient norm below tolerance), "line_search_failed" (no decrease even
    along steepest descent), "diverged" (non-finite loss), or whatever non-None string
    `on_iteration` returned (it is called after every iteration; time budget, target).
    A resumed run passes the iterations done and the Gram matrix of its history."""
    gram = gram or Gram(options.m)
    batch = 0 if options.full_batch else step
    f, _ = backend.evaluate(0.0, batch)
    gram.update_gradient(backend.take_gradient())
    while True:
        if not math.isfinite(f):
            return "diverged"
        if math.sqrt(gram.gg) <= options.gradient_tolerance:
            return "converged"
        if options.max_iterations and step >= options.max_iterations:
            return "max_steps"
        restarted = False
        while True:
            gtd, dd = backend.set_direction(direction_coefficients(gram))
            if gtd < 0 or not gram.order:
                break
            gram.reset()  # not a descent direction (rounding): steepest descent
            restarted = True
        t0 = 1.0 if gram.order else min(1.0, 1.0 / math.sqrt(max(dd, 1e-300)))
        search = LineSearch(f, gtd, t0, options.c1, options.c2, options.wolfe,
                            options.max_line_search)
        while not search.done:
            t = search.t
            f_t, gtd_t = backend.evaluate(t, batch)
            search.tell(t, f_t, gtd_t)
        if not search.accepted:
            if not gram.order:
                return "line_search_failed"
            gram.reset()  # a bad curvature model: retry once from steepest descent
            continue
        slot = gram.next_slot()
        kept = gram.update_pair(slot, backend.accept(slot))
        f = f_t
        step += 1
        if not options.full_batch:
            batch += 1  # the next iteration's gradient, on its own batch
            f, _ = backend.evaluate(0.0, batch)
            gram.update_gradient(backend.take_gradient())
        record = Iteration(step, f, math.sqrt(max(gram.gg, 0.0)), t, search.evals, kept,
                           restarted, list(gram.order))
        if on_iteration is not None:
            reason = on_iteration(record)
            if reason:
                return reason
