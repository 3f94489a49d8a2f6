"""Shared helpers of the tiered store tests: small configs, real Criteo batches, LMDB dumps."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from stream_ctr.connectors.dead_letter import DeadLetterFile
from stream_ctr.connectors.files import FileSource, detect_format
from stream_ctr.config import Config, OptimConfig
from stream_ctr.store.device_cache import DeviceCache
from stream_ctr.store.host_tier import HostTier
from stream_ctr.store.layout import RowLayout
from stream_ctr.store.lmdb_tier import LmdbTier
from stream_ctr.train.batches import micro_batches

BATCH = 128
CRITEO_FIELDS = 39
LAYOUT = RowLayout(10)


def small_config(run_dir: Path, tiered: bool, cache_batches: float = 2.0, ram_rows: int = 3000,
                 **store) -> Config:
    """DeepFM with a small MLP on batches of 128; a tiered store with a device cache of
    `cache_batches` worst-case working sets, `ram_rows` RAM rows, a spill of 1,500 rows
    (so that it drains to LMDB every few batches), the rest in LMDB."""
    cfg = Config()
    cfg.model.mlp_dims = (32, 32)
    cfg.data.batch_size = BATCH
    cfg.train.run_dir = str(run_dir)
    cfg.train.threads = 1
    cfg.train.device = "cpu"
    if tiered:
        cfg.store.kind = "tiered"
        cfg.store.cache_bytes = int(cache_batches * BATCH * CRITEO_FIELDS * DeviceCache.bytes_per_row(LAYOUT))
        cfg.store.ram_bytes = ram_rows * HostTier.bytes_per_row(LAYOUT)
        cfg.store.disk_bytes = 64 << 20
        cfg.store.spill_bytes = 1500 * LAYOUT.row_bytes
        for k, v in store.items():
            setattr(cfg.store, k, v)
    return cfg


def criteo_batches(n: int, batch: int = BATCH, tmp: Path | None = None) -> list:
    fmt, path = detect_format("criteo:sample")
    dead = DeadLetterFile((tmp or Path("/tmp")) / "dead_letter_store_tests.jsonl")
    with FileSource(path, fmt, chunk_records=4096) as src:
        return list(micro_batches(src, batch, dead, n * batch))


def lmdb_rows(store_dir: str | Path, dim: int = 10) -> dict[str, torch.Tensor]:
    """Every row of an LMDB store, by key: {"keys", "weight", "exp_avg", "exp_avg_sq", "meta"}."""
    layout = RowLayout(dim)
    tier = LmdbTier(store_dir, layout, 1 << 30, keep=3, read_only=True)
    keys, rows, start = [], [], 0
    while True:
        k, r, start = tier.scan(start, 1 << 20)
        keys.append(k)
        rows.append(r)
        if start == 0:
            break
    tier.close()
    w, m, v, meta = layout.unpack(torch.from_numpy(np.concatenate(rows)))
    return {"keys": torch.from_numpy(np.concatenate(keys)), "weight": w, "exp_avg": m,
            "exp_avg_sq": v, "meta": meta}


def sorted_memory_rows(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    order = torch.argsort(state["keys"])
    return {k: state[k][order] for k in ("keys", "weight", "exp_avg", "exp_avg_sq")}


def assert_same_rows(a: dict, b: dict) -> None:
    for k in ("keys", "weight", "exp_avg", "exp_avg_sq"):
        assert torch.equal(a[k], b[k]), f"{k} differ"


OPTIM = OptimConfig()


def tiny_store(tmp: Path, cache_rows: int, ram_rows: int, disk_rows: int = 10_000, keep: int = 3,
               spill_rows: int = 0, device: str = "cpu", **store):
    """A TieredEmbeddingStore with exact row capacities, for scripted traces (no spill
    unless asked: RAM's dirty rows then go straight to LMDB); its cache on `device`."""
    import dataclasses

    from stream_ctr.config import ModelConfig, StoreConfig
    from stream_ctr.store.plan import make_plan
    from stream_ctr.store.tiered import TieredEmbeddingStore
    cfg = StoreConfig(kind="tiered", cache_bytes=1 << 20, ram_bytes=1 << 20, disk_bytes=64 << 20)
    for k, v in store.items():
        setattr(cfg, k, v)
    model = ModelConfig()
    plan = make_plan(cfg, model, batch_size=1, n_fields=1, store_dir=str(tmp / "store"))
    plan = dataclasses.replace(plan, cache_rows=cache_rows, ram_rows=ram_rows, disk_rows=disk_rows,
                               spill_rows=spill_rows)
    return TieredEmbeddingStore(plan, cfg, model, seed=7, device=device, keep_checkpoints=keep)


def step(store, keys: list[int], counts: list[int] | None = None, update: bool = True) -> torch.Tensor:
    """prepare + (optionally) a CowClip/Adam update with a small constant gradient."""
    k = torch.tensor(sorted(keys), dtype=torch.int64, device=store.device)
    slots = store.prepare(k)
    if update:
        c = torch.tensor(counts if counts is not None else [1] * len(keys), dtype=torch.int64)
        c = c[torch.argsort(torch.tensor(keys))].to(store.device)
        store.update(slots, torch.full((len(keys), store.dim + 1), 0.01, device=store.device), c,
                     store.clock, OPTIM)
    return slots


def where(store, key: int) -> str:
    """Tier holding `key` (after the I/O thread caught up): cache, ram, spill, disk or none."""
    store.settle()
    k = torch.tensor([key])
    if store.cache.lookup(k.to(store.device)).item() >= 0:
        return "cache"
    if store.ram.index.lookup(k).item() >= 0:
        return "ram"
    if store.spill is not None and store.spill.index.lookup(k).item() >= 0:
        return "spill"
    found, _ = store.disk.get(np.array([key]))
    return "disk" if found[0] else "none"
