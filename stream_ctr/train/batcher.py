"""Micro-batcher: decoded chunks in, fixed-size training batches out."""
from __future__ import annotations

from stream_ctr.connectors.batch import Batch


class MicroBatcher:
    """Accumulates rows until `batch_size` are pending, then emits full batches.

    Rows keep their order, so a batch's `positions_after()` is a valid resume
    point: everything before it has been trained, nothing after it has.
    Pending rows are not part of any checkpoint; after a crash they are read
    again from the source.
    """

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self._pending: list[Batch] = []
        self._rows = 0

    @property
    def pending_rows(self) -> int:
        return self._rows

    def add(self, chunk: Batch) -> list[Batch]:
        """Queue `chunk`; return every full batch now available (possibly none)."""
        if len(chunk):
            self._pending.append(chunk)
            self._rows += len(chunk)
        if self._rows < self.batch_size:
            return []
        rows = Batch.concat(self._pending) if len(self._pending) > 1 else self._pending[0]
        n_full = len(rows) // self.batch_size * self.batch_size
        out = [rows.slice(i, i + self.batch_size) for i in range(0, n_full, self.batch_size)]
        rest = rows.slice(n_full, len(rows))
        self._pending = [rest] if len(rest) else []
        self._rows = len(rest)
        return out

    def flush(self) -> Batch | None:
        """The partial batch still pending (end of stream or latency budget), if any."""
        if not self._rows:
            return None
        rows = Batch.concat(self._pending)
        self._pending, self._rows = [], 0
        return rows
