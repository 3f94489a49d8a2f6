"""A vectorized open-addressing map int64 key -> int64 slot, with removal.

The same probing scheme as stream_ctr/store/key_index.py (linear probing; compiled
loops on the CPU, `ops.hash_probe` elsewhere: one Triton launch per lookup or
insert on CUDA), plus `remove`: a removed entry becomes a tombstone that
lookups probe past and inserts never reuse, and the table is rebuilt from
its live entries when live + tombstones pass half the capacity. The tiers
use it for resident rows, whose slots are reused as rows come and go.

On the CPU (where `probe_cpu` is usable) keys and values sit side by side in one
[capacity, 2] table, every operation is one compiled loop that hashes, probes
and reads or writes the pair (`probe_cpu.pair_*`), and a removal shifts later
entries back instead of leaving a tombstone (so lookups never slow down as rows
come and go); elsewhere two contiguous arrays, as `ops.hash_probe` needs them.
Both give the same answers.
"""
from __future__ import annotations

import torch

from stream_ctr.ops import hash_probe
from stream_ctr.store import probe_cpu
from stream_ctr.store.key_index import _slot_hash

EMPTY = -1       # keys are non-negative feature signs
TOMBSTONE = -2


class SlotIndex:
    """int64 key -> int64 value (a slot number) for up to `max_entries` live keys."""

    def __init__(self, max_entries: int, device: torch.device | str = "cpu") -> None:
        # 4x the live entries: at most 1/4 live load, rebuilt at 1/2 with tombstones.
        cap = 1 << max(4, (4 * max(1, max_entries) - 1).bit_length())
        self.device = torch.device(device)
        probe = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.paired = probe_cpu.usable(probe, probe)
        self._alloc(cap)
        self.size = 0
        self.tombstones = 0

    def _alloc(self, cap: int) -> None:
        if self.paired:
            self.table = torch.full((cap, 2), EMPTY, dtype=torch.int64)
            self.keys, self.vals = self.table[:, 0], self.table[:, 1]
        else:
            self.keys = torch.full((cap,), EMPTY, dtype=torch.int64, device=self.device)
            self.vals = torch.full((cap,), EMPTY, dtype=torch.int64, device=self.device)

    @property
    def capacity(self) -> int:
        return self.keys.numel()

    @property
    def nbytes(self) -> int:
        return 16 * self.capacity

    def __len__(self) -> int:
        return self.size

    def _find(self, keys: torch.Tensor) -> torch.Tensor:
        """Table position of each key, -1 where absent."""
        mask = self.capacity - 1
        pos = _slot_hash(keys, mask)
        if probe_cpu.usable(self.keys, keys):             # one compiled loop, same answers
            return probe_cpu.find_positions(self.keys, keys, pos)
        return hash_probe.find_positions(self.keys, keys, pos)

    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """Value of each key, -1 where absent."""
        if self.paired:
            return probe_cpu.pair_lookup(self.table, keys.to(torch.int64))
        if probe_cpu.usable(self.keys, keys):             # the value read in the probe loop
            return probe_cpu.find_positions(self.keys, keys, _slot_hash(keys, self.capacity - 1),
                                            self.vals)
        pos = self._find(keys)
        return torch.where(pos >= 0, self.vals[pos.clamp(min=0)], -1)

    def insert(self, keys: torch.Tensor, vals: torch.Tensor) -> None:
        """Insert keys that are unique and absent."""
        vals = vals.to(torch.int64)          # the table's dtype, on either path
        n = keys.numel()
        if n == 0:
            return
        if 2 * (self.size + self.tombstones + n) > self.capacity:
            self._rebuild(self.size + n)
        self._place(keys, vals)
        self.size += n

    def remove(self, keys: torch.Tensor) -> torch.Tensor:
        """Remove present keys (absent ones are ignored); returns their values (-1 if absent)."""
        if self.paired:
            vals, n = probe_cpu.pair_remove(self.table, keys.to(torch.int64))
            self.size -= n
            return vals
        pos = self._find(keys)
        vals = torch.where(pos >= 0, self.vals.index_select(0, pos.clamp(min=0)), -1)
        present = pos[pos >= 0]
        self.keys[present] = TOMBSTONE
        self.vals[present] = EMPTY
        self.size -= present.numel()
        self.tombstones += present.numel()
        return vals

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of every live entry, in table order."""
        live = self.keys >= 0
        return self.keys[live], self.vals[live]

    def _place(self, keys: torch.Tensor, vals: torch.Tensor) -> None:
        if self.paired:
            probe_cpu.pair_place(self.table, keys.to(torch.int64), vals)
            return
        mask = self.capacity - 1
        pos = _slot_hash(keys, mask)
        if probe_cpu.usable(self.keys, keys) and self.keys.is_contiguous():
            probe_cpu.place(self.keys, self.vals, keys, vals, pos)
            return
        hash_probe.place(self.keys, self.vals, keys, vals, pos)

    def _rebuild(self, min_live: int) -> None:
        keys, vals = self.items()
        cap = self.capacity
        while 4 * min_live > cap:
            cap *= 2
        self._alloc(cap)
        self.tombstones = 0
        self._place(keys, vals)
