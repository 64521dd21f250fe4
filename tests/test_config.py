"""Configuration: schema errors with clear messages, --set overrides, defaults, resolved
paths, the data-fits-model check and the config hash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distbelief.config import (
    Config,
    apply_overrides,
    config_from_dict,
    config_hash,
    hashed_settings,
    load_config,
    parse_override,
    settings_diff,
    settings_hash,
)
from distbelief.data.converters import make_synthetic
from distbelief.errors import ConfigError, DataError, UserError

LAYERS = """
[model]
layers = [
    { type = "dense", units = 16, activation = "relu" },
    { type = "dense", units = 3, activation = "softmax" },
]
"""
VALID = LAYERS + """
[data]
path = "synth.h5"

[run]
max_steps = 10
"""


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small synthetic set: 8 flat features, 3 classes."""
    path = tmp_path_factory.mktemp("data") / "synth.h5"
    return make_synthetic(path, n_train=200, n_test=50, input_shape=(8,), num_classes=3)


def write_config(folder: Path, text: str, name: str = "exp.toml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def raw_config(text: str = VALID) -> dict:
    import tomllib

    return tomllib.loads(text)


def schema_error(text: str, overrides: tuple[str, ...] = ()) -> str:
    """The message of the ConfigError the schema check raises for `text`."""
    with pytest.raises(ConfigError) as info:
        config_from_dict(apply_overrides(raw_config(text), overrides), Path("exp.toml"))
    message = str(info.value)
    assert "\n" not in message
    return message


# -- a valid file --------------------------------------------------------------------------


def test_valid_config_has_documented_defaults(tmp_path: Path, data_file: Path) -> None:
    path = write_config(data_file.parent, VALID)
    config = load_config(path, cwd=tmp_path)
    assert isinstance(config, Config)
    assert config.data.batch_size == 64
    opt = config.optimizer
    assert (opt.algorithm, opt.learning_rate, opt.adagrad) == ("sgd", 0.02, True)
    assert (opt.n_fetch, opt.n_push, opt.warm_start_steps) == (1, 1, 0)
    assert (config.cluster.ps_shards, config.cluster.partitions) == (1, 1)
    run = config.run
    assert (run.max_steps, run.max_seconds, run.target_accuracy) == (10, 0.0, None)
    assert (run.eval_every_seconds, run.eval_samples, run.seed) == (2.0, 0, 0)
    assert (run.threads, run.progress_every_seconds) == (0, 2.0)
    assert (run.checkpoint_every_seconds, run.checkpoint_every_steps,
            run.keep_checkpoints) == (600.0, 0, 3)
    assert run.out_dir == tmp_path.resolve() / "runs" / "exp"
    assert config.model.layers[1] == {"type": "dense", "units": 3, "activation": "softmax"}


def test_config_is_frozen(tmp_path: Path, data_file: Path) -> None:
    config = load_config(write_config(data_file.parent, VALID), cwd=tmp_path)
    with pytest.raises(AttributeError):
        config.run.max_steps = 5  # type: ignore[misc]


def test_relative_data_path_is_resolved_against_the_config_folder(
        tmp_path: Path, data_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sub = tmp_path / "configs"
    sub.mkdir()
    text = VALID.replace('path = "synth.h5"', f'path = "../{data_file.parent.name}/synth.h5"')
    (tmp_path / data_file.parent.name).mkdir()
    (tmp_path / data_file.parent.name / "synth.h5").write_bytes(data_file.read_bytes())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(Path("..") / "configs" / write_config(sub, text).name)
    assert config.data.path == (tmp_path / data_file.parent.name / "synth.h5").resolve()
    # out_dir, instead, is relative to where the command runs.
    assert config.run.out_dir == elsewhere.resolve() / "runs" / "exp"


def test_explicit_out_dir_is_relative_to_cwd(tmp_path: Path, data_file: Path) -> None:
    path = write_config(data_file.parent, VALID + 'out_dir = "results/a"\n')
    assert load_config(path, cwd=tmp_path).run.out_dir == tmp_path.resolve() / "results/a"


def test_to_dict_is_json_and_complete(tmp_path: Path, data_file: Path) -> None:
    config = load_config(write_config(data_file.parent, VALID), cwd=tmp_path)
    d = json.loads(json.dumps(config.to_dict()))
    assert set(d) == {"model", "data", "optimizer", "cluster", "run"}
    assert d["data"]["path"] == str(data_file.resolve())
    assert d["run"]["target_accuracy"] is None
    assert d["model"]["layers"][0]["units"] == 16


# -- schema errors ---------------------------------------------------------------------------


def test_unknown_section_suggests_the_closest() -> None:
    message = schema_error(VALID + "[optimiser]\nadagrad = false\n")
    assert "unknown section [optimiser]" in message
    assert "did you mean 'optimizer'" in message


def test_unknown_key_names_it_and_suggests_the_closest() -> None:
    message = schema_error(VALID.replace("max_steps = 10", "max_step = 10"))
    assert "unknown key 'run.max_step'" in message
    assert "did you mean 'max_steps'" in message


def test_unknown_key_far_from_any_has_no_suggestion_but_lists_valid_keys() -> None:
    message = schema_error(VALID + "zzzz = 1\n")
    assert "unknown key 'run.zzzz'" in message
    assert "did you mean" not in message
    assert "max_seconds" in message


@pytest.mark.parametrize("key, value, expected", [
    ("run.max_steps", '"ten"', "an integer >= 0"),
    ("run.max_steps", "-1", "an integer >= 0"),
    ("run.max_steps", "2.5", "an integer >= 0"),
    ("data.batch_size", "0", "an integer >= 1"),
    ("data.batch_size", "true", "an integer >= 1"),
    ("optimizer.learning_rate", "0", "a number > 0"),
    ("optimizer.learning_rate", "nan", "a number > 0"),
    ("optimizer.learning_rate", '"fast"', "a number > 0"),
    ("optimizer.adagrad", "1", "true or false"),
    ("optimizer.algorithm", '"adam"', "one of 'sgd', 'downpour'"),
    ("optimizer.n_fetch", "0", "an integer >= 1"),
    ("optimizer.n_push", "0", "an integer >= 1"),
    ("optimizer.warm_start_steps", "-5", "an integer >= 0"),
    ("cluster.ps_shards", "-1", "an integer >= 0"),
    ("optimizer.update", '"rmsprop"',
     "one of 'adagrad', 'sgd', 'adarevision', 'momentum', 'adam', 'dcasgd'"),
    ("optimizer.backup_workers", "-1", "an integer >= 0"),
    ("optimizer.average_every", "0", "an integer >= 1"),
    ("optimizer.elastic_alpha", "1.5", "a number > 0 and <= 1"),
    ("run.target_accuracy", "1.5", "a number > 0 and <= 1"),
    ("run.target_accuracy", "0", "a number > 0 and <= 1"),
    ("run.max_seconds", "-1", "a number >= 0"),
    ("run.eval_every_seconds", "0", "a number > 0"),
    ("run.eval_samples", "-1", "an integer >= 0"),
    ("run.threads", "-2", "an integer >= 0"),
    ("run.seed", "-1", "an integer >= 0"),
    ("run.checkpoint_every_seconds", "-1", "a number >= 0"),
    ("run.checkpoint_every_steps", "-1", "an integer >= 0"),
    ("run.checkpoint_every_steps", "1.5", "an integer >= 0"),
    ("run.keep_checkpoints", "1", "an integer >= 2"),
    ("run.out_dir", "3", "a non-empty string"),
    ("data.path", "[1]", "a non-empty string"),
    ("model.layers", "[]", "a non-empty list of tables"),
    ("model.layers", "[1, 2]", "a non-empty list of tables"),
])
def test_bad_value_names_key_value_and_what_is_allowed(key: str, value: str,
                                                       expected: str) -> None:
    message = schema_error(VALID, (f"{key}={value}",))
    assert f"{key} = " in message
    assert "is invalid" in message
    assert expected in message


def test_bad_value_message_shows_the_value_as_written() -> None:
    message = schema_error(VALID, ('run.max_steps="ten"',))
    assert 'run.max_steps = "ten" is invalid' in message


def test_sandblaster_options_are_checked() -> None:
    message = schema_error(VALID, ('optimizer.algorithm="sandblaster"', "optimizer.m=0"))
    assert "optimizer.m = 0 is invalid" in message
    message = schema_error(VALID, ('optimizer.algorithm="sandblaster"',
                                   "optimizer.wolfe_c1=0.5", "optimizer.wolfe_c2=0.4"))
    assert "wolfe_c1" in message and "smaller" in message


def test_downpour_is_accepted_by_the_schema() -> None:
    config = config_from_dict(apply_overrides(raw_config(), ['optimizer.algorithm="downpour"',
                                                             "cluster.ps_shards=2"]))
    assert config.optimizer.algorithm == "downpour"
    assert config.cluster.ps_shards == 2


def test_model_partitions_are_accepted_by_the_schema() -> None:
    # Whether they fit the model is checked against the data (test_model_parallel.py).
    raw = apply_overrides(raw_config(), ["cluster.partitions=2"])
    assert config_from_dict(raw).cluster.partitions == 2


def test_a_run_without_any_stop_rule_is_refused() -> None:
    message = schema_error(VALID.replace("max_steps = 10", ""))
    for key in ("run.max_steps", "run.max_seconds", "run.target_accuracy"):
        assert key in message


@pytest.mark.parametrize("stop", ["max_seconds = 1.5", "target_accuracy = 0.5"])
def test_any_one_stop_rule_is_enough(stop: str) -> None:
    config_from_dict(raw_config(VALID.replace("max_steps = 10", stop)))


def test_missing_required_keys() -> None:
    assert "missing required key 'model.layers'" in schema_error(
        VALID.replace(LAYERS, ""))
    assert "missing required key 'data.path'" in schema_error(
        VALID.replace('path = "synth.h5"', ""))


def test_section_that_is_not_a_table() -> None:
    assert "[run] must be a table" in schema_error('run = 5\n' + VALID.split("[run]")[0])


def test_missing_and_malformed_config_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    bad = write_config(tmp_path, "[run\nmax_steps = 1\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)


# -- --set ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("run.max_steps=100", ("run", "max_steps", 100)),
    ("optimizer.learning_rate=1e-3", ("optimizer", "learning_rate", 1e-3)),
    ("optimizer.adagrad=false", ("optimizer", "adagrad", False)),
    ('run.out_dir="runs/x y"', ("run", "out_dir", "runs/x y")),
    ("run.out_dir=runs/bare", ("run", "out_dir", "runs/bare")),
    ("data.path = a.h5", ("data", "path", "a.h5")),
    ("model.layers=[1, 2]", ("model", "layers", [1, 2])),
    ("model.layers=[{type=\"dense\", units=3, activation=\"softmax\"}]",
     ("model", "layers", [{"type": "dense", "units": 3, "activation": "softmax"}])),
])
def test_parse_override(text: str, expected: tuple) -> None:
    assert parse_override(text) == expected


@pytest.mark.parametrize("text", ["max_steps=3", "run.max_steps", "run.=3", ".x=3",
                                  "run.a.b=3", "=3"])
def test_bad_override_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="expected section.key=value"):
        parse_override(text)


