"""What the model sees of a batch's keys: F fixed fields and M pooled multi-hot fields.

One batch's keys, as the store sees them, are one flat int64 array: the fixed
keys ``keys [B, F]`` row-major, then each multi-hot field's jagged values
(`Batch.jagged`) in field order.  Its unique keys are the working set (every
occurrence counted: CowClip's `cnt`), and `inverse` maps each of those keys
to its unique row.  `field_inputs` turns the unique rows back into the
model's inputs::

    emb  [B, F + M, d]   fixed fields gathered, then each multi-hot field pooled (sum | mean)
    lin  [B, F + M]      the rows' linear weight, gathered / pooled the same way

so DeepFM, W&D, DCN and DCNv2 take n_fields = F + M and need no change.
The trainer (`Trainer._forward`, `predict`) and the serving `Scorer` share it,
which keeps their scores bit for bit the same.

Wider fields (a schema's per-field ``embed_dim`` = k x d, `FieldRows`): such a
field's key brings k rows, its own and k - 1 derived from it (`derive_keys`),
and counts as k fields side by side, so its whole k x d vector reaches the
DNN and cross nets while the store keeps one row width.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from stream_ctr.connectors.batch import Batch
from stream_ctr.connectors.schema import SchemaError
from stream_ctr.ops.embedding_gather import gather_rows
from stream_ctr.ops.jagged_pool import jagged_pool

_SIGN_MASK = np.uint64((1 << 63) - 1)          # keys are 63-bit signs


@dataclass(frozen=True)
class FieldRows:
    """Store rows per model field: k for a field k x model.embed_dim wide."""
    fixed: tuple[int, ...]                      # per key column (`Batch.keys`)
    multi: tuple[int, ...]                      # per multi-hot field (`Batch.jagged`)

    @property
    def n_inputs(self) -> int:
        """Row-wide fields the model takes: sum of k."""
        return sum(self.fixed) + sum(self.multi)

    def keys_per_record(self, max_lens: Sequence[int]) -> int:
        """The most keys one record brings, its multi-hot lists at most `max_lens` long."""
        return sum(self.fixed) + sum(k * n for k, n in zip(self.multi, max_lens))


def field_rows(fmt, embed_dim: int) -> FieldRows | None:
    """The rows of each field of `fmt` (a Schema's `embed_dims`); None when every field
    is model.embed_dim wide, as the built-in formats always are."""
    dims = tuple(getattr(fmt, "embed_dims", ()))
    if not any(dims):
        return None
    names = tuple(fmt.key_fields) + tuple(f.name for f in fmt.multi_fields)
    rows = []
    for name, dim in zip(names, dims):
        if dim % embed_dim:
            raise SchemaError(f"field {name!r}: embed_dim {dim} is not a multiple of model.embed_dim "
                              f"{embed_dim}; a field is stored as whole rows of model.embed_dim")
        rows.append(max(dim // embed_dim, 1))
    return FieldRows(tuple(rows[:fmt.n_keys]), tuple(rows[fmt.n_keys:]))


def model_fields(fmt, embed_dim: int) -> tuple[int, int, FieldRows | None]:
    """(fields the model takes, the most keys one record brings, `field_rows`) of records
    of `fmt` (a RecordFormat or Schema): what a Trainer or Scorer is built with."""
    rows = field_rows(fmt, embed_dim)
    if rows is None:
        return fmt.n_model_fields, fmt.max_keys_per_record, None
    return rows.n_inputs, rows.keys_per_record([f.max_len for f in fmt.multi_fields]), rows


def derive_keys(keys: np.ndarray, j: int) -> np.ndarray:
    """The key of row j (>= 1) of each of `keys` (splitmix64 of key + j * golden ratio):
    a fixed function, so training and serving find the same rows."""
    with np.errstate(over="ignore"):
        z = keys.astype(np.uint64) + np.uint64(j) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z & _SIGN_MASK).astype(np.int64)


def _jagged_rows(batch: Batch, rows: FieldRows | None) -> list[tuple[np.ndarray, np.ndarray, str]]:
    """(values, offsets, pooling) of each multi-hot model field, a wide field's derived
    rows beside its own (they share its offsets)."""
    fields = [(j.values, j.offsets, j.pooling) for j in batch.jagged]
    if rows is None:
        return fields
    return [(values if j == 0 else derive_keys(values, j), offsets, pooling)
            for (values, offsets, pooling), k in zip(fields, rows.multi) for j in range(k)]


def _fixed_keys(batch: Batch, rows: FieldRows | None) -> np.ndarray:
    """Fixed keys [B, F'], a wide field's derived rows beside its own."""
    if rows is None:
        return batch.keys
    return np.stack([column if j == 0 else derive_keys(column, j)
                     for column, k in zip(batch.keys.T, rows.fixed) for j in range(k)], axis=1)


def batch_keys(batch: Batch, rows: FieldRows | None = None) -> np.ndarray:
    """int64 [B*F + N_1 + ... + N_M]: fixed keys row-major, then each multi-hot field's
    values (with `rows`, F and M count each wide field's k rows)."""
    fixed = _fixed_keys(batch, rows).reshape(-1)
    if not batch.jagged:
        return fixed
    return np.concatenate([fixed] + [values for values, _, _ in _jagged_rows(batch, rows)])


def field_inputs(rows: torch.Tensor, inverse: torch.Tensor, batch: Batch, d: int,
                 field_rows: FieldRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(emb [B, F + M, d], lin [B, F + M]) from unique rows [U, d + 1] and `inverse`, each
    key's index into them, in `batch_keys` order (the same `field_rows`; only the layout
    is needed here, so no key is derived a second time).

    Fixed fields: embedding and linear columns are split at the unique-row level,
    so the backward of the split touches [U, d+1], not [B, F, d+1].  Multi-hot
    fields pool whole rows (embedding and linear weight together)."""
    b = batch.keys.shape[0]
    f = sum(field_rows.fixed) if field_rows is not None else batch.keys.shape[1]
    n_fixed = b * f
    emb = gather_rows(rows[:, :d].contiguous(), inverse[:n_fixed]).view(b, f, d)
    # Not rows[:, d][inverse]: under deterministic algorithms that indexing's backward is a
    # sort-based accumulate that took 12 of a 35 ms step at batch 131,072 on an H200.
    lin = gather_rows(rows[:, d:], inverse[:n_fixed]).view(b, f)
    if not batch.jagged:
        return emb, lin
    multi_rows = field_rows.multi if field_rows is not None else (1,) * len(batch.jagged)
    pooled, at = [], n_fixed
    for jag, k in zip(batch.jagged, multi_rows):
        n = len(jag.values)
        offsets = torch.from_numpy(jag.offsets).to(rows.device, non_blocking=True)
        for _ in range(k):          # a wide field's rows follow one another in `inverse`
            pooled.append(jagged_pool(rows, inverse[at:at + n], offsets, jag.pooling == "mean"))
            at += n
    multi = torch.stack(pooled, dim=1)                          # [B, M, d + 1]
    return torch.cat([emb, multi[:, :, :d]], dim=1), torch.cat([lin, multi[:, :, d]], dim=1)
