"""The host RAM tier: packed rows (the LMDB value bytes) in one uint8 array.

Exclusive with the device cache (a row is resident in one of the two) and
bounded by a row capacity derived from its byte budget. Rows enter when the
cache demotes them and leave when the cache promotes them (`take`) or when
this tier is full (`put` returns the rows it pushed out, for the disk tier).
Nothing here survives a crash: dirty rows are made durable only by being
written to LMDB (on demotion or at a checkpoint).
"""
from __future__ import annotations

import torch

from stream_ctr.store.device_cache import Rows
from stream_ctr.store.layout import WRITE_GEN, RowLayout, gather_rows, scatter_rows
from stream_ctr.store.policies import _INF, expired, priority, select_victims
from stream_ctr.store.slot_index import SlotIndex


class HostTier:
    def __init__(self, capacity: int, layout: RowLayout, policy: str,
                 evict_fraction: float = 1 / 32) -> None:
        self.capacity, self.layout, self.policy = capacity, layout, policy
        # Evicting a chunk at once amortizes the O(capacity) victim selection.
        self.evict_chunk = int(capacity * evict_fraction)
        self.rows = layout.empty(capacity)
        self._init_slots(capacity)

    def _init_slots(self, capacity: int) -> None:
        self.slot_keys = torch.full((capacity,), -1, dtype=torch.int64)
        self.dirty = torch.zeros(capacity, dtype=torch.bool)
        self.index = SlotIndex(capacity)
        # Free slots as a stack: taking n is O(n), not a scan of the whole tier per put.
        self._free = torch.arange(capacity - 1, -1, -1, dtype=torch.int64)
        self._n_free = capacity

    @staticmethod
    def bytes_per_row(layout: RowLayout) -> int:
        """RAM bytes per row: packed row, key, dirty flag and the index (16 B x 4 entries)."""
        return layout.row_bytes + 8 + 1 + 64

    @property
    def nbytes(self) -> int:
        return self.capacity * (self.layout.row_bytes + 9) + self.index.nbytes

    def __len__(self) -> int:
        return len(self.index)

    def meta(self) -> torch.Tensor:
        return self.layout.meta(self.rows)

    def peek(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(found [n], packed rows of the found keys) without moving anything."""
        slots = self.index.lookup(keys)
        found = slots >= 0
        return found, gather_rows(self.rows, slots[found])

    def take(self, keys: torch.Tensor) -> tuple[torch.Tensor, Rows]:
        """Remove the resident ones of `keys`; (found [n], their rows in key order)."""
        slots = self.index.lookup(keys)
        found = slots >= 0
        return found, self._remove(slots[found])

    def copy(self, slots: torch.Tensor) -> Rows:
        """The rows in `slots`, copied; nothing moves."""
        return Rows(self.slot_keys[slots], gather_rows(self.rows, slots), self.dirty[slots].clone())

    def drop(self, slots: torch.Tensor) -> None:
        """Free occupied `slots` (their rows were copied out and now live elsewhere)."""
        self.index.remove(self.slot_keys[slots])
        self.slot_keys[slots] = -1
        self.dirty[slots] = False
        n = slots.numel()
        self._free[self._n_free:self._n_free + n] = slots
        self._n_free += n

    def _take_free(self, n: int) -> torch.Tensor:
        if n > self._n_free:
            raise RuntimeError(f"{type(self).__name__} has {self._n_free} free slots, {n} needed")
        self._n_free -= n
        return self._free[self._n_free:self._n_free + n].clone()

    def _place(self, incoming: Rows, dirty: torch.Tensor) -> None:
        free = self._take_free(len(incoming))
        scatter_rows(self.rows, free, incoming.packed)
        self.slot_keys[free] = incoming.keys
        self.dirty[free] = dirty
        self.index.insert(incoming.keys, free)

    def _remove_dirty(self, slots: torch.Tensor) -> tuple[Rows, int]:
        """Free `slots`; (copies of their dirty rows, how many clean ones were dropped): a
        clean row's LMDB copy is current, so only dirty rows are worth copying out."""
        dirty = self.dirty[slots]
        keep = slots[dirty]
        rows = Rows(self.slot_keys[keep], gather_rows(self.rows, keep),
                    torch.ones(keep.numel(), dtype=torch.bool))
        self.drop(slots)
        return rows, slots.numel() - keep.numel()

    def _remove(self, slots: torch.Tensor) -> Rows:
        rows = self.copy(slots)
        self.drop(slots)
        return rows

    def put(self, incoming: Rows) -> tuple[Rows, int]:
        """Insert rows (absent here); returns (the dirty rows pushed out to make room, the
        number of clean ones dropped: LMDB holds them)."""
        n = len(incoming)
        out: list[Rows] = []
        clean = 0
        if n == 0:
            return Rows.cat([], self.layout, torch.device("cpu")), 0
        if n >= self.capacity:
            # More rows than the whole tier: everything resident leaves, and
            # the lowest-priority incoming rows go straight through.
            rows, clean = self._remove_dirty(torch.nonzero(self.slot_keys >= 0).view(-1))
            out.append(rows)
            prio = priority(self.layout.meta(incoming.packed), self.policy)
            through = select_victims(prio, incoming.keys, n - self.capacity)
            keep = torch.ones(n, dtype=torch.bool)
            keep[through] = False
            passed = incoming.select(through)
            out.append(passed.select(passed.dirty))
            clean += len(passed) - len(out[-1])
            incoming = incoming.select(keep)
        else:
            need = len(self) + n - self.capacity
            if need > 0:
                rows, clean = self.evict(max(need, min(self.evict_chunk, len(self))))
                out.append(rows)
        self._place(incoming, incoming.dirty)
        return Rows.cat(out, self.layout, torch.device("cpu")), clean

    def evict(self, n: int) -> tuple[Rows, int]:
        """Remove the `n` lowest-priority rows: (their dirty rows, clean ones dropped)."""
        prio = priority(self.meta(), self.policy)
        prio.masked_fill_(self.slot_keys < 0, _INF)
        return self._remove_dirty(select_victims(prio, self.slot_keys, n))

    def expire(self, clock: int, newest_event_ms: int, ttl_steps: int,
               ttl_seconds: int) -> tuple[Rows, Rows]:
        """Remove rows past their TTL: (expired by steps, expired by seconds). Reads the
        metadata of occupied slots only (the spill's empty slots are file pages)."""
        live = torch.nonzero(self.slot_keys >= 0).view(-1)
        by_steps, by_seconds = expired(gather_rows(self.meta(), live), clock, newest_event_ms,
                                       ttl_steps, ttl_seconds)
        return self._remove(live[by_steps]), self._remove(live[by_seconds])

    def dirty_slots(self) -> torch.Tensor:
        return torch.nonzero(self.dirty).view(-1)

    def mark_clean(self, slots: torch.Tensor, write_gen: int) -> None:
        self.dirty[slots] = False
        self.meta()[slots, WRITE_GEN] = write_gen

    def without_disk_copy(self) -> int:
        live = torch.nonzero(self.slot_keys >= 0).view(-1)
        return int((gather_rows(self.meta(), live)[:, WRITE_GEN] < 0).sum())