def test_overrides_replace_file_values_and_are_validated(tmp_path: Path,
                                                         data_file: Path) -> None:
    path = write_config(data_file.parent, VALID)
    config = load_config(path, ["run.max_steps=7", "optimizer.learning_rate=1e-3",
                                "optimizer.adagrad=false", "data.batch_size=8"], cwd=tmp_path)
    assert config.run.max_steps == 7
    assert config.optimizer.learning_rate == pytest.approx(1e-3)
    assert config.optimizer.adagrad is False
    assert config.data.batch_size == 8
    # A mistake in --set is reported as one on the command line, not in the file.
    with pytest.raises(ConfigError, match=r"^--set optimizer.learnig_rate=0.1: unknown key "
                       r"'optimizer.learnig_rate'; did you mean 'learning_rate'"):
        load_config(path, ["optimizer.learnig_rate=0.1"], cwd=tmp_path)
    with pytest.raises(ConfigError, match=r"^--set run.max_steps=lots: run.max_steps = "
                       r"\"lots\" is invalid"):
        load_config(path, ["run.max_steps=lots"], cwd=tmp_path)
    with pytest.raises(ConfigError, match=r"^--set trainer.x=1: unknown section \[trainer\]"):
        load_config(path, ["trainer.x=1"], cwd=tmp_path)


