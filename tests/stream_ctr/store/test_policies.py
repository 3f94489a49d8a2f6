"""Demotion order (LRU, LFU), write-back of dirty rows, admission and TTL on scripted traces."""
import pytest
import torch

from stream_ctr.store.embedding import init_rows
from stream_ctr.store.layout import LAST_STEP, META_FIELDS, WRITE_GEN
from stream_ctr.store.policies import AdmissionSketch, priority, select_victims, victim_order
from tests.stream_ctr.store.helpers import OPTIM, step, tiny_store, where


def test_select_victims_breaks_ties_by_key_and_skips_protected():
    prio = torch.tensor([5, 1, 3, 1, 9, 1, torch.iinfo(torch.int64).max])
    keys = torch.tensor([50, 40, 30, 20, 10, 60, 0])
    assert select_victims(prio, keys, 3).tolist() == [3, 1, 5]        # prio 1: keys 20, 40, 60
    assert sorted(select_victims(prio, keys, 4).tolist()) == [1, 2, 3, 5]
    assert len(select_victims(prio, keys, 10)) == 6                    # never the protected one


def test_compiled_victim_selection_chooses_as_the_torch_ops(monkeypatch):
    """The CPU's compiled selection against the torch ops it replaces: LRU-like narrow
    priorities with many ties and protected rows, a wide LFU-like span (handed back to
    the torch ops), and asking for more rows than are eligible."""
    from stream_ctr.store import policies
    inf = torch.iinfo(torch.int64).max
    g = torch.Generator().manual_seed(7)
    cases = []
    for n_rows, span, n in ((1_000, 20, 300), (5_000, 3, 2_000), (64, 1 << 40, 10), (50, 5, 80)):
        prio = torch.randint(100, 100 + span, (n_rows,), generator=g)
        prio[torch.randperm(n_rows, generator=g)[:n_rows // 5]] = inf
        keys = torch.randperm(10 * n_rows, generator=g)[:n_rows]
        cases.append((prio, keys, n))
    compiled = [select_victims(p, k, n) for p, k, n in cases]
    monkeypatch.setattr(policies, "_victims_kernel", lambda: (lambda *a: -1))
    for (p, k, n), got in zip(cases, compiled):
        assert torch.equal(got, select_victims(p, k, n))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_victims_on_a_gpu_are_the_cpus():
    """On CUDA the threshold comes from a sort (kthvalue would run on one thread block):
    the same victims as the CPU chooses, narrow and wide priority spans alike."""
    inf = torch.iinfo(torch.int64).max
    g = torch.Generator().manual_seed(11)
    for n_rows, span, n in ((320_000, 50, 30_000), (5_000, 3, 2_000), (64, 1 << 40, 10), (50, 5, 80)):
        prio = torch.randint(100, 100 + span, (n_rows,), generator=g)
        prio[torch.randperm(n_rows, generator=g)[: n_rows // 10]] = inf
        keys = torch.randperm(10 * n_rows, generator=g)[:n_rows]
        want = select_victims(prio, keys, n)
        got = select_victims(prio.cuda(), keys.cuda(), n).cpu()
        assert torch.equal(torch.sort(got).values, torch.sort(want).values)


def test_lfu_priority_orders_by_count_then_last_step():
    meta = torch.zeros(4, META_FIELDS, dtype=torch.int64)
    meta[:, 0] = torch.tensor([3, 1, 1, 2])          # count
    meta[:, LAST_STEP] = torch.tensor([1, 7, 5, 2])
    keys = torch.tensor([1, 2, 3, 4])
    assert victim_order(meta, keys, "lfu").tolist() == [2, 1, 3, 0]
    assert victim_order(meta, keys, "lru").tolist() == [0, 3, 2, 1]
    assert priority(meta, "lru").tolist() == [1, 7, 5, 2]


def test_lru_demotion_order_through_the_tiers(tmp_path):
    s = tiny_store(tmp_path, cache_rows=4, ram_rows=3, policy="lru")
    step(s, [1, 2])
    step(s, [3, 4])
    step(s, [1, 5])                 # full: 2 is least recently used
    assert where(s, 2) == "ram"
    step(s, [6, 7])                 # 3 and 4 tie (step 2): smaller keys first
    assert [where(s, k) for k in (3, 4)] == ["ram", "ram"]
    step(s, [8])                    # 1 and 5 tie (step 3) -> 1; RAM full -> its LRU (2) to disk
    assert where(s, 1) == "ram" and where(s, 2) == "disk"
    assert [where(s, k) for k in (5, 6, 7, 8)] == ["cache"] * 4
    step(s, [2])                    # back up from disk; 5 (oldest in cache) goes down
    assert where(s, 2) == "cache" and where(s, 5) == "ram" and where(s, 3) == "disk"
    st = s.stats()
    assert st["evictions"]["cache_to_ram"] == 5 and st["evictions"]["ram_to_disk"] == 2
    assert st["lookups"]["disk"]["hit"] == 1
    s.close()


def test_lfu_demotion_order(tmp_path):
    s = tiny_store(tmp_path, cache_rows=4, ram_rows=8, policy="lfu")
    step(s, [1, 2, 3, 4], counts=[5, 1, 3, 1])
    step(s, [5])                    # counts 1: keys 2 and 4 (both step 1) -> 2
    assert where(s, 2) == "ram" and where(s, 4) == "cache"
    step(s, [6])                    # counts 1: 4 (step 1) before 5 (step 2)
    assert where(s, 4) == "ram" and where(s, 5) == "cache"
    step(s, [7], counts=[9])        # 5 and 6 have count 1: 5 is older
    assert where(s, 5) == "ram" and [where(s, k) for k in (1, 3, 6, 7)] == ["cache"] * 4
    s.close()


def test_dirty_rows_are_written_back_clean_rows_are_not(tmp_path):
    s = tiny_store(tmp_path, cache_rows=2, ram_rows=1)
    step(s, [1, 2])                              # trained: dirty
    w1 = s.peek(torch.tensor([1]))
    for keys in ([3, 4], [5, 6], [7, 8]):        # new rows (no disk copy yet): dirty too
        step(s, keys, update=False)
    assert where(s, 1) == "disk" and torch.equal(s.peek(torch.tensor([1])), w1)
    st = s.stats()
    assert st["rows_written_back"] == st["evictions"]["ram_to_disk"] == 5
    assert st["clean_rows_dropped"] == 0
    step(s, [1, 2], update=False)                # promoted, seen (new last_step): dirty
    s.state_dict()                               # checkpoint: every resident row clean
    step(s, [9, 10], update=False)
    step(s, [11, 12], update=False)              # 1 and 2 leave RAM again
    s.settle()
    st = s.stats()
    # Dropped, as LMDB already holds them: 1, 2 and the RAM row of the checkpoint.
    assert st["clean_rows_dropped"] == 3
    assert st["rows_written_back"] == st["evictions"]["ram_to_disk"] - 3
    assert where(s, 1) == "disk" and torch.equal(s.peek(torch.tensor([1])), w1)
    s.close()


def test_admission_after_n_sightings_trains_unadmitted_keys_on_their_initial_row(tmp_path):
    s = tiny_store(tmp_path, cache_rows=4, ram_rows=4, admission_min_count=3)
    init = init_rows(torch.tensor([42]), s.dim, s.init_std, s.seed)
    for _ in range(2):                            # sightings 1 and 2: transient rows
        slots = step(s, [42])
        assert len(s) == 0
        assert s.stats()["admissions_rejected"] >= 1
    assert s.stats()["admissions_rejected"] == 2 and s.stats()["rows_created"] == 0
    slots = s.prepare(torch.tensor([42]))         # 3rd sighting: admitted, starts from init
    assert torch.equal(s.weight[slots], init) and len(s) == 1
    s.update(slots, torch.full((1, s.dim + 1), 0.01), torch.tensor([1]), 3, OPTIM)
    assert not torch.equal(s.peek(torch.tensor([42])), init)
    s.close()


def test_admission_sketch_counts_per_key():
    sk = AdmissionSketch(min_count=2, width=1 << 10)
    a = torch.tensor([1, 2, 3])
    assert not sk.admit(a).any()
    assert sk.admit(torch.tensor([2, 3, 4])).tolist() == [True, True, False]


def test_ttl_expires_rows_in_every_tier_and_counts_reasons(tmp_path):
    s = tiny_store(tmp_path, cache_rows=2, ram_rows=1, ttl_steps=2)
    step(s, [1, 2])                               # step 1
    step(s, [3, 4])                               # 1, 2 -> RAM / disk
    assert {where(s, 1), where(s, 2)} == {"ram", "disk"}
    for _ in range(3):
        step(s, [3, 4])                           # steps 3-5: 1, 2 unseen for > 2 steps
    s.settle()
    assert where(s, 1) == "none" and where(s, 2) == "none"
    assert s.stats()["evictions"]["ttl_steps"] == 2 and len(s) == 2
    slots = step(s, [1], update=False)            # comes back as a new row
    assert torch.equal(s.weight[slots], init_rows(torch.tensor([1]), s.dim, s.init_std, s.seed))
    s.close()


def test_ttl_in_the_device_cache(tmp_path):
    s = tiny_store(tmp_path, cache_rows=4, ram_rows=4, ttl_steps=1)
    step(s, [1, 2])
    step(s, [2])
    step(s, [2])                                  # 1 last seen 2 steps ago
    assert where(s, 1) == "none" and where(s, 2) == "cache"
    assert s.stats()["evictions"]["ttl_steps"] == 1
    s.close()


def test_disk_budget_evicts_the_lowest_priority_disk_rows(tmp_path):
    s = tiny_store(tmp_path, cache_rows=2, ram_rows=0, disk_rows=4)
    for k in range(1, 13, 2):
        step(s, [k, k + 1])                       # every step pushes 2 rows to disk
    s.settle()
    assert s.disk.entries() <= 4 + 2              # the sweep runs after each write
    assert s.stats()["evictions"]["disk_capacity"] >= 4
    # The oldest rows went first.
    assert where(s, 1) == "none" and where(s, 9) == "disk"
    s.close()


def test_metrics_snapshot_follows_the_collector_contract(tmp_path):
    s = tiny_store(tmp_path, cache_rows=2, ram_rows=1)
    for keys in ([1, 2], [3, 4], [5, 6]):
        step(s, keys)
    s.settle()
    snap = s.metrics_snapshot()
    assert set(snap["tiers"]) == {"device", "host", "disk"}
    dev, host, disk = (snap["tiers"][t] for t in ("device", "host", "disk"))
    assert dev["rows"] == 2 and host["rows"] == 1 and disk["rows"] == 3
    assert dev["lookups"] == 6 and dev["hits"] == 0 and dev["evictions"] == 4
    assert host["lookups"] == 6 and host["evictions"] == 3
    assert snap["admissions_rejected"] == 0 and snap["expired"] == 0
    assert s.stats()["bytes"]["disk"] > 0
    s.close()


def test_a_prefetch_reads_demoted_rows_before_their_lmdb_write(tmp_path):
    # The LMDB write of what a step demoted runs after the next prefetch (so that it
    # overlaps the next prepare): that prefetch must read those rows from the pending
    # write, exactly, and as rows whose disk copy is of the open generation.
    s = tiny_store(tmp_path, cache_rows=2, ram_rows=0)
    ref = tiny_store(tmp_path / "ref", cache_rows=8, ram_rows=0)      # never demotes
    slots = {}
    for name, store in (("s", s), ("ref", ref)):
        step(store, [1, 2])
        step(store, [3, 4])                     # s: 1 and 2 leave for LMDB
        store.prefetch(torch.tensor([1, 2]))
        slots[name] = step(store, [1, 2])
    assert s.stats()["prefetched_rows"] == 2
    keys = torch.tensor([1, 2])
    assert torch.equal(s.peek(keys), ref.peek(keys))
    assert s.cache.meta[slots["s"], WRITE_GEN].tolist() == [s.disk.open_generation] * 2
    for k in (1, 2):
        assert where(s, k) == "cache"
    s.close()
    ref.close()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_next_batchs_room_is_made_during_the_step_from_rows_of_neither_batch(tmp_path, device):
    # The trainer's order: prepare(N), prefetch(N+1), then N's forward and update while the
    # I/O thread frees the cache slots N+1's misses will take. It never takes a row of N
    # (in flight) or of N+1; what it cannot free, the next prepare does. Where a row lives
    # changes no number: the rows match a store that never demotes (on the same device).
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    s = tiny_store(tmp_path, cache_rows=4, ram_rows=8, device=device, evict_ahead="on")
    ref = tiny_store(tmp_path / "ref", cache_rows=16, ram_rows=0, device=device)
    for store in (s, ref):
        step(store, [1, 2])
        step(store, [3, 4])                         # s's cache is full: 1, 2, 3, 4
        slots = store.prepare(torch.tensor([3, 4], device=device))
        store.prefetch(torch.tensor([3, 5, 6, 7], device=device))  # 3 misses; 1, 2 the only candidates
        store.update(slots, torch.full((2, store.dim + 1), 0.01, device=device),
                     torch.ones(2, dtype=torch.int64, device=device), store.clock, OPTIM)
        if store is s:
            store.settle()
            assert s.stats()["rows_evicted_ahead"] == 2
            assert [where(s, k) for k in (1, 2, 3, 4)] == ["ram", "ram", "cache", "cache"]
        step(store, [3, 5, 6, 7])                   # prepare evicts the third: 4
    assert where(s, 4) == "ram" and s.stats()["evictions"]["cache_to_ram"] == 3
    keys = torch.arange(1, 8, device=device)
    assert torch.equal(s.peek(keys), ref.peek(keys))
    s.close()
    ref.close()


def test_evict_ahead_auto_is_on_where_the_io_thread_has_a_core(monkeypatch):
    from stream_ctr.store import tiered
    monkeypatch.setattr(tiered, "usable_cores", lambda processes=1: 4 // processes)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert not tiered.resolve_evict_ahead("auto", cpu)      # torch computes on every core
    assert tiered.resolve_evict_ahead("auto", cuda)         # the host waits on the GPU
    assert tiered.resolve_evict_ahead("on", cpu) and not tiered.resolve_evict_ahead("off", cuda)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert tiered.resolve_evict_ahead("auto", cpu)          # a core is left for the I/O thread
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")             # 2 cores each for 2 processes
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert not tiered.resolve_evict_ahead("auto", cpu)
