"""The object a trainer rank reports its events to, and the /metrics endpoint.

``TrainerMetrics`` updates the metrics of `stream_ctr.telemetry.catalogue`
directly (per batch or per chunk, never per record: a handful of counter
increments and a vectorized ``bincount`` / ``max`` over the batch columns).
The registry is always passed in (tests use a fresh ``CollectorRegistry``);
nothing here touches prometheus_client's global registry. Values another
component owns are read at scrape time by custom collectors
(`stream_ctr.telemetry.collectors`), never mirrored here:

- an embedding store with ``metrics_snapshot()`` (see `StoreCollector`),
- a source's consumer lag (a callable returning ``{partition: records}``),
- the prequential window's run totals, process memory, checkpoint/merge ages.
"""
from __future__ import annotations

import platform
import sys
import threading
import time
from collections import Counter as _Tally
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from stream_ctr.ops.cowclip_adam import CLIP_RATIO_EDGES
from stream_ctr.telemetry import collectors as mc
from stream_ctr.telemetry.catalogue import (MetricSpec, NAMESPACE, PHASES, PHASE_BUCKETS_S, RATE_STALE_S, SKIP_NONFINITE,
                                            SPECS)


def _make(s: MetricSpec, registry: CollectorRegistry, ranked: bool) -> Any:
    name = s.name[:-len("_total")] if s.kind == "counter" else s.name
    labels = mc.label_names(s, ranked)
    if s.kind == "counter":
        return Counter(name, s.help, labels, registry=registry)
    if s.kind == "gauge":
        return Gauge(name, s.help, labels, registry=registry)
    return Histogram(name, s.help, labels, registry=registry, buckets=PHASE_BUCKETS_S)


