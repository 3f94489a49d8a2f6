"""LMDB tier: generations and undo logs, map growth, the cap, read-only views."""
import numpy as np
import pytest

from stream_ctr.store.errors import StoreError
from stream_ctr.store.generations import GenerationView, commit_checkpoint, rollback
from stream_ctr.store.lmdb_tier import ABSENT, NONE, READ, LmdbTier, WriteBatch
from tests.stream_ctr.store.helpers import LAYOUT


def rows_for(keys, value):
    r = np.full((len(keys), LAYOUT.row_bytes), value, dtype=np.uint8)
    r[:, LAYOUT.meta_off + 24:] = 0
    return r


def table(tier):
    keys, rows, start = [], [], 0
    while True:
        k, r, start = tier.scan(start, 1000)
        keys += k.tolist()
        rows += [int(x[0]) for x in r]
        if start == 0:
            return dict(zip(keys, rows))


def put(tier, keys, value, old):
    keys = np.array(keys, dtype=np.int64)
    tier.apply(WriteBatch(put_keys=keys, put_rows=rows_for(keys, value),
                          put_old=np.full(len(keys), old, np.int8)))


def checkpoint(tier, keys=(), value=0):
    keys = np.array(keys, dtype=np.int64)
    b = WriteBatch(put_keys=keys, put_rows=rows_for(keys, value),
                   put_old=np.full(len(keys), READ, np.int8))
    return commit_checkpoint(tier, b)


def test_writes_after_a_checkpoint_are_undone_and_a_committed_generation_too(tmp_path):
    tier = LmdbTier(tmp_path, LAYOUT, 64 << 20, keep=3)
    put(tier, [1, 2, 3], 10, ABSENT)                       # before any checkpoint: no undo
    g1, n1 = checkpoint(tier, [4], 11)
    assert g1 == 1 and table(tier) == {1: 10, 2: 10, 3: 10, 4: 11}
    put(tier, [1, 5], 20, READ)                            # demotions after checkpoint 1
    tier.apply(WriteBatch(del_keys=np.array([2]), del_old=np.array([READ], np.int8)))
    put(tier, [4], 21, READ)                               # 4 was written by checkpoint 1
    put(tier, [4], 22, NONE)                               # ... and its old value is logged now
    g2, n2 = checkpoint(tier, [3], 22)                     # committed ... but say its manifest never was
    put(tier, [6], 30, ABSENT)
    view = GenerationView(tier, g1, n1)                    # an evaluator reading checkpoint 1
    found, rows = view.get(np.array([1, 2, 3, 4, 5, 6]))
    assert found.tolist() == [True, True, True, True, False, False] and rows[:, 0].tolist() == [10, 10, 10, 11]
    view.close()
    rollback(tier, g1, n1)
    assert table(tier) == {1: 10, 2: 10, 3: 10, 4: 11} and tier.generation == 1
    with pytest.raises(StoreError, match="only at generation 1"):
        rollback(tier, g2, n2)                             # that generation was abandoned ...
    assert checkpoint(tier, [7], 40)[0] == g2
    with pytest.raises(StoreError, match="not the one"):
        rollback(tier, g2, n2)                             # ... and its number reused
    with pytest.raises(StoreError, match="not the one"):
        rollback(tier, g1, "another-nonce")
    tier.close()


def test_rollback_to_generation_zero_empties_the_table(tmp_path):
    tier = LmdbTier(tmp_path, LAYOUT, 64 << 20, keep=3)
    put(tier, [1, 2], 1, ABSENT)
    rollback(tier, 0)
    assert table(tier) == {} and tier.undo_generations() == []
    tier.close()


def test_only_the_newest_checkpoints_stay_restorable(tmp_path):
    tier = LmdbTier(tmp_path, LAYOUT, 64 << 20, keep=2)
    gens = [checkpoint(tier, [k], k) for k in (1, 2, 3, 4)]
    put(tier, [1], 99, READ)
    with pytest.raises(StoreError, match="can no longer go back"):
        rollback(tier, *gens[0])
    rollback(tier, *gens[1])                  # the 2 newest, and one more of slack, are fine
    assert table(tier) == {1: 1, 2: 2}
    tier.close()


