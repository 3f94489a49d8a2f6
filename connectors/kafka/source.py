"""KafkaSource: decoded chunks from Kafka topics, read in a consumer group.

The source contract shared with `FileSource` (``read`` -> ``(Batch,
rejected)``, ``exhausted``, ``snapshot``, ``close``), plus the calls a
streaming trainer needs:

- ``trained(batch)``: the trainer reports a batch of rows this source returned
  as trained; returns the resume positions to checkpoint, a `KafkaPositions`
  (per partition the next offset to read, and the rows of a split packed
  message already trained; `stream_ctr.connectors.kafka.positions`, whose
  ``to_checkpoint()`` is what a checkpoint stores);
- ``commit(positions)``: publish them as the group's committed offsets.  Call
  it only after the checkpoint holding them is durable: group offsets are for
  lag tools and for the next owner of a partition, the checkpoint is the truth.
- ``rejects_written()``: the rejects ``read`` returned are in the dead-letter
  sink; only then may positions pass messages that decoded to no row (below).

Positions in and out of the source (the constructor's, ``snapshot``,
``trained``, ``trained_positions``, ``handover_positions``,
``give_peer_positions``, ``commit``) are `KafkaPositions`.

Offsets and what survives a crash.  Auto-commit is off.  On assignment a
partition is positioned (in this order) at: the checkpoint's position (the
first assignment after start only), the position this process last trained to
before a rebalance took the partition away (or the group's committed offset
if that is further), the group's committed offset, else `options.start`.
A broker that cannot answer for the group's offsets longer than
`options.commit_timeout_s` does not stall partitions with a position of the
first two kinds: they go on from it (logged).
After a crash the trainer restarts from its checkpoint and re-reads exactly
the records after it.

Ranks of a distributed job (``wait_for_peers``).  The ranks share one model,
so a partition that moves between them must continue where the previous rank
left it, whatever the group offset says (the revocation commit may have
failed; on a resume the checkpoint is older than what a peer trained since;
some brokers, tansu among them, drop commit metadata).  A rank's newly
assigned partitions stay paused (`peers_wanted`) until the job's next step
exchanges every rank's `handover_positions` (`give_peer_positions`): each
starts no earlier than the furthest position any rank of this run reached.

Rebalances (exactly-once hand-over).  The consumer polls on a thread of its
own (``kafka-poll``); ``read()`` waits for that poll at most about
`options.poll_timeout_s` + `POLL_GRACE_S` and returns (a poll that has not
returned, a group join the broker holds, goes on and is waited for by the next
read; one stuck for `STUCK_POLL_NOTICE_S` is logged), so the caller always
gets its thread back: it can stop, and a stream end is never decided while a
poll is out.  The rebalance listener runs inside the poll (kafka-python: on its
IO thread ``kafka-io-*``; confluent: on the poll thread); everything it does
to the source it hands to the source's own thread, which runs it while it
waits for the poll, or at its next read (within one train step): until
``close()`` no two threads change the source's state at once (closing, the
listener's calls run where they come from), and the consumer is used by
one thread at a time (a commit asked for while a poll is out is made when it
returns).  On revocation the source drops every row of the revoked
partitions it has not returned; with ``hold_revocations`` it then holds the
revocation (`revocation`) and the listener waits until the caller
``acknowledge``s it: the trainer drops the rows it holds but has not trained
and writes a checkpoint first.  Only then does the listener commit the revoked
partitions' trained positions, *before* the group may hand them to another
member.  Rows of a revoked partition are therefore trained by this trainer
only up to that committed offset, and by the next owner only after it.  A
*lost* membership (session expired, broker restarted) cannot commit: rows are
dropped the same way, and the trained position stays in the checkpoints (and
is where this trainer continues if the partition comes back).  With
kafka-python the listener's wait holds up the IO thread's heartbeats while the
trainer checkpoints.

Outages.  Mid-stream, an unreachable broker is retried with growing backoff
(kafka-python reconnects by itself; the source probes and logs one clear line
when it goes away and one when it is back) and ``read()`` keeps returning
empty batches, so the trainer can still stop on a signal.  At start-up an
unreachable broker or a missing topic is a `SourceError`.

Deleted topics.  Every `PROBE_EVERY_S` (and before a stream ends idle) the
source checks that the broker's metadata still lists every partition it reads
(`client.missing_partitions`).  One missing is logged, left unpositioned and
uncommitted; missing for `TOPIC_GONE_AFTER_S` it is `StreamGone` (a
`SourceError`), raised from ``read()`` or ``exhausted``, so a deleted topic
never looks like an idle stream that ended.  The trainer checkpoints what it
trained before the error leaves the run.  (A topic recreated within that time,
as after a broker restart without its data, is waited out like an outage.)

Messages that are no record.  A null value (a tombstone), an empty value, or
one a decoder cannot take is rejected at its offset (`kafka_decode`); once
``read()`` has handed the reject out and the trainer has reported it written
(``rejects_written``), the resume position passes the message like a fully
trained one (`PositionBook.no_rows`), so a restart does not read it again.  A
reject never written (a stop while the dead-letter broker is down) keeps the
position before its message: a resume reads and dead-letters it.

Joining the group.  A member that did not leave the group (this trainer's
previous process, killed) keeps its partitions until the broker's session
timeout drops it; only then is this one assigned.  Waiting longer than
`JOIN_NOTICE_S` for the first assignment is logged once, with how long it may
take.  ``close()`` leaves the group (kafka-python and librdkafka send
LeaveGroup), so a restart after SIGTERM or Ctrl-C does not wait for it.  A
member still joining cannot leave before the broker ends that join (the
LeaveGroup queues behind the JoinGroup on one connection): ``close()`` then
waits only `LEAVE_WHILE_JOINING_S` and the broker drops the member after its
session timeout.  Until the group assigns partitions, `unassigned_s` says for
how long (the trainer reports it; the idle end does not count it).
Measured on tansu with kafka.session_timeout_ms = 10 s (30 s), both clients
alike: a first join 5.3 s (15 s; tansu admits a member after half the
timeout), a restart after a clean stop 5.3 s (15 s), after SIGKILL 18 s
(54 s).  Static membership (``group_instance_id``) made the restart after
SIGKILL 18 s at 30 s, but every other join slower (18 s), and a static member
does not leave the group when it stops, so a stopped trainer's partitions would
wait out its session in a group of several trainers: not used.

Decoding overlaps fetching.  A polled run of messages is decoded on a worker
thread (`decode_messages` is numpy, which releases the GIL; two runs may be
decoded at once) while the caller's thread goes on with kafka-python: when
``read()`` needs rows that are still being decoded, it polls for the next run
(briefly, while fewer than two reads' worth of rows are in sight) before it
waits for them.  Runs are taken into the buffer in fetch order, on the
caller's thread, exactly as a synchronous decode would have put them there; a
revocation first waits for the runs in flight and takes them in, then drops
rows as described above, so the exactly-once hand-over is unchanged.

Backpressure.  Every ``read()`` polls (heartbeats and rebalances go on while
the trainer works through a large fetch); rows decoded but not yet returned
stay in a buffer, and above ``max_buffered_records`` the partitions are
paused (the consumer keeps its membership but fetches nothing) and resumed
below half of it, so memory stays bounded when the trainer is behind (runs
still being decoded count, at their estimated rows).

Order.  Within a partition, offset order.  The partitions of one fetch are
interleaved by message timestamp (`kafka_decode.event_order`), so a backfill
of several partitions trains in roughly event order rather than partition
after partition.

Lag, per partition: the high watermark of the last fetch response minus the
trained offset (at least the records fetched but not trained); see `lag()`.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Callable

import numpy as np

from stream_ctr.connectors.batch import Batch, Rejected
from stream_ctr.connectors.files import SourceError
from stream_ctr.connectors.formats import RecordFormat
from stream_ctr.connectors.kafka.client import (PROBE_EVERY_S, BrokerWatch, StreamGone, connect_consumer,
                                                missing_partitions)
from stream_ctr.connectors.kafka.client import topic_partition as _tp
from stream_ctr.connectors.kafka.decode import decode_messages, event_order
from stream_ctr.connectors.kafka.listener import Listener
from stream_ctr.connectors.kafka.options import KafkaUrl, check_crc32c, partition_name, start_timestamp_ms
from stream_ctr.connectors.schema import Schema
from stream_ctr.connectors.kafka.positions import (KafkaPositions, PartitionPosition, PositionBook,
                                                   commit_metadata, filter_partitions, parse_commit_metadata)

log = logging.getLogger("stream_ctr.connectors.kafka")
# How much longer than stop_when_idle_s a stream waits for records its broker says exist.
BEHIND_GRACE_S = 10.0
_VALUE, _OFFSET, _TIMESTAMP = attrgetter("value"), attrgetter("offset"), attrgetter("timestamp")
# Runs decoded at the same time (they are independent; taken in in fetch order).
# Two keep both cores of a small machine busy while the caller fetches; more
# mostly add GIL hand-offs between numpy calls.
_DECODE_THREADS = 2
# How long a poll made while rows are still being decoded may wait for the next
# run: long enough for a fetch response in flight to arrive, short enough that
# a finished decode is not kept waiting long when nothing more comes.
_PREFETCH_WAIT_S = 0.01
# A partition missing from the broker's metadata this long is gone (`StreamGone`).  Not
# at once: a broker restarted without its data (tansu with memory storage) lists no
# topic until whoever runs it recreates them, and that is an outage the source waits out.
TOPIC_GONE_AFTER_S = 5.0
# Waiting this long for the group's first assignment is worth a line (see the module doc).
JOIN_NOTICE_S = 5.0
# How much longer than its own timeout ``read()`` waits for a poll before it returns
# without it (the poll goes on: a group join, a rebalance listener waiting for this thread).
POLL_GRACE_S = 2.0
# A poll that has not returned after this long is stuck at the broker: worth a warning.
STUCK_POLL_NOTICE_S = 60.0
# ``close()`` waits this long for a poll still in flight before it gives the consumer up.
CLOSE_WAIT_S = 15.0
# How long ``close()`` waits for the group to confirm this member left while its join is
# still pending at the broker (kafka-python; librdkafka bounds it itself, ~5 s).
LEAVE_WHILE_JOINING_S = 1.0


@dataclass(frozen=True)
class Revocation:
    """Partitions a rebalance took from this member (``lost``: the membership had
    expired, nothing will be committed).  The source has dropped their rows; the
    consumer's rebalance listener waits inside its poll until ``acknowledge``."""
    partitions: tuple[str, ...]
    lost: bool


