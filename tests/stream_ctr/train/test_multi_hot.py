"""Multi-hot (list) fields through the trainer, the store and the serving bundle.

The synthetic JSON ad log's `history` (0-50 ad ids) is a mean-pooled multi-hot
field of AD_LOG_SCHEMA: the model sees F + 1 fields, the store every id.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from stream_ctr.config import Config, schema_text
from stream_ctr.connectors.batch import Batch, Jagged
from stream_ctr.connectors.files import FileSource, detect_format
from stream_ctr.connectors.synth_json import AD_LOG_SCHEMA, write_synthetic_json
from stream_ctr.serving.bundle import read_bundle
from stream_ctr.serving.scorer import Scorer
from stream_ctr.cli.main import main
from stream_ctr.train.checkpoint import load_checkpoint
from stream_ctr.train.loop import configure_torch, held_out_start, train
from stream_ctr.train.trainer import Trainer


def _config(run_dir, source, batch=128) -> Config:
    cfg = Config()
    cfg.model.mlp_dims = (32, 32)
    cfg.data.batch_size = batch
    cfg.data.source = source
    cfg.data.schema = schema_text(AD_LOG_SCHEMA, "test")
    cfg.data.holdout_fraction = 0.1
    cfg.train.run_dir = str(run_dir)
    cfg.train.threads = 1
    cfg.train.device = "cpu"
    return cfg


def _tiny_batch() -> Batch:
    keys = np.array([[1, 2], [1, 3]], np.int64)
    history = Jagged(np.array([1, 7, 7, 2, 9], np.int64), np.array([0, 3, 5], np.int64), "mean")
    return Batch(np.array([1, 0], np.float32), np.zeros((2, 0), np.float32), keys,
                 np.zeros(2, np.int64), np.zeros(2, np.int32), np.arange(2, dtype=np.int64), ("p",),
                 (history,))


def test_working_set_counts_every_occurrence_and_the_model_sees_f_plus_m_fields(tmp_path):
    cfg = _config(tmp_path / "r", "json:x")
    trainer = Trainer(cfg, n_fields=3, n_dense=0)
    batch = _tiny_batch()
    uniq, inverse, counts = trainer._working_set(batch)
    assert dict(zip(uniq.tolist(), counts.tolist())) == {1: 3, 2: 2, 3: 1, 7: 2, 9: 1}
    assert torch.equal(uniq[inverse], torch.tensor([1, 2, 1, 3, 1, 7, 7, 2, 9]))
    result = trainer.train_step(batch)
    assert result.rows_touched == 5 and bool(torch.isfinite(result.loss))
    assert trainer.predict(batch).shape == (2,)
    with pytest.raises(ValueError, match="multi-hot"):
        Trainer(cfg, n_fields=2, n_dense=0).predict(batch)


@pytest.fixture(scope="module")
def json_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multi_hot")
    log = tmp / "log.jsonl"
    write_synthetic_json(log, 4000, seed=3)
    cfg = _config(tmp / "run", f"json:{log}")
    return tmp, log, cfg, train(cfg, show_progress=False)


def test_export_scores_multi_hot_records_bit_for_bit_as_trainer_predict(json_run):
    tmp, log, cfg, summary = json_run
    assert summary.test["records"] == 400
    assert main(["export", cfg.train.run_dir, "--out", str(tmp / "bundle"), "--quiet"]) == 0
    state = load_checkpoint(cfg.train.run_dir)
    saved = Config.from_dict(state.config)
    configure_torch(saved)
    fmt, path = detect_format(f"json:{log}", saved.data.schema)
    assert fmt.n_model_fields == fmt.n_keys + 1 and fmt.pooling == ("mean",)
    trainer = Trainer(saved, fmt.n_model_fields, fmt.n_dense, read_only=True)
    trainer.load_state_tensors(state.tensors["trainer"])
    with FileSource(path, fmt, start_offset=held_out_start(4000, 0.1)) as src:
        batch, _ = src.read()
    assert batch.n_multi == 1 and len(batch.jagged[0].values) > 1000
    reference = trainer.predict(batch)
    probs = Scorer(read_bundle(tmp / "bundle")).score(batch)
    assert np.array_equal(probs, reference)
    # the held-out history ids are in the bundle (they were trained) or get their initial rows
    trainer.store.close()


def test_tiny_tiered_cache_trains_the_same_as_one_memory_table(json_run, tmp_path):
    tmp, log, cfg, summary = json_run
    tiered = _config(tmp_path / "tiered", f"json:{log}")
    tiered.store.kind = "tiered"
    # a device cache of about two worst-case working sets (16 keys + 50 history ids a record)
    from stream_ctr.store.device_cache import DeviceCache
    from stream_ctr.store.host_tier import HostTier
    from stream_ctr.store.layout import RowLayout
    layout = RowLayout(tiered.model.embed_dim)
    tiered.store.cache_bytes = 2 * 128 * 66 * DeviceCache.bytes_per_row(layout)
    tiered.store.ram_bytes = 3000 * HostTier.bytes_per_row(layout)
    tiered.store.disk_bytes = 64 << 20
    other = train(tiered, show_progress=False)
    assert other.test["auc"] == summary.test["auc"] and other.test["logloss"] == summary.test["logloss"]
