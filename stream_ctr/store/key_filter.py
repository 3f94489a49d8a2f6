"""A Bloom filter of int64 keys: which keys the LMDB tier may hold.

In a click stream most ids that miss the device cache and RAM are new (a
Zipf tail: 2.2M of 2.7M disk lookups on 1M rows of the bundled synthetic
stream found nothing), and each costs an LMDB B-tree descent. The filter
answers "certainly absent" for most of them from RAM. `maybe(keys)` is False
only for a key never `add`ed: a key added and later deleted from LMDB, or one
that collides, is only looked up for nothing. Two bit positions per key from
one 64-bit mix (the hash indexes' splitmix, key_index.py), in compiled loops.
"""
from __future__ import annotations

from functools import cache

import numpy as np

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

    def add(self, keys: np.ndarray) -> None:
        if len(keys) == 0:
            return
        _kernel()(self.words, np.ascontiguousarray(keys, dtype=np.int64), self.bits_log2,
                  np.ones(0, dtype=bool), True)
        self.added += len(keys)

    def maybe(self, keys: np.ndarray) -> np.ndarray:
        """Per key: False when it was certainly never added."""
        out = np.ones(len(keys), dtype=bool)
        if len(keys):
            _kernel()(self.words, np.ascontiguousarray(keys, dtype=np.int64), self.bits_log2, out, False)
        return out


@cache
def _kernel():
    # One compiled loop a call: the mix, both bits, set or tested in place. (In numpy the
    # adds had to sort each probe's positions to OR together the bits that share a byte:
    # 0.4 s of a 1M-row tiered run.) The mix is key_index._slot_hash with every bit kept;
    # the two probes come from its low and high halves.
    from numba import njit

    @njit(nogil=True, cache=True)
    def bits(words, keys, bits_log2, out, set_bits):
        """set_bits: set each key's two bits; else out[i] = False where one is clear."""
        mask = (1 << bits_log2) - 1
        for i in range(keys.shape[0]):
            x = keys[i] * -7046029254386353131
            x = x ^ ((x >> 31) & ((1 << 33) - 1))
            x = x * -4658895280553007687
            x = x ^ ((x >> 29) & ((1 << 35) - 1))
            for pos in (x & mask, (x >> 32) & mask):
                if set_bits:
                    words[pos >> 3] |= np.uint8(1 << (pos & 7))
                elif (words[pos >> 3] >> (pos & 7)) & 1 == 0:
                    out[i] = False

    return bits
