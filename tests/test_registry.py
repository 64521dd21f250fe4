"""The algorithms' registry: every line names a trainer that exists, and the command line,
config validation, compare and the docs read the same list. Serial and fast."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.mpi_jobs import job_env, run_mpi

from distbelief import cli, config
from distbelief.algorithms import registry
from distbelief.compare import plan

DOCS = Path(__file__).resolve().parents[1] / "docs"
HELPERS = Path(__file__).resolve().parent / "helpers"


@pytest.mark.parametrize("algorithm", registry.ALGORITHMS, ids=registry.names())
def test_each_trainer_exists_and_takes_a_config_resume_and_setup(algorithm) -> None:
    # algorithms.launch calls trainer(config, [comm,] resume=..., setup=RunSetup).
    for partitions in (1, 2):
        trainer = algorithm.load_trainer(partitions)
        parameters = inspect.signature(trainer).parameters
        assert next(iter(parameters)) == "config"
        assert "resume" in parameters and "setup" in parameters
        assert ("comm" in parameters) != algorithm.in_one_process(partitions)
    if algorithm.shard_trainer is not None:
        trainer = algorithm.load_trainer(1, {algorithm.shards: 1})
        assert {"comm", "setup"} <= set(inspect.signature(trainer).parameters)


def test_a_declared_shard_rule_is_made_from_the_config_and_a_size() -> None:
    declared = [a for a in registry.ALGORITHMS if a.shard_rule is not None]
    assert [a.name for a in declared] == ["diloco"]
    for algorithm in declared:
        parameters = list(inspect.signature(algorithm.load_shard_rule()).parameters)
        assert parameters[:2] == ["config", "size"]


def test_averaging_with_elastic_alpha_is_easgd_on_downpours_machinery() -> None:
    averaging = registry.get("averaging")
    assert averaging.load_trainer(1, {"elastic_alpha": None}).__module__ == \
        "distbelief.algorithms.averaging.collective"
    assert averaging.load_trainer(1, {"elastic_alpha": 0.5}).__module__ == \
        "distbelief.algorithms.averaging.elastic"


def test_only_sgd_trains_in_one_process_and_only_with_one_partition() -> None:
    assert [a.name for a in registry.ALGORITHMS if a.in_one_process(1)] == ["sgd"]
    assert not any(a.in_one_process(2) for a in registry.ALGORITHMS)


def test_config_compare_and_help_read_the_registry() -> None:
    assert config.ALGORITHMS == registry.names()
    assert [k.name for k in config.algorithm_keys()["averaging"]] == ["average_every",
                                                                  "elastic_alpha"]
    assert plan.parse_algorithm("hogwild").name == "hogwild"
    description = cli.build_parser().description
    for algorithm in registry.ALGORITHMS:
        assert f"{algorithm.name} ({algorithm.summary})" in description


def test_shard_rules() -> None:
    assert config.needs_shards("downpour", {}) and config.needs_shards("sandblaster", {})
    assert not config.needs_shards("hogwild", {"elastic_alpha": 0.5})
    assert config.needs_shards("sync", {"backup_workers": 1})
    assert not config.needs_shards("sync", {"backup_workers": 0})
    assert config.needs_shards("averaging", {"elastic_alpha": 0.5})
    assert not config.needs_shards("averaging", {"elastic_alpha": None})


def test_the_architecture_page_lists_every_algorithm() -> None:
    text = (DOCS / "architecture.md").read_text()
    listed = text.split("The registered algorithms:")[1].split(".\n")[0]
    assert [name.strip(" `\n") for name in listed.split(",")] == list(registry.names())


def test_loading_one_trainer_imports_no_other_algorithm() -> None:
    code = ("import sys; from distbelief.algorithms import registry; "
            "registry.get('sync').load_trainer(1); "
            "print(' '.join(m for m in sys.modules if m.startswith('distbelief.algorithms.')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=True).stdout.split()
    assert "distbelief.algorithms.sync" in loaded
    others = {"downpour", "sandblaster", "averaging", "hogwild", "sgd", "partitioned_sgd"}
    assert not [m for m in loaded if m.split(".")[2] in others]


def test_an_unknown_name_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        registry.get("nope")


EXAMPLE_LINE = ('registry.Algorithm("full_batch", "example_algorithm:train", '
                '"full-batch gradient descent")')
"""The registration line of docs/architecture.md's example, as a test adds it."""


