"""Stream micro-batches whose composition is a function of offsets alone (`kafka.deterministic_batches`).

Why: the default stream batcher cuts batches out of the rows in the order the
consumer fetched them, and fetch order interleaves partitions differently in
every run; a resumed run then trains other batches and ends with another
model.  Here each batch takes a fixed share of rows from every partition of
the topics, in offset order, so a re-run or a run resumed from any checkpoint
trains the same batches and ends with the same model, bit for bit.

The plan.  Partitions are ordered by (topic, partition number).  Batch number
``k`` (the records trained before it, divided by the batch size) takes
`allocate(batch_size, ...)` rows: ``batch_size // n`` from each of the ``n``
partitions, one more from ``batch_size % n`` of them, starting at partition
``k % n`` (so no partition runs ahead).  The rows of a batch are its
partitions' rows one partition after the other, each in offset order.
Every partition of the topics counts, owned or not: a batcher whose group
member lost a partition to another member waits for it (deterministic
batching is for one consumer per group; a distributed job ignores the flag).

Cuts.  A batch that cannot follow the plan -- a partition has no rows within
the latency budget (`data.max_batch_delay_s`), the stream went idle
(`--stop-when-idle`, the tail), or `--limit` ends the run inside
a batch -- takes what is there (`allocate` over the rows available) and is
*recorded* before it trains: one JSON line in ``RUN_DIR/batch_cuts.jsonl``
(the records trained before it, the rows per partition, each partition's
first offset).  A run resumed from a checkpoint replays the cuts recorded
after that checkpoint, waiting for the rows each needs, so even those batches
come out the same.  The journal is written without fsync: it survives a
killed process, not a machine that loses its page cache (the resumed run then
cuts afresh: still every record once, no longer the same batches).

What survives a crash: the checkpoint's positions (where every partition
resumes) and the journal; rows pending here are read again.  On a rebalance
(kafka-python and librdkafka revoke every partition: eager assignment) the
pending rows of the revoked partitions are dropped and read again from the
trained positions, so the plan goes on where training stood.
"""
from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from stream_ctr.connectors.batch import Batch
from stream_ctr.connectors.kafka.options import split_partition_name
from stream_ctr.train.batches import dead_letter_or_stop
from stream_ctr.train.events import IDLE, Idle

if TYPE_CHECKING:
    from stream_ctr.connectors.kafka.source import KafkaSource
    from stream_ctr.train.batches import StopSignal

log = logging.getLogger("stream_ctr.train")
JOURNAL_NAME = "batch_cuts.jsonl"


def allocate(batch_size: int, available: list[int], first: int = 0) -> list[int]:
    """Rows to take from each partition: equal shares of `batch_size` (the remainder
    one each, from partition `first` on), capped by `available`; what a capped
    partition cannot give goes to the others the same way.  With every partition
    holding enough this is the plan; `sum(result) < batch_size` only when all the
    available rows together are fewer."""
    n = len(available)
    take = [0] * n
    left = batch_size
    open_ = [i for i in (list(range(first % n, n)) + list(range(first % n))) if available[i]] if n else []
    while left > 0 and open_:
        share, extra = divmod(left, len(open_))
        still = []
        for rank, i in enumerate(open_):
            want = share + (rank < extra)
            got = min(want, available[i] - take[i])
            take[i] += got
            left -= got
            if take[i] < available[i]:
                still.append(i)
        if len(still) == len(open_):     # nobody was capped: everything is placed
            break
        open_ = still
    return take


@dataclass(frozen=True)
class Cut:
    """A recorded batch that did not follow the plan."""
    before: int                          # records trained before it (the batch's key)
    rows: dict[str, int]                 # partition -> rows it took
    first: dict[str, int]                # partition -> offset of its first row (a check)

    def to_json(self) -> str:
        return json.dumps({"before": self.before, "rows": self.rows, "first": self.first}, sort_keys=True)


