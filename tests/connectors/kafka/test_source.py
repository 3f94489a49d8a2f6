"""KafkaSource against a real broker: offsets, resume, commit, backpressure, errors, dead letters."""
import gzip
import threading
import time

import numpy as np
import pytest

from stream_ctr.connectors.batch import Batch, Rejected
from stream_ctr.connectors.files import SAMPLE_PATHS, SourceError
from stream_ctr.connectors.kafka.source import KafkaSource
from stream_ctr.connectors.kafka.options import parse_kafka_url
from stream_ctr.connectors.kafka.positions import GIVEN_UP, ROWS_DONE, KafkaPositions
from stream_ctr.connectors.kafka.sink import KafkaDeadLetter
from tests.kafka_broker import KafkaHelper, kafka_test_options

LINES = gzip.open(SAMPLE_PATHS["criteo"], "rb").read().split(b"\n")[:3000]
# Every test runs with both consumer clients (the kafka_client fixture sets kafka.client).
pytestmark = pytest.mark.usefixtures("kafka_client")


def open_source(kafka, topic, group, positions=None, hold_revocations=False, **options):
    """A source resuming at `positions`, a checkpoint's dict (read back as a resume does)."""
    if positions is not None:
        positions = KafkaPositions.from_checkpoint(positions)
    options.setdefault("stop_when_idle_s", 1.5)
    chunk = options.pop("chunk", 700)
    url = parse_kafka_url(kafka.url(topic, group), kafka_test_options(**options))
    return KafkaSource(url, positions=positions, hold_revocations=hold_revocations, chunk_records=chunk)


def drain(source, max_records=None, train=True):
    """Read until idle; report every batch trained. Returns the concatenated rows."""
    got = []
    while not source.exhausted:
        batch, _ = source.read(max_records)
        if len(batch):
            got.append(batch)
            if train:
                source.trained(batch)
    return Batch.concat(got) if got else None


def test_an_idle_end_waits_for_records_the_broker_said_it_has(kafka, monkeypatch, caplog):
    """A quiet spell while an owned partition's watermark (from the fetch answers) is past
    the last record read is a slow fetch, not the stream's end. A watermark that stays
    ahead with no record to come (transaction markers, a compacted tail) ends the stream
    after a grace all the same, with a warning naming the partition."""
    import stream_ctr.connectors.kafka.source as source_module
    topic = kafka.topic()
    kafka.produce(topic, LINES[:100])
    with open_source(kafka, topic, "g-behind") as source:
        assert len(drain(source)) == 100
        name = f"{topic}/0"
        assert source._highwater[name] == 100       # every offset the broker has was read
        source._highwater[name] = 105                # as a log ending in 5 offsets without records
        monkeypatch.setattr(source_module, "BEHIND_GRACE_S", 1e9)
        assert not source.exhausted
        monkeypatch.setattr(source_module, "BEHIND_GRACE_S", 0.0)
        with caplog.at_level("WARNING", logger="stream_ctr.connectors.kafka"):
            assert source.exhausted
    assert f"{name}: read to 100, watermark 105" in caplog.text


def test_reads_every_record_once_with_kafka_offsets_and_commits(kafka, kafka_client):
    topic = kafka.topic(partitions=3)
    kafka.produce(topic, LINES[:900], partitions=[i % 3 for i in range(900)])
    with open_source(kafka, topic, "g-read") as source:
        assert type(source._consumer).__name__ == {"kafka-python": "KafkaConsumer",
                                                   "confluent": "ConfluentConsumer"}[kafka_client]
        rows = drain(source)
        trained = source.trained_positions
        assert source.commit(trained)
        positions = trained.to_checkpoint()
        lag = source.lag()
    assert len(rows) == 900
    names = np.array(rows.partitions)[rows.partition]
    for p in range(3):
        offsets = rows.offset[names == f"{topic}/{p}"]
        assert sorted(offsets.tolist()) == list(range(300))               # each exactly once
    assert positions == {f"{topic}/{p}": 300 for p in range(3)}
    assert kafka.committed("g-read", topic, 3) == positions
    assert lag == {f"{topic}/{p}": 0 for p in range(3)}


