"""Whether a run has collapsed: its training loss went non-finite, exploded, or sat at
chance.

A classifier that has learnt nothing predicts every class alike, and its cross-entropy is
log(number of classes), "chance" (2.3026 for ten classes). A run whose recent mean loss
stays at or above that for a whole window has collapsed: usually the learning rate is too
high for the replica count (asynchronous updates add up), and a warm start or a warmup is
the remedy. A loss that explodes but stays finite (the last few lines' mean at twice
chance, or twice the run's first loss if that was higher) is reported at once, without
waiting for the window: it is already past chance, and a run whose window is minutes long
(an 8192-way softmax) would otherwise train on for minutes unwarned.
The RunRecorder feeds every training line to a CollapseWatch, prints the
warning once, and keeps it in summary.json; run.stop_on_collapse ends the run on it.
The argument and the figures are in docs/configuration.md ("When a run collapses").
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

AT_CHANCE = 0.98
"""A window's mean loss at or above this fraction of log(classes) counts as chance: a run
that learns anything at all leaves it within seconds."""
MIN_LINES = 5
"""Training lines a window needs before it can be judged (they come every ~0.5 s); also
the recent lines an explosion is judged on."""
EXPLODED = 2.0
"""The recent lines' mean at this many times chance (or the first loss, if higher) is an
explosion: a softmax at chance is already as wrong as a uniform guess, twice that is
confidently wrong."""
CAUSES = ("a learning rate too high for the model or for this many replicas (their "
          "asynchronous updates add up: try a lower optimizer.learning_rate), or a run "
          "that needs a warm start (optimizer.warm_start_steps) or a learning-rate warmup "
          "(optimizer.warmup_steps)")


@dataclass(frozen=True)
class Collapse:
    """What a CollapseWatch found: `kind` "non-finite", "exploded" or "at chance", when (`time`,
    seconds into the run; `step`) and the loss that showed it."""

    kind: str
    time: float
    step: int
    loss: float
    chance: float
    window_seconds: float

    def describe(self) -> str:
        """One line for a person: what happened and its likely causes."""
        if self.kind == "non-finite":
            what = f"the training loss became {self.loss} at step {self.step:,d}"
        elif self.kind == "exploded":
            what = (f"the training loss exploded to a mean of {self.loss:.4f} over its "
                    f"last {MIN_LINES} lines, up to step {self.step:,d} (chance, the log of "
                    f"the class count, is {self.chance:.4f})")
        else:
            what = (f"the training loss stayed at or above chance for "
                    f"{self.window_seconds:g}s, up to step {self.step:,d} (mean "
                    f"{self.loss:.4f}; chance, the log of the class count, is "
                    f"{self.chance:.4f})")
        return f"the run collapsed: {what}. Likely causes: {CAUSES}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "time": self.time, "step": self.step,
                "loss": self.loss if math.isfinite(self.loss) else None,
                "chance_loss": self.chance, "window_seconds": self.window_seconds,
                "likely_causes": CAUSES}


class CollapseWatch:
    """Judges a run's training losses, line by line (see the module docstring)."""

    def __init__(self, num_classes: int, window_seconds: float) -> None:
        self.chance = math.log(num_classes)
        self.window_seconds = float(window_seconds)
        self.found: Collapse | None = None
        self.recovered_at: float | None = None  # a later window left chance again
        self._window: deque[tuple[float, float]] = deque()  # (time, loss)
        self._recent: deque[float] = deque(maxlen=MIN_LINES)
        self._first_time: float | None = None
        self._first_loss = 0.0

    def add(self, time: float, step: int, loss: float) -> Collapse | None:
        """Note one training line; returns the Collapse the first time one is found."""
        if not math.isfinite(loss):
            if self.found is None or self.found.kind != "non-finite":
                self.found, self.recovered_at = Collapse(
                    "non-finite", time, step, loss, self.chance, self.window_seconds), None
                return self.found
            return None
        if self._first_time is None:
            self._first_time, self._first_loss = time, loss
        self._window.append((time, loss))
        self._recent.append(loss)
        recent = sum(self._recent) / len(self._recent)
        if self.found is None and len(self._recent) == MIN_LINES \
                and recent >= EXPLODED * max(self.chance, self._first_loss):
            self.found = Collapse("exploded", time, step, recent, self.chance,
                                  self.window_seconds)
            return self.found
        if self.found is not None and self.found.kind == "exploded" \
                and self.recovered_at is None and recent < AT_CHANCE * self.chance:
            self.recovered_at = time
        while self._window and self._window[0][0] < time - self.window_seconds:
            self._window.popleft()
        if time - self._first_time < self.window_seconds or len(self._window) < MIN_LINES:
            return None
        mean = sum(x for _, x in self._window) / len(self._window)
        at_chance = mean >= AT_CHANCE * self.chance
        if self.found is None and at_chance:
            self.found = Collapse("at chance", time, step, mean, self.chance,
                                  self.window_seconds)
            return self.found
        if self.found is not None and self.found.kind == "at chance" and not at_chance \
                and self.recovered_at is None:
            self.recovered_at = time
        return None

    def summary(self) -> dict[str, Any] | None:
        """summary.json's `collapse`: None, or what was found (and when it recovered)."""
        if self.found is None:
            return None
        return {**self.found.to_dict(), "recovered_at": self.recovered_at}
