"""What reads a tiered store without moving a row: peek, len, export, stats.

A mixin of TieredEmbeddingStore (kept apart so that tiered.py is the story of
row movement). `stats()` and `metrics_snapshot()` only read plain attributes:
the metrics exporter calls them from its own thread at scrape time.
"""
from __future__ import annotations

import numpy as np
import torch

from stream_ctr.store.embedding import init_rows
from stream_ctr.store.layout import WRITE_GEN, refuse_negative_keys


class TieredReads:
    # ---- reads without moving rows ---------------------------------------------------
    def peek(self, keys: torch.Tensor) -> torch.Tensor:
        """Rows [U, cols] for sorted unique keys, from wherever they live; absent -> initial."""
        refuse_negative_keys(keys)
        self._wait_keep_staged()
        cols = self.layout.cols
        out = torch.empty(keys.numel(), cols, dtype=torch.float32, device=self.device)
        slots = self.cache.lookup(keys)
        hit = slots >= 0
        out[hit] = self.cache.weight[slots[hit]]
        # A row expired by its metadata is absent (as in `prepare`), reclaimed yet or not.
        expired = [torch.nonzero(hit & self._expired(self.cache.meta[slots.clamp(min=0)])).view(-1)]
        idx = torch.nonzero(~hit).view(-1)
        rest = keys[idx].cpu()
        in_ram, packed = self.ram.peek(rest)
        if self.spill is not None and len(self.spill):
            in_ram, packed = self._peek_spill(rest, in_ram, packed)
        ram_idx = idx[in_ram.to(self.device)]
        out[ram_idx] = self.layout.floats(packed)[:, :cols].to(self.device)
        expired.append(ram_idx[self._expired(self.layout.meta(packed)).to(self.device)])
        idx, rest = idx[(~in_ram).to(self.device)], rest[~in_ram]
        found = torch.zeros(rest.numel(), dtype=torch.bool)
        if self.disk is not None and rest.numel():
            f, rows = self.disk.get(rest.numpy())
            found = torch.from_numpy(f)
        if found.any():
            disk_idx = idx[found.to(self.device)]
            out[disk_idx] = self.layout.floats(torch.from_numpy(rows))[:, :cols].to(self.device)
            expired.append(disk_idx[self._expired(self._disk_meta(rows)).to(self.device)])
        absent = torch.cat([idx[(~found).to(self.device)]] + expired)
        out[absent] = init_rows(keys[absent], self.dim, self.init_std, self.seed)
        return out

    def _peek_spill(self, keys: torch.Tensor, in_ram: torch.Tensor,
                    packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RAM's (found, rows) of sorted `keys` completed with the spill's, in key order."""
        rest = torch.nonzero(~in_ram).view(-1)
        in_spill, spilled = self.spill.peek(keys[rest])
        found = in_ram.clone()
        found[rest[in_spill]] = True
        pos = torch.cat([torch.nonzero(in_ram).view(-1), rest[in_spill]])
        return found, torch.cat([packed, spilled])[torch.argsort(pos)]

    def __len__(self) -> int:
        """Rows held: on disk, plus resident rows that have no disk copy yet."""
        self._wait_keep_staged()
        live = self.cache.slot_keys >= 0
        in_cache = int((live & (self.cache.meta[:, WRITE_GEN] < 0)).sum())
        spilled = self.spill.without_disk_copy() if self.spill is not None else 0
        return (self.disk.entries() if self.disk else 0) + in_cache + self.ram.without_disk_copy() + spilled

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """Every row (keys sorted, packed rows), the live copy of each: for tests and tools.
        Reads the whole LMDB table into memory."""
        self._wait_keep_staged()
        keys, rows, start = [], [], 0
        while self.disk is not None:
            k, r, start = self.disk.scan(start, 1 << 20)
            keys.append(k)
            rows.append(r)
            if start == 0:
                break
        cs = self.cache.resident()
        hosts = [t for t in (self.ram, self.spill) if t is not None]
        rk = [self.cache.slot_keys[cs].cpu().numpy()] + [t.slot_keys[t.slot_keys >= 0].numpy() for t in hosts]
        rr = [self.cache.pack(cs).cpu().numpy()] + [t.rows[t.slot_keys >= 0].numpy() for t in hosts]
        dk = np.concatenate(keys) if keys else np.zeros(0, np.int64)
        on_disk_only = ~np.isin(dk, np.concatenate(rk))
        allk = np.concatenate([dk[on_disk_only]] + rk)
        allr = np.concatenate([np.concatenate(rows)[on_disk_only] if keys else
                               np.zeros((0, self.layout.row_bytes), np.uint8)] + rr)
        order = np.argsort(allk)
        return allk[order], allr[order]

    # ---- metrics -------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters (see stats.py) and gauges; plain attribute reads, never blocks."""
        out = self.counters.as_dict()
        out["rows"] = {"cache": len(self.cache.index), "ram": len(self.ram.index), "disk": self._disk_rows,
                       "spill": len(self.spill) if self.spill is not None else 0}
        out["bytes"] = {"cache": len(self.cache.index) * self.plan.cache_row_bytes,
                        "ram": len(self.ram.index) * self.plan.ram_row_bytes, "disk": self._disk_bytes}
        out["capacity_rows"] = {"cache": self.plan.cache_rows, "ram": self.plan.ram_rows,
                                "disk": self.plan.disk_rows}
        out["lmdb_generation"] = self.disk.generation if self.disk else 0
        return out

    def metrics_snapshot(self) -> dict:
        """The contract of stream_ctr/metrics_collectors.StoreCollector."""
        s = self.stats()
        lk, ev = s["lookups"], s["evictions"]
        tiers = {}
        for name, tier, budget, evicted in (("device", "cache", self.plan.cache_bytes, "cache_to_ram"),
                                            ("host", "ram", self.plan.ram_bytes, "ram_to_disk"),
                                            ("disk", "disk", self.plan.disk_bytes, "disk_capacity")):
            tiers[name] = {"rows": s["rows"][tier], "bytes": s["bytes"][tier], "capacity_bytes": budget,
                           "lookups": lk[tier]["hit"] + lk[tier]["miss"], "hits": lk[tier]["hit"],
                           "evictions": ev[evicted]}
        return {"tiers": tiers, "admissions_rejected": s["admissions_rejected"],
                "expired": ev["ttl_steps"] + ev["ttl_seconds"], "evictions_by_reason": dict(ev),
                "prefetch_wait_seconds": s["prefetch_wait_seconds"]}
