"""Producing to Kafka: a producer factory, topic creation, and the dead-letter topic.

A dead-letter message is one rejected record::

    key     b"topic/partition"                     (its source partition)
    value   {"topic": "clicks", "partition": 2, "offset": 41,
             "reason": "bad_integer", "raw": "0\\t1\\tx\\t..."}
    headers reason, source_partition, source_offset

As in the dead-letter file (connectors/dead_letter.py), schema decoders add a
"detail" (the field and value), a record that is not valid UTF-8 also gets
"raw_b64", its exact bytes in base64 (`raw` shows them as U+FFFD), and a record
longer than `data.dead_letter_max_bytes` keeps only its first bytes, with
``"raw_truncated": true``, ``"raw_bytes"`` and ``"raw_sha256"`` of the whole:
one oversized bad line must not make a message the broker refuses (JSON
escaping can grow a line sixfold), which would stop the stream at that record
on every restart.  The whole record stays at its partition/offset in the
source topic.

`offset` is the Kafka offset of the message the record was in (the lines of
a packed message share it).  `write()` returns only once the broker has
acknowledged every record (retrying through outages), so a record is never
checkpointed past without being on the dead-letter topic.  Across restarts a
record is dead-lettered once (`ExactlyOnceDeadLetter`): a checkpoint records
the topic's end offsets (`position`), and a resumed run reads back what was
produced after them (`entries_since`) and does not produce it again.  A stop
asked for while it retries (SIGTERM with the broker down) ends the wait with
`DeadLetterUnsent`: the batch those records came with is not trained, so the
checkpoint stays before them and a resumed run reads them again (and finds
those that landed after all).  An error the broker will not get over by
retrying (a message too large for it, no permission to write the topic) is a
`SourceError` naming the topic, not an endless retry.  A record the broker
acknowledges as a duplicate (it has seen the producer's sequence number) is
looked for on the topic and sent again if it is not there: a broker killed
between storing the sequence number and the record would otherwise lose it.
"""
from __future__ import annotations

import json
import logging
import time
from collections import Counter

from stream_ctr.connectors.batch import Rejected
from stream_ctr.connectors.dead_letter import DETAIL_LIMIT_CHARS, RAW_LIMIT_BYTES, Entry, record_fields
from stream_ctr.connectors.files import SourceError
from stream_ctr.connectors.kafka.options import KafkaUrl, client_config, split_partition_name

log = logging.getLogger("stream_ctr.connectors.kafka")
# RAW_LIMIT_BYTES and DETAIL_LIMIT_CHARS (imported above) are the caps of every sink.
READ_BACK_TIMEOUT_S = 60.0        # reading the topic back on resume: longest wait without a record
READ_BACK_QUIET_POLLS = 2         # ... done after this many empty polls (of 1 s) at its reported end
# The broker no longer knows this (idempotent) producer's sequence numbers -- a broker
# restart that kept the log but not the producer state (tansu does that): a new
# producer (a new producer id) sends the records again.
_PRODUCER_STATE_ERRORS = ("OutOfOrderSequenceNumberError", "UnknownProducerIdError",
                          "InvalidProducerEpochError", "DuplicateNotFound")
FLUSH_SLICE_S = 1.0               # how often a waiting write looks for a stop


class DeadLetterUnsent(RuntimeError):
    """A stop came while rejected records were still unacknowledged by the broker."""


class DuplicateNotFound(RuntimeError):
    """The broker acknowledged a record as a duplicate of one it held already (an idempotent
    producer's sequence number it had seen), and reading the topic back did not find it:
    the broker recorded the sequence number but not the record (tansu on s3:// storage
    does that when it is killed between the two writes).  Sent again by a new producer."""
    retriable = True


def make_producer(url: KafkaUrl, **settings):
    """A KafkaProducer for `url`'s brokers; `settings` are kafka-python producer options."""
    from kafka import KafkaProducer
    from kafka.errors import KafkaError
    from stream_ctr.connectors.kafka.client import unreachable_message
    defaults = {"acks": "all", "linger_ms": 20, "batch_size": 1 << 20,
                "max_request_size": 16 << 20}
    try:
        return KafkaProducer(**client_config(url), **{**defaults, **settings})
    except KafkaError as e:
        raise SourceError(unreachable_message(url, e)) from None