def test_override_does_not_change_the_raw_dict() -> None:
    raw = raw_config()
    apply_overrides(raw, ["run.max_steps=99"])
    assert raw["run"]["max_steps"] == 10


# -- data against model ------------------------------------------------------------------------


def test_missing_data_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file") as caught:
        load_config(write_config(tmp_path, VALID), cwd=tmp_path)
    # A relative data.path: the message says where it was looked for, and why there.
    assert "resolved from the config file's folder, " + str(tmp_path.resolve()) in str(
        caught.value)


def test_missing_absolute_data_file_names_only_the_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file") as caught:
        load_config(write_config(tmp_path, VALID), [f"data.path={tmp_path / 'none.h5'}"],
                    cwd=tmp_path)
    assert "resolved from" not in str(caught.value)


def test_corrupt_data_file(tmp_path: Path) -> None:
    (tmp_path / "synth.h5").write_bytes(os.urandom(4096))
    with pytest.raises(DataError, match="synth.h5"):
        load_config(write_config(tmp_path, VALID), cwd=tmp_path)


def test_check_data_can_be_skipped(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, VALID), check_data=False, cwd=tmp_path)
    assert config.data.path == (tmp_path / "synth.h5").resolve()


def test_output_layer_that_does_not_match_the_classes(tmp_path: Path, data_file: Path) -> None:
    path = write_config(data_file.parent, VALID.replace("units = 3", "units = 10"))
    with pytest.raises(ConfigError) as info:
        load_config(path, cwd=tmp_path)
    message = str(info.value)
    assert message.startswith("model.layers:")
    assert "3 classes" in message and "input 8" in message


def test_local_layer_on_flat_data_does_not_fit(tmp_path: Path, data_file: Path) -> None:
    text = VALID.replace('{ type = "dense", units = 16, activation = "relu" }',
                         '{ type = "local", kernel = 3, channels = 4, activation = "relu" }')
    with pytest.raises(ConfigError, match="model.layers:.*3-D"):
        load_config(write_config(data_file.parent, text), cwd=tmp_path)


def test_bad_layer_spec_is_reported_with_its_key(tmp_path: Path, data_file: Path) -> None:
    text = VALID.replace('activation = "relu"', 'activation = "relux"')
    with pytest.raises(ConfigError, match="model.layers:.*activation"):
        load_config(write_config(data_file.parent, text), cwd=tmp_path)


def test_batch_and_eval_sizes_must_fit_the_data(tmp_path: Path, data_file: Path) -> None:
    path = write_config(data_file.parent, VALID)
    with pytest.raises(DataError, match=r"data.batch_size = 500 is larger than the 200 "
                       r"training rows in \S+synth.h5$"):
        load_config(path, ["data.batch_size=500"], cwd=tmp_path)
    # After a validation split the count is not the file's: the message says which it is
    # (issue 42: "324 rows in tiny.h5" for a file of 360 training rows).
    with pytest.raises(DataError, match=r"data.batch_size = 190 is larger than the 180 "
                       r"training rows after the validation split \(data.validation = 0.1\) "
                       r"of the 200 in \S+synth.h5$"):
        load_config(path, ["data.batch_size=190", "data.validation=0.1"], cwd=tmp_path)
    with pytest.raises(DataError, match="run.eval_samples = 51 .* 50 test samples"):
        load_config(path, ["run.eval_samples=51"], cwd=tmp_path)


