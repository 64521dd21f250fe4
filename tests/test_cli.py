"""The command line: help texts, one-line errors with exit status 2, an end-to-end train,
prepare, and how errors behave under MPI (reported once; an unhandled exception aborts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import exit_statuses
from helpers.configs import small_config_text
from helpers.mpi_jobs import REPO, every_rank_exited, run_cli, run_mpi

# The real command line, then a line with the rank's exit status (mpiexec reports one).
EXIT_STATUS = REPO / "tests" / "mpi_programs" / "cli_exit_status.py"

CONFIG = small_config_text(16, 3, data={"batch_size": 16}, optimizer=None, cluster=None,
                           run={"max_steps": 50, "eval_every_seconds": 60,
                                "progress_every_seconds": 60, "threads": None})


@pytest.fixture(scope="module")
def data_dir(synthetic_folder) -> Path:
    return synthetic_folder("cli", n_train=300, n_test=60, input_shape=(8,), num_classes=3, seed=0)


def write(folder: Path, text: str, name: str = "exp.toml") -> Path:
    (folder / name).write_text(text)
    return folder / name


def assert_user_error(result, *fragments: str) -> str:
    """Exit 2, stderr exactly one `distbelief: error:` line holding `fragments`."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("distbelief: error: ")
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


# -- help --------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, expected", [
    (["--help"], ["train", "report", "status", "prepare", "inspect"]),
    (["train", "--help"], ["CONFIG", "--set", "examples:", "run.out_dir", "--resume", "--fresh",
                           "SIGUSR1", "Ctrl-C", "distbelief status RUN_DIR",
                           "distbelief help ALGORITHM", "sandblaster  Sandblaster L-BFGS"]),
    (["help", "downpour"], ['optimizer.fetch = "own_pushes"', "optimizer.push_dtype",
                            "docs/downpour.md", "Shared keys"]),
    (["help", "optimizer"], ["optimizer.learning_rate = 0.02", "optimizer.schedule"]),
    (["help"], ["diloco", "hogwild"]),
    (["status", "--help"], ["RUN_DIR", "--json", "login", "examples:"]),
    (["inspect", "--help"], ["CHECKPOINT_OR_RUN_DIR", "sha256", "examples:"]),
    (["report", "--help"], ["RUN_DIR", "--out", "examples:", "matplotlib"]),
    (["prepare", "--help"], ["fashion-mnist", "synthetic", "examples:"]),
    (["prepare", "synthetic", "--help"], ["--train", "--shape", "--classes", "--seed"]),
    (["prepare", "fashion-mnist", "--help"], ["--src", "/usr/share/datasets/fashion-mnist"]),
])
def test_help(args: list[str], expected: list[str]) -> None:
    result = run_cli(args, timeout=60)
    assert result.returncode == 0, result.stderr
    for text in expected:
        assert text in result.stdout


def test_train_help_is_short() -> None:
    """What train does, its flags and the algorithms; the keys are `distbelief help`'s."""
    result = run_cli(["train", "--help"], timeout=60)
    assert len(result.stdout.splitlines()) < 60, result.stdout
    assert "optimizer.backup_workers" not in result.stdout


def test_help_of_an_unknown_algorithm_suggests_the_closest() -> None:
    assert_user_error(run_cli(["help", "dowpour"], timeout=60),
                      "unknown algorithm 'dowpour'; did you mean 'downpour'?")


def test_no_command_is_a_usage_error() -> None:
    result = run_cli([], timeout=60)
    assert result.returncode == 2
    assert "usage: distbelief" in result.stderr


# -- one-line errors ---------------------------------------------------------------------------


def test_missing_config(tmp_path: Path) -> None:
    assert_user_error(run_cli(["train", tmp_path / "none.toml"]), "config file not found",
                      "none.toml")


def test_unknown_key(data_dir: Path, tmp_path: Path) -> None:
    cfg = write(tmp_path, CONFIG.replace("batch_size", "batchsize"))
    assert_user_error(run_cli(["train", cfg]), "unknown key 'data.batchsize'",
                      "did you mean 'batch_size'")


def test_bad_value(data_dir: Path) -> None:
    cfg = write(data_dir, CONFIG)
    assert_user_error(run_cli(["train", cfg, "--set", "optimizer.learning_rate=-1"]),
                      "optimizer.learning_rate = -1 is invalid", "a number > 0")


def test_bad_set_syntax(data_dir: Path) -> None:
    cfg = write(data_dir, CONFIG)
    assert_user_error(run_cli(["train", cfg, "--set", "max_steps=3"]),
                      "expected section.key=value")


def test_missing_data_file(tmp_path: Path) -> None:
    cfg = write(tmp_path, CONFIG)
    assert_user_error(run_cli(["train", cfg]), "synth.h5", "no such file")


def test_corrupt_data_file(tmp_path: Path) -> None:
    (tmp_path / "synth.h5").write_bytes(os.urandom(10_000))
    cfg = write(tmp_path, CONFIG)
    assert_user_error(run_cli(["train", cfg]), "synth.h5")


def test_data_that_does_not_fit_the_model(data_dir: Path) -> None:
    cfg = write(data_dir, CONFIG.replace("units = 3", "units = 10"), "misfit.toml")
    assert_user_error(run_cli(["train", cfg]), "model.layers", "3 classes")


