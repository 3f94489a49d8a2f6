"""Where each Kafka partition a source owns stands: fetched, returned, trained.

A partition is named ``"topic/partition"`` (`options.partition_name`: the names
`Batch.partitions` carries).  Its position is a `PartitionPosition`
``(offset, rows_done)``: `offset`, the Kafka offset of the first message not yet
fully consumed -- the next offset to read when `rows_done` is 0 -- and
`rows_done`, how many decoded rows of the message at `offset` are consumed
already (more than 0 only inside a packed message that a micro-batch boundary
split).  `KafkaPositions` holds them for a whole source, with the partitions it
had given up (a rebalance, a lost membership) when they were taken.  Inside the
source, the trainer and a distributed job, positions are these types.

The checkpoint's flat dict (`Positions`, ``{name: int}``) is written and read
here only, by `KafkaPositions.to_checkpoint` / `from_checkpoint` (and the
module functions they use), in the format every checkpoint and job manifest so
far holds: ``{"topic/p": offset}`` plus, only while a packed message is split,
``{"topic/p#rows_done": rows}``, and for a given-up partition
``{"topic/p#given_up": 1}``.  Keys of other sources (``"file:NAME"``) may sit
beside them and are ignored.  The group commit uses the offset (and puts
``rows_done=N`` in the commit metadata, `commit_metadata`).  So for
one-record-per-message topics the checkpoint's offsets *are* the group's
committed offsets: the next offset to read.

Why a fold over trained batches and not ``Batch.positions_after()``: the rows
of a packed message share its Kafka offset, and a batch that ends inside one
must not claim the whole message.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, NamedTuple

import numpy as np

from stream_ctr.connectors.batch import Batch, Positions

# The checkpoint format's marks (this module alone reads and writes them).
ROWS_DONE = "#rows_done"
GIVEN_UP = "#given_up"               # = 1: the source did not own the partition at the time


class PartitionPosition(NamedTuple):
    """Where one partition stands (see the module doc): `offset`, the first message not
    fully consumed (the next offset to read when `rows_done` is 0); `rows_done`, the
    decoded rows of that message already consumed. Positions order as (offset,
    rows_done): the greater one is further along the partition."""
    offset: int
    rows_done: int = 0



def _position(position: tuple[int, int]) -> PartitionPosition:
    return position if type(position) is PartitionPosition else PartitionPosition(*map(int, position))


# -- the checkpoint's flat dict: the one place it is written and read ---------------------

def to_positions(state: Mapping[str, tuple[int, int]], given_up: Iterable[str] = frozenset()) -> Positions:
    """The checkpoint dict of per-partition positions, the names in `given_up` marked."""
    given_up = frozenset(given_up)
    out: Positions = {}
    for name, (offset, rows_done) in sorted(state.items()):
        out[name] = int(offset)
        if rows_done:
            out[name + ROWS_DONE] = int(rows_done)
        if name in given_up:
            out[name + GIVEN_UP] = 1
    return out


def _is_partition_key(name: str) -> bool:
    return not name.endswith((ROWS_DONE, GIVEN_UP)) and "/" in name and not name.startswith("file:")


def from_positions(positions: Positions) -> dict[str, PartitionPosition]:
    """The Kafka partitions ("topic/p") of a checkpoint's positions; other keys are ignored."""
    return {name: PartitionPosition(int(offset), int(positions.get(name + ROWS_DONE, 0)))
            for name, offset in positions.items() if _is_partition_key(name)}


def given_up_positions(positions: Positions) -> dict[str, PartitionPosition]:
    """The partitions of `positions` that their source had given up (a rebalance, a
    lost membership) when they were taken: where it left them, not where it stood."""
    return {name: position for name, position in from_positions(positions).items()
            if positions.get(name + GIVEN_UP)}


