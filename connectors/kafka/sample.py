"""The first records of a topic, read without a consumer group: what `schema infer` samples.

Every partition is read from its earliest offset (nothing is committed, no group
joins); a message's LF-separated lines are records, blank lines are not.
"""
from __future__ import annotations

import time

from stream_ctr.connectors.files import SourceError
from stream_ctr.connectors.kafka.client import unreachable_message
from stream_ctr.connectors.kafka.options import KafkaUrl, client_config


def sample_records(url: KafkaUrl, n_records: int, idle_s: float = 5.0) -> list[bytes]:
    """Up to `n_records` records from the start of `url`'s topics, in fetch order; fewer when
    nothing more arrives for `idle_s`.  SourceError when the broker or a topic is missing."""
    from kafka import KafkaConsumer, TopicPartition
    from kafka.errors import KafkaError
    try:
        consumer = KafkaConsumer(**client_config(url), group_id=None, enable_auto_commit=False,
                                 auto_offset_reset="earliest", allow_auto_create_topics=False)
        parts = [TopicPartition(t, p) for t in url.topics
                 for p in sorted(consumer.partitions_for_topic(t) or ())]
    except KafkaError as e:
        raise SourceError(unreachable_message(url, e)) from None
    try:
        if not parts:
            raise SourceError(f"topic {', '.join(url.topics)} does not exist on {','.join(url.bootstrap)} "
                              "or has no partitions")
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        records: list[bytes] = []
        last = time.monotonic()
        while len(records) < n_records and time.monotonic() - last < idle_s:
            for batch in consumer.poll(timeout_ms=500).values():
                for message in batch:
                    records.extend(line for line in (message.value or b"").split(b"\n") if line.strip())
                last = time.monotonic()
        return records[:n_records]
    finally:
        consumer.close()