def test_resume_from_checkpoint_positions_inside_a_packed_message(kafka):
    topic = kafka.topic()
    # 10 packed messages of 50 lines; a checkpoint taken after 120 rows sits inside message 2.
    kafka.produce(topic, [b"\n".join(LINES[i:i + 50]) for i in range(0, 500, 50)])
    with open_source(kafka, topic, "g-pack-a") as source:
        first, _ = source.read(120)
        while len(first) < 120:
            more, _ = source.read(120 - len(first))
            first = Batch.concat([first, more]) if len(more) else first
        checkpoint = source.trained(first).to_checkpoint()
    assert checkpoint == {f"{topic}/0": 2, f"{topic}/0" + ROWS_DONE: 20}
    # The group has no commit: the checkpoint alone decides where to go on.
    with open_source(kafka, topic, "g-pack-b", positions=checkpoint) as source:
        rest = drain(source)
        final = source.trained_positions.to_checkpoint()
    assert len(rest) == 380 and final == {f"{topic}/0": 10}
    assert rest.offset[0] == 2 and np.count_nonzero(rest.offset == 2) == 30


def test_lag_counts_the_records_on_the_broker_not_only_the_buffer(kafka):
    """Small fetches and a small buffer: the backlog is what the broker holds beyond the
    trained offset (it used to be only the records fetched, capped by the buffer)."""
    topic = kafka.topic()
    kafka.produce(topic, LINES[:2000])
    with open_source(kafka, topic, "g-lag", max_partition_fetch_bytes=4096,
                     max_buffered_records=50, chunk=20) as source:
        batch, _ = source.read(20)
        while not len(batch):
            batch, _ = source.read(20)
        source.trained(batch)
        lag = source.lag()[f"{topic}/0"]
        fetched = source._book.fetch_next[f"{topic}/0"]
    assert fetched < 1000 and lag == 2000 - len(batch)


@pytest.mark.parametrize("fetch_bytes", [65536, 1 << 20])
def test_a_message_larger_than_the_fetch_sizes_is_read_whole(kafka, fetch_bytes):
    """The broker returns a message larger than the fetch sizes whole; librdkafka used to
    drop any response over max(fetch sizes) + 1 MiB and fetch it again forever (nothing
    read, the stream then taken for idle), and refused fetch sizes below 1,000,000."""
    topic = kafka.topic()
    big = LINES[50].rstrip(b"\n") + b"a" * 2_500_000       # a long last field: still one record
    kafka.produce(topic, [*LINES[:50], big, *LINES[51:100]])
    with open_source(kafka, topic, "g-big", fetch_max_bytes=fetch_bytes,
                     max_partition_fetch_bytes=fetch_bytes) as source:
        rows = drain(source)
        positions = source.trained_positions.to_checkpoint()
    assert rows is not None and rows.offset.tolist() == list(range(100))
    assert positions == {f"{topic}/0": 100}


def test_backpressure_pauses_and_resumes_without_losing_records(kafka):
    topic = kafka.topic()
    kafka.produce(topic, [b"\n".join(LINES[i:i + 100]) for i in range(0, 3000, 100)])
    with open_source(kafka, topic, "g-bp", max_buffered_records=300) as source:
        paused_seen = False
        got = []
        while not source.exhausted:
            batch, _ = source.read(50)                 # a slow consumer of a fast fetcher
            paused_seen |= source.stats.paused
            if len(batch):
                got.append(batch)
        assert source.snapshot().to_checkpoint() == {f"{topic}/0": 30}
    rows = Batch.concat(got)
    assert paused_seen and len(rows) == 3000
    assert np.array_equal(np.repeat(np.arange(30), 100), rows.offset)


