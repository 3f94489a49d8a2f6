"""Kafka message decoding, position bookkeeping and URLs (no broker needed)."""
import gzip
import json

import numpy as np
import pytest

from stream_ctr.connectors.batch import Batch
from stream_ctr.connectors.decode import decode_lines
from stream_ctr.connectors.files import SAMPLE_PATHS, SourceError
from stream_ctr.connectors.formats import AVAZU, CRITEO
from stream_ctr.connectors.kafka.decode import decode_messages
from stream_ctr.connectors.kafka.options import (KafkaOptions, dead_letter_problem, default_group_warning,
                                                 parse_kafka_url, start_timestamp_ms)
from stream_ctr.connectors.kafka.positions import ROWS_DONE, PositionBook, from_positions, to_positions


def sample_lines(name: str, n: int) -> list[bytes]:
    lines = gzip.open(SAMPLE_PATHS[name], "rb").read().split(b"\n")
    return lines[1:n + 1] if name == "avazu" else lines[:n]


def decode(values, fmt=CRITEO, parts=None, value_format="text"):
    n = len(values)
    parts = np.zeros(n, np.int32) if parts is None else np.array(parts, np.int32)
    return decode_messages(values, parts, np.arange(100, 100 + n), np.full(n, 1234), ("t/0", "t/1"),
                           fmt, value_format)


def test_one_record_per_message_matches_the_file_decoder():
    lines = sample_lines("criteo", 50)
    d = decode(lines, parts=[i % 2 for i in range(50)])
    ref, _ = decode_lines(b"\n".join(lines), CRITEO, "f", 0)
    assert np.array_equal(d.batch.keys, ref.keys) and np.array_equal(d.batch.dense, ref.dense)
    assert d.batch.offset.tolist() == list(range(100, 150))          # Kafka offsets
    assert d.batch.partition.tolist() == [i % 2 for i in range(50)]
    assert d.batch.partitions == ("t/0", "t/1")
    assert (d.batch.event_time_ms == 1234).all()                      # Criteo: the message time
    assert d.rows_per_message.tolist() == [1] * 50 and not d.rejected


def test_packed_messages_trailing_newlines_and_empty_messages():
    lines = sample_lines("criteo", 10)
    values = [lines[0] + b"\n", b"\n".join(lines[1:4]), b"", b"1\t2", lines[4] + b"\r\n",
              b"\n".join(lines[5:10]) + b"\n"]
    d = decode(values)
    ref, _ = decode_lines(b"\n".join(lines), CRITEO, "f", 0)
    assert np.array_equal(d.batch.keys, ref.keys)
    assert d.batch.offset.tolist() == [100, 101, 101, 101, 104, 105, 105, 105, 105, 105]
    assert d.rows_per_message.tolist() == [1, 3, 0, 0, 1, 5]
    assert d.line_in_message.tolist() == [0, 0, 1, 2, 0, 0, 1, 2, 3, 4]
    assert sorted((r.offset, r.reason) for r in d.rejected) == [(102, "empty_message"),
                                                                (103, "field_count")]
    # Several records in one message share its offset: a reject among them says which it was.
    bad = decode([b"\n".join([lines[0], b"1\t2", lines[1]]), b"1\t2"])
    assert [(r.offset, r.reason, r.detail) for r in bad.rejected] == [
        (100, "field_count", "record line 2 of 3 in its message"), (101, "field_count", "")]


def test_json_objects_map_named_fields_through_the_format():
    lines = sample_lines("criteo", 3)
    objects = []
    for i, line in enumerate(lines):
        fields = line.decode().split("\t")
        # A missing value is an absent key (record 0) or null (the others); keys in any order.
        obj = {name: (None if not v else int(v) if name == "label" or name.startswith("I") else v)
               for name, v in zip(CRITEO.field_names, fields) if v or i}
        objects.append(json.dumps(dict(reversed(list(obj.items())))).encode())
    values = objects + [b"{not json", b'{"label": 1, "C1": "a\\nb"}', b"[1, 2]"]
    d = decode(values, value_format="json")
    ref, _ = decode_lines(b"\n".join(lines), CRITEO, "f", 0)
    assert np.array_equal(d.batch.keys, ref.keys) and np.array_equal(d.batch.dense, ref.dense)
    assert [(r.offset, r.reason) for r in d.rejected] == [(103, "bad_json"), (104, "bad_json"),
                                                          (105, "bad_json")]
    assert d.rejected[0].raw == b"{not json"


def test_avazu_json_and_text_agree():
    lines = sample_lines("avazu", 20)
    text = decode(lines, fmt=AVAZU)
    objects = [json.dumps(dict(zip(AVAZU.field_names, ln.decode().split(",")))).encode() for ln in lines]
    js = decode(objects, fmt=AVAZU, value_format="json")
    assert np.array_equal(text.batch.keys, js.batch.keys)
    assert (text.batch.event_time_ms > 0).all()                      # Avazu has its own time
    assert np.array_equal(text.batch.event_time_ms, js.batch.event_time_ms)


