"""Connecting a KafkaSource's consumer, and watching the broker for outages.

At start-up an unreachable broker or a missing topic is a `SourceError` (one
clear line).  Mid-stream, kafka-python reconnects by itself (backoff up to
`kafka.reconnect_backoff_max_s`); `BrokerWatch` only notices: when reads
have waited for records a while it probes the broker, logs one line when it
goes away and one when it is back, and counts outages for the metrics.

A topic deleted mid-stream (or a partition gone: the topic recreated with
fewer) is `StreamGone`, a `SourceError`: nothing arrives from it again, so it
must not look like an idle stream that ended.  `missing_partitions` asks the
broker's metadata, which is the only place that says so: on tansu a fetch of
a deleted topic returns no records and no error (kafka-python), and a
ListOffsets answers offset 0.  Group commits fail (UnknownTopicOrPartition),
but only at the next checkpoint.
"""
from __future__ import annotations

import logging
import time
from typing import Iterable

from stream_ctr.connectors.files import SourceError
from stream_ctr.connectors.kafka.options import KafkaUrl, client_config, split_partition_name

log = logging.getLogger("stream_ctr.connectors.kafka")
PROBE_EVERY_S = 2.0          # without records this long, check the broker is still there
PROBE_TIMEOUT_MS = 2000
# kafka-python refreshes the metadata of the topics it reads this often (its default,
# 5 min, noticed a deleted topic that late); the confluent backend asks each time.
METADATA_MAX_AGE_MS = 5000


class StreamGone(SourceError):
    """A topic (or a partition) the source reads was deleted while it ran."""

    def __init__(self, what: str) -> None:
        self.what = what            # "topic 'clicks' was deleted", "partition clicks/3 is gone"
        super().__init__(self._message("the records trained before are in the run's checkpoints"))

    def checkpointed_at(self, path: str) -> None:
        """Name the checkpoint that holds what was trained (the run writes one before it stops)."""
        self.args = (self._message(f"what was trained is checkpointed at {path}"),)

    def _message(self, kept: str) -> str:
        return f"kafka: {self.what} while training: {kept}; recreate it or point the run at another topic"


def topic_partition(name: str):
    """kafka-python's TopicPartition of a "topic/partition" name."""
    from kafka import TopicPartition
    topic, partition = split_partition_name(name)
    return TopicPartition(topic, partition)


def unreachable_message(url: KafkaUrl, error: Exception) -> str:
    return (f"cannot reach a Kafka broker at {','.join(url.bootstrap)} within "
            f"{url.options.connect_timeout_s:.0f} s ({type(error).__name__}); is it running, and "
            f"is {url.text} the right address? (kafka.connect_timeout_s sets the wait)")


def connect_consumer(url: KafkaUrl):
    """A consumer in `url`'s group: auto-commit off, no topic auto-creation, large fetches.

    kafka-python's KafkaConsumer, or with ``kafka.client = confluent`` the
    librdkafka one behind the same calls (`stream_ctr.connectors.kafka.confluent`)."""
    from kafka import KafkaConsumer
    from kafka.errors import KafkaError
    o = url.options
    try:
        if o.client == "confluent":
            consumer = _confluent_consumer(url)
        else:
            consumer = KafkaConsumer(
                **client_config(url), group_id=o.group, enable_auto_commit=False,
                auto_offset_reset="earliest", allow_auto_create_topics=False,
                max_poll_records=o.max_poll_records, fetch_max_bytes=o.fetch_max_bytes,
                max_partition_fetch_bytes=o.max_partition_fetch_bytes,
                fetch_max_wait_ms=int(min(500, o.poll_timeout_s * 1000)),
                session_timeout_ms=o.session_timeout_ms, heartbeat_interval_ms=o.heartbeat_interval_ms,
                metadata_max_age_ms=METADATA_MAX_AGE_MS)
            _no_topic_creation(consumer)
        missing = [t for t in url.topics if not consumer.partitions_for_topic(t)]
    except KafkaError as e:
        raise SourceError(unreachable_message(url, e)) from None
    if missing:
        consumer.close(autocommit=False)
        raise SourceError(f"topic {', '.join(map(repr, missing))} does not exist on "
                          f"{','.join(url.bootstrap)} (create it, e.g. with "
                          f"`stream-ctr replay FILE --to {url.text} --partitions N`)")
    return consumer


def _no_topic_creation(consumer) -> None:
    """kafka-python 3.0 does not hand `allow_auto_create_topics` to its metadata client,
    so every metadata request of the subscribed topics asked the broker to create them:
    a topic deleted mid-stream came back (empty, with the broker's default partition
    count) and the trainer went on reading it.  Set it where the requests are built."""
    cluster = getattr(getattr(consumer, "_client", None), "cluster", None)
    if cluster is not None and "allow_auto_create_topics" in getattr(cluster, "config", {}):
        cluster.config["allow_auto_create_topics"] = False