def test_bad_records_are_returned_as_rejected_with_their_offsets(kafka):
    topic = kafka.topic()
    values = list(LINES[:20])
    values[3], values[7] = b"1\t2\t3", b"x" + values[7][1:]
    kafka.produce(topic, values + [b""])
    kafka.produce(topic, [b"1\t2", b"\n".join([b"a", b"b"])])    # a bad line; a packed message of bad lines
    rejected = []
    with open_source(kafka, topic, "g-bad") as source:
        while not source.exhausted:
            batch, bad = source.read()
            rejected += bad
            source.rejects_written()            # (as the trainer reports them once in its sink)
            if len(batch):
                source.trained(batch)
        positions, lag = source.trained_positions.to_checkpoint(), source.lag()
    assert sorted((r.partition, r.offset, r.reason) for r in rejected) == [
        (f"{topic}/0", 3, "field_count"), (f"{topic}/0", 7, "bad_label"), (f"{topic}/0", 20, "empty_message"),
        (f"{topic}/0", 21, "field_count"), (f"{topic}/0", 22, "field_count"), (f"{topic}/0", 22, "field_count")]
    # The topic ends in messages without a good row: the position still moves past them
    # (else lag stays at 3 and they are dead-lettered again at every restart).
    assert positions == {f"{topic}/0": 23} and lag == {f"{topic}/0": 0}


def test_dead_letter_topic_holds_reason_partition_offset(kafka):
    topic = kafka.topic(prefix="dlq")
    url = parse_kafka_url(kafka.url(topic), kafka_test_options())
    with KafkaDeadLetter(url, topic) as sink:
        sink.write([Rejected("clicks/2", 41, "bad_integer", b"0\t1\tx"),
                    Rejected("clicks/0", 7, "field_count", b"1\t2")])
        assert sink.counts == {"bad_integer": 1, "field_count": 1}
    letters = kafka.dead_letters(topic)
    assert {(d["topic"], d["partition"], d["offset"], d["reason"], d["raw"]) for d in letters} == {
        ("clicks", 2, 41, "bad_integer", "0\t1\tx"), ("clicks", 0, 7, "field_count", "1\t2")}
    assert not any("raw_b64" in d or "detail" in d for d in letters)


def test_dead_letter_topic_keeps_the_detail_and_the_exact_bytes_of_a_non_utf8_record(kafka):
    """As the dead-letter file does: `raw` is text (U+FFFD for bad bytes), `raw_b64` the bytes."""
    import base64
    topic = kafka.topic(prefix="dlq-bytes")
    raw = b'{"site": "caf\xe9", "price": "cheap"}'
    url = parse_kafka_url(kafka.url(topic), kafka_test_options())
    with KafkaDeadLetter(url, topic) as sink:
        sink.write([Rejected("clicks/1", 5, "bad_value:price", raw, "price = 'cheap': expected a number")])
    (letter,) = kafka.dead_letters(topic)
    assert letter["detail"] == "price = 'cheap': expected a number"
    assert letter["raw"] == '{"site": "caf\ufffd", "price": "cheap"}'
    assert base64.b64decode(letter["raw_b64"]) == raw


def test_an_oversized_bad_record_is_dead_lettered_in_part_and_a_refusal_is_one_clear_error(
        kafka, monkeypatch):
    """A 3 MB bad line of control bytes is ~18 MB of JSON: more than a producer request
    may carry, so without the cap every restart would stop at it."""
    import hashlib
    from stream_ctr.connectors.kafka import sink as kafka_sink
    topic = kafka.topic(prefix="dlq-big")
    raw = b"\x01" * 3_000_000
    url = parse_kafka_url(kafka.url(topic), kafka_test_options())
    with KafkaDeadLetter(url, topic) as sink:
        sink.write([Rejected("clicks/0", 9, "field_count", raw, "x" * 3_000_000)])
    (letter,) = kafka.dead_letters(topic)
    assert letter["raw"] == "\x01" * kafka_sink.RAW_LIMIT_BYTES and "raw_b64" not in letter
    assert letter["detail"] == "x" * kafka_sink.DETAIL_LIMIT_CHARS
    assert letter["raw_bytes"] == len(raw) and letter["raw_sha256"] == hashlib.sha256(raw).hexdigest()
    # An error retrying cannot fix is one clear error, not a retry loop.
    monkeypatch.setattr(kafka_sink, "RAW_LIMIT_BYTES", 1 << 30)
    with KafkaDeadLetter(url, topic) as sink:
        with pytest.raises(SourceError, match="dead-letter topic .* refuses the record from clicks/0 offset 9"):
            sink.write([Rejected("clicks/0", 9, "field_count", raw)])


