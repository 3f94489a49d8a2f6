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


@dataclass
class Batch:
    labels: np.ndarray
    dense: np.ndarray
    keys: np.ndarray
    event_time_ms: np.ndarray
    partition: np.ndarray
    offset: np.ndarray
    partitions: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        n = len(self.labels)
        for name in ("dense", "keys", "event_time_ms", "partition", "offset"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Batch.{name} has {len(getattr(self, name))} rows, labels has {n}")

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def n_fields(self) -> int:
        return self.keys.shape[1]

    @property
    def n_dense(self) -> int:
        return self.dense.shape[1]

    def slice(self, start: int, stop: int) -> "Batch":
        return Batch(self.labels[start:stop], self.dense[start:stop], self.keys[start:stop],
                     self.event_time_ms[start:stop], self.partition[start:stop],
                     self.offset[start:stop], self.partitions)

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
    def empty(n_fields: int, n_dense: int, partitions: tuple[str, ...] = ()) -> "Batch":
        return Batch(np.zeros(0, np.float32), np.zeros((0, n_dense), np.float32),
                     np.zeros((0, n_fields), np.int64), np.zeros(0, np.int64),
                     np.zeros(0, np.int32), np.zeros(0, np.int64), partitions)

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
        remapped = []
        for b in batches:
            lut = np.array([names.index(p) for p in b.partitions] or [0], dtype=np.int32)
            remapped.append(lut[b.partition] if len(b) else b.partition)
        return Batch(np.concatenate([b.labels for b in batches]),
                     np.concatenate([b.dense for b in batches]),
                     np.concatenate([b.keys for b in batches]),
                     np.concatenate([b.event_time_ms for b in batches]),
                     np.concatenate(remapped).astype(np.int32),
                     np.concatenate([b.offset for b in batches]),
                     tuple(names))


@dataclass(frozen=True)
class Rejected:
    """A record that did not decode. It is dead-lettered, never dropped silently."""
    partition: str
    offset: int
    reason: str          # a short token: field_count, bad_label, ...; schema decoders name the
                         # field: missing:FIELD, bad_value:FIELD
    raw: bytes
    detail: str = ""     # what a person needs to fix it (the field and value), if known
