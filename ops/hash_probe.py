"""Lookups and inserts of the stores' open-addressing hash maps, one launch each on a GPU.

The maps (`store.key_index.KeyIndex`, `store.slot_index.SlotIndex`) keep int64
keys in a power-of-two table, probed linearly from a start slot the caller
hashes. Two operations, each with the same answers on every path:

- `find_positions(table_keys, keys, start, table_vals=None)`: the table
  position holding each key, -1 where it is absent (or, with `table_vals`, the
  value at that position). A probe stops at the key or at a free slot (-1);
  anything else, another key or a tombstone (-2), is probed past.
- `place(table_keys, table_vals, keys, vals, start)`: write keys that are
  unique and absent, each in the first free slot of its probe sequence (never
  a tombstone), and its value beside it. Keys racing for one free slot may
  end up in another order along the sequence than the reference puts them,
  which no lookup can tell apart. A key given twice, or one already present,
  is outside the contract (the paths differ then). The table must keep a free
  slot for every key, which the maps ensure by growing first at half load; a
  key that finds none after probing the whole table raises ValueError ("hash
  map full"), as the CPU loop does, rather than probing forever.

Paths: on CUDA a Triton kernel, one lane per key walking its sequence (the
inserts claim a slot with an atomic compare-and-swap, then read back one count
of keys left without a slot: a host sync); elsewhere the torch
reference, one gather per probe round for every unresolved key. The rounds
cost a host sync and about ten launches each, and a batch takes 3-20 of them:
on an H100 a DeepFM step of 8,192 spent 8 of its 12 ms there while the GPU
worked 2.9 ms. The stores run CPU tables through their own compiled loops
(`store.probe_cpu`), not through here.
"""
from __future__ import annotations

from functools import cache

import torch

from .dispatch import check_triton_device, use_triton

EMPTY = -1                  # a free slot (feature signs are non-negative)
_BLOCK = 256


def find_positions(table_keys: torch.Tensor, keys: torch.Tensor, start: torch.Tensor,
                   table_vals: torch.Tensor | None = None) -> torch.Tensor:
    """Position of each key in `table_keys` (or its value in `table_vals`), -1 where absent."""
    if use_triton(keys):
        return find_positions_triton(table_keys, keys, start, table_vals)
    return find_positions_reference(table_keys, keys, start, table_vals)


def place(table_keys: torch.Tensor, table_vals: torch.Tensor, keys: torch.Tensor,
          vals: torch.Tensor, start: torch.Tensor) -> None:
    """Write unique, absent keys and their values into the tables (in place). The table
    must have a free slot for each (the maps grow first)."""
    if use_triton(keys):
        place_triton(table_keys, table_vals, keys, vals, start)
    else:
        place_reference(table_keys, table_vals, keys, vals, start)


def find_positions_reference(table_keys: torch.Tensor, keys: torch.Tensor, start: torch.Tensor,
                             table_vals: torch.Tensor | None = None) -> torch.Tensor:
    mask = table_keys.numel() - 1
    pos = start.clone()
    out = torch.full_like(keys, EMPTY)
    active = torch.arange(keys.numel(), device=keys.device)
    for _ in range(mask + 1):            # a full table without the key: absent
        if not active.numel():
            break
        p = pos[active]
        found = table_keys[p]
        hit = found == keys[active]
        out[active[hit]] = p[hit] if table_vals is None else table_vals[p[hit]]
        cont = ~(hit | (found == EMPTY))
        active = active[cont]
        pos[active] = (p[cont] + 1) & mask
    return out


def place_reference(table_keys: torch.Tensor, table_vals: torch.Tensor, keys: torch.Tensor,
                    vals: torch.Tensor, start: torch.Tensor) -> None:
    mask = table_keys.numel() - 1
    pos = start.clone()
    pending = torch.arange(keys.numel(), device=keys.device)
    for _ in range(2 * (mask + 1)):      # each key sees every slot; a lost race repeats one
        if not pending.numel():
            break
        p = pos[pending]
        free = table_keys[p] == EMPTY
        cand, cand_pos = pending[free], p[free]
        # Several keys may race for one free slot: one write wins, and the read-back
        # tells each key whether it was the one.
        table_keys[cand_pos] = keys[cand]
        won = table_keys[cand_pos] == keys[cand]
        table_vals[cand_pos[won]] = vals[cand[won]]
        pending = torch.cat([pending[~free], cand[~won]])
        pos[pending] = (pos[pending] + 1) & mask
    if pending.numel():
        raise ValueError("hash map full: no free slot")


def find_positions_triton(table_keys: torch.Tensor, keys: torch.Tensor, start: torch.Tensor,
                          table_vals: torch.Tensor | None = None) -> torch.Tensor:
    check_triton_device(keys)
    _check(table_keys, keys, start, table_vals)
    out = torch.empty_like(keys)
    n = keys.numel()
    if n:
        vals = table_keys if table_vals is None else table_vals
        _kernels()["find"][(triton.cdiv(n, _BLOCK),)](
            table_keys, vals, keys.contiguous(), start.contiguous(), out, n,
            table_keys.numel() - 1, WITH_VALS=table_vals is not None, BLOCK=_BLOCK)
    return out


