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
data line).  Progress and the summary report ``next_offset``: every data line
before it was acknowledged by the broker, and the line at ``next_offset`` was
not (or was not yet known to be).  Replaying again with ``--resume
next_offset`` therefore loses nothing.  A resume sends again the records from
``next_offset`` on that were already acknowledged, which are

* none after a clean end;
* after Ctrl-C or a failure, with ``key none`` (file order) the records of the
  messages whose acknowledgement was not in yet; with ``key line`` or
  ``field:NAME`` a chunk's messages go out partition by partition, so records
  after ``next_offset`` in other partitions may already be on the broker: up to
  one chunk (`CHUNK_BYTES`) is sent twice;
* whatever the broker stored but did not acknowledge (the process died, or the
  connection broke before the answer came): at-least-once, never lost.

Failures: every message's acknowledgement is checked after each chunk.  A
send the broker refuses for good (a message too large, no permission) stops
the replay at once; retriable failures (the broker unreachable, a leader
moving) are retried, with backoff, for `RETRY_S` seconds, then stop it.  A
retry sends a partition's messages again from its first failed one on, in
order, so a partition's records stay in file order, except that messages
acknowledged after a lost one are sent again after it (duplicates).  A
failure, or a file that cannot be read to its end (a truncated gzip), raises
`ReplayError` (a `SourceError`) whose message and `.summary` say how many
records were acknowledged and the ``next_offset`` to resume from.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Callable

from stream_ctr.connectors.files import READ_ERRORS, SourceError, detect_format, open_binary
from stream_ctr.connectors.formats import RecordFormat
from stream_ctr.connectors.kafka.options import parse_kafka_url
from stream_ctr.connectors.kafka.sink import create_topic, make_producer, topic_partitions

log = logging.getLogger("stream_ctr.connectors.kafka")
CHUNK_BYTES = 4 << 20
RETRY_S = 120.0        # how long unacknowledged records are retried before the replay stops


@dataclass
class ReplaySummary:
    file: str
    topic: str
    partitions: int
    records: int              # data lines produced and acknowledged
    messages: int             # messages acknowledged
    bytes: int                # value bytes of the acknowledged messages
    seconds: float
    records_per_s: float
    mb_per_s: float
    first_offset: int         # data line the replay started at (--resume)
    next_offset: int          # data line to --resume from
    interrupted: bool = False
    created_topic: bool = False   # the topic did not exist: replay created it

    def as_dict(self) -> dict:
        return asdict(self)


class ReplayError(SourceError):
    """The replay stopped before the end; `summary` is what it got done."""

    def __init__(self, message: str, summary: ReplaySummary) -> None:
        super().__init__(message)
        self.summary = summary


class _Stop(Exception):
    """Internal: stop the replay with this (one-line) cause."""


ProgressFn = Callable[[int, int, float, int], None]    # (records, bytes, seconds, next_offset)


