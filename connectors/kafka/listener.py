"""The consumer-group rebalance listener of `KafkaSource`.

kafka-python (3.x) runs it on its IO thread (``kafka-io-*``), inside the
``poll()`` the source's poll thread makes; the confluent backend drives the same
methods on that poll thread itself, inside ``poll()`` (`confluent._drive`).
Whatever it does to the source runs on the source's own thread
(`KafkaSource._listener_call`), and a revocation waits for the trainer's
acknowledgement before its offsets are committed; the commit is awaited through
the asynchronous API (a blocking consumer call here would wait for this very IO
thread).  An error the listener meets (say a commit the broker refuses) is
handed to the source (`listener_failed`) and raised from its next ``read()``,
never swallowed; a checkpoint that cannot be written reaches the listener as
``acknowledge(durable=False)``: nothing is committed.
"""
from __future__ import annotations

import logging
from typing import Any, Protocol

from kafka import AsyncConsumerRebalanceListener

log = logging.getLogger("stream_ctr.connectors.kafka")


class RebalanceOwner(Protocol):
    """What the listener needs of its `KafkaSource` (declared here so that this
    module does not import the source that imports it)."""
    _consumer: Any
    stats: Any

    def listener_failed(self, error: BaseException) -> None: ...
    def _on_revoked(self, partitions: set, lost: bool) -> tuple[dict, Any]: ...
    def _on_assigned(self, partitions: set) -> None: ...
    def _listener_call(self, fn: Any, *args: Any) -> Any: ...


class Listener(AsyncConsumerRebalanceListener):
    def __init__(self, source: RebalanceOwner) -> None:
        self._source = source

    async def on_partitions_revoked(self, revoked: set) -> None:
        source = self._source
        try:
            offsets, ack = source._listener_call(source._on_revoked, revoked, False)
            # The trainer takes the revocation in and checkpoints; only then commit.
            durable = ack is None or ack.result()
        except BaseException as e:          # noqa: BLE001 - re-raised on the caller's thread
            source.listener_failed(e)
            return
        if not offsets or not durable:
            return
        try:
            # Before this returns, the group cannot give these partitions to
            # another member: the next owner starts exactly here.
            await source._consumer.commit_async(offsets)
            source.stats.commits += 1
        except Exception as e:              # noqa: BLE001 - logged; checkpoints keep the positions
            source.stats.commit_failures += 1
            log.warning("kafka: commit on revocation failed (%s); the next owner of %s may "
                        "re-read records this trainer already trained",
                        e, ", ".join(sorted(f"{tp.topic}/{tp.partition}" for tp in offsets)))

    async def on_partitions_lost(self, lost: set) -> None:
        source = self._source
        try:
            _, ack = source._listener_call(source._on_revoked, lost, True)
            if ack is not None:
                ack.result()
        except BaseException as e:          # noqa: BLE001
            source.listener_failed(e)

    async def on_partitions_assigned(self, assigned: set) -> None:
        source = self._source
        try:
            if assigned:    # nothing is fetched before the source positions it (a consumer call:
                source._consumer.pause(*assigned)   # on this thread, librdkafka's callback holds its lock)
            source._listener_call(source._on_assigned, assigned)
        except BaseException as e:          # noqa: BLE001
            self._source.listener_failed(e)