def test_a_new_algorithm_is_a_module_and_one_registry_line(synthetic_folder, small_config,
                                                          tmp_path) -> None:
    """docs/architecture.md's example, through the real command line on 2 ranks. Every
    process of the job (the guardians and the workers they start) adds the line to the
    registry at start-up (a sitecustomize.py), before anything reads it: as if it were
    written in registry.py."""
    assert EXAMPLE_LINE.removeprefix("registry.") in (DOCS / "architecture.md").read_text()
    folder = synthetic_folder("example", {"fb.toml": small_config(
        optimizer={"algorithm": "full_batch", "learning_rate": 0.5}, cluster=None,
        run={"max_steps": 25})})
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        f"import sys\nsys.path.insert(0, {str(HELPERS)!r})\n"
        f"from distbelief.algorithms import registry\n"
        f"registry.ALGORITHMS += ({EXAMPLE_LINE},)\n")
    env = job_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    out = tmp_path / "out"
    proc = run_mpi(2, ["-m", "distbelief", "train", folder / "fb.toml",
                       "--set", f'run.out_dir="{out}"'], timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == "full_batch" and summary["steps"] == 25
    assert summary["stop_reason"] == "max_steps"
    assert summary["final_test_accuracy"] > 0.4  # 4 classes: chance is 0.25


SCALED_LINE = registry.Algorithm(
    "scaled_sgd", "helpers.scaled_sgd.trainer:train", "sgd at a scaled rate",
    options="helpers.scaled_sgd.options:ScaledOptions", shards="ignored",
    one_process_trainer="helpers.scaled_sgd.trainer:train")
"""tests/helpers/scaled_sgd/'s registration line: an algorithm with two keys of its own."""


def test_an_algorithm_with_keys_of_its_own_is_its_folder_and_one_registry_line(
        monkeypatch, synthetic_folder, small_config, capsys, tmp_path) -> None:
    """Registered in this process only, the algorithm's keys are in the schema (checked,
    suggested, hashed), in --help, `distbelief help NAME` and the docs tables, and it
    trains through the command line with them."""
    monkeypatch.setattr(registry, "ALGORITHMS", (*registry.ALGORITHMS, SCALED_LINE))
    folder = synthetic_folder("scaled", {"s.toml": small_config(
        optimizer={"algorithm": "scaled_sgd", "learning_rate": 0.1, "rate_scale": 0.5},
        cluster=None, run={"max_steps": 400})})
    out = tmp_path / "out"
    status = cli.main(["train", str(folder / "s.toml"), "--set", "optimizer.step_cap=30",
                       "--set", f'run.out_dir="{out}"'])
    assert status == 0, capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["steps"] == 30
    recorded = json.loads((out / "config.json").read_text())["optimizer"]
    assert recorded["learning_rate"] == pytest.approx(0.05)  # 0.1 x rate_scale
    assert recorded["step_cap"] == 30

    assert cli.main(["help", "scaled_sgd"]) == 0
    shown = capsys.readouterr().out
    assert "optimizer.rate_scale = 1" in shown and "optimizer.step_cap = 0" in shown
    assert "the factor on optimizer.learning_rate" in shown
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert "scaled_sgd   sgd at a scaled rate" in capsys.readouterr().out
    tables = config.key_tables()
    assert "| `optimizer.rate_scale` | 1 | the factor on optimizer.learning_rate |" in tables
    assert "`optimizer.step_cap`" in tables

    base = config.load_config(folder / "s.toml", check_data=False)
    assert config.config_hash(base) != config.config_hash(config.load_config(
        folder / "s.toml", ["optimizer.rate_scale=0.25"], check_data=False))
    assert config.config_hash(base) == config.config_hash(config.load_config(
        folder / "s.toml", ["optimizer.step_cap=5"], check_data=False))  # hashed="never"
    assert cli.main(["train", str(folder / "s.toml"), "--set", "optimizer.rate_scal=2"]) == 2
    assert "did you mean 'rate_scale'?" in capsys.readouterr().err
    assert cli.main(["train", str(folder / "s.toml"), "--set", "optimizer.rate_scale=4",
                     "--set", "optimizer.learning_rate=0.5"]) == 2
    assert "takes the learning rate above 1" in capsys.readouterr().err  # its own check
    assert cli.main(["train", str(folder / "s.toml"), "--set", 'optimizer.algorithm="sgd"']) == 2
    assert 'optimizer.rate_scale applies only to algorithm = "scaled_sgd"' in \
        capsys.readouterr().err
