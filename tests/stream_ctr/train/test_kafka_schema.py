"""Your own JSON log through a real broker: replay with its schema, train from the topic."""
import json

from stream_ctr.config import schema_text
from stream_ctr.connectors.kafka.replay import replay_file
from stream_ctr.connectors.synth_json import AD_LOG_SCHEMA, write_synthetic_json
from stream_ctr.train.checkpoint import load_checkpoint
from stream_ctr.train.loop import train
from tests.stream_ctr.train.test_kafka_train import kafka_config


def test_json_log_replayed_and_trained_from_the_topic(kafka, tmp_path):
    path = tmp_path / "log.jsonl"
    write_synthetic_json(path, 3000)
    schema = schema_text(AD_LOG_SCHEMA, "test")
    topic = kafka.topic(partitions=2)
    replay_file(f"json:{path}", kafka.url(topic), packed=50, schema=schema)
    cfg = kafka_config(tmp_path, kafka.url(topic, "own-log"), schema=schema)
    cfg.kafka.stop_when_idle_s = 1.5
    s = train(cfg, show_progress=False)
    assert s.records_trained == 3000 and s.records_rejected == 0       # every record exactly once
    assert load_checkpoint(cfg.train.run_dir).positions == {f"{topic}/0": 30, f"{topic}/1": 30}


def test_bad_json_records_are_dead_lettered_naming_the_field(kafka, tmp_path):
    path = tmp_path / "log.jsonl"
    write_synthetic_json(path, 400)
    good = path.read_bytes().splitlines()
    record = json.loads(good[0])
    bad = {json.dumps({k: v for k, v in record.items() if k != "site"}).encode(): "missing:site",
           json.dumps({**record, "price": "cheap"}).encode(): "bad_value:price",
           b'{"clicked": true,': "bad_json"}
    values = good[:200] + list(bad) + good[200:]
    topic = kafka.topic(partitions=1)
    kafka.produce(topic, values)
    cfg = kafka_config(tmp_path, kafka.url(topic, "dlq"), schema=schema_text(AD_LOG_SCHEMA, "test"))
    cfg.kafka.stop_when_idle_s = 1.5
    s = train(cfg, show_progress=False)
    assert s.records_trained == 400 and s.records_rejected == 3
    assert s.rejected_by_reason == {reason: 1 for reason in bad.values()}
    letters = kafka.dead_letters(f"{topic}.dead-letter")
    assert {(d["offset"], d["reason"]) for d in letters} == {(200 + i, r) for i, r in enumerate(bad.values())}


def test_schema_infer_from_a_topic(kafka, tmp_path, capsys):
    from stream_ctr.cli import main
    from stream_ctr.connectors.schema import parse_schema
    path = tmp_path / "log.jsonl"
    write_synthetic_json(path, 600)
    topic = kafka.topic(partitions=2)
    lines = path.read_bytes().splitlines()
    kafka.produce(topic, [b"\n".join(lines[i:i + 10]) for i in range(0, 600, 10)],
                  partitions=[i % 2 for i in range(60)])
    assert main(["schema", "infer", kafka.url(topic), "--records", "500", "--quiet"]) == 0
    schema = parse_schema(capsys.readouterr().out)
    assert schema.label.name == "clicked" and schema.event_time.name == "ts"
    assert "os" in schema.key_fields and schema.n_dense == 1
