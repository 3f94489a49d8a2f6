"""Demotion, admission and expiry policies, all on the rows' shared metadata.

* **Demotion** (`victim_order`, `select_victims`): which resident rows leave a
  full tier. LRU evicts the smallest `last_step` first; LFU the smallest
  `count`, then the smallest `last_step`. Ties go to the smaller key, so the
  order is a pure function of the metadata: the same trace evicts the same
  rows on every run and device.
* **Admission** (`AdmissionSketch`): a key gets a row only once it has been
  seen in `min_count` batches. Sightings of keys without a row are counted in
  a count-min sketch (conservative update, halved when it has absorbed many
  sightings so that old counts fade), so counting costs no row. A key not yet
  admitted still takes part in its batch: its embedding *during that step* is
  its initial value `init_rows(key)` with zero moments, exactly what a new row
  would hold, and its update is discarded afterwards. Count-min only
  over-counts, so a key is never admitted later than `min_count` sightings.
* **Expiry** (`expired`): a row unseen for more than `ttl_steps` batches, or
  whose last event time is more than `ttl_seconds` behind the newest event
  time, is deleted; evictions are counted by reason.
"""
from __future__ import annotations

from functools import cache

import numpy as np
import torch

from stream_ctr.store.layout import COUNT, EVENT_MS, LAST_STEP

POLICIES = ("lru", "lfu")
_INF = torch.iinfo(torch.int64).max


def priority(meta: torch.Tensor, policy: str) -> torch.Tensor:
    """int64 eviction priority per row (smaller leaves first) from meta [n, 4].

    LFU packs (count, last_step) into one int64: count saturates at 2**31 - 1
    and last_step is below 2**32 batches, which a run does not reach.
    """
    last = meta[:, LAST_STEP]
    if policy == "lru":
        return last.clone()
    count = meta[:, COUNT].clamp(0, (1 << 31) - 1)
    return (count << 32) | (last & ((1 << 32) - 1))