def place_triton(table_keys: torch.Tensor, table_vals: torch.Tensor, keys: torch.Tensor,
                 vals: torch.Tensor, start: torch.Tensor) -> None:
    check_triton_device(keys)
    _check(table_keys, keys, start, table_vals)
    n = keys.numel()
    if n:
        unplaced = torch.zeros(1, dtype=torch.int32, device=keys.device)
        _kernels()["place"][(triton.cdiv(n, _BLOCK),)](
            table_keys, table_vals, keys.contiguous(), vals.to(table_vals.dtype).contiguous(),
            start.contiguous(), unplaced, n, table_keys.numel() - 1, BLOCK=_BLOCK)
        if int(unplaced.item()):           # a host sync; the maps' inserts sync anyway
            raise ValueError("hash map full: no free slot")


def _check(table_keys: torch.Tensor, keys: torch.Tensor, start: torch.Tensor,
           table_vals: torch.Tensor | None) -> None:
    cap = table_keys.numel()
    if cap & (cap - 1) or keys.dtype != torch.int64 or table_keys.dtype != torch.int64:
        raise ValueError(f"hash probe needs int64 keys and a power-of-two int64 table, got "
                         f"{keys.dtype} keys and {cap} {table_keys.dtype} slots")
    if start.shape != keys.shape:
        raise ValueError(f"one start slot per key: {tuple(start.shape)} for {tuple(keys.shape)}")
    # The kernels index the tables as flat arrays: a strided view would be read wrongly.
    if not table_keys.is_contiguous() or (table_vals is not None and (
            not table_vals.is_contiguous() or table_vals.shape != table_keys.shape)):
        raise ValueError("hash probe needs contiguous key and value tables of one shape")


def _find_kernel(table_keys_ptr, table_vals_ptr, keys_ptr, start_ptr, out_ptr, n, mask,
                 WITH_VALS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    key = tl.load(keys_ptr + offs, mask=live, other=0)
    pos = tl.load(start_ptr + offs, mask=live, other=0) & mask     # never outside the table
    out = tl.full((BLOCK,), -1, tl.int64)
    active = live
    probes = tl.zeros((BLOCK,), tl.int64)
    # A lane's walk ends at its key, at a free slot, or after the whole table (absent).
    while tl.max(active.to(tl.int32), axis=0) > 0:
        slot = tl.load(table_keys_ptr + pos, mask=active, other=-1)
        hit = active & (slot == key)
        if WITH_VALS:
            val = tl.load(table_vals_ptr + pos, mask=hit, other=-1)
            out = tl.where(hit, val, out)
        else:
            out = tl.where(hit, pos, out)
        probes += 1
        active = active & (slot != key) & (slot != -1) & (probes <= mask)
        pos = tl.where(active, (pos + 1) & mask, pos)
    tl.store(out_ptr + offs, out, mask=live)


def _place_kernel(table_keys_ptr, table_vals_ptr, keys_ptr, vals_ptr, start_ptr, unplaced_ptr,
                  n, mask, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    key = tl.load(keys_ptr + offs, mask=live, other=0)
    val = tl.load(vals_ptr + offs, mask=live, other=0)
    pos = tl.load(start_ptr + offs, mask=live, other=0) & mask
    active = live
    probes = tl.zeros((BLOCK,), tl.int64)
    unplaced = offs < 0                     # all False
    while tl.max(active.to(tl.int32), axis=0) > 0:
        # Lanes that are done compare against a value no slot holds: their CAS writes
        # nothing (atomic_cas takes no mask).
        cmp = tl.where(active, -1, -3).to(tl.int64)
        old = tl.atomic_cas(table_keys_ptr + pos, cmp, tl.where(active, key, -3))
        won = active & (old == -1)
        tl.store(table_vals_ptr + pos, val, mask=won)
        probes += 1
        active = active & (old != -1)
        full = active & (probes > mask)     # saw every slot taken: no room (the caller raises)
        unplaced = unplaced | full
        active = active & ~full
        pos = tl.where(active, (pos + 1) & mask, pos)
    tl.atomic_add(unplaced_ptr, tl.sum(unplaced.to(tl.int32), axis=0))


@cache
def _kernels() -> dict:
    # First Triton use in this process: import triton now (binding the module globals
    # the kernel bodies read) and jit the kernels once.
    global triton, tl
    import triton
    import triton.language as tl
    # The key count changes every batch: no kernel variant per n % 16 (each a compile).
    return {"find": triton.jit(_find_kernel, do_not_specialize=["n"]),
            "place": triton.jit(_place_kernel, do_not_specialize=["n"])}
