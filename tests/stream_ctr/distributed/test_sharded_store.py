"""ShardedEmbeddingStore with 2 and 4 real gloo ranks: one owner per row, global counts.

Every rank replays the same synthetic steps: each rank's batch has keys
shared by all ranks (with a different count on each) and keys of its own.
Each rank also keeps a plain single-table reference that applies the
synchronous update (union of the keys, global counts, gradient of the global
mean loss); the sharded rows must match it.
"""
import hashlib

import pytest
import torch

from tests.stream_ctr.distributed.harness import run_ranks, values

DIM = 4
STEPS = 3


def _shared() -> torch.Tensor:
    """Keys in every rank's batch at every step."""
    return torch.randint(0, 1 << 62, (12,), generator=torch.Generator().manual_seed(17))


def _keys(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique keys of rank's batch at `step` and their in-batch counts."""
    shared = _shared()
    g = torch.Generator().manual_seed(1000 + 31 * rank + step)
    own = torch.randint(0, 1 << 62, (6,), generator=g)
    keys = torch.cat([shared, own])
    counts = torch.cat([torch.full((12,), rank + 1), torch.arange(1, 7)])
    order = torch.argsort(keys)
    return keys[order], counts[order]


def _grad(rank: int, step: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5000 + 7 * rank + step)
    # Large enough that CowClip clips: then the result depends on the counts.
    return torch.randn(n, DIM + 1, generator=g) * 3.0


def _config():
    from stream_ctr.config import Config
    cfg = Config()
    cfg.model.embed_dim = DIM
    cfg.optim.lr_embed = 0.05
    cfg.optim.l2 = 1e-3
    return cfg


def _sync_update(ref, ranks: list[int], step: int, optim) -> None:
    """One synchronous step of the ranks in `ranks` on a single table."""
    parts = [(_keys(r, step), _grad(r, step, 18)) for r in ranks]
    keys = torch.cat([k for (k, _), _ in parts])
    counts = torch.cat([c for (_, c), _ in parts])
    n = torch.tensor([float(c.sum()) for (_, c), _ in parts], dtype=torch.float64)
    scale = (n / n.sum()).to(torch.float32)
    grads = torch.cat([g * scale[i] for i, (_, g) in enumerate(parts)])
    uniq, inv = torch.unique(keys, return_inverse=True)
    slots = ref.prepare(uniq)
    g_sum = torch.zeros(uniq.numel(), DIM + 1).index_add_(0, inv, grads)
    c_sum = torch.zeros(uniq.numel(), dtype=torch.int64).index_add_(0, inv, counts)
    ref.update(slots, g_sum, c_sum, step + 1, optim)


def store_checks(rank: int, world: int) -> dict:
    from stream_ctr.distributed.context import init_distributed
    from stream_ctr.store.embedding import InMemoryEmbeddingStore, init_rows
    from stream_ctr.distributed.sharded_store import ShardedEmbeddingStore, owner_of

    class Recording(InMemoryEmbeddingStore):
        def update(self, slots, grad, counts, step, optim):
            self.calls.append((self.index.keys_by_row()[slots].clone(), counts.clone(), step))
            return super().update(slots, grad, counts, step, optim)

    init_distributed(torch.device("cpu"), timeout_s=60)
    cfg = _config()
    local = Recording(cfg.model, seed=3)
    local.calls = []
    store = ShardedEmbeddingStore(local, cfg.optim)
    ref = InMemoryEmbeddingStore(cfg.model, seed=3)
    out: dict = {"pulled_shared": []}
    shared_keys = _shared()

    for step in range(STEPS):
        keys, counts = _keys(rank, step)
        slots = store.prepare(keys)
        rows = store.weight[slots]
        is_shared = torch.isin(keys, shared_keys)
        out["pulled_shared"].append(hashlib.sha256(rows[is_shared].numpy().tobytes()).hexdigest())
        store.update(slots, _grad(rank, step, keys.numel()), counts, step + 1, cfg.optim)
        _sync_update(ref, list(range(world)), step, cfg.optim)

    # A step that rank 0 trains and the others skip (non-finite loss: prepare, no update).
    keys, counts = _keys(rank, STEPS)
    slots = store.prepare(keys)
    if rank == 0:
        store.update(slots, _grad(0, STEPS, keys.numel()), counts, STEPS + 1, cfg.optim)
    else:
        store.settle()
    _sync_update(ref, [0], STEPS, cfg.optim)
    # A step where the last rank has no batch at all.
    last = world - 1
    if rank == last:
        store.idle_step()
    else:
        keys, counts = _keys(rank, STEPS + 1)
        slots = store.prepare(keys)
        store.update(slots, _grad(rank, STEPS + 1, keys.numel()), counts, STEPS + 2, cfg.optim)
    _sync_update(ref, list(range(last)), STEPS + 1, cfg.optim)

    # Evaluation reads: never-seen keys come back as their initial rows, nothing is created.
    rows_before = len(store)
    unseen = torch.sort(torch.randint(0, 1 << 62, (9,), generator=torch.Generator().manual_seed(99)))[0]
    peeked = store.peek(unseen)
    out["peek_is_init"] = bool(torch.equal(peeked, init_rows(unseen, DIM, cfg.model.init_std, 3)))
    out["peek_created"] = len(store) - rows_before

    state = store.state_dict()
    mine = state["keys"]
    out["local_keys"] = mine.tolist()
    out["owner_ok"] = bool((owner_of(mine, world) == rank).all())
    ref_rows = ref.peek(torch.sort(mine)[0])
    own_rows = state["weight"][torch.argsort(mine)]
    out["max_diff_vs_sync"] = float((own_rows - ref_rows).abs().max()) if mine.numel() else 0.0
    out["moved_from_init"] = float((own_rows - init_rows(torch.sort(mine)[0], DIM, cfg.model.init_std, 3)).abs().max())
    out["shared_counts"] = [(k.tolist(), c.tolist(), s) for k, c, s in local.calls]
    out["shared_keys"] = shared_keys.tolist()
    out["exchange_bytes"] = store.stats.sent_bytes
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def sharded(request):
    return request.param, values(run_ranks(store_checks, request.param))


def test_each_row_has_exactly_one_owner(sharded):
    world, results = sharded
    all_keys = [k for r in results for k in r["local_keys"]]
    assert len(all_keys) == len(set(all_keys))                  # never held by two ranks
    assert all(r["owner_ok"] for r in results)
    assert all(r["local_keys"] for r in results)                # every rank owns some rows


def test_a_key_pulls_the_same_row_whichever_rank_asks(sharded):
    world, results = sharded
    for step in range(STEPS):
        assert len({r["pulled_shared"][step] for r in results}) == 1


def test_sharded_rows_equal_a_synchronous_single_table(sharded):
    world, results = sharded
    for r in results:
        assert r["moved_from_init"] > 1e-3
        assert r["max_diff_vs_sync"] < 1e-6


def test_cowclip_gets_global_counts(sharded):
    world, results = sharded
    shared = set(results[0]["shared_keys"])
    seen = 0
    for r in results:
        for keys, counts, step in r["shared_counts"][:STEPS]:
            for k, c in zip(keys, counts):
                if k in shared:
                    assert c == world * (world + 1) // 2            # sum over ranks of rank + 1
                    seen += 1
    assert seen == STEPS * len(shared)


def test_evaluation_reads_create_no_rows(sharded):
    world, results = sharded
    assert all(r["peek_is_init"] and r["peek_created"] == 0 for r in results)


def test_exchange_traffic_is_counted(sharded):
    world, results = sharded
    assert all(r["exchange_bytes"] > 0 for r in results)