def missing_partitions(consumer, names: Iterable[str], fresh: bool = False) -> tuple[set[str], str]:
    """The partitions of `names` ("topic/p") that the broker's metadata does not list
    (their topic was deleted, or has fewer partitions now), and what that is in words
    ("topic 'a' was deleted", "partition a/3 is gone ('a' has 2 now)").

    kafka-python answers from its metadata (at most `METADATA_MAX_AGE_MS` old; a topic
    it lacks is asked for at once), or from a request sent now when `fresh`; the
    confluent backend always asks.  A KafkaError when the broker cannot answer."""
    by_topic: dict[str, list[str]] = {}
    for name in names:
        by_topic.setdefault(split_partition_name(name)[0], []).append(name)
    if fresh and by_topic:
        consumer.topics()
    missing, words = set(), []
    for topic, of_topic in sorted(by_topic.items()):
        listed = consumer.partitions_for_topic(topic) or set()
        gone = sorted((n for n in of_topic if split_partition_name(n)[1] not in listed),
                      key=lambda n: split_partition_name(n)[1])
        missing.update(gone)
        if gone and not listed:
            words.append(f"topic {topic!r} was deleted")
        elif gone:
            words.append(f"partition{'s' if len(gone) > 1 else ''} {', '.join(gone)} "
                         f"{'are' if len(gone) > 1 else 'is'} gone ({topic!r} has {len(listed)} now)")
    return missing, "; ".join(words)


def _confluent_consumer(url: KafkaUrl):
    from stream_ctr.connectors.kafka import confluent as kafka_confluent
    if not kafka_confluent.available():
        raise SourceError("kafka.client = confluent needs the confluent-kafka package "
                          "(pip install confluent-kafka), or use kafka.client = kafka-python")
    return kafka_confluent.ConfluentConsumer(url)


def every_connection_down(consumer) -> bool | None:
    """Whether the consumer holds no live connection to any broker, or None if it cannot
    tell: a question for a consumer with no partition to probe. A member of a group
    keeps one to its coordinator (heartbeats) while the broker is there.
    confluent-kafka's adapter says so from librdkafka's all-brokers-down event;
    kafka-python from its connection table (an internal of kafka-python 3.0)."""
    if hasattr(consumer, "brokers_down"):
        return bool(consumer.brokers_down)
    conns = getattr(getattr(getattr(consumer, "_client", None), "_manager", None), "_conns", None)
    if not isinstance(conns, dict):
        return None
    return not any(getattr(c, "connected", False) for c in list(conns.values()))


class BrokerWatch:
    """Outage bookkeeping: when reads come back empty, is the broker still there?"""

    def __init__(self, url: KafkaUrl, stats) -> None:
        self._where = ",".join(url.bootstrap)
        self._max_backoff_s = url.options.reconnect_backoff_max_s
        self._stats = stats
        self.outage_since: float | None = None
        self._next_probe = time.monotonic() + PROBE_EVERY_S
        self._backoff_s = 0.5
        self._down_probes = 0          # probes in a row that found no broker connection

    @property
    def in_outage(self) -> bool:
        return self.outage_since is not None

    def records_arrived(self, now: float) -> bool:
        """Records came: an outage (if any) is over.  True if one just ended."""
        self._next_probe = now + PROBE_EVERY_S
        self._backoff_s = 0.5
        if self.outage_since is None:
            return False
        seconds = now - self.outage_since
        log.warning("kafka: broker %s reachable again after %.1f s; training continues",
                    self._where, seconds)
        self._stats.outage_s += seconds
        self._stats.connected = True
        self.outage_since = None
        return True

    def nothing_arrived(self, consumer, partitions: list[str], now: float) -> bool:
        """A read waited in vain; probe the broker when due.  True if an outage just ended."""
        from kafka.errors import KafkaError
        if now < self._next_probe:
            return False
        if not partitions:                  # nothing to ask about (no assignment yet, or lost)
            self._next_probe = now + PROBE_EVERY_S
            # A group that lost its partitions to an outage must not hide the outage: the
            # client's connections say it instead of a probe, on two probes in a row (a
            # client between two connections has none for a moment).
            down = every_connection_down(consumer)
            if down is None:
                return False
            if not down:
                self._down_probes = 0
                return self.records_arrived(now)       # connected again: an outage ends
            self._down_probes += 1
            if self._down_probes >= 2:
                self._outage_started("all broker connections down", now)
            return False
        try:
            consumer.beginning_offsets([topic_partition(n) for n in partitions],
                                       timeout_ms=PROBE_TIMEOUT_MS)
        except KafkaError as e:
            self._outage_started(type(e).__name__, now)
            self._backoff_s = min(self._backoff_s * 2, self._max_backoff_s)
            self._next_probe = time.monotonic() + self._backoff_s
            return False
        return self.records_arrived(time.monotonic())

    def _outage_started(self, why: str, now: float) -> None:
        """The broker did not answer: the outage starts now (said once), or goes on."""
        if self.outage_since is None:
            self.outage_since = now
            self._stats.outages += 1
            self._stats.connected = False
            log.warning("kafka: broker %s unreachable (%s); training waits, retrying with "
                        "backoff up to %.0f s", self._where, why, self._max_backoff_s)
        else:
            log.info("kafka: broker still unreachable after %.0f s", now - self.outage_since)
