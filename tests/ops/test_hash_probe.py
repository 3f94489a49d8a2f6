"""ops.hash_probe: the Triton lookups and inserts answer as the torch reference and the
stores' compiled CPU loops do, on tables with collisions, tombstones and a wrapped end."""
import pytest
import torch

from stream_ctr.ops import hash_probe
from stream_ctr.ops.dispatch import FORCE_TRITON_ENV, PATH_TRITON, kernel_path
from stream_ctr.store import probe_cpu
from stream_ctr.store.key_index import _slot_hash

TOMBSTONE = -2


def filled_table(cap, n_keys, seed, tombstones=0, device="cpu"):
    """A table of `cap` slots holding `n_keys` random keys (values = 1000 + their order),
    with `tombstones` of them then removed; and the keys, present and removed."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.unique(torch.randint(0, 2**62, (n_keys,), generator=gen))[torch.randperm(n_keys, generator=gen)]
    table_keys = torch.full((cap,), -1, dtype=torch.int64)
    table_vals = torch.full((cap,), -1, dtype=torch.int64)
    probe_cpu.place(table_keys, table_vals, keys, 1000 + torch.arange(n_keys), _slot_hash(keys, cap - 1))
    removed = keys[:tombstones]
    pos = probe_cpu.find_positions(table_keys, removed, _slot_hash(removed, cap - 1))
    table_keys[pos] = TOMBSTONE
    table_vals[pos] = -1
    return table_keys.to(device), table_vals.to(device), keys.to(device), removed.to(device)


def queries(keys, n_absent, seed):
    gen = torch.Generator().manual_seed(seed + 1)
    absent = torch.randint(2**62, 2**63 - 1, (n_absent,), generator=gen).to(keys.device)
    q = torch.cat([keys, absent])
    return q[torch.randperm(q.numel(), generator=gen).to(keys.device)]


@pytest.mark.parametrize("cap, n_keys, tombstones", [(16, 7, 0), (1 << 12, 2000, 300), (1 << 16, 32_000, 0)])
def test_find_positions_matches_the_cpu_loop_and_the_reference(triton_device, monkeypatch, cap, n_keys, tombstones):
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    tk, tv, keys, _ = filled_table(cap, n_keys, seed=cap, tombstones=tombstones)
    q = queries(keys, n_keys // 2 + 1, seed=cap)
    start = _slot_hash(q, cap - 1)
    expected_pos = probe_cpu.find_positions(tk, q, start)
    expected_val = probe_cpu.find_positions(tk, q, start, tv)
    assert torch.equal(hash_probe.find_positions_reference(tk, q, start), expected_pos)
    assert torch.equal(hash_probe.find_positions_reference(tk, q, start, tv), expected_val)
    d = triton_device
    pos = hash_probe.find_positions_triton(tk.to(d), q.to(d), start.to(d))
    val = hash_probe.find_positions_triton(tk.to(d), q.to(d), start.to(d), tv.to(d))
    assert torch.equal(pos.cpu(), expected_pos) and torch.equal(val.cpu(), expected_val)
    assert int((expected_pos >= 0).sum()) == n_keys - tombstones


@pytest.mark.parametrize("cap, n_old, n_new", [(16, 3, 5), (1 << 12, 1000, 1000), (1 << 17, 20_000, 40_000)])
def test_place_puts_each_key_where_lookups_find_it(triton_device, monkeypatch, cap, n_old, n_new):
    """Inserts into a table with tombstones: every new key is found with its value, no
    tombstone is reused, no old entry is touched, and exactly n_new free slots are taken."""
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    d = triton_device
    tk, tv, old, removed = filled_table(cap, n_old, seed=n_new, tombstones=n_old // 3)
    gen = torch.Generator().manual_seed(7)
    new = torch.unique(torch.randint(2**62, 2**63 - 1, (n_new,), generator=gen))
    new = new[torch.randperm(new.numel(), generator=gen)]
    vals = torch.randint(0, 2**40, (new.numel(),), generator=gen)
    before_k, before_v = tk.clone(), tv.clone()
    tk_d, tv_d = tk.to(d), tv.to(d)
    hash_probe.place_triton(tk_d, tv_d, new.to(d), vals.to(d), _slot_hash(new, cap - 1).to(d))
    tk_out, tv_out = tk_d.cpu(), tv_d.cpu()
    taken = before_k != tk_out
    assert int(taken.sum()) == new.numel()
    assert bool((before_k[taken] == -1).all())            # only free slots, never a tombstone
    assert torch.equal(tv_out[~taken], before_v[~taken])
    found = probe_cpu.find_positions(tk_out, new, _slot_hash(new, cap - 1), tv_out)
    assert torch.equal(found, vals)
    still = old[n_old // 3:]
    assert torch.equal(probe_cpu.find_positions(tk_out, still, _slot_hash(still, cap - 1), tv_out),
                       1000 + torch.arange(n_old // 3, n_old))
    # The reference inserts into the same slots' set (its order among racing keys may differ).
    rk, rv = before_k.clone(), before_v.clone()
    hash_probe.place_reference(rk, rv, new, vals, _slot_hash(new, cap - 1))
    assert torch.equal(torch.sort(rk).values, torch.sort(tk_out).values)
    assert torch.equal(probe_cpu.find_positions(rk, new, _slot_hash(new, cap - 1), rv), vals)


def test_the_dispatcher_takes_triton_on_cuda_tensors_only(monkeypatch):
    tk, tv, keys, _ = filled_table(64, 20, seed=3)
    start = _slot_hash(keys, 63)
    called = []
    monkeypatch.setattr(hash_probe, "find_positions_triton", lambda *a: called.append(a) or "triton")
    assert torch.equal(hash_probe.find_positions(tk, keys, start, tv), 1000 + torch.arange(20))
    assert not called
    if torch.cuda.is_available():
        assert kernel_path(keys.cuda()) == PATH_TRITON
        assert hash_probe.find_positions(tk.cuda(), keys.cuda(), start.cuda()) == "triton"


def test_bad_tables_are_refused_with_the_reason(triton_device):
    keys = torch.arange(4, device=triton_device)
    with pytest.raises(ValueError, match="power-of-two"):
        hash_probe.find_positions_triton(torch.full((12,), -1, device=triton_device), keys, keys)
    with pytest.raises(ValueError, match="one start slot per key"):
        hash_probe.find_positions_triton(torch.full((16,), -1, device=triton_device), keys, keys[:2])
    strided = torch.full((32,), -1, device=triton_device)[::2]        # 16 slots, not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        hash_probe.find_positions_triton(strided, keys, keys)
    with pytest.raises(ValueError, match="one shape"):
        hash_probe.place_triton(torch.full((16,), -1, device=triton_device),
                                torch.full((8,), -1, device=triton_device), keys, keys, keys)


def test_a_full_table_answers_absent_and_refuses_an_insert(triton_device, monkeypatch):
    """No free slot anywhere: a lookup of an absent key ends (-1) after the whole table,
    and an insert raises as the CPU loop does instead of probing forever."""
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    d = triton_device
    keys = torch.arange(16, dtype=torch.int64) * 7 + 1
    tk, tv = torch.full((16,), -1, dtype=torch.int64), torch.full((16,), -1, dtype=torch.int64)
    probe_cpu.place(tk, tv, keys, keys, _slot_hash(keys, 15))
    absent = torch.tensor([5, 2**40], dtype=torch.int64)
    start = _slot_hash(absent, 15)
    assert hash_probe.find_positions_reference(tk, absent, start).tolist() == [-1, -1]
    assert hash_probe.find_positions_triton(tk.to(d), absent.to(d), start.to(d)).tolist() == [-1, -1]
    for place in (hash_probe.place_reference, hash_probe.place_triton):
        with pytest.raises(ValueError, match="hash map full"):
            place(tk.clone().to(d), tv.clone().to(d), absent.to(d), absent.to(d), start.to(d))
    with pytest.raises(ValueError, match="hash map full"):
        probe_cpu.place(tk.clone(), tv.clone(), absent, absent, start)
