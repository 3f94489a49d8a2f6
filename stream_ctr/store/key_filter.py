"""A Bloom filter of int64 keys: which keys the LMDB tier may hold.

In a click stream most ids that miss the device cache and RAM are new (a
Zipf tail: 2.2M of 2.7M disk lookups on 1M rows of the bundled synthetic
stream found nothing), and each costs an LMDB B-tree descent. The filter
answers "certainly absent" for most of them from RAM. `maybe(keys)` is False
only for a key never `add`ed: a key added and later deleted from LMDB, or one
that collides, is only looked up for nothing. Two bit positions per key from
one 64-bit mix (the hash indexes' splitmix, key_index.py); vectorized, no
per-key Python.
"""
from __future__ import annotations

import numpy as np
import torch

from stream_ctr.store.key_index import _slot_hash

MIN_BITS_LOG2 = 23          # 1 MiB
MAX_BITS_LOG2 = 28          # 32 MiB: 8 bits a key up to 32M keys, fewer beyond (more lookups)
BITS_PER_KEY = 8            # two probes: ~5% false positives while under this load


def filter_bits_log2(expected_keys: int) -> int:
    """The filter's size (log2 of its bits) for a tier planned to hold `expected_keys`."""
    want = max(1, BITS_PER_KEY * expected_keys - 1).bit_length()
    return min(max(want, MIN_BITS_LOG2), MAX_BITS_LOG2)


class KeyFilter:
    def __init__(self, bits_log2: int) -> None:
        self.bits_log2 = bits_log2
        self.words = np.zeros(1 << (bits_log2 - 3), dtype=np.uint8)
        self.added = 0              # keys added, duplicates counted (for the load)

    def _positions(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # The full 64-bit mix (mask -1); two probes from its low and high halves.
        x = _slot_hash(torch.from_numpy(np.ascontiguousarray(keys, dtype=np.int64)), -1).numpy()
        mask = (1 << self.bits_log2) - 1
        return (x & mask).astype(np.uint64), ((x >> 32) & mask).astype(np.uint64)

    def add(self, keys: np.ndarray) -> None:
        if len(keys) == 0:
            return
        for pos in self._positions(keys):
            # Several keys may set bits of one byte: OR each byte's bits together first
            # (a plain fancy-index assignment would keep only the last).
            pos = np.sort(pos)
            byte = (pos >> np.uint64(3)).astype(np.int64)
            bit = (np.uint8(1) << (pos & np.uint64(7)).astype(np.uint8)).astype(np.uint8)
            starts = np.flatnonzero(np.r_[True, byte[1:] != byte[:-1]])
            self.words[byte[starts]] |= np.bitwise_or.reduceat(bit, starts)
        self.added += len(keys)

    def maybe(self, keys: np.ndarray) -> np.ndarray:
        """Per key: False when it was certainly never added."""
        out = np.ones(len(keys), dtype=bool)
        for pos in self._positions(keys):
            byte = (pos >> np.uint64(3)).astype(np.int64)
            out &= ((self.words[byte] >> (pos & np.uint64(7)).astype(np.uint8)) & 1).astype(bool)
        return out
