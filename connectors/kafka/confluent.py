"""The confluent-kafka (librdkafka) consumer backend of `KafkaSource` (``kafka.client = confluent``).

Why a second client: with kafka-python every fetched byte passes through
Python (4 KiB socket reads joined and copied on its IO thread, record batches
parsed by the polling thread), ~0.6-0.9 us of CPU a record of packed messages
on the machines we measured, on the same cores the decoder needs.  librdkafka
fetches and checks record batches in C on its own threads, without the GIL,
and keeps a prefetch queue per partition, so the broker is asked for the next
batch while the trainer decodes.  BENCHMARKS.md ("Ingest (Kafka)") has the
numbers.  kafka-python stays the default (pure Python, nothing to compile);
this backend needs ``pip install confluent-kafka``.

`ConfluentConsumer` gives `KafkaSource` the part of kafka-python's
``KafkaConsumer`` API it uses, with kafka-python's types at the boundary
(``kafka.TopicPartition`` keys, records with ``offset`` / ``value`` /
``timestamp``, ``OffsetAndMetadata``, and ``kafka.errors`` exceptions), so the
source's positioning, hand-over and commit logic is one code path for both
clients.  Differences that matter, and how they are bridged:

- Rebalance callbacks run on the thread that polls (inside ``consume()``),
  not on an IO thread; the source's listener is the same object, driven
  synchronously (its only await, the revocation commit, is synchronous here).
- A newly assigned partition is assigned and immediately paused inside the
  callback (as kafka-python's listener pauses it): nothing is handed out
  before `KafkaSource` has chosen its position and seeked.  librdkafka
  discards messages fetched before a seek (its fetch version changes).
- The high watermark comes from librdkafka's cache, updated by every fetch
  response (like kafka-python's ``highwater``).
- ``partitions_for_topic`` and ``topics`` ask the broker every time (bounded
  by kafka.connect_timeout_s); kafka-python answers from its metadata cache.

Known: on tansu, deleting a topic this consumer fetches crashes librdkafka
2.16 (SIGSEGV in ``rd_kafka_metadata_update_op``: tansu's fetch reply for the
deleted topic carries a leader hint under a null topic id, which librdkafka
looks up by a NULL name).  The trainer dies before the source can report
`StreamGone`; its last checkpoint stands, and a restart says the topic does
not exist.  kafka-python reports the deletion (`StreamGone`).
"""
from __future__ import annotations

import logging
import threading
from collections import namedtuple
from typing import Any

from stream_ctr.connectors.kafka.options import KafkaUrl, sasl_password

log = logging.getLogger("stream_ctr.connectors.kafka")

# A fetched message, shaped like kafka-python's ConsumerRecord where the source reads it.
Record = namedtuple("Record", "offset value timestamp")
# librdkafka error codes (rdkafka.h) that mean "not a member of the group right now".
_NOT_A_MEMBER = ("REBALANCE_IN_PROGRESS", "ILLEGAL_GENERATION", "UNKNOWN_MEMBER_ID",
                 "_ASSIGNMENT_LOST", "_STATE")
_FATAL_AUTH = ("_AUTHENTICATION", "SASL_AUTHENTICATION_FAILED", "_SSL")
RUN_BYTES = 8 << 20         # values handed to the source per poll (one decode run)
_WAKE_TIMEOUT_S = 1.0
# The largest values librdkafka 2.x accepts for these properties (its configuration table).
_RECEIVE_MAX_BYTES = 2147483647
_FETCH_MAX_BYTES = _RECEIVE_MAX_BYTES - 512     # it must stay 512 bytes below the receive limit
_PARTITION_FETCH_MAX_BYTES = 1_000_000_000
_MESSAGE_MAX_BYTES = 1_000_000                  # librdkafka's default
_QUEUED_MAX_KBYTES = 2097151


def available() -> bool:
    try:
        import confluent_kafka  # noqa: F401
    except ImportError:
        return False
    return True


