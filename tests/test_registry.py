"""The algorithms' registry: every line names a trainer that exists, and the command line,
config validation, compare and the docs read the same list. Serial and fast."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from distbelief import cli, config
from distbelief.algorithms import registry
from distbelief.compare import plan

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.mark.parametrize("algorithm", registry.ALGORITHMS, ids=registry.names())
def test_each_trainer_exists_and_takes_a_config_and_resume(algorithm) -> None:
    for partitions in (1, 2):
        trainer = algorithm.load_trainer(partitions)
        parameters = inspect.signature(trainer).parameters
        assert next(iter(parameters)) == "config" and "resume" in parameters
        assert ("comm" in parameters) != algorithm.in_one_process(partitions)
    if algorithm.shard_trainer is not None:
        trainer = algorithm.load_trainer(1, {algorithm.shards: 1})
        assert "comm" in inspect.signature(trainer).parameters


def test_averaging_with_elastic_alpha_is_easgd_on_downpours_machinery() -> None:
    averaging = registry.get("averaging")
    assert averaging.load_trainer(1, {"elastic_alpha": None}).__module__ == \
        "distbelief.algorithms.averaging.collective"
    assert averaging.load_trainer(1, {"elastic_alpha": 0.5}).__module__ == \
        "distbelief.algorithms.downpour.elastic"


def test_only_sgd_trains_in_one_process_and_only_with_one_partition() -> None:
    assert [a.name for a in registry.ALGORITHMS if a.in_one_process(1)] == ["sgd"]
    assert not any(a.in_one_process(2) for a in registry.ALGORITHMS)


def test_config_compare_and_help_read_the_registry() -> None:
    assert config.ALGORITHMS == registry.names()
    assert config.ALGORITHM_KEYS["averaging"] == ("average_every", "elastic_alpha")
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