class _PollThread:
    """Runs the consumer's polls on a thread of their own (daemon: a poll stuck at the
    broker never holds up the process's exit), so that the rebalance listener inside
    a poll can wait for the source's own thread (see the module doc, "Rebalances")."""

    def __init__(self, poll: Callable[..., dict]) -> None:
        self._poll = poll
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kafka-poll", daemon=True)
        self._thread.start()

    def submit(self, timeout_ms: int, max_records: int) -> Future:
        future: Future = Future()
        self._requests.put((future, timeout_ms, max_records))
        return future

    def stop(self) -> None:
        self._requests.put(None)

    def _run(self) -> None:
        while (request := self._requests.get()) is not None:
            future, timeout_ms, max_records = request
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._poll(timeout_ms=timeout_ms, max_records=max_records))
            except BaseException as e:      # noqa: BLE001 - raised on the source's thread
                future.set_exception(e)


@dataclass
class _Decoding:
    """A polled run of messages on the decode worker."""
    future: Future                  # -> DecodedMessages
    names: list[str]                # partition names; msg_partition indexes them
    msg_partition: np.ndarray
    msg_offset: np.ndarray
    n_messages: int
    rows_estimate: int              # for backpressure and prefetching, until it is done


@dataclass
class KafkaStats:
    """Counters a metrics collector reads at scrape time."""
    messages: int = 0
    records: int = 0            # decoded rows returned by read()
    bytes: int = 0              # message value bytes fetched
    rejected: int = 0
    rebalances: int = 0
    outages: int = 0
    outage_s: float = 0.0       # finished outages
    connected: bool = True
    commits: int = 0
    commit_failures: int = 0
    paused: bool = False
    lag: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class KafkaSource:
    """Decoded chunks of Kafka topics read in a consumer group; see the module doc."""

    def __init__(self, url: KafkaUrl, positions: KafkaPositions | None = None,
                 hold_revocations: bool = False, chunk_records: int = 65536,
                 wait_for_peers: bool = False, schema: Schema | None = None) -> None:
        """`hold_revocations`: a rebalance's revocation waits, inside the consumer's
        poll, until the caller takes it in (`revocation`, then `acknowledge`); without
        it the revoked partitions' offsets are committed at once."""
        self.url, self.options = url, url.options
        # A rank of a distributed job positions a newly assigned partition only once the
        # job has told it where the other ranks left it (`give_peer_positions`).
        self._wait_for_peers = wait_for_peers
        self._peer: dict[str, PartitionPosition] = {}
        self._assignments = 0           # non-empty assignments so far
        self._peers_at = 0              # ... when the peers' positions were last given
        # A declared schema (data.schema) decodes the values; else the URL's format.
        self.fmt: RecordFormat | Schema = schema if schema is not None else url.options.record_format
        self.chunk_records = chunk_records
        self.stats = KafkaStats()
        self.crc32c = check_crc32c()
        self._hold_revocations = hold_revocations
        # The rebalance listener runs inside a poll, on the poll thread (confluent) or
        # kafka-python's IO thread; what it does to this source it hands to the source's
        # own thread (`_listener_call`), which runs it while it waits for the poll.
        self._owner = threading.get_ident()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Condition()
        self._in_flight: Future | None = None          # the poll on the poll thread
        self._in_flight_since = 0.0
        self._in_flight_waits = False                  # ... made because rows were missing
        self._said_stuck = False
        self._revocation: Revocation | None = None     # taken by the listener, not yet acknowledged
        self._ack: Future | None = None                # -> durable: commit the revoked offsets
        self._deferred_commit: KafkaPositions | None = None    # asked for while a poll was in flight
        self._book = PositionBook()
        # The checkpoint's positions serve the first assignment only; the partitions it
        # had given up continue like ones given up in this process (see PositionBook).
        positions = positions if positions is not None else KafkaPositions({})
        self._initial = positions.owned()
        self._book.released.update(positions.given_up_partitions())
        self._joined = False                                # the group assigned us (maybe nothing)
        self._unassigned_since: float | None = time.monotonic()    # (not `_joined`) since
        self._unpositioned: set[str] = set()                # assigned, paused until seeked
        self._buffer: deque[Batch] = deque()
        self._buffered = 0
        self._decoding: deque[_Decoding] = deque()     # in fetch order
        self._decoder = ThreadPoolExecutor(max_workers=_DECODE_THREADS, thread_name_prefix="kafka-decode")
        self._rejected: list[Rejected] = []
        self._backpressure = False
        self._closing = False
        self._rows_per_message = 1.0
        self._idle_since = time.monotonic()
        self._watch = BrokerWatch(url, self.stats)
        self._listener_error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._highwater: dict[str, int] = {}         # per partition, from the last fetch response
        self._behind_said = False                     # the idle end's warning (once a run)
        self._fresh: set[str] = set()        # positioned in this process, nothing delivered since
        self._ends_asked_at: dict[str, float] = {}   # when `_check_log_ends` last asked the broker
        self._offsets_unreadable_since: float | None = None   # the group's offsets fail to load since
        self._missing: set[str] = set()              # partitions the broker's metadata did not list
        self._missing_since: float | None = None
        self._next_stream_check = 0.0
        self._all_listed_at = float("-inf")          # the last fresh look that found every partition
        self._consumer = connect_consumer(url)
        # Every partition of the topics at start (connect_consumer checked they exist).
        self.partition_names: tuple[str, ...] = tuple(
            partition_name(t, p) for t in url.topics for p in sorted(self._consumer.partitions_for_topic(t)))
        self._consumer.subscribe(list(url.topics), listener=Listener(self))
        self._poller = _PollThread(self._consumer.poll)
        self._join_wait_since: float | None = time.monotonic()     # until the first assignment

    # -- the source contract ------------------------------------------------
    def read(self, max_records: int | None = None) -> tuple[Batch, list[Rejected]]:
        """Up to `max_records` decoded rows (default `chunk_records`) and the
        records rejected since the last call; may return an empty Batch.

        A call starts a consumer poll when none is out and no revocation is held
        (a held one waits for `acknowledge`), so heartbeats and rebalances
        progress between train steps.  It waits only when fewer than
        `max_records` rows are buffered: at most about `options.poll_timeout_s` +
        `POLL_GRACE_S` for a poll (twice when the first poll's records are still
        decoding and a second one overlaps them), longer only while a commit
        deferred by that poll is made (up to kafka.commit_timeout_s) or a new
        partition is positioned."""
        want = self.chunk_records if max_records is None else max_records
        if not self._closing:        # with runs still decoding, waiting is `_collect`'s business
            self._poll(want - self._buffered - self._rows_decoding(), prefetch=bool(self._decoding))
        self._collect(want)
        batch = self._take(want)
        if len(batch):
            self._idle_since = time.monotonic()
        rejected, self._rejected = self._rejected, []
        self._book.rejects_handed_out()
        self.stats.rejected += len(rejected)
        return batch, rejected

    def rejects_written(self) -> None:
        """The rejects `read` returned are in the dead-letter sink (on disk, or acknowledged
        by the broker). Until this is called, no position moves past a message that
        decoded to no row: a run that stops before its rejects are written checkpoints
        before them, and its resume reads and dead-letters them again."""
        self._book.rejects_written()

    @property
    def exhausted(self) -> bool:
        """A stream ends only after `options.stop_when_idle_s` without records
        (counted from the group's first assignment; not during outages or
        rebalances, nor while rows are buffered), and only while the broker
        still lists every partition it reads: a deleted topic is no idle
        stream (`StreamGone`, raised once it has been missing `TOPIC_GONE_AFTER_S`)."""
        idle = self.options.stop_when_idle_s
        if not (bool(idle) and self._joined and self._in_flight is None and self._revocation is None
                and not self._buffered and not self._decoding
                and not self._watch.in_outage
                and not self._unpositioned and time.monotonic() - self._idle_since >= idle):
            return False
        now = time.monotonic()      # (asked again right after the batches ended: the same answer)
        if self._behind_highwater(now - self._idle_since - idle):
            return False
        return now - self._all_listed_at < PROBE_EVERY_S or self._check_streams(now, fresh=True)

    def _behind_highwater(self, waited_s: float) -> bool:
        """Whether an owned partition's broker reported records past what was fetched: a
        quiet spell is then a slow fetch (a loaded broker or client), not the stream's end.
        Bounded: a log that ends in offsets no record comes from (transaction markers,
        a compacted tail) keeps the watermark ahead for ever, so after `BEHIND_GRACE_S`
        more the stream ends all the same, and says which partitions were behind."""
        high, fetched = dict(self._highwater), self._book.fetch_next
        behind = {n: (fetched.get(n, off), high[n]) for n, (off, _) in self._book.trained.items()
                  if n in high and fetched.get(n, off) < high[n]}
        if not behind:
            return False
        if waited_s < BEHIND_GRACE_S:
            return True
        if not self._behind_said:
            self._behind_said = True
            log.warning("kafka: ending the idle stream although the broker reported offsets past the last "
                        "record read (%s): markers or a compacted tail with no records in them, or "
                        "records not fetched for %.0f s; a resume reads on from the checkpoint",
                        ", ".join(f"{n}: read to {a}, watermark {b}" for n, (a, b) in sorted(behind.items())),
                        waited_s + self.options.stop_when_idle_s)
        return False

    def snapshot(self) -> KafkaPositions:
        """Resume positions after the last row `read` returned, for owned partitions."""
        return KafkaPositions(self._book.returned)

    def trained(self, batch: Batch) -> KafkaPositions:
        """Report `batch` (rows this source returned, in order) as trained; returns
        the positions to checkpoint (every owned partition after its last trained row)."""
        self._book.advance(self._book.trained, batch)
        self._book.forget_trained_messages()
        return self._book.checkpoint_positions()

    @property
    def peers_wanted(self) -> bool:
        """A distributed rank's source holds newly assigned partitions paused until
        `give_peer_positions` (the job's next step exchanges them)."""
        return self._wait_for_peers and bool(self._unpositioned) and self._peers_at < self._assignments

    def handover_positions(self) -> KafkaPositions:
        """Where this source left the partitions it gave up in this run (for the job's
        exchange: their next owner may be another rank)."""
        return KafkaPositions(self._book.released, frozenset(self._book.released))

    def give_peer_positions(self, every_rank: list[KafkaPositions]) -> None:
        """Every rank's `handover_positions`: a partition assigned here starts no
        earlier than where any rank of this run left it, even if that rank's commit on
        revocation failed (or, on a resume, the checkpoint is older). Positions the
        paused partitions (blocking calls: call it on the caller's thread)."""
        furthest = KafkaPositions.furthest([KafkaPositions(self._peer), *every_rank])
        self._peer = dict(furthest.partitions)
        self._peers_at = self._assignments
        # (With a poll in flight the consumer is not this thread's: the poll's end positions them.)
        if self._unpositioned and self._in_flight is None and self._revocation is None:
            self._position_new_partitions()

    @property
    def trained_positions(self) -> KafkaPositions:
        """Positions after everything reported trained: owned partitions, plus the
        ones given up, marked so (see `PositionBook.released`)."""
        return self._book.checkpoint_positions()

    def owned_rows(self, batch: Batch) -> Batch:
        """`batch` without the rows of partitions this source no longer owns."""
        gone = set(batch.partitions) - set(self._book.trained)
        return filter_partitions(batch, gone) if gone else batch

    def commit(self, positions: KafkaPositions) -> bool:
        """Commit `positions` of owned partitions as the group's offsets; blocks,
        retrying for up to `options.commit_timeout_s`.  False if it did not succeed
        (logged; the checkpoint still holds the truth, the next commit catches up).
        While a poll is still in flight (a group join that outlasted a read) the commit
        waits for it: it is made, with the latest positions asked for, right after that
        poll returns; then it returns False."""
        from kafka.errors import CommitFailedError, KafkaError
        if self._in_flight is not None or self._revocation is not None:
            self._deferred_commit = positions
            return False
        self._deferred_commit = None
        # A partition the broker no longer lists would be retried for commit_timeout_s.
        offsets = self._offsets({n: p for n, p in positions.partitions.items() if n not in self._missing})
        if not offsets:
            return True
        deadline = time.monotonic() + self.options.commit_timeout_s
        delay = 0.2
        while True:
            try:
                self._consumer.commit(offsets, timeout_ms=int(self.options.commit_timeout_s * 1000))
                self.stats.commits += 1
                return True
            except CommitFailedError as e:      # not a member right now (a rebalance, a lost group)
                log.warning("kafka: group commit refused (%s); the group is rebalancing, a "
                            "revocation or the next checkpoint commits", e)
                break
            except KafkaError as e:
                if time.monotonic() + delay > deadline:
                    log.warning("kafka: could not commit group offsets for %.0f s (%s); the "
                                "checkpoint holds them, the next commit catches up",
                                self.options.commit_timeout_s, e)
                    break
                time.sleep(delay)
                delay = min(delay * 2, self.options.reconnect_backoff_max_s)
        self.stats.commit_failures += 1
        return False

    def lag(self) -> dict[str, int]:
        """Per owned partition: records on the broker not yet trained -- the partition's
        high watermark as the last fetch response reported it, minus the trained
        offset -- and never less than the records fetched but not yet trained.

        The watermark comes with every fetch response (no extra request; the
        ListOffsets answer is wrong on some brokers, tansu among them). While the
        partitions are paused (backpressure) it is the last one seen, so the lag
        shown is then a lower bound."""
        trained, fetched = dict(self._book.trained), dict(self._book.fetch_next)   # maybe a scrape thread
        high = dict(self._highwater)
        self.stats.lag = {n: max(0, fetched.get(n, off) - off, high.get(n, off) - off)
                          for n, (off, _) in trained.items()}
        return self.stats.lag

    def close(self) -> None:
        """Leave the group without committing (commits follow checkpoints only; one
        deferred by a poll in flight is made first).  A poll still in flight is waited
        for up to `CLOSE_WAIT_S`; if it does not return, the consumer is left as it is
        (the group drops this member after kafka.session_timeout_ms)."""
        try:
            if self._consumer is not None:
                self._close_consumer()
        finally:
            if self._consumer is not None:
                self._poller.stop()
                self._consumer = None
            self._decoder.shutdown(wait=True, cancel_futures=True)
            self._decoding.clear()

    def _close_consumer(self) -> None:
        self._closing = True
        if self._revocation is not None:    # taken in but never checkpointed: no commit
            self.acknowledge(durable=False)
        if not self._settle_poll(CLOSE_WAIT_S):
            log.warning("kafka: the consumer is still inside a poll after %.0f s (a group join "
                        "the broker does not complete?); leaving it without closing: the group "
                        "drops this member after kafka.session_timeout_ms", CLOSE_WAIT_S)
            if self._deferred_commit is not None:
                log.warning("kafka: the last checkpoint's offsets were not committed to the group "
                            "(the consumer was inside that poll); a restart resumes from the "
                            "checkpoint, which holds them")
            return
        if self._deferred_commit is not None:
            self.commit(self._deferred_commit)
        # A member still joining cannot leave before the broker ends its join: the
        # LeaveGroup queues behind the JoinGroup the broker holds on the same connection
        # (tansu admits a member only after half the session timeout).  Waiting for it
        # made a stop during a join take up to that long; see LEAVE_WHILE_JOINING_S.
        timeout_ms = None if self._joined else int(LEAVE_WHILE_JOINING_S * 1000)
        try:
            self._consumer.close(autocommit=False, timeout_ms=timeout_ms)
        except Exception as e:          # the broker may be gone; nothing to lose here
            log.warning("kafka: consumer close: %s", e)

    def __enter__(self) -> "KafkaSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- fetching ------------------------------------------------------------
    def _poll(self, rows_missing: int, prefetch: bool = False) -> int:
        """One consumer poll, on the poll thread; the records go to the decode worker.
        Returns the number of messages accepted.  It waits (up to
        `options.poll_timeout_s`, plus `POLL_GRACE_S`) only when rows are missing; a
        `prefetch` poll waits `_PREFETCH_WAIT_S`.  A poll still in flight from an
        earlier call is waited for instead of a new one; meanwhile the rebalance
        listener's calls run here.  A revocation taken meanwhile returns 0 at once:
        the caller takes it in (`revocation`, `acknowledge`) before anything else."""
        if self._revocation is not None:
            return 0
        wait = rows_missing > 0 and not prefetch
        timeout_s = _PREFETCH_WAIT_S if prefetch else self.options.poll_timeout_s if wait else 0
        budget_s = timeout_s
        if self._in_flight is None:
            rows = max(rows_missing, self.chunk_records)
            max_messages = max(1, min(self.options.max_poll_records,
                                      int(rows / max(self._rows_per_message, 1.0)) + 1))
            self._in_flight = self._poller.submit(int(timeout_s * 1000), max_messages)
            self._in_flight_since, self._in_flight_waits = time.monotonic(), wait
            self._in_flight.add_done_callback(self._notify)
            budget_s += POLL_GRACE_S
        waited = self._in_flight_waits
        fetched = self._await_poll(budget_s)
        error = self.take_listener_error()
        if error is not None:
            raise error
        now = time.monotonic()
        self._notice_waits(now)
        if fetched is None:
            return 0
        if self._watch.in_outage:       # what the broker listed before it went away says nothing now
            self._missing, self._missing_since = set(), None
        elif now >= self._next_stream_check:
            self._next_stream_check = now + PROBE_EVERY_S
            self._check_streams(now)
        return self._after_poll(fetched, waited)

    def _notice_waits(self, now: float) -> None:
        """One line for a first assignment slow to come, and one for a poll stuck at the broker."""
        if self._join_wait_since is not None and now - self._join_wait_since >= JOIN_NOTICE_S:
            waited, self._join_wait_since = now - self._join_wait_since, None
            log.warning("kafka: waiting for group %r to assign partitions (%.0f s so far): a member "
                        "that did not leave the group, such as this trainer's previous process if "
                        "it was killed, holds them until the broker drops it, up to "
                        "kafka.session_timeout_ms (%.0f s; tansu also takes half of that to admit "
                        "any member). A trainer stopped by SIGTERM or Ctrl-C leaves the group, so "
                        "its restart does not wait for it", self.options.group, waited,
                        self.options.session_timeout_ms / 1000)
        if self._in_flight is None:
            self._said_stuck = False
        elif not self._said_stuck and now - self._in_flight_since >= STUCK_POLL_NOTICE_S:
            self._said_stuck = True
            log.warning("kafka: the consumer's poll has not returned for %.0f s: most likely the "
                        "group coordinator on %s does not complete this member's join (a broker "
                        "problem; kafka.session_timeout_ms is %.0f s). The trainer keeps what it "
                        "trained and can be stopped as usual; a restart resumes from its checkpoint",
                        now - self._in_flight_since, self.options.bootstrap,
                        self.options.session_timeout_ms / 1000)

    def _await_poll(self, budget_s: float) -> dict | None:
        """The records of the poll in flight, once it returns within `budget_s`; None
        if it has not (it goes on) or if the listener took a revocation meanwhile.
        Runs the listener's calls while it waits."""
        deadline = time.monotonic() + budget_s
        while True:
            self._service()
            if self._revocation is not None:
                return None
            future = self._in_flight
            if future.done():
                self._in_flight = None
                return self._poll_result(future)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            with self._wake:
                if self._calls.empty() and not future.done():
                    self._wake.wait(remaining)

    def _poll_result(self, future: Future) -> dict:
        from kafka.errors import KafkaError
        try:
            return future.result()
        except KafkaError as e:
            if not getattr(e, "retriable", False) and "Authentication" in type(e).__name__:
                raise SourceError(f"kafka: {self.url.text}: authentication failed: {e}") from None
            if self._listener_error is None and not self._closing:
                log.warning("kafka: poll failed (%s); retrying", e)
            return {}

    def _settle_poll(self, budget_s: float) -> bool:
        """Closing: wait up to `budget_s` for the poll in flight (its records are
        dropped: nothing after the checkpoint is lost, a restart reads them again);
        True if none is in flight any more."""
        deadline = time.monotonic() + budget_s
        while self._in_flight is not None:
            if self._revocation is not None:
                self.acknowledge(durable=False)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                self._await_poll(remaining)
            except Exception as e:      # noqa: BLE001 - closing: the poll's records are dropped anyway
                log.warning("kafka: the last poll failed while closing: %s: %s", type(e).__name__, e)
        return True

    def listener_failed(self, error: BaseException) -> None:
        """The rebalance listener's error, raised from the next `read()` (any thread; the
        first one is kept: a later one is a consequence)."""
        with self._error_lock:
            if self._listener_error is None:
                self._listener_error = error

    def take_listener_error(self) -> BaseException | None:
        with self._error_lock:
            error, self._listener_error = self._listener_error, None
        return error

    def _notify(self, _future: Future | None = None) -> None:
        with self._wake:
            self._wake.notify_all()

    def _service(self) -> None:
        """Run the calls the rebalance listener handed to this thread."""
        while True:
            try:
                fn, args, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:      # noqa: BLE001 - the listener hands it back
                    future.set_exception(e)

    def _listener_call(self, fn: Callable, *args):
        """Run `fn(*args)` for the rebalance listener on the source's own thread (it
        waits for the poll there, or next polls within one train step) and return its
        result.  Directly when the listener runs on that thread (librdkafka's close) or
        the source is closing (its thread may no longer serve calls)."""
        if self._closing or threading.get_ident() == self._owner:
            return fn(*args)
        future: Future = Future()
        self._calls.put((fn, args, future))
        self._notify()
        return future.result()

    def _after_poll(self, fetched: dict, waited: bool) -> int:
        """Position new partitions, accept the records, account for idleness and
        backpressure, make a commit deferred while the poll was in flight."""
        if self._unpositioned:
            self._position_new_partitions()
        self._check_log_ends()
        n = self._accept(fetched)
        now = time.monotonic()
        if n:
            self._idle_since = now
            self._watch.records_arrived(now)
        elif waited and self._watch.nothing_arrived(self._consumer, self._book.owned(), now):
            self._idle_since = now
        self._apply_backpressure()
        if self._deferred_commit is not None:
            self.commit(self._deferred_commit)
        return n

    def _accept(self, fetched: dict) -> int:
        """Hand the polled records of owned, positioned partitions to the decode worker;
        returns their count."""
        names, values, offsets, times, parts = [], [], [], [], []
        for tp, records in sorted(fetched.items()):
            name = partition_name(tp.topic, tp.partition)
            high = self._consumer.highwater(tp) if name in self._book.trained else None
            if high is not None:
                self._highwater[name] = high
            if name not in self._book.trained or name in self._unpositioned or not records:
                continue                    # revoked meanwhile, or not positioned yet
            offs = np.fromiter(map(_OFFSET, records), dtype=np.int64, count=len(records))
            first = int(np.searchsorted(offs, self._book.fetch_next[name]))
            if first:                       # already fetched once: never return a record twice
                records, offs = records[first:], offs[first:]
            if not len(offs):
                continue
            self._fresh.discard(name)
            names.append(name)
            parts.append(np.full(len(offs), len(names) - 1, dtype=np.int32))
            values.extend(map(_VALUE, records))
            offsets.append(offs)
            times.append(np.fromiter(map(_TIMESTAMP, records), dtype=np.int64, count=len(records)))
        if not names:
            return 0
        msg_partition, msg_offset, msg_time = np.concatenate(parts), np.concatenate(offsets), np.concatenate(times)
        if len(names) > 1:
            values, msg_partition, msg_offset, msg_time = event_order(values, msg_partition,
                                                                       msg_offset, msg_time)
        for name, offs in zip(names, offsets):
            self._book.fetch_next[name] = int(offs[-1]) + 1     # the next poll's duplicates
        future = self._decoder.submit(decode_messages, values, msg_partition, msg_offset, msg_time,
                                      tuple(names), self.fmt, self.options.value_format)
        self._decoding.append(_Decoding(future, names, msg_partition, msg_offset, len(values),
                                        int(len(values) * self._rows_per_message)))
        self.stats.messages += len(values)
        self.stats.bytes += sum(map(len, filter(None, values)))    # a tombstone's value is None
        return len(values)

    def _rows_decoding(self) -> int:
        return sum(d.rows_estimate for d in self._decoding)

    def _collect(self, want: int) -> None:
        """Take decoded runs into the buffer, oldest first, while fewer than `want`
        rows are buffered, waiting for them if need be.  While the oldest is still
        decoding and fewer than 2 * `want` rows are in sight, poll for the next run
        first: that fetching (the poll thread) overlaps the decoding (the worker).  Runs
        beyond `want` stay queued, so the next read() finds them without waiting on
        the broker.  A poll may run the rebalance listener, which takes every run in
        itself; so the queue is looked at afresh after each."""
        prefetch = not self._closing
        while self._decoding and self._buffered < want:
            in_sight = self._buffered + self._rows_decoding()
            if prefetch and in_sight < 2 * want and not self._decoding[0].future.done():
                prefetch = self._poll(2 * want - in_sight, prefetch=True) > 0
                continue
            self._take_in(self._decoding.popleft())

    def _take_in(self, run: _Decoding) -> None:
        """Put a decoded run into the buffer (on the source's own thread, where the
        listener's calls run too)."""
        decoded = run.future.result()
        names, msg_partition, msg_offset = run.names, run.msg_partition, run.msg_offset
        for index, name in enumerate(names):
            mine = msg_partition == index
            self._book.note_message_rows(name, msg_offset[mine], decoded.rows_per_message[mine])
        rejected = decoded.rejected
        skipped = {name: pos for name, pos in self._book.skip.items() if name in names}
        if skipped:   # resuming inside a packed message: its bad lines were dead-lettered already
            rejected = [r for r in rejected if r.partition not in skipped or skipped[r.partition].offset != r.offset]
        batch = self._book.drop_skipped(decoded.batch)
        self._rejected.extend(rejected)
        if len(batch):
            self._buffer.append(batch)
            self._buffered += len(batch)
        self._rows_per_message = 0.8 * self._rows_per_message + 0.2 * max(
            1.0, (len(decoded.batch) + len(decoded.rejected)) / run.n_messages)

    def _take(self, want: int) -> Batch:
        """Pop up to `want` buffered rows, oldest first."""
        if not self._buffered:
            return Batch.empty(self.fmt.n_keys, self.fmt.n_dense, (), self.fmt.pooling)
        pieces, n = [], 0
        while self._buffer and n < want:
            head = self._buffer.popleft()
            if n + len(head) > want:
                cut = want - n
                self._buffer.appendleft(head.slice(cut, len(head)))
                head = head.slice(0, cut)
            pieces.append(head)
            n += len(head)
        self._buffered -= n
        batch = pieces[0] if len(pieces) == 1 else Batch.concat(pieces)
        self._book.advance(self._book.returned, batch)
        self.stats.records += n
        return batch

    def _apply_backpressure(self) -> None:
        limit = self.options.max_buffered_records
        rows = self._buffered + self._rows_decoding()
        if not self._backpressure and rows > limit:
            self._backpressure = True
        elif self._backpressure and rows < limit // 2:
            self._backpressure = False
        else:
            return
        tps = [_tp(n) for n in self._book.owned() if n not in self._unpositioned]
        (self._consumer.pause if self._backpressure else self._consumer.resume)(*tps)
        self.stats.paused = self._backpressure

    # -- rebalances (the listener's calls, run on the source's thread: `_listener_call`) ----
    def _on_revoked(self, tps: set, lost: bool) -> tuple[dict, Future | None]:
        """Give up `tps` (on the source's thread); returns the offsets to commit for them
        (none if lost) and, when revocations are held, the future `acknowledge`
        resolves (True: commit them)."""
        names = sorted(partition_name(tp.topic, tp.partition) for tp in tps)
        if not names or self._closing:
            return {}, None
        self.stats.rebalances += 1
        self._joined = False                # not idle while the group rebalances
        self._unassigned_since = self._unassigned_since or time.monotonic()
        while self._decoding:               # as if decoded synchronously: take them in first
            self._take_in(self._decoding.popleft())
        gone = set(names)
        self._buffer = deque(b for b in (filter_partitions(b, gone) for b in self._buffer) if len(b))
        self._buffered = sum(map(len, self._buffer))
        self._unpositioned -= gone
        positions = self._book.release(names)     # checkpoints keep them from here on
        for name in names:
            self._highwater.pop(name, None)
        self._fresh -= gone
        log.info("kafka: partitions %s %s", ", ".join(names),
                 "lost (group membership expired)" if lost else "revoked by a rebalance")
        offsets = {} if lost else self._offsets({n: p for n, p in positions.items() if n not in self._missing},
                                                owned_only=False)
        if not self._hold_revocations:
            return offsets, None
        self._revocation, self._ack = Revocation(tuple(names), lost), Future()
        return offsets, self._ack

    @property
    def revocation(self) -> Revocation | None:
        """The revocation a poll took since the last `acknowledge` (its rows are gone
        from this source); the group's rebalance waits for its acknowledgement."""
        return self._revocation

    def acknowledge(self, durable: bool) -> None:
        """The caller has taken `revocation` in (dropped the rows of those partitions
        it holds) and, if `durable`, made what it trained from them durable: the
        listener then commits their offsets (not for a lost membership) and the
        rebalance goes on.  Returns at once; the next read waits for the poll."""
        ack, self._revocation, self._ack = self._ack, None, None
        if ack is not None:
            ack.set_result(durable)

    def _on_assigned(self, tps: set) -> None:
        names = {partition_name(tp.topic, tp.partition) for tp in tps}
        self._join_wait_since = None
        self._next_stream_check = 0.0       # a changed topic makes the group rebalance: look now
        self._unpositioned |= names - set(self._book.owned())
        if tps:
            self._assignments += 1
            log.info("kafka: assigned %s", ", ".join(sorted(names)))
        else:
            self._initial = {}              # the checkpoint's positions serve the first assignment only
        self._joined = True
        self._unassigned_since = None
        self._idle_since = time.monotonic()

    @property
    def unassigned_s(self) -> float | None:
        """How long this member has been waiting for the group to assign it partitions (a
        first join, or a rebalance since a revocation); None once it has an assignment,
        even an empty one.  `options.stop_when_idle_s` does not count this wait: records
        may be waiting in the topic for the group, the stream is not idle."""
        since = self._unassigned_since
        return None if since is None else time.monotonic() - since

    def _position_new_partitions(self) -> None:
        """Seek newly assigned partitions (on the caller's thread: blocking calls are allowed)."""
        from kafka.errors import KafkaError
        if self.peers_wanted:               # paused until the job's next exchange
            return
        if self._missing & self._unpositioned:
            return      # deleted? `_check_streams` decides; asking for their offsets would block
        names = sorted(self._unpositioned)
        try:
            committed = {n: self._consumer.committed(_tp(n), metadata=True) for n in names}
            starts = self._start_positions([n for n in names if committed[n] is None
                                            and n not in self._initial and n not in self._book.released])
        except KafkaError as e:
            # The checkpoint is the truth: when the broker cannot tell the group's offsets
            # for longer than a commit may take (seen: tansu with a stored offset a killed
            # broker left empty), partitions this trainer has its own position for go on
            # from it rather than waiting forever.
            now = time.monotonic()
            self._offsets_unreadable_since = self._offsets_unreadable_since or now
            own = all(n in self._initial or n in self._book.released for n in names)
            if not own or now - self._offsets_unreadable_since < self.options.commit_timeout_s:
                log.warning("kafka: cannot position %s yet (%s); retrying", ", ".join(names), e)
                return
            log.warning("kafka: the group's offsets of %s are unreadable for %.0f s (%s); going on "
                        "from this trainer's own positions (its checkpoint's)", ", ".join(names),
                        now - self._offsets_unreadable_since, e)
            committed, starts = {n: None for n in names}, {}
        self._offsets_unreadable_since = None
        for name in names:
            c = committed[name]
            group = (PartitionPosition(c.offset, parse_commit_metadata(c.metadata))
                     if c is not None and c.offset >= 0 else None)
            position = self._choose_position(name, group, starts.get(name))
            self._book.own(name, position)
            self._consumer.seek(_tp(name), position.offset)
            self._fresh.add(name)
        self._initial = {}
        self._unpositioned.clear()
        if not self._backpressure:
            self._consumer.resume(*[_tp(n) for n in names])
        self._idle_since = time.monotonic()

    def _check_log_ends(self) -> None:
        """A partition positioned in this process (from a checkpoint, the group or a peer)
        that has delivered nothing since, whose end as the last fetch answer gave it is
        before its position: the topic was deleted and recreated (what `StreamGone`
        advises), or truncated. A broker answers such a position out of range (the
        client then reads from the log's start: records all below the position, which
        were dropped as ones already read) or with nothing (tansu): either way the new
        log was never trained, silently. It is read from its first offset instead, and a
        warning says so. The ListOffsets end must agree (a deleted topic's fetch answers
        end at 0 too; `StreamGone` handles those). Not checked once a partition has
        delivered: a topic recreated under a running trainer is first a deleted one."""
        from kafka.errors import KafkaError
        for name in sorted(self._fresh - self._unpositioned - self._missing):
            tp = _tp(name)
            high, old = self._consumer.highwater(tp), self._book.fetch_next.get(name)
            if high is None or old is None or high >= old:
                continue
            now = time.monotonic()
            if now - self._ends_asked_at.get(name, -PROBE_EVERY_S) < PROBE_EVERY_S:
                continue                    # (a broker that cannot answer is not asked every poll)
            self._ends_asked_at[name] = now
            try:
                end = self._consumer.end_offsets([tp], timeout_ms=5000).get(tp)
                start = int(self._consumer.beginning_offsets([tp], timeout_ms=5000).get(tp) or 0)
            except KafkaError:
                continue                    # asked again after PROBE_EVERY_S
            if end is None or end >= old:
                continue
            self._consumer.seek(tp, start)
            self._book.own(name, PartitionPosition(start, 0))
            log.warning("kafka: partition %s ends at offset %d, before this run's position %d: the "
                        "topic was deleted and recreated (or truncated); reading it from its first "
                        "offset %d, as records new to this model", name, high, old, start)

    # -- deleted topics (see connectors/kafka/client.py) -------------------------
    def _check_streams(self, now: float, fresh: bool = False) -> bool:
        """Whether the broker's metadata lists every partition this source reads
        (False also when the broker cannot answer).  One missing for
        `TOPIC_GONE_AFTER_S` raises `StreamGone`; until then it is logged once and
        left alone (not positioned, not committed)."""
        from kafka.errors import KafkaError
        names = set(self.partition_names) | set(self._book.owned()) | self._unpositioned
        try:
            missing, what = missing_partitions(self._consumer, names, fresh)
        except KafkaError:
            return False
        self._missing = missing
        if not missing:
            if fresh:
                self._all_listed_at = now
            if self._missing_since is not None:
                log.warning("kafka: the broker lists every partition again after %.1f s; training "
                            "continues", now - self._missing_since)
            self._missing_since = None
            return True
        if self._missing_since is None:
            self._missing_since = now
            log.warning("kafka: %s (the broker's metadata no longer lists it); the run stops in "
                        "%.0f s unless it comes back", what, TOPIC_GONE_AFTER_S)
        elif now - self._missing_since >= TOPIC_GONE_AFTER_S:
            raise StreamGone(what)
        return False

    def _choose_position(self, name: str, group: PartitionPosition | None,
                         start: PartitionPosition | None) -> PartitionPosition:
        if name in self._initial:
            position = self._initial[name]
            if group is not None and group > position:
                log.warning("kafka: %s: the group's committed offset %d is past this checkpoint's "
                            "%d (another member trained those records, or this checkpoint is "
                            "older); resuming at the checkpoint", name, group.offset, position.offset)
            how = "checkpoint"
        elif name in self._book.released:
            position, how = max(self._book.released[name], group or PartitionPosition(-1)), "own last position"
        elif group is not None:
            position, how = group, "group offset"
        else:
            position, how = start or PartitionPosition(0), f"start={self.options.start}"
        peer = self._peer.get(name)
        if peer is not None and peer > position:
            position, how = peer, "where another rank of this job left it"
        log.info("kafka: %s starts at offset %d (%s)", name, position.offset, how)
        return position

    def _start_positions(self, names: list[str]) -> dict[str, PartitionPosition]:
        if not names:
            return {}
        tps = [_tp(n) for n in names]
        timestamp = start_timestamp_ms(self.options.start)
        if timestamp is not None:
            found = self._consumer.offsets_for_times({tp: timestamp for tp in tps})
            ends = self._consumer.end_offsets([tp for tp in tps if found.get(tp) is None])
            return {n: PartitionPosition(found[tp].offset if found.get(tp) else ends[tp])
                    for n, tp in zip(names, tps)}
        edge = (self._consumer.beginning_offsets if self.options.start == "earliest"
                else self._consumer.end_offsets)(tps)
        return {n: PartitionPosition(edge[tp]) for n, tp in zip(names, tps)}

    def _offsets(self, positions: dict[str, PartitionPosition], owned_only: bool = True) -> dict:
        """The group commit of `positions`: {kafka.TopicPartition: OffsetAndMetadata} (the
        next offset to read; `rows_done` in the metadata), for both clients."""
        from kafka.structs import OffsetAndMetadata
        return {_tp(n): OffsetAndMetadata(off, commit_metadata(done), -1)
                for n, (off, done) in positions.items() if not owned_only or n in self._book.trained}

