"""The consumer-group rebalance listener of `KafkaSource`.

kafka-python (3.x) runs it on its IO thread (``kafka-io-*``) while the
source's caller is blocked inside ``poll()``, which waits for the group-join
coroutine that awaits these methods; so it may touch the source and the
trainer's state (no train step runs meanwhile) but must not call a blocking
consumer API: the revocation commit is awaited through the asynchronous one.
The confluent backend drives the same methods on the polling thread itself,
inside ``poll()`` (`confluent._drive`).  An error in
the trainer's hook (say a checkpoint that cannot be written) is handed back
to the caller's thread and raised from ``read()``, never swallowed.
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
    _listener_error: BaseException | None
    stats: Any

    def _on_revoked(self, partitions: set, lost: bool) -> dict: ...
    def _on_assigned(self, partitions: set) -> None: ...


class Listener(AsyncConsumerRebalanceListener):
    def __init__(self, source: RebalanceOwner) -> None:
        self._source = source

    async def on_partitions_revoked(self, revoked: set) -> None:
        source = self._source
        try:
            offsets = source._on_revoked(revoked, lost=False)
        except BaseException as e:          # noqa: BLE001 - re-raised on the caller's thread
            source._listener_error = e
            return
        if not offsets:
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
        try:
            self._source._on_revoked(lost, lost=True)
        except BaseException as e:          # noqa: BLE001
            self._source._listener_error = e

    async def on_partitions_assigned(self, assigned: set) -> None:
        try:
            self._source._on_assigned(assigned)
        except BaseException as e:          # noqa: BLE001
            self._source._listener_error = e
