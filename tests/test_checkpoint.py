"""Checkpoints: the format (parts, manifest, h5ls-readable), the atomic multi-writer commit
interrupted at every phase (exceptions and SIGKILL), damaged and mismatched checkpoints,
retention and leftovers, re-slicing to another shard count, and `inspect`."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
from helpers import flip_bytes
from helpers.checkpoint import HASH, LAYOUT, PHASES, SETTINGS, break_commit, save, state_for
from helpers.configs import small_config_text
from helpers.mpi_jobs import run_cli, run_mpi

from distbelief.algorithms.common import check_replica_count
from distbelief.config import settings_hash
from distbelief.model.layout import ParamLayout, balanced_ranges
from distbelief.records import checkpoint as ckpt


def assert_holds(found: ckpt.Checkpoint, step: int) -> None:
    """`found` verifies and holds exactly what save() wrote for `step`."""
    params, accum = state_for(step)
    assert found.step == step and found.samples == step * 4
    assert found.wall_seconds == step * 0.5
    got_params, got_state = found.read_state()
    assert np.array_equal(got_params, params)
    assert np.array_equal(got_state["accum"], accum)
    assert ckpt.verify(found.path).step == step


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "run" / ckpt.CHECKPOINTS_DIR


# -- the format ----------------------------------------------------------------------------------


def test_round_trip_with_several_shards_and_replicas(root: Path) -> None:
    rng = np.random.default_rng(42)
    rng.random(5)
    path = save(root, 12, shards=3, replicas=2, rng_state=rng.bit_generator.state)
    assert path == root / "ckpt-0000000012"
    assert sorted(p.name for p in path.iterdir()) == [
        "manifest.json", "replica-0000.h5", "replica-0001.h5", "shard-0000.h5",
        "shard-0001.h5", "shard-0002.h5"]
    found, damaged = ckpt.find_latest(root)
    assert damaged == []
    assert_holds(found, 12)
    assert found.shard_ranges == balanced_ranges(LAYOUT.size, 3)
    replica = found.read_replica(1)
    assert replica.data_state == {"epoch": 12, "position": 1}
    assert replica.counters == {"step": 12}
    assert np.array_equal(replica.arrays["pending"], np.full(3, 1, np.float32))
    # The RNG continues exactly where it was saved.
    restored = np.random.default_rng()
    restored.bit_generator.state = replica.rng_state
    assert np.array_equal(restored.random(4), rng.random(4))
    with h5py.File(path / "shard-0001.h5", "r") as f:
        assert {k: int(v) for k, v in f["counters"].attrs.items()} == {"version": 13}


def test_every_replica_in_one_part_when_one_rank_writes_them_all(root: Path) -> None:
    # 200 replicas (two lost): one replicas.h5 with a group each, so a commit creates,
    # syncs and hashes 1 file for them rather than 198, and each reads back as its own.
    params, accum = state_for(5)
    meta = ckpt.CheckpointMeta(5, 20, 2.5, HASH)
    partial = ckpt.prepare(root, 5)
    rng = np.random.default_rng(3)
    kept = [i for i in range(200) if i not in (7, 150)]
    states = [ckpt.ReplicaState(i, {"local_steps": 10 * i}, {"epoch": 1, "position": i},
                                rng.bit_generator.state if i == 9 else None,
                                {"pending": np.full(2, i, np.float32)} if i == 9 else {})
              for i in kept]
    records = [ckpt.write_shard_part(partial, meta, 0, 0, LAYOUT.size, params,
                                     {"accum": accum}),
               ckpt.write_replicas_part(partial, meta, states)]
    path = ckpt.commit(root, meta, settings=SETTINGS, algorithm="downpour", layout=LAYOUT,
                       shard_ranges=[(0, LAYOUT.size)], optimizer_state=["accum"],
                       parts=records, num_replicas=200, keep=3, lost_replicas=[7, 150])
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "replicas.h5",
                                                      "shard-0000.h5"]
    found = ckpt.verify(path)
    assert found.num_replicas == 200 and not found.has_replica(7) and found.has_replica(8)
    for i in (0, 8, 199):
        replica = found.read_replica(i)
        assert replica.counters == {"local_steps": 10 * i}
        assert replica.data_state == {"epoch": 1, "position": i}
        assert replica.rng_state is None and replica.arrays == {}
    nine = found.read_replica(9)
    assert nine.rng_state == rng.bit_generator.state
    assert np.array_equal(nine.arrays["pending"], np.full(2, 9, np.float32))
    with pytest.raises(ckpt.CheckpointError, match="has no replica 150"):
        found.read_replica(150)
    # A part that is not what the manifest says is refused by name, as a replica file's is.
    os.truncate(path / "replicas.h5", 100)
    with pytest.raises(ckpt.CheckpointError, match="replicas.h5"):
        ckpt.verify(path)


def test_parts_waiting_for_their_release_are_unreleased_not_lost(root: Path) -> None:
    # cluster.release_spares_at: 3 parts, part 2 not released yet, part 1 lost. Both have
    # no state and count in the replicas (a resume at this layout restores part 0
    # exactly), but only part 1 is lost (a resume says so); part 2 starts on a fresh pass
    # when released, as in a fresh run (spares.part_start).
    from distbelief.algorithms.downpour.spares import part_start

    params, accum = state_for(5)
    meta = ckpt.CheckpointMeta(5, 20, 2.5, HASH)
    partial = ckpt.prepare(root, 5)
    records = [ckpt.write_shard_part(partial, meta, 0, 0, LAYOUT.size, params,
                                     {"accum": accum}),
               ckpt.write_replicas_part(partial, meta, [ckpt.ReplicaState(
                   0, {"local_steps": 4}, {"epoch": 2, "position": 9}, None, {})])]
    path = ckpt.commit(root, meta, settings=SETTINGS, algorithm="downpour", layout=LAYOUT,
                       shard_ranges=[(0, LAYOUT.size)], optimizer_state=["accum"],
                       parts=records, num_replicas=3, keep=3, lost_replicas=[1],
                       unreleased_replicas=[2])
    found = ckpt.verify(path)
    assert (found.manifest["lost_replicas"], found.manifest["unreleased_replicas"]) == (
        [1], [2])
    assert found.num_replicas == 3 and [found.has_replica(r) for r in range(3)] == [
        True, False, False]
    plan = SimpleNamespace(num_replicas=3)
    assert part_start(found, plan, 10, 0, 20) == (2, 9, 4)
    assert part_start(found, plan, 10, 2, 20) == (3, 0, 0)  # a pass no epoch used
    text = ckpt.describe(ckpt.inspect_checkpoint(path))
    assert "lost replicas (no part; a resume starts them afresh): 1\n" in text
    assert "unreleased replicas (no part; cluster.release_spares_at releases them): 2" in text
    # Without any, the manifest has no such key, as before.
    assert "unreleased_replicas" not in json.loads(
        (save(root, 6) / "manifest.json").read_text())


def test_manifest_records_everything_the_brief_asks_for(root: Path) -> None:
    path = save(root, 30, shards=2)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == "distbelief-checkpoint" and manifest["version"] == 1
    assert (manifest["step"], manifest["samples"], manifest["wall_seconds"]) == (30, 120, 15.0)
    assert manifest["config_hash"] == HASH and manifest["config"] == SETTINGS
    assert manifest["layout"] == LAYOUT.to_records()
    assert manifest["num_params"] == LAYOUT.size
    assert [(s["start"], s["stop"]) for s in manifest["shards"]] == balanced_ranges(
        LAYOUT.size, 2)
    # Sizes and checksums are those of the files on disk, computed independently here.
    assert set(manifest["parts"]) == {"shard-0000.h5", "shard-0001.h5", "replica-0000.h5"}
    for name, entry in manifest["parts"].items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_parts_hold_only_plain_datasets_and_attributes(root: Path) -> None:
    path = save(root, 3, shards=2)
    seen = {}

    def visit(name: str, obj: object) -> None:
        seen[name] = type(obj).__name__
        if isinstance(obj, h5py.Dataset):
            assert obj.dtype == np.float32 and obj.ndim == 1 and obj.compression is None
        for value in obj.attrs.values():
            assert isinstance(value, (str, np.integer)), (name, value)

    for part in ("shard-0001.h5", "replica-0000.h5"):
        with h5py.File(path / part, "r") as f:
            visit("/", f)
            f.visititems(visit)
    assert seen["params"] == "Dataset" and seen["optimizer/accum"] == "Dataset"
    assert seen["arrays/pending"] == "Dataset" and seen["data"] == "Group"


def test_h5ls_reads_the_parts(root: Path, h5ls: str) -> None:
    path = save(root, 3)
    out = subprocess.run([h5ls, "-r", str(path / "shard-0000.h5")], capture_output=True,
                         text=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    assert f"/params                  Dataset {{{LAYOUT.size}}}" in out.stdout
    assert "/optimizer/accum" in out.stdout


def test_write_part_checks_its_arrays(root: Path) -> None:
    partial = ckpt.prepare(root, 1)
    meta = ckpt.CheckpointMeta(1, 1, 0.0, HASH)
    with pytest.raises(ValueError, match="float32 of shape"):
        ckpt.write_shard_part(partial, meta, 0, 0, 10, np.zeros(10), {})
    with pytest.raises(ValueError, match="optimizer state 'accum'"):
        ckpt.write_shard_part(partial, meta, 0, 0, 10, np.zeros(10, np.float32),
                              {"accum": np.zeros(9, np.float32)})
    with pytest.raises(ckpt.CheckpointError, match="prepare"):
        ckpt.write_shard_part(root / "nowhere.partial", meta, 0, 0, 1, np.zeros(1, np.float32),
                              {})


# -- re-sharding ---------------------------------------------------------------------------------


@pytest.mark.parametrize("saved_shards, loaded_shards", [(1, 4), (3, 2), (4, 7), (5, 5)])
def test_a_run_with_another_shard_count_reads_its_own_ranges(root: Path, saved_shards: int,
                                                              loaded_shards: int) -> None:
    save(root, 8, shards=saved_shards)
    found, _ = ckpt.find_latest(root)
    params, accum = state_for(8)
    for a, b in balanced_ranges(LAYOUT.size, loaded_shards):
        got_params, got_state = found.read_range(a, b)
        assert np.array_equal(got_params, params[a:b])
        assert np.array_equal(got_state["accum"], accum[a:b])
    with pytest.raises(ValueError, match="outside"):
        found.read_range(0, LAYOUT.size + 1)


@pytest.mark.parametrize("total, before, after", [(1000, 3, 7), (17, 17, 1), (64, 1, 64)])
def test_assemble_and_split(total: int, before: int, after: int) -> None:
    vector = np.random.default_rng(total).standard_normal(total).astype(np.float32)
    pieces = [(a, b, vector[a:b].copy()) for a, b in balanced_ranges(total, before)]
    pieces.reverse()  # any order
    full = ckpt.assemble(pieces, total)
    assert np.array_equal(full, vector)
    resliced = ckpt.split(full, balanced_ranges(total, after))
    assert len(resliced) == after
    assert np.array_equal(np.concatenate(resliced), vector)
    assert ckpt.assemble([(a, b, s) for (a, b), s in
                          zip(balanced_ranges(total, after), resliced, strict=True)],
                         total).tobytes() == vector.tobytes()


def test_assemble_refuses_gaps_and_overlaps() -> None:
    ones = np.ones(5, np.float32)
    with pytest.raises(ValueError, match="tile"):
        ckpt.assemble([(0, 5, ones), (6, 11, ones)], 11)  # gap
    with pytest.raises(ValueError, match="tile"):
        ckpt.assemble([(0, 5, ones), (4, 9, ones)], 9)  # overlap
    with pytest.raises(ValueError, match="end at 5"):
        ckpt.assemble([(0, 5, ones)], 6)  # short
    with pytest.raises(ValueError, match="tile"):
        ckpt.split(np.zeros(10), [(0, 4), (5, 10)])


# -- retention and leftovers ---------------------------------------------------------------------


def test_keep_checkpoints_is_honoured(root: Path) -> None:
    for step in (10, 20, 30, 40, 50):
        save(root, step, keep=2)
        steps = [s for s, _ in ckpt.list_checkpoints(root)]
        assert steps == [s for s in (50, 40, 30, 20, 10) if s <= step][:2]
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-0000000040", "ckpt-0000000050"]
    with pytest.raises(ValueError, match="at least 2"):
        save(root, 60, keep=1)


def test_leftovers_are_never_loaded_and_are_cleaned(root: Path) -> None:
    save(root, 10)
    # A newer, complete-looking .partial and a half-deleted checkpoint from a killed run.
    shutil.copytree(save(root, 20), root / "ckpt-0000000099.partial")
    shutil.copytree(root / "ckpt-0000000010", root / "ckpt-0000000005.deleting")
    found, damaged = ckpt.find_latest(root)
    assert found.step == 20 and damaged == []
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [20, 10]
    removed = ckpt.clean_leftovers(root)
    assert sorted(p.name for p in removed) == ["ckpt-0000000005.deleting",
                                               "ckpt-0000000099.partial"]
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-0000000010", "ckpt-0000000020"]


def test_prepare_replaces_a_stale_partial_of_the_same_step(root: Path) -> None:
    stale = root / "ckpt-0000000007.partial"
    stale.mkdir(parents=True)
    (stale / "shard-0000.h5").write_bytes(b"half a file")
    save(root, 7)
    assert not stale.exists()
    assert_holds(ckpt.find_latest(root)[0], 7)


def test_a_step_is_committed_once(root: Path) -> None:
    save(root, 7)
    with pytest.raises(ckpt.CheckpointError, match="exists already"):
        save(root, 7)
    assert_holds(ckpt.find_latest(root)[0], 7)


def test_commit_refuses_missing_or_short_parts(root: Path) -> None:
    save(root, 1)
    meta = ckpt.CheckpointMeta(2, 8, 1.0, HASH)
    partial = ckpt.prepare(root, 2)
    params, accum = state_for(2)
    shard = ckpt.write_shard_part(partial, meta, 0, 0, LAYOUT.size, params, {"accum": accum})
    replica = ckpt.write_replica_part(partial, meta, 0, {"epoch": 0})
    kwargs = {"settings": SETTINGS, "algorithm": "sgd", "layout": LAYOUT,
              "shard_ranges": [(0, LAYOUT.size)], "optimizer_state": ["accum"],
              "num_replicas": 1, "keep": 3}
    with pytest.raises(ckpt.CheckpointError, match="reported parts"):
        ckpt.commit(root, meta, parts=[shard], **kwargs)  # the replica never reported
    os.truncate(partial / "replica-0000.h5", 100)
    with pytest.raises(ckpt.CheckpointError, match="replica-0000.h5 is 100 bytes"):
        ckpt.commit(root, meta, parts=[shard, replica], **kwargs)
    with pytest.raises(ValueError, match=f"end at {LAYOUT.size - 1}"):
        ckpt.commit(root, meta, parts=[shard, replica],
                    **{**kwargs, "shard_ranges": [(0, LAYOUT.size - 1)]})
    assert_holds(ckpt.find_latest(root)[0], 1)


# -- interrupted commits -------------------------------------------------------------------------

COMMITTED = {"after the rename, before retention", "half-way through deleting an old one"}


class Interrupted(Exception):
    pass


def _check_after_interruption(root: Path, phase: str) -> None:
    found, damaged = ckpt.find_latest(root)
    assert damaged == []
    assert_holds(found, 30 if phase in COMMITTED else 20)
    ckpt.clean_leftovers(root)
    save(root, 40, keep=2)  # the next checkpoint goes through as usual
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [40, 30 if phase in COMMITTED else 20]
    assert_holds(ckpt.find_latest(root)[0], 40)


@pytest.mark.parametrize("phase", PHASES)
def test_an_exception_at_any_phase_keeps_the_previous_checkpoint(
        root: Path, monkeypatch: pytest.MonkeyPatch, phase: str) -> None:
    save(root, 10, keep=2)
    save(root, 20, keep=2)

    def stop() -> None:
        raise Interrupted(phase)

    with monkeypatch.context() as patch:
        break_commit(patch, phase, stop)
        with pytest.raises(Interrupted):
            save(root, 30, shards=2, keep=2)
    _check_after_interruption(root, phase)


KILL_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import pytest
from helpers.checkpoint import break_commit, save
from pathlib import Path
root = Path({root!r})
with pytest.MonkeyPatch.context() as patch:
    break_commit(patch, {phase!r}, lambda: os.kill(os.getpid(), signal.SIGKILL))
    save(root, 30, shards=2, keep=2)
print("not killed")
"""


