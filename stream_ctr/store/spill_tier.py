"""The spill: dirty rows pushed out of RAM, held in a file before they go to LMDB.

Why it exists: LMDB is a B-tree of ~200-byte rows in 4 KiB pages. Writing the
rows RAM pushes out each step (keys spread over the whole table) copies about
one leaf page per row, and every commit flushes those pages: the disk tier
then writes ~20x the bytes it stores and becomes the step's bottleneck. The
spill takes those rows into fixed-size slots of a memory-mapped file
(`store_dir/spill.bin`) instead, and writes them to LMDB in key order, a
contiguous range of keys per step: each leaf page is then copied once for all
of the rows that fall in it. Rows the batch asks for again while they are in
the spill come back from the file without touching LMDB at all.

Contract:

* It holds only rows newer than their LMDB copy (dirty ones; a clean row
  leaving RAM is dropped, as before). A row is resident in exactly one of
  cache, RAM and spill; LMDB may hold an older copy of it, whose generation
  the row's `write_gen` metadata names as in RAM.
* Nothing in it survives a crash or a close: the file is created empty at
  open and deleted at close. Rows spilled since the last checkpoint are lost
  with the rest of the work since it, exactly as LMDB's own rows written since
  are rolled back on resume. A checkpoint writes every spilled row to LMDB (with
  the cache's and RAM's dirty rows, in key order) and then clears the spill.
* `drain(incoming)` picks what leaves for LMDB this step: nothing while it is
  under `high_water`; then, in rounds, the keys it held when the round began,
  sorted, `chunk_rows` a step (those still here); and always at least enough
  to fit `incoming` rows.
* Its blocks are reserved (posix_fallocate) at open, so a full disk is an error
  at start that names the option, never a SIGBUS when a page is first written.

Its index (key -> slot) is RAM: 73 B a row, printed with the store's plan.
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import torch

from stream_ctr.store.device_cache import Rows
from stream_ctr.store.errors import StoreError
from stream_ctr.store.host_tier import HostTier
from stream_ctr.store.layout import RowLayout

SPILL_FILE = "spill.bin"


class SpillTier(HostTier):
    def __init__(self, capacity: int, layout: RowLayout, store_dir: str | Path,
                 chunk_rows: int = 65536, high_water: float = 0.5) -> None:
        self.capacity, self.layout, self.policy = capacity, layout, "lru"
        self.evict_chunk = 0
        # A round (half the spill) leaves in at least 4 steps, so a small spill still
        # drains gradually rather than all at once.
        self.chunk_rows, self.high_water = max(1, min(chunk_rows, capacity // 8)), high_water
        self.path = Path(store_dir) / SPILL_FILE
        self._map = self._open(self.path, max(1, capacity) * layout.row_bytes)
        self.rows = torch.from_numpy(
            np.frombuffer(self._map, dtype=np.uint8).reshape(max(1, capacity), layout.row_bytes))
        self._init_slots(capacity)
        self._round, self._cursor = np.zeros(0, np.int64), 0

    @staticmethod
    def _open(path: Path, size: int) -> mmap.mmap:
        try:
            path.unlink(missing_ok=True)        # an earlier process's spill is never state
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise StoreError(f"cannot create the store's spill file {path}: {e}") from None
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                path.unlink(missing_ok=True)
                raise StoreError(
                    f"cannot reserve {size / 2**20:,.1f} MiB for the store's spill file {path} "
                    f"({e.strerror}): free space on that disk, move store.store_dir, or lower "
                    "store.spill_bytes (0 turns the spill off)") from None
            return mmap.mmap(fd, size)
        finally:
            os.close(fd)

    @property
    def nbytes(self) -> int:
        """RAM it takes (the rows are in the file): keys, flags and the index."""
        return self.capacity * 9 + self.index.nbytes

    def put(self, incoming: Rows) -> None:
        """Insert dirty rows (absent here); the caller made room with `drain`."""
        if len(incoming):
            self._place(incoming, torch.ones(len(incoming), dtype=torch.bool))

    def drain(self, incoming: int) -> Rows:
        """Rows to write to LMDB now (in key order), so that `incoming` more rows fit."""
        must = len(self) + incoming - self.capacity
        active = self._cursor < len(self._round)
        want = max(must, self.chunk_rows if active or len(self) + incoming > self.high_water
                   * self.capacity else 0)
        parts: list[Rows] = []
        got = 0
        while got < want and len(self):
            if self._cursor >= len(self._round):
                if got >= must and parts:
                    break                       # a round's end: the next starts next step
                self._round = np.sort(self.slot_keys[self.slot_keys >= 0].numpy())
                self._cursor = 0
            keys = self._round[self._cursor:self._cursor + (want - got)]
            self._cursor += len(keys)
            slots = self.index.lookup(torch.from_numpy(keys))
            part = self._remove(slots[slots >= 0])
            parts.append(part)
            got += len(part)
        return Rows.cat(parts, self.layout, torch.device("cpu"))

    def clear(self) -> None:
        """Forget every row (a checkpoint wrote them all to LMDB); the file stays."""
        self._init_slots(self.capacity)
        self._round, self._cursor = np.zeros(0, np.int64), 0

    def close(self) -> None:
        """Release the map and delete the file (nothing in it is state)."""
        self.rows = torch.zeros(0, self.layout.row_bytes, dtype=torch.uint8)
        try:
            self._map.close()
        except BufferError:             # a view still alive: the map closes when it dies
            pass
        self.path.unlink(missing_ok=True)
