"""Build the Cython kernels in pyx/ into the distbelief package.

Compiler directives are set here once. DISTBELIEF_DEBUG_KERNELS=1 turns bounds and
wraparound checks back on for a debug build. The extension records a hash of its sources,
so that an editable checkout whose .pyx changed without a rebuild is detected at import.
"""
import hashlib
import os
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = Path(__file__).resolve().parent
PYX_DIR = HERE / "pyx"


def source_hash() -> str:
    """sha256 over pyx/*.pyx and pyx/*.pxd, in name order (kernels.py recomputes it)."""
    digest = hashlib.sha256()
    for path in sorted([*PYX_DIR.glob("*.pyx"), *PYX_DIR.glob("*.pxd")]):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


debug = os.environ.get("DISTBELIEF_DEBUG_KERNELS", "0") == "1"
directives = {
    "language_level": 3,
    "boundscheck": debug,
    "wraparound": debug,
    "cdivision": True,
    "initializedcheck": debug,
}
extensions = [
    Extension(
        "distbelief.model._kernels",
        sources=[str(Path("pyx") / "_kernels.pyx")],
        include_dirs=[numpy.get_include()],
        define_macros=[
            ("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
            ("DISTBELIEF_SOURCE_HASH", f'"{source_hash()}"'),
        ],
        # -fno-math-errno lets gcc vectorise sqrtf in the Adagrad loop; -fno-trapping-math
        # lets it if-convert AdaRevision's max (a compare-and-select; no kernel reads the
        # floating-point exception flags). No fast-math, so results stay IEEE and match the
        # numpy references bit for bit where they should.
        extra_compile_args=["-O3", "-fno-math-errno", "-fno-trapping-math"],
    )
]

setup(ext_modules=cythonize(extensions, compiler_directives=directives))