def test_every_error_is_a_user_error() -> None:
    assert issubclass(ConfigError, UserError) and issubclass(DataError, UserError)


# -- hash ----------------------------------------------------------------------------------------


def _hash(overrides: list[str]) -> str:
    return config_hash(config_from_dict(apply_overrides(raw_config(), overrides),
                                        Path("/cfg/exp.toml")))


def test_hash_follows_what_is_trained_not_budgets() -> None:
    base = _hash([])
    assert len(base) == 64 and base == _hash([])
    assert _hash(["optimizer.learning_rate=0.03"]) != base
    assert _hash(["run.seed=1"]) != base
    assert _hash(["data.batch_size=32"]) != base
    assert _hash(['model.layers=[{type="dense", units=3, activation="softmax"}]']) != base
    # Budgets, cadences and where results go may change on a resumed run.
    assert _hash(["run.max_steps=1000", "run.max_seconds=5", "run.target_accuracy=0.9",
                  "run.eval_every_seconds=1", 'run.out_dir="elsewhere"', "run.threads=2",
                  "run.progress_every_seconds=9", "run.checkpoint_every_seconds=5",
                  "run.checkpoint_every_steps=7", "run.keep_checkpoints=9"]) == base
    # So may the shard count: a checkpoint is re-sliced for the new one.
    assert _hash(["cluster.ps_shards=4"]) == base


def test_hashed_settings_and_their_differences() -> None:
    def settings(overrides: list[str]) -> dict:
        config = config_from_dict(apply_overrides(raw_config(), overrides),
                                  Path("/cfg/exp.toml"))
        return hashed_settings(config)

    base = settings([])
    assert set(base) == {"model", "data", "optimizer", "run"}
    assert base["run"] == {"seed": 0}
    assert settings_hash(base) == _hash([])
    changed = settings(["optimizer.learning_rate=0.5", "run.seed=3", "data.batch_size=8"])
    assert settings_diff(base, changed) == ["data.batch_size: 64 -> 8",
                                            "optimizer.learning_rate: 0.02 -> 0.5",
                                            "run.seed: 0 -> 3"]
    assert settings_diff(base, base) == []


def test_hash_is_stable_across_processes() -> None:
    code = ("import tomllib, sys; from pathlib import Path; "
            "from distbelief.config import config_from_dict, config_hash; "
            f"raw = tomllib.loads({VALID!r}); "
            "print(config_hash(config_from_dict(raw, Path('/cfg/exp.toml'))))")
    hashes = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, timeout=60, check=True)
        hashes.add(out.stdout.strip())
    assert hashes == {_hash([])}


def test_sandblaster_with_partitions_is_accepted(tmp_path):
    """Sandblaster's replicas may span several ranks (model parallelism), as Downpour's."""
    from distbelief.config import load_config

    cfg = tmp_path / "c.toml"
    cfg.write_text('[model]\nlayers = [{type = "dense", units = 10}]\n'
                   '[data]\npath = "x.h5"\n[optimizer]\nalgorithm = "sandblaster"\n'
                   '[cluster]\npartitions = 2\n[run]\nmax_steps = 3\n')
    config = load_config(cfg, check_data=False)
    assert (config.optimizer.algorithm, config.cluster.partitions) == ("sandblaster", 2)


def _optimizer(overrides: list[str]) -> tuple:
    config = config_from_dict(apply_overrides(raw_config(), overrides), Path("/cfg/exp.toml"))
    return config.optimizer, config.cluster


def test_update_reads_the_older_adagrad_spelling_and_refuses_a_contradiction() -> None:
    assert _optimizer([])[0].update == "adagrad"
    assert _optimizer(["optimizer.adagrad=false"])[0].update == "sgd"
    opt = _optimizer(['optimizer.update="sgd"'])[0]
    assert (opt.update, opt.adagrad) == ("sgd", False)
    opt = _optimizer(['optimizer.algorithm="downpour"', 'optimizer.update="adarevision"'])[0]
    assert (opt.update, opt.adagrad) == ("adarevision", False)
    message = schema_error(VALID, ("optimizer.adagrad=true", 'optimizer.update="sgd"'))
    assert "contradicts" in message and "optimizer.update" in message
    message = schema_error(VALID + "[optimizer]\nadagrad = true\nupdate = \"sgd\"\n")
    assert "contradicts" in message
    # An override of one spelling replaces the file's other one.
    in_file = raw_config(VALID + '[optimizer]\nalgorithm = "downpour"\nadagrad = true\n')
    config = config_from_dict(apply_overrides(in_file, ['optimizer.update="adarevision"']),
                              Path("/cfg/exp.toml"))
    assert config.optimizer.update == "adarevision"
    in_file = raw_config(VALID + '[optimizer]\nupdate = "adagrad"\n')
    config = config_from_dict(apply_overrides(in_file, ["optimizer.adagrad=false"]),
                              Path("/cfg/exp.toml"))
    assert config.optimizer.update == "sgd"
    message = schema_error(VALID, ('optimizer.update="adarevision"',))
    assert "Downpour" in message and '"sgd"' in message