def test_map_grows_until_the_cap_then_a_clear_error(tmp_path):
    tier = LmdbTier(tmp_path / "a", LAYOUT, 64 << 20, keep=3, initial_map_bytes=256 << 10)
    put(tier, range(1, 20001), 5, ABSENT)                 # ~4 MB of rows
    assert tier.map_bytes() >= 4 << 20 and tier.entries() == 20000
    tier.close()
    small = LmdbTier(tmp_path / "b", LAYOUT, 1 << 20, keep=3, initial_map_bytes=256 << 10)
    with pytest.raises(StoreError, match=r"reached its cap of 1,048,576 bytes \(store.disk_bytes / --disk-bytes\)"):
        put(small, range(1, 20001), 5, ABSENT)
    assert small.entries() < 20000                         # whole transactions or nothing
    small.close()


def test_store_of_another_dimension_is_refused(tmp_path):
    from stream_ctr.store.layout import RowLayout
    LmdbTier(tmp_path, LAYOUT, 64 << 20, keep=3).close()
    with pytest.raises(StoreError, match="embed_dim"):
        LmdbTier(tmp_path, RowLayout(16), 64 << 20, keep=3)


def mapped_rss_bytes(data_file) -> int:
    """Resident bytes of this process's mappings of `data_file` (/proc/self/smaps)."""
    target, total, inside = str(data_file.resolve()), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0] and not line.startswith(("Rss", "Pss")):
                inside = line.rstrip("\n").endswith(target)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="Linux /proc only")
def test_reads_keep_the_mapped_lmdb_pages_within_their_budget(tmp_path):
    keys = np.arange(1, 60001, dtype=np.int64)
    unlimited = LmdbTier(tmp_path / "a", LAYOUT, 256 << 20, keep=3, chunk_rows=4096, mapped_bytes=0)
    put(unlimited, keys, 7, ABSENT)                      # ~12 MB of rows
    found, rows = unlimited.get(keys)
    assert found.all() and (rows[:, 0] == 7).all()
    assert mapped_rss_bytes(tmp_path / "a" / "data.mdb") > 8 << 20 and unlimited.mapped.trims == 0
    unlimited.close()

    budget = 1 << 20
    tier = LmdbTier(tmp_path / "a", LAYOUT, 256 << 20, keep=3, chunk_rows=1024, mapped_bytes=budget)
    found, rows = tier.get(keys)
    assert found.all() and (rows[:, 0] == 7).all()      # unmapping never changes what is read
    assert tier.mapped.trims > 0
    # at most the budget plus the pages of one chunk of reads (1024 keys, a page each at most)
    assert mapped_rss_bytes(tmp_path / "a" / "data.mdb") <= budget + 1024 * 4096
    put(tier, keys[::2], 9, NONE)                        # writes keep working after a trim
    assert table(tier)[1] == 9 and table(tier)[2] == 7
    tier.close()


def test_used_bytes_fall_when_rows_go_and_the_file_high_water_mark_does_not(tmp_path):
    """The disk tier's byte gauge (and its near-budget alert) follows used_bytes: the
    file only ever grows, as LMDB reuses freed pages instead of shrinking it."""
    tier = LmdbTier(tmp_path, LAYOUT, 64 << 20, keep=2)
    keys = np.arange(20_000, dtype=np.int64)
    put(tier, keys, 1, ABSENT)                   # before the first checkpoint: no undo log
    full_used, full_file = tier.used_bytes(), tier.file_bytes()
    assert 20_000 * LAYOUT.row_bytes <= full_used <= full_file
    tier.apply(WriteBatch(del_keys=keys[:19_000], del_old=np.full(19_000, NONE, np.int8)))
    assert tier.used_bytes() < full_used / 5
    assert tier.file_bytes() >= full_file          # copy-on-write: deleting wrote pages too
