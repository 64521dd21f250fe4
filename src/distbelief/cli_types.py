"""The command line's argument types: argparse `type=` functions that turn a flag's text
into a value or an ArgumentTypeError naming what was expected."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_ints(text: str) -> tuple[int, ...]:
    return tuple(positive_int(part) for part in text.split(","))


def comma_ints(text: str, example: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like {example}, "
                                         f"got {text!r}") from None


def seeds(text: str) -> tuple[int, ...]:
    seeds = comma_ints(text, "0,1,2")
    if min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"seeds must be 0 or more, got {text!r}")
    return seeds


def positive_floats(text: str) -> tuple[float, ...]:
    return tuple(positive_float(part) for part in text.split(","))


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def shape(text: str) -> tuple[int, ...]:
    shape = comma_ints(text, "28,28,1")
    if len(shape) not in (1, 3) or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected H,W,C or F of positive integers, "
                                         f"got {text!r}")
    return shape


def layouts(text: str) -> tuple[tuple[int, int, int], ...]:
    """'1:2:1,2:2:1' as ((S, R, P), ...)."""
    out = []
    for part in text.split(","):
        try:
            s_, r_, p_ = (int(v) for v in part.split(":"))
        except ValueError:
            s_ = r_ = p_ = -1
        if s_ < 0 or r_ < 1 or p_ < 1:
            raise argparse.ArgumentTypeError(f"{part!r}: expected S:R:P, S >= 0 shards, "
                                             f"R >= 1 replicas, P >= 1 partitions")
        out.append((s_, r_, p_))
    return tuple(out)
