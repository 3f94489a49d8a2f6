import torch

from stream_ctr.store.key_index import KeyIndex


def test_insert_lookup_grow_roundtrip():
    index = KeyIndex(capacity=16)
    g = torch.Generator().manual_seed(0)
    keys = torch.unique(torch.randint(0, 2**62, (50_000,), generator=g))
    rows, new = index.lookup_or_insert(keys)
    assert new.all() and torch.equal(rows, torch.arange(len(keys)))
    assert index.capacity >= 2 * len(keys)             # load factor <= 1/2 after growing
    rows2, new2 = index.lookup_or_insert(keys.flip(0))
    assert not new2.any() and torch.equal(rows2, rows.flip(0))
    assert torch.equal(index.keys_by_row(), keys)
    absent = torch.tensor([1, 2, 3], dtype=torch.int64)
    assert (index.lookup(absent[~torch.isin(absent, keys)]) == -1).all()


def test_row_ids_follow_insert_order_not_slots():
    keys = torch.tensor([10, 3, 2**40, 7], dtype=torch.int64)
    a, b = KeyIndex(16), KeyIndex(1 << 12)
    assert torch.equal(a.insert(keys), b.insert(keys))
    rebuilt = KeyIndex.from_keys(a.keys_by_row())
    assert torch.equal(rebuilt.lookup(keys), torch.arange(4))


def test_colliding_keys_all_found():
    # Keys engineered to share slots in a tiny table still resolve.
    index = KeyIndex(16)
    keys = torch.arange(0, 8, dtype=torch.int64) * 16
    rows = index.insert(keys)
    assert torch.equal(index.lookup(keys), rows)
    assert index.lookup(torch.tensor([], dtype=torch.int64)).numel() == 0
