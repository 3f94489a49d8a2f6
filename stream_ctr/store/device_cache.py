"""The device cache: a fixed number of row slots on the training device.

Holds w, m, v as three contiguous [capacity, cols] float32 tensors (what the
fused CowClip + Adam kernel updates in place), the metadata [capacity, 4]
int64, a dirty flag per slot, and a SlotIndex key -> slot. On a GPU every
tensor, the index included, lives on the GPU: lookups, victim selection and
(un)packing are tensor ops, never per-key Python.

Slots are taken from the free ones in increasing slot order, so the layout is
a pure function of the sequence of operations. Nothing here survives a crash:
the cache is rebuilt empty and filled from the lower tiers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from stream_ctr.store.layout import COUNT, META_FIELDS, RowLayout, gather_rows, scatter_rows
from stream_ctr.store.policies import _INF, priority, select_victims
from stream_ctr.store.slot_index import SlotIndex
from stream_ctr.store.stats import profiled


@dataclass
class Rows:
    """Rows leaving or entering a tier: keys [n], packed rows [n, row_bytes], dirty [n]."""
    keys: torch.Tensor
    packed: torch.Tensor
    dirty: torch.Tensor

    def __len__(self) -> int:
        return self.keys.numel()

    def to(self, device: torch.device) -> "Rows":
        return Rows(self.keys.to(device), self.packed.to(device), self.dirty.to(device))

    def select(self, mask_or_idx: torch.Tensor) -> "Rows":
        idx = torch.nonzero(mask_or_idx).view(-1) if mask_or_idx.dtype == torch.bool else mask_or_idx
        return Rows(self.keys.index_select(0, idx), gather_rows(self.packed, idx),
                    self.dirty.index_select(0, idx))

    @staticmethod
    def cat(parts: list["Rows"], layout: RowLayout, device: torch.device) -> "Rows":
        parts = [p for p in parts if len(p)]
        if not parts:
            return Rows(torch.zeros(0, dtype=torch.int64, device=device), layout.empty(0, device),
                        torch.zeros(0, dtype=torch.bool, device=device))
        return Rows(torch.cat([p.keys for p in parts]), torch.cat([p.packed for p in parts]),
                    torch.cat([p.dirty for p in parts]))


class DeviceCache:
    def __init__(self, capacity: int, layout: RowLayout, device: torch.device) -> None:
        self.capacity, self.layout, self.device = capacity, layout, device
        cols = layout.cols

        def table() -> torch.Tensor:
            return torch.zeros(capacity, cols, dtype=torch.float32, device=device)
        self.weight, self.exp_avg, self.exp_avg_sq = table(), table(), table()
        self.meta = torch.zeros(capacity, META_FIELDS, dtype=torch.int64, device=device)
        self.slot_keys = torch.full((capacity,), -1, dtype=torch.int64, device=device)
        self.dirty = torch.zeros(capacity, dtype=torch.bool, device=device)
        # Slots of rows that live only for the current step (keys not admitted).
        self.transient = torch.zeros(capacity, dtype=torch.bool, device=device)
        self.index = SlotIndex(capacity, device)

    @staticmethod
    def bytes_per_row(layout: RowLayout) -> int:
        """Device bytes per slot: w, m, v, meta, key, flags and the index (16 B x 4 entries)."""
        return 12 * layout.cols + 8 * META_FIELDS + 8 + 2 + 64

    @property
    def nbytes(self) -> int:
        return self.capacity * (12 * self.layout.cols + 8 * META_FIELDS + 8 + 2) + self.index.nbytes

    def __len__(self) -> int:
        return len(self.index)

    @property
    def free(self) -> int:
        return self.capacity - len(self.index) - int(self.transient.sum())

    @profiled("store.cache.lookup")
    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """Slot of each key, -1 where not resident."""
        return self.index.lookup(keys)

    def take_free(self, n: int) -> torch.Tensor:
        """The `n` lowest free slots (the caller made room)."""
        free = torch.nonzero((self.slot_keys < 0) & ~self.transient).view(-1)
        if free.numel() < n:
            raise RuntimeError(f"device cache has {free.numel()} free slots, {n} needed")
        return free[:n]

    @profiled("store.cache.fill")
    def fill(self, slots: torch.Tensor, keys: torch.Tensor, packed: torch.Tensor,
             dirty: torch.Tensor, transient: bool = False) -> None:
        """Write packed rows into free `slots`; transient rows are not indexed."""
        if slots.numel() == 0:
            return
        packed = packed.to(self.device)
        # Strided views scattered straight in: no contiguous copy of each part first.
        f, c = self.layout.floats(packed), self.layout.cols
        for table, part in ((self.weight, f[:, :c]), (self.exp_avg, f[:, c:2 * c]),
                            (self.exp_avg_sq, f[:, 2 * c:]), (self.meta, self.layout.meta(packed))):
            scatter_rows(table, slots, part)
        self.dirty[slots] = dirty.to(self.device)
        if transient:
            self.transient[slots] = True
        else:
            self.slot_keys[slots] = keys
            self.index.insert(keys, slots)

    def pack(self, slots: torch.Tensor) -> torch.Tensor:
        return self.layout.pack(gather_rows(self.weight, slots), gather_rows(self.exp_avg, slots),
                                gather_rows(self.exp_avg_sq, slots), gather_rows(self.meta, slots))

    def release_transient(self) -> int:
        n = int(self.transient.sum())
        self.transient.zero_()
        return n

    def remove(self, slots: torch.Tensor) -> Rows:
        """Take rows out of the cache (their slots become free); returns them packed."""
        keys = self.slot_keys[slots]
        rows = Rows(keys, self.pack(slots), self.dirty[slots].clone())
        self.index.remove(keys)
        self.slot_keys[slots] = -1
        self.dirty[slots] = False
        return rows

    @profiled("store.cache.evict")
    def evict(self, n: int, protect: torch.Tensor, policy: str) -> Rows:
        """Remove the `n` lowest-priority resident rows, never the slots in `protect`."""
        occupied = self.slot_keys >= 0
        prio = priority(self.meta, policy)
        prio.masked_fill_(~occupied, _INF)
        prio.index_fill_(0, protect, _INF)
        victims = select_victims(prio, self.slot_keys, n)
        return self.remove(victims)

    def resident(self) -> torch.Tensor:
        """Slots of all indexed rows, in slot order."""
        return torch.nonzero(self.slot_keys >= 0).view(-1)

    def add_counts(self, slots: torch.Tensor, counts: torch.Tensor) -> None:
        self.meta[:, COUNT].index_add_(0, slots, counts.to(torch.int64))
        self.dirty.index_fill_(0, slots, True)
