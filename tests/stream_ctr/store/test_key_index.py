import pytest
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


def _vectorized(monkeypatch):
    """The probe rounds CUDA takes, on the CPU (the compiled loop switched off)."""
    from stream_ctr.store import probe_cpu
    monkeypatch.setattr(probe_cpu, "usable", lambda *tensors: False)


def test_compiled_cpu_lookup_answers_as_the_probe_rounds(monkeypatch):
    """A nearly half-full table (long probe runs), keys present and absent, in any order."""
    g = torch.Generator().manual_seed(1)
    keys = torch.unique(torch.randint(0, 2**62, (30_000,), generator=g))
    index = KeyIndex(capacity=2 * len(keys))
    index.insert(keys[torch.randperm(len(keys), generator=g)])
    query = torch.cat([keys, torch.randint(0, 2**62, (5_000,), generator=g), keys[:100]])
    query = query[torch.randperm(len(query), generator=g)]
    compiled = index.lookup(query)
    _vectorized(monkeypatch)
    assert torch.equal(compiled, index.lookup(query))
    assert torch.equal(compiled >= 0, torch.isin(query, keys))


def test_removals_leave_every_other_key_findable_on_either_path(monkeypatch):
    """Removal on the CPU shifts later entries of a probe run back (no tombstones); with
    the compiled loops off it leaves tombstones. Either way the rest stay findable."""
    from stream_ctr.store.slot_index import SlotIndex
    g = torch.Generator().manual_seed(2)
    keys = torch.unique(torch.randint(0, 2**62, (4_000,), generator=g))
    answers = []
    for compiled in (True, False):
        if not compiled:
            _vectorized(monkeypatch)
        index = SlotIndex(max_entries=len(keys))
        assert index.paired == compiled
        index.insert(keys, torch.arange(len(keys)))
        gone = keys[::3]
        assert torch.equal(index.remove(gone), torch.arange(len(keys))[::3])
        found = index.lookup(keys)
        assert (found[::3] == -1).all()
        kept = torch.ones(len(keys), dtype=torch.bool)
        kept[::3] = False
        assert torch.equal(found[kept], torch.arange(len(keys))[kept])
        assert len(index) == int(kept.sum())
        answers.append(found)
    assert torch.equal(*answers)


def test_a_small_table_churned_by_inserts_and_removals_answers_as_a_dict():
    """Runs that wrap around the end of the table, removals in the middle of runs and
    rebuilds: after every round each key answers what a dict holds, and no removed
    entry is left behind as a tombstone (the table's live entries are exactly the dict)."""
    from stream_ctr.store.slot_index import SlotIndex
    g = torch.Generator().manual_seed(5)
    index, model = SlotIndex(max_entries=8), {}
    universe = torch.randint(0, 2**62, (64,), generator=g).unique()
    for round_ in range(300):
        present = torch.tensor(sorted(model), dtype=torch.int64)
        absent = universe[~torch.isin(universe, present)]
        add = absent[torch.randperm(len(absent), generator=g)[:int(torch.randint(0, 6, (1,), generator=g))]]
        if len(model) + len(add) > 8:
            add = add[:8 - len(model)]
        index.insert(add, torch.arange(len(add)) + 100 * round_)
        model.update({int(k): 100 * round_ + i for i, k in enumerate(add)})
        drop = present[torch.randperm(len(present), generator=g)[:int(torch.randint(0, 4, (1,), generator=g))]]
        assert index.remove(drop).tolist() == [model.pop(int(k)) for k in drop]
        got = index.lookup(universe)
        assert got.tolist() == [model.get(int(k), -1) for k in universe]
        live_keys, live_vals = index.items()
        assert dict(zip(live_keys.tolist(), live_vals.tolist())) == model
        assert len(index) == len(model)
        if index.paired:
            assert not (index.keys == -2).any()


def test_tables_built_by_compiled_inserts_and_by_probe_rounds_answer_alike():
    """Either insert path leaves every key before the first free slot of its probe run,
    so either lookup finds it in either table; row ids follow insert order in both."""
    from stream_ctr.store.slot_index import SlotIndex
    g = torch.Generator().manual_seed(3)
    keys = torch.unique(torch.randint(0, 2**62, (20_000,), generator=g))
    keys = keys[torch.randperm(len(keys), generator=g)]
    query = torch.cat([keys, torch.randint(0, 2**62, (2_000,), generator=g)])

    def build(rounds: bool):
        with pytest.MonkeyPatch.context() as mp:
            if rounds:
                _vectorized(mp)
            index, slots = KeyIndex(capacity=16), SlotIndex(max_entries=len(keys))
            for i, part in enumerate(keys.chunk(7)):          # grows on the way
                index.lookup_or_insert(part)
                slots.insert(part, torch.arange(len(part), dtype=torch.int32) + i * 10_000)
                slots.remove(part[::5])                        # tombstones in the runs
        return index, slots

    def answers(index, slots, rounds: bool):
        with pytest.MonkeyPatch.context() as mp:
            if rounds:
                _vectorized(mp)
            return index.lookup(query), slots.lookup(query)

    tables = {"compiled": build(False), "rounds": build(True)}
    expected = answers(*tables["rounds"], rounds=True)
    assert torch.equal(expected[0][:len(keys)], torch.arange(len(keys)))
    assert int((expected[1] >= 0).sum()) == len(keys) - sum(len(p[::5]) for p in keys.chunk(7))
    for built in tables.values():
        for rounds in (False, True):
            got = answers(*built, rounds=rounds)
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("path", ["reference", "triton", "cuda"])
def test_maps_on_the_gpu_paths_answer_as_the_compiled_loops(monkeypatch, path):
    """KeyIndex and SlotIndex through ops.hash_probe (the torch rounds; the Triton
    kernels under Triton's interpreter; the maps on a GPU, compiled Triton) against the
    compiled CPU loops: the same row ids through growth, lookups and removals with
    tombstones and a rebuild."""
    import os
    from stream_ctr.ops.dispatch import FORCE_TRITON_ENV, INTERPRET_ENV
    from stream_ctr.store import probe_cpu
    from stream_ctr.store.slot_index import SlotIndex
    if path == "triton":
        if os.environ.get(INTERPRET_ENV) != "1":
            pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
        monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    if path == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    device = "cuda" if path == "cuda" else "cpu"
    g = torch.Generator().manual_seed(4)
    batches = [torch.unique(torch.randint(0, 2**20, (n,), generator=g)) for n in (3_000, 5_000, 9_000)]

    def run(usable, device="cpu"):
        monkeypatch.setattr(probe_cpu, "usable", usable)
        index, slots, out = KeyIndex(16, device), SlotIndex(max_entries=2_000, device=device), []
        for keys in batches:
            keys = keys.to(device)
            out += list(index.lookup_or_insert(keys))
            live = torch.sort(slots.items()[0]).values
            slots.remove(live[: live.numel() // 2])
            fresh = keys[slots.lookup(keys) < 0][:1_000]
            slots.insert(fresh, torch.arange(fresh.numel(), device=device) + 7)
            out.append(slots.lookup(keys))
        return [t.cpu() for t in out + [index.keys_by_row()]]

    real_usable = probe_cpu.usable
    compiled = run(real_usable)
    other = run((lambda *t: False) if device == "cpu" else real_usable, device)
    assert all(torch.equal(a, b) for a, b in zip(compiled, other))
