"""The README's commands are the ones CI runs (issue 11: a new user's first hour)."""

from __future__ import annotations

import ast
import re

from helpers.mpi_jobs import REPO

from distbelief.config import load_config

README = (REPO / "README.md").read_text()
CI = (REPO / ".ci" / "run").read_text()


def _quick_start() -> str:
    return README.split("## Quick start\n", 1)[1].split("\n## ", 1)[0]


def _code_lines(text: str) -> list[str]:
    """The indented (code block) lines of a Markdown section."""
    return [line.strip() for line in text.splitlines() if line.startswith("    ")]


def test_ci_runs_the_readme_test_command_verbatim():
    commands = [c for c in _code_lines(_quick_start()) if "pytest" in c]
    assert commands == ['pip install -e ".[mpich,test,plot]" && python -m pytest']
    assert commands[0] in CI
    # ... first, before anything (torch) is installed into the venv.
    assert CI.index(commands[0]) < CI.index("torch==")


def test_ci_installs_system_packages_only_after_the_readme_command_and_the_readme_names_them():
    # On a fresh machine the README's command runs without them (their tests skip), so CI
    # must not install them first; a user finds each one named in the README.
    command = 'pip install -e ".[mpich,test,plot]" && python -m pytest'
    packages = re.findall(r"apt_packages\+=\(([\w.-]+)\)", CI)
    assert sorted(packages) == ["dataset-fashion-mnist", "hdf5-tools", "shellcheck"]
    assert CI.index(command) < CI.index("apt-get install")
    for package in packages:
        assert package in _quick_start(), package


def test_quick_start_makes_the_venv_first_and_names_the_data_package():
    lines = _code_lines(_quick_start())
    assert lines[0].startswith("python3 -m venv")
    assert "dataset-fashion-mnist" in _quick_start()
    assert "--fresh" in _quick_start()


def test_no_test_module_imports_torch_at_module_level():
    # A module-level `import torch` stops collection of the whole suite without torch.
    for path in sorted((REPO / "tests").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(re.match(r"torch(\.|$)", n) for n in names), path.name


def test_quick_start_trains_two_replicas_so_the_report_shows_asynchrony():
    # With 1 replica every push has staleness 0: no histogram, one throughput bar.
    [command] = [c for c in _code_lines(_quick_start()) if "distbelief train" in c]
    ranks, config_path = re.search(r"mpiexec -n (\d+) python -m distbelief train (\S+)",
                                   command).groups()
    config = load_config(REPO / config_path, check_data=False, cwd=REPO)
    replicas = int(ranks) - config.cluster.ps_shards * config.cluster.partitions
    assert config.optimizer.algorithm == "downpour" and replicas == 2
    assert f"distbelief report {config.run.out_dir.relative_to(REPO)}" in command
    # The config's own comment gives the same command.
    assert f"# Run:  mpiexec -n {ranks} python -m distbelief train {config_path}" \
        in (REPO / config_path).read_text()
