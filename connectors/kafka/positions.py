"""Where each Kafka partition a source owns stands: fetched, returned, trained.

A position is ``(offset, rows_done)``: the Kafka offset of the first message
not yet fully consumed, and how many decoded rows of that message are (for a
packed message that a micro-batch boundary split).  As `Positions` (the
checkpoint's dict) it is written ``{"topic/p": offset}`` plus, only while a
packed message is split, ``{"topic/p#rows_done": rows}``; the group commit
uses the offset (and puts ``rows_done=N`` in the commit metadata).  So for
one-record-per-message topics the checkpoint's offsets *are* the group's
committed offsets: the next offset to read.

Why a fold over trained batches and not ``Batch.positions_after()``: the rows
of a packed message share its Kafka offset, and a batch that ends inside one
must not claim the whole message.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from stream_ctr.connectors.batch import Batch, Positions

ROWS_DONE = "#rows_done"
GIVEN_UP = "#given_up"               # = 1: the source did not own the partition at the time
Position = tuple[int, int]           # (offset, rows_done)


def to_positions(state: dict[str, Position], given_up: frozenset[str] | set[str] = frozenset()) -> Positions:
    out: Positions = {}
    for name, (offset, rows_done) in sorted(state.items()):
        out[name] = offset
        if rows_done:
            out[name + ROWS_DONE] = rows_done
        if name in given_up:
            out[name + GIVEN_UP] = 1
    return out


def from_positions(positions: Positions) -> dict[str, Position]:
    """The Kafka partitions ("topic/p") of a checkpoint's positions; other keys are ignored."""
    out: dict[str, Position] = {}
    for name, offset in positions.items():
        if name.endswith((ROWS_DONE, GIVEN_UP)) or "/" not in name or name.startswith("file:"):
            continue
        out[name] = (int(offset), int(positions.get(name + ROWS_DONE, 0)))
    return out


def given_up_positions(positions: Positions) -> dict[str, Position]:
    """The partitions of `positions` that their source had given up (a rebalance, a
    lost membership) when they were taken: where it left them, not where it stood."""
    return {name: position for name, position in from_positions(positions).items()
            if positions.get(name + GIVEN_UP)}


@dataclass(frozen=True)
class KafkaPositions:
    """Where a Kafka source stands after everything trained: per partition ("topic/p")
    the offset of the first message not fully trained and the rows of it already
    trained (a packed message a batch boundary split); `given_up`: the partitions it no
    longer owned when the snapshot was taken (a rebalance, a lost membership): where
    it left them. A checkpoint stores it as `to_checkpoint()`, the flat dict above."""
    partitions: dict[str, Position]
    given_up: frozenset[str] = frozenset()

    def to_checkpoint(self) -> Positions:
        return to_positions(self.partitions, self.given_up)

    @classmethod
    def from_checkpoint(cls, positions: Positions) -> "KafkaPositions":
        return cls(from_positions(positions), frozenset(given_up_positions(positions)))

    def describe(self, most: int = 4) -> str:
        """`offsets t/0 1,234, t/1 1,230`: the first partitions, for a person."""
        names = sorted(self.partitions)
        shown = ", ".join(f"{n} {self.partitions[n][0]:,}" for n in names[:most])
        more = f" and {len(names) - most} more partitions" if len(names) > most else ""
        return f"offsets {shown}{more}" if names else "the group's committed offsets"


def commit_metadata(rows_done: int) -> str:
    return f"rows_done={rows_done}" if rows_done else ""


def parse_commit_metadata(metadata: str | None) -> int:
    if metadata and metadata.startswith("rows_done="):
        try:
            return max(0, int(metadata.split("=", 1)[1]))
        except ValueError:
            return 0
    return 0


