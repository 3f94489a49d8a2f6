"""Replay a Criteo/Avazu file (plain or gzip) into a Kafka topic, in file order.

Each data line becomes one message, or with ``packed=N`` groups of up to N
consecutive lines of one partition become one message (far cheaper to produce
and consume).  Lines are sent as they are, bad ones included: the consumer
dead-letters them, exactly as it would live traffic.  The header of an Avazu
file is not sent.

Partitioning (`key`):
  ``none``        no message key; line i goes to partition (i // packed) % P,
                  a deterministic round robin;
  ``line``        key = the line's data-line number; Kafka's default partitioner
                  (murmur2) places it;
  ``field:NAME``  key = that field's raw value (say ``device_ip``), so one
                  user's records stay in order in one partition.
Within a partition, records keep file order.

Offsets: `resume` skips that many data lines first (the Avazu header is not a
data line).  Progress and the summary report ``next_offset``, the data line
after the last one the broker acknowledged: replaying again with ``--resume
next_offset`` continues without gaps (and without duplicates, unless the
process died between sending and the acknowledgement of a chunk).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

from connectors.files import SourceError, detect_format, open_binary
from connectors.formats import RecordFormat
from connectors.kafka_options import KafkaUrl, parse_kafka_url
from connectors.kafka_sink import create_topic, make_producer, topic_partitions

CHUNK_BYTES = 4 << 20


@dataclass
class ReplaySummary:
    file: str
    topic: str
    partitions: int
    records: int              # data lines produced and acknowledged
    messages: int
    bytes: int                # message value bytes
    seconds: float
    records_per_s: float
    mb_per_s: float
    first_offset: int         # data line the replay started at (--resume)
    next_offset: int          # data line to --resume from
    interrupted: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


ProgressFn = Callable[[int, int, float, int], None]    # (records, bytes, seconds, next_offset)


def replay_file(source: str, to: str, rate: float = 0.0, key: str = "none", resume: int = 0,
                packed: int = 1, limit: int = 0, partitions: int = 0,
                progress: ProgressFn | None = None) -> ReplaySummary:
    """Produce the data lines of `source` (a path or FORMAT:PATH) to the topic of `to`.

    `rate` caps records/s (0 = as fast as possible); `limit` stops after that
    many lines (0 = to the end); `partitions` > 0 creates the topic with that
    many partitions if it does not exist.  Blocks until done; Ctrl-C stops
    after acknowledging what was sent and reports it (``interrupted``).
    """
    fmt, path = detect_format(source)
    url = parse_kafka_url(to)
    if len(url.topics) != 1:
        raise SourceError(f"replay writes one topic; {to!r} names {len(url.topics)}")
    if packed < 1 or resume < 0 or limit < 0 or rate < 0:
        raise SourceError("replay needs --packed >= 1, --resume >= 0, --limit >= 0, --rate >= 0")
    topic = url.topics[0]
    n_partitions = topic_partitions(url, topic)
    if not n_partitions and partitions:
        create_topic(url, topic, partitions)
        n_partitions = topic_partitions(url, topic)
    if not n_partitions:
        raise SourceError(f"topic {topic!r} does not exist on {','.join(url.bootstrap)}; create it "
                          "or pass --partitions N to create it with N partitions")
    route = _router(key, fmt, n_partitions, packed)
    producer = make_producer(url)
    sent = _Counts(resume)
    t0 = time.perf_counter()
    try:
        for lines, first in _data_lines(path, fmt, resume, limit):
            for part, message_key, value, n_lines, end in route(lines, first):
                producer.send(topic, value=value, key=message_key, partition=part)
                sent.add(n_lines, len(value), end)
                if rate:
                    _throttle(rate, sent.records, t0)
            producer.flush()                 # acknowledged: the resume point may move
            sent.next_offset = first + len(lines)
            if progress:
                progress(sent.records, sent.bytes, time.perf_counter() - t0, sent.next_offset)
    except KeyboardInterrupt:
        sent.interrupted = True
        producer.flush()
    finally:
        producer.close(timeout=30)
    seconds = time.perf_counter() - t0
    return ReplaySummary(str(path), topic, n_partitions, sent.records, sent.messages, sent.bytes,
                         seconds, sent.records / max(seconds, 1e-9),
                         sent.bytes / 1e6 / max(seconds, 1e-9), resume, sent.next_offset,
                         sent.interrupted)


class _Counts:
    """What was sent; `next_offset` moves only past acknowledged, gap-free lines."""

    def __init__(self, start: int) -> None:
        self.records = self.messages = self.bytes = 0
        self.next_offset, self.interrupted = start, False

    def add(self, records: int, n_bytes: int, end: int | None) -> None:
        self.records += records
        self.messages += 1
        self.bytes += n_bytes
        if end is not None:          # file order: everything before `end` is sent
            self.next_offset = end


def _throttle(rate: float, records: int, t0: float) -> None:
    ahead = records / rate - (time.perf_counter() - t0)
    if ahead > 0.001:
        time.sleep(ahead)


def _data_lines(path, fmt: RecordFormat, resume: int, limit: int):
    """(lines, offset of the first) chunks of data lines from `resume`, at most `limit` in all."""
    with open_binary(path) as stream:
        tail = b""
        header_pending = fmt.has_header
        to_skip, left = resume, limit or -1
        offset = resume
        while left:
            chunk = stream.read(CHUNK_BYTES)
            data = tail + chunk
            if chunk:
                cut = data.rfind(b"\n") + 1
                data, tail = data[:cut], data[cut:]
                if not data:                 # no whole line yet
                    continue
            elif not data:
                break
            else:
                tail = b""
            lines = data.split(b"\n")
            if lines and lines[-1] == b"" and data.endswith(b"\n"):
                lines.pop()
            if header_pending and lines:
                _check_header(lines.pop(0), path, fmt)
                header_pending = False
            if to_skip:
                skipped = min(to_skip, len(lines))
                lines, to_skip = lines[skipped:], to_skip - skipped
            if left > 0:
                lines, left = lines[:left], left - min(left, len(lines))
            if lines:
                yield lines, offset
                offset += len(lines)
            if not chunk:
                break
    if to_skip:
        raise SourceError(f"--resume {resume} is past the end of {path} ({resume - to_skip} data lines)")


def _check_header(line: bytes, path, fmt: RecordFormat) -> None:
    if line.rstrip(b"\r").decode("utf-8", errors="replace").split(fmt.delimiter) != list(fmt.field_names):
        raise SourceError(f"{path}: first line is not the {fmt.name} header; pick the right format")


def _router(key: str, fmt: RecordFormat, n_partitions: int, packed: int):
    """A function (lines, first offset) -> messages (partition, key, value, lines, end).

    `end` is the data line after the message when messages go out in file
    order (key none), else None (the resume point then moves per chunk).
    """
    if key == "none":
        def route(lines, first):
            for m in range(0, len(lines), packed):
                value = lines[m] if packed == 1 else b"\n".join(lines[m:m + packed])
                n = min(packed, len(lines) - m)
                yield ((first + m) // packed) % n_partitions, None, value, n, first + m + n
        return route
    if key != "line" and not (key.startswith("field:") and key[6:] in fmt.field_names):
        raise SourceError(f"--key must be none, line or field:NAME with NAME one of "
                          f"{', '.join(fmt.field_names)}; got {key!r}")
    from kafka.partitioner.default import murmur2
    field = fmt.field_names.index(key[6:]) if key != "line" else -1
    delimiter = fmt.delimiter.encode()

    def route(lines, first):
        if field < 0:
            keys = [str(first + i).encode() for i in range(len(lines))]
        else:
            keys = [(f[field] if len(f) > field else b"") for f in (ln.split(delimiter) for ln in lines)]
        groups: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault((murmur2(k) & 0x7FFFFFFF) % n_partitions, []).append(i)
        for part, members in sorted(groups.items()):
            for m in range(0, len(members), packed):
                chosen = members[m:m + packed]
                value = b"\n".join(lines[i] for i in chosen)
                # A packed message carries the key of its first line.
                yield part, keys[chosen[0]], value, len(chosen), None
    return route
