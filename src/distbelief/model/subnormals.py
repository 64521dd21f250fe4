"""Subnormal floats flushed to zero from a process's start: before numpy loads its BLAS,
whose worker threads inherit the mode when they are created. The command line calls it
first; it imports only the compiled kernels, which import no numpy."""

from __future__ import annotations

import sys


def flush_from_the_start() -> None:
    """Subnormal floats flushed to zero in this thread before numpy loads its BLAS, whose
    worker threads inherit the mode when they are created (run.flush_subnormals = false
    turns it off again in the training thread: distbelief.model.kernels). Saturated
    gradients full of subnormals made the speech model's steps 16-27x slower."""
    if "numpy" in sys.modules:
        return  # too late for the BLAS threads; a caller that imported numpy chose its mode
    try:
        from distbelief.model import _kernels  # compiled; imports no numpy

        _kernels.flush_subnormals(True)
    except (ImportError, AttributeError):
        pass  # no build, or a stale one: kernels.py says how to rebuild when it is needed
