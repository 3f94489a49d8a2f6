"""A vectorized open-addressing hash map from int64 feature signs to row ids.

Every operation works on whole tensors of keys (no per-key Python), on CPU or
on CUDA tensors alike: linear probing from a hashed start slot, at a load of
at most 1/2. On the CPU lookups and inserts are compiled loops (`probe_cpu`);
elsewhere `ops.hash_probe`: one Triton launch per lookup or insert on CUDA,
torch probe rounds where Triton is missing or the reference is forced. All
paths give the same answers.

Row ids are handed out densely (0, 1, 2, ...) in the order keys are inserted,
so the row a key gets does not depend on where it landed in the slot array:
two runs that insert the same keys in the same order agree on every row id.
"""
from __future__ import annotations

import torch

from stream_ctr.ops import hash_probe
from stream_ctr.store import probe_cpu

EMPTY = -1                      # feature signs are non-negative, so -1 marks a free slot
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
_MIX = -4658895280553007687     # 0xBF58476D1CE4E5B9 as a signed int64


def _slot_hash(keys: torch.Tensor, mask: int) -> torch.Tensor:
    # splitmix64-style mixing; int64 products wrap, and shifts are made
    # logical by masking off the sign-extended bits.
    x = keys * _GOLDEN
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    x = x * _MIX
    x = x ^ ((x >> 29) & ((1 << 35) - 1))
    return x & mask


class KeyIndex:
    """int64 key -> int64 row id, growable, with a load factor of at most 1/2."""

    def __init__(self, capacity: int = 1024, device: torch.device | str = "cpu") -> None:
        cap = 1 << max(4, (max(1, capacity) - 1).bit_length())
        self.device = torch.device(device)
        self.slot_keys = torch.full((cap,), EMPTY, dtype=torch.int64, device=self.device)
        self.slot_rows = torch.full((cap,), EMPTY, dtype=torch.int64, device=self.device)
        self.size = 0

    @property
    def capacity(self) -> int:
        return self.slot_keys.numel()

    def __len__(self) -> int:
        return self.size

    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """Row id of each key, or -1 where the key is absent."""
        mask = self.capacity - 1
        if probe_cpu.usable(self.slot_keys, keys):
            return probe_cpu.find_positions(self.slot_keys, keys, _slot_hash(keys, mask), self.slot_rows)
        return hash_probe.find_positions(self.slot_keys, keys, _slot_hash(keys, mask), self.slot_rows)

    def insert(self, keys: torch.Tensor) -> torch.Tensor:
        """Insert keys that are unique and absent; return their new row ids.

        Row ids are `len(self) + arange(len(keys))` in the order given.
        """
        n = keys.numel()
        if 2 * (self.size + n) > self.capacity:
            self._grow(self.size + n)
        rows = torch.arange(self.size, self.size + n, dtype=torch.int64, device=keys.device)
        self._place(keys, rows)
        self.size += n
        return rows

    def lookup_or_insert(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ids for unique `keys`, inserting the absent ones; also the mask of new keys."""
        rows = self.lookup(keys)
        new = rows < 0
        if bool(new.any()):
            rows[new] = self.insert(keys[new])
        return rows, new

    def _place(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        mask = self.capacity - 1
        if probe_cpu.usable(self.slot_keys, keys) and self.slot_keys.is_contiguous():
            probe_cpu.place(self.slot_keys, self.slot_rows, keys, rows, _slot_hash(keys, mask))
            return
        hash_probe.place(self.slot_keys, self.slot_rows, keys, rows, _slot_hash(keys, mask))

    def _grow(self, min_size: int) -> None:
        cap = self.capacity
        while 2 * min_size > cap:
            cap *= 2
        used = self.slot_keys != EMPTY
        keys, rows = self.slot_keys[used], self.slot_rows[used]
        self.slot_keys = torch.full((cap,), EMPTY, dtype=torch.int64, device=self.device)
        self.slot_rows = torch.full((cap,), EMPTY, dtype=torch.int64, device=self.device)
        self._place(keys, rows)

    def keys_by_row(self) -> torch.Tensor:
        """All keys, ordered by their row id (for checkpoints)."""
        used = self.slot_keys != EMPTY
        out = torch.empty(self.size, dtype=torch.int64, device=self.device)
        out[self.slot_rows[used]] = self.slot_keys[used]
        return out

    @staticmethod
    def from_keys(keys_by_row: torch.Tensor, device: torch.device | str = "cpu") -> "KeyIndex":
        """Rebuild an index in which key `keys_by_row[i]` has row id i."""
        index = KeyIndex(2 * keys_by_row.numel(), device)
        index.insert(keys_by_row.to(index.device))
        return index