class CutJournal:
    """``RUN_DIR/batch_cuts.jsonl``: the cuts of a run, by the records trained before each.

    Cuts stay known (`due`) until the batch after them is trained: a batch emitted
    and then dropped by a rebalance is emitted again, and must come out the same."""

    def __init__(self, path: Path, trained_before: int) -> None:
        self.path = path
        self.cuts: dict[int, Cut] = {}          # before -> cut, from the resume point on
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    raw = json.loads(line)
                    cut = Cut(int(raw["before"]), {k: int(v) for k, v in raw["rows"].items()},
                              {k: int(v) for k, v in raw["first"].items()})
                except (ValueError, KeyError, TypeError, AttributeError):
                    continue            # a line a kill cut short: it never trained
                if cut.before >= trained_before:
                    self.cuts[cut.before] = cut     # a later line for the same batch wins
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(self.cuts[k].to_json() + "\n" for k in sorted(self.cuts)))
        tmp.replace(path)               # the cuts before the checkpoint are done with

    def due(self, before: int) -> Cut | None:
        """The recorded cut of the batch after `before` trained records, if any."""
        return self.cuts.get(before)

    def forget(self, before: int) -> None:
        """Drop the cuts from `before` on (the stream no longer matches them)."""
        self.cuts = {k: c for k, c in self.cuts.items() if k < before}

    def trained_up_to(self, before: int) -> None:
        """Batches before `before` trained records are trained: their cuts are done with."""
        if self.cuts and min(self.cuts) < before:
            self.cuts = {k: c for k, c in self.cuts.items() if k >= before}

    def append(self, cut: Cut) -> None:
        self.cuts[cut.before] = cut
        with open(self.path, "a") as f:
            f.write(cut.to_json() + "\n")


@dataclass
class _Queue:
    """Rows of one partition, in offset order, with the time each piece arrived."""
    pieces: deque = field(default_factory=deque)   # (arrival monotonic s, Batch)
    rows: int = 0

    def push(self, piece: Batch, now: float) -> None:
        self.pieces.append((now, piece))
        self.rows += len(piece)

    def pop(self, n: int) -> list[Batch]:
        out, need = [], n
        while need:
            arrived, piece = self.pieces.popleft()
            if len(piece) > need:
                self.pieces.appendleft((arrived, piece.slice(need, len(piece))))
                piece = piece.slice(0, need)
            out.append(piece)
            need -= len(piece)
        self.rows -= n
        return out

    def head_offset(self) -> int | None:
        return int(self.pieces[0][1].offset[0]) if self.rows else None


