"""Counters and timings of the tiered store, read by the metrics exporter at scrape time,
and the labels of its parts in a torch.profiler trace (`profiled`).

Counters only grow; `TieredEmbeddingStore.stats()` adds the gauges (rows and
bytes per tier, LMDB generation and map size). Updated from the training
thread and the I/O thread, hence the lock.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from torch.profiler import record_function

F = TypeVar("F", bound=Callable)

TIERS = ("cache", "ram", "disk")
EVICTION_REASONS = ("cache_to_ram", "ram_to_disk", "ttl_steps", "ttl_seconds", "disk_capacity")


@dataclass
class StoreStats:
    # lookups[tier][result]: a key looked up in a tier (in prepare) hit or missed there
    lookups: dict[str, dict[str, int]] = field(
        default_factory=lambda: {t: {"hit": 0, "miss": 0} for t in TIERS})
    evictions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(EVICTION_REASONS, 0))
    rows_created: int = 0
    admissions_rejected: int = 0        # key-batches that trained on a transient initial row
    rows_written_back: int = 0          # dirty rows written to LMDB on demotion (via the spill)
    clean_rows_dropped: int = 0         # clean rows leaving RAM (their LMDB copy is current)
    rows_spilled: int = 0               # dirty rows leaving RAM into the spill file
    spill_hits: int = 0                 # keys prepare found in the spill (RAM missed)
    prefetch_wait_seconds: float = 0.0  # prepare blocked on the I/O thread
    prefetched_rows: int = 0
    rows_evicted_ahead: int = 0         # of cache_to_ram: demoted on the I/O thread during a step
    rows_uploaded_ahead: int = 0        # RAM, spill and LMDB rows prepare installed from device
                                        # copies the I/O thread made during a step (a GPU)
    lmdb_read_rows: int = 0
    lmdb_read_seconds: float = 0.0
    lmdb_written_rows: int = 0          # rows put or deleted, undo entries not counted
    lmdb_write_seconds: float = 0.0
    checkpoints: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self, k, getattr(self, k) + v)

    def lookup(self, tier: str, hits: int, misses: int) -> None:
        with self._lock:
            self.lookups[tier]["hit"] += hits
            self.lookups[tier]["miss"] += misses

    def evicted(self, reason: str, n: int) -> None:
        with self._lock:
            self.evictions[reason] += n

    def as_dict(self) -> dict:
        with self._lock:
            out = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
            out["lookups"] = {t: dict(r) for t, r in self.lookups.items()}
            out["evictions"] = dict(self.evictions)
            return out


def profiled(name: str) -> Callable[[F], F]:
    """Label each call of the function `name` in a torch.profiler trace (`bench train
    --profile-steps` lists the store's labels, on both threads). A new range per call:
    torch's own decorator shares one between threads."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def labelled(*args, **kwargs):
            with record_function(name):
                return fn(*args, **kwargs)
        return labelled             # type: ignore[return-value]
    return wrap