def batch_of(offsets: list[int], partition: int = 0, names=("t/0",)) -> Batch:
    b = Batch.empty(CRITEO.n_keys, CRITEO.n_dense, names)
    n = len(offsets)
    return Batch(np.zeros(n, np.float32), np.zeros((n, 13), np.float32), np.zeros((n, 39), np.int64),
                 np.zeros(n, np.int64), np.full(n, partition, np.int32), np.array(offsets, np.int64),
                 b.partitions)


def test_fold_over_batches_that_split_a_packed_message():
    book = PositionBook()
    book.own("t/0", (10, 0))
    book.note_message_rows("t/0", np.array([10, 11, 12]), np.array([1, 4, 1]))   # message 11 holds 4 rows
    book.advance(book.trained, batch_of([10, 11]))
    assert to_positions(book.trained) == {"t/0": 11, "t/0" + ROWS_DONE: 1}
    book.advance(book.trained, batch_of([11, 11]))
    assert book.trained["t/0"] == (11, 3)
    book.advance(book.trained, batch_of([11, 12]))
    assert to_positions(book.trained) == {"t/0": 13}
    book.forget_trained_messages()
    assert book.message_rows["t/0"] == {}


def test_resume_inside_a_packed_message_skips_the_trained_rows():
    book = PositionBook()
    book.own("t/0", from_positions({"t/0": 11, "t/0" + ROWS_DONE: 3, "file:x": 5})["t/0"])
    batch = batch_of([11, 11, 11, 11, 12])
    kept = book.drop_skipped(batch)
    assert kept.offset.tolist() == [11, 12] and not book.skip
    book.note_message_rows("t/0", np.array([11, 12]), np.array([4, 1]))
    book.advance(book.trained, kept)
    assert to_positions(book.trained) == {"t/0": 13}


def test_urls_and_options():
    url = parse_kafka_url("kafka://127.0.0.1:9092,127.0.0.1:9093/a,b?group=g&format=avazu&value=json",
                          KafkaOptions(start="latest"))
    assert url.bootstrap == ("127.0.0.1:9092", "127.0.0.1:9093") and url.topics == ("a", "b")
    assert (url.options.group, url.options.format, url.options.value_format, url.options.start) == \
        ("g", "avazu", "json", "latest")
    for bad, words in [("kafka:///t", "no broker"), ("kafka://h/t", "HOST:PORT"),
                       ("kafka://h:1", "no topic"), ("kafka://h:1/t?grp=x", "unknown parameter"),
                       ("kafka://h:1/t?format=x", "kafka.format"), ("kafka://h:1/t t", "topic name"),
                       ("http://h:1/t", "not a Kafka URL"),
                       ("kafka://[::1/t?group=g", "is not a valid URL .Invalid IPv6 URL")]:
        with pytest.raises(SourceError, match=words):
            parse_kafka_url(bad)
    assert start_timestamp_ms("2024-01-01T00:00:00") == 1704067200000
    assert KafkaOptions(start="yesterday").problem() .startswith("kafka.start")
    # The dead-letter topic is a topic name too: the producer refused it only at the
    # first bad record, with a traceback in the middle of the stream.
    for name, words in [("bad name/with spaces", "'bad name/with spaces' is not a valid topic name"),
                        ("x" * 300, "300 characters; at most 249"), ("..", "not a valid topic name"),
                        ("{topic}.dlq/1", "'{topic}.dlq/1' gives 't.dlq/1', which is not a valid")]:
        assert KafkaOptions(dead_letter_topic=name).problem().startswith("kafka.dead_letter_topic "), name
        assert words in KafkaOptions(dead_letter_topic=name).problem(), name
    assert KafkaOptions(dead_letter_topic="").problem() is None           # the run's file instead
    assert KafkaOptions(dead_letter_topic="{topic}-" + "x" * 240).problem() is None
    assert "251 characters" in dead_letter_problem(KafkaOptions(dead_letter_topic="{topic}-" + "x" * 244),
                                                   "clicks")      # known once the source topic is
    assert "sasl_mechanism" in KafkaOptions(sasl_mechanism="PLAIN").problem()