@dataclass(frozen=True)
class KafkaPositions:
    """Where a Kafka source stands after everything trained: per partition ("topic/p")
    its `PartitionPosition` (the next offset to read, and the rows of that message
    already trained when a batch boundary split a packed message); `given_up`: the
    partitions among them it no longer owned when the snapshot was taken (a rebalance,
    a lost membership): where it left them. A checkpoint stores it as
    `to_checkpoint()`, the flat dict of the module doc, and a resume reads it back
    with `from_checkpoint`."""
    partitions: Mapping[str, PartitionPosition]
    given_up: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "partitions", {name: _position(p) for name, p in self.partitions.items()})
        object.__setattr__(self, "given_up", frozenset(self.given_up).intersection(self.partitions))

    def owned(self) -> dict[str, PartitionPosition]:
        """The partitions the source owned when the snapshot was taken."""
        return {name: p for name, p in self.partitions.items() if name not in self.given_up}

    def given_up_partitions(self) -> dict[str, PartitionPosition]:
        """The partitions it had given up, where it left them."""
        return {name: p for name, p in self.partitions.items() if name in self.given_up}

    @classmethod
    def furthest(cls, every: Iterable["KafkaPositions"]) -> "KafkaPositions":
        """Per partition the furthest position any of `every` holds (a partition only
        moves forward, whichever source or rank read it); none marked given up."""
        out: dict[str, PartitionPosition] = {}
        for positions in every:
            for name, position in positions.partitions.items():
                out[name] = max(out.get(name, position), position)
        return cls(out)

    def to_checkpoint(self) -> Positions:
        return to_positions(self.partitions, self.given_up)

    @classmethod
    def from_checkpoint(cls, positions: Positions) -> "KafkaPositions":
        return cls(from_positions(positions), frozenset(given_up_positions(positions)))

    def describe(self, most: int = 4) -> str:
        """`offsets t/0 1,234, t/1 1,230`: the first partitions, for a person."""
        names = sorted(self.partitions)
        shown = ", ".join(f"{n} {self.partitions[n].offset:,}" for n in names[:most])
        more = f" and {len(names) - most} more partitions" if len(names) > most else ""
        return f"offsets {shown}{more}" if names else "the group's committed offsets"


def commit_metadata(rows_done: int) -> str:
    """The group commit's metadata of a position: ``rows_done=N`` inside a packed message."""
    return f"rows_done={rows_done}" if rows_done else ""


def parse_commit_metadata(metadata: str | None) -> int:
    """`rows_done` of a group commit's metadata (0 if none, or not ours)."""
    if metadata and metadata.startswith("rows_done="):
        try:
            return max(0, int(metadata.split("=", 1)[1]))
        except ValueError:
            return 0
    return 0


@dataclass
class PositionBook:
    """Positions of the partitions a source owns, keyed by partition name ("topic/p").

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

    `checkpoint_positions()` is the `KafkaPositions` of `trained` and `released`.
    """
    trained: dict[str, PartitionPosition] = field(default_factory=dict)
    returned: dict[str, PartitionPosition] = field(default_factory=dict)
    fetch_next: dict[str, int] = field(default_factory=dict)
    skip: dict[str, PartitionPosition] = field(default_factory=dict)
    message_rows: dict[str, dict[int, int]] = field(default_factory=dict)
    no_rows: dict[str, set[int]] = field(default_factory=dict)
    no_rows_decoded: dict[str, list[int]] = field(default_factory=dict)
    no_rows_unwritten: dict[str, list[int]] = field(default_factory=dict)
    released: dict[str, PartitionPosition] = field(default_factory=dict)

    def own(self, name: str, position: tuple[int, int]) -> None:
        """Start owning `name` at `position` (the consumer was seeked to its offset)."""
        position = _position(position)
        self.trained[name] = self.returned[name] = position
        self.fetch_next[name] = position.offset
        self.message_rows[name] = {}
        self.no_rows[name] = set()
        if position.rows_done:
            self.skip[name] = position
        else:
            self.skip.pop(name, None)

    def release(self, names: list[str]) -> dict[str, PartitionPosition]:
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

    def checkpoint_positions(self) -> KafkaPositions:
        """What a checkpoint stores: owned partitions, and given-up ones marked as such."""
        given_up = frozenset(self.released).difference(self.trained)
        return KafkaPositions({**self.released, **self.trained}, given_up)

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

    def _pass_empty(self, state: dict[str, PartitionPosition]) -> None:
        for name, (offset, done) in state.items():
            empty = self.no_rows.get(name)
            if empty and not done and offset in empty:
                while offset in empty:
                    offset += 1
                state[name] = PartitionPosition(offset, 0)

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

    def advance(self, state: dict[str, PartitionPosition], batch: Batch) -> None:
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
            state[name] = PartitionPosition(last, done) if done < total else PartitionPosition(last + 1, 0)
        self._pass_empty(state)

    def forget_trained_messages(self) -> None:
        """Drop sizes of packed messages that are fully trained (bounded memory)."""
        for name, sizes in self.message_rows.items():
            if sizes and name in self.trained:
                first_open = self.trained[name].offset
                for offset in [o for o in sizes if o < first_open]:
                    del sizes[offset]
        for name, empty in self.no_rows.items():
            if empty and name in self.trained:
                empty.difference_update([o for o in empty if o < self.trained[name].offset])


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
