"""`replay`: files into topics, in file order, with packing, keys, resume; and the CLI."""
import gzip
import json

import pytest

from stream_ctr.connectors.files import SAMPLE_PATHS, SourceError
from stream_ctr.connectors.formats import AVAZU
from stream_ctr.connectors.kafka.replay import replay_file
from stream_ctr.cli import main

CRITEO_LINES = gzip.open(SAMPLE_PATHS["criteo"], "rb").read().split(b"\n")
AVAZU_LINES = gzip.open(SAMPLE_PATHS["avazu"], "rb").read().split(b"\n")


def by_partition(records):
    out: dict[int, list[bytes]] = {}
    for r in records:
        out.setdefault(r.partition, []).extend(r.value.split(b"\n"))
    return out


def test_packed_round_robin_replay_keeps_file_order_and_resumes(kafka):
    topic = kafka.topic(partitions=2)
    s1 = replay_file("criteo:sample", kafka.url(topic), packed=100, limit=1000)
    assert (s1.records, s1.messages, s1.partitions, s1.next_offset) == (1000, 10, 2, 1000)
    s2 = replay_file("criteo:sample", kafka.url(topic), packed=100, resume=s1.next_offset, limit=500)
    assert (s2.first_offset, s2.next_offset, s2.records) == (1000, 1500, 500)
    parts = by_partition(kafka.read_all(topic, 2))
    # Message m holds lines [100m, 100m + 100) and went to partition m % 2.
    expected = {p: [ln for m in range(15) if m % 2 == p for ln in CRITEO_LINES[100 * m:100 * m + 100]]
                for p in (0, 1)}
    assert parts == expected


def test_keyed_replay_sends_one_key_to_one_partition_and_skips_the_avazu_header(kafka):
    topic = kafka.topic(partitions=3)
    s = replay_file("avazu:sample", kafka.url(topic), key="field:device_ip", limit=300)
    assert s.records == 300
    records = kafka.read_all(topic, 3)
    assert sorted(r.value for r in records) == sorted(AVAZU_LINES[1:301])   # header not sent
    partition_of = {}
    for r in records:
        assert partition_of.setdefault(r.key, r.partition) == r.partition
        assert r.key == r.value.split(b",")[AVAZU.field_names.index("device_ip")]
    assert len(set(partition_of.values())) > 1


def test_replay_creates_a_missing_topic_and_says_so(kafka):
    topic = f"replay-missing-{kafka.topic()}"
    s = replay_file("criteo:sample", kafka.url(topic), limit=50)
    assert s.created_topic and s.partitions == 1 and s.records == 50
    again = replay_file("criteo:sample", kafka.url(topic), limit=10)
    assert not again.created_topic


def test_replay_errors(kafka):
    topic = kafka.topic()
    with pytest.raises(SourceError, match="--key"):
        replay_file("criteo:sample", kafka.url(topic), key="field:nope")
    with pytest.raises(SourceError, match="past the end"):
        replay_file("criteo:sample", kafka.url(topic), resume=10 ** 6)


