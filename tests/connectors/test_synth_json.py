"""The synthetic JSON ad log: deterministic, decodes under its schema, labels from a learnable teacher."""
import json

import numpy as np

from stream_ctr.connectors.schema import parse_schema
from stream_ctr.connectors.schema_decode import decode_records
from stream_ctr.connectors.synth import bayes_auc, probs_path
from stream_ctr.connectors.synth_json import AD_LOG_SCHEMA, MAX_HISTORY, write_synthetic_json


def test_records_have_the_documented_shape(tmp_path):
    path = tmp_path / "log.jsonl"
    assert write_synthetic_json(path, 3000, seed=3) == 3000
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 3000
    r = records[0]
    assert set(r) == {"event_id", "ts", "user_id", "ad_id", "campaign_id", "creative_id", "site",
                      "placement", "device", "country", "price", "position", "history", "clicked"}
    assert set(r["device"]) == {"os", "model", "type"} and isinstance(r["clicked"], bool)
    assert all(0 <= len(x["history"]) <= MAX_HISTORY for x in records)
    assert max(len(x["history"]) for x in records) > 20
    ts = [x["ts"] for x in records]
    assert ts == sorted(ts)
    probs = np.load(probs_path(path))
    labels = np.array([x["clicked"] for x in records])
    assert probs.shape == (3000,) and 0.08 < labels.mean() < 0.25
    assert bayes_auc(path, labels) > 0.7


def test_deterministic_and_gzip(tmp_path):
    write_synthetic_json(tmp_path / "a.jsonl", 500, seed=1)
    write_synthetic_json(tmp_path / "b.jsonl.gz", 500, seed=1, gzip=True)
    import gzip
    assert (tmp_path / "a.jsonl").read_bytes() == gzip.decompress((tmp_path / "b.jsonl.gz").read_bytes())


def test_decodes_under_its_schema_without_rejects(tmp_path):
    path = tmp_path / "log.jsonl"
    write_synthetic_json(path, 2000)
    schema = parse_schema(AD_LOG_SCHEMA)
    batch, rejected = decode_records(path.read_bytes(), schema, "file:log.jsonl", 0)
    assert rejected == [] and len(batch) == 2000
    assert batch.keys.shape == (2000, 11) and batch.dense.shape == (2000, 1)
    assert (batch.event_time_ms[1:] >= batch.event_time_ms[:-1]).all()
