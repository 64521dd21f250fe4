"""PyTorch as the reference of the tests marked `torch` (conftest's torch fixture)."""

from __future__ import annotations

import os

import pytest

# PyTorch is the reference of a few tests (marked `torch`), never a dependency: the plain
# `pip install torch` on Linux fetches a multi-GB CUDA build, so the test extra leaves it
# out and those tests skip, naming the CPU wheel. CI's second step installs it and sets
# DISTBELIEF_REQUIRE_TORCH=1, which turns the skip into a failure.
TORCH_INSTALL = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
REQUIRE_TORCH = "DISTBELIEF_REQUIRE_TORCH"


def import_torch():
    """torch, or a skip (a failure under DISTBELIEF_REQUIRE_TORCH=1) naming the install."""
    try:
        import torch
    except ImportError:
        reason = f"needs PyTorch as the reference, not installed: {TORCH_INSTALL}"
        if os.environ.get(REQUIRE_TORCH) == "1":
            pytest.fail(f"{REQUIRE_TORCH}=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    return torch
