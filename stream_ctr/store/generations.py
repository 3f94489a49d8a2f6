"""Checkpoint generations of the LMDB tier: commit, roll back, read an old one.

See lmdb_tier.py for the scheme (rows + per-generation undo logs). These are
the three operations that touch several generations at once; each write is
ONE LMDB transaction, so a crash at any point leaves the store at its
previous commit and every retained checkpoint restorable.
"""
from __future__ import annotations

import secrets

import lmdb
import numpy as np

from stream_ctr.store.errors import StoreError
from stream_ctr.store.layout import decode_keys, encode_keys
from stream_ctr.store.lmdb_tier import LmdbTier, WriteBatch

_CHUNK = 65536             # undo entries read and applied (sorted) at a time


def commit_checkpoint(tier: LmdbTier, batch: WriteBatch) -> tuple[int, str]:
    """Write `batch` (the dirty resident rows) and commit it as the next generation,
    in one transaction. Returns (generation, nonce). Blocks until the commit is on disk."""
    gen, nonce = tier.open_generation, secrets.token_hex(8)
    # Oldest undo log still needed: the `keep` newest checkpoints stay restorable, plus one
    # generation of slack (a commit whose manifest failed, a step checkpointed twice).
    floor = max(tier.undo_from, gen - tier.keep + 1)

    def finish(txn: lmdb.Transaction, seq: int) -> int:
        txn.put(b"generation", str(gen).encode(), db=tier.meta_db)
        txn.put(b"nonce.%016x" % gen, nonce.encode(), db=tier.meta_db)
        txn.put(b"undo_from", str(floor).encode(), db=tier.meta_db)
        for old in (g for g in tier.undo_generations() if g < floor):
            txn.drop(tier._undo_db(txn, old), delete=True)
        for old in range(max(1, floor - 1 - 2 * tier.keep), floor - 1):
            txn.delete(b"nonce.%016x" % old, db=tier.meta_db)
        return 0                  # the generation that opens has no undo entries yet

    tier._retry(lambda: tier._commit(batch, finish))
    tier.env.sync(True)
    tier.generation, tier.undo_from = gen, floor
    return gen, nonce


def check_restorable(tier: LmdbTier, gen: int, nonce: str) -> None:
    if gen > tier.generation:
        raise StoreError(f"the checkpoint needs generation {gen} of the LMDB store at {tier.path}, "
                         f"which is only at generation {tier.generation}: is store.store_dir the "
                         "directory this checkpoint was trained with?")
    if gen >= 1 and gen + 1 < tier.undo_from and any(g > gen for g in tier.undo_generations()):
        raise StoreError(f"the LMDB store at {tier.path} can no longer go back to generation {gen}: "
                         f"its undo logs start at generation {tier.undo_from} "
                         "(only the newest train.keep_checkpoints checkpoints can be resumed)")
    if gen >= 1 and tier.nonce(gen) != nonce:
        raise StoreError(f"generation {gen} of the LMDB store at {tier.path} is not the one this "
                         "checkpoint committed (the store was rolled back past it, or belongs to another run)")


def rollback(tier: LmdbTier, gen: int, nonce: str = "") -> int:
    """Bring `rows` back to generation `gen` (0: empty), in one transaction.

    Applies the undo logs newer than `gen`, newest first and each from its
    end, so the oldest logged value of a key is the one that stays. Returns
    the number of undo entries applied.
    """
    check_restorable(tier, gen, nonce)
    newer = sorted((g for g in tier.undo_generations() if g > gen), reverse=True)
    applied = [0]

    def undo(txn: lmdb.Transaction, _seq: int) -> int:
        applied[0] = 0
        if gen == 0:
            txn.drop(tier.rows_db, delete=False)
        for g in newer:
            db = tier._undo_db(txn, g)
            if gen > 0:
                cur = txn.cursor(db=db)
                more = cur.last()
                while more:
                    vals = []
                    while more and len(vals) < _CHUNK:
                        vals.append(cur.value())
                        more = cur.prev()
                    _apply_old_values(tier, txn, vals)
                    applied[0] += len(vals)
            txn.drop(db, delete=True)
        txn.put(b"generation", str(gen).encode(), db=tier.meta_db)
        if gen == 0:
            txn.put(b"undo_from", b"2", db=tier.meta_db)
        for g in range(gen + 1, tier.generation + 1):
            txn.delete(b"nonce.%016x" % g, db=tier.meta_db)
        return 0

    tier._retry(lambda: tier._commit(WriteBatch(), undo))
    tier.env.sync(True)
    tier.forget_key_filter()            # the undo logs put deleted rows back
    tier.generation = gen
    if gen == 0:
        tier.undo_from = 2
    return applied[0]


def _apply_old_values(tier: LmdbTier, txn: lmdb.Transaction, vals: list[bytes]) -> None:
    """Undo entries in application order (newest first): the last one per key wins."""
    keys = decode_keys(b"".join(bytes(v[:8]) for v in vals))
    # Last occurrence of each key in `vals` = first occurrence in the reversed list.
    uniq, first_rev = np.unique(keys[::-1], return_index=True)
    last = len(vals) - 1 - first_rev
    present = np.array([len(vals[i]) > 8 for i in last], dtype=bool)
    if present.any():
        idx = last[present]
        rows = np.frombuffer(b"".join(bytes(vals[i][8:]) for i in idx), np.uint8).reshape(len(idx), -1)
        tier.putmulti(txn, uniq[present], rows)
    for k in encode_keys(uniq[~present]):
        txn.delete(k, db=tier.rows_db)


class GenerationView:
    """Reads `rows` as of an older generation without writing anything.

    Holds one read transaction (a consistent snapshot, even while a trainer
    keeps writing) and the oldest logged value of every key changed since
    `gen`, in memory: its size is the undo volume since that checkpoint.
    """

    def __init__(self, tier: LmdbTier, gen: int, nonce: str) -> None:
        check_restorable(tier, gen, nonce)
        self.tier = tier
        self.txn = tier.env.begin(db=tier.rows_db)
        keys, present, rows = [], [], []
        for g in sorted(x for x in tier.undo_generations() if x > gen):
            for _, v in self.txn.cursor(db=tier._undo_db(self.txn, g)):
                keys.append(bytes(v[:8]))
                present.append(len(v) > 8)
                rows.append(bytes(v[8:]))
        k = decode_keys(b"".join(keys))
        self.keys, first = np.unique(k, return_index=True)        # first logged value wins
        self.present = np.array(present, dtype=bool)[first]
        w = tier.layout.row_bytes
        self.rows = np.zeros((len(self.keys), w), np.uint8)
        chosen = [rows[i] for i, p in zip(first, self.present) if p]
        if chosen:
            self.rows[self.present] = np.frombuffer(b"".join(chosen), np.uint8).reshape(-1, w)

    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Like LmdbTier.get, as of the view's generation."""
        found = np.zeros(len(keys), dtype=bool)
        out = np.zeros((len(keys), self.tier.layout.row_bytes), np.uint8)
        logged = np.zeros(len(keys), dtype=bool)
        if len(self.keys):
            pos = np.searchsorted(self.keys, keys).clip(max=len(self.keys) - 1)
            logged = self.keys[pos] == keys
            from_log = logged & self.present[pos]
            out[from_log] = self.rows[pos[from_log]]
            found[from_log] = True
        rest = np.nonzero(~logged)[0]
        if len(rest):
            fk, rows = self.tier._getmulti(self.txn, keys[rest])
            hit = rest[np.searchsorted(keys[rest], fk)]
            out[hit] = rows
            found[hit] = True
        return found, out[found]

    def close(self) -> None:
        self.txn.abort()