class OffsetOrderBatcher:
    """Per-partition queues and the plan; see the module doc.

    `trained_records` reports the records trained into the model so far (the
    checkpoint's count after a resume): the key of the next batch.  The same
    calls as `StreamBatcher` where the run needs them (`discard`, `pending_rows`)."""

    def __init__(self, batch_size: int, journal: CutJournal, trained_records: Callable[[], int]) -> None:
        self.batch_size = batch_size
        self.journal = journal
        self._trained_records = trained_records
        self._before = trained_records()          # records before the next batch to emit
        self._partitions: list[str] = []
        self._queues: dict[str, _Queue] = {}

    def set_partitions(self, names: list[str]) -> None:
        """Every partition of the topics, in plan order (not only the owned ones)."""
        self._partitions = list(names)
        for name in names:
            self._queues.setdefault(name, _Queue())

    @property
    def pending_rows(self) -> int:
        return sum(q.rows for q in self._queues.values())

    def oldest_wait_s(self) -> float:
        heads = [q.pieces[0][0] for q in self._queues.values() if q.rows]
        return time.monotonic() - min(heads) if heads else 0.0

    def add(self, chunk: Batch) -> None:
        """Split `chunk` (rows in offset order within each partition) into the queues."""
        if not len(chunk):
            return
        now = time.monotonic()
        for index, name in enumerate(chunk.partitions):
            rows = np.flatnonzero(chunk.partition == index)
            if len(rows):
                queue = self._queues.setdefault(name, _Queue())
                queue.push(chunk if len(rows) == len(chunk) else chunk.take(rows), now)
                if name not in self._partitions:        # a partition added to the topic meanwhile
                    self._partitions = sorted(set(self._partitions) | {name}, key=split_partition_name)

    def discard(self, partitions: list[str]) -> int:
        """A rebalance took `partitions`: drop their pending rows (read again from the
        trained positions); batches emitted but not trained were dropped with them."""
        dropped = 0
        for name in partitions:
            queue = self._queues.get(name)
            if queue is not None:
                dropped += queue.rows
                self._queues[name] = _Queue()
        self._before = self._trained_records()
        return dropped

    def planned(self, size: int) -> Batch | None:
        """The next batch of `size` rows if the journal or the plan can make it now."""
        self.journal.trained_up_to(self._trained_records())
        cut = self.journal.due(self._before)
        if cut is not None:
            return self._replay(cut)
        want = allocate(size, [size] * len(self._partitions), self._first())
        if any(self._queues[n].rows < w for n, w in zip(self._partitions, want)):
            return None
        batch = self._take(dict(zip(self._partitions, want)))
        if size != self.batch_size:             # the limit ends the run inside a batch
            self._record(batch, dict(zip(self._partitions, want)))
        return batch

    def cut(self, size: int) -> Batch | None:
        """The next batch from what is pending (the budget is spent, or the stream is idle),
        recorded in the journal; None when nothing is pending."""
        if self.journal.due(self._before) is not None:
            log.warning("stream-ctr: the recorded batch after record %d cannot be rebuilt from the "
                        "stream (its rows are gone: a topic recreated?); batches from here follow "
                        "the plan and may differ from the interrupted run's", self._before)
            self.journal.forget(self._before)
        available = [self._queues[n].rows for n in self._partitions]
        if not sum(available):
            return None
        rows = dict(zip(self._partitions, allocate(size, available, self._first())))
        batch = self._take(rows)
        self._record(batch, rows)
        return batch

    def waiting_for_journal(self) -> bool:
        return self.journal.due(self._before) is not None

    # -- internals -----------------------------------------------------------
    def _first(self) -> int:
        return (self._before // self.batch_size) % max(1, len(self._partitions))

    def _replay(self, cut: Cut) -> Batch | None:
        if any(self._queues.get(n, _Queue()).rows < r for n, r in cut.rows.items() if r):
            return None
        heads = {n: self._queues[n].head_offset() for n, r in cut.rows.items() if r}
        if heads != {n: o for n, o in cut.first.items() if cut.rows.get(n)}:
            log.warning("stream-ctr: the recorded batch after record %d starts at offsets %s, the "
                        "stream here at %s; batches from here follow the plan",
                        self._before, cut.first, heads)
            self.journal.forget(self._before)
            return None
        return self._take(cut.rows)

    def _take(self, rows: dict[str, int]) -> Batch:
        pieces = [p for name in self._partitions if rows.get(name) for p in self._queues[name].pop(rows[name])]
        batch = pieces[0] if len(pieces) == 1 else Batch.concat(pieces)
        self._before += len(batch)
        return batch

    def _record(self, batch: Batch, rows: dict[str, int]) -> None:
        taken = {n: r for n, r in rows.items() if r}
        first = {}
        for index, name in enumerate(batch.partitions):
            mine = np.flatnonzero(batch.partition == index)
            if len(mine):
                first[name] = int(batch.offset[mine[0]])
        self.journal.append(Cut(self._before - len(batch), taken, first))


def plan_order(names) -> list[str]:
    """Partition names in plan order: by topic, then partition number."""
    return sorted(names, key=split_partition_name)


def offset_ordered_batches(source: "KafkaSource", read: Callable[[int], tuple], batcher: OffsetOrderBatcher,
                           dead_letter, limit_records: int, max_delay_s: float, stop: "StopSignal",
                           monitor=None) -> Iterator[Batch | Idle]:
    """The batches of a stream under `kafka.deterministic_batches`, its chunks from
    `read` (the source's read, with what the input does on a revocation): the plan's batches, a
    recorded cut when the latency budget is spent or the stream is idle; at most
    `limit_records` rows when it is >= 0; IDLE after a read that brought nothing. Ends
    like the fetch-order batches (`inputs.KafkaInput`): idle, the limit, or a stop."""
    batcher.set_partitions(plan_order(source.partition_names))
    emitted = 0
    while not stop.requested:
        size = batcher.batch_size if limit_records < 0 else min(batcher.batch_size, limit_records - emitted)
        if size <= 0:
            return
        batch = batcher.planned(size)
        if batch is None and batcher.pending_rows and not batcher.waiting_for_journal() and (
                # every row up to the limit is here: the last batch of the run is cut from them
                0 <= limit_records <= emitted + batcher.pending_rows
                # the latency budget is spent: train what is there
                or batcher.oldest_wait_s() >= max_delay_s):
            batch = batcher.cut(size)
        if batch is not None:
            emitted += len(batch)
            yield batch
            continue
        if source.exhausted:                    # idle: the tail, in cuts of at most `size`
            batch = batcher.cut(size)
            if batch is None:
                return
            emitted += len(batch)
            yield batch
            continue
        t0 = time.perf_counter()
        chunk, rejected = read(batcher.batch_size)
        if monitor is not None:
            monitor.on_read(chunk, rejected, time.perf_counter() - t0)
        if not dead_letter_or_stop(dead_letter, rejected, stop):
            return
        source.rejects_written()
        batcher.add(chunk)
        if not len(chunk):
            yield IDLE                          # a caller that must not block takes a turn