def test_keys_of_one_algorithm_are_refused_for_another() -> None:
    message = schema_error(VALID, ('optimizer.algorithm="downpour"', "optimizer.backup_workers=1"))
    assert 'optimizer.backup_workers applies only to algorithm = "sync"' in message
    message = schema_error(VALID, ("optimizer.elastic_alpha=0.5",))
    assert 'applies only to algorithm = "averaging"' in message
    message = schema_error(VALID, ('optimizer.fetch="overlapped"',))
    assert 'optimizer.fetch applies only to algorithm = "downpour"' in message
    message = schema_error(VALID, ('optimizer.algorithm="downpour"', 'optimizer.fetch="late"'))
    assert "optimizer.fetch" in message and "'overlapped'" in message


@pytest.mark.parametrize("algorithm, more", [
    ("sandblaster", ()), ("sync", ()), ("sync", ("optimizer.backup_workers=1",)),
    ("averaging", ()), ("averaging", ("optimizer.elastic_alpha=0.5",)), ("hogwild", ()),
    ("sgd", ())])
def test_push_dtype_is_refused_outside_downpour(algorithm: str, more: tuple[str, ...]) -> None:
    # Only Downpour's replicas push gradients to shards; EASGD's pushes are elastic
    # differences and Sandblaster's go point to point: one clear error for each.
    message = schema_error(VALID, (f'optimizer.algorithm="{algorithm}"',
                                   'optimizer.push_dtype="bfloat16"', *more))
    assert message.count("optimizer.push_dtype") == 1
    assert 'optimizer.push_dtype applies only to algorithm = "downpour"' in message


def test_push_dtype_values_and_hash() -> None:
    def config(*overrides: str):
        return config_from_dict(apply_overrides(raw_config(), [
            'optimizer.algorithm="downpour"', *overrides]), Path("/cfg/exp.toml"))

    assert config().optimizer.push_dtype == "float32"
    assert config('optimizer.push_dtype="bfloat16"').optimizer.push_dtype == "bfloat16"
    message = schema_error(VALID, ('optimizer.algorithm="downpour"',
                                   'optimizer.push_dtype="float16"'))
    assert "optimizer.push_dtype" in message and "'bfloat16'" in message
    # float32, given or not, leaves the hash as it was before the key existed; bfloat16
    # changes what is trained, so a run cannot resume under the other setting
    assert config_hash(config('optimizer.push_dtype="float32"')) == config_hash(config())
    assert "push_dtype" not in hashed_settings(config())["optimizer"]
    narrowed = config('optimizer.push_dtype="bfloat16"')
    assert hashed_settings(narrowed)["optimizer"]["push_dtype"] == "bfloat16"
    assert config_hash(narrowed) != config_hash(config())


def test_max_staleness_values_hash_and_who_refuses_it() -> None:
    def config(*overrides: str):
        return config_from_dict(apply_overrides(raw_config(), [
            'optimizer.algorithm="downpour"', *overrides]), Path("/cfg/exp.toml"))

    assert config().optimizer.max_staleness is None
    assert config("optimizer.max_staleness=0").optimizer.max_staleness == 0
    # unset leaves earlier runs' hashes alone; every bound trains differently
    assert "max_staleness" not in hashed_settings(config())["optimizer"]
    hashes = {config_hash(config(*more)) for more in
              [(), ("optimizer.max_staleness=0",), ("optimizer.max_staleness=2",)]}
    assert len(hashes) == 3
    message = schema_error(VALID, ('optimizer.algorithm="downpour"',
                                   "optimizer.max_staleness=-1"))
    assert "optimizer.max_staleness" in message and "an integer >= 0" in message
    # The bound's fetch waits for the replica's own push and for the slowest replica.
    message = schema_error(VALID, ('optimizer.algorithm="downpour"', "optimizer.max_staleness=1",
                                   'optimizer.fetch="asynchronous"'))
    assert 'leave fetch at "own_pushes"' in message
    # EASGD and asynchronous DiLoCo run on Downpour's shards, without its gate: one line
    # that says so.
    for algorithm, more in [("averaging", "optimizer.elastic_alpha=0.5"),
                            ("diloco", "optimizer.asynchronous=true"), ("sync", "")]:
        message = schema_error(VALID, (f'optimizer.algorithm="{algorithm}"',
                                       "optimizer.max_staleness=1", *filter(None, [more])))
        assert (f'optimizer.max_staleness applies only to algorithm = "downpour", not '
                f'"{algorithm}": it gates Downpour\'s pushes and fetches') in message


def test_ps_shards_defaults_to_what_the_algorithm_needs() -> None:
    assert _optimizer(['optimizer.algorithm="downpour"'])[1].ps_shards == 1
    assert _optimizer([])[1].ps_shards == 1  # sgd ignores it; as before
    message = schema_error(VALID, ('optimizer.algorithm="downpour"', "cluster.ps_shards=0"))
    assert "cluster.ps_shards = 0" in message and "at least 1" in message


