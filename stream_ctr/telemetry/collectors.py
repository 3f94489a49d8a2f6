"""Scrape-time collectors: values other components own, read when Prometheus asks.

They run on the HTTP server's thread while the training thread works, so the
providers they call must only read plain attributes (ints, floats, small
dicts) and never block or move data.

Provider contracts (anything with these methods plugs in):

- **embedding store**: ``metrics_snapshot() -> dict``::

      {"tiers": {"device": {"rows": int, "bytes": int, "capacity_bytes": int | None,
                            "lookups": int, "hits": int, "evictions": int},
                 "host": {...}, "disk": {...}},          # any subset of tiers / keys
       "admissions_rejected": int, "expired": int}      # cumulative counts

  A store without it (the in-memory store) is reported as one ``device``
  tier: rows and bytes from ``len(store)`` and its row width; lookups and hits
  from the batches' working sets (a new row is a miss).
- **source**: a callable ``lag() -> {partition: records not yet trained}``
  and/or the source (or a function returning the current one) with
  ``metrics_snapshot() -> {"lag": {partition: n}, "errors": {reason: count},
  "connected": bool, "paused": bool, "rebalances": int}`` (any subset), or a
  ``stats`` attribute with the fields of `stream_ctr.connectors.kafka.source.KafkaStats`.
"""
from __future__ import annotations

import os
import resource
import sys
import types
from typing import Any, Callable, Iterator, Mapping

from prometheus_client.utils import floatToGoString
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from stream_ctr.telemetry.catalogue import SPECS, NAMESPACE, MetricSpec


TIER_KEYS = ("rows", "bytes", "capacity_bytes", "lookups", "hits", "evictions")


def label_names(s: MetricSpec, ranked: bool) -> tuple[str, ...]:
    """The labels a trainer exports `s` with: the catalogue's, less ``rank`` in a single
    process (only the ranks of a distributed job are told apart by a rank label)."""
    return s.labels if ranked else tuple(name for name in s.labels if name != "rank")


def family(short: str, ranked: bool = True) -> CounterMetricFamily | GaugeMetricFamily:
    """An empty family for ``stream_ctr_<short>`` with its catalogue labels (without
    ``rank`` unless `ranked`) and help."""
    s: MetricSpec = SPECS[f"{NAMESPACE}_{short}"]
    cls = {"counter": CounterMetricFamily, "histogram": HistogramMetricFamily}.get(s.kind, GaugeMetricFamily)
    return cls(s.name, s.help, labels=list(label_names(s, ranked)))


class _Ranked(Collector):
    """A collector for one trainer process: `rank` is its rank in a job of several, or
    None (a single process: no rank label). `r` is the rank's label values to start a
    sample's labels with ([] or [rank])."""

    SHORTS: tuple[str, ...] = ()

    def __init__(self, rank: str | None) -> None:
        self.rank = rank
        self.r: list[str] = [] if rank is None else [rank]

    def families(self) -> dict[str, Metric]:
        return {s: family(s, self.rank is not None) for s in self.SHORTS}

    def describe(self) -> Iterator[Metric]:
        return iter(self.families().values())


class StoreCollector(_Ranked):
    """Embedding rows / bytes / lookups / hits / evictions per tier (see module doc)."""

    SHORTS = ("embedding_rows", "embedding_bytes", "embedding_capacity_bytes",
              "embedding_lookups_total", "embedding_hits_total", "embedding_evictions_total",
              "embedding_admissions_rejected_total", "embedding_expired_total",
              "embedding_evictions_by_reason_total", "embedding_prefetch_wait_seconds_total")

    def __init__(self, rank: str | None) -> None:
        super().__init__(rank)
        self.store: object | None = None
        # Fallback bookkeeping for stores without metrics_snapshot().
        self._lookups = 0
        self._hits = 0
        self._rows_seen: int | None = None

    def after_batch(self, rows_touched: int) -> None:
        """Training thread, once per batch: working-set size, for stores without a snapshot."""
        store = self.store
        if store is None or hasattr(store, "metrics_snapshot"):
            return
        rows = len(store)  # type: ignore[arg-type]
        new = rows - (self._rows_seen if self._rows_seen is not None else rows)
        self._rows_seen = rows
        self._lookups += rows_touched
        self._hits += max(rows_touched - new, 0)

    def snapshot(self) -> dict[str, Any]:
        store = self.store
        if store is None:
            return {}
        snap = getattr(store, "metrics_snapshot", None)
        if snap is not None:
            return snap() or {}
        rows = len(store)  # type: ignore[arg-type]
        if self._rows_seen is None:
            self._rows_seen = rows
        width = (getattr(store, "dim", 0) + 1) * 4 * 3      # row + Adam m and v, float32
        return {"tiers": {"device": {"rows": rows, "bytes": rows * width, "lookups": self._lookups,
                                     "hits": self._hits, "evictions": 0}},
                "admissions_rejected": 0, "expired": 0, "prefetch_wait_seconds": 0.0}   # all resident

    def tier_stats(self) -> dict[str, dict[str, Any]]:
        return dict(self.snapshot().get("tiers", {}))

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        fams = self.families()
        per_tier = {"rows": "embedding_rows", "bytes": "embedding_bytes",
                    "capacity_bytes": "embedding_capacity_bytes", "lookups": "embedding_lookups_total",
                    "hits": "embedding_hits_total", "evictions": "embedding_evictions_total"}
        for tier, stats in snap.get("tiers", {}).items():
            for key, short in per_tier.items():
                value = stats.get(key)
                if value is not None and not (key == "capacity_bytes" and value <= 0):
                    fams[short].add_metric([*self.r, tier], float(value))
        for key in ("admissions_rejected", "expired"):
            if snap.get(key) is not None:
                fams[f"embedding_{key}_total"].add_metric(self.r, float(snap[key]))
        for reason, n in snap.get("evictions_by_reason", {}).items():
            fams["embedding_evictions_by_reason_total"].add_metric([*self.r, reason], float(n))
        if snap.get("prefetch_wait_seconds") is not None:
            fams["embedding_prefetch_wait_seconds_total"].add_metric(
                self.r, float(snap["prefetch_wait_seconds"]))
        return iter(fams.values())


