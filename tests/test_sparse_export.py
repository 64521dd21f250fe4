"""A sparse model's checkpoint exported and evaluated a piece at a time (issue 44, part 3;
records.vectors): the export copies each table from the shards' parts in row blocks and
equals the export of the whole vector array by array; `evaluate`, load_model's predict and
evaluate read only each batch's rows, from the checkpoint or an export, and give the
whole vector's figures. In one process: the parts are written as three shards write them."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

import distbelief
from distbelief.api import evaluate_split
from distbelief.config import build_network, config_from_dict, config_hash, hashed_settings
from distbelief.data.hdf5 import load_test, open_dataset
from distbelief.data.synthetic_sparse import Options, make_sparse_synthetic
from distbelief.records import checkpoint as ckpt
from distbelief.records import vectors
from distbelief.records.export import read_trained, write_export

MODELS = {
    # ids: two tables of different sizes and a dense tower
    "fields": (Options(train=500, test=2_500, fields=2, field_rows=300, dim=3),
               [{"type": "embedding", "dim": 3, "combine": "concat"},
                {"type": "dense", "units": 4, "activation": "tanh"},
                {"type": "dense", "units": 1, "activation": "sigmoid"}]),
    # sparse rows: one table of a weight per feature
    "logistic": (Options(train=500, test=2_500, features=3_000, nnz=10),
                 [{"type": "sparse_linear", "units": 1, "activation": "sigmoid"}]),
}


def stored_run(tmp_path, kind: str):
    """A checkpoint of random parameters and Adagrad state in three shard parts, and the
    whole vectors it holds."""
    options, layers = MODELS[kind]
    data = make_sparse_synthetic(kind, tmp_path / "data.h5", options).info.path
    config = config_from_dict({
        "model": {"loss": "binary_cross_entropy", "layers": layers},
        "data": {"path": str(data), "batch_size": 32},
        "optimizer": {"algorithm": "downpour", "learning_rate": 0.1, "update": "adagrad"},
        "run": {"out_dir": str(tmp_path / "run"), "max_steps": 10}})
    network = build_network(config, open_dataset(data))
    rng = np.random.default_rng(3)
    params = rng.normal(scale=0.5, size=network.layout.size).astype(np.float32)
    accum = rng.random(network.layout.size, dtype=np.float32)
    root = ckpt.checkpoint_root(config.run.out_dir)
    meta = ckpt.CheckpointMeta(10, 320, 1.0, config_hash(config))
    partial = ckpt.prepare(root, meta.step)
    ranges = network.layout.shard_ranges(3)  # boundaries inside tables and rows
    records = [ckpt.write_shard_part(partial, meta, i, a, b, params[a:b],
                                     {"accum": accum[a:b]}) for i, (a, b) in enumerate(ranges)]
    records.append(ckpt.write_replica_part(partial, meta, 0, {}))
    ckpt.commit(root, meta, settings=hashed_settings(config), algorithm="downpour",
                layout=network.layout, shard_ranges=ranges, optimizer_state=["accum"],
                parts=records, num_replicas=1, keep=2)
    return config.run.out_dir, network, params, accum, data


@pytest.mark.parametrize("kind", MODELS)
def test_a_sparse_checkpoint_is_exported_in_row_blocks_and_evaluated_by_batch_rows(
        tmp_path, monkeypatch, kind: str) -> None:
    out, network, params, accum, data = stored_run(tmp_path, kind)
    x, y = load_test(open_dataset(data))
    whole = network.evaluate(params, x, y, batch_size=1000)

    # Evaluated from the checkpoint: each batch's rows, never the whole vector.
    trained = read_trained(out)
    result = evaluate_split(out, trained, None, "test")
    assert trained._params is None  # the whole vector was never read
    assert result["samples"] == len(y) == 2_500
    assert result["loss"] == pytest.approx(whole.loss, rel=1e-6)
    assert result["auc"] == pytest.approx(whole.figures["auc"], rel=1e-6)

    # The parts stay open for the evaluation's batches (3 of 1,000 rows here), each opened
    # once, not per batch (the dense part's read before them is its own), and are all
    # closed after it.
    trained, opened, open_part = read_trained(out), [], ckpt.Checkpoint._open_part

    def counted(self, path, kind, index):
        opened.append(path.name)
        return open_part(self, path, kind, index)

    monkeypatch.setattr(ckpt.Checkpoint, "_open_part", counted)
    files_before = h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE)
    assert evaluate_split(out, trained, None, "test")["loss"] == result["loss"]
    assert sorted(set(opened)) == [f"shard-{i:04d}.h5" for i in range(3)], opened
    assert len(opened) == 4, opened
    assert h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE) == files_before
    monkeypatch.undo()

    # Exported in blocks of a few rows of a table (not a divisor of a shard's range), and
    # the export of the whole vector in memory: the same arrays, which are the parameters'.
    _, rows, width = network.tables[0]
    monkeypatch.setattr(vectors, "BLOCK_BYTES", 4 * width * (rows // 30 + 7))
    monkeypatch.setattr("distbelief.records.export.BLOCK_BYTES", vectors.BLOCK_BYTES)
    streamed = read_trained(out, with_optimizer=True)
    for fmt in ("hdf5", "safetensors"):
        write_export(streamed, tmp_path / f"streamed.{fmt}")
    assert streamed._params is None and streamed._optimizer_state is None
    in_memory = read_trained(out, with_optimizer=True)
    assert np.array_equal(in_memory.params, params)  # read whole, here only
    assert np.array_equal(in_memory.optimizer_state["accum"], accum)
    for fmt in ("hdf5", "safetensors"):
        write_export(in_memory, tmp_path / f"whole.{fmt}")
    with h5py.File(tmp_path / "streamed.hdf5") as a, h5py.File(tmp_path / "whole.hdf5") as b:
        names = []
        a.visititems(lambda name, obj: names.append(name)
                     if isinstance(obj, h5py.Dataset) else None)
        assert len(names) == 2 * len(network.layout.entries)
        for name in names:
            assert np.array_equal(a[name][()], b[name][()]), name
        table = network.layout.entries[0]
        assert np.array_equal(a["params/layers.0.table" if kind == "logistic"
                                else "params/layers.0.table_0"][()],
                              network.layout.view(params, table.layer, table.name))
    assert (tmp_path / "streamed.safetensors").read_bytes() == \
        (tmp_path / "whole.safetensors").read_bytes()

    # Evaluated and predicted from each export: the batch rows read from the file.
    first = network.logits(params, x[:300])
    for fmt in ("hdf5", "safetensors"):
        path = tmp_path / f"streamed.{fmt}"
        from_export = read_trained(path)
        result = evaluate_split(path, from_export, data, "test")
        assert h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE) == files_before
        assert from_export._params is None
        assert result["loss"] == pytest.approx(whole.loss, rel=1e-6)
        model = distbelief.load_model(path)
        np.testing.assert_allclose(model.predict(x[:300]), 1 / (1 + np.exp(-first)),
                                   rtol=1e-5, atol=1e-7)
        assert model.evaluate(x, y).loss == pytest.approx(whole.loss, rel=1e-6)
        assert model._trained._params is None
        # The named arrays are the whole tables, read on demand; predictions then use them.
        named = dict(model.named_parameters())
        named[next(iter(named))][...] = 0
        assert not np.allclose(model.predict(x[:300]), 1 / (1 + np.exp(-first)))
