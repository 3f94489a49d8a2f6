"""Where embedding rows live: one in-memory table, or a tiered store of device cache,
host RAM and LMDB on disk (docs/tiers-and-sizing.md).

Modules, one concern each:
    layout        the row bytes, the same in every tier
    slot_index    vectorized key -> slot hash map with removal
    device_cache  the fixed-capacity cache on the training device
    host_tier     the RAM tier
    spill_tier    the disk spill: dirty rows from RAM, on their way to LMDB in key order
    mapped_pages  the bound on LMDB's mapped pages in RSS
    lmdb_tier     the LMDB tier, its undo logs and map growth
    generations   checkpoint commit, rollback, reading an old generation
    policies      LRU/LFU demotion, admission sketch, TTL
    writeback     what goes to LMDB and how old values are logged; disk sweeps
    io_worker     the background thread (demotions below the cache, LMDB writes,
                  sweeps, gathering the next batch's rows)
    plan          budgets -> rows per tier, refusal of impossible plans
    stats         counters for the metrics exporter
    tiered        TieredEmbeddingStore, tying them together
    views         what reads a tiered store without moving rows (peek, export, stats)
    embedding     the store interface, row init, and the one-table in-memory store
    key_index     the vectorized uint64 key -> row hash map
    probe_cpu     the maps' lookups and inserts as compiled loops on the CPU

May import config, threads, connectors and ops (and torch, lmdb); never train,
telemetry, models, distributed, bench or cli.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from stream_ctr.config import Config, StoreConfig
from stream_ctr.store.embedding import EmbeddingStore, InMemoryEmbeddingStore
from stream_ctr.store.errors import StoreError
from stream_ctr.store.plan import StorePlan, make_plan

__all__ = ["StoreError", "StorePlan", "build_store", "make_plan", "resume_store_config", "store_dir"]


def store_dir(cfg: Config) -> str:
    return cfg.store.store_dir or str(Path(cfg.train.run_dir) / "store")


def build_store(cfg: Config, n_fields: int, device: torch.device, read_only: bool = False,
                announce: bool = True) -> EmbeddingStore:
    """The store `cfg.store.kind` names. A tiered store prints its plan (stderr) unless
    read-only or `announce` is False, and raises ConfigError for an impossible plan."""
    if cfg.store.kind == "memory":
        return InMemoryEmbeddingStore(cfg.model, cfg.train.seed, device)
    from stream_ctr.store.tiered import TieredEmbeddingStore
    plan = make_plan(cfg.store, cfg.model, cfg.data.batch_size, n_fields, store_dir(cfg))
    if announce and not read_only:
        print(plan.describe(), file=sys.stderr, flush=True)
    return TieredEmbeddingStore(plan, cfg.store, cfg.model, cfg.train.seed, device,
                                keep_checkpoints=cfg.train.keep_checkpoints, read_only=read_only)


def resume_store_config(current: StoreConfig, saved: StoreConfig) -> StoreConfig:
    """The [store] section a resumed run uses. A checkpoint of a tiered store has its
    rows in LMDB, so resuming it without tiered options adopts the checkpoint's
    section; with tiered options (new budgets, policies) the current ones apply,
    and the store checks that its directory holds the checkpoint's table."""
    if saved.kind == "tiered" and current.kind == "memory":
        return saved
    return current
