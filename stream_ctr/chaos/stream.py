"""The known stream a chaos run trains: good records and malformed messages, and where each is.

Good records are Criteo TSV lines (the bundled sample's lines, in order, over
and over until there are enough; each is a distinct record at its own offset).
One message per record, round robin over the partitions, produced all at
once or spread over a time (`StreamProducer`).  Between them, at
`bad_rate`, a malformed message of one of `BAD_KINDS` -- none may stop the
stream, each must reach the dead-letter topic.  Offsets are counted as
produced (one producer, one request in flight, a new topic): message ``i`` of a
partition is at offset ``i``.
"""
from __future__ import annotations

import gzip
import json
import random
import threading
import time
from dataclasses import dataclass, field

from stream_ctr.connectors.files import detect_format

# Each decodes to a rejected record, never to a row (tests/stream_ctr/chaos checks it).
BAD_KINDS = ("random_bytes", "invalid_utf8", "truncated", "wrong_fields", "huge_value", "json")


@dataclass
class KnownStream:
    """What was produced where: the verifier's ground truth."""
    topic: str
    partitions: int
    good: int                                              # good records (one a message)
    messages: list[int] = field(default_factory=list)      # per partition: messages produced
    bad: dict[tuple[int, int], str] = field(default_factory=dict)   # (partition, offset) -> kind

    def bad_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for kind in self.bad.values():
            out[kind] = out.get(kind, 0) + 1
        return dict(sorted(out.items()))


def sample_lines() -> list[bytes]:
    """The bundled Criteo sample's data lines (no trailing LF)."""
    _fmt, path = detect_format("criteo:sample")
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        return [line.rstrip(b"\r\n") for line in f if line.strip()]


def malformed(kind: str, good: bytes, rng: random.Random) -> bytes:
    """A malformed message of `kind`, made from a good line where that helps."""
    fields = good.split(b"\t")
    if kind == "random_bytes":      # no LF: one message, one record
        return bytes(rng.choice([b for b in range(256) if b != 10]) for _ in range(rng.randint(1, 300)))
    if kind == "invalid_utf8":      # an undecodable label
        return b"\t".join([b"\xff\xfe"] + fields[1:])
    if kind == "truncated":         # cut inside the line: fields missing
        return b"\t".join(fields[:rng.randint(1, len(fields) - 2)])
    if kind == "wrong_fields":      # fields too many
        return good + b"\t" + b"\t".join(b"x" for _ in range(rng.randint(1, 5)))
    if kind == "huge_value":        # an integer field of ~200 KB
        return b"\t".join([fields[0], b"9" * 200_000] + fields[2:])
    if kind == "json":              # a JSON object with wrong types in a TSV topic
        return json.dumps({"label": "yes", "I1": [1, 2], "C1": {"x": None}}).encode()
    raise ValueError(f"unknown malformed kind {kind!r}")


class StreamProducer:
    """Produces the known stream, all at once or spread over `produce_s` seconds (live
    traffic: the trainers under faults wait for records as a real one does).

    It produces in chunks, each flushed (every message acknowledged) while holding
    `lock`: a fault that kills the broker takes the lock first, so no produce request
    is in flight then and no message can land twice (offsets are counted, not read)."""

    CHUNK = 200

    def __init__(self, bootstrap: str, topic: str, records: int, partitions: int, bad_rate: float,
                 seed: int) -> None:
        from stream_ctr.connectors.kafka.options import parse_kafka_url
        from stream_ctr.connectors.kafka.sink import create_topic
        if not create_topic(parse_kafka_url(f"kafka://{bootstrap}/{topic}"), topic, partitions):
            raise RuntimeError(f"topic {topic} exists already on {bootstrap}: a chaos run needs a new one")
        self.bootstrap, self.bad_rate = bootstrap, bad_rate
        self.stream = KnownStream(topic, partitions, records, [0] * partitions)
        self.lock = threading.Lock()
        self._rng = random.Random(seed)
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def run(self, produce_s: float = 0.0) -> None:
        """Produce everything; over about `produce_s` seconds when > 0."""
        from kafka import KafkaProducer
        # Not idempotent: a broker restart that keeps the log but not the producer
        # state (tansu) refuses an idempotent producer's next sequence numbers for
        # good.  Nothing is in flight at a restart (`lock`), so nothing lands twice.
        producer = KafkaProducer(bootstrap_servers=self.bootstrap, acks="all", linger_ms=20,
                                 batch_size=1 << 20, max_request_size=16 << 20,
                                 max_in_flight_requests_per_connection=1, enable_idempotence=False)
        lines, rng, stream = sample_lines(), self._rng, self.stream
        t0, sent, good = time.monotonic(), 0, 0
        try:
            while good < stream.good:
                with self.lock:
                    for _ in range(self.CHUNK):
                        if good >= stream.good:
                            break
                        partition = sent % stream.partitions
                        if self.bad_rate and rng.random() < self.bad_rate:
                            kind = BAD_KINDS[rng.randrange(len(BAD_KINDS))]
                            value = malformed(kind, lines[rng.randrange(len(lines))], rng)
                            stream.bad[(partition, stream.messages[partition])] = kind
                        else:
                            value = lines[good % len(lines)]
                            good += 1
                        producer.send(stream.topic, value=value, partition=partition)
                        stream.messages[partition] += 1
                        sent += 1
                    producer.flush()
                if produce_s > 0:       # keep to the schedule: good records spread over produce_s
                    ahead = t0 + produce_s * good / stream.good - time.monotonic()
                    if ahead > 0:
                        time.sleep(ahead)
        finally:
            producer.close()

    def start(self, produce_s: float) -> None:
        """`run` on a background thread; `join` waits for it (and raises what it raised)."""
        def target() -> None:
            try:
                self.run(produce_s)
            except BaseException as e:      # handed to join()
                self.error = e
        self._thread = threading.Thread(target=target, name="chaos-producer", daemon=True)
        self._thread.start()

    def join(self) -> KnownStream:
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error
        return self.stream