def test_missing_topic_and_unreachable_broker_are_one_clear_error(kafka):
    with pytest.raises(SourceError, match="does not exist"):
        open_source(kafka, "no-such-topic-xyz", "g")
    t0 = time.monotonic()
    with pytest.raises(SourceError, match="cannot reach a Kafka broker at 127.0.0.1:9"):
        KafkaSource(parse_kafka_url("kafka://127.0.0.1:9/t", kafka_test_options(connect_timeout_s=1)))
    assert time.monotonic() - t0 < 30


def test_start_position_when_neither_checkpoint_nor_group_has_one(kafka):
    topic = kafka.topic()
    kafka.produce(topic, LINES[:10])
    # start=earliest is the default; the group then commits, and a new member of the
    # same group continues from the commit, not from the start.
    with open_source(kafka, topic, "g-start") as source:
        first = source.read(4)[0]
        while not len(first):
            first = source.read(4)[0]
        source.commit(source.trained(first))
    with open_source(kafka, topic, "g-start") as source:
        rest = drain(source)
    assert first.offset.tolist() == [0, 1, 2, 3] and rest.offset.tolist() == list(range(4, 10))


def test_a_revocation_checkpoint_keeps_the_revoked_positions_and_a_resume_uses_them(kafka):
    """The trainer checkpoints when a revocation reaches it; its positions must hold the revoked
    partitions (marked given up), or a crash before the next checkpoint resumes them
    from the group's offset -- which on tansu has lost the rows_done of a packed
    message split by a batch (the broker drops commit metadata), or which is older
    when the commit on revocation failed."""
    from kafka import KafkaConsumer
    topic = kafka.topic(partitions=2)
    values = [b"\n".join(LINES[i:i + 50]) for i in range(0, 400, 50)]    # 8 messages of 50 lines
    kafka.produce(topic, values, partitions=[i % 2 for i in range(8)])
    at_revocation = []
    source = open_source(kafka, topic, "g-given-up", stop_when_idle_s=0, chunk=30, hold_revocations=True)
    trained = []
    while sum(map(len, trained)) < 120:           # 4 batches of 30 split packed messages
        batch, _ = source.read(30)
        if len(batch):
            source.trained(batch)
            trained.append(batch)
    leave = threading.Event()

    def second_member():
        consumer = KafkaConsumer(topic, bootstrap_servers=kafka.bootstrap,
                                 group_id=kafka.group("g-given-up", topic), enable_auto_commit=False,
                                 session_timeout_ms=6000, heartbeat_interval_ms=1000)
        while not leave.is_set():
            consumer.poll(200, max_records=1)
        consumer.close(autocommit=False)

    member = threading.Thread(target=second_member, daemon=True)
    member.start()
    deadline = time.monotonic() + 60
    while not at_revocation and time.monotonic() < deadline:
        source.read(30)                           # rows read now are not trained: a "crash"
        if source.revocation is not None:         # the group waits while the trainer checkpoints
            at_revocation.append(source.trained_positions.to_checkpoint())
            source.acknowledge(durable=True)
    leave.set()
    member.join(timeout=30)
    source.close()
    assert at_revocation, "no rebalance within 60 s"
    checkpoint = at_revocation[0]
    names = [f"{topic}/0", f"{topic}/1"]
    split = [n for n in names if checkpoint.get(n + ROWS_DONE)]
    assert split and all(checkpoint.get(n + GIVEN_UP) == 1 for n in names), checkpoint
    # Resume from that checkpoint (in a new group: nothing but the checkpoint says where
    # to go on): every record once, counting the 120 trained before the revocation.
    with open_source(kafka, topic, "g-given-up-resumed", positions=checkpoint) as resumed:
        rest = drain(resumed)
    everything = sorted(pairs for b in trained + [rest]
                        for pairs in zip(np.array(b.partitions)[b.partition].tolist(), b.offset.tolist()))
    assert len(everything) == 400
    per_message = {}
    for name, offset in everything:
        per_message[(name, offset)] = per_message.get((name, offset), 0) + 1
    assert set(per_message.values()) == {50} and len(per_message) == 8


