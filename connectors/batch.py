"""The columnar batch every stage passes on, and the positions it covers.

A `Batch` is what a source's decoder produces and what the trainer consumes.
It is plain numpy so that connectors never depend on torch; the trainer moves
it to a device with `stream_ctr.types.to_device`.

Layout (B rows, F categorical fields, D dense features)::

    labels      float32 [B]      0.0 / 1.0 click
    dense       float32 [B, D]   transformed numeric features (D may be 0)
    keys        int64   [B, F]   feature signs: hash(field, raw token), 63-bit,
                                 never negative; a missing value has its own sign
    event_time_ms int64 [B]      event time in ms since the epoch, -1 if the
                                 format carries none (Criteo)
    partition   int32   [B]      index into `partitions` of the row's source
                                 partition (a file is one partition)
    offset      int64   [B]      the row's offset inside its partition: a Kafka
                                 offset, or a file's 0-based data-line number
    jagged      tuple[Jagged]    one per multi-hot (list) field, M of them (M may be 0)
    weight      float32 [B] | None   the record's loss weight (a schema `weight` field,
                                 e.g. 1/rate after negative down-sampling); None = all 1

A multi-hot field's keys are jagged, as TorchRec's KeyedJaggedTensor holds
them: one flat `values` array and `offsets` that cut it into rows.  Row i's
keys are ``values[offsets[i]:offsets[i + 1]]``; an empty list is an empty
range.  For B = 3 rows of a field `history`::

    row          0           1      2
    keys         [k1, k2]    []     [k3, k4, k5]

    values   int64 [N]     [k1, k2, k3, k4, k5]       N = 5 keys in all
    offsets  int64 [B+1]   [0,  2,  2,  5]            offsets[0] = 0, offsets[B] = N
    pooling  str           "sum" | "mean"             how the model pools the row's embeddings

The fixed fields stay a dense ``keys [B, F]``; the model sees F + M embedded
fields, the M pooled from their jagged keys.

`positions_after()` is the resume position: per partition, the offset of the
first record *not* contained in the batch (last offset + 1). A checkpoint
stores it; after a crash the source is reopened there and yields exactly the
records that follow.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Resume position: source partition name -> next offset to read.
Positions = dict[str, int]


POOLINGS = ("sum", "mean")


@dataclass
class Jagged:
    """The keys of one multi-hot field over B rows (see the module docstring)."""
    values: np.ndarray          # int64 [N]
    offsets: np.ndarray         # int64 [B+1], non-decreasing, offsets[0] == 0, offsets[-1] == N
    pooling: str = "sum"

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"Jagged.pooling must be one of {POOLINGS}, got {self.pooling!r}")
        o = self.offsets
        if o.ndim != 1 or len(o) < 1 or o[0] != 0 or o[-1] != len(self.values):
            raise ValueError(f"Jagged.offsets must run from 0 to len(values) = {len(self.values)}, "
                             f"got {len(o)} offsets ending at {o[-1] if len(o) else None}")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def slice(self, start: int, stop: int) -> "Jagged":
        start, stop, _ = slice(start, stop).indices(len(self))
        stop = max(start, stop)
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        return Jagged(self.values[lo:hi], self.offsets[start:stop + 1] - lo, self.pooling)

    def take(self, rows: np.ndarray) -> "Jagged":
        """The rows `rows` (indices or a boolean mask), in that order."""
        rows = np.flatnonzero(rows) if rows.dtype == bool else np.asarray(rows, np.int64)
        lengths = self.lengths[rows]
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        # each output value's source index: its row's start plus its place in the row
        starts = np.repeat(self.offsets[rows] - offsets[:-1], lengths)
        return Jagged(self.values[starts + np.arange(offsets[-1])], offsets, self.pooling)

    @staticmethod
    def empty(pooling: str = "sum") -> "Jagged":
        return Jagged(np.zeros(0, np.int64), np.zeros(1, np.int64), pooling)

    @staticmethod
    def concat(parts: list["Jagged"]) -> "Jagged":
        pooling = {p.pooling for p in parts}
        if len(pooling) != 1:
            raise ValueError(f"Jagged.concat: fields pool differently ({sorted(pooling)})")
        shift = np.cumsum([0] + [len(p.values) for p in parts[:-1]])
        offsets = np.concatenate([np.zeros(1, np.int64)] + [p.offsets[1:] + s for p, s in zip(parts, shift)])
        return Jagged(np.concatenate([p.values for p in parts]).astype(np.int64, copy=False),
                      offsets.astype(np.int64, copy=False), parts[0].pooling)


@dataclass
class Batch:
    labels: np.ndarray
    dense: np.ndarray
    keys: np.ndarray
    event_time_ms: np.ndarray
    partition: np.ndarray
    offset: np.ndarray
    partitions: tuple[str, ...] = field(default=())
    jagged: tuple[Jagged, ...] = field(default=())
    weight: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.labels)
        for name in ("dense", "keys", "event_time_ms", "partition", "offset"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Batch.{name} has {len(getattr(self, name))} rows, labels has {n}")
        if self.weight is not None and len(self.weight) != n:
            raise ValueError(f"Batch.weight has {len(self.weight)} rows, labels has {n}")
        self.jagged = tuple(self.jagged)
        for j, jag in enumerate(self.jagged):
            if len(jag) != n:
                raise ValueError(f"Batch.jagged[{j}] has {len(jag)} rows, labels has {n}")

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def n_fields(self) -> int:
        return self.keys.shape[1]

    @property
    def n_dense(self) -> int:
        return self.dense.shape[1]

    @property
    def n_multi(self) -> int:
        return len(self.jagged)

    @property
    def pooling(self) -> tuple[str, ...]:
        return tuple(j.pooling for j in self.jagged)

    def slice(self, start: int, stop: int) -> "Batch":
        return Batch(self.labels[start:stop], self.dense[start:stop], self.keys[start:stop],
                     self.event_time_ms[start:stop], self.partition[start:stop],
                     self.offset[start:stop], self.partitions,
                     tuple(j.slice(start, stop) for j in self.jagged),
                     None if self.weight is None else self.weight[start:stop])

    def take(self, rows: np.ndarray) -> "Batch":
        """The rows `rows` (indices or a boolean mask), in that order; same partition table."""
        return Batch(self.labels[rows], self.dense[rows], self.keys[rows], self.event_time_ms[rows],
                     self.partition[rows], self.offset[rows], self.partitions,
                     tuple(j.take(rows) for j in self.jagged),
                     None if self.weight is None else self.weight[rows])

    def positions_after(self) -> Positions:
        """Per partition, the offset just after the last row of this batch."""
        out: Positions = {}
        if len(self) == 0:
            return out
        last = np.full(len(self.partitions), -1, dtype=np.int64)
        np.maximum.at(last, self.partition, self.offset)
        for i, name in enumerate(self.partitions):
            if last[i] >= 0:
                out[name] = int(last[i]) + 1
        return out

    @staticmethod
    def empty(n_fields: int, n_dense: int, partitions: tuple[str, ...] = (),
              pooling: tuple[str, ...] = ()) -> "Batch":
        """No rows; `pooling` names one jagged (multi-hot) field each."""
        return Batch(np.zeros(0, np.float32), np.zeros((0, n_dense), np.float32),
                     np.zeros((0, n_fields), np.int64), np.zeros(0, np.int64),
                     np.zeros(0, np.int32), np.zeros(0, np.int64), partitions,
                     tuple(Jagged.empty(p) for p in pooling))

    @staticmethod
    def concat(batches: list["Batch"]) -> "Batch":
        """Concatenate batches; partition indices are remapped to one name table."""
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        names: list[str] = []
        for b in batches:
            for p in b.partitions:
                if p not in names:
                    names.append(p)
        if len({b.pooling for b in batches}) != 1:
            raise ValueError("Batch.concat: batches differ in their multi-hot fields "
                             f"({sorted({b.pooling for b in batches})})")
        remapped = []
        for b in batches:
            lut = np.array([names.index(p) for p in b.partitions] or [0], dtype=np.int32)
            remapped.append(lut[b.partition] if len(b) else b.partition)
        # A batch without weights weighs 1 per row, so mixing the two stays exact.
        weight = None
        if any(b.weight is not None for b in batches):
            weight = np.concatenate([np.ones(len(b), np.float32) if b.weight is None else b.weight
                                     for b in batches]).astype(np.float32, copy=False)
        return Batch(np.concatenate([b.labels for b in batches]),
                     np.concatenate([b.dense for b in batches]),
                     np.concatenate([b.keys for b in batches]),
                     np.concatenate([b.event_time_ms for b in batches]),
                     np.concatenate(remapped).astype(np.int32),
                     np.concatenate([b.offset for b in batches]),
                     tuple(names),
                     tuple(Jagged.concat([b.jagged[j] for b in batches])
                           for j in range(batches[0].n_multi)),
                     weight)


@dataclass(frozen=True)
class Rejected:
    """A record that did not decode. It is dead-lettered, never dropped silently."""
    partition: str
    offset: int
    reason: str          # a short token: field_count, bad_label, ...; schema decoders name the
                         # field: missing:FIELD, bad_value:FIELD
    raw: bytes
    detail: str = ""     # what a person needs to fix it (the field and value), if known
