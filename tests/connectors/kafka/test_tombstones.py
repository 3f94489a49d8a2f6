"""Messages that hold no record -- null values (tombstones), empty values, values a
decoder cannot take -- are dead-lettered at their offsets and passed, through a
real broker, with both consumer clients.

Found on 0.13.0: one tombstone (a delete on a compacted topic, or a key-only
message) made `stream-ctr train kafka://...` exit 1 with a TypeError in the
source, and again at every --resume: the stream could never pass it.
"""
import gzip
import json

import numpy as np
import pytest

from stream_ctr.cli import main
from stream_ctr.connectors.files import SAMPLE_PATHS
from stream_ctr.connectors.formats import CRITEO
from stream_ctr.connectors.kafka.decode import decode_messages
from stream_ctr.train.checkpoint import load_checkpoint
from tests.kafka_broker import kafka_set_args

LINES = [line for line in gzip.open(SAMPLE_PATHS["criteo"], "rb").read().split(b"\n") if line][:400]
# Deeper than Python's recursion limit: json.loads raises RecursionError, not ValueError.
TOO_DEEP = b"[" * 100_000


def produce_keyed(bootstrap: str, topic: str, messages: list[tuple[int, bytes | None]]) -> None:
    """Produce (partition, value) in order, every message with a key (a null value needs one)."""
    from kafka import KafkaProducer
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    for partition, value in messages:
        producer.send(topic, key=b"user-1", value=value, partition=partition)
    producer.flush()
    producer.close()


def train(url: str, run_dir, capsys, *extra: str) -> dict:
    """`stream-ctr train URL ... --stop-when-idle 2 --json`; returns the JSON summary."""
    code = main(["train", url, "--run-dir", str(run_dir), "--stop-when-idle", "2", "--json", "--quiet",
                 "--batch-size", "64", "--threads", "1", "--set", "model.mlp_dims=32,32",
                 *kafka_set_args(), *extra])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def json_value(line: bytes) -> bytes:
    return json.dumps(dict(zip(CRITEO.field_names, line.decode().split("\t")))).encode()


def test_tombstones_first_middle_last_and_empty_values_are_dead_lettered_and_passed(
        kafka, tmp_path, capsys, kafka_client):
    """Partition 0: one record a message; partition 1: packed messages (20 lines each)."""
    topic = kafka.topic(partitions=2)
    single = [None] + LINES[:100] + [None, b""] + LINES[100:200] + [None]
    packed = [None] + [b"\n".join(LINES[i:i + 20]) for i in range(200, 300, 20)] + [None] \
        + [b"\n".join(LINES[i:i + 20]) for i in range(300, 400, 20)] + [b"", None]
    produce_keyed(kafka.bootstrap, topic, [(0, v) for v in single] + [(1, v) for v in packed])
    url, run_dir = kafka.url(topic, "tombstones"), tmp_path / "run"

    s = train(url, run_dir, capsys)
    assert s["records_trained"] == 400
    assert s["rejected_by_reason"] == {"tombstone": 6, "empty_message": 2}
    expected = {(0, 0, "tombstone"), (0, 101, "tombstone"), (0, 102, "empty_message"), (0, 203, "tombstone"),
                (1, 0, "tombstone"), (1, 6, "tombstone"), (1, 12, "empty_message"), (1, 13, "tombstone")}
    letters = kafka.dead_letters(f"{topic}.dead-letter")
    assert {(d["partition"], d["offset"], d["reason"]) for d in letters} == expected
    assert all(d["raw"] == "" for d in letters)
    # The resume point passes the trailing tombstones: a restart reads nothing again.
    ends = {f"{topic}/0": len(single), f"{topic}/1": len(packed)}
    assert load_checkpoint(run_dir).positions == ends
    assert kafka.committed("tombstones", topic, 2) == ends

    again = train(url, run_dir, capsys, "--resume", str(run_dir))
    assert again["records_trained"] == 0 and again["records_rejected"] == 0
    assert again["records_trained_total"] == 400
    assert load_checkpoint(run_dir).positions == ends
    assert len(kafka.dead_letters(f"{topic}.dead-letter")) == len(expected)