class TrainerMetrics:
    """The metrics one trainer rank updates directly, and the hooks that feed them.

    ``TrainerMetrics(registry, rank)``, then per chunk read `observe_read`,
    per trained batch `observe_batch`, per checkpoint `observe_checkpoint`,
    per merge `observe_merge`. `watch_*` register scrape-time collectors for
    values other components own. `snapshot()` is what the run-directory time
    series records.

    `rank` is the process's rank in a job of several (every series then carries
    ``rank="r"``); None, a single process, exports the series without a rank label.
    """

    def __init__(self, registry: CollectorRegistry, rank: int | None = None,
                 clock: Callable[[], float] = time.time,
                 reasons: Iterable[str] = (), auc_baseline: float = 0.0) -> None:
        self.registry, self.clock = registry, clock
        self.rank = None if rank is None else str(rank)
        self._rank_label = {} if rank is None else {"rank": self.rank}
        self._m: dict[str, Any] = {}        # made at first use (see _metric)
        self._making = threading.Lock()       # the reading and the training thread both report
        self.started_s = clock()
        self.last_checkpoint_s: float | None = None
        self.last_merge_s: float | None = None
        self.newest_event_s: float | None = None
        self.records_trained = 0
        self._rate_mark = (self.started_s, 0)
        self.samples_per_s = 0.0
        self.accuracy: dict[str, float] = {}
        self.skipped_batches = 0
        self.rejected = 0
        self.clip_ratio = ClipRatioTally()
        self.phase_seconds: dict[str, float] = {}     # this invocation, for the run summary
        self.epoch = 0                      # passes over a file source completed
        self._store = mc.StoreCollector(self.rank)
        self._source = mc.SourceCollector(self.rank)
        self._run = mc.RunCollector(self)
        for c in (self._store, self._source, self._run, mc.ProcessCollector(self.rank)):
            registry.register(c)
        # The standard process_* families (RSS, CPU seconds, fds, start time), per process.
        prometheus_client.ProcessCollector(registry=registry)
        self._init_series(reasons, auc_baseline)

    def _metric(self, short: str, **labels: str) -> Any:
        """The series of ``stream_ctr_<short>`` with these labels (and this process's rank).

        A metric is registered at its first use: one without labels (a single process's
        gauge) is exported from its creation, so one that is absent until set
        (prequential_auc before a window, last_merge_timestamp_seconds before a merge)
        must not exist before."""
        name = f"{NAMESPACE}_{short}"
        metric = self._m.get(name)
        if metric is None:
            assert name in _DIRECT, name
            with self._making:
                metric = self._m.get(name)
                if metric is None:
                    metric = self._m[name] = _make(SPECS[name], self.registry, self.rank is not None)
        labels = {**self._rank_label, **labels}
        return metric.labels(**labels) if labels else metric

    def _init_series(self, reasons: Iterable[str], auc_baseline: float) -> None:
        """Create every fixed-label child at 0, so panels and alerts see 0, not nothing."""
        for short in ("records_trained_total", "batches_trained_total", "embedding_rows_clipped_total",
                      "checkpoints_total", "merges_total", "merge_bytes_total"):
            self._metric(short)
        self._metric("batches_skipped_total", reason=SKIP_NONFINITE)
        for reason in reasons:
            self._metric("records_rejected_total", reason=reason)
        for phase in PHASES:
            self._metric("step_phase_seconds", phase=phase)
        # Read at scrape time: a trainer that stops (a hang, an idle stream) must not keep
        # showing its last rate.
        self._metric("samples_per_second").set_function(self.current_samples_per_s)
        self._metric("start_time_seconds").set(self.started_s)
        self._metric("epochs_completed").set(0)
        self._metric("build_info", version=_version(), torch=_torch_version(),
                     python=platform.python_version()).set(1)
        if auc_baseline > 0:
            self._metric("prequential_auc_baseline").set(auc_baseline)

    # -- providers read at scrape time ---------------------------------------------------

    def watch_store(self, store: object) -> None:
        """Report the embedding store's tiers (see `metrics_collectors.StoreCollector`)."""
        self._store.store = store
        if not hasattr(store, "metrics_snapshot"):
            self._store._rows_seen = len(store)  # type: ignore[arg-type]

    def watch_source(self, lag: Callable[[], Mapping[str, float]] | None = None,
                     source: object | None = None) -> None:
        """Consumer lag ``{partition: records}`` from `lag()`, and/or a source (or a function
        returning the current one) read for errors and state (see `SourceCollector`)."""
        self._source.lag_fn, self._source.source = lag, source

    def watch_window(self, window: object) -> None:
        """Totals of a `PrequentialWindow` (read at scrape time), counted from now: a
        resumed window holds the whole run's totals, and a counter that started there
        would drop below its last scrape after a crash (Prometheus takes that for a
        reset and counts the run's totals again as new increase)."""
        self._run.window = window
        self._run.baseline = {attr: float(getattr(window, attr)) for attr, _ in self._run.TOTALS}

    # -- events from the train loop ------------------------------------------------------

    def observe_read(self, partitions: tuple[str, ...], partition_index: np.ndarray,
                     rejected: list | None = None, seconds: float = 0.0) -> None:
        """One chunk read from the source: decoded rows' partition indices, rejected records."""
        if len(partition_index):
            counts = np.bincount(partition_index, minlength=len(partitions))
            for name, n in zip(partitions, counts.tolist()):
                if n:
                    self._metric("records_consumed_total", partition=name).inc(n)
        if rejected:
            for name, n in _Tally(r.partition for r in rejected).items():
                self._metric("records_consumed_total", partition=name).inc(n)
            self.observe_rejected(_Tally(r.reason for r in rejected))
        if seconds:
            self.observe_phase("decode", seconds)

    def observe_rejected(self, counts: Mapping[str, int]) -> None:
        """Rejected records by reason (they went to the dead-letter sink)."""
        for reason, n in counts.items():
            self._metric("records_rejected_total", reason=reason).inc(n)
            self.rejected += n

    def observe_phase(self, phase: str, seconds: float) -> None:
        self._metric("step_phase_seconds", phase=phase).observe(seconds)
        self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + seconds

    def observe_batch(self, n_records: int, skipped: bool, phase_s: Mapping[str, float],
                      rows_clipped: int = 0, event_time_ms: np.ndarray | None = None,
                      accuracy: Mapping[str, float] | None = None, rows_touched: int = 0,
                      clip_ratio: tuple[np.ndarray, float, int] | None = None) -> None:
        """One micro-batch stepped: its size, whether its update was skipped, phase
        timings, CowClip's clipped rows, its event times, the window accuracy after
        it, its working-set size (unique keys), and CowClip's ratio histogram
        (cumulative counts per edge, sum of ratios, rows) when it clipped."""
        self._metric("batches_trained_total").inc()
        if skipped:
            self._metric("batches_skipped_total", reason=SKIP_NONFINITE).inc()
            self.skipped_batches += 1
        self._metric("records_trained_total").inc(n_records)
        self.records_trained += n_records
        if rows_clipped:
            self._metric("embedding_rows_clipped_total").inc(rows_clipped)
        if clip_ratio is not None:
            self.clip_ratio.add(*clip_ratio)
        for phase, seconds in phase_s.items():
            self.observe_phase(phase, seconds)
        if event_time_ms is not None and len(event_time_ms):
            newest = int(event_time_ms.max())
            if newest >= 0:
                self.newest_event_s = max(self.newest_event_s or 0.0, newest / 1000.0)
                self._metric("last_trained_event_timestamp_seconds").set(self.newest_event_s)
        if accuracy is not None:
            self.observe_accuracy(accuracy)
        self._store.after_batch(rows_touched)
        self._update_rate()

    def observe_epoch(self, completed: int, another_pass: bool = True) -> None:
        """Passes over a file source completed: from 1 on, the window scores rows seen
        before. The time series' `epoch` moves only when `another_pass` begins."""
        self._metric("epochs_completed").set(completed)
        if another_pass:
            self.epoch = completed

    def observe_accuracy(self, acc: Mapping[str, float]) -> None:
        """Sliding-window accuracy: keys auc, logloss, calibration, records (NaN skipped)."""
        self.accuracy = dict(acc)
        for key, short in (("auc", "prequential_auc"), ("logloss", "prequential_logloss"),
                           ("calibration", "prequential_calibration"),
                           ("ne", "prequential_normalized_entropy"),
                           ("records", "prequential_window_records")):
            value = acc.get(key)
            if value is not None and np.isfinite(value):
                self._metric(short).set(value)

    def _update_rate(self) -> None:
        now = self.clock()
        t0, n0 = self._rate_mark
        if now - t0 >= 1.0:
            self.samples_per_s = (self.records_trained - n0) / (now - t0)
            self._rate_mark = (now, self.records_trained)

    def current_samples_per_s(self) -> float:
        """The rate over the last interval of at least 1 s that batches closed; once no
        batch has come for RATE_STALE_S, the mean since the last mark (falls towards 0)."""
        now = self.clock()
        t0, n0 = self._rate_mark
        if now - t0 > RATE_STALE_S:
            return (self.records_trained - n0) / (now - t0)
        return self.samples_per_s

    def resumed_from_checkpoint(self, saved_at_s: float) -> None:
        """The run resumed a checkpoint written at `saved_at_s` (this clock): its age
        counts from then, not from the process start (a trainer that keeps crashing
        before it checkpoints must still trip the checkpoint-age alert)."""
        self.last_checkpoint_s = saved_at_s
        self._metric("last_checkpoint_timestamp_seconds").set(saved_at_s)

    def observe_checkpoint(self, seconds: float, nbytes: int = 0) -> None:
        """A checkpoint became durable after `seconds`; it holds `nbytes` on disk."""
        self.last_checkpoint_s = self.clock()
        self._metric("checkpoints_total").inc()
        self._metric("last_checkpoint_timestamp_seconds").set(self.last_checkpoint_s)
        self._metric("last_checkpoint_bytes").set(nbytes)
        self.observe_phase("checkpoint", seconds)

    def observe_merge(self, seconds: float, nbytes: int) -> None:
        """A k-step merge of the dense replicas finished; this rank sent/received `nbytes`."""
        self.last_merge_s = self.clock()
        self._metric("merges_total").inc()
        self._metric("merge_bytes_total").inc(nbytes)
        self._metric("last_merge_timestamp_seconds").set(self.last_merge_s)
        self._metric("last_merge_bytes").set(nbytes)
        self.observe_phase("merge", seconds)

    # -- for the run-directory time series -----------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Current values for one time-series record (training thread; cheap)."""
        now = self.clock()
        tiers = self._store.tier_stats()
        lag = self._source.lag()
        return {
            "t": round(now, 3), "records": self.records_trained, "samples_per_s": self.samples_per_s,
            "auc": self.accuracy.get("auc"), "logloss": self.accuracy.get("logloss"),
            "calibration": self.accuracy.get("calibration"),
            "rejected": self.rejected, "skipped_batches": self.skipped_batches, "epoch": self.epoch,
            "lag_records": float(sum(lag.values())) if lag else None,
            "freshness_s": now - self.newest_event_s if self.newest_event_s is not None else None,
            "tiers": {t: {k: s.get(k) for k in ("lookups", "hits", "rows", "bytes")}
                      for t, s in tiers.items()},
        }