@pytest.mark.parametrize("phase", PHASES)
def test_sigkill_at_any_phase_keeps_the_previous_checkpoint(root: Path, phase: str) -> None:
    save(root, 10, keep=2)
    save(root, 20, keep=2)
    script = KILL_SCRIPT.format(tests=str(Path(__file__).parent), root=str(root), phase=phase)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == -signal.SIGKILL, result.stdout + result.stderr
    _check_after_interruption(root, phase)


# -- damaged and mismatched checkpoints ---------------------------------------------------------


def _edit_manifest_step(path: Path) -> None:
    text = (path / "manifest.json").read_text()
    (path / "manifest.json").write_text(text.replace('"step": 20', '"step": 21'))


DAMAGE = {
    "truncated part": (lambda p: os.truncate(p / "shard-0001.h5", 1000),
                       "shard-0001.h5 is 1000 bytes"),
    "flipped bytes": (lambda p: flip_bytes(p / "shard-0000.h5"),
                      "shard-0000.h5 fails its sha256 checksum"),
    "missing manifest": (lambda p: (p / "manifest.json").unlink(), "manifest.json is missing"),
    "unreadable manifest": (lambda p: (p / "manifest.json").write_text('{"format": "dist'),
                            "manifest.json is unreadable"),
    "edited manifest": (_edit_manifest_step, "fails its own checksum"),
    "missing part": (lambda p: (p / "replica-0000.h5").unlink(), "replica-0000.h5 is missing"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_reported_and_the_previous_one_used(root: Path,
                                                                    damage: str) -> None:
    save(root, 10, shards=2)
    newest = save(root, 20, shards=2)
    harm, message = DAMAGE[damage]
    harm(newest)
    found, damaged = ckpt.find_latest(root)
    assert_holds(found, 10)
    assert [path for path, _ in damaged] == [newest]
    assert str(newest) in damaged[0][1] and message in damaged[0][1]
    with pytest.raises(ckpt.CheckpointError, match=message):
        ckpt.verify(newest)


def test_verifying_only_some_parts(root: Path) -> None:
    path = save(root, 10, shards=3)
    os.truncate(path / "shard-0002.h5", 10)
    assert ckpt.verify(path, parts=["shard-0000.h5", "shard-0001.h5"]).step == 10
    with pytest.raises(ckpt.CheckpointError, match="shard-0002.h5 is 10 bytes"):
        ckpt.verify(path, parts=["shard-0002.h5"])
    with pytest.raises(ckpt.CheckpointError, match="has no part shard-0009.h5"):
        ckpt.verify(path, parts=["shard-0009.h5"])


def test_with_every_checkpoint_damaged_none_is_loaded(root: Path) -> None:
    for step in (10, 20):
        os.truncate(save(root, step) / "shard-0000.h5", 10)
    found, damaged = ckpt.find_latest(root)
    assert found is None and len(damaged) == 2


def test_set_aside_keeps_a_damaged_checkpoint_out_of_the_way(root: Path) -> None:
    first = save(root, 10)
    aside = ckpt.set_aside(first)
    assert aside.name == "ckpt-0000000010.damaged" and (aside / "manifest.json").exists()
    assert ckpt.list_checkpoints(root) == []
    assert ckpt.set_aside(save(root, 10)).name == "ckpt-0000000010.damaged-2"


def test_a_different_model_is_refused_naming_both(root: Path) -> None:
    found = ckpt.verify(save(root, 5))
    found.check_compatible(SETTINGS, LAYOUT)  # the same: no error
    other = ParamLayout([(0, "weights", (9, 5)), (0, "bias", (9,)), (1, "weights", (3, 9)),
                         (1, "bias", (3,))])
    with pytest.raises(ckpt.CheckpointMismatch) as info:
        found.check_compatible(SETTINGS, other)
    assert str(found.path) in str(info.value)
    assert "(7, 5) in the checkpoint" in str(info.value) and "(9, 5)" in str(info.value)
    smaller = ParamLayout([(0, "weights", (7, 5))])
    with pytest.raises(ckpt.CheckpointMismatch, match="4 parameter arrays .* this run's model 1"):
        found.check_compatible(SETTINGS, smaller)


def test_a_different_configuration_is_refused_naming_what_changed(root: Path) -> None:
    found = ckpt.verify(save(root, 5))
    changed = {**SETTINGS, "optimizer": {"learning_rate": 0.1}}
    with pytest.raises(ckpt.CheckpointMismatch) as info:
        found.check_compatible(changed, LAYOUT)
    message = str(info.value)
    assert HASH[:12] in message and settings_hash(changed)[:12] in message
    assert "optimizer.learning_rate: 0.05 -> 0.1" in message
    assert isinstance(info.value, ckpt.UserError)


def test_a_part_swapped_in_from_another_checkpoint_is_caught(root: Path) -> None:
    older = save(root, 10)
    newer = save(root, 20)
    shutil.copy(older / "shard-0000.h5", newer / "shard-0000.h5")
    manifest = json.loads((newer / "manifest.json").read_text())
    data = (newer / "shard-0000.h5").read_bytes()
    manifest["parts"]["shard-0000.h5"] = {"size": len(data),
                                          "sha256": hashlib.sha256(data).hexdigest()}
    manifest["manifest_sha256"] = ckpt._manifest_digest(manifest)
    (newer / "manifest.json").write_text(json.dumps(manifest))
    found = ckpt.verify(newer)  # the checksums agree: only the part's own header can tell
    with pytest.raises(ckpt.CheckpointError, match="header"):
        found.read_state()


# -- inspect -------------------------------------------------------------------------------------


def test_inspect_a_valid_checkpoint(root: Path) -> None:
    path = save(root, 12, shards=2)
    result = run_cli(["inspect", path], timeout=60)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith(f"{path}: VALID")
    assert "step 12, 48 samples, 6.0s of training" in out
    assert f"config hash {HASH}" in out
    assert f"4 arrays, {LAYOUT.size:,d} parameters" in out and "layer 1" in out
    a, b = balanced_ranges(LAYOUT.size, 2)[1]
    assert f"shard 1: [{a:,d}, {b:,d})  shard-0001.h5" in out
    assert out.count("  ok") == 3


def test_inspect_a_run_folder_with_a_damaged_newest_checkpoint(root: Path) -> None:
    save(root, 10)
    flip_bytes(save(root, 20) / "shard-0000.h5")
    (root / "ckpt-0000000030.partial").mkdir()
    result = run_cli(["inspect", root.parent], timeout=60)
    assert result.returncode == 1, result.stderr
    blocks = result.stdout.split("\n\n")
    assert blocks[0].startswith(f"{root / 'ckpt-0000000020'}: NOT VALID")
    assert "fails its sha256 checksum" in blocks[0]
    assert blocks[1].startswith(f"{root / 'ckpt-0000000010'}: VALID")
    assert "ckpt-0000000030.partial: NOT VALID" in blocks[2] and "incomplete" in blocks[2]


def test_inspect_a_folder_without_checkpoints(tmp_path: Path) -> None:
    result = run_cli(["inspect", tmp_path], timeout=60)
    assert result.returncode == 2
    assert "holds no checkpoint" in result.stderr and "Traceback" not in result.stderr


def test_the_module_uses_no_mpi_and_no_pickle() -> None:
    source = Path(ckpt.__file__).read_text()
    assert "mpi4py" not in source and "pickle" not in source
    code = textwrap.dedent("""
        import sys, distbelief.records.checkpoint
        print('mpi4py.MPI' in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "False"


# -- training runs: resume, signals, the command line --------------------------------------------

TRAIN_TOML = small_config_text(
    24, 3, data={"batch_size": 16}, optimizer={"algorithm": None}, cluster=None,
    run={"max_steps": 200, "eval_every_seconds": 0.05, "progress_every_seconds": 0.05})


@pytest.fixture(scope="module")
def data_dir(synthetic_folder) -> Path:
    # 500 rows in batches of 16: a run of 200 steps crosses several epochs, so the data
    # position restored on resume includes the epoch.
    return synthetic_folder("ckpt_train", {"exp.toml": TRAIN_TOML}, n_train=500, n_test=100,
                            input_shape=(10,), num_classes=3, seed=5)


def train_config(data_dir: Path, out: Path, *overrides: str):
    import tomllib

    from distbelief.config import apply_overrides, config_from_dict

    raw = apply_overrides(tomllib.loads(TRAIN_TOML), [f'run.out_dir="{out}"', *overrides])
    return config_from_dict(raw, data_dir / "exp.toml")


def train_in_process(data_dir: Path, out: Path, *overrides: str, resume: str = "auto"):
    """(summary, printed output) of a single-process run."""
    import io

    from distbelief.algorithms.sgd import train

    stream = io.StringIO()
    summary = train(train_config(data_dir, out, *overrides), stream=stream, resume=resume)
    return summary, stream.getvalue()


def final_state(out: Path) -> tuple[int, np.ndarray, np.ndarray, dict]:
    """(step, params, Adagrad accumulator, data position) of a run's newest checkpoint."""
    found, damaged = ckpt.find_latest(ckpt.checkpoint_root(out))
    assert found is not None and damaged == []
    params, state = found.read_state()
    return found.step, params, state["accum"], found.read_replica(0).data_state


def assert_same_training(a: Path, b: Path) -> None:
    step_a, params_a, accum_a, data_a = final_state(a)
    step_b, params_b, accum_b, data_b = final_state(b)
    assert step_a == step_b
    assert np.array_equal(params_a, params_b)
    assert np.array_equal(accum_a, accum_b)
    assert data_a == data_b


def metrics_of(out: Path) -> list[dict]:
    from distbelief.records.metrics import read_metrics

    return read_metrics(out / "metrics.jsonl")


@pytest.fixture(scope="module")
def straight_run(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200 steps without interruption: what every resumed run must reproduce bit for bit."""
    out = tmp_path_factory.mktemp("straight") / "out"
    train_in_process(data_dir, out)
    return out


def test_half_and_resume_is_bit_identical(data_dir: Path, tmp_path: Path,
                                          straight_run: Path) -> None:
    out = tmp_path / "halves"
    first, _ = train_in_process(data_dir, out, "run.max_steps=100")
    assert first["steps"] == 100 and final_state(out)[0] == 100
    summary, printed = train_in_process(data_dir, out)
    assert "resuming from" in printed and "ckpt-0000000100" in printed
    assert summary["steps"] == 200 and summary["samples"] == 200 * 16
    assert summary["resumed_from"].endswith("ckpt-0000000100")
    assert_same_training(out, straight_run)
    # The metrics continue: one resume line, steps and times increasing, the wall time
    # of both halves in the summary.
    lines = metrics_of(out)
    assert [x["step"] for x in lines if x["kind"] == "resume"] == [100]
    times = [x["time"] for x in lines]
    assert times == sorted(times)
    train_steps = [x["step"] for x in lines if x["kind"] == "train"]
    assert train_steps == sorted(set(train_steps)) and train_steps[-1] == 200
    # The resumed run counts on from the training time its checkpoint recorded (not from
    # the first run's summary, which also holds the time spent writing that checkpoint).
    halfway = ckpt.read_manifest(out / "checkpoints" / ckpt.checkpoint_name(100))
    assert 0 < halfway["wall_seconds"] < summary["wall_seconds"]


def test_resume_from_a_periodic_checkpoint_of_a_killed_run(data_dir: Path, tmp_path: Path,
                                                           straight_run: Path) -> None:
    out = tmp_path / "killed"
    train_in_process(data_dir, out, "run.max_steps=130", "run.checkpoint_every_steps=50")
    assert [s for s, _ in ckpt.list_checkpoints(out / "checkpoints")] == [130, 100, 50]
    # As if killed between step 100's checkpoint and the end: the newest is the periodic
    # one, the metrics run on to step 130.
    shutil.rmtree(out / "checkpoints" / "ckpt-0000000130")
    after = [x for x in metrics_of(out) if x["step"] > 100]
    assert after
    summary, _ = train_in_process(data_dir, out, "run.checkpoint_every_steps=50")
    assert summary["steps"] == 200
    assert_same_training(out, straight_run)
    # keep_checkpoints = 3 (the default); 150 and 200 came from the resumed run.
    assert [s for s, _ in ckpt.list_checkpoints(out / "checkpoints")] == [200, 150, 100]
    # What the killed run logged after its checkpoint was moved aside, not lost.
    discarded = [json.loads(t) for t in
                 (out / "metrics.discarded.jsonl").read_text().splitlines()]
    assert discarded[0]["kind"] == "discarded" and discarded[1:] == after
    steps = [x["step"] for x in metrics_of(out) if x["kind"] == "train"]
    assert steps == sorted(set(steps))


def test_a_damaged_newest_checkpoint_falls_back_and_is_set_aside(data_dir: Path,
                                                                tmp_path: Path,
                                                                straight_run: Path) -> None:
    out = tmp_path / "damaged"
    train_in_process(data_dir, out, "run.max_steps=120", "run.checkpoint_every_steps=60")
    newest = out / "checkpoints" / "ckpt-0000000120"
    flip_bytes(newest / "shard-0000.h5")
    summary, printed = train_in_process(data_dir, out)
    assert f"warning: checkpoint {newest} is damaged" in printed
    assert "fails its sha256 checksum" in printed
    assert "resuming from" in printed and "ckpt-0000000060 at step 60" in printed
    assert summary["resumed_from"].endswith("ckpt-0000000060")
    assert (out / "checkpoints" / "ckpt-0000000120.damaged").is_dir()
    assert_same_training(out, straight_run)


def test_all_checkpoints_damaged_is_an_error_not_a_silent_restart(data_dir: Path,
                                                                  tmp_path: Path) -> None:
    out = tmp_path / "ruined"
    train_in_process(data_dir, out, "run.max_steps=20")
    (out / "checkpoints" / "ckpt-0000000020" / "manifest.json").unlink()
    with pytest.raises(ckpt.CheckpointError, match="all 1 are damaged.*--fresh"):
        train_in_process(data_dir, out)


def test_a_finished_run_resumed_trains_no_further_step(data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "done"
    train_in_process(data_dir, out, "run.max_steps=30")
    before = final_state(out)
    summary, _ = train_in_process(data_dir, out, "run.max_steps=30")
    assert summary["steps"] == 30 and summary["stop_reason"] == "max_steps"
    after = final_state(out)
    assert np.array_equal(before[1], after[1])
    assert [s for s, _ in ckpt.list_checkpoints(out / "checkpoints")] == [30]


def test_resume_refuses_another_model_and_leaves_the_run_alone(data_dir: Path,
                                                               tmp_path: Path) -> None:
    out = tmp_path / "model"
    train_in_process(data_dir, out, "run.max_steps=20")
    config_before = (out / "config.json").read_text()
    other = 'model.layers=[{type="dense", units=8, activation="relu"}, ' \
            '{type="dense", units=3, activation="softmax"}]'
    with pytest.raises(ckpt.CheckpointMismatch, match="different model.*--fresh"):
        train_in_process(data_dir, out, other)
    with pytest.raises(ckpt.CheckpointMismatch,
                       match=r"optimizer.learning_rate: 0.05 -> 0.07"):
        train_in_process(data_dir, out, "optimizer.learning_rate=0.07")
    assert (out / "config.json").read_text() == config_before
    # A longer budget, other cadences and another shard count are not "another model".
    summary, _ = train_in_process(data_dir, out, "run.max_steps=40", "cluster.ps_shards=3",
                                  "run.checkpoint_every_seconds=5")
    assert summary["steps"] == 40


def test_fresh_moves_the_previous_run_aside(data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "fresh"
    train_in_process(data_dir, out, "run.max_steps=20")
    summary, printed = train_in_process(data_dir, out, "run.max_steps=10", resume="fresh")
    assert summary["steps"] == 10 and summary["resumed_from"] is None
    archived = [p for p in out.iterdir() if p.name.startswith("previous-")]
    assert len(archived) == 1 and str(archived[0]) in printed
    assert json.loads((archived[0] / "summary.json").read_text())["steps"] == 20
    assert ckpt.find_latest(archived[0] / "checkpoints")[0].step == 20
    assert final_state(out)[0] == 10


def test_require_without_a_checkpoint_is_an_error(data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ckpt.CheckpointError, match="--resume: there is no checkpoint"):
        train_in_process(data_dir, tmp_path / "none", resume="require")


def test_leftovers_of_a_killed_commit_are_cleaned_at_start(data_dir: Path,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "left"
    train_in_process(data_dir, out, "run.max_steps=20")
    junk = out / "checkpoints" / "ckpt-0000000025.partial"
    junk.mkdir()
    (junk / ".shard-0000.h5.tmp").write_bytes(b"half")
    summary, _ = train_in_process(data_dir, out, "run.max_steps=25")
    assert summary["steps"] == 25 and not junk.exists()
    assert final_state(out)[0] == 25


def test_periodic_checkpoints_by_time(data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "timed"
    summary, _ = train_in_process(data_dir, out, "run.max_steps=0", "run.max_seconds=1.0",
                                  "run.checkpoint_every_seconds=0.2", "run.keep_checkpoints=50")
    marks = [x for x in metrics_of(out) if x["kind"] == "checkpoint"]
    # A periodic one (about 4 fit in the 1 s; 1 on a machine so busy that a write takes
    # 0.5 s) and the final one. How many fit depends on the load; that none comes sooner
    # than 0.2 s after the start or the previous one does not: the next is scheduled
    # once the previous one is written.
    assert len(marks) >= 2, marks
    times = [0.0] + [x["time"] for x in marks[:-1]]
    assert all(b - a >= 0.2 for a, b in itertools.pairwise(times)), times
    assert marks[-1]["step"] == summary["steps"]
    assert len(ckpt.list_checkpoints(out / "checkpoints")) == len(marks)


def test_stop_signals_only_set_a_flag() -> None:
    from distbelief.algorithms.common import StopSignals

    before = signal.getsignal(signal.SIGUSR1)
    with StopSignals() as signals:
        assert signals.received is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert signals.received == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) is before


# -- through the command line ----------------------------------------------------------------------


def cli_train(data_dir: Path, out: Path, *args: str):
    return run_cli(["train", data_dir / "exp.toml", "--set", f'run.out_dir="{out}"', *args],
                   timeout=120)


def test_cli_half_and_resume_is_bit_identical(data_dir: Path, tmp_path: Path,
                                              straight_run: Path) -> None:
    out = tmp_path / "cli"
    result = cli_train(data_dir, out, "--set", "run.max_steps=100")
    assert result.returncode == 0, result.stderr
    result = cli_train(data_dir, out, "--resume")
    assert result.returncode == 0, result.stderr
    assert "resuming from" in result.stdout and "after 200 steps" in result.stdout
    assert_same_training(out, straight_run)


def test_cli_resume_without_checkpoint_and_resume_with_fresh(data_dir: Path,
                                                             tmp_path: Path) -> None:
    result = cli_train(data_dir, tmp_path / "none", "--resume")
    assert result.returncode == 2
    assert result.stderr.startswith("distbelief: error: train --resume: there is no checkpoint")
    result = cli_train(data_dir, tmp_path / "none", "--resume", "--fresh")
    assert result.returncode == 2 and "not allowed with argument" in result.stderr


def test_cli_refuses_another_model_with_one_message(data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli_model"
    assert cli_train(data_dir, out, "--set", "run.max_steps=10").returncode == 0
    result = cli_train(data_dir, out, "--set", "optimizer.adagrad=false")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "ckpt-0000000010" in lines[0] and "optimizer.adagrad: true -> false" in lines[0]


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
def test_signal_stops_with_a_checkpoint_and_a_rerun_continues(
        data_dir: Path, tmp_path: Path, sig: signal.Signals) -> None:
    import time

    from helpers.mpi_jobs import job_env

    out = tmp_path / "signalled"
    cmd = [sys.executable, "-m", "distbelief", "train", str(data_dir / "exp.toml"), "--set",
           f'run.out_dir="{out}"', "--set", "run.max_steps=100000000",
           "--set", "run.eval_every_seconds=60"]
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=job_env())
        try:
            deadline = time.monotonic() + 60
            # A training line means the loop (and so the signal handler) is running.
            while not (out / "metrics.jsonl").exists() or "train" not in \
                    (out / "metrics.jsonl").read_text():
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            proc.send_signal(sig)
            sent = time.monotonic()
            returncode = proc.wait(timeout=30)
            waited = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    output = (tmp_path / "log").read_text()
    assert returncode == 0, output
    assert waited < 10, f"took {waited:.1f}s to stop"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == sig.name
    step = summary["steps"]
    assert step > 0 and final_state(out)[0] == step
    assert f"stopped ({sig.name}) after {step} steps" in output

    # A rerun (the requeued job) continues from there, and computes exactly what a run
    # that was never stopped computes.
    result = cli_train(data_dir, out, "--set", f"run.max_steps={step + 40}")
    assert result.returncode == 0, result.stderr
    assert f"at step {step}," in result.stdout
    assert json.loads((out / "summary.json").read_text())["steps"] == step + 40
    train_in_process(data_dir, tmp_path / "unstopped", f"run.max_steps={step + 40}")
    assert_same_training(out, tmp_path / "unstopped")


def test_a_resume_drops_lines_written_after_the_checkpoint_even_of_earlier_steps(
        tmp_path: Path) -> None:
    # Downpour evaluates a snapshot in a thread: the line of an evaluation of step 20 can
    # be written after the checkpoint of step 20. A run resumed from that checkpoint must
    # not keep it, or times in metrics.jsonl would go backwards.
    from distbelief.records.metrics import ResumePoint, RunRecorder, read_metrics

    with RunRecorder(tmp_path, stream=None) as recorder:
        recorder.log(20, 200, 0.9)
        at = recorder.elapsed()
        recorder.log_event("checkpoint", 20, 200, at=at)
        recorder.log_eval(20, 200, 0.9, {"loss": 0.9, "accuracy": 0.6})  # finished after the checkpoint
    recorder = RunRecorder(tmp_path, stream=None,
                           resume=ResumePoint(20, 200, at, "ckpt-0000000020"))
    recorder.close()
    lines = read_metrics(tmp_path / "metrics.jsonl")
    assert [x["kind"] for x in lines] == ["train", "checkpoint", "resume"]
    assert [x["time"] for x in lines] == sorted(x["time"] for x in lines)
    discarded = read_metrics(tmp_path / "metrics.discarded.jsonl")
    assert [x["kind"] for x in discarded] == ["discarded", "eval"]


def test_a_checkpoint_of_another_replica_count_says_how_to_resume_it() -> None:
    found = SimpleNamespace(path=Path("runs/x/checkpoints/ckpt-0000000100"), num_replicas=3)
    check_replica_count(found, 3, "synchronous")  # the same count: nothing to say
    check_replica_count(None, 2, "synchronous")  # a fresh start
    with pytest.raises(ckpt.CheckpointError) as error:
        check_replica_count(found, 2, "synchronous", extra_ranks=1,
                            why=" (their data positions)")
    assert str(error.value) == (
        "checkpoint runs/x/checkpoints/ckpt-0000000100 was written by 3 synchronous "
        "replica(s) (their data positions), so it resumes on 4 ranks (mpiexec -n 4), not 3; "
        "or pass --fresh to start over")


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("damaged", [None, "shard-0002.h5"])
def test_the_ranks_of_a_job_verify_a_checkpoint_together(tmp_path: Path, ranks: int,
                                                          damaged: str | None) -> None:
    # Every part of the newest checkpoint is hashed once, by one rank (part i by rank
    # i mod N), not every byte by rank 0; a damaged part, whichever rank finds it, sends
    # every rank to the previous checkpoint with the same reason.
    program = Path(__file__).parent / "mpi_programs" / "verify_spread.py"
    proc = run_mpi(ranks, [program, tmp_path / "ckpts", *([damaged] if damaged else [])],
                   timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [line["rank"] for line in lines] == list(range(ranks))
    newest = [name for line in lines for name in line["hashed"]
              if name.startswith("ckpt-0000000020/")]
    parts = ["replicas.h5"] + [f"shard-{i:04d}.h5" for i in range(4)]
    assert sorted(newest) == [f"ckpt-0000000020/{p}" for p in parts]  # each once
    for line in lines:
        assert len([n for n in line["hashed"] if n.startswith("ckpt-0000000020/")]) in (
            len(parts) // ranks, -(-len(parts) // ranks))
    assert {line["step"] for line in lines} == {10 if damaged else 20}
    reasons = {tuple(line["damaged"]) for line in lines}
    assert len(reasons) == 1  # the same verdict everywhere
    if damaged:
        assert f"{damaged} fails its sha256 checksum" in reasons.pop()[0]