def test_new_optimizer_keys_leave_earlier_runs_hashes_alone() -> None:
    """Checkpoints written before update/backup_workers/average_every/elastic_alpha existed
    must still resume: those keys stay out of the hash of the algorithms that ignore them."""
    for algorithm in ("sgd", "downpour"):
        config = config_from_dict(apply_overrides(raw_config(), [
            f'optimizer.algorithm="{algorithm}"']), Path("/cfg/exp.toml"))
        assert set(hashed_settings(config)["optimizer"]) == {
            "algorithm", "learning_rate", "adagrad", "n_fetch", "n_push", "warm_start_steps"}
    config = config_from_dict(apply_overrides(raw_config(), [
        'optimizer.algorithm="downpour"', 'optimizer.update="adarevision"']),
        Path("/cfg/exp.toml"))
    assert hashed_settings(config)["optimizer"]["update"] == "adarevision"
    # fetch changes the trajectory when it is not the default: then it is hashed
    config = config_from_dict(apply_overrides(raw_config(), [
        'optimizer.algorithm="downpour"', 'optimizer.fetch="overlapped"']),
        Path("/cfg/exp.toml"))
    assert hashed_settings(config)["optimizer"]["fetch"] == "overlapped"


# -- the learning-rate schedule ----------------------------------------------------------


def test_schedule_defaults_and_what_build_schedule_makes() -> None:
    from distbelief.config import build_schedule

    opt = _optimizer([])[0]
    assert (opt.warmup_steps, opt.schedule, opt.decay_steps, opt.decay_rate,
            opt.min_learning_rate) == (0, "constant", None, None, None)
    config = config_from_dict(raw_config(), Path("/cfg/exp.toml"))
    assert build_schedule(config).constant and build_schedule(config)(10**6) == 0.02
    # step fills in its decay rate and floor; cosine its floor
    opt = _optimizer(['optimizer.schedule="step"', "optimizer.decay_steps=100"])[0]
    assert (opt.decay_rate, opt.min_learning_rate) == (0.1, 0.0)
    config = config_from_dict(apply_overrides(raw_config(), [
        "optimizer.learning_rate=0.1", "optimizer.warmup_steps=10",
        'optimizer.schedule="cosine"', "optimizer.decay_steps=100",
        "optimizer.min_learning_rate=0.001"]), Path("/cfg/exp.toml"))
    schedule = build_schedule(config)
    assert schedule(0) == pytest.approx(0.01) and schedule(9) == schedule(10) == 0.1
    assert schedule(110) == pytest.approx(0.001)
    # every algorithm with a learning rate takes one
    for algorithm in ("downpour", "sync", "averaging", "hogwild"):
        opt = _optimizer([f'optimizer.algorithm="{algorithm}"', "optimizer.warmup_steps=5",
                          "cluster.ps_shards=1" if algorithm == "downpour" else
                          "optimizer.learning_rate=0.02"])[0]
        assert opt.warmup_steps == 5


@pytest.mark.parametrize("overrides, expected", [
    (['optimizer.schedule="cosine"'],
     'optimizer.schedule = "cosine" needs optimizer.decay_steps, an integer >= 1'),
    (['optimizer.schedule="step"'], 'optimizer.schedule = "step" needs optimizer.decay_steps'),
    (["optimizer.decay_steps=100"],
     'optimizer.decay_steps = 100 applies to optimizer.schedule = "step" or "cosine"'),
    (["optimizer.min_learning_rate=0.001"], "optimizer.min_learning_rate = 0.001 applies to"),
    (['optimizer.schedule="cosine"', "optimizer.decay_steps=10", "optimizer.decay_rate=0.5"],
     'optimizer.decay_rate = 0.5 applies to optimizer.schedule = "step"'),
    (['optimizer.schedule="step"', "optimizer.decay_steps=10", "optimizer.decay_rate=1.0"],
     "optimizer.decay_rate = 1.0 is invalid; expected a number > 0 and < 1"),
    (['optimizer.schedule="cosine"', "optimizer.decay_steps=10",
      "optimizer.min_learning_rate=0.02"],
     "optimizer.min_learning_rate = 0.02 must be below optimizer.learning_rate = 0.02"),
    (['optimizer.schedule="linear"'],
     ("""optimizer.schedule = "linear" is invalid; expected one of 'constant', 'step', """
     """'cosine'""")),
    (["optimizer.warmup_steps=-1"], "optimizer.warmup_steps = -1 is invalid"),
    (['optimizer.schedule="cosine"', "optimizer.decay_steps=0"],
     "optimizer.decay_steps = 0 is invalid; expected an integer >= 1"),
    (['optimizer.algorithm="sandblaster"', "optimizer.warmup_steps=100"],
     'optimizer.warmup_steps = 100, but algorithm = "sandblaster" has no learning rate'),
    (['optimizer.algorithm="sandblaster"', 'optimizer.schedule="constant"'],
     'algorithm = "sandblaster" has no learning rate'),
])
def test_schedule_errors_name_the_key_the_value_and_what_is_allowed(overrides, expected):
    assert expected in schema_error(VALID, tuple(overrides))