def replay_file(source: str, to: str, rate: float = 0.0, key: str = "none", resume: int = 0,
                packed: int = 1, limit: int = 0, partitions: int = 0,
                progress: ProgressFn | None = None, retry_s: float | None = None,
                schema: str = "") -> ReplaySummary:
    """Produce the data lines of `source` (a path or FORMAT:PATH) to the topic of `to`.

    `rate` caps records/s (0 = as fast as possible); `limit` stops after that
    many lines (0 = to the end); a topic that does not exist is created with
    `partitions` partitions (0: one; the summary's `created_topic` says so); `retry_s` (default `RETRY_S`) is
    how long retriable send failures are retried.  Blocks until done; Ctrl-C
    stops after acknowledging what was sent and reports it (``interrupted``).
    ReplayError if sending or reading fails (see the module docstring).
    """
    fmt, path = detect_format(source, schema)       # `schema`: TOML text, for json:/csv: files
    url = parse_kafka_url(to)
    if len(url.topics) != 1:
        raise SourceError(f"replay writes one topic; {to!r} names {len(url.topics)}")
    if packed < 1 or resume < 0 or limit < 0 or rate < 0:
        raise SourceError("replay needs --packed >= 1, --resume >= 0, --limit >= 0, --rate >= 0")
    _check_key(key, fmt)                     # before anything is created
    retry_s = RETRY_S if retry_s is None else max(float(retry_s), 0.0)
    topic = url.topics[0]
    n_partitions = topic_partitions(url, topic)
    created = False
    if not n_partitions:
        create_topic(url, topic, partitions or 1)
        n_partitions, created = topic_partitions(url, topic), True
    if not n_partitions:
        raise SourceError(f"topic {topic!r} does not exist on {','.join(url.bootstrap)} and creating "
                          "it did not take; create it with the broker's tools")
    route = _router(key, fmt, n_partitions, packed)
    # A send's own retries end after `delivery`; replay_file's rounds go on to `retry_s`.
    delivery_ms = int(min(max(retry_s, 1.0), 120.0) * 1000)
    producer = make_producer(url, delivery_timeout_ms=delivery_ms, max_block_ms=min(delivery_ms, 60000),
                             request_timeout_ms=min(30000, delivery_ms - 100))
    state = _Counts(resume)
    failure = None
    t0 = time.perf_counter()
    try:
        try:
            for lines, first in _data_lines(path, fmt, resume, limit):
                state.begin(list(route(lines, first)), first + len(lines))
                _produce_chunk(producer, topic, state, rate, t0, retry_s,
                               url.options.reconnect_backoff_max_s)
                state.next_offset = state.chunk_end       # all acknowledged: the resume point moves
                state.msgs = []
                if progress:
                    progress(state.records, state.bytes, time.perf_counter() - t0, state.next_offset)
        except KeyboardInterrupt:
            state.interrupted = True
            producer.flush()
            state.settle()
        except _Stop as e:
            failure = str(e)
            state.settle()
    finally:
        producer.close(timeout=30)
    seconds = time.perf_counter() - t0
    summary = ReplaySummary(str(path), topic, n_partitions, state.records, state.messages,
                            state.bytes, seconds, state.records / max(seconds, 1e-9),
                            state.bytes / 1e6 / max(seconds, 1e-9), resume, state.resume_point(),
                            state.interrupted, created)
    if failure:
        raise ReplayError(f"replay of {path} to {topic} stopped: {failure}; {summary.records:,} "
                          f"records were acknowledged (data lines {resume:,} on); resume with "
                          f"--resume {summary.next_offset} (next_offset)", summary)
    return summary


def _produce_chunk(producer, topic: str, state: "_Counts", rate: float, t0: float,
                   retry_s: float, backoff_max_s: float) -> None:
    """Send the chunk's messages; return once all are acknowledged, else _Stop."""
    from kafka.errors import KafkaError
    msgs = state.msgs
    todo = list(range(len(msgs)))
    first_failure, delay = None, 0.5
    while todo:
        failed: dict[int, BaseException] = {}
        state.futures = {}
        for j, i in enumerate(todo):
            part, message_key, value, n_lines, _ = msgs[i]
            try:
                state.futures[i] = producer.send(topic, value=value, key=message_key, partition=part)
            except KafkaError as e:          # refused before sending (too large, no metadata in time)
                failed.update((k, e) for k in todo[j:])       # send no more: the retry keeps order
                break
            state.sent += n_lines
            if rate:
                _throttle(rate, state.sent, t0)
        producer.flush()
        state.settle()
        for i, future in state.futures.items():
            if i not in state.acked:
                failed[i] = future.exception or KafkaError("not acknowledged after flush")
        state.futures = {}
        if not failed:
            return
        i, e = min(failed.items())
        what = _describe(e)
        if not getattr(e, "retriable", False):
            raise _Stop(f"the broker refuses a message of {msgs[i][3]} records from data line "
                        f"{msgs[i][4]:,} ({what})")
        now = time.monotonic()
        first_failure = first_failure or now
        if now - first_failure >= retry_s:
            raise _Stop(f"{len(failed)} messages not acknowledged after retrying for "
                        f"{now - first_failure:.0f} s ({what})")
        # Per partition, send again from its first failed message on, in order.
        earliest: dict[int, int] = {}
        for k in failed:
            earliest[msgs[k][0]] = min(earliest.get(msgs[k][0], k), k)
        todo = [k for k in range(len(msgs)) if k >= earliest.get(msgs[k][0], len(msgs))]
        log.warning("kafka: %d of %d replay messages not acknowledged (%s); sending %d again in %.1f s",
                    len(failed), len(msgs), what, len(todo), delay)
        time.sleep(delay)
        delay = min(delay * 2, max(backoff_max_s, 0.5))


