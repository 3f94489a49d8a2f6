"""What the tiered store writes to LMDB, and how each old value gets logged.

Every resident row carries in its `write_gen` metadata the LMDB generation its
disk copy was written in; against the open generation O of the LMDB tier:

    -1         no disk copy            its first write logs "absent"
    O          written (so logged) in O   no log
    0 < g < O  disk copy from gen g    its first write in O logs the value on
                                       disk, read inside the write transaction
                                       (that read pages in the leaf the put needs)

So undo logs hold exactly the rows changed since the last checkpoint, and a
rollback restores only those. These helpers build the WriteBatch for a set of
rows and run the disk sweep (TTL and the disk budget).
"""
from __future__ import annotations

import numpy as np
import torch

from stream_ctr.store.device_cache import Rows
from stream_ctr.store.layout import WRITE_GEN, RowLayout
from stream_ctr.store.lmdb_tier import ABSENT, NONE, READ, LmdbTier, WriteBatch
from stream_ctr.store.policies import expired, priority, select_victims


def old_value_logging(write_gen: np.ndarray, open_gen: int) -> np.ndarray:
    """Per row: NONE, ABSENT or READ (see module doc)."""
    out = np.full(len(write_gen), READ, dtype=np.int8)
    out[write_gen == open_gen] = NONE
    out[write_gen < 0] = ABSENT
    return out


def put_batch(rows: Rows, layout: RowLayout, open_gen: int) -> WriteBatch:
    """Writes of `rows` (CPU), in key order."""
    keys = rows.keys.numpy()
    order = np.argsort(keys, kind="stable")
    packed = rows.packed.numpy()[order]
    wg = layout.meta(rows.packed).numpy()[order, WRITE_GEN]
    return WriteBatch(put_keys=keys[order], put_rows=packed, put_old=old_value_logging(wg, open_gen))


def delete_batch(rows: Rows, layout: RowLayout, open_gen: int) -> WriteBatch:
    """Deletions of the disk copies of resident `rows` (CPU) that have one."""
    wg = layout.meta(rows.packed).numpy()[:, WRITE_GEN]
    on_disk = wg >= 0
    keys = rows.keys.numpy()[on_disk]
    order = np.argsort(keys, kind="stable")
    return WriteBatch(del_keys=keys[order], del_old=old_value_logging(wg[on_disk][order], open_gen))


def merge(*batches: WriteBatch) -> WriteBatch:
    """One batch with the changes of several (on disjoint keys); puts stay in key order."""
    def cat(name: str, width: int | None = None) -> np.ndarray | None:
        parts = [getattr(b, name) for b in batches if len(getattr(b, name.replace("rows", "keys")))]
        if not parts:
            return None if width is not None else getattr(batches[0], name)[:0]
        return np.concatenate(parts)
    puts = cat("put_keys")
    order = np.argsort(puts, kind="stable")
    rows = cat("put_rows", 0)
    return WriteBatch(put_keys=puts[order], put_rows=None if rows is None else rows[order],
                      put_old=cat("put_old")[order] if len(puts) else np.zeros(0, np.int8),
                      del_keys=cat("del_keys"), del_old=cat("del_old"),
                      undo_keys=cat("undo_keys"), undo_rows=cat("undo_rows", 0))


def sweep(tier: LmdbTier, start: int, max_rows: int, over_budget: int,
          resident: "callable", clock: int, newest_event_ms: int, ttl_steps: int,
          ttl_seconds: int, policy: str) -> tuple[WriteBatch, dict[str, int], int]:
    """Scan up to `max_rows` disk rows from key `start`; delete the expired ones and,
    while the table is `over_budget` rows too big, the lowest-priority others.

    Rows resident in the cache or RAM are skipped (their copy up there is the
    live one). The capacity choice is sampled: the victims are the lowest
    (policy) priority rows of the scanned window, not of the whole table.
    Returns the deletions, counts by reason, and the key to continue from.
    """
    keys, rows, nxt = tier.scan(start, max_rows)
    counts = {"ttl_steps": 0, "ttl_seconds": 0, "disk_capacity": 0}
    if len(keys) == 0:
        return WriteBatch(), counts, nxt
    keep = ~resident(torch.from_numpy(keys)).numpy()
    keys, rows = keys[keep], rows[keep]
    meta = torch.from_numpy(rows[:, tier.layout.meta_off:].view(np.int64).copy())
    by_steps, by_seconds = expired(meta, clock, newest_event_ms, ttl_steps, ttl_seconds)
    victims = (by_steps | by_seconds).numpy()
    counts["ttl_steps"], counts["ttl_seconds"] = int(by_steps.sum()), int(by_seconds.sum())
    extra = over_budget - int(victims.sum())
    if extra > 0:
        prio = priority(meta, policy)
        prio[torch.from_numpy(victims)] = torch.iinfo(torch.int64).max
        chosen = select_victims(prio, torch.from_numpy(keys), extra).numpy()
        victims[chosen] = True
        counts["disk_capacity"] = len(chosen)
    dk, drows = keys[victims], rows[victims]
    wg = drows[:, tier.layout.meta_off:].view(np.int64)[:, WRITE_GEN]
    log = tier.logs_undo & (wg < tier.open_generation)
    batch = WriteBatch(del_keys=dk, del_old=np.full(len(dk), NONE, np.int8),
                       undo_keys=dk[log], undo_rows=drows[log].copy())
    return batch, counts, nxt