def test_the_schedule_is_in_the_hash_and_its_defaults_are_not() -> None:
    base = _hash([])
    assert _hash(["optimizer.warmup_steps=0", 'optimizer.schedule="constant"']) == base
    warmup = _hash(["optimizer.warmup_steps=100"])
    cosine = _hash(['optimizer.schedule="cosine"', "optimizer.decay_steps=1000"])
    hashes = {base, warmup, cosine,
              _hash(["optimizer.warmup_steps=200"]),
              _hash(['optimizer.schedule="cosine"', "optimizer.decay_steps=2000"]),
              _hash(['optimizer.schedule="cosine"', "optimizer.decay_steps=1000",
                     "optimizer.min_learning_rate=0.001"]),
              _hash(['optimizer.schedule="step"', "optimizer.decay_steps=1000"]),
              _hash(['optimizer.schedule="step"', "optimizer.decay_steps=1000",
                     "optimizer.decay_rate=0.5"])}
    assert len(hashes) == 8
    config = config_from_dict(apply_overrides(raw_config(), [
        "optimizer.warmup_steps=100", 'optimizer.schedule="cosine"',
        "optimizer.decay_steps=1000"]), Path("/cfg/exp.toml"))
    assert settings_diff(hashed_settings(config_from_dict(raw_config(), Path("/cfg/exp.toml"))),
                         hashed_settings(config)) == [
        "optimizer.decay_steps: null -> 1000", "optimizer.min_learning_rate: null -> 0.0",
        'optimizer.schedule: null -> "cosine"', "optimizer.warmup_steps: null -> 100"]


MOMENTUM_RAW = {"model": {"layers": [{"type": "dense", "units": 4, "activation": "softmax"}]},
       "data": {"path": "d.h5"}, "run": {"max_steps": 1}}


def _optimizer_config(**optimizer):
    return config_from_dict({**MOMENTUM_RAW, "optimizer": optimizer})


def test_the_settings_belong_to_their_rule_and_hash_only_with_it():
    with pytest.raises(ConfigError, match='optimizer.momentum applies only to update = '
                                          '"momentum"'):
        _optimizer_config(update="adam", momentum=0.5)
    with pytest.raises(ConfigError, match="optimizer.beta2 applies only"):
        _optimizer_config(beta2=0.99)
    with pytest.raises(ConfigError, match="sandblaster"):
        _optimizer_config(algorithm="sandblaster", update="momentum")
    with pytest.raises(ConfigError, match=r"optimizer\.beta1"):
        _optimizer_config(update="adam", beta1=1.0)
    sgd, momentum = _optimizer_config(update="sgd"), _optimizer_config(update="momentum")
    assert config_hash(sgd) != config_hash(momentum)
    assert "momentum" not in hashed_settings(sgd)["optimizer"]
    assert hashed_settings(momentum)["optimizer"]["momentum"] == 0.9
    nesterov = _optimizer_config(update="momentum", nesterov=True)
    assert config_hash(nesterov) != config_hash(momentum)
    adam, adam_b2 = _optimizer_config(update="adam"), _optimizer_config(update="adam", beta2=0.99)
    assert config_hash(adam) != config_hash(adam_b2)
    # Adagrad's hash has none of the new keys: earlier runs' checkpoints still resume.
    assert not {"momentum", "nesterov", "beta1", "beta2", "update"} & set(
        hashed_settings(_optimizer_config())["optimizer"])


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "configs").glob("*.toml")),
                         ids=lambda p: p.name)
def test_every_shipped_configuration_is_valid(path: Path) -> None:
    # Settings only: the data files are made by `distbelief prepare` (each file says how).
    config = load_config(path, check_data=False)
    assert config.model.layers and config.data.batch_size > 0


# -- [optimizer] as one flat list of keys, before each algorithm owned its own ----------------
# The hashing of that time, frozen here (its key lists as they were), so that a change to
# the declarations that moved a config hash, and with it every checkpoint's resume, fails.

CONFIGS = Path(__file__).parents[1] / "configs"
FLAT_OPTIMIZER_KEYS = (
    "algorithm", "learning_rate", "adagrad", "update", "fetch", "push_dtype", "backup_workers",
    "average_every", "elastic_alpha", "inner_steps", "outer_update", "outer_learning_rate",
    "outer_momentum", "asynchronous", "n_fetch", "n_push", "warm_start_steps", "momentum",
    "nesterov", "beta1", "beta2", "warmup_steps", "schedule", "decay_steps", "decay_rate",
    "min_learning_rate", "m", "work_unit_size", "push_every_units", "backup_copies",
    "line_search", "wolfe_c1", "wolfe_c2", "max_line_search", "gradient_tolerance")
FLAT_OWN_KEYS = {"downpour": ("fetch", "push_dtype"), "sync": ("backup_workers",),
                 "averaging": ("average_every", "elastic_alpha"),
                 "diloco": ("inner_steps", "outer_update", "outer_learning_rate",
                            "outer_momentum", "asynchronous", "push_dtype")}
FLAT_SANDBLASTER_KEYS = ("m", "work_unit_size", "push_every_units", "backup_copies",
                         "line_search", "wolfe_c1", "wolfe_c2", "max_line_search",
                         "gradient_tolerance")
FLAT_SANDBLASTER_UNHASHED = ("work_unit_size", "push_every_units", "backup_copies",
                             "gradient_tolerance")