class _Counts:
    """What was acknowledged, and the chunk in flight (`msgs`, `acked`, `futures`)."""

    def __init__(self, start: int) -> None:
        self.records = self.messages = self.bytes = self.sent = 0
        self.next_offset, self.interrupted = start, False
        self.msgs: list[tuple] = []              # (partition, key, value, lines, first line)
        self.acked: set[int] = set()
        self.futures: dict = {}
        self.chunk_end = start

    def begin(self, msgs: list[tuple], chunk_end: int) -> None:
        self.msgs, self.acked, self.futures, self.chunk_end = msgs, set(), {}, chunk_end

    def settle(self) -> None:
        """Count the messages of the chunk whose acknowledgement came in."""
        for i, future in self.futures.items():
            if i not in self.acked and future.succeeded():
                self.acked.add(i)
                self.records += self.msgs[i][3]
                self.messages += 1
                self.bytes += len(self.msgs[i][2])

    def resume_point(self) -> int:
        """The first data line not acknowledged (every line before it is)."""
        starts = [m[4] for i, m in enumerate(self.msgs) if i not in self.acked]
        return min(starts) if starts else (self.chunk_end if self.msgs else self.next_offset)


def _describe(e: BaseException) -> str:
    """`e` as one line that names its type once."""
    text = " ".join(str(e).split())
    name = type(e).__name__
    return text if text.startswith(name) else f"{name}: {text}" if text else name


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
            try:
                chunk = stream.read(CHUNK_BYTES)
            except READ_ERRORS as e:         # a truncated or damaged gzip, an I/O error
                raise _Stop(f"cannot read {path} past data line {offset - to_skip:,}, the file is "
                            f"truncated or corrupt ({_describe(e)})") from e
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
    if not fmt.field_names:              # a csv schema that takes its columns from the header
        return
    if line.rstrip(b"\r").decode("utf-8", errors="replace").split(fmt.delimiter) != list(fmt.field_names):
        raise SourceError(f"{path}: first line is not the {fmt.name} header; pick the right format")


def _router(key: str, fmt: RecordFormat, n_partitions: int, packed: int):
    """A function (lines, first offset) -> messages (partition, key, value, lines, first).

    `first` is the message's first (lowest) data line.  Within a partition
    messages come in file order.
    """
    if key == "none":
        def route(lines, first):
            for m in range(0, len(lines), packed):
                value = lines[m] if packed == 1 else b"\n".join(lines[m:m + packed])
                n = min(packed, len(lines) - m)
                yield ((first + m) // packed) % n_partitions, None, value, n, first + m
        return route
    _check_key(key, fmt)
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
                yield part, keys[chosen[0]], value, len(chosen), first + chosen[0]
    return route


def _check_key(key: str, fmt: RecordFormat) -> None:
    if key != "none" and key != "line" and not (key.startswith("field:") and key[6:] in fmt.field_names):
        raise SourceError(f"--key must be none, line or field:NAME with NAME one of "
                          f"{', '.join(fmt.field_names)}; got {key!r}")