def test_an_unexpected_poll_error_is_raised_and_close_still_leaves_the_group(kafka, caplog):
    """A poll failing with an error that is not Kafka's (a bug, a client's internal state)
    reaches the caller from read(); close() after it still stops the poll thread, closes
    the consumer (leaving the group) and raises nothing, so a run's own error is the one
    its user sees."""
    topic = kafka.topic()
    kafka.produce(topic, LINES[:200])
    source = open_source(kafka, topic, "g-poll-error")
    rows = drain(source)
    assert len(rows) == 200
    consumer, closed = source._consumer, []
    close_consumer = consumer.close

    def close_and_note(**kw):
        closed.append(kw)
        close_consumer(**kw)
    consumer.close = close_and_note

    def broken(**_kw):
        raise RuntimeError("the client's state is broken")
    source._poller._poll = broken
    with pytest.raises(RuntimeError, match="state is broken"):
        for _ in range(3):
            source.read(10)
    source._in_flight = source._poller.submit(0, 1)     # and one in flight when close() comes
    source.close()
    assert source._consumer is None
    assert "the last poll failed while closing: RuntimeError" in caplog.text
    # The consumer left the group, waiting for the broker's answer as long as it takes (a
    # member that has joined; one still joining waits only LEAVE_WHILE_JOINING_S).
    assert closed == [{"autocommit": False, "timeout_ms": None}]


def test_an_outage_with_no_partition_to_probe_is_said_when_every_broker_is_down(fresh_broker, kafka_client,
                                                                                caplog):
    """A group that lost its partitions in an outage (a restarted broker that forgot the
    group) has no partition to probe: the client's connections say the outage instead
    (confluent-kafka: librdkafka's all-brokers-down event; kafka-python: no live
    connection), on two probes in a row, and its end when the broker is back."""
    import contextlib
    import logging
    from kafka import ConsumerRebalanceListener
    from kafka.errors import KafkaError
    from stream_ctr.connectors.kafka.client import BrokerWatch, connect_consumer, every_connection_down
    from stream_ctr.connectors.kafka.source import KafkaStats

    class NoRebalanceWork(ConsumerRebalanceListener):      # (both clients await these)
        async def on_partitions_revoked(self, revoked): pass               # noqa: E704

        async def on_partitions_assigned(self, assigned): pass             # noqa: E704

    def poll_until(down: bool) -> None:
        deadline = time.monotonic() + 30
        while every_connection_down(consumer) is not down and time.monotonic() < deadline:
            with contextlib.suppress(KafkaError):
                consumer.poll(timeout_ms=200)          # serves the client's callbacks
        assert every_connection_down(consumer) is down

    helper = KafkaHelper(fresh_broker.bootstrap)
    topic = helper.topic()
    url = parse_kafka_url(helper.url(topic, "g"), kafka_test_options())
    consumer = connect_consumer(url)
    try:
        consumer.subscribe([topic], listener=NoRebalanceWork())
        poll_until(down=False)
        stats = KafkaStats()
        watch = BrokerWatch(url, stats)
        t = time.monotonic()
        with caplog.at_level(logging.WARNING):
            watch.nothing_arrived(consumer, [], t + 10)
            watch.nothing_arrived(consumer, [], t + 20)
            assert not watch.in_outage and stats.outages == 0       # connected: no outage
            fresh_broker.stop()
            poll_until(down=True)
            watch.nothing_arrived(consumer, [], t + 30)
            assert not watch.in_outage                              # one probe is not enough
            watch.nothing_arrived(consumer, [], t + 40)
            assert watch.in_outage and stats.outages == 1 and not stats.connected
            assert f"broker {fresh_broker.bootstrap} unreachable (all broker connections down)" in caplog.text
            if kafka_client == "kafka-python":
                # kafka-python's connections come back by themselves; librdkafka's event is
                # cleared by an assignment or records, when a partition probe takes over.
                fresh_broker.start()
                poll_until(down=False)
                assert watch.nothing_arrived(consumer, [], t + 50)  # connected again: it ended
                assert not watch.in_outage and stats.connected and stats.outage_s == 10
                assert "reachable again after 10.0 s" in caplog.text
    finally:
        consumer.close()