def topic_partitions(url: KafkaUrl, topic: str) -> int:
    """Number of partitions of `topic`; 0 if it does not exist."""
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError
    from stream_ctr.connectors.kafka.client import unreachable_message
    try:
        admin = KafkaAdminClient(**client_config(url))
    except KafkaError as e:
        raise SourceError(unreachable_message(url, e)) from None
    try:
        described = admin.describe_topics([topic])
    finally:
        admin.close()
    for entry in described:
        if entry.get("name") == topic and not entry.get("error_code"):
            return len(entry.get("partitions") or [])
    return 0


def require_topics(url: KafkaUrl) -> None:
    """SourceError unless every topic of `url` exists (checked before anything is created)."""
    missing = [t for t in url.topics if not topic_partitions(url, t)]
    if missing:
        raise SourceError(f"topic {', '.join(map(repr, missing))} does not exist on "
                          f"{','.join(url.bootstrap)} (create it, e.g. with "
                          f"`stream-ctr replay FILE --to {url.text} --partitions N`)")


def create_topic(url: KafkaUrl, topic: str, partitions: int) -> bool:
    """Create `topic` with `partitions` partitions (the broker's default replication).

    Returns False if it already existed.  SourceError if it cannot be created.
    """
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import KafkaError, TopicAlreadyExistsError
    from stream_ctr.connectors.kafka.client import unreachable_message
    try:
        admin = KafkaAdminClient(**client_config(url))
    except KafkaError as e:
        raise SourceError(unreachable_message(url, e)) from None
    try:
        admin.create_topics([NewTopic(topic, partitions, -1)])
        return True
    except TopicAlreadyExistsError:
        return False
    except KafkaError as e:
        raise SourceError(f"cannot create topic {topic!r} on {','.join(url.bootstrap)}: {e}") from None
    finally:
        admin.close()


