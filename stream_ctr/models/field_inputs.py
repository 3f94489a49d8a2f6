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
"""
from __future__ import annotations

import numpy as np
import torch

from stream_ctr.connectors.batch import Batch
from stream_ctr.ops.embedding_gather import gather_rows
from stream_ctr.ops.jagged_pool import jagged_pool


def batch_keys(batch: Batch) -> np.ndarray:
    """int64 [B*F + N_1 + ... + N_M]: fixed keys row-major, then each multi-hot field's values."""
    if not batch.jagged:
        return batch.keys.reshape(-1)
    return np.concatenate([batch.keys.reshape(-1)] + [j.values for j in batch.jagged])


def field_inputs(rows: torch.Tensor, inverse: torch.Tensor, batch: Batch, d: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(emb [B, F + M, d], lin [B, F + M]) from unique rows [U, d + 1] and `inverse`, each
    key's index into them, in `batch_keys` order.

    Fixed fields: embedding and linear columns are split at the unique-row level,
    so the backward of the split touches [U, d+1], not [B, F, d+1].  Multi-hot
    fields pool whole rows (embedding and linear weight together)."""
    b, f = batch.keys.shape
    n_fixed = b * f
    emb = gather_rows(rows[:, :d].contiguous(), inverse[:n_fixed]).view(b, f, d)
    lin = rows[:, d][inverse[:n_fixed]].view(b, f)
    if not batch.jagged:
        return emb, lin
    pooled, at = [], n_fixed
    for jag in batch.jagged:
        n = len(jag.values)
        offsets = torch.from_numpy(jag.offsets).to(rows.device, non_blocking=True)
        pooled.append(jagged_pool(rows, inverse[at:at + n], offsets, jag.pooling == "mean"))
        at += n
    multi = torch.stack(pooled, dim=1)                          # [B, M, d + 1]
    return torch.cat([emb, multi[:, :, :d]], dim=1), torch.cat([lin, multi[:, :, d]], dim=1)
