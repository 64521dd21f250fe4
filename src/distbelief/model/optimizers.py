"""Optimizers that update a flat float32 parameter vector in place: Adagrad, plain SGD,
AdaRevision (Adagrad that revises its steps for the updates a stale gradient missed), SGD
with momentum and Adam, and the learning-rate `Schedule` they step with.

They work on any 1-D float32 array, so a parameter-server shard runs one on its own range
of the parameter vector, and a single process runs one on the whole vector. The update
itself is one fused pass in the compiled kernels (distbelief.model.kernels). Each optimizer's
state is a dict of named float32 arrays, which checkpoints save and load back.

The learning rate is a pure function of the update count (`Schedule`: linear warmup, then
constant, step or cosine decay). An optimizer does not count its updates itself: whoever
applies the update knows how many came before it (a trainer its step, a parameter-server
shard the gradients it has applied, both kept in checkpoints), so `step(..., update=n)`
takes it, and a resumed run steps at the same rates as an unbroken one.

A parameter-server shard applies every rule through one declared interface, `ShardRule`:
`apply(params, grad, StepInfo)`, the StepInfo holding all the shard knows of the update
(its count, the shard's version, the version the gradient was computed on, the pushes
summed in it); each rule reads the fields it needs, `revises` declares the one
capability a transport must know of, and `delay_stats` what a shard reports of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from distbelief.model import kernels


def _check_learning_rate(learning_rate: object) -> float:
    if isinstance(learning_rate, bool) or not isinstance(
            learning_rate, (int, float, np.integer, np.floating)):
        raise TypeError(f"learning_rate must be a number, got {type(learning_rate).__name__}")
    if not math.isfinite(learning_rate) or learning_rate <= 0:
        raise ValueError(f"learning_rate must be a positive finite number, got {learning_rate}")
    return float(learning_rate)


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


SCHEDULES = ("constant", "step", "cosine")
"""Schedule kinds: the rate after the warmup."""


class Schedule:
    """The learning rate of update number `t` (t updates were applied before it), a pure
    function of t:

        warmup   t < warmup_steps:  learning_rate * (t + 1) / warmup_steps
        then, with s = t - warmup_steps (updates since the warmup ended):
        constant learning_rate
        step     max(min_learning_rate, learning_rate * decay_rate ** (s // decay_steps))
        cosine   min_learning_rate + (learning_rate - min_learning_rate)
                   * (1 + cos(pi * min(s, decay_steps) / decay_steps)) / 2
                 (learning_rate at s = 0, min_learning_rate from s = decay_steps on)

    The warmup's first update runs at learning_rate / warmup_steps, its last at
    learning_rate, so the warmup joins the decay without a jump. A constant schedule
    without warmup is the plain fixed rate (`Schedule(lr)`).
    """

    def __init__(self, learning_rate: float, warmup_steps: int = 0, kind: str = "constant",
                 decay_steps: int | None = None, decay_rate: float = 0.1,
                 min_learning_rate: float = 0.0) -> None:
        self.learning_rate = _check_learning_rate(learning_rate)
        self.warmup_steps = _check_count("warmup_steps", warmup_steps, 0)
        if kind not in SCHEDULES:
            raise ValueError(f"kind must be one of {', '.join(SCHEDULES)}, got {kind!r}")
        self.kind = kind
        if kind == "constant":
            self.decay_steps = None
        elif decay_steps is None:
            raise ValueError(f"a {kind} schedule needs decay_steps")
        else:
            self.decay_steps = _check_count("decay_steps", decay_steps, 1)
        if isinstance(decay_rate, bool) or not isinstance(
                decay_rate, (int, float, np.integer, np.floating)) \
                or not 0 < decay_rate < 1:
            raise ValueError(f"decay_rate must be a number in (0, 1), got {decay_rate!r}")
        self.decay_rate = float(decay_rate)
        if isinstance(min_learning_rate, bool) or not isinstance(
                min_learning_rate, (int, float, np.integer, np.floating)) \
                or not 0 <= min_learning_rate < self.learning_rate:
            raise ValueError(f"min_learning_rate must be a number >= 0 and below "
                             f"learning_rate {self.learning_rate:g}, got {min_learning_rate!r}")
        self.min_learning_rate = float(min_learning_rate)

    @property
    def constant(self) -> bool:
        """Whether every update gets learning_rate (no warmup, no decay)."""
        return self.kind == "constant" and self.warmup_steps == 0

    def __call__(self, update: int) -> float:
        """The learning rate of update number `update` (0 for the first)."""
        t = _check_count("update", update, 0)
        if t < self.warmup_steps:
            return self.learning_rate * (t + 1) / self.warmup_steps
        s = t - self.warmup_steps
        if self.kind == "step":
            return max(self.min_learning_rate,
                       self.learning_rate * self.decay_rate ** (s // self.decay_steps))
        if self.kind == "cosine":
            progress = min(s, self.decay_steps) / self.decay_steps
            return self.min_learning_rate + (self.learning_rate - self.min_learning_rate) \
                * 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.learning_rate

    def __repr__(self) -> str:
        return (f"Schedule(learning_rate={self.learning_rate!r}, "
                f"warmup_steps={self.warmup_steps}, kind={self.kind!r}, "
                f"decay_steps={self.decay_steps}, decay_rate={self.decay_rate!r}, "
                f"min_learning_rate={self.min_learning_rate!r})")


def _schedule(learning_rate: float | Schedule) -> Schedule:
    """A Schedule as given, or the constant one of a plain rate (checked)."""
    if isinstance(learning_rate, Schedule):
        return learning_rate
    return Schedule(learning_rate)


@dataclass(frozen=True)
class StepInfo:
    """What a parameter-server shard knows of one update, given to ShardRule.apply. Both
    transports fill every field; a rule reads those it needs."""

    update: int
    """Gradients (pushes) the slice had applied before this update over the whole run,
    earlier jobs included: the learning-rate schedule's position (step's update=)."""
    version: int
    """Updates the shard had applied before this one (a fold of several pushes is one)."""
    fetched: int
    """The version the gradient's parameters were pulled at (at most `version`; a fold of
    several pushes gives the mean of theirs). AdaRevision revises for the difference."""
    pushes: int = 1
    """Pushes summed into this gradient (the RMA transport folds every full slot at once;
    on shared memory each push is its own update). DelayedNesterov counts them."""


class ShardRule:
    """The update rule of a parameter-server shard's slice: every optimizer here, and any
    other rule a shard applies (EASGD's center update). Subclasses define step() and
    state(); a shard calls only what is declared here, never probes for more.

    `apply` is how a shard applies one update: by default step(params, grad, copy,
    update=info.update); a rule that needs more of StepInfo overrides it."""

    revises: ClassVar[bool] = False
    """True for a rule that keeps state per version (AdaRevision's gradient sums): a
    transport that applies one update in pieces (a shared-memory client restricted to a
    model partition) calls record_version(version + 1) on the whole slice's rule after
    the pieces, so the versions the pieces did not touch are kept too."""

    def step(self, params: np.ndarray, grad: np.ndarray, copy: np.ndarray | None = None, *,
             update: int | None = None) -> None:
        """Update params in place with grad (with `copy`, store the new params there too)."""
        raise NotImplementedError

    def apply(self, params: np.ndarray, grad: np.ndarray, info: StepInfo,
              copy: np.ndarray | None = None) -> None:
        """Apply `grad` to `params` in place as the update `info` describes (with `copy`,
        also store the new params there, in the same pass)."""
        self.step(params, grad, copy, update=info.update)

    def state(self) -> dict[str, np.ndarray]:
        """The live state arrays (not copies), by name."""
        raise NotImplementedError

    def saved_state(self) -> dict[str, np.ndarray]:
        """The live state arrays a checkpoint keeps: all of state() unless a rule keeps
        some that a resumed run rebuilds (AdaRevision's history)."""
        return self.state()

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore state saved by saved_state(); checks shapes and values, copies."""
        raise NotImplementedError

    def delay_stats(self) -> dict[str, float] | None:
        """What this rule saw of the gradients' delays, for the shard's statistics; None
        for a rule that keeps no such count (every one but AdaRevision)."""
        return None

    def scaling_stats(self) -> dict[str, float] | None:
        """What staleness scaling did to this object's updates (their count and the mean
        factor of their rates), for the shard's statistics; None without scaling."""
        return None

    elementwise: ClassVar[bool] = False
    """True for a rule whose update of a coordinate reads only that coordinate's
    parameter, gradient and state (Adagrad, SGD, Momentum, Adam): step_at can then update
    a few coordinates alone."""

    def step_at(self, params: np.ndarray, grad: np.ndarray, index: np.ndarray, *,
                update: int | None = None) -> None:
        """step() on the coordinates `index` (distinct) of params, grad and the state
        only: gathered, updated and written back. A sparse model's step touches a few
        rows of its tables, and writing the others back unchanged would undo the updates
        other Hogwild workers made to them meanwhile. Each state array is an attribute
        of the rule named as in state() (Hogwild binds its shared arrays the same way)."""
        self._at(params, index, lambda values: self.step(
            values, np.ascontiguousarray(grad[index]), update=update))

    def apply_at(self, params: np.ndarray, grad: np.ndarray, index: np.ndarray,
                 info: StepInfo) -> None:
        """apply() on the coordinates `index` (distinct) of params and the state only,
        `grad` their gradient (compact, one value per index): a shard's lazy update of
        the rows a row-sharded push touched (ps.endpoint.PieceMap)."""
        self._at(params, index, lambda values: self.apply(values, grad, info))

    def _at(self, params: np.ndarray, index: np.ndarray,
            update: Callable[[np.ndarray], None]) -> None:
        """Gather params and the state at `index`, run `update` on the gathered params
        (the state attributes pointed at the gathered state meanwhile), write back."""
        if not self.elementwise:
            raise ValueError(f"{type(self).__name__} updates the whole vector at once; it "
                             f"cannot update a sparse model's touched rows alone")
        live = self.state()
        compact = {name: array[index] for name, array in live.items()}
        values = params[index]
        try:
            for name, array in compact.items():
                setattr(self, name, array)
            update(values)
        finally:
            for name, array in live.items():
                setattr(self, name, array)
        params[index] = values
        for name, array in compact.items():
            live[name][index] = array


STALENESS_SCALINGS = ("none", "inverse")
"""How a shard scales an update's learning rate by the push's staleness (the shard's
updates between the gradient's fetch and its application): not at all, or divided by it
(Zhang, Gupta, Lian and Liu, "Staleness-aware Async-SGD for Distributed Deep Learning",
IJCAI 2016)."""


def staleness_scale(scaling: str, info: StepInfo) -> float:
    """The factor `scaling` applies to the rate of the update `info` describes: 1 for
    "none", 1 / max(1, version - fetched) for "inverse" (a push with nothing applied since
    its fetch, or one update, keeps the full rate)."""
    if scaling == "none":
        return 1.0
    return 1.0 / max(1, info.version - info.fetched)


class _Scheduled(ShardRule):
    """What every optimizer on a schedule shares: the schedule, the rate of one update, and
    on a shard the scaling of that rate by the update's staleness."""

    schedule: Schedule
    staleness_scaling: str = "none"
    """One of STALENESS_SCALINGS: set on a shard's rule (optimizer.staleness_scaling), read
    by apply. An attribute, so a copy of the rule for a piece of the slice keeps it."""
    _scale: float = 1.0  # the factor of the update apply is applying
    _scaled_updates: int = 0  # apply's updates, and their factors summed
    _scale_sum: float = 0.0

    @property
    def learning_rate(self) -> float:
        """The schedule's peak rate (the configured optimizer.learning_rate)."""
        return self.schedule.learning_rate

    def rate(self, update: int | None) -> float:
        """The rate of update number `update`; None is allowed only on a constant schedule
        (callers that never had a count keep working)."""
        if update is None:
            if not self.schedule.constant:
                raise ValueError("this optimizer follows a learning-rate schedule: step() "
                                 "needs update= (the number of updates applied before)")
            return self.schedule.learning_rate * self._scale
        return self.schedule(update) * self._scale

    def apply(self, params: np.ndarray, grad: np.ndarray, info: StepInfo,
              copy: np.ndarray | None = None) -> None:
        """The update as ShardRule.apply, at the rate scaled by its staleness."""
        self._scale = staleness_scale(self.staleness_scaling, info)
        self._scaled_updates += 1
        self._scale_sum += self._scale
        try:
            self._apply(params, grad, info, copy)
        finally:
            self._scale = 1.0

    def _apply(self, params: np.ndarray, grad: np.ndarray, info: StepInfo,
               copy: np.ndarray | None) -> None:
        """What apply does at its rate: step() at the update's schedule position; a rule
        that reads more of StepInfo overrides this."""
        self.step(params, grad, copy, update=info.update)

    def scaling_stats(self) -> dict[str, float] | None:
        if self.staleness_scaling == "none":
            return None
        mean = self._scale_sum / self._scaled_updates if self._scaled_updates else 1.0
        return {"scaling": self.staleness_scaling, "updates": self._scaled_updates,
                "rate_scale_mean": mean}


def _check_size(size: object) -> int:
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        raise TypeError(f"size must be an integer, got {type(size).__name__}")
    if size < 0:
        raise ValueError(f"size must be non-negative, got {size}")
    return int(size)


def _check_state_keys(name: str, state: object, expected: set[str]) -> None:
    if not isinstance(state, dict):
        raise TypeError(f"{name} state must be a dict of arrays, got {type(state).__name__}")
    if set(state) != expected:
        raise ValueError(f"{name} state must have keys {sorted(expected)}, "
                         f"got {sorted(map(str, state))}")


class Adagrad(_Scheduled):
    """Adagrad as in the DistBelief paper and torch.optim.Adagrad with default arguments.

    Per parameter: accum += g**2; param -= lr * g / (sqrt(accum) + eps), lr the schedule's
    rate for this update (`learning_rate`: a number, or a Schedule). accum starts at zero;
    no weight decay.
    """

    elementwise = True

    def __init__(self, size: int, learning_rate: float | Schedule, eps: float = 1e-10) -> None:
        self.size = _check_size(size)
        self.schedule = _schedule(learning_rate)
        if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)):
            raise TypeError(f"eps must be a number, got {type(eps).__name__}")
        if not math.isfinite(eps) or eps < 0:
            raise ValueError(f"eps must be a non-negative finite number, got {eps}")
        self.eps = float(eps)
        self.accum = np.zeros(self.size, np.float32)

    def step(self, params: np.ndarray, grad: np.ndarray,
             copy: np.ndarray | None = None, *, update: int | None = None) -> None:
        """Update params (1-D float32, length size) in place with grad, one fused pass;
        with `copy`, also store the new params there in the same pass. `update`: the
        number of updates applied before this one (the schedule's position)."""
        kernels.adagrad_update(params, self.accum, grad, self.rate(update), self.eps, copy)

    def state(self) -> dict[str, np.ndarray]:
        """The live state arrays (not copies): {"accum": sum of squared gradients}."""
        return {"accum": self.accum}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore state saved by state(); checks shape and values, copies into accum."""
        _check_state_keys("Adagrad", state, {"accum"})
        accum = state["accum"]
        if not isinstance(accum, np.ndarray) or not np.issubdtype(accum.dtype, np.floating):
            raise TypeError("Adagrad state 'accum' must be a floating-point numpy array")
        if accum.shape != (self.size,):
            raise ValueError(f"Adagrad state 'accum' must have shape ({self.size},), "
                             f"got {accum.shape}")
        # A sum of squares is finite and non-negative; anything else is a corrupt file.
        if not np.all(np.isfinite(accum)) or np.any(accum < 0):
            raise ValueError("Adagrad state 'accum' must be finite and non-negative")
        np.copyto(self.accum, accum, casting="same_kind")


class SGD(_Scheduled):
    """Plain SGD: param -= lr * g, lr the schedule's rate for this update (`learning_rate`:
    a number, or a Schedule). It has no state."""

    elementwise = True

    def __init__(self, learning_rate: float | Schedule) -> None:
        self.schedule = _schedule(learning_rate)

    def step(self, params: np.ndarray, grad: np.ndarray,
             copy: np.ndarray | None = None, *, update: int | None = None) -> None:
        """Update params (1-D float32) in place with grad of the same length; with `copy`,
        also store the new params there in the same pass. `update` as Adagrad.step's."""
        kernels.sgd_update(params, grad, self.rate(update), copy)

    def state(self) -> dict[str, np.ndarray]:
        """SGD keeps no state: an empty dict."""
        return {}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Accepts only the empty state that state() returns."""
        _check_state_keys("SGD", state, set())


HISTORY = 8
"""Versions of the gradient sum an AdaRevision shard keeps (a ring): a push whose fetch is
older than this is revised as if it had fetched the oldest one kept (counted in `capped`).
Each costs one float32 vector of the slice in memory (in the shared segment on the shared
transport), none on the wire."""


class AdaRevision(_Scheduled):
    """AdaRevision: McMahan and Streeter, "Delay-Tolerant Algorithms for Asynchronous
    Distributed Online Learning", NIPS 2014, Algorithm 2 (AdaptiveRevision), per coordinate.

    The rule, written from the paper's algorithm (the text of the paper was not available
    here; the zero-delay case below is the check that it reduces to Adagrad as the paper
    says). State: gsum, the sum of every gradient applied; z, the delay-adjusted sum of
    squares; zmax, its running maximum. A gradient g computed on parameters fetched when
    the sum was gsum_fetched is applied as

        g_bck = gsum - gsum_fetched        (gradients applied since the fetch)
        eta_old = lr / (sqrt(zmax) + eps)
        z += g**2 + 2 * g * g_bck
        zmax = max(zmax, z)
        eta = lr / (sqrt(zmax) + eps)
        param -= eta * g - (eta_old - eta) * g_bck   (revise the backlog's steps)
        gsum += g

    With no delay (g_bck = 0) this is Adagrad exactly: z = sum of g**2, eta as Adagrad's.
    z may shrink (g against the backlog), hence zmax, which keeps the rate non-increasing.

    What "gsum at fetch" is: the shard numbers its updates (its version). Instead of every
    push carrying a vector gsum_fetched (one more slice on every pull and push), the push
    carries the version it fetched (8 bytes), and the optimizer keeps gsum at each of the
    last HISTORY versions (history_00 ...: history_k holds gsum after the update that
    made a version v with v % HISTORY == k). step() takes the version being updated and
    the version fetched.
    """

    revises = True  # keeps a gradient sum per version (ShardRule.revises)

    def __init__(self, size: int, learning_rate: float | Schedule, eps: float = 1e-10,
                 history: int = HISTORY) -> None:
        self.size = _check_size(size)
        self.schedule = _schedule(learning_rate)
        if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)):
            raise TypeError(f"eps must be a number, got {type(eps).__name__}")
        # eps > 0: eta_old of a coordinate with no gradient yet is lr / eps, finite, and
        # multiplies a g_bck of exactly 0 there.
        if not math.isfinite(eps) or eps <= 0:
            raise ValueError(f"eps must be a positive finite number, got {eps}")
        self.eps = float(eps)
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValueError(f"history must be a positive integer, got {history!r}")
        self.history = history
        self.gsum = np.zeros(self.size, np.float32)
        self.z = np.zeros(self.size, np.float32)
        self.zmax = np.zeros(self.size, np.float32)
        for k in range(history):
            setattr(self, self._slot_name(k), np.zeros(self.size, np.float32))
        # Counts of this process's updates (a shard's on RMA; each client's on shared memory)
        self.updates = 0
        self.backlog_versions = 0  # sum over updates of version - fetched, after capping
        self.capped = 0  # updates whose fetch was older than the history

    @staticmethod
    def _slot_name(k: int) -> str:
        return f"history_{k:02d}"

    def _slot(self, version: int) -> np.ndarray:
        return getattr(self, self._slot_name(version % self.history))

    def step(self, params: np.ndarray, grad: np.ndarray, copy: np.ndarray | None = None, *,
             version: int, fetched: int, update: int | None = None) -> None:
        """Apply `grad` as update number version + 1 (`version` updates were applied
        before it), computed on the parameters of version `fetched`; params (1-D float32,
        length size) in place, with `copy` also stored there. A fetch older than the
        history is taken as the oldest version kept (self.capped counts them); a fetch
        newer than `version` as `version` (no delay). `update`: the schedule's position,
        as Adagrad.step's (the revision of the backlog uses this update's rate for both
        eta_old and eta: the rule assumes one rate)."""
        lr = self.rate(update)
        if version < 0:
            raise ValueError(f"version must be non-negative, got {version}")
        fetched = min(int(fetched), int(version))
        if version - fetched >= self.history:
            fetched = version - self.history + 1
            self.capped += 1
        self.updates += 1
        self.backlog_versions += version - fetched
        kernels.adarevision_update(params, self.gsum, self.z, self.zmax, self._slot(fetched),
                                   grad, lr, self.eps, copy)
        self.record_version(version + 1)

    def _apply(self, params: np.ndarray, grad: np.ndarray, info: StepInfo,
               copy: np.ndarray | None) -> None:
        """step() with the shard's version and the version the gradient was pulled at."""
        self.step(params, grad, copy, version=info.version, fetched=info.fetched,
                  update=info.update)

    def record_version(self, version: int) -> None:
        """Keep gsum as the gradient sum of `version` (its history slot). step does it for
        its own slice; a transport that steps a shard in pieces calls it on the whole."""
        np.copyto(self._slot(version), self.gsum)

    def delay_stats(self) -> dict[str, float]:
        """This object's updates, their mean backlog in versions, and how many fetches were
        older than the history (capped)."""
        mean = self.backlog_versions / self.updates if self.updates else 0.0
        return {"updates": self.updates, "backlog_mean": mean, "capped": self.capped}

    def state(self) -> dict[str, np.ndarray]:
        """The live state arrays (not copies): gsum, z, zmax and the history slots."""
        state = {"gsum": self.gsum, "z": self.z, "zmax": self.zmax}
        for k in range(self.history):
            state[self._slot_name(k)] = getattr(self, self._slot_name(k))
        return state

    def saved_state(self) -> dict[str, np.ndarray]:
        """What a checkpoint keeps: gsum, z and zmax (live arrays). Not the history: a
        resumed run's replicas fetch afresh, so no push refers to a version before it."""
        return {"gsum": self.gsum, "z": self.z, "zmax": self.zmax}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore state saved by saved_state() (or state(); the history is not read):
        checks shapes and values, copies, and fills every history slot with gsum, so a
        push that fetched after the restore sees no backlog before it."""
        names = {"gsum", "z", "zmax"}
        if not isinstance(state, dict):
            raise TypeError(f"AdaRevision state must be a dict of arrays, "
                            f"got {type(state).__name__}")
        if not names <= set(state):
            raise ValueError(f"AdaRevision state must have keys {sorted(names)}, "
                             f"got {sorted(map(str, state))}")
        for name in sorted(names):
            value = state[name]
            if not isinstance(value, np.ndarray) or not np.issubdtype(value.dtype, np.floating):
                raise TypeError(f"AdaRevision state {name!r} must be a floating-point numpy "
                                "array")
            if value.shape != (self.size,):
                raise ValueError(f"AdaRevision state {name!r} must have shape ({self.size},), "
                                 f"got {value.shape}")
            if not np.all(np.isfinite(value)):
                raise ValueError(f"AdaRevision state {name!r} must be finite")
        if np.any(state["zmax"] < 0) or np.any(state["zmax"] < state["z"]):
            raise ValueError("AdaRevision state 'zmax' must be non-negative and at least z")
        for name in sorted(names):
            np.copyto(getattr(self, name), state[name], casting="same_kind")
        for k in range(self.history):
            np.copyto(getattr(self, self._slot_name(k)), self.gsum)


def _check_fraction(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


def _load_arrays(name: str, optimizer: object, state: dict[str, np.ndarray],
                 names: set[str]) -> None:
    """Check `state` holds finite float arrays of the optimizer's size under `names`, and
    copy them into the optimizer's attributes of those names."""
    _check_state_keys(name, state, names)
    size = optimizer.size  # type: ignore[attr-defined]
    for key in sorted(names):
        value = state[key]
        if not isinstance(value, np.ndarray) or not np.issubdtype(value.dtype, np.floating):
            raise TypeError(f"{name} state {key!r} must be a floating-point numpy array")
        if value.shape != (size,):
            raise ValueError(f"{name} state {key!r} must have shape ({size},), "
                             f"got {value.shape}")
        if not np.all(np.isfinite(value)):
            raise ValueError(f"{name} state {key!r} must be finite")
    for key in sorted(names):
        np.copyto(getattr(optimizer, key), state[key], casting="same_kind")