class KafkaDeadLetter:
    """Rejected records produced to a dead-letter topic; same interface as DeadLetterFile."""

    def __init__(self, url: KafkaUrl, topic: str, max_raw_bytes: int | None = None) -> None:
        self.topic = topic
        self.path = f"kafka://{','.join(url.bootstrap)}/{topic}"
        self.name = self.path
        self.max_raw_bytes = RAW_LIMIT_BYTES if max_raw_bytes is None else max_raw_bytes
        self._retry_max_s = url.options.reconnect_backoff_max_s
        if not topic_partitions(url, topic) and create_topic(url, topic, 1):
            log.info("kafka: created dead-letter topic %s", topic)
        self._url = url
        self._producer = make_producer(url, acks="all", linger_ms=0)
        self.counts: Counter[str] = Counter()
        self._unsent = 0                # records a stop left unacknowledged (see write)
        self._ends: dict[int, int] | None = None   # the topic's end offsets, read once (position)
        self._acked: dict[int, int] = {}           # partition -> after the last record acknowledged

    def write(self, rejected: list[Rejected], stop=None) -> None:
        """Produce the records; blocks until the broker acknowledged all of them.

        `stop` (anything with a ``requested`` flag, e.g. the run's StopSignal) is
        looked at about once a second while the broker does not answer: once it is
        set, `DeadLetterUnsent` is raised instead of waiting on (the caller must not
        train or checkpoint past these records)."""
        if not rejected:
            return
        if self._producer is None:
            raise ValueError(f"dead-letter topic {self.topic} is closed")
        from kafka.errors import KafkaError
        pending = list(rejected)
        delay = 0.5
        while pending:
            sends, failed, duplicates, landed = [], [], [], []
            before = self._known_ends()
            for r in pending:
                try:
                    sends.append((r, self._send(r)))
                except KafkaError as e:         # refused before sending (e.g. too large)
                    failed.append((r, e))
            self._flush(len(pending), stop)
            failed += [(r, future.exception) for r, future in sends if future.failed()]
            for r, future in sends:
                if future.succeeded():
                    meta = future.value
                    # offset -1: "a duplicate", held already, the broker says
                    (duplicates if meta.offset < 0 else landed).append(r)
                    self._acked[meta.partition] = max(self._acked.get(meta.partition, 0), meta.offset + 1)
            failed += [(r, DuplicateNotFound()) for r in self._not_on_topic(duplicates, landed, before)]
            stale = [type(e).__name__ for _, e in failed if type(e).__name__ in _PRODUCER_STATE_ERRORS]
            if stale:
                log.warning("kafka: dead-letter topic %s: the broker lost this producer's state (%s; "
                            "a restart?); sending %d records again with a new producer",
                            self.topic, stale[0], len(failed))
                self._producer.close(timeout=1)
                self._producer = make_producer(self._url, acks="all", linger_ms=0)
                failed = [(r, None) for r, _ in failed]
            final = [(r, e) for r, e in failed if e is not None and not getattr(e, "retriable", True)]
            if final:
                r, e = final[0]
                raise SourceError(
                    f"dead-letter topic {self.topic}: the broker refuses the record from "
                    f"{r.partition} offset {r.offset} ({type(e).__name__}: {e}); fix the topic's "
                    f"permissions or size limits, lower data.dead_letter_max_bytes (now "
                    f"{self.max_raw_bytes:,}), or set kafka.dead_letter_topic = \"\" to write "
                    f"rejected records to the run's dead-letter file")
            pending = [r for r, _ in failed]
            if pending:
                log.warning("kafka: %d dead-letter records not acknowledged (%s); retrying in %.1f s",
                            len(pending), failed[0][1], delay)
                self._stop_if_asked(len(pending), stop)
                time.sleep(delay)
                delay = min(delay * 2, self._retry_max_s)
        self.counts.update(r.reason for r in rejected)

    def _flush(self, records: int, stop) -> None:
        """Wait for every send to end (acknowledged or failed), or for a stop."""
        from kafka.errors import KafkaTimeoutError
        while True:
            try:
                self._producer.flush(timeout=FLUSH_SLICE_S if stop is not None else None)
                return
            except KafkaTimeoutError:
                self._stop_if_asked(records, stop)

    def _stop_if_asked(self, records: int, stop) -> None:
        if stop is not None and stop.requested:
            self._unsent = records
            raise DeadLetterUnsent(
                f"dead-letter topic {self.topic}: stopping with {records} rejected records not "
                f"acknowledged by the broker; the batch they came with was not trained, so a "
                f"resumed run reads and dead-letters them again")

    def _send(self, r: Rejected):
        topic, partition = split_partition_name(r.partition)
        value = {"topic": topic, "partition": partition, "offset": r.offset,
                 **record_fields(r, self.max_raw_bytes)}
        return self._producer.send(
            self.topic, key=r.partition.encode(), value=json.dumps(value, ensure_ascii=False).encode(),
            headers=[("reason", r.reason.encode()), ("source_partition", r.partition.encode()),
                     ("source_offset", str(r.offset).encode())])

    def position(self) -> dict[str, int]:
        """Where the topic ends, per partition: past every record this sink had acknowledged
        (no broker request after the first: a checkpoint during an outage needs none).  A
        partition this process did not write to ends where the read-back (or the broker's
        reported end offsets, which may lag its log) left it: never past its true end, so
        a resume reads back at worst some records more."""
        if self._ends is None:
            self._ends = self._end_offsets()
        ends = dict(self._ends)
        for p, after in self._acked.items():
            ends[p] = max(ends.get(p, 0), after)
        return {str(p): n for p, n in sorted(ends.items())}

    def _consumer(self):
        from kafka import KafkaConsumer
        from kafka.errors import KafkaError
        from stream_ctr.connectors.kafka.client import unreachable_message
        try:
            return KafkaConsumer(**client_config(self._url), group_id=None, enable_auto_commit=False,
                                 auto_offset_reset="earliest", allow_auto_create_topics=False)
        except KafkaError as e:
            raise SourceError(unreachable_message(self._url, e)) from None

    def _end_offsets(self) -> dict[int, int]:
        from kafka import TopicPartition
        from kafka.errors import KafkaError
        n = topic_partitions(self._url, self.topic)
        consumer = self._consumer()
        try:
            ends = consumer.end_offsets([TopicPartition(self.topic, p) for p in range(n)])
        except KafkaError as e:
            raise SourceError(f"dead-letter topic {self.topic}: cannot read its end offsets "
                              f"({type(e).__name__}: {e})") from None
        finally:
            consumer.close(autocommit=False)
        return {tp.partition: int(offset) for tp, offset in ends.items()}

    def entries_since(self, position: dict[str, int]) -> list[Entry]:
        """The records the topic holds past `position` (a `position()` of an earlier run),
        read back from their headers; SourceError if the broker does not hand them over."""
        out, ends = self._read_back({int(p): n for p, n in position.items()})
        self._ends = ends
        return out

    def _known_ends(self) -> dict[int, int]:
        """Per partition, an offset at or before the topic's end now, with no broker
        request: where this producer's acknowledgements or the last read-back left it."""
        return {**(self._ends or {}), **self._acked}

    def _not_on_topic(self, duplicates: list[Rejected], landed: list[Rejected],
                      since: dict[int, int]) -> list[Rejected]:
        """Of `duplicates` (acknowledged by the broker as held already), those the topic
        does not hold at or past `since` besides the `landed` ones (acknowledged at an
        offset in the same write: the lines of a packed message share one identity).
        A real Kafka answers "duplicate" only for a record it holds (a retried send whose
        first answer was lost); a broker that stored the sequence number and then died
        before the record must not lose a dead letter."""
        if not duplicates:
            return []
        held, _ends = self._read_back(since)
        found = Counter(e[:2] for e in held)
        found.subtract((r.partition, r.offset) for r in landed)
        missing = []
        for r in duplicates:
            key = (r.partition, r.offset)
            if found[key] > 0:
                found[key] -= 1
            else:
                missing.append(r)
        if missing:
            log.warning("kafka: dead-letter topic %s: the broker acknowledged %d records as duplicates "
                        "but does not hold them (it lost them in a restart?); sending them again",
                        self.topic, len(missing))
        return missing

    def _read_back(self, since: dict[int, int]) -> tuple[list[Entry], dict[int, int]]:
        """The records the topic holds from `since` (partition -> offset; the log's start
        for a partition not in it) to its end, and where each partition ended.

        Read until the broker has nothing more, not to its reported end offsets: a broker
        may report them behind its log (tansu on s3:// storage did, by 8 of 15 records)."""
        from kafka import TopicPartition
        from kafka.errors import KafkaError
        n = topic_partitions(self._url, self.topic)
        consumer = self._consumer()
        out: list[Entry] = []
        try:
            tps = [TopicPartition(self.topic, p) for p in range(n)]
            reported, firsts = consumer.end_offsets(tps), consumer.beginning_offsets(tps)
            consumer.assign(tps)
            for tp in tps:
                consumer.seek(tp, max(since.get(tp.partition, 0), firsts[tp]))
            quiet, waited_since = 0, time.monotonic()
            while quiet < READ_BACK_QUIET_POLLS:
                polled = consumer.poll(timeout_ms=1000)
                got = sum(map(len, polled.values()))
                for records in polled.values():
                    out += [e for e in map(_identity, records) if e is not None]
                behind = any(consumer.position(tp) < reported[tp] for tp in tps)
                if got:
                    quiet, waited_since = 0, time.monotonic()
                elif not behind:
                    quiet += 1
                elif time.monotonic() - waited_since > READ_BACK_TIMEOUT_S:
                    raise SourceError(
                        f"dead-letter topic {self.topic}: the broker did not hand over its records "
                        f"in {READ_BACK_TIMEOUT_S:.0f} s (needed so that none is dead-lettered twice "
                        f"or lost); check the broker and resume again")
            ends = {tp.partition: max(consumer.position(tp), int(reported[tp])) for tp in tps}
        except KafkaError as e:
            raise SourceError(f"dead-letter topic {self.topic}: cannot read back its records "
                              f"({type(e).__name__}: {e}); check the broker and resume again") from None
        finally:
            consumer.close(autocommit=False)
        return out, ends

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def close(self) -> None:
        """Close the producer. Every record `write` returned for is acknowledged
        already; records a stop left unsent get one more second (their batch was
        not trained, so a resumed run dead-letters them again)."""
        from kafka.errors import KafkaError
        producer, self._producer = self._producer, None
        if producer is None:
            return
        try:
            producer.close(timeout=1 if self._unsent else 30)
        except KafkaError as e:
            log.warning("kafka: dead-letter topic %s: closing the producer: %s: %s",
                        self.topic, type(e).__name__, e)

    def __enter__(self) -> "KafkaDeadLetter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _identity(record) -> Entry | None:
    """(source partition, offset, epoch 0) of a dead-letter message, from its headers or its
    value; None for a message that is not one of ours."""
    headers = dict(record.headers or [])
    try:
        return headers["source_partition"].decode(), int(headers["source_offset"]), 0
    except (KeyError, ValueError, UnicodeDecodeError, AttributeError):
        pass
    try:
        value = json.loads(record.value)
        return f"{value['topic']}/{value['partition']}", int(value["offset"]), 0
    except (KeyError, ValueError, TypeError):
        return None