def flat_hash(config) -> str:
    """config_hash as it was computed when [optimizer] was one flat dataclass."""
    from distbelief.config import settings_hash

    d = config.to_dict()
    opt = {key: d["optimizer"][key] for key in FLAT_OPTIMIZER_KEYS}  # each old key is there
    algorithm = opt["algorithm"]
    dropped = set(FLAT_SANDBLASTER_UNHASHED if algorithm == "sandblaster"
                  else FLAT_SANDBLASTER_KEYS)
    for owner, keys in FLAT_OWN_KEYS.items():
        if owner != algorithm:
            dropped.update(keys)
    dropped.difference_update(FLAT_OWN_KEYS.get(algorithm, ()))
    if algorithm == "diloco" and opt["outer_update"] not in ("nesterov", "delayed_nesterov"):
        dropped.add("outer_momentum")
    if opt["update"] in ("adagrad", "sgd"):
        dropped.add("update")
    for rule, keys in {"momentum": ("momentum", "nesterov"), "adam": ("beta1", "beta2")}.items():
        if opt["update"] != rule:
            dropped.update(keys)
    if opt["fetch"] == "own_pushes":
        dropped.add("fetch")
    defaults = {"warmup_steps": 0, "schedule": "constant", "decay_steps": None,
                "decay_rate": None, "min_learning_rate": None}
    dropped.update(key for key, default in defaults.items() if opt[key] == default)
    if opt["push_dtype"] == "float32":
        dropped.add("push_dtype")
    out = {section: d[section] for section in ("model", "data")}
    out["optimizer"] = {k: v for k, v in opt.items() if k not in dropped}
    out["run"] = {"seed": d["run"]["seed"]}
    if config.data.in_memory:
        out["data"] = {k: v for k, v in out["data"].items()
                       if k not in ("in_memory", "stream_memory_mb")}
    if not config.data.validation:
        out["data"].pop("validation", None)
    return settings_hash(out)


ALGORITHM_VARIANTS = [
    [], ['optimizer.algorithm="downpour"', 'optimizer.fetch="overlapped"'],
    ['optimizer.algorithm="downpour"', 'optimizer.push_dtype="bfloat16"',
     'optimizer.update="adarevision"'],
    ['optimizer.algorithm="sync"', "optimizer.backup_workers=1", "cluster.ps_shards=1"],
    ['optimizer.algorithm="averaging"', "optimizer.elastic_alpha=0.5", "cluster.ps_shards=1"],
    ['optimizer.algorithm="averaging"', "optimizer.average_every=4", "cluster.ps_shards=0"],
    ['optimizer.algorithm="diloco"', 'optimizer.outer_update="sgd"', "cluster.ps_shards=0"],
    ['optimizer.algorithm="diloco"', "optimizer.asynchronous=true", "cluster.ps_shards=1",
     'optimizer.outer_update="delayed_nesterov"', 'optimizer.push_dtype="bfloat16"'],
    ['optimizer.algorithm="sandblaster"', "optimizer.m=4", "optimizer.work_unit_size=64",
     "cluster.ps_shards=1"],
    ['optimizer.algorithm="hogwild"', "cluster.ps_shards=0", 'optimizer.update="adam"'],
    ['optimizer.update="momentum"', 'optimizer.schedule="step"', "optimizer.decay_steps=10"],
]


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_configuration_hashes_as_before_the_keys_had_owners(path: Path) -> None:
    config = load_config(path, check_data=False)
    assert config_hash(config) == flat_hash(config)


@pytest.mark.parametrize("overrides", ALGORITHM_VARIANTS, ids=lambda o: " ".join(o) or "sgd")
def test_each_algorithms_keys_hash_as_before_they_had_owners(overrides: list[str]) -> None:
    config = load_config(CONFIGS / "fashion_mnist_mlp.toml", overrides, check_data=False)
    assert config_hash(config) == flat_hash(config)


def test_sandblasters_keys_are_still_ignored_by_the_other_algorithms() -> None:
    """As before: a file written for Sandblaster also runs the others (compare does)."""
    path = CONFIGS / "fashion_mnist_sandblaster.toml"
    config = load_config(path, ['optimizer.algorithm="sgd"'], check_data=False)
    assert config_hash(config) == flat_hash(config)


def test_the_docs_key_tables_are_the_generated_ones() -> None:
    """docs/configuration.md's [optimizer] tables are what `python -m distbelief.config
    --docs` writes from the declarations: run it after changing a key."""
    from distbelief.config import DOCS_BEGIN, docs_with_key_tables

    page = (CONFIGS.parent / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert DOCS_BEGIN in page
    assert docs_with_key_tables(page) == page, "run: python -m distbelief.config --docs"
    for key in ("learning_rate", "fetch", "backup_workers", "elastic_alpha", "inner_steps",
                "wolfe_c1"):
        assert f"| `optimizer.{key}` |" in page


def test_no_branch_on_an_algorithms_name_is_left_in_config() -> None:
    from distbelief import config

    source = Path(config.__file__).read_text()
    for name in ("sgd", "downpour", "sandblaster", "sync", "averaging", "hogwild", "diloco"):
        assert f'== "{name}"' not in source and f'!= "{name}"' not in source


def test_dcasgd_runs_on_downpours_shards_with_its_lambda_hashed_only_with_it():
    downpour = _optimizer_config(algorithm="downpour", update="dcasgd", dc_lambda=0.1)
    assert downpour.optimizer.dc_lambda == 0.1
    assert hashed_settings(downpour)["optimizer"]["dc_lambda"] == 0.1
    assert "dc_lambda" not in hashed_settings(_optimizer_config(update="sgd"))["optimizer"]
    with pytest.raises(ConfigError, match="optimizer.dc_lambda applies only"):
        _optimizer_config(algorithm="downpour", dc_lambda=0.1)
    with pytest.raises(ConfigError, match="runs on Downpour's parameter-server shards"):
        _optimizer_config(update="dcasgd")