def test_replay_cli_json_summary(kafka, capsys):
    topic = f"cli-{kafka.topic()}"
    code = main(["replay", "criteo:sample", "--to", kafka.url(topic), "--partitions", "3",
                 "--limit", "250", "--packed", "50", "--json", "--quiet"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    assert (summary["records"], summary["messages"], summary["partitions"], summary["next_offset"]) == \
        (250, 5, 3, 250)
    assert main(["replay", "criteo:sample", "--to", "kafka://nohost/t"]) == 3       # the source
    assert "HOST:PORT" in capsys.readouterr().err


def in_file_order_per_partition(parts: dict[int, list[bytes]], lines: list[bytes]) -> bool:
    """The partitions hold exactly `lines`, each partition a subsequence of them in order."""
    def subsequence(part):
        it = iter(lines)
        return all(any(ln == x for x in it) for ln in part)
    return (sorted(ln for part in parts.values() for ln in part) == sorted(lines)
            and all(subsequence(part) for part in parts.values()))


def small_chunks(monkeypatch) -> None:
    """Chunks of ~300 lines, so a replay of a few thousand lines has several."""
    import stream_ctr.connectors.kafka.replay
    monkeypatch.setattr(stream_ctr.connectors.kafka.replay, "CHUNK_BYTES", 64 << 10)


def test_broker_stopped_mid_replay_stops_with_next_offset_and_the_resume_loses_nothing(
        fresh_broker, monkeypatch, capsys):
    import stream_ctr.connectors.kafka.replay
    from stream_ctr.connectors.kafka.options import parse_kafka_url
    from stream_ctr.connectors.kafka.sink import create_topic
    from tests.kafka_broker import KafkaHelper
    small_chunks(monkeypatch)
    monkeypatch.setattr(stream_ctr.connectors.kafka.replay, "RETRY_S", 2.0, raising=False)
    kafka, topic, total = KafkaHelper(fresh_broker.bootstrap), "replay-outage", 3000
    url = kafka.url(topic)
    at_stop = {}

    def stop_the_broker_once(records, n_bytes, seconds, next_offset):
        if fresh_broker.running and records >= 1000:
            at_stop.update(records=records, next_offset=next_offset,
                           on_broker=by_partition(kafka.read_all(topic, 2)))
            fresh_broker.stop()              # memory storage: what it held is gone

    create_topic(parse_kafka_url(url), topic, 2)
    with pytest.raises(SourceError, match="acknowledged") as failed:
        replay_file("criteo:sample", url, packed=10, limit=total, progress=stop_the_broker_once)
    s = failed.value.summary
    # Exactly what the broker held when it stopped was acknowledged, and it is
    # every line before next_offset, each partition in file order.
    assert 0 < s.next_offset == s.records == at_stop["records"] == at_stop["next_offset"] < total
    assert f"--resume {s.next_offset}" in str(failed.value) and "\n" not in str(failed.value)
    assert in_file_order_per_partition(at_stop["on_broker"], CRITEO_LINES[:s.next_offset])

    fresh_broker.start()                     # same port, empty
    create_topic(parse_kafka_url(url), topic, 2)
    assert main(["replay", "criteo:sample", "--to", url, "--packed", "10", "--limit",
                 str(total - s.next_offset), "--resume", str(s.next_offset), "--json", "--quiet"]) == 0
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (resumed["records"], resumed["next_offset"]) == (total - s.next_offset, total)
    assert in_file_order_per_partition(by_partition(kafka.read_all(topic, 2)),
                                       CRITEO_LINES[s.next_offset:total])


def test_truncated_gzip_stops_with_what_was_produced_and_next_offset(kafka, monkeypatch, tmp_path,
                                                                      capsys):
    small_chunks(monkeypatch)
    whole = gzip.compress(b"\n".join(CRITEO_LINES[:6000]) + b"\n")
    path = tmp_path / "day.tsv.gz"
    path.write_bytes(whole[:len(whole) // 2])
    topic = kafka.topic()
    with pytest.raises(SourceError, match="truncated") as failed:
        replay_file(f"criteo:{path}", kafka.url(topic))
    s = failed.value.summary
    assert str(path) in str(failed.value) and f"--resume {s.next_offset}" in str(failed.value)
    assert 0 < s.records == s.next_offset < 6000
    assert [r.value for r in kafka.read_all(topic)] == CRITEO_LINES[:s.next_offset]
    # The command: one error line, non-zero status.
    assert main(["replay", f"criteo:{path}", "--to", kafka.url(kafka.topic()), "--quiet"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "truncated" in err[0] and "--resume" in err[0], err


def test_a_bad_key_creates_no_topic(kafka, capsys):
    from stream_ctr.connectors.kafka.options import parse_kafka_url
    from stream_ctr.connectors.kafka.sink import topic_partitions
    url = kafka.url("replay-bad-key")
    assert main(["replay", "criteo:sample", "--to", url, "--partitions", "5", "--key", "field:nope"]) == 3
    assert "--key" in capsys.readouterr().err
    assert topic_partitions(parse_kafka_url(url), "replay-bad-key") == 0


def test_interrupted_keyed_replay_reports_the_first_unacknowledged_line(kafka, monkeypatch):
    import stream_ctr.connectors.kafka.replay
    topic = kafka.topic(partitions=3)
    sends = [0]

    def ctrl_c_after_the_1990th_send(rate, records, t0):     # called after each send
        sends[0] += 1
        if sends[0] == 1990:
            raise KeyboardInterrupt

    # One chunk, sent partition by partition: the last partition's last 10 lines are not sent.
    monkeypatch.setattr(stream_ctr.connectors.kafka.replay, "_throttle", ctrl_c_after_the_1990th_send)
    s = replay_file("criteo:sample", kafka.url(topic), key="line", rate=1e9, limit=2000)
    assert s.interrupted and s.records == 1990
    on_broker = {int(r.key) for r in kafka.read_all(topic, 3)}
    assert len(on_broker) == s.records
    # Every line before next_offset is on the broker, the line at it is not.
    assert 0 < s.next_offset < 2000 and set(range(s.next_offset)) <= on_broker
    assert s.next_offset not in on_broker
