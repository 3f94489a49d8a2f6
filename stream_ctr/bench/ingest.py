"""`stream-ctr bench ingest`: how fast records come out of Kafka, raw and decoded.

For each message layout (one record per message, and `packed` lines per
message) the same synthetic Criteo records are produced into a fresh
1-partition topic and read back by
  (a) a bare kafka-python consumer loop (assign, poll, touch every value), and
  (b) `KafkaSource.read()`, i.e. the same fetches plus joining the values and
      decoding them into a `Batch` (labels, dense, 39 hashed keys); the source
      decodes on a worker thread while its caller's thread fetches the next run;
and, when confluent-kafka is installed, the same pair with librdkafka:
  (a') a bare confluent-kafka consumer loop (assign, consume, touch every value),
  (b') `KafkaSource` with ``kafka.client = confluent``.
Clocks start when fetching can start (after the assignment, once connected;
for `KafkaSource`, once the group's partitions are positioned), so none
includes the group join and every one includes its first fetch: librdkafka
prefetches from the assignment on (up to a fetch of 64 MiB), so a clock started
at the first record would leave a quarter of a 1M-record packed run out of
(a') and (b').  The broker runs on the same machine (it competes for the cores).
"""
from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
import uuid
from pathlib import Path


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def _raw_loop(bootstrap: str, topic: str, n_messages: int) -> tuple[float, int, int]:
    """(seconds from the assignment, messages, value bytes) of a bare kafka-python loop."""
    from kafka import KafkaConsumer, TopicPartition
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None,
                             max_poll_records=20000, fetch_max_bytes=64 << 20,
                             max_partition_fetch_bytes=16 << 20)
    tp = TopicPartition(topic, 0)
    consumer.partitions_for_topic(topic)        # connected before the clock starts
    t0 = time.perf_counter()
    consumer.assign([tp])
    consumer.seek(tp, 0)
    seen = n_bytes = 0
    while seen < n_messages:
        for records in consumer.poll(timeout_ms=1000).values():
            seen += len(records)
            n_bytes += sum(len(r.value) for r in records)
    seconds = time.perf_counter() - t0
    consumer.close()
    return seconds, seen, n_bytes


def _confluent_raw_loop(bootstrap: str, topic: str, n_messages: int) -> tuple[float, int, int]:
    """(seconds from the assignment, messages, value bytes) of a bare confluent-kafka loop,
    with the librdkafka settings `KafkaSource` uses.  consume() returns after at most
    0.1 s, as soon as that many messages are there or the time is up."""
    from confluent_kafka import Consumer, TopicPartition
    from stream_ctr.connectors.kafka.confluent import librdkafka_config
    from stream_ctr.connectors.kafka.options import KafkaOptions, parse_kafka_url
    url = parse_kafka_url(f"kafka://{bootstrap}/{topic}",
                          KafkaOptions(group=f"bench-{uuid.uuid4().hex[:8]}"))
    consumer = Consumer(librdkafka_config(url))
    consumer.list_topics(topic, timeout=10)     # connected before the clock starts
    t0 = time.perf_counter()
    consumer.assign([TopicPartition(topic, 0, 0)])
    seen = n_bytes = 0
    while seen < n_messages:
        messages = consumer.consume(num_messages=20000, timeout=0.1)
        seen += len(messages)
        n_bytes += sum(len(m.value()) for m in messages)
    seconds = time.perf_counter() - t0
    consumer.close()
    return seconds, seen, n_bytes


def _clocked_source_class():
    from stream_ctr.connectors.kafka.source import KafkaSource

    class ClockedSource(KafkaSource):
        """KafkaSource noting when its partitions are positioned: from then on it fetches."""
        started_at: float | None = None

        def _position_new_partitions(self) -> None:
            super()._position_new_partitions()
            if self.started_at is None and not self._unpositioned:
                self.started_at = time.perf_counter()
    return ClockedSource


def _source_loop(bootstrap: str, topic: str, n_records: int,
                 client: str = "kafka-python") -> tuple[float, int, int]:
    """(seconds from the group's assignment, rows decoded, value bytes) through KafkaSource."""
    from stream_ctr.connectors.kafka.options import KafkaOptions, parse_kafka_url
    options = KafkaOptions(group=f"bench-{uuid.uuid4().hex[:8]}", session_timeout_ms=6000,
                           heartbeat_interval_ms=1000, dead_letter_topic="", client=client)
    source = _clocked_source_class()(parse_kafka_url(f"kafka://{bootstrap}/{topic}", options))
    rows = 0
    while rows < n_records:
        batch, _ = source.read()
        rows += len(batch)
    seconds = time.perf_counter() - source.started_at
    n_bytes = source.stats.bytes
    source.close()
    return seconds, rows, n_bytes


