"""Per-field embedding widths: a schema field `embed_dim = k x model.embed_dim` is k rows.

The store keeps one row width; a wide field's key brings its own row and k - 1
rows under keys derived from it, so memory grows with each field's own width,
and the tiers, checkpoints, export and serving need no other change.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from stream_ctr.config import Config, schema_text
from stream_ctr.connectors.batch import Batch, Jagged
from stream_ctr.connectors.files import FileSource, detect_format
from stream_ctr.connectors.schema import SchemaError, parse_schema, schema_to_toml
from stream_ctr.connectors.synth_json import AD_LOG_SCHEMA, write_synthetic_json
from stream_ctr.cli.main import main
from stream_ctr.models.field_inputs import (FieldRows, batch_keys, derive_keys, field_inputs, field_rows,
                                            model_fields)
from stream_ctr.serving.bundle import read_bundle
from stream_ctr.serving.scorer import Scorer
from stream_ctr.train.checkpoint import load_checkpoint
from stream_ctr.train.loop import configure_torch, held_out_start, train
from stream_ctr.train.trainer import Trainer

D = 10                                          # model.embed_dim (the default)
WIDE_SCHEMA = (AD_LOG_SCHEMA
               .replace('[schema.fields.user_id]\nkind = "categorical"\n',
                        '[schema.fields.user_id]\nkind = "categorical"\nembed_dim = 30\n')
               .replace('[schema.fields.history]\nkind = "multi_hot"\n',
                        '[schema.fields.history]\nkind = "multi_hot"\nembed_dim = 20\n'))


def test_the_wide_schema_is_the_ad_log_schema_with_two_wider_fields():
    narrow, wide = parse_schema(AD_LOG_SCHEMA), parse_schema(WIDE_SCHEMA)
    assert narrow.embed_dims == (0,) * narrow.n_model_fields
    dims = dict(zip(wide.key_fields + ("history",), wide.embed_dims))
    assert dims["user_id"] == 30 and dims["history"] == 20 and sum(dims.values()) == 50
    assert parse_schema(schema_to_toml(wide)) == wide


def test_field_rows_and_what_the_model_takes():
    wide = parse_schema(WIDE_SCHEMA)
    rows = field_rows(wide, D)
    user = wide.key_fields.index("user_id")
    assert rows.fixed[user] == 3 and sum(rows.fixed) == wide.n_keys + 2 and rows.multi == (2,)
    n_inputs, keys_per_record, same = model_fields(wide, D)
    assert same == rows and n_inputs == wide.n_model_fields + 3
    assert keys_per_record == wide.n_keys + 2 + 2 * wide.multi_fields[0].max_len
    assert field_rows(parse_schema(AD_LOG_SCHEMA), D) is None    # all narrow: the old path
    with pytest.raises(SchemaError, match="embed_dim 30 is not a multiple of model.embed_dim 8"):
        field_rows(wide, 8)


def test_a_width_that_is_not_whole_rows_is_one_clear_error(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    write_synthetic_json(log, 200, seed=1)
    (tmp_path / "s.toml").write_text(WIDE_SCHEMA.replace("embed_dim = 30", "embed_dim = 25"))
    code = main(["train", f"json:{log}", "--schema", str(tmp_path / "s.toml"),
                 "--run-dir", str(tmp_path / "run"), "--quiet"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err == ("stream-ctr: error: schema field 'user_id': embed_dim 25 is not a multiple of "
                   "model.embed_dim 10 (a field is stored as whole rows of model.embed_dim); use 20 "
                   "or 30, or change model.embed_dim")


def test_a_numeric_field_left_dense_takes_no_embed_dim():
    text = AD_LOG_SCHEMA.replace('transform = "log1p"', 'transform = "log1p"\nembed_dim = 20', 1)
    assert text != AD_LOG_SCHEMA
    with pytest.raises(SchemaError, match="embed_dim goes with a field that is embedded"):
        parse_schema(text)


def test_derived_keys_are_fixed_63_bit_and_distinct():
    keys = np.array([0, 1, 2, (1 << 63) - 1, 123456789], np.int64)
    one, two = derive_keys(keys, 1), derive_keys(keys, 2)
    assert np.array_equal(one, derive_keys(keys.copy(), 1))
    assert (one >= 0).all() and (two >= 0).all()
    assert len(set(keys.tolist()) | set(one.tolist()) | set(two.tolist())) == 15


def test_a_wide_field_is_its_rows_side_by_side():
    """Field 0 three rows wide, field 1 one, a multi-hot field two: the model sees
    3 + 1 + 2 fields, field 0's input is its key's row then its two derived rows."""
    rows = FieldRows(fixed=(3, 1), multi=(2,))
    keys = np.array([[5, 6], [5, 7]], np.int64)
    history = Jagged(np.array([8, 9, 9], np.int64), np.array([0, 2, 3], np.int64), "sum")
    batch = Batch(np.array([1, 0], np.float32), np.zeros((2, 0), np.float32), keys, np.zeros(2, np.int64),
                  np.zeros(2, np.int32), np.arange(2, dtype=np.int64), ("p",), (history,))
    flat = batch_keys(batch, rows)
    five1, five2 = derive_keys(np.array([5]), 1)[0], derive_keys(np.array([5]), 2)[0]
    assert flat[:8].tolist() == [5, five1, five2, 6, 5, five1, five2, 7]
    assert flat[8:11].tolist() == [8, 9, 9] and flat[11:].tolist() == derive_keys(np.array([8, 9, 9]), 1).tolist()
    uniq, inverse = torch.unique(torch.from_numpy(flat), return_inverse=True)
    table = torch.randn(len(uniq), D + 1)
    emb, lin = field_inputs(table, inverse, batch, D, rows)
    assert emb.shape == (2, 6, D) and lin.shape == (2, 6)
    row_of = {k: table[i] for i, k in enumerate(uniq.tolist())}
    assert torch.equal(emb[1, :3].reshape(-1), torch.cat([row_of[5][:D], row_of[five1][:D], row_of[five2][:D]]))
    assert torch.equal(emb[0, 4], row_of[8][:D] + row_of[9][:D])       # sum-pooled, first row
    h1, h2 = derive_keys(np.array([8, 9]), 1).tolist()
    assert torch.equal(emb[0, 5], row_of[h1][:D] + row_of[h2][:D])    # sum-pooled, derived row


def wide_config(tmp, log) -> Config:
    cfg = Config()
    cfg.model.mlp_dims = (32, 32)
    cfg.data.batch_size = 128
    cfg.data.source = f"json:{log}"
    cfg.data.schema = schema_text(WIDE_SCHEMA, "test")
    cfg.data.holdout_fraction = 0.1
    cfg.train.run_dir = str(tmp / "run")
    cfg.train.threads = 1
    cfg.train.device = "cpu"
    return cfg


@pytest.fixture(scope="module")
def wide_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wide")
    log = tmp / "log.jsonl"
    write_synthetic_json(log, 4000, seed=3)
    cfg = wide_config(tmp, log)
    return tmp, log, cfg, train(cfg, show_progress=False)


def test_a_wide_run_stores_k_rows_per_id_and_serves_bit_for_bit(wide_run):
    tmp, log, cfg, summary = wide_run
    assert np.isfinite(summary.test["auc"]) and summary.test["records"] == 400
    state = load_checkpoint(cfg.train.run_dir)
    saved = Config.from_dict(state.config)
    configure_torch(saved)
    fmt, path = detect_format(f"json:{log}", saved.data.schema)
    trainer = Trainer.for_format(saved, fmt, read_only=True)
    trainer.load_state_tensors(state.tensors["trainer"])
    assert trainer.n_fields == fmt.n_model_fields + 3
    with FileSource(path, fmt, start_offset=0, stop_offset=held_out_start(4000, 0.1)) as src:
        batch, _ = src.read()
    with FileSource(path, fmt, start_offset=held_out_start(4000, 0.1)) as src:
        held, _ = src.read()
    reference = trainer.predict(held)
    assert main(["export", cfg.train.run_dir, "--out", str(tmp / "bundle"), "--quiet"]) == 0
    bundle = read_bundle(tmp / "bundle")
    assert np.array_equal(Scorer(bundle).score(held), reference)
    # every trained user id holds its own row and two derived ones; a narrow field one
    user, ad = fmt.key_fields.index("user_id"), fmt.key_fields.index("ad_id")
    users, ads = np.unique(batch.keys[:, user]), np.unique(batch.keys[:, ad])
    stored = set(bundle.keys.tolist())
    assert set(users.tolist()) | set(derive_keys(users, 1).tolist()) | set(derive_keys(users, 2).tolist()) <= stored
    assert set(ads.tolist()) <= stored and not set(derive_keys(ads, 1).tolist()) & stored
    trainer.store.close()


def test_a_published_chain_of_a_wide_run_serves_its_final_export(wide_run, tmp_path):
    """Deltas carry each step's working set, derived rows included: a follower of the
    chain scores as the final checkpoint's export does."""
    from stream_ctr.serving.follower import Follower, initial_bundle
    from stream_ctr.serving.predictor import Predictor
    from stream_ctr.serving.published import read_index
    _, log, _, _ = wide_run
    cfg = wide_config(tmp_path, log)
    cfg.train.checkpoint_every_batches = 7
    cfg.serving.publish = str(tmp_path / "pub")
    cfg.serving.full_every = 3
    train(cfg, show_progress=False)
    assert read_index(cfg.serving.publish).chain          # the last version is a delta
    assert main(["export", cfg.train.run_dir, "--out", str(tmp_path / "final"), "--quiet"]) == 0
    fmt, path = detect_format(f"json:{log}", cfg.data.schema)
    with FileSource(path, fmt, start_offset=held_out_start(4000, 0.1)) as src:
        held, _ = src.read()
    predictor = Predictor(Scorer(read_bundle(initial_bundle(cfg.serving.publish))))
    try:
        Follower(cfg.serving.publish, predictor).poll()
        served = predictor.current()[0].score(held)
        assert np.array_equal(served, Scorer(read_bundle(tmp_path / "final")).score(held))
    finally:
        predictor.close()