def test_json_tombstones_and_values_no_decoder_takes(kafka, tmp_path, capsys, kafka_client):
    """value=json: a null value is a tombstone (not bad_json), and JSON nested deeper than the
    recursion limit is one `undecodable` message while the rest of its fetch trains."""
    topic = kafka.topic()
    values = [None] + [json_value(line) for line in LINES[:50]] + [TOO_DEEP, None] \
        + [json_value(line) for line in LINES[50:100]] + [None]
    produce_keyed(kafka.bootstrap, topic, [(0, v) for v in values])
    url, run_dir = kafka.url(topic, "json-tombstones") + "&value=json", tmp_path / "run"

    s = train(url, run_dir, capsys)
    assert s["records_trained"] == 100
    assert s["rejected_by_reason"] == {"tombstone": 3, "undecodable": 1}
    letters = {d["offset"]: d for d in kafka.dead_letters(f"{topic}.dead-letter")}
    assert {o: d["reason"] for o, d in letters.items()} == {0: "tombstone", 51: "undecodable",
                                                            52: "tombstone", 103: "tombstone"}
    assert "RecursionError" in letters[51]["detail"]
    assert load_checkpoint(run_dir).positions == {f"{topic}/0": len(values)}
    again = train(url, run_dir, capsys, "--resume", str(run_dir))
    assert again["records_trained"] == 0 and again["records_rejected"] == 0


def test_a_value_that_makes_the_decoder_raise_rejects_that_message_only():
    """The fetch is decoded in halves down to the message that raises; the rows of every
    other message come out as a whole-fetch decode would give them."""
    good = [json_value(line) for line in LINES[:9]]
    values = good[:4] + [TOO_DEEP] + good[4:] + [None]
    n = len(values)
    out = decode_messages(values, np.zeros(n, np.int32), np.arange(10, 10 + n), np.full(n, 5, np.int64),
                          ("t/0",), CRITEO, "json")
    clean = decode_messages(good, np.zeros(9, np.int32), np.arange(9), np.full(9, 5, np.int64),
                            ("t/0",), CRITEO, "json")
    assert np.array_equal(out.batch.keys, clean.batch.keys)
    assert np.array_equal(out.batch.labels, clean.batch.labels)
    assert out.batch.offset.tolist() == [10, 11, 12, 13, 15, 16, 17, 18, 19]
    assert out.rows_per_message.tolist() == [1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0]
    assert sorted((r.offset, r.reason) for r in out.rejected) == [(14, "undecodable"), (20, "tombstone")]


@pytest.mark.parametrize("value_format", ["text", "json"])
def test_null_values_decode_to_tombstone_rejects_at_their_offsets(value_format):
    line = LINES[0] if value_format == "text" else json_value(LINES[0])
    values = [None, line, None, b"", line, None]
    n = len(values)
    out = decode_messages(values, np.array([0, 0, 1, 1, 1, 1], np.int32), np.arange(n), np.zeros(n, np.int64),
                          ("t/0", "t/1"), CRITEO, value_format)
    assert len(out.batch) == 2 and out.batch.offset.tolist() == [1, 4]
    empty = "empty_message" if value_format == "text" else "bad_json"    # b"" is no JSON object
    assert sorted((r.partition, r.offset, r.reason) for r in out.rejected) == [
        ("t/0", 0, "tombstone"), ("t/1", 2, "tombstone"), ("t/1", 3, empty), ("t/1", 5, "tombstone")]
    assert all(r.raw == b"" for r in out.rejected if r.reason == "tombstone")


def test_null_values_under_a_declared_schema_are_tombstones():
    from tests.connectors.kafka.test_schema_messages import SCHEMA, rec
    values = [None, rec(1), b"", None]
    out = decode_messages(values, np.zeros(4, np.int32), np.arange(4), np.zeros(4, np.int64), ("t/0",), SCHEMA)
    assert out.batch.offset.tolist() == [1] and out.rows_per_message.tolist() == [0, 1, 0, 0]
    assert sorted((r.offset, r.reason) for r in out.rejected) == [(0, "tombstone"), (2, "empty_message"),
                                                                  (3, "tombstone")]