def test_image_layers_on_flat_data(data_dir: Path) -> None:
    text = CONFIG.replace('{ type = "dense", units = 16, activation = "relu" }',
                          '{ type = "local", kernel = 3, channels = 2, activation = "relu" }')
    cfg = write(data_dir, text, "local.toml")
    assert_user_error(run_cli(["train", cfg]), "model.layers", "local")


def test_report_of_a_folder_without_metrics(tmp_path: Path) -> None:
    assert_user_error(run_cli(["report", tmp_path, "--out", tmp_path / "r"]),
                      "metrics.jsonl")


def test_prepare_from_a_folder_without_idx_files(tmp_path: Path) -> None:
    result = run_cli(["prepare", "fashion-mnist", "--src", tmp_path, "--out",
                      tmp_path / "f.h5"])
    assert_user_error(result)
    assert not (tmp_path / "f.h5").exists()


def test_prepare_synthetic_bad_shape(tmp_path: Path) -> None:
    result = run_cli(["prepare", "synthetic", "--out", tmp_path / "s.h5", "--train", "10",
                      "--test", "5", "--shape", "28,x"])
    assert result.returncode == 2
    assert "H,W,C" in result.stderr or "integers" in result.stderr


# -- working commands ------------------------------------------------------------------------------


def test_prepare_synthetic_then_train_then_report(tmp_path: Path) -> None:
    result = run_cli(["prepare", "synthetic", "--out", tmp_path / "synth.h5", "--train", "300",
                      "--test", "60", "--shape", "8", "--classes", "3", "--seed", "4"])
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "synth.h5").is_file()

    cfg = write(tmp_path, CONFIG)
    result = run_cli(["train", cfg, "--set", "run.max_steps=30", "--set", "run.out_dir=out"],
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 30
    assert "stopped (max_steps) after 30 steps" in result.stdout
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["run"]["max_steps"] == 30

    pytest.importorskip("matplotlib")
    result = run_cli(["report", tmp_path / "out", "--out", tmp_path / "plots"])
    assert result.returncode == 0, result.stderr
    assert len(list((tmp_path / "plots").glob("*.png"))) == 3
    assert "out" in result.stdout.splitlines()[1]  # the summary table's row for the run
    # Without --out the figures go into the run's own folder, not ./report.
    result = run_cli(["report", "out"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert len(list((tmp_path / "out").glob("*.png"))) == 3
    assert not (tmp_path / "report").exists()


def test_plain_sgd_run_does_not_start_mpi(data_dir: Path) -> None:
    code = ("import sys; from distbelief.cli import main; "
            f"rc = main(['train', {str(write(data_dir, CONFIG))!r}, '--set', "
            f"'run.out_dir=\"{data_dir / 'nompi'}\"']); "
            "print('MPI', 'mpi4py.MPI' in sys.modules); sys.exit(rc)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "MPI False" in result.stdout


# -- under MPI ---------------------------------------------------------------------------------------


@pytest.mark.both_mpis
@pytest.mark.parametrize("n", [2, 3])
def test_user_error_under_mpi_is_printed_once_and_every_rank_exits_2(tmp_path: Path,
                                                                      n: int) -> None:
    cfg = write(tmp_path, CONFIG)  # no data file next to it
    result = run_mpi(n, [EXIT_STATUS, "train", cfg], timeout=120)
    assert result.returncode == 2, result.stderr
    # mpiexec reports one status; each rank prints its own.
    assert every_rank_exited(exit_statuses(result), n, 2), result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if "distbelief: error:" in line]
    assert len(errors) == 1, result.stderr
    assert "no such file" in errors[0]


@pytest.mark.parametrize("n", [2, 3])
def test_sgd_refuses_several_ranks_on_every_rank(data_dir: Path, n: int) -> None:
    cfg = write(data_dir, CONFIG)
    result = run_mpi(n, [EXIT_STATUS, "train", cfg], timeout=120)
    assert result.returncode == 2, result.stderr
    assert exit_statuses(result) == [2] * n, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if "distbelief: error:" in line]
    assert len(errors) == 1 and f"{n} MPI ranks" in errors[0], result.stderr


@pytest.mark.both_mpis
def test_unhandled_exception_on_one_rank_aborts_the_job(tmp_path: Path) -> None:
    # Rank 1 would wait forever in the barrier if rank 0's exception did not abort the job.
    script = tmp_path / "crash.py"
    script.write_text(
        "from distbelief.cli import start_mpi\n"
        "world = start_mpi()\n"
        "if world.Get_rank() == 0:\n"
        "    raise RuntimeError('boom on rank 0')\n"
        "world.Barrier()\n")
    result = run_mpi(2, [script], timeout=60)
    assert result.returncode != 0
    assert "RuntimeError: boom on rank 0" in result.stderr


def test_prepare_without_the_data_names_the_package_and_src(tmp_path: Path) -> None:
    assert_user_error(run_cli(["prepare", "fashion-mnist", "--src", tmp_path / "none",
                               "--out", tmp_path / "fm.h5"]),
                      "no such folder", "apt-get install dataset-fashion-mnist", "--src DIR")
    assert not (tmp_path / "fm.h5").exists()
