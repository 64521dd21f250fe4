"""Set the number of BLAS threads at run time (the `run.threads` setting).

numpy's dense layers are BLAS GEMMs, so the BLAS thread count decides how many cores one
process uses. Environment variables (OPENBLAS_NUM_THREADS) only work before numpy is
imported; configuration lives in the TOML file, so we call OpenBLAS's own setter instead.
numpy wheels ship scipy-openblas64 (symbols with a `scipy_` prefix and a `64_` suffix); a
numpy built against a system OpenBLAS exports the plain names. The library is found among
the shared objects loaded into this process, so it is the one numpy really uses.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path

import numpy as np

# (setter, getter) name pairs, most specific first.
_SYMBOLS = (
    ("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
    ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
    ("openblas_set_num_threads", "openblas_get_num_threads"),
)


def _loaded_libraries() -> list[str]:
    """Paths of the shared objects mapped into this process whose name mentions blas."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if "blas" in Path(path).name.lower() and path not in paths:
                    paths.append(path)
    except OSError:
        pass  # not Linux: fall back to numpy's bundled-libraries folder below
    libs_dir = Path(np.__file__).resolve().parent.parent / "numpy.libs"
    paths += [str(p) for p in sorted(libs_dir.glob("*blas*")) if str(p) not in paths]
    return paths


@functools.cache
def _blas_functions() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None:
    """(set_num_threads, get_num_threads) of the loaded OpenBLAS, or None if none is found."""
    for path in _loaded_libraries():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for set_name, get_name in _SYMBOLS:
            setter = getattr(lib, set_name, None)
            getter = getattr(lib, get_name, None)
            if setter is not None and getter is not None:
                setter.argtypes, setter.restype = [ctypes.c_int], None
                getter.argtypes, getter.restype = [], ctypes.c_int
                return setter, getter
    return None


def get_blas_threads() -> int | None:
    """The BLAS thread count now in effect, or None when no OpenBLAS was found."""
    functions = _blas_functions()
    return None if functions is None else int(functions[1]())


def set_blas_threads(n: int) -> bool:
    """Use `n` BLAS threads from now on (n >= 1). Returns False, after one warning on
    stderr, when no OpenBLAS is found (another BLAS: the run goes on with its default)."""
    if n < 1:
        raise ValueError(f"thread count must be >= 1, got {n}")
    functions = _blas_functions()
    if functions is None:
        _warn_not_found()
        return False
    functions[0](int(n))
    return True


def apply_thread_setting(threads: int) -> None:
    """The `run.threads` setting: 0 leaves the BLAS default alone, N sets N threads."""
    if threads > 0:
        set_blas_threads(threads)


@functools.cache
def _warn_not_found() -> None:
    # cached: a warning per call would flood the log of a multi-rank job.
    print("distbelief: warning: no OpenBLAS found in this process; run.threads is "
          "ignored and BLAS uses its default thread count", file=sys.stderr)
