"""Compiled CPU loops for the hash maps' lookups and inserts (`KeyIndex`, `SlotIndex`).

`find_positions(table_keys, keys, start)` returns what the vectorized probe
rounds return: the table position holding each key, -1 where the key is
absent.  The same linear probing from the same start (`_slot_hash`), one slot
at a time until the key or a free slot: anything else (another key, a
tombstone) is probed past.  The rounds gather windows for every unresolved
key, which on the CPU costs ~18x a plain loop: 3.8 ms against 0.21 ms for the
43K unique keys of a batch of 8,192 Criteo records (2-vCPU EPYC).

`place(table_keys, table_vals, keys, vals, start)` inserts keys that are
unique and absent, each in the first free slot of its probe sequence (never a
tombstone), as the vectorized rounds do; they may pick another free slot when
keys race for one, which no lookup can tell apart.  43K new keys: 23 ms in
rounds.

Only CPU int64 tensors come here; on CUDA the maps go to `ops.hash_probe`
(one Triton launch per lookup or insert).
"""
from __future__ import annotations

from functools import cache

import torch

EMPTY = -1                      # a free slot (feature signs are non-negative)


def usable(table_keys: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether `find_positions` takes these tensors (both int64 on the CPU)."""
    return (table_keys.device.type == "cpu" and keys.device.type == "cpu"
            and table_keys.dtype == torch.int64 and keys.dtype == torch.int64)


def find_positions(table_keys: torch.Tensor, keys: torch.Tensor, start: torch.Tensor,
                   table_vals: torch.Tensor | None = None) -> torch.Tensor:
    """Table position of each of `keys`, -1 where absent, probing from `start`; with
    `table_vals`, the value at that position instead (-1 where absent), read in the same
    loop (a separate gather of 43K positions took 0.5-1.9 ms)."""
    out = torch.empty_like(keys)
    if keys.numel():
        vals = table_keys if table_vals is None else table_vals
        _kernel()(table_keys.contiguous().numpy(), keys.contiguous().numpy(),
                  start.contiguous().numpy(), vals.contiguous().numpy(), table_vals is not None,
                  out.numpy())
    return out


def place(table_keys: torch.Tensor, table_vals: torch.Tensor, keys: torch.Tensor,
          vals: torch.Tensor, start: torch.Tensor) -> None:
    """Write each key and its value in the first free slot from `start` (in place).
    The table must have a free slot for every key (the maps grow first)."""
    if keys.numel():
        _place_kernel()(table_keys.numpy(), table_vals.numpy(), keys.contiguous().numpy(),
                        vals.contiguous().numpy(), start.contiguous().numpy())


@cache
def _place_kernel():
    from numba import njit

    @njit(nogil=True, cache=True)
    def place_keys(table_keys, table_vals, keys, vals, start):
        mask = table_keys.shape[0] - 1
        for i in range(keys.shape[0]):
            p = start[i]
            n = 0
            while table_keys[p] != EMPTY:
                p = (p + 1) & mask
                n += 1
                if n > mask:
                    raise ValueError("hash map full: no free slot")
            table_keys[p] = keys[i]
            table_vals[p] = vals[i]
    return place_keys


@cache
def _kernel():
    # Compiled on the first call (about a second; cached in __pycache__ after that).
    from numba import njit

    @njit(nogil=True, cache=True)
    def find(table_keys, keys, start, table_vals, values, out):
        mask = table_keys.shape[0] - 1
        for i in range(keys.shape[0]):
            k = keys[i]
            p = start[i]
            out[i] = EMPTY
            for _ in range(table_keys.shape[0]):        # a full table cannot loop forever
                s = table_keys[p]
                if s == k:
                    out[i] = table_vals[p] if values else p
                    break
                if s == EMPTY:
                    break
                p = (p + 1) & mask
    return find


# ---- key/value pairs side by side (`SlotIndex` on the CPU) -------------------------------
# A table [capacity, 2] int64 of (key, value) rows: a probe finds the value in the cache
# line it read the key from, and the start slot is hashed inside the loop (the same
# splitmix64 mix as `key_index._slot_hash`) instead of by five torch ops over the keys.


def pair_lookup(table: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Value of each of `keys` in a pair table, -1 where absent."""
    out = torch.empty_like(keys)
    if keys.numel():
        _pair_kernels()[0](table.numpy(), keys.contiguous().numpy(), out.numpy(), False)
    return out


def pair_place(table: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor) -> None:
    """Insert unique, absent keys, each in the first free slot of its probe sequence.
    The table must have a free slot for every key."""
    if keys.numel():
        _pair_kernels()[1](table.numpy(), keys.contiguous().numpy(), vals.contiguous().numpy())


def pair_remove(table: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Remove `keys` (absent ones are ignored): (their values, -1 where absent; how many
    were removed). Leaves no tombstone: later entries of the probe run shift back."""
    out = torch.empty_like(keys)
    if not keys.numel():
        return out, 0
    return out, int(_pair_kernels()[0](table.numpy(), keys.contiguous().numpy(), out.numpy(), True))


@cache
def _pair_kernels():
    # Each loop is self-contained (the hash written out in each): a compiled function that
    # calls another one defined here is not found in numba's cache by a new process.
    from numba import njit

    @njit(nogil=True, cache=True)
    def place(table, keys, vals):
        mask = table.shape[0] - 1
        for i in range(keys.shape[0]):
            x = keys[i] * -7046029254386353131
            x = x ^ ((x >> 31) & ((1 << 33) - 1))
            x = x * -4658895280553007687
            p = (x ^ ((x >> 29) & ((1 << 35) - 1))) & mask
            n = 0
            while table[p, 0] != EMPTY:
                p = (p + 1) & mask
                n += 1
                if n > mask:
                    raise ValueError("hash map full: no free slot")
            table[p, 0] = keys[i]
            table[p, 1] = vals[i]

    @njit(nogil=True, cache=True)
    def find(table, keys, out, remove):
        """out[i]: the value of keys[i], -1 where absent; with `remove`, the entries found
        are removed too. Returns how many were found."""
        # Backward-shift deletion: the entries after a removed one that would no longer
        # be found from their start slot move back into the gap, so the table never holds
        # tombstones and lookups stay as short as the live load makes them (a spill's
        # index collects tombstones three times its live keys between rebuilds, and its
        # lookups were 5x slower for them).
        mask = table.shape[0] - 1
        n = 0
        for i in range(keys.shape[0]):
            k = keys[i]
            x = k * -7046029254386353131
            x = x ^ ((x >> 31) & ((1 << 33) - 1))
            x = x * -4658895280553007687
            p = (x ^ ((x >> 29) & ((1 << 35) - 1))) & mask
            out[i] = EMPTY
            found = False
            for _ in range(table.shape[0]):         # a full table cannot loop forever
                s = table[p, 0]
                if s == k:
                    found = True
                    break
                if s == EMPTY:
                    break
                p = (p + 1) & mask
            if not found:
                continue
            out[i] = table[p, 1]
            n += 1
            if not remove:
                continue
            j = p
            while True:
                j = (j + 1) & mask
                kj = table[j, 0]
                if kj == EMPTY:
                    break
                x = kj * -7046029254386353131
                x = x ^ ((x >> 31) & ((1 << 33) - 1))
                x = x * -4658895280553007687
                h = (x ^ ((x >> 29) & ((1 << 35) - 1))) & mask
                # The entry at j stays if its start slot h lies cyclically in (p, j].
                if (p <= j and p < h <= j) or (p > j and (h > p or h <= j)):
                    continue
                table[p, 0] = kj
                table[p, 1] = table[j, 1]
                p = j
            table[p, 0] = EMPTY
            table[p, 1] = EMPTY
        return n

    return find, place