class ClipRatioTally:
    """The run's CowClip ratio histogram, as the update kernel buckets it (exported by
    `RunCollector`: a prometheus_client Histogram can only observe one value at a time)."""

    def __init__(self) -> None:
        self.edges = CLIP_RATIO_EDGES
        self.le = np.zeros(len(CLIP_RATIO_EDGES), dtype=np.int64)
        self.sum = 0.0
        self.rows = 0

    def add(self, le: np.ndarray, ratio_sum: float, rows: int) -> None:
        self.le += le
        self.sum += ratio_sum
        self.rows += rows

    def quantile_upper(self, q: float) -> float:
        """The smallest bucket edge at or above the q-quantile (inf past the last edge;
        NaN before any row)."""
        if not self.rows:
            return float("nan")
        i = int(np.searchsorted(self.le, q * self.rows, side="left"))
        return float(self.edges[i]) if i < len(self.edges) else float("inf")

    def summary(self) -> dict[str, float]:
        """For a run summary: rows, mean ratio and bucket upper bounds of p50/p99."""
        return {"rows": self.rows, "mean": self.sum / self.rows if self.rows else float("nan"),
                "p50_le": self.quantile_upper(0.5), "p99_le": self.quantile_upper(0.99)}


# Metrics set directly by TrainerMetrics; the rest come from the collectors.
_DIRECT = frozenset(f"{NAMESPACE}_{n}" for n in (
    "records_consumed_total", "records_trained_total", "records_rejected_total",
    "batches_trained_total", "batches_skipped_total", "samples_per_second", "step_phase_seconds",
    "embedding_rows_clipped_total", "prequential_auc", "prequential_logloss",
    "prequential_calibration", "prequential_normalized_entropy", "prequential_window_records", "prequential_auc_baseline",
    "last_trained_event_timestamp_seconds", "checkpoints_total",
    "last_checkpoint_timestamp_seconds", "last_checkpoint_bytes", "merges_total",
    "merge_bytes_total", "last_merge_timestamp_seconds", "last_merge_bytes", "start_time_seconds",
    "build_info", "epochs_completed"))

# Every counter and histogram would also export a `_created` series per label set (the
# client_python default): twice the series for no use here, so they are off.
prometheus_client.disable_created_metrics()


def _version() -> str:
    from stream_ctr import __version__
    return __version__


def _torch_version() -> str:
    torch = sys.modules.get("torch")       # never import torch just to label a metric
    return getattr(torch, "__version__", "not loaded") if torch is not None else "not loaded"


class MetricsServer:
    """The HTTP endpoint Prometheus scrapes (`/metrics`), on a daemon thread."""

    def __init__(self, registry: CollectorRegistry, port: int, addr: str = "127.0.0.1") -> None:
        from prometheus_client import start_http_server
        try:
            self._server, self._thread = start_http_server(port, addr=addr, registry=registry)
        except OSError as e:
            from stream_ctr.config import ConfigError
            raise ConfigError(f"metrics.port: cannot serve metrics on {addr}:{port} ({e.strerror or e}); "
                              "is another trainer using it? pick another --metrics-port "
                              "(0 turns the endpoint off)") from None
        self.addr, self.port = addr, self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