def bench_ingest(records: int, packed: int, bootstrap: str | None, repeat: int = 2,
                 show_progress: bool = True) -> dict:
    from stream_ctr.connectors.kafka.options import parse_kafka_url
    from stream_ctr.connectors.kafka.sink import create_topic
    from stream_ctr.connectors.kafka.local_broker import LocalBroker
    from stream_ctr.connectors.kafka.replay import replay_file
    from stream_ctr.connectors.synth import write_synthetic_criteo
    from stream_ctr.connectors.kafka.confluent import available
    confluent = available()
    broker = None if bootstrap else LocalBroker().start()
    bootstrap = bootstrap or broker.bootstrap
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="stream_ctr_ingest_") as tmp:
            data = str(Path(tmp) / "synth.tsv")
            write_synthetic_criteo(data, records, seed=0)
            for layout, per_message in (("1 record/message", 1), (f"packed {packed}/message", packed)):
                topic = f"bench-ingest-{uuid.uuid4().hex[:8]}"
                url = f"kafka://{bootstrap}/{topic}"
                create_topic(parse_kafka_url(url), topic, 1)
                replay_file(f"criteo:{data}", url, packed=per_message)
                n_messages = -(-records // per_message)
                pairs = [("kafka-python loop (a)", lambda: _raw_loop(bootstrap, topic, n_messages),
                          "KafkaSource + decode (b)", lambda: _source_loop(bootstrap, topic, records))]
                if confluent:
                    pairs.append(("confluent-kafka loop (a')",
                                  lambda: _confluent_raw_loop(bootstrap, topic, n_messages),
                                  "KafkaSource client=confluent (b')",
                                  lambda: _source_loop(bootstrap, topic, records, "confluent")))
                for raw_name, raw_loop, ours_name, ours_loop in pairs:
                    # interleaved, so that both see the same moments of a shared machine
                    runs = [(raw_loop(), ours_loop()) for _ in range(repeat)]
                    raw = min((r for r, _ in runs), key=lambda r: r[0])
                    ours = min((o for _, o in runs), key=lambda r: r[0])
                    for client, (seconds, _, n_bytes) in ((raw_name, raw), (ours_name, ours)):
                        rows.append({"layout": layout, "client": client, "records": records,
                                     "records_per_s": records / seconds,
                                     "mb_per_s": n_bytes / 1e6 / seconds})
                    rows[-1]["ratio_b_a"] = raw[0] / ours[0]
                    if raw_name.startswith("kafka-python"):
                        kafka_python_raw_s = raw[0]
                    else:   # (b') against the kafka-python loop (a), the issue's reference
                        rows[-1]["ratio_vs_a"] = kafka_python_raw_s / ours[0]
                    if show_progress:
                        print(f"bench ingest: {layout}: {ours_name} / {raw_name} = "
                              f"{rows[-1]['ratio_b_a']:.2f}", file=sys.stderr, flush=True)
    finally:
        if broker is not None:
            broker.stop()
    from kafka.record import util
    return {"machine": _machine(), "broker": "local tansu (memory)" if broker else bootstrap,
            "crc32c": getattr(util, "crc32c_c", None) is not None, "rows": rows}


def format_ingest_table(result: dict) -> str:
    cols = [("layout", "layout", "{}"), ("client", "client", "{}"), ("records", "records", "{:,}"),
            ("records_per_s", "records/s", "{:,.0f}"), ("mb_per_s", "MB/s", "{:,.1f}"),
            ("ratio_b_a", "ours/raw", "{:.2f}"), ("ratio_vs_a", "ours/(a)", "{:.2f}")]
    table = [[title for _, title, _ in cols]]
    table += [[fmt.format(r[key]) if key in r else "" for key, _, fmt in cols] for r in result["rows"]]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    lines = [" | ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in table]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    head = f"Kafka ingest on {result['machine']}; broker {result['broker']}; crc32c {result['crc32c']}"
    return head + "\n" + "\n".join(lines)