def test_security_options_pass_through_and_the_password_comes_from_the_environment(monkeypatch):
    from stream_ctr.connectors.kafka.options import client_config
    options = KafkaOptions(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512",
                           sasl_username="trainer", ssl_cafile="/etc/ca.pem",
                           sasl_password_env="TEST_KAFKA_PW")
    url = parse_kafka_url("kafka://b1:9093,b2:9093/clicks", options)
    monkeypatch.delenv("TEST_KAFKA_PW", raising=False)
    with pytest.raises(SourceError, match="TEST_KAFKA_PW"):
        client_config(url)
    monkeypatch.setenv("TEST_KAFKA_PW", "s3cret")
    config = client_config(url)
    assert config["bootstrap_servers"] == ["b1:9093", "b2:9093"]
    assert (config["security_protocol"], config["sasl_mechanism"], config["sasl_plain_username"],
            config["sasl_plain_password"], config["ssl_cafile"]) == \
        ("SASL_SSL", "SCRAM-SHA-512", "trainer", "s3cret", "/etc/ca.pem")
    assert "s3cret" not in repr(options)          # options go into checkpoints; secrets never do
    # the same options for librdkafka (kafka.client = confluent)
    from stream_ctr.connectors.kafka.confluent import librdkafka_config
    rd = librdkafka_config(url)
    assert (rd["bootstrap.servers"], rd["security.protocol"], rd["sasl.mechanism"], rd["sasl.username"],
            rd["sasl.password"], rd["ssl.ca.location"], rd["ssl.endpoint.identification.algorithm"]) == \
        ("b1:9093,b2:9093", "SASL_SSL", "SCRAM-SHA-512", "trainer", "s3cret", "/etc/ca.pem", "https")
    assert rd["enable.auto.commit"] is False and rd["allow.auto.create.topics"] is False


def test_librdkafka_takes_every_fetch_size_the_options_accept():
    """Fetch sizes are soft limits (a larger message still comes whole): any value the
    options accept makes a librdkafka consumer, and any message size can be received."""
    confluent_kafka = pytest.importorskip("confluent_kafka")
    from stream_ctr.connectors.kafka.confluent import librdkafka_config
    for fetch, partition in [(1024, 1024), (65536, 1 << 20), (999_999, 999_999), (64 << 20, 16 << 20),
                             ((1 << 31) - 1, (1 << 31) - 1), (10 ** 12, 10 ** 12)]:
        options = KafkaOptions(fetch_max_bytes=fetch, max_partition_fetch_bytes=partition)
        assert options.problem() is None
        config = librdkafka_config(parse_kafka_url("kafka://127.0.0.1:9/t", options))
        assert config["receive.message.max.bytes"] == 2147483647
        confluent_kafka.Consumer(config).close()      # librdkafka checks the properties here


def test_a_run_without_a_group_warns_that_it_shares_the_default_one(tmp_path):
    from stream_ctr.config import Config
    from stream_ctr.train.inputs import KafkaInput
    warning = default_group_warning(parse_kafka_url("kafka://127.0.0.1:9/clicks"))
    assert warning == ("kafka: the URL names no group (?group=) and kafka.group is not set: reading clicks "
                       "in the default group 'stream-ctr', whose committed offsets every run without a "
                       "group shares; give this run its own with kafka://127.0.0.1:9/clicks?group=NAME")
    assert default_group_warning(parse_kafka_url("kafka://127.0.0.1:9/clicks?group=stream-ctr")) is None
    assert default_group_warning(parse_kafka_url("kafka://127.0.0.1:9/clicks", KafkaOptions(group="ctr"))) is None
    cfg = Config()
    cfg.train.run_dir = str(tmp_path / "run")
    kafka_input = KafkaInput(cfg, parse_kafka_url("kafka://127.0.0.1:9/clicks"), lambda: 0, True)
    assert kafka_input.start_warnings() == [warning]           # (what the trainer prints at its start)


def test_the_consumer_client_is_an_option():
    assert parse_kafka_url("kafka://h:1/t?client=confluent").options.client == "confluent"
    assert parse_kafka_url("kafka://h:1/t").options.client == "kafka-python"
    with pytest.raises(SourceError, match="kafka.client must be one of kafka-python, confluent"):
        parse_kafka_url("kafka://h:1/t?client=librdkafka")


def test_a_resume_names_the_topic_and_group_it_switches_to():
    from stream_ctr.config import Config
    from stream_ctr.train.inputs import switched_source
    saved = Config()
    saved.data.source = "kafka://127.0.0.1:9/a,b?group=g1"
    same = parse_kafka_url("kafka://127.0.0.1:9/b,a", KafkaOptions(group="g1"))
    assert switched_source(saved, same) == ""
    assert switched_source(saved, parse_kafka_url("kafka://127.0.0.1:9/a,b?group=g2")) == (
        "the checkpoint read topics a, b (group 'g1'); this run reads topics a, b (group 'g2'): "
        "topics a, b from the checkpoint's offsets")
    assert switched_source(saved, parse_kafka_url("kafka://127.0.0.1:9/b,c?group=g1&start=latest")) == (
        "the checkpoint read topics a, b (group 'g1'); this run reads topics b, c (group 'g1'): topic b "
        "from the checkpoint's offsets, topic c from the committed offsets of group 'g1' (else "
        "kafka.start = latest), the checkpoint's offsets of topic a are not used")
    saved.data.source = "criteo:sample"                     # (a file run's checkpoint)
    assert switched_source(saved, same) == ""
