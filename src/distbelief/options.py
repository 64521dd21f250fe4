"""How a configuration key is declared: its rule (what values it takes), default, one-line
help and whether it is in the config hash, as a field of an options dataclass.

Each algorithm declares the [optimizer] keys it owns as a subclass of `Options` in its
package (algorithms/downpour/options.py, ...; the registry names it), beside the shared
keys that config.py declares the same way. config builds the schema, the checks, --help,
`distbelief help ALGORITHM` and docs/configuration.md's key tables from these fields, so a
key is written once. This module imports nothing of distbelief but errors, so config can
read every algorithm's options without importing a trainer (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

HASH_POLICIES = ("always", "unless default", "never")
"""Whether a key is in the config hash: always; only when it is not its default (a key
added later, so that earlier runs keep their hash); never (it changes how a result is
computed, not what is trained: a resumed run may change it)."""


@dataclass(frozen=True)
class Rule:
    """Checks one key. `convert` returns the clean value or None when the value is wrong;
    `describe` says what is allowed (a callable when that changes, as the algorithms do)."""

    convert: Callable[[Any], Any]
    describe: str | Callable[[], str]

    @property
    def allowed(self) -> str:
        return self.describe() if callable(self.describe) else self.describe


def integer(minimum: int) -> Rule:
    def convert(v: Any) -> Any:
        # bool is an int in Python; `true` is never a count.
        if isinstance(v, int) and not isinstance(v, bool) and v >= minimum:
            return v
        return None
    return Rule(convert, f"an integer >= {minimum}")


def number(minimum: float, strict: bool = False, maximum: float | None = None) -> Rule:
    def convert(v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return None
        v = float(v)
        if v < minimum or (strict and v == minimum) or (maximum is not None and v > maximum):
            return None
        return v
    low = f"> {minimum:g}" if strict else f">= {minimum:g}"
    high = f" and <= {maximum:g}" if maximum is not None else ""
    return Rule(convert, f"a number {low}{high}")


def boolean() -> Rule:
    return Rule(lambda v: v if isinstance(v, bool) else None, "true or false")


def text() -> Rule:
    return Rule(lambda v: v if isinstance(v, str) and v else None, "a non-empty string")


def choice(options: Iterable[str] | Callable[[], Iterable[str]]) -> Rule:
    """One of `options` (or of what the callable returns when a value is checked)."""
    def current() -> tuple[str, ...]:
        return tuple(options() if callable(options) else options)
    if not callable(options):
        options = tuple(options)
    return Rule(lambda v: v if v in current() else None,
                lambda: "one of " + ", ".join(repr(o) for o in current()))


def option(default: Any, rule: Rule, help: str, hashed: str = "always",
           shown: str | None = None) -> Any:
    """A field of an options dataclass: one configuration key. `help` is one sentence
    (Markdown: `code` and [links](page.md) are kept in the docs, plain in the terminal);
    `shown` is the default as the tables print it, when not the value itself."""
    if hashed not in HASH_POLICIES:
        raise ValueError(f"hashed = {hashed!r}: expected one of {HASH_POLICIES}")
    return dataclasses.field(default=default, metadata={
        "rule": rule, "help": help, "hashed": hashed, "shown": shown})


@dataclass(frozen=True)
class Key:
    """One key, as `keys()` reads it from an options dataclass."""

    name: str
    rule: Rule
    default: Any
    help: str
    hashed: str
    shown: str | None = None

    def shown_default(self) -> str:
        """The default as a TOML reader would write it ("unset" for None)."""
        if self.shown is not None:
            return self.shown
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return "true" if self.default else "false"
        if isinstance(self.default, str):
            return f'"{self.default}"'
        return f"{self.default:g}" if isinstance(self.default, float) else str(self.default)


def keys(options: type) -> tuple[Key, ...]:
    """The keys an options dataclass declares, in declaration order."""
    return tuple(Key(f.name, f.metadata["rule"], f.default, f.metadata["help"],
                     f.metadata["hashed"], f.metadata["shown"])
                 for f in dataclasses.fields(options) if "rule" in f.metadata)


@dataclass(frozen=True)
class Options:
    """The [optimizer] keys one algorithm owns (none here: the base of every algorithm's).

    A subclass declares its keys as `option(...)` fields, what it is in `description`, and
    overrides `checked` for checks that read more than one key or another section. Setting
    an algorithm's key while another algorithm is chosen is an error (config says so),
    unless `ignored_by_others`.
    """

    description: ClassVar[str] = ""
    """A paragraph for `distbelief help ALGORITHM`: what the algorithm does with its keys."""
    docs: ClassVar[str] = ""
    """Its docs page, e.g. "docs/downpour.md"."""
    no_learning_rate: ClassVar[str | None] = None
    """Why the algorithm has no learning rate (None: it has one). Then the schedule's keys
    and the update rules with settings of their own are errors."""
    shard_updates: ClassVar[tuple[str, ...]] = ()
    """optimizer.update rules only some algorithms run (on shards that know each push's
    delay), this one among them."""
    refused_because: ClassVar[Mapping[str, str]] = {}
    """Why another algorithm refuses one of these keys, where its name alone does not say
    (config adds it to the error)."""
    ignored_by_others: ClassVar[bool] = False
    """Another algorithm ignores these keys instead of refusing them (Sandblaster's, as
    they always were: a file written for it also runs other algorithms, in `compare`)."""
    batch_may_exceed_data: ClassVar[bool] = False
    """data.batch_size may be larger than the training set (then it is the whole set)."""

    def checked(self, given: Mapping[str, Any], settings: Mapping[str, Mapping[str, Any]],
                where: str) -> Options:
        """These options checked against each other and the rest of the configuration
        (`settings`: every section's checked values; `given`: the [optimizer] table as
        written), with the keys whose default depends on others resolved. Raises
        ConfigError naming `optimizer.key`, the value and what is allowed."""
        return self

    def unhashed(self) -> set[str]:
        """The keys left out of the config hash with these values."""
        out = set()
        for key in keys(type(self)):
            value = getattr(self, key.name)
            if key.hashed == "never" or (key.hashed == "unless default"
                                         and value == key.default):
                out.add(key.name)
        return out

    def run_name(self) -> str | None:
        """The name a run of these options goes by in its summary and report, when not
        the algorithm's (averaging with elastic_alpha is "easgd")."""
        return None