def _kafka_stats_snapshot(stats: Any) -> dict[str, Any]:
    """`stream_ctr.connectors.kafka.source.KafkaStats` (plain attributes) in the source snapshot's shape."""
    return {"errors": {"broker_outage": stats.outages, "commit_failed": stats.commit_failures},
            "connected": stats.connected, "paused": stats.paused, "rebalances": stats.rebalances}


class SourceCollector(_Ranked):
    """Consumer lag per partition, source errors by reason, connection and group state."""

    SHORTS = ("consumer_lag_records", "source_errors_total", "source_connected", "source_paused",
              "source_rebalances_total")

    def __init__(self, rank: str | None) -> None:
        super().__init__(rank)
        self.lag_fn: Callable[[], Mapping[str, float]] | None = None
        self.source: object | None = None

    def _snapshot(self) -> dict[str, Any]:
        src = self.source
        if isinstance(src, (types.FunctionType, types.MethodType)):     # the run's current source
            src = src()
        snap = getattr(src, "metrics_snapshot", None)
        if snap is not None:
            return snap() or {}
        stats = getattr(src, "stats", None)
        return _kafka_stats_snapshot(stats) if hasattr(stats, "commit_failures") else {}

    def lag(self) -> dict[str, float]:
        out = dict(self._snapshot().get("lag", {}) or {})
        if self.lag_fn is not None:
            out.update(self.lag_fn() or {})
        return out

    def collect(self) -> Iterator[Metric]:
        fams = self.families()
        for partition, n in sorted(self.lag().items()):
            fams["consumer_lag_records"].add_metric([*self.r, str(partition)], float(n))
        snap = self._snapshot()
        for reason, n in sorted((snap.get("errors", {}) or {}).items()):
            fams["source_errors_total"].add_metric([*self.r, str(reason)], float(n))
        for key, short in (("connected", "source_connected"), ("paused", "source_paused"),
                           ("rebalances", "source_rebalances_total")):
            if snap.get(key) is not None:
                fams[short].add_metric(self.r, float(snap[key]))
        return iter(fams.values())


class RunCollector(_Ranked):
    """Ages computed at scrape time and the prequential window's run totals."""

    SHORTS = ("event_freshness_seconds", "last_checkpoint_age_seconds", "last_merge_age_seconds",
              "prequential_records_total", "prequential_logloss_nats_total",
              "prequential_predicted_clicks_total", "prequential_clicks_total",
              "cowclip_gradient_threshold_ratio")
    TOTALS = (("total_records", "prequential_records_total"),
               ("total_logloss_sum", "prequential_logloss_nats_total"),
               ("total_prob_sum", "prequential_predicted_clicks_total"),
               ("total_label_sum", "prequential_clicks_total"))

    def __init__(self, owner: Any) -> None:   # the TrainerMetrics that registers it
        super().__init__(owner.rank)
        self.owner = owner
        self.window: object | None = None
        self.baseline: dict[str, float] = {}     # the window's totals when watching began

    def collect(self) -> Iterator[Metric]:
        m, r = self.owner, self.r
        now = m.clock()
        fams = self.families()
        if m.newest_event_s is not None:
            fams["event_freshness_seconds"].add_metric(r, now - m.newest_event_s)
        since = m.last_checkpoint_s if m.last_checkpoint_s is not None else m.started_s
        fams["last_checkpoint_age_seconds"].add_metric(r, now - since)
        if m.last_merge_s is not None:
            fams["last_merge_age_seconds"].add_metric(r, now - m.last_merge_s)
        if self.window is not None:
            for attr, short in self.TOTALS:        # per process, like every other counter
                fams[short].add_metric(r, float(getattr(self.window, attr)) - self.baseline.get(attr, 0.0))
        ratio = m.clip_ratio
        if ratio.rows:                             # pre-bucketed by the update kernel
            buckets = [(floatToGoString(e), float(n)) for e, n in zip(ratio.edges, ratio.le.tolist())]
            fams["cowclip_gradient_threshold_ratio"].add_metric(
                r, buckets + [("+Inf", float(ratio.rows))], ratio.sum)
        return iter(fams.values())


def _rss_bytes() -> tuple[float | None, float]:
    """(current RSS, peak RSS) of this process; current is None where /proc is missing."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"), float(peak)
    except (OSError, ValueError, IndexError):
        return None, float(peak)


class ProcessCollector(_Ranked):
    """What prometheus_client's standard process collector lacks: peak RSS, and torch's
    CUDA memory on a GPU (with the rank label in a job of several ranks)."""

    SHORTS = ("process_peak_resident_memory_bytes", "gpu_memory_allocated_bytes")

    def collect(self) -> Iterator[Metric]:
        r = self.r
        fams = self.families()
        _, peak = _rss_bytes()
        fams["process_peak_resident_memory_bytes"].add_metric(r, peak)
        torch = sys.modules.get("torch")      # never import torch (or start CUDA) from a scrape
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            fams["gpu_memory_allocated_bytes"].add_metric(r, float(torch.cuda.memory_allocated()))
        return iter(fams.values())
