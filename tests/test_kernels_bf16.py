"""The bfloat16 kernels (narrowed Downpour pushes, issue 28) against a numpy reference of
round-to-nearest-even that works by distances in float64, not by the kernel's bit trick:
every upper half of a float32 with the lower halves that decide rounding (0, 1, just
under a tie, the tie, just over it, all ones, random), so every exponent, both signs,
subnormals, infinities and NaNs (including NaNs whose payload lies only in the bits
dropped) are covered."""

from __future__ import annotations

import numpy as np
import pytest

from distbelief.model import kernels


def reference_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits: the nearer of the two bfloat16 values around x (ties to
    the even one; past the largest finite value, infinity counts as 2**128), NaN -> the
    same sign, upper payload kept, quiet bit set."""
    bits = x.view(np.uint32)
    low = (bits >> 16).astype(np.uint32)  # toward zero: bfloat16 is sign-magnitude too
    high = low + 1
    exact = (bits & 0xFFFF) == 0

    def value(h: np.ndarray) -> np.ndarray:
        v = (h.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        beyond = (h & 0x7FFF) == 0x7F80  # one past the largest finite magnitude
        return np.where(beyond, np.copysign(2.0**128, v), v)

    with np.errstate(invalid="ignore"):
        xd = x.astype(np.float64)
        d_low = np.abs(xd - value(low))
        d_high = np.abs(value(high) - xd)
    pick_high = (d_high < d_low) | ((d_high == d_low) & (low % 2 == 1))
    out = np.where(exact | ~pick_high, low, high)
    nan = np.isnan(x)
    out = np.where(nan, low | 0x40, out)
    return out.astype(np.uint16)


def every_upper_half(rng: np.random.Generator) -> np.ndarray:
    upper = np.arange(1 << 16, dtype=np.uint32) << 16
    lowers = [0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF]
    parts = [upper | lo for lo in lowers]
    parts.append(upper | rng.integers(0, 1 << 16, upper.size, dtype=np.uint32))
    return np.concatenate(parts).view(np.float32)


def test_reference_agrees_with_known_values() -> None:
    # The reference itself, on values worked out by hand: 1 + 2**-8 is a tie between 1
    # and 1 + 2**-7 (odd): even wins; 1 + 3 * 2**-8 ties 1 + 2**-7 (odd) and 1 + 2**-6.
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -1 - 2**-8,
                  np.finfo(np.float32).max, np.inf, -np.inf, -0.0, 2**-133],
                 dtype=np.float32)
    assert [hex(v) for v in reference_bf16(x)] == [
        "0x3f80", "0x3f80", "0x3f82", "0x3f81", "0xbf80", "0x7f80", "0x7f80", "0xff80",
        "0x8000", "0x1"]


def test_narrow_rounds_to_nearest_even_everywhere() -> None:
    x = every_upper_half(np.random.default_rng(0))
    out = np.full(x.size, 0xABCD, dtype=np.uint16)
    kernels.bf16_narrow(x, out)
    want = reference_bf16(x)
    wrong = np.flatnonzero(out != want)
    assert wrong.size == 0, (
        f"{wrong.size} wrong, e.g. {x.view(np.uint32)[wrong[:5]]} -> {out[wrong[:5]]}, "
        f"want {want[wrong[:5]]}")


def test_nans_stay_nans_and_infinities_stay_infinities() -> None:
    bits = np.array([0x7F800001, 0x7F80FFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0xFF800001,
                     0x7FC00000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF],
                    dtype=np.uint32)
    out = np.empty(bits.size, dtype=np.uint16)
    kernels.bf16_narrow(bits.view(np.float32), out)
    back = np.empty(bits.size, dtype=np.float32)
    kernels.bf16_widen(out, back)
    assert np.isnan(back[:6]).all()
    assert list(np.signbit(back[:6])) == [False, False, False, True, True, False]
    # the largest float32 is beyond bfloat16's largest finite value by more than half a
    # step: it rounds to infinity, as IEEE round-to-nearest does
    assert list(back[6:]) == [np.inf, -np.inf, np.inf, -np.inf]


@pytest.mark.parametrize("size, offset", [(0, 0), (1, 0), (7, 1), (8, 0), (9, 3),
                                          (1003, 5)])
def test_narrow_widen_and_round_on_any_length_and_alignment(size: int, offset: int) -> None:
    # The narrowing loop works 8 values at a time with a scalar tail, on unaligned loads.
    rng = np.random.default_rng(size)
    base = (rng.standard_normal(size + offset) * 10.0**rng.integers(-30, 30, size + offset)
            ).astype(np.float32)
    x = base[offset:]
    want = reference_bf16(x)
    out = np.zeros(size + 1, dtype=np.uint16)[1:]  # unaligned output as well
    kernels.bf16_narrow(x, out)
    assert np.array_equal(out, want)
    widened = np.full(size, np.nan, dtype=np.float32)
    kernels.bf16_widen(out, widened)
    assert np.array_equal(widened.view(np.uint32), want.astype(np.uint32) << 16)
    rounded = np.full(size, np.nan, dtype=np.float32)
    kernels.bf16_round(x, rounded)
    assert np.array_equal(rounded, widened)
    in_place = x.copy()
    kernels.bf16_round(in_place, in_place)
    assert np.array_equal(in_place, widened)
    total = np.full(size, 0.5, dtype=np.float32)
    kernels.bf16_widen(out, total, accumulate=True)
    assert np.array_equal(total, np.float32(0.5) + widened)


def test_rounding_error_is_at_most_half_a_step() -> None:
    x = np.random.default_rng(1).standard_normal(100_000).astype(np.float32)
    rounded = np.empty_like(x)
    kernels.bf16_round(x, rounded)
    relative = np.abs(rounded.astype(np.float64) - x) / np.abs(x)
    assert relative.max() <= 2.0**-8  # half a step of an 8-bit significand
    assert relative.mean() > 2.0**-12  # it does round


def test_bf16_kernels_reject_bad_input() -> None:
    x = np.zeros(4, dtype=np.float32)
    h = np.zeros(4, dtype=np.uint16)
    with pytest.raises(TypeError, match="out must have dtype uint16"):
        kernels.bf16_narrow(x, np.zeros(4, dtype=np.int16))
    with pytest.raises(TypeError, match="src must have dtype float32"):
        kernels.bf16_narrow(x.astype(np.float64), h)
    with pytest.raises(ValueError, match="out must have shape"):
        kernels.bf16_narrow(x, np.zeros(3, dtype=np.uint16))
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.bf16_widen(np.zeros(8, dtype=np.uint16)[::2], x)
    with pytest.raises(ValueError, match="out must not overlap src"):
        kernels.bf16_widen(x.view(np.uint16)[:4], x)
    with pytest.raises(ValueError, match="out must not overlap src"):
        shifted = np.zeros(5, dtype=np.float32)
        kernels.bf16_round(shifted[1:], shifted[:4])
    read_only = np.zeros(4, dtype=np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="out is an output"):
        kernels.bf16_widen(h, read_only)
