"""Record weights (a schema `weight` field) through the decoder, the Batch and the loss.

The use that matters: a log whose negatives were down-sampled at rate r and
carry weight 1/r.  Trained with the weights, the model predicts the click rate
of the full stream; without them, the rate of the sample (here ~2.6x higher).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from stream_ctr.config import Config, schema_text
from stream_ctr.connectors.batch import Batch
from stream_ctr.connectors.files import FileSource, detect_format
from stream_ctr.connectors.schema import parse_schema
from stream_ctr.connectors.schema_decode import decode_records
from stream_ctr.train.checkpoint import load_checkpoint
from stream_ctr.train.loop import configure_torch, train
from stream_ctr.train.trainer import Trainer

SCHEMA = """\
[schema]
encoding = "json"

[schema.fields.clicked]
kind = "label"

[schema.fields.ad]
kind = "categorical"

[schema.fields.site]
kind = "categorical"

[schema.fields.w]
kind = "%s"
"""


def _schema(weight_kind: str = "weight"):
    return parse_schema(SCHEMA % weight_kind, "test")


def test_the_weight_field_is_decoded_and_a_bad_or_missing_weight_is_dead_lettered():
    lines = [{"clicked": 1, "ad": "a", "site": "s", "w": 1},
             {"clicked": 0, "ad": "b", "site": "s", "w": 4.5},
             {"clicked": 0, "ad": "b", "site": "s", "w": -1},
             {"clicked": 0, "ad": "b", "site": "s"},
             {"clicked": 0, "ad": "b", "site": "s", "w": "heavy"}]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    batch, rejected = decode_records(data, _schema(), "p", 10)
    assert batch.weight.dtype == np.float32 and batch.weight.tolist() == [1.0, 4.5]
    assert [(r.offset, r.reason) for r in rejected] == [(12, "bad_value:w"), (13, "missing:w"),
                                                        (14, "bad_value:w")]
    ignored, rejected = decode_records(data, _schema("ignore"), "p", 10)
    assert ignored.weight is None and len(ignored) == 5 and not rejected


def test_batches_carry_weights_through_slice_take_and_concat():
    data = b'{"clicked": 1, "ad": "a", "site": "s", "w": 2}\n{"clicked": 0, "ad": "b", "site": "s", "w": 3}\n'
    weighted, _ = decode_records(data, _schema(), "p", 0)
    plain, _ = decode_records(data, _schema("ignore"), "p", 2)
    assert weighted.slice(1, 2).weight.tolist() == [3.0]
    assert weighted.take(np.array([1, 0])).weight.tolist() == [3.0, 2.0]
    # a batch without weights weighs 1 per row
    assert Batch.concat([plain, weighted]).weight.tolist() == [1.0, 1.0, 2.0, 3.0]
    assert Batch.concat([plain, plain]).weight is None


def test_the_loss_is_the_weighted_mean_and_does_not_depend_on_the_weights_scale(tmp_path):
    cfg = Config()
    cfg.model.mlp_dims = (8,)
    cfg.train.device = "cpu"
    cfg.train.run_dir = str(tmp_path)
    trainer = Trainer(cfg, n_fields=2, n_dense=0)
    rng = np.random.default_rng(0)
    n = 64
    batch = Batch(rng.integers(0, 2, n).astype(np.float32), np.zeros((n, 0), np.float32),
                  rng.integers(1, 50, (n, 2)), np.zeros(n, np.int64), np.zeros(n, np.int32),
                  np.arange(n, dtype=np.int64), ("p",), (), rng.uniform(0.1, 5, n).astype(np.float32))
    logits = torch.randn(n)
    labels = torch.from_numpy(batch.labels)
    w = torch.from_numpy(batch.weight)
    expected = (w * F.binary_cross_entropy_with_logits(logits, labels, reduction="none")).sum() / w.sum()
    assert torch.allclose(trainer._loss(logits, labels, trainer._inputs(batch)[2]), expected)
    scaled = Batch(**{**batch.__dict__, "weight": batch.weight * 8})
    assert torch.allclose(trainer._loss(logits, labels, trainer._inputs(scaled)[2]), expected)
    unweighted = Batch(**{**batch.__dict__, "weight": None})
    ones = Batch(**{**batch.__dict__, "weight": np.ones(n, np.float32)})
    assert trainer._inputs(unweighted)[2] is None
    assert torch.allclose(trainer._loss(logits, labels, trainer._inputs(ones)[2]),
                          trainer._loss(logits, labels, None))


def _write_log(path, n: int, rng, keep_negative: float | None):
    """A log over 100 ads and 20 sites with known click rates (~9% overall); with
    `keep_negative`, negatives are kept at that rate and weigh 1/rate."""
    ad_logit = rng.normal(-2.6, 0.8, 100)
    site_logit = rng.normal(0.0, 0.4, 20)
    ad, site = rng.integers(0, 100, n), rng.integers(0, 20, n)
    p = 1 / (1 + np.exp(-(ad_logit[ad] + site_logit[site])))
    clicked = rng.random(n) < p
    keep = np.ones(n, bool) if keep_negative is None else clicked | (rng.random(n) < keep_negative)
    weight = np.where(clicked, 1.0, 1.0 / (keep_negative or 1.0))
    with open(path, "w") as f:
        for i in np.flatnonzero(keep).tolist():
            f.write(json.dumps({"clicked": bool(clicked[i]), "ad": f"ad{ad[i]}", "site": f"s{site[i]}",
                                "w": float(weight[i])}) + "\n")
    return p[keep].mean(), clicked[keep].mean()


@pytest.fixture(scope="module")
def down_sampled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("weights")
    # the same ads and sites (same seed for the rates) in both files
    _write_log(tmp / "train.jsonl", 60_000, np.random.default_rng(7), keep_negative=0.2)
    full_ctr, _ = _write_log(tmp / "test.jsonl", 6_000, np.random.default_rng(7), keep_negative=None)
    return tmp, full_ctr


def _mean_prediction(tmp, weight_kind: str) -> float:
    cfg = Config()
    cfg.model.mlp_dims = (16,)
    cfg.data.batch_size = 256
    cfg.data.source = f"json:{tmp / 'train.jsonl'}"
    cfg.data.schema = schema_text(SCHEMA % weight_kind, "test")
    cfg.train.run_dir = str(tmp / f"run-{weight_kind}")
    cfg.train.threads = 1
    cfg.train.device = "cpu"
    train(cfg, show_progress=False)
    state = load_checkpoint(cfg.train.run_dir)
    saved = Config.from_dict(state.config)
    configure_torch(saved)
    fmt, path = detect_format(f"json:{tmp / 'test.jsonl'}", saved.data.schema)
    trainer = Trainer(saved, fmt.n_model_fields, fmt.n_dense, read_only=True)
    trainer.load_state_tensors(state.tensors["trainer"])
    with FileSource(path, fmt) as src:
        batch, _ = src.read()
    probs = trainer.predict(batch)
    trainer.store.close()
    return float(probs.mean())


def test_down_sampled_negatives_with_weights_predict_the_full_streams_click_rate(down_sampled):
    tmp, full_ctr = down_sampled
    weighted = _mean_prediction(tmp, "weight")
    unweighted = _mean_prediction(tmp, "ignore")
    # the sample clicks at ~2.6x the full stream's rate; the weights undo that
    assert abs(weighted / full_ctr - 1) < 0.15, (weighted, full_ctr)
    assert unweighted / full_ctr > 2.0, (unweighted, full_ctr)