def librdkafka_config(url: KafkaUrl) -> dict[str, Any]:
    """librdkafka properties for a consumer of `url` (the same options as kafka-python's)."""
    o = url.options
    config: dict[str, Any] = {
        "bootstrap.servers": ",".join(url.bootstrap), "client.id": o.client_id,
        "group.id": o.group, "enable.auto.commit": False, "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest", "allow.auto.create.topics": False,
        "enable.partition.eof": False,
        # The fetch sizes are soft limits: the broker returns the first record batch of a
        # partition whole even when it is larger, so they are only clamped to the ranges
        # librdkafka accepts (a larger value would refuse to start the consumer).
        "fetch.max.bytes": min(o.fetch_max_bytes, _FETCH_MAX_BYTES),
        "max.partition.fetch.bytes": min(o.max_partition_fetch_bytes, _PARTITION_FETCH_MAX_BYTES),
        # librdkafka refuses a fetch.max.bytes below message.max.bytes (1,000,000 by default;
        # for a consumer it only bounds the requests it sends, all of them small).
        "message.max.bytes": min(o.fetch_max_bytes, _MESSAGE_MAX_BYTES),
        # A response larger than this is dropped and fetched again, forever: one message
        # larger than the fetch sizes (which the broker still returns whole) stalled its
        # partition with nothing trained.  So admit any response size librdkafka can
        # (buffers are sized by each response, not by this).
        "receive.message.max.bytes": _RECEIVE_MAX_BYTES,
        "fetch.wait.max.ms": int(min(500, o.poll_timeout_s * 1000)),
        # After a full prefetch queue librdkafka waits this long before fetching that
        # partition again (default 1 s): the trainer drained the queue long before,
        # and sat ~0.5 s without records (measured).
        "fetch.queue.backoff.ms": 10,
        # librdkafka's prefetch queue per partition: one whole fetch, so memory stays
        # bounded when the trainer is behind (the source pauses beyond that).  It must
        # hold more than one poll asks for (~chunk_records rows): consume(n) waits until
        # n messages are there, and with a queue of one partition fetch (16 MiB) a poll
        # of 66 packed messages sometimes waited out poll_timeout_s (measured: 0.2-1.1M
        # rows/s; 1.1-1.2M with this).
        "queued.max.messages.kbytes": min(max(1024, o.fetch_max_bytes >> 10), _QUEUED_MAX_KBYTES),
        "session.timeout.ms": o.session_timeout_ms, "heartbeat.interval.ms": o.heartbeat_interval_ms,
        "reconnect.backoff.max.ms": int(o.reconnect_backoff_max_s * 1000),
        "socket.connection.setup.timeout.ms": int(o.connect_timeout_s * 1000),
        "security.protocol": o.security_protocol,
    }
    if o.security_protocol in ("SSL", "SASL_SSL"):
        config["ssl.endpoint.identification.algorithm"] = "https" if o.ssl_check_hostname else "none"
        for key, path in (("ssl.ca.location", o.ssl_cafile), ("ssl.certificate.location", o.ssl_certfile),
                          ("ssl.key.location", o.ssl_keyfile)):
            if path:
                config[key] = path
    if o.sasl_mechanism:
        config.update({"sasl.mechanism": o.sasl_mechanism, "sasl.username": o.sasl_username,
                       "sasl.password": sasl_password(o)})
    return config


def _kafka_error(e: Exception, what: str):
    """A kafka-python exception for a confluent-kafka one (the source catches those)."""
    from kafka import errors
    err = e.args[0] if e.args else None
    name = err.name() if hasattr(err, "name") else type(e).__name__
    text = f"{what}: {err.str() if hasattr(err, 'str') else e} ({name})"
    if name in _NOT_A_MEMBER:
        return errors.CommitFailedError(text)
    if name in _FATAL_AUTH:
        return errors.SaslAuthenticationFailedError(text)
    if name in ("_TIMED_OUT", "REQUEST_TIMED_OUT", "_TRANSPORT", "_ALL_BROKERS_DOWN"):
        return errors.KafkaTimeoutError(text)
    return errors.KafkaError(text)


