"""The fixtures and hooks of the test suite. What tests call to launch the command line or
MPI jobs is in helpers/mpi_jobs.py; the small model's configuration in helpers/configs.py."""

from __future__ import annotations

import compileall
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.configs import small_config_text
from helpers.mpi_jobs import REPO
from helpers.torch_reference import import_torch

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")

@pytest.fixture(name="torch")
def torch_fixture():
    """PyTorch for a test that compares with it (such tests are marked `torch`)."""
    torch = import_torch()
    torch.set_num_threads(1)
    return torch


# Debian packages a few tests need (marked `system`), each asked for by a fixture below:
# the README's test command runs on a fresh machine without them, and those tests skip,
# naming the package. CI installs them in a later step and sets DISTBELIEF_REQUIRE_SYSTEM=1,
# which turns the skip into a failure.
REQUIRE_SYSTEM = "DISTBELIEF_REQUIRE_SYSTEM"
SYSTEM_FIXTURES = ("shellcheck", "h5ls", "fashion_mnist_dir")


def _need_system_package(package: str, what: str) -> None:
    reason = f"needs {what}, from the Debian package {package} (apt-get install {package})"
    if os.environ.get(REQUIRE_SYSTEM) == "1":
        pytest.fail(f"{REQUIRE_SYSTEM}=1 but this test {reason}", pytrace=False)
    pytest.skip(reason)


def _system_tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        _need_system_package(package, f"the `{name}` command")
    return path


@pytest.fixture
def shellcheck() -> str:
    """The path of shellcheck (the sbatch scripts are linted with it)."""
    return _system_tool("shellcheck", "shellcheck")


@pytest.fixture
def h5ls() -> str:
    """The path of HDF5's h5ls (checkpoints must be readable by the standard tools)."""
    return _system_tool("h5ls", "hdf5-tools")


@pytest.fixture
def fashion_mnist_dir() -> Path:
    """The folder of Debian's Fashion-MNIST IDX files (the tests on real data)."""
    if not FASHION_MNIST_DIR.is_dir():
        _need_system_package("dataset-fashion-mnist", f"the real data in {FASHION_MNIST_DIR}")
    return FASHION_MNIST_DIR


def pytest_configure(config: pytest.Config) -> None:
    # Every rank of every MPI job imports the package; where PYTHONDONTWRITEBYTECODE is set
    # (this machine, CI's) nothing is cached, and each process compiled its ~80 modules
    # again: 0.7-0.9 s of CPU per process, about a third of a short 3-rank job's time.
    # Compiled once here, they are read by every process after (the variable only stops
    # writing).
    compileall.compile_dir(REPO / "src", quiet=1)
    compileall.compile_dir(REPO / "tests" / "helpers", quiet=1)
    from helpers.matrix import MatrixSample
    config.pluginmanager.register(MatrixSample(REPO), "matrix-sample")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A test that asks for the torch fixture is a torch test, and one that asks for a
    # system package's fixture is a system test: `-m torch` and `-m system` select exactly
    # these, with no marker to forget.
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if "torch" in fixtures:
            item.add_marker(pytest.mark.torch)
        if any(name in fixtures for name in SYSTEM_FIXTURES):
            item.add_marker(pytest.mark.system)


SHM_REPORT = "DISTBELIEF_SHM_REPORT"
"""A file: each test that leaves new files in /dev/shm appends a line naming them there
(finding which tests leave segments behind; CI's shm_check says only that some did)."""


@pytest.fixture(autouse=True)
def _shm_report(request: pytest.FixtureRequest) -> Iterator[None]:
    report = os.environ.get(SHM_REPORT)
    if not report:
        yield
        return
    before = set(os.listdir("/dev/shm"))
    yield
    deadline = time.monotonic() + 3.0  # a guardian may still be removing them
    while True:
        left = sorted(set(os.listdir("/dev/shm")) - before)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if left:
        with open(report, "a", encoding="utf-8") as f:
            f.write(f"{request.node.nodeid}: {' '.join(left)}\n")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """A failed test's report ends with the machine's load and its busiest processes, so a
    failure on a starved machine says so (helpers.processes.machine_load)."""
    report = yield
    if report.failed and call.when == "call":
        from helpers.processes import machine_load
        report.sections.append(("machine at the failure", machine_load()))
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The test process itself starts MPI when a test module imports mpi4py.MPI, and an
    Open MPI singleton leaves its 16 MB sm_segment file in /dev/shm at exit (seen: one per
    run of the suite). Unlink the /dev/shm files this process maps: they are its own, and a
    mapping outlives the unlink until the process exits."""
    if "mpi4py.MPI" not in sys.modules:
        return
    from distbelief.runtime.launching.guardian import shm_files_mapped_by

    for path in shm_files_mapped_by(os.getpid()):
        try:
            os.unlink(path)
        except OSError:
            pass


@pytest.fixture(scope="session")
def small_config() -> Any:
    """small_config_text: the small model's TOML, with overrides."""
    return small_config_text


@pytest.fixture(scope="session")
def synthetic_folder(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A factory: make(name, {file: text}, **synthetic) gives a new folder holding synth.h5
    (data.converters.make_synthetic: by default 4000 training rows, 500 test rows of 16
    features, 4 classes, seed 3) and the given configuration files."""
    from distbelief.data.converters import make_synthetic

    def make(name: str, configs: dict[str, str] | None = None, *, n_train: int = 4000,
             n_test: int = 500, input_shape: tuple[int, ...] = (16,), num_classes: int = 4,
             seed: int = 3) -> Path:
        folder = tmp_path_factory.mktemp(name)
        make_synthetic(folder / "synth.h5", n_train=n_train, n_test=n_test,
                       input_shape=input_shape, num_classes=num_classes, seed=seed)
        for file, text in (configs or {}).items():
            (folder / file).write_text(text)
        return folder

    return make
