"""Where a run's batches come from, and how it is told to stop.

`micro_batches` cuts a file source into full batches (dead-lettering its bad
lines in step); `dead_letter_or_stop` is a stream's dead-letter write that a
stop can end; `LookAhead` holds the next batch so a tiered store can prefetch
its rows; `StopSignal` turns SIGTERM / Ctrl-C into a request to finish the
batch, checkpoint and exit. Kafka sources have their own batchers
(`streaming`, `offset_batches`); `inputs` puts either kind behind one protocol.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Iterator

from stream_ctr.connectors.batch import Batch, Rejected
from stream_ctr.connectors.dead_letter import DeadLetterFile
from stream_ctr.connectors.files import FileSource
from stream_ctr.connectors.kafka.positions import filter_partitions
from stream_ctr.connectors.kafka.sink import DeadLetterUnsent
from stream_ctr.telemetry.monitor import RunMonitor
from stream_ctr.train.batcher import MicroBatcher

log = logging.getLogger("stream_ctr.train")


def micro_batches(source: FileSource, batch_size: int, dead_letter: DeadLetterFile,
                  limit_records: int = -1, monitor: RunMonitor | None = None) -> Iterator[Batch]:
    """Full batches from `source` (the last one may be partial); at most
    `limit_records` rows when it is >= 0. Each chunk read is reported to `monitor`.

    A rejected line is dead-lettered just before the first batch after it is
    yielded (or at the end of the file), not when its chunk is read: a run that
    stops at a limit or a signal leaves the lines after its resume point for the
    resumed run, bad ones included, so none is dead-lettered twice (with a tiered
    store's look-ahead, the bad lines before the batch read ahead may be)."""
    batcher = MicroBatcher(batch_size)
    emitted = 0
    waiting: list[Rejected] = []        # read, in line order, not dead-lettered yet

    def dead_letter_up_to(batch: Batch) -> None:
        nonlocal waiting
        last = int(batch.offset[-1]) if len(batch) else -1
        due = [r for r in waiting if r.offset < last]
        waiting = waiting[len(due):]
        dead_letter.write(due)

    while not source.exhausted:
        t0 = time.perf_counter()
        chunk, rejected = source.read()
        if monitor is not None:
            monitor.on_read(chunk, rejected, time.perf_counter() - t0)
        waiting += rejected
        for batch in batcher.add(chunk):
            if 0 <= limit_records <= emitted + len(batch):
                batch = batch.slice(0, limit_records - emitted)
                dead_letter_up_to(batch)
                yield batch
                return
            emitted += len(batch)
            dead_letter_up_to(batch)
            yield batch
    rest = batcher.flush()
    if rest is not None and 0 <= limit_records < emitted + len(rest):
        rest = rest.slice(0, limit_records - emitted)      # the limit cuts the file's tail
        dead_letter_up_to(rest)
    else:
        dead_letter.write(waiting)          # every line of the file was read: all are due
    if rest is not None:
        yield rest


class LookAhead:
    """The batch read ahead of the one training, so a tiered store can prefetch its rows.

    That batch is read but not trained, so a rebalance during the read after it
    must drop its rows of the revoked partitions (`discard`, from the source's
    listener) -- even if the same partitions come straight back to this member:
    they then continue at their trained position, and those rows are read again.
    """

    def __init__(self) -> None:
        self._held: Batch | None = None

    def swap(self, batch: Batch | None) -> Batch | None:
        """Hold `batch` (None at the end); return the batch held until now."""
        held, self._held = self._held, batch
        return held

    def discard(self, partitions: list[str]) -> None:
        if self._held is not None:
            self._held = filter_partitions(self._held, set(partitions))


def dead_letter_or_stop(dead_letter, rejected: list[Rejected], stop: "StopSignal") -> bool:
    """Dead-letter `rejected`; False when a stop came while the dead-letter topic's
    broker did not answer. The caller then trains nothing more: its checkpoint
    stays before those records, and a resumed run reads them again. Without
    this, a SIGTERM to a trainer whose broker is gone waited forever."""
    try:
        dead_letter.write(rejected, stop)
        return True
    except DeadLetterUnsent as e:
        log.warning("%s", e)
        return False


class StopSignal:
    """SIGTERM / Ctrl-C ask the loop to finish its batch, checkpoint and exit."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: object) -> None:
        if self.requested:              # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
