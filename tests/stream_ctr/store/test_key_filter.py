"""The LMDB key filter: it never hides a row that is on disk (no false negatives), after
writes, a reopen (built from a scan) and a rollback that puts deleted rows back."""
import numpy as np

from stream_ctr.store.generations import commit_checkpoint, rollback
from stream_ctr.store.key_filter import MAX_BITS_LOG2, MIN_BITS_LOG2, KeyFilter, filter_bits_log2
from stream_ctr.store.lmdb_tier import ABSENT, READ, LmdbTier, WriteBatch
from tests.stream_ctr.store.helpers import LAYOUT
from tests.stream_ctr.store.test_lmdb_tier import put


def test_every_added_key_may_be_there_and_most_others_are_not():
    rng = np.random.default_rng(5)
    f = KeyFilter(20)
    added = rng.integers(0, 1 << 62, 100_000)
    f.add(added[:50_000])
    f.add(np.concatenate([added[50_000:], added[50_000:]]))       # duplicates, many bits per byte
    assert f.maybe(added).all()
    others = rng.integers(0, 1 << 62, 100_000)
    fp = f.maybe(np.setdiff1d(others, added)).mean()
    assert fp < 0.06, fp                      # 10.5 bits a key, two probes: ~3%
    assert f.added == 150_000


def test_the_bits_set_are_the_two_halves_of_the_index_hash():
    """The compiled loops set exactly the bits the hash indexes' mix names: its low and
    high halves, masked to the filter's size."""
    import torch
    from stream_ctr.store.key_index import _slot_hash
    keys = np.random.default_rng(6).integers(0, 1 << 62, 5_000)
    f = KeyFilter(16)
    f.add(keys)
    x = _slot_hash(torch.from_numpy(keys), -1).numpy()
    expected = np.zeros_like(f.words)
    for pos in (x & 0xFFFF, (x >> 32) & 0xFFFF):
        np.bitwise_or.at(expected, pos >> 3, (1 << (pos & 7)).astype(np.uint8))
    assert np.array_equal(f.words, expected)


def test_the_size_follows_the_planned_rows_within_bounds():
    assert filter_bits_log2(10) == MIN_BITS_LOG2
    assert filter_bits_log2(3_000_000) == 25              # >= 8 bits a key
    assert filter_bits_log2(10 ** 10) == MAX_BITS_LOG2


def found(tier, keys):
    return tier.get(np.array(keys, dtype=np.int64))[0].tolist()


def test_reads_skip_unwritten_keys_and_find_every_written_one(tmp_path):
    tier = LmdbTier(tmp_path, LAYOUT, 64 << 20, keep=3, filter_bits_log2=MIN_BITS_LOG2)
    put(tier, [1, 2, 3], 10, ABSENT)
    assert found(tier, [0, 1, 2, 3, 4]) == [False, True, True, True, False]   # built by a scan
    assert tier.key_filter().added == 3
    put(tier, [4, 9], 11, ABSENT)                          # then kept up to date by each write
    assert tier.key_filter().added == 5
    assert found(tier, [1, 4, 5, 9]) == [True, True, False, True]
    commit_checkpoint(tier, WriteBatch())
    tier.apply(WriteBatch(del_keys=np.array([2]), del_old=np.array([READ], np.int8)))
    assert found(tier, [2]) == [False]
    tier.close()
    tier = LmdbTier(tmp_path, LAYOUT, 64 << 20, keep=3, filter_bits_log2=MIN_BITS_LOG2)
    assert found(tier, [1, 2, 3, 4, 9, 10]) == [True, False, True, True, True, False]   # rebuilt
    rollback(tier, 1, tier.nonce(1))                       # puts key 2 back: the filter knows
    assert found(tier, [1, 2, 3]) == [True, True, True]
    tier.close()


def test_a_store_too_large_to_scan_reads_without_a_filter(tmp_path, monkeypatch):
    import stream_ctr.store.lmdb_tier as lmdb_tier
    monkeypatch.setattr(lmdb_tier, "FILTER_SCAN_MAX_ROWS", 2)
    tier = LmdbTier(tmp_path, LAYOUT, 64 << 20, keep=3, filter_bits_log2=MIN_BITS_LOG2)
    put(tier, [1, 2, 3], 10, ABSENT)
    assert found(tier, [1, 2, 3, 4]) == [True, True, True, False]
    assert tier.key_filter() is None
    tier.close()
