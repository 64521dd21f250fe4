"""Set the number of BLAS threads at run time (the `run.threads` setting).

numpy's dense layers are BLAS GEMMs, so the BLAS thread count decides how many cores one
process uses. Environment variables (OPENBLAS_NUM_THREADS) only work before numpy is
imported; configuration lives in the TOML file, so we ask the loaded BLAS itself through
threadpoolctl, which knows the setters of every BLAS numpy may load (OpenBLAS with any
symbol prefix, MKL, BLIS, FlexiBLAS). It looks among the shared objects loaded into this
process, so it finds the BLAS numpy really uses.
"""

from __future__ import annotations

import functools
import sys

import numpy as np  # noqa: F401  (loads numpy's BLAS, so threadpoolctl finds it)
from threadpoolctl import ThreadpoolController


def _blas_controller() -> ThreadpoolController:
    """threadpoolctl's controller narrowed to the BLAS libraries loaded in this process."""
    # A fresh controller each call: it scans the libraries loaded now, so a BLAS loaded
    # after the first call (scipy's, say) is covered too. Calls are rare (once per run).
    return ThreadpoolController().select(user_api="blas")


def get_blas_threads() -> int | None:
    """The BLAS thread count now in effect, or None when no BLAS was found."""
    blas = _blas_controller()
    if not blas.lib_controllers:
        return None
    return int(blas.lib_controllers[0].num_threads)


def set_blas_threads(n: int) -> bool:
    """Use `n` BLAS threads from now on, process-wide (n >= 1). Returns False, after one
    warning on stderr, when no BLAS library is found (the run goes on with its default)."""
    if n < 1:
        raise ValueError(f"thread count must be >= 1, got {n}")
    blas = _blas_controller()
    if not blas.lib_controllers:
        _warn_not_found()
        return False
    # limit() returns a limiter whose restore we never call: the setting stays in force.
    blas.limit(limits=int(n))
    return True


def apply_thread_setting(threads: int) -> None:
    """The `run.threads` setting: 0 leaves the BLAS default alone, N sets N threads."""
    if threads > 0:
        set_blas_threads(threads)


@functools.cache
def _warn_not_found() -> None:
    # cached: a warning per call would flood the log of a multi-rank job.
    print("distbelief: warning: no BLAS library found in this process; run.threads is "
          "ignored and BLAS uses its default thread count", file=sys.stderr)