def select_victims(prio: torch.Tensor, keys: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the `n` rows with the smallest (prio, key); prio == int64 max never leaves.
    Those below the threshold priority come in index order, then the tied ones by key.

    O(len) selection (`_kth_smallest`) plus a sort of the rows tied at the threshold,
    not a full sort: the host tier calls this on tens of millions of rows. On the CPU one
    compiled loop makes the same choice when the priorities span fewer values than there
    are rows (LRU's step numbers), in a few passes instead of a dozen torch ops."""
    if prio.device.type == "cpu" and keys.device.type == "cpu" and prio.numel() and n > 0:
        out = torch.empty(min(n, prio.numel()), dtype=torch.int64)
        got = _victims_kernel()(prio.contiguous().numpy(), keys.contiguous().numpy(), n, out.numpy())
        if got >= 0:
            return out[:got]
    eligible = prio != _INF
    n = min(n, int(eligible.sum()))
    if n <= 0:
        return torch.zeros(0, dtype=torch.int64, device=prio.device)
    thr = _kth_smallest(prio, eligible, n)
    below = torch.nonzero(prio < thr).view(-1)
    tied = torch.nonzero(prio == thr).view(-1)
    take = n - below.numel()
    tied = tied[torch.argsort(keys[tied])[:take]]
    return torch.cat([below, tied])


def _kth_smallest(prio: torch.Tensor, eligible: torch.Tensor, n: int) -> torch.Tensor:
    """The n-th smallest eligible priority (1 <= n <= eligible rows). On the CPU, when the
    eligible priorities span fewer values than there are rows (LRU's step numbers), a
    histogram: about 5x faster than kthvalue on a 320K-row cache."""
    if prio.device.type == "cpu":
        lo = int(prio.min())
        span = int(torch.where(eligible, prio, lo).max()) - lo + 1
        if span <= prio.numel():
            bucket = torch.where(eligible, prio - lo, span)
            below = torch.bincount(bucket, minlength=span + 1).cumsum(0)
            return torch.searchsorted(below, n) + lo
    if prio.device.type == "cuda":
        # (kthvalue runs one thread block per slice: over a whole cache, one block of
        # the GPU; a sort uses all of it)
        return torch.sort(prio).values[n - 1]
    return torch.kthvalue(prio, n).values


@cache
def _victims_kernel():
    from numba import njit

    @njit(nogil=True, cache=True)
    def victims(prio, keys, n, out):
        """`select_victims` into `out`; returns how many, or -1 when the eligible
        priorities span more values than there are rows (the caller sorts then)."""
        inf = 9223372036854775807
        lo, hi, eligible = inf, -inf - 1, 0
        for i in range(prio.shape[0]):
            p = prio[i]
            if p != inf:
                eligible += 1
                lo = min(lo, p)
                hi = max(hi, p)
        n = min(n, eligible)
        if n <= 0:
            return 0
        span = hi - lo + 1
        if span > prio.shape[0]:
            return -1
        hist = np.zeros(span, np.int64)
        for i in range(prio.shape[0]):
            if prio[i] != inf:
                hist[prio[i] - lo] += 1
        below, b = 0, 0
        while below + hist[b] < n:
            below += hist[b]
            b += 1
        thr = lo + b
        tied = np.empty(hist[b], np.int64)
        k, t = 0, 0
        for i in range(prio.shape[0]):
            if prio[i] < thr:
                out[k] = i
                k += 1
            elif prio[i] == thr:
                tied[t] = i
                t += 1
        order = np.argsort(keys[tied])
        for j in range(n - below):
            out[k + j] = tied[order[j]]
        return n

    return victims


def victim_order(meta: torch.Tensor, keys: torch.Tensor, policy: str) -> torch.Tensor:
    """All rows in eviction order (for tests and diagnostics): a full sort."""
    prio = priority(meta, policy)
    order = torch.argsort(keys, stable=True)
    return order[torch.argsort(prio[order], stable=True)]


def expired(meta: torch.Tensor, clock: int, newest_event_ms: int, ttl_steps: int,
            ttl_seconds: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(by_steps, by_seconds) bool masks of rows past their time to live (0 = no TTL)."""
    by_steps = torch.zeros(meta.shape[0], dtype=torch.bool, device=meta.device)
    by_seconds = torch.zeros_like(by_steps)
    if ttl_steps > 0:
        by_steps = clock - meta[:, LAST_STEP] > ttl_steps
    if ttl_seconds > 0 and newest_event_ms >= 0:
        ev = meta[:, EVENT_MS]
        by_seconds = (ev >= 0) & (newest_event_ms - ev > 1000 * ttl_seconds) & ~by_steps
    return by_steps, by_seconds


_SALTS = (-7046029254386353131, -4658895280553007687, -7723592293110705685, 0x2545F4914F6CDD1D)


class AdmissionSketch:
    """Count-min sketch of sightings of keys that have no row yet.

    `depth` rows of `width` int32 counters. Counts are per batch (a key counts
    once per batch it appears in), which is what `prepare` sees.
    """

    def __init__(self, min_count: int, width: int, device: torch.device | str = "cpu",
                 depth: int = 4) -> None:
        self.min_count = min_count
        self.width = 1 << max(4, (width - 1).bit_length())
        self.depth = depth
        self.device = torch.device(device)
        self.table = torch.zeros(depth, self.width, dtype=torch.int32, device=self.device)
        self.since_halving = 0

    @property
    def enabled(self) -> bool:
        return self.min_count > 1

    @property
    def nbytes(self) -> int:
        return self.table.numel() * 4 if self.enabled else 0

    def _cells(self, keys: torch.Tensor) -> torch.Tensor:
        rows = []
        for salt in _SALTS[: self.depth]:
            x = (keys ^ salt) * -7046029254386353131
            x = x ^ ((x >> 29) & ((1 << 35) - 1))
            x = x * -4658895280553007687
            rows.append((x ^ ((x >> 32) & ((1 << 32) - 1))) & (self.width - 1))
        return torch.stack(rows)                      # [depth, n]

    def admit(self, keys: torch.Tensor) -> torch.Tensor:
        """Count one sighting of each (unique) key; True where it reached `min_count`."""
        if not self.enabled:
            return torch.ones(keys.numel(), dtype=torch.bool, device=keys.device)
        cells = self._cells(keys)
        current = torch.gather(self.table, 1, cells)
        estimate = current.min(0).values + 1
        # Conservative update: raise only the counters below the new estimate;
        # scatter_reduce(amax) keeps colliding keys deterministic.
        new = torch.maximum(current, estimate.expand_as(current))
        self.table.scatter_reduce_(1, cells, new, reduce="amax")
        self.since_halving += keys.numel()
        if self.since_halving >= 8 * self.width:       # fade old counts
            self.table >>= 1
            self.since_halving = 0
        return estimate >= self.min_count

    def state_dict(self) -> dict:
        if not self.enabled:
            return {}
        # A copy: `.cpu()` of a CPU tensor is the live table, which training goes on changing.
        return {"table": self.table.to("cpu", copy=True), "since_halving": self.since_halving}

    def load_state_dict(self, state: dict) -> None:
        table = state.get("table")
        if table is not None and tuple(table.shape) == tuple(self.table.shape):
            self.table = table.to(self.device, copy=True)     # never adopt the caller's tensor
            self.since_halving = int(state["since_halving"])