class DCASGD(_Scheduled):
    """Delay-compensated asynchronous SGD (Zheng, Meng, Wang, Chen, Yu, Ma and Liu,
    "Asynchronous Stochastic Gradient Descent with Delay Compensation", ICML 2017), in the
    approximation MXNet ships as `optimizer.DCASGD`. The paper corrects a stale gradient
    toward the current parameters with a cheap diagonal Hessian approximation,
    g + lambda * g * g * (w_now - w_fetched), keeping the parameters each worker fetched (a
    copy of the slice per replica). The approximation takes w_fetched to be the parameters
    before the slice's last update, so w_now - w_fetched is that update's step d, one
    vector for every replica:

        g_c = g + lambda * g * g * d
        d   = -lr * g_c
        w  += d

    d starts at 0, so the first update is plain SGD. It understates an update's delay
    when more than one update came between its fetch and its application (the paper's
    version would need a copy per replica: not built). Per coordinate, element-wise."""

    elementwise = True

    def __init__(self, size: int, learning_rate: float | Schedule,
                 dc_lambda: float = 0.04) -> None:
        self.size = _check_size(size)
        self.schedule = _schedule(learning_rate)
        if (isinstance(dc_lambda, bool) or not isinstance(dc_lambda, (int, float))
                or not math.isfinite(dc_lambda) or dc_lambda < 0):
            raise ValueError(f"dc_lambda must be a non-negative finite number, got "
                             f"{dc_lambda!r}")
        self.dc_lambda = float(dc_lambda)
        self.last_step = np.zeros(self.size, np.float32)

    def step(self, params: np.ndarray, grad: np.ndarray,
             copy: np.ndarray | None = None, *, update: int | None = None) -> None:
        """As SGD.step, the gradient compensated with the last update's step."""
        compensated = grad * grad
        compensated *= self.last_step
        compensated *= np.float32(self.dc_lambda)
        compensated += grad
        np.multiply(compensated, np.float32(-self.rate(update)), out=self.last_step)
        params += self.last_step
        if copy is not None:
            np.copyto(copy, params)

    def state(self) -> dict[str, np.ndarray]:
        """The live state arrays (not copies): {"last_step": the last update's step}."""
        return {"last_step": self.last_step}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore state saved by state(); checks shape and values, copies."""
        _load_arrays("DCASGD", self, state, {"last_step"})


class Momentum(_Scheduled):
    """SGD with momentum, as torch.optim.SGD(lr, momentum, nesterov) with no dampening or
    weight decay: buf = momentum * buf + g; param -= lr * buf (Nesterov: lr * (g + momentum
    * buf)). buf starts at zero, so the first update is torch's (buf = g)."""

    elementwise = True

    def __init__(self, size: int, learning_rate: float | Schedule, momentum: float = 0.9,
                 nesterov: bool = False) -> None:
        self.size = _check_size(size)
        self.schedule = _schedule(learning_rate)
        self.momentum = _check_fraction("momentum", momentum)
        self.nesterov = bool(nesterov)
        self.buf = np.zeros(self.size, np.float32)

    def step(self, params: np.ndarray, grad: np.ndarray,
             copy: np.ndarray | None = None, *, update: int | None = None) -> None:
        """As Adagrad.step."""
        kernels.momentum_update(params, self.buf, grad, self.rate(update), self.momentum,
                                self.nesterov, copy)

    def state(self) -> dict[str, np.ndarray]:
        """The live state arrays (not copies): {"buf": the momentum buffer}."""
        return {"buf": self.buf}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore state saved by state(); checks shape and values, copies."""
        _load_arrays("Momentum", self, state, {"buf"})


BLOCK_VALUES = 1 << 20
"""Values DelayedNesterov updates per pass (4 MB of float32 temporaries at most)."""


class DelayedNesterov(ShardRule):
    """Delayed Nesterov momentum, the outer optimizer of asynchronous Local-SGD (Liu et al.
    2024, "Asynchronous Local-SGD Training for Language Modeling", arXiv 2401.09135, its
    "DN" rule), for deltas that land one at a time on a parameter server.

    Each delta g moves the parameters at once, without momentum: param -= lr * g / period.
    The momentum moves only every `period` deltas, on their mean:

        pending += g                                 (every delta)
        at every period-th delta:
            buf = momentum * buf + pending / period
            param -= lr * momentum * buf;  pending = 0

    Over `period` deltas the parameters move by lr * (mean + momentum * buf): one Nesterov
    step (Momentum(nesterov=True)) on their mean, so a stale delta never gets momentum of
    its own. `update` (deltas applied before) and `pushes` (deltas summed into this grad,
    on the RMA transport's folds) place the milestones, so a resumed shard keeps them; a
    fold that runs past a milestone puts all its deltas in the block that ends there.
    State: buf and pending. The rate is constant (no schedule)."""

    def __init__(self, size: int, learning_rate: float, momentum: float,
                 period: int) -> None:
        self.size = _check_size(size)
        self.learning_rate = _check_learning_rate(learning_rate)
        self.momentum = _check_fraction("momentum", momentum)
        self.period = _check_count("period", period, 1)
        self.buf = np.zeros(self.size, np.float32)
        self.pending = np.zeros(self.size, np.float32)

    def step(self, params: np.ndarray, grad: np.ndarray, copy: np.ndarray | None = None,
             *, update: int | None = None, pushes: int = 1) -> None:
        """Apply grad, the sum of `pushes` deltas, after `update` deltas (required)."""
        if update is None:
            raise ValueError("DelayedNesterov.step needs update= (the deltas applied "
                             "before): its momentum moves every period-th delta")
        pushes = _check_count("pushes", pushes, 1)
        milestone = (update + pushes) // self.period > update // self.period
        each = np.float32(self.learning_rate / self.period)
        mean, step = np.float32(1.0 / self.period), \
            np.float32(self.learning_rate * self.momentum)
        # In blocks: a shard's slice can be large, and numpy's temporaries are block-sized.
        for lo in range(0, self.size, BLOCK_VALUES):
            hi = min(lo + BLOCK_VALUES, self.size)
            p, g, buf, pending = params[lo:hi], grad[lo:hi], self.buf[lo:hi], \
                self.pending[lo:hi]
            p -= each * g
            pending += g
            if milestone:
                buf *= np.float32(self.momentum)
                buf += mean * pending
                p -= step * buf
                pending.fill(0)
        if copy is not None:
            np.copyto(copy, params)

    def apply(self, params: np.ndarray, grad: np.ndarray, info: StepInfo,
              copy: np.ndarray | None = None) -> None:
        """step() with the pushes the grad sums (StepInfo.pushes)."""
        self.step(params, grad, copy, update=info.update, pushes=info.pushes)

    def state(self) -> dict[str, np.ndarray]:
        """The live state arrays (not copies): the momentum buf, and pending, the sum of
        the deltas since the momentum last moved."""
        return {"buf": self.buf, "pending": self.pending}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore state saved by state(); checks shapes and values, copies."""
        _load_arrays("DelayedNesterov", self, state, {"buf", "pending"})


class Adam(_Scheduled):
    """Adam (Kingma and Ba 2015), as torch.optim.Adam with no weight decay or amsgrad:
    m and v are the moving averages of g and g**2, bias-corrected by the update's number.
    It needs that number: step(update=n) is update n + 1 of the run (a parameter-server
    shard counts the gradients it applied, a trainer its steps, both in checkpoints)."""

    elementwise = True

    def __init__(self, size: int, learning_rate: float | Schedule, beta1: float = 0.9,
                 beta2: float = 0.999, eps: float = 1e-8) -> None:
        self.size = _check_size(size)
        self.schedule = _schedule(learning_rate)
        self.beta1 = _check_fraction("beta1", beta1)
        self.beta2 = _check_fraction("beta2", beta2)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) \
                or not math.isfinite(eps) or eps <= 0:
            raise ValueError(f"eps must be a positive finite number, got {eps!r}")
        self.eps = float(eps)
        self.exp_avg = np.zeros(self.size, np.float32)
        self.exp_avg_sq = np.zeros(self.size, np.float32)

    def step(self, params: np.ndarray, grad: np.ndarray,
             copy: np.ndarray | None = None, *, update: int | None = None) -> None:
        """As Adagrad.step, but `update` is required (the bias correction counts it)."""
        if update is None:
            raise ValueError("Adam.step needs update= (the number of updates applied "
                             "before): its bias correction counts them")
        kernels.adam_update(params, self.exp_avg, self.exp_avg_sq, grad, self.rate(update),
                            self.beta1, self.beta2, self.eps, update + 1, copy)

    def state(self) -> dict[str, np.ndarray]:
        """The live state arrays (not copies): the moving averages exp_avg, exp_avg_sq."""
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore state saved by state(); checks shapes and values, copies."""
        _load_arrays("Adam", self, state, {"exp_avg", "exp_avg_sq"})
        if np.any(self.exp_avg_sq < 0):
            raise ValueError("Adam state 'exp_avg_sq' must be non-negative")


UPDATES = ("adagrad", "sgd", "adarevision", "momentum", "adam", "dcasgd")


def optimizer_for(update: str, learning_rate: float | Schedule, size: int,
                  **hyper: Any) -> Adagrad | SGD | AdaRevision | Momentum | Adam:
    """The optimizer config.optimizer.update names, over `size` parameters, at a fixed
    rate or on a Schedule (config.build_schedule); `hyper`: its own settings (momentum,
    nesterov; beta1, beta2)."""
    if update not in UPDATES:
        raise ValueError(f"update must be one of {', '.join(UPDATES)}, got {update!r}")
    if update == "adarevision":
        return AdaRevision(size, learning_rate, **hyper)
    if update == "dcasgd":
        return DCASGD(size, learning_rate, **hyper)
    if update == "momentum":
        return Momentum(size, learning_rate, **hyper)
    if update == "adam":
        return Adam(size, learning_rate, **hyper)
    return make_optimizer(update == "adagrad", learning_rate, size)


def make_optimizer(adagrad: bool, learning_rate: float | Schedule,
                   size: int) -> Adagrad | SGD:
    """Adagrad over `size` parameters if adagrad, else SGD (which needs no size); at a
    fixed rate or on a Schedule."""
    if not isinstance(adagrad, (bool, np.bool_)):
        raise TypeError(f"adagrad must be True or False, got {type(adagrad).__name__}")
    if adagrad:
        return Adagrad(size, learning_rate)
    _check_size(size)
    return SGD(learning_rate)
