"""Subnormal floats are flushed to zero (issue 31 item 1): the command line sets FTZ and DAZ
before numpy starts its BLAS, so the BLAS worker threads flush too; run.flush_subnormals =
false turns it off in the training thread."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.mpi_jobs import job_env

from distbelief.algorithms import launch
from distbelief.config import config_from_dict
from distbelief.data.converters import make_synthetic
from distbelief.model import kernels

# 1e-22 squared is 1e-44: each product is subnormal, and so is their sum over 512 terms.
GEMM = """
import sys
from distbelief import cli  # importing the command line loads no numpy
from distbelief.model import subnormals  # what cli.main calls first
if sys.argv[1] == "cli":
    subnormals.flush_from_the_start()
import numpy as np
a = np.full((512, 512), 1e-22, np.float32)
print(float((a @ a).max()), float((np.float32(1e-39) * np.float32(2))))
"""


@pytest.mark.parametrize("threads", ["1", "2"])
def test_the_command_line_flushes_in_every_blas_thread(threads: str) -> None:
    env = {**job_env(), "OPENBLAS_NUM_THREADS": threads, "OMP_NUM_THREADS": threads}

    def run(mode: str) -> list[float]:
        out = subprocess.run([sys.executable, "-c", GEMM, mode], capture_output=True,
                             text=True, env=env, timeout=60, check=True).stdout
        return [float(v) for v in out.split()]

    assert run("cli") == [0.0, 0.0]
    gemm, scaled = run("plain")  # numpy alone keeps them
    assert 0 < gemm < 1.2e-38 and 0 < scaled < 1.2e-38


def test_the_mode_is_per_thread_and_can_be_turned_off() -> None:
    before = kernels.flushes_subnormals()
    try:
        assert kernels.flush_subnormals(True)
        assert kernels.flushes_subnormals()
        assert np.float32(1e-39) * np.float32(2) == 0
        assert kernels.flush_subnormals(False)
        assert not kernels.flushes_subnormals()
        assert np.float32(1e-39) * np.float32(2) > 0
    finally:
        kernels.flush_subnormals(before)


def test_run_flush_subnormals_false_turns_it_off_for_the_training(tmp_path: Path) -> None:
    make_synthetic(tmp_path / "d.h5", n_train=200, n_test=50, input_shape=(4,), num_classes=2)

    def config(flush: bool):
        return config_from_dict({
            "model": {"layers": [{"type": "dense", "units": 2, "activation": "softmax"}]},
            "data": {"path": str(tmp_path / "d.h5"), "batch_size": 10},
            "optimizer": {"algorithm": "sgd"},
            "run": {"max_steps": 5, "out_dir": str(tmp_path / f"run-{flush}"),
                    "flush_subnormals": flush}})

    before = kernels.flushes_subnormals()
    try:
        kernels.flush_subnormals(True)
        launch.train(config(True), None, "auto")
        assert kernels.flushes_subnormals()
        launch.train(config(False), None, "auto")
        assert not kernels.flushes_subnormals()
    finally:
        kernels.flush_subnormals(before)