@dataclass
class PositionBook:
    """Positions of the partitions a source owns; plain dicts keyed by "topic/p".

    - `trained`: resume position after everything the trainer reported
      trained (what a checkpoint stores and the group commit publishes);
    - `returned`: resume position after every row `read()` returned;
    - `fetch_next`: the next offset expected from the consumer (records
      before it are duplicates of what was already fetched and are dropped);
    - `skip`: rows to drop at the start of a message the source was
      positioned inside (resume into a split packed message);
    - `message_rows`: good rows of packed messages still in flight, so the
      fold knows whether a batch finished a message;
    - `no_rows`: offsets of messages that decoded to no row at all (every
      line rejected, or empty) and whose rejects `read()` has handed out: a
      position that reaches one moves past it, or a partition ending in one
      would never look consumed (lag 1 forever, its bad records
      dead-lettered again at every restart).  Only once they are in the
      dead-letter sink, though: until read() returns their rejects they wait in
      `no_rows_decoded`, then in `no_rows_unwritten` until the trainer reports
      them written (`rejects_written`).  A write that never lands (a stop while
      the dead-letter broker is down) so leaves every position before them,
      and a resumed run reads and dead-letters them again;
    - `released`: last trained position of partitions given up (a rebalance
      or a lost group) in this process, or in the run a checkpoint resumes.
      Checkpoints keep them, marked given up: the model holds those records,
      and the group's offset may not (the commit on revocation can fail, the
      membership can be lost before it, a broker can drop the rows_done
      metadata); a partition that comes back continues after the furthest of
      this position and the group's offset.
    """
    trained: dict[str, Position] = field(default_factory=dict)
    returned: dict[str, Position] = field(default_factory=dict)
    fetch_next: dict[str, int] = field(default_factory=dict)
    skip: dict[str, Position] = field(default_factory=dict)
    message_rows: dict[str, dict[int, int]] = field(default_factory=dict)
    no_rows: dict[str, set[int]] = field(default_factory=dict)
    no_rows_decoded: dict[str, list[int]] = field(default_factory=dict)
    no_rows_unwritten: dict[str, list[int]] = field(default_factory=dict)
    released: dict[str, Position] = field(default_factory=dict)

    def own(self, name: str, position: Position) -> None:
        """Start owning `name` at `position` (the consumer was seeked to its offset)."""
        self.trained[name] = self.returned[name] = position
        self.fetch_next[name] = position[0]
        self.message_rows[name] = {}
        self.no_rows[name] = set()
        if position[1]:
            self.skip[name] = position
        else:
            self.skip.pop(name, None)

    def release(self, names: list[str]) -> dict[str, Position]:
        """Stop owning `names`; returns (and remembers) their trained positions."""
        out = {}
        for name in names:
            if name in self.trained:
                out[name] = self.released[name] = self.trained[name]
            for table in (self.trained, self.returned, self.fetch_next, self.skip, self.message_rows,
                          self.no_rows, self.no_rows_decoded, self.no_rows_unwritten):
                table.pop(name, None)
        return out

    def owned(self) -> list[str]:
        return sorted(self.trained)

    def checkpoint_positions(self) -> Positions:
        """What a checkpoint stores: owned partitions, and given-up ones marked as such."""
        given_up = set(self.released) - set(self.trained)
        return to_positions({**self.released, **self.trained}, given_up)

    def note_message_rows(self, name: str, offsets: np.ndarray, rows_per_message: np.ndarray) -> None:
        """Record how many good rows the (decoded) messages at `offsets` of `name` hold."""
        packed = np.flatnonzero(rows_per_message > 1)
        if len(packed) and name in self.message_rows:
            self.message_rows[name].update(zip(offsets[packed].tolist(),
                                               rows_per_message[packed].tolist()))
        empty = offsets[rows_per_message == 0]
        if len(empty) and name in self.no_rows:
            self.no_rows_decoded.setdefault(name, []).extend(empty.tolist())

    def rejects_handed_out(self) -> None:
        """read() returns the rejects of everything decoded so far (not yet written)."""
        for name, offsets in self.no_rows_decoded.items():
            self.no_rows_unwritten.setdefault(name, []).extend(offsets)
        self.no_rows_decoded.clear()

    def rejects_written(self) -> None:
        """The rejects read() handed out are in the dead-letter sink: positions may now
        move past the messages that had no row."""
        for name, offsets in self.no_rows_unwritten.items():
            if name in self.no_rows:
                self.no_rows[name].update(offsets)
        self.no_rows_unwritten.clear()
        self._pass_empty(self.trained)
        self._pass_empty(self.returned)

    def _pass_empty(self, state: dict[str, Position]) -> None:
        for name, (offset, done) in state.items():
            empty = self.no_rows.get(name)
            if empty and not done and offset in empty:
                while offset in empty:
                    offset += 1
                state[name] = (offset, 0)

    def drop_skipped(self, batch: Batch) -> Batch:
        """Remove the rows a positioned-inside-a-message resume must not return again."""
        if not self.skip or not len(batch):
            return batch
        keep = np.ones(len(batch), dtype=bool)
        for index, name in enumerate(batch.partitions):
            if name not in self.skip:
                continue
            offset, rows = self.skip[name]
            in_partition = batch.partition == index
            if not in_partition.any():
                continue
            # A message is always decoded whole, so its rows are all here.
            same = np.flatnonzero(in_partition & (batch.offset == offset))
            keep[same[:rows]] = False
            del self.skip[name]
        return batch if keep.all() else _take(batch, np.flatnonzero(keep))

    def advance(self, state: dict[str, Position], batch: Batch) -> None:
        """Fold `batch` (rows in order, as returned) into `state` (trained or returned)."""
        for index, name in enumerate(batch.partitions):
            if name not in state:
                continue                   # a partition given up since (its rows were discarded)
            offsets = batch.offset[batch.partition == index]
            if not len(offsets):
                continue
            last = int(offsets[-1])
            count = int(np.count_nonzero(offsets == last))
            previous_offset, previous_done = state[name]
            done = count + (previous_done if previous_offset == last else 0)
            total = self.message_rows.get(name, {}).get(last, 1)
            state[name] = (last, done) if done < total else (last + 1, 0)
        self._pass_empty(state)

    def forget_trained_messages(self) -> None:
        """Drop sizes of packed messages that are fully trained (bounded memory)."""
        for name, sizes in self.message_rows.items():
            if sizes and name in self.trained:
                first_open = self.trained[name][0]
                for offset in [o for o in sizes if o < first_open]:
                    del sizes[offset]
        for name, empty in self.no_rows.items():
            if empty and name in self.trained:
                empty.difference_update([o for o in empty if o < self.trained[name][0]])


def committed_offsets(bootstrap: str, group: str, topic: str, partitions: int) -> dict[str, int]:
    """The group's committed offsets of `topic` as {"topic/p": offset} (partitions with
    none are absent), read with a consumer that joins no group and commits nothing."""
    from kafka import KafkaConsumer, TopicPartition
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        out = {}
        for p in range(partitions):
            offset = consumer.committed(TopicPartition(topic, p))
            if offset is not None:
                out[f"{topic}/{p}"] = offset
        return out
    finally:
        consumer.close(autocommit=False)


def _take(batch: Batch, rows: np.ndarray) -> Batch:
    return batch.take(rows)       # multi-hot (jagged) fields included


def filter_partitions(batch: Batch, names: set[str]) -> Batch:
    """The rows of `batch` whose partition is not in `names`."""
    drop = [i for i, name in enumerate(batch.partitions) if name in names]
    if not drop or not len(batch):
        return batch
    return _take(batch, np.flatnonzero(~np.isin(batch.partition, drop)))