class ConfluentConsumer:
    """A confluent-kafka Consumer behind the kafka-python calls `KafkaSource` makes."""

    def __init__(self, url: KafkaUrl) -> None:
        from confluent_kafka import Consumer
        self._timeout_s = url.options.connect_timeout_s
        self._fatal = None                  # a fatal librdkafka error, raised by the next poll
        # Set when librdkafka reports every broker connection down, cleared when the group
        # assigns partitions or records come: with no partition to probe, the only sign of
        # an outage (`brokers_down`).
        self._down = False
        self._lock = threading.Lock()       # error_cb runs on librdkafka's threads
        config = librdkafka_config(url)
        config["error_cb"] = self._on_error
        self._consumer = Consumer(config)
        self._listener = None
        self._pending: list = []            # consumed, not yet handed out; newest first
        # The cached watermark of a partition when it was last seeked: until a fetch
        # answer changes it, it may be one from before (another assignment), not its end.
        self._high_at_seek: dict[tuple[str, int], int | None] = {}

    # -- errors librdkafka reports asynchronously ---------------------------
    def _on_error(self, err) -> None:
        from confluent_kafka import KafkaError
        if err.name() in _FATAL_AUTH or err.fatal():
            with self._lock:
                self._fatal = err
        else:   # transport errors during an outage: BrokerWatch logs the outage once
            if err.code() == KafkaError._ALL_BROKERS_DOWN:
                self._down = True
            log.debug("kafka (librdkafka): %s", err.str())

    @property
    def brokers_down(self) -> bool:
        """librdkafka has lost every broker connection since the last assignment or record
        (what `BrokerWatch` asks when the consumer owns no partition it could probe)."""
        return self._down

    def _raise_fatal(self) -> None:
        with self._lock:
            fatal, self._fatal = self._fatal, None
        if fatal is not None:
            raise _kafka_error(Exception(fatal), "librdkafka")

    # -- metadata ------------------------------------------------------------
    def partitions_for_topic(self, topic: str) -> set[int] | None:
        """The topic's partitions; None if the broker says it does not exist.  Any other
        error (the broker away, say) raises: it says nothing about the topic."""
        from confluent_kafka import KafkaError, KafkaException
        try:
            meta = self._consumer.list_topics(topic, timeout=self._timeout_s)
        except KafkaException as e:
            raise _kafka_error(e, "metadata") from None
        t = meta.topics.get(topic)
        if t is None or (t.error is not None and t.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
            return None
        if t.error is not None:
            raise _kafka_error(Exception(t.error), f"metadata of {topic}")
        return set(t.partitions) or None

    def topics(self) -> set[str]:
        """Every topic the broker lists (a metadata request now, as kafka-python's)."""
        from confluent_kafka import KafkaException
        try:
            meta = self._consumer.list_topics(timeout=self._timeout_s)
        except KafkaException as e:
            raise _kafka_error(e, "metadata") from None
        return set(meta.topics)

    # -- group membership ----------------------------------------------------
    def subscribe(self, topics: list[str], listener) -> None:
        self._listener = listener
        self._consumer.subscribe(list(topics), on_assign=self._assigned, on_revoke=self._revoked,
                                 on_lost=self._lost)

    def _assigned(self, consumer, partitions) -> None:
        self._down = False
        consumer.assign(partitions)
        if partitions:
            consumer.pause(partitions)      # the source positions them before anything is fetched
        _drive(self._listener.on_partitions_assigned({_kp(p) for p in partitions}))

    def _forget(self, partitions) -> None:
        """Drop consumed messages of `partitions` not handed out yet (revoked, or seeked)."""
        gone = {(p.topic, p.partition) for p in partitions}
        if self._pending and gone:
            self._pending = [m for m in self._pending if (m.topic(), m.partition()) not in gone]

    def _revoked(self, consumer, partitions) -> None:
        self._forget(partitions)
        _drive(self._listener.on_partitions_revoked({_kp(p) for p in partitions}))
        consumer.unassign()

    def _lost(self, consumer, partitions) -> None:
        self._forget(partitions)
        _drive(self._listener.on_partitions_lost({_kp(p) for p in partitions}))
        consumer.unassign()

    # -- fetching -------------------------------------------------------------
    def poll(self, timeout_ms: int = 0, max_records: int = 500) -> dict:
        """Up to `max_records` messages, and about `RUN_BYTES` of values at most, as
        {kafka.TopicPartition: [Record]} in offset order per partition; may run the
        rebalance callbacks.

        librdkafka hands over everything it has prefetched (up to a whole fetch
        of every partition) in one consume(); cut into runs of about
        `RUN_BYTES`, as kafka-python's fetch responses are, the source decodes
        them on both its decode threads and never holds one huge run.  The rest
        waits here for the next calls (consume() is called when it is used up)."""
        from confluent_kafka import KafkaException
        if not self._pending:
            # consume(n, timeout) waits until n messages are there or the time is up;
            # kafka-python's poll returns as soon as any are: take what is there, and
            # only when that is nothing wait for the first one.
            n = max(1, min(max_records, 1_000_000))
            try:
                self._pending = self._consumer.consume(num_messages=n, timeout=0)
                if not self._pending and timeout_ms > 0:
                    self._pending = self._consumer.consume(num_messages=1, timeout=timeout_ms / 1000)
                    if self._pending and n > 1:
                        self._pending += self._consumer.consume(num_messages=n - 1, timeout=0)
            except KafkaException as e:
                raise _kafka_error(e, "consume") from None
            self._pending.reverse()                  # pop() from the end: oldest first
        self._raise_fatal()
        messages, n_bytes = [], 0
        while self._pending and len(messages) < max_records and n_bytes < RUN_BYTES:
            m = self._pending.pop()
            messages.append(m)
            n_bytes += len(m) if m.error() is None else 0
        out: dict = {}
        for m in messages:
            err = m.error()
            if err is not None:
                if err.fatal() or err.name() in _FATAL_AUTH:
                    raise _kafka_error(Exception(err), "consume")
                log.debug("kafka (librdkafka): %s", err.str())
                continue
            tp = (m.topic(), m.partition())
            out.setdefault(tp, []).append(Record(m.offset(), m.value(), m.timestamp()[1]))
        if out:
            self._down = False
        from kafka import TopicPartition
        return {TopicPartition(t, p): records for (t, p), records in out.items()}

    def highwater(self, tp) -> int | None:
        """The partition's end as the last fetch answer gave it (kafka-python's meaning);
        None before one has come since the partition was seeked."""
        high = self._cached_high(tp)
        key = (tp.topic, tp.partition)
        if key in self._high_at_seek:
            if high == self._high_at_seek[key]:
                return None
            del self._high_at_seek[key]
        return high

    def _cached_high(self, tp) -> int | None:
        try:
            _, high = self._consumer.get_watermark_offsets(_ck(tp), cached=True)
        except Exception:                   # noqa: BLE001 - not known yet
            return None
        return high if high >= 0 else None

    def pause(self, *tps) -> None:
        if tps:
            self._consumer.pause([_ck(tp) for tp in tps])

    def resume(self, *tps) -> None:
        if tps:
            self._consumer.resume([_ck(tp) for tp in tps])
            # A resumed partition is fetched only when librdkafka's broker thread next
            # wakes up (its next heartbeat: ~0.5 s in the bench, up to
            # heartbeat_interval_ms after every rebalance, measured); a metadata
            # request wakes it now.  Only a speed-up: during an outage it just fails.
            from confluent_kafka import KafkaException
            try:
                self._consumer.list_topics(tps[0].topic, timeout=_WAKE_TIMEOUT_S)
            except KafkaException:
                pass

    def seek(self, tp, offset: int) -> None:
        from confluent_kafka import KafkaException
        self._forget([tp])
        self._high_at_seek[(tp.topic, tp.partition)] = self._cached_high(tp)
        try:
            self._consumer.seek(_ck(tp, offset))
        except KafkaException as e:
            raise _kafka_error(e, f"seek {tp.topic}/{tp.partition} to {offset}") from None

    # -- offsets ---------------------------------------------------------------
    def committed(self, tp, metadata: bool = False):
        """The group's committed offset of `tp` as kafka-python's OffsetAndMetadata, or None."""
        from confluent_kafka import KafkaException
        from kafka.structs import OffsetAndMetadata
        try:
            (c,) = self._consumer.committed([_ck(tp)], timeout=self._timeout_s)
        except KafkaException as e:
            raise _kafka_error(e, "committed offsets") from None
        if c.error is not None:
            raise _kafka_error(Exception(c.error), "committed offsets")
        if c.offset < 0:
            return None
        return OffsetAndMetadata(c.offset, getattr(c, "metadata", None) or "", -1)

    def commit(self, offsets: dict, timeout_ms: int | None = None) -> None:
        """Commit {kafka.TopicPartition: OffsetAndMetadata}; blocks until the broker answers."""
        from confluent_kafka import KafkaException, TopicPartition
        tps = [TopicPartition(tp.topic, tp.partition, om.offset, metadata=om.metadata)
               if om.metadata else TopicPartition(tp.topic, tp.partition, om.offset)
               for tp, om in offsets.items()]
        try:
            result = self._consumer.commit(offsets=tps, asynchronous=False)
        except KafkaException as e:
            raise _kafka_error(e, "commit") from None
        failed = [p for p in result or [] if p.error is not None]
        if failed:
            raise _kafka_error(Exception(failed[0].error), f"commit {failed[0].topic}/{failed[0].partition}")

    async def commit_async(self, offsets: dict) -> None:
        """The revocation commit: synchronous here (callbacks run on the polling thread)."""
        self.commit(offsets)

    def _watermarks(self, tps, timeout_ms: int | None, which: int) -> dict:
        from confluent_kafka import KafkaException
        timeout_s = (timeout_ms / 1000) if timeout_ms else self._timeout_s
        out = {}
        for tp in tps:
            try:
                out[tp] = self._consumer.get_watermark_offsets(_ck(tp), timeout=timeout_s,
                                                               cached=False)[which]
            except KafkaException as e:
                raise _kafka_error(e, "list offsets") from None
        return out

    def beginning_offsets(self, tps, timeout_ms: int | None = None) -> dict:
        return self._watermarks(tps, timeout_ms, 0)

    def end_offsets(self, tps, timeout_ms: int | None = None) -> dict:
        return self._watermarks(tps, timeout_ms, 1)

    def offsets_for_times(self, timestamps: dict) -> dict:
        """{tp: ms} -> {tp: object with .offset, or None past the end} (kafka-python's shape)."""
        from confluent_kafka import KafkaException
        from kafka.structs import OffsetAndTimestamp
        query = [_ck(tp, ts) for tp, ts in timestamps.items()]
        try:
            found = self._consumer.offsets_for_times(query, timeout=self._timeout_s)
        except KafkaException as e:
            raise _kafka_error(e, "offsets for times") from None
        out = {}
        for tp, f in zip(timestamps, found):
            out[tp] = OffsetAndTimestamp(f.offset, timestamps[tp], -1) if f.offset >= 0 else None
        return out

    def close(self, autocommit: bool = False, timeout_ms: int | None = None) -> None:
        """Leave the group (revocation callbacks run first); never commits by itself.
        `timeout_ms` is not librdkafka's to take: it bounds its LeaveGroup itself."""
        self._consumer.close()


def _ck(tp, offset: int | None = None):
    from confluent_kafka import TopicPartition
    return TopicPartition(tp.topic, tp.partition) if offset is None \
        else TopicPartition(tp.topic, tp.partition, offset)


def _kp(p):
    from kafka import TopicPartition
    return TopicPartition(p.topic, p.partition)


def _drive(coroutine) -> None:
    """Run a listener coroutine that never suspends (this backend's awaits are synchronous)."""
    try:
        coroutine.send(None)
    except StopIteration:
        return
    coroutine.close()
    raise RuntimeError("the rebalance listener suspended; the confluent backend cannot wait")
