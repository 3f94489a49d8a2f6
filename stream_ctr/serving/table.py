"""The embedding rows a scorer reads: a full bundle's table under the rows deltas replaced.

    lookup(k) ──> overlay (in memory, sorted; every row a delta brought since the full snapshot)
                    └─ not there ──> base (the full bundle's keys.npy / rows.npy, memory-mapped)
                                       └─ not there ──> absent: the scorer uses the initial row

Applying a delta never copies the base: a table of any size stays on disk (page
cache), and the overlay grows only with the rows touched since the last full
snapshot. A `RowTable` is immutable: `updated` returns a new one, so the model
answering keeps its table while the next one is built, and a swap is one
pointer assignment. A delta replaces rows (it does not add to them): applying
the same delta twice gives the same table.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_EMPTY_KEYS = np.zeros(0, np.int64)


@dataclass(frozen=True)
class RowTable:
    base_keys: np.ndarray           # int64 [N] strictly increasing (memory-mapped)
    base_rows: np.ndarray           # float32 [N, cols]
    keys: np.ndarray                # int64 [M] strictly increasing: the overlay
    rows: np.ndarray                # float32 [M, cols]

    @staticmethod
    def of(keys: np.ndarray, rows: np.ndarray) -> "RowTable":
        """A table of one full bundle's rows (no overlay)."""
        return RowTable(keys, rows, _EMPTY_KEYS, np.zeros((0, rows.shape[1]), np.float32))

    @property
    def cols(self) -> int:
        return int(self.base_rows.shape[1])

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found bool [n], rows float32 [n, cols]) for sorted unique int64 keys; rows of
        keys not found are left uninitialized."""
        out = np.empty((len(keys), self.cols), dtype=np.float32)
        in_overlay = _find(self.keys, keys)
        found = in_overlay >= 0
        out[found] = self.rows[in_overlay[found]]
        rest = np.flatnonzero(~found)
        in_base = _find(self.base_keys, keys[rest])
        hit = in_base >= 0
        out[rest[hit]] = self.base_rows[in_base[hit]]      # ascending positions: sequential pages
        found[rest[hit]] = True
        return found, out

    def updated(self, keys: np.ndarray, rows: np.ndarray) -> "RowTable":
        """This table with rows [n, cols] of strictly increasing keys [n] replaced (or added)."""
        if rows.shape != (len(keys), self.cols):
            raise ValueError(f"delta rows of shape {rows.shape} for {len(keys)} keys of {self.cols} columns")
        all_keys = np.concatenate([self.keys, np.asarray(keys, np.int64)])
        all_rows = np.concatenate([self.rows, np.asarray(rows, np.float32)])
        order = np.argsort(all_keys, kind="stable")     # equal keys: the overlay's, then the delta's
        sorted_keys = all_keys[order]
        last = np.ones(len(order), dtype=bool)           # keep the last of equal keys: the delta's
        last[:-1] = sorted_keys[1:] != sorted_keys[:-1]
        return RowTable(self.base_keys, self.base_rows, sorted_keys[last], all_rows[order[last]])


def _find(table: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Index of each key in sorted `table`, -1 where it is not there."""
    if not len(table) or not len(keys):
        return np.full(len(keys), -1, dtype=np.int64)
    pos = np.searchsorted(table, keys).clip(max=len(table) - 1)
    return np.where(np.asarray(table[pos]) == keys, pos, -1)
