"""`replay`: files into topics, in file order, with packing, keys, resume; and the CLI."""
import gzip
import json

import pytest

from connectors.files import SAMPLE_PATHS, SourceError
from connectors.formats import AVAZU
from connectors.replay import replay_file
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
    parts = by_partition(kafka.read_all(topic, 2, idle_ms=1000))
    # Message m holds lines [100m, 100m + 100) and went to partition m % 2.
    expected = {p: [ln for m in range(15) if m % 2 == p for ln in CRITEO_LINES[100 * m:100 * m + 100]]
                for p in (0, 1)}
    assert parts == expected


def test_keyed_replay_sends_one_key_to_one_partition_and_skips_the_avazu_header(kafka):
    topic = kafka.topic(partitions=3)
    s = replay_file("avazu:sample", kafka.url(topic), key="field:device_ip", limit=300)
    assert s.records == 300
    records = kafka.read_all(topic, 3, idle_ms=1000)
    assert sorted(r.value for r in records) == sorted(AVAZU_LINES[1:301])   # header not sent
    partition_of = {}
    for r in records:
        assert partition_of.setdefault(r.key, r.partition) == r.partition
        assert r.key == r.value.split(b",")[AVAZU.field_names.index("device_ip")]
    assert len(set(partition_of.values())) > 1


def test_replay_errors(kafka):
    with pytest.raises(SourceError, match="does not exist"):
        replay_file("criteo:sample", kafka.url("replay-missing-topic"))
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
    assert main(["replay", "criteo:sample", "--to", "kafka://nohost/t"]) == 2
    assert "HOST:PORT" in capsys.readouterr().err
