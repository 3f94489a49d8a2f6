"""Every Prometheus metric of stream_ctr, and the object the train loop reports to.

Names follow ``stream_ctr_<subsystem>_<name>_<unit>``: base units (seconds,
bytes), counters end in ``_total``, and label names come from the fixed set
``rank, partition, tier, reason, phase``. `CATALOGUE` is the single list of
metric names; `monitoring/` (dashboard, alerts) may use only names from
`exported_names()`, which a test checks.

The registry is always passed in (tests use a fresh ``CollectorRegistry``);
nothing here touches prometheus_client's global registry. Values another
component owns are read at scrape time by custom collectors
(`stream_ctr.metrics_collectors`), never mirrored here:

- an embedding store with ``metrics_snapshot()`` (see `StoreCollector`),
- a source's consumer lag (a callable returning ``{partition: records}``),
- the prequential window's run totals, process memory, checkpoint/merge ages.

Updates are per batch or per chunk, never per record: a handful of counter
increments and a vectorized ``bincount`` / ``max`` over the batch columns.
"""
from __future__ import annotations

import time
from collections import Counter as _Tally
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

NAMESPACE = "stream_ctr"
PHASES = ("decode", "prepare", "forward_backward", "update", "merge", "checkpoint")
PHASE_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
SKIP_NONFINITE = "nonfinite"    # batches_skipped_total reason: loss or gradient NaN/inf


RATE_STALE_S = 5.0      # no batch for this long: samples/s is the mean since the last one


@dataclass(frozen=True)
class MetricSpec:
    name: str                   # full name; counters end in _total
    kind: str                   # counter | gauge | histogram
    labels: tuple[str, ...]
    help: str

    @property
    def series_names(self) -> tuple[str, ...]:
        """The sample names Prometheus stores for this metric."""
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


def _spec(name: str, kind: str, labels: str, help_: str) -> MetricSpec:
    return MetricSpec(f"{NAMESPACE}_{name}", kind, tuple(labels.split()), help_)


R = "rank"
CATALOGUE: tuple[MetricSpec, ...] = (
    # throughput / records
    _spec("records_consumed_total", "counter", "rank partition",
          "Records read from the source (decoded or rejected), per source partition."),
    _spec("records_trained_total", "counter", R, "Records the model was trained on."),
    _spec("records_rejected_total", "counter", "rank reason",
          "Records that did not decode and went to the dead-letter sink, by reason."),
    _spec("batches_trained_total", "counter", R, "Micro-batches stepped (skipped ones included)."),
    _spec("batches_skipped_total", "counter", "rank reason",
          "Micro-batches whose update was skipped (reason nonfinite: NaN/inf loss)."),
    _spec("samples_per_second", "gauge", R,
          "Records trained per second over the last interval of about one second."),
    _spec("step_phase_seconds", "histogram", "rank phase",
          "Wall time of one batch's phases: decode, prepare (working set), forward_backward, "
          "update, merge, checkpoint."),
    _spec("embedding_rows_clipped_total", "counter", R, "Embedding rows whose gradient CowClip clipped."),
    # quality
    _spec("prequential_auc", "gauge", R, "AUC of the sliding prequential window (scored before training)."),
    _spec("prequential_logloss", "gauge", R, "Mean logloss (nats) of the sliding prequential window."),
    _spec("prequential_calibration", "gauge", R,
          "Mean predicted CTR / observed CTR over the sliding window; 1 is perfect."),
    _spec("prequential_window_records", "gauge", R, "Records currently in the sliding window."),
    _spec("prequential_auc_baseline", "gauge", R,
          "Configured AUC baseline (metrics.auc_baseline) for the AUC alert; absent when unset."),
    _spec("prequential_records_total", "counter", R, "Records scored prequentially over the run."),
    _spec("prequential_logloss_sum_total", "counter", R,
          "Sum of per-record prequential logloss (nats); rate() / rate(records) = windowed logloss."),
    _spec("prequential_predicted_clicks_total", "counter", R, "Sum of predicted click probabilities."),
    _spec("prequential_clicks_total", "counter", R, "Sum of observed click labels."),
    # freshness / lag
    _spec("last_trained_event_timestamp_seconds", "gauge", R,
          "Event time of the newest record trained (unix seconds); absent if records carry none."),
    _spec("event_freshness_seconds", "gauge", R,
          "Now minus the event time of the newest trained record."),
    _spec("consumer_lag_records", "gauge", "rank partition",
          "Records in the source partition after the last trained one (file: to the end of "
          "the training range)."),
    _spec("source_errors_total", "counter", "rank reason",
          "Source-side errors by reason (broker_outage, commit_failed), read from the source."),
    _spec("source_connected", "gauge", R, "1 while the source reaches its broker, 0 during an outage."),
    _spec("source_paused", "gauge", R,
          "1 while the source pauses fetching (backpressure: decoded rows wait for the trainer)."),
    _spec("source_rebalances_total", "counter", R, "Consumer-group rebalances this rank went through."),
    # checkpoints / merges
    _spec("checkpoints_total", "counter", R, "Checkpoints written."),
    _spec("last_checkpoint_timestamp_seconds", "gauge", R, "When the last checkpoint became durable."),
    _spec("last_checkpoint_age_seconds", "gauge", R,
          "Seconds since the last durable checkpoint (since trainer start if none yet)."),
    _spec("last_checkpoint_bytes", "gauge", R, "Size on disk of the last checkpoint."),
    _spec("merges_total", "counter", R, "k-step merges of the dense replicas."),
    _spec("merge_bytes_total", "counter", R, "Bytes this rank exchanged in k-step merges."),
    _spec("last_merge_timestamp_seconds", "gauge", R, "When the last merge finished."),
    _spec("last_merge_age_seconds", "gauge", R, "Seconds since the last merge; absent before the first."),
    _spec("last_merge_bytes", "gauge", R, "Bytes this rank exchanged in the last merge."),
    # embedding tiers (read from the store at scrape time)
    _spec("embedding_rows", "gauge", "rank tier", "Embedding rows held in the tier."),
    _spec("embedding_bytes", "gauge", "rank tier", "Bytes the tier's rows (with Adam moments) occupy."),
    _spec("embedding_capacity_bytes", "gauge", "rank tier",
          "Byte budget of the tier; absent when unbounded."),
    _spec("embedding_lookups_total", "counter", "rank tier", "Working-set keys looked up in the tier."),
    _spec("embedding_hits_total", "counter", "rank tier", "Lookups the tier served from its own rows."),
    _spec("embedding_evictions_total", "counter", "rank tier", "Rows moved down out of the tier (or deleted)."),
    _spec("embedding_admissions_rejected_total", "counter", R,
          "New keys not given a row yet (admission policy: seen fewer than N times)."),
    _spec("embedding_expired_total", "counter", R, "Rows deleted by TTL expiry."),
    # process
    _spec("process_resident_memory_bytes", "gauge", R, "Resident set size of the trainer process."),
    _spec("process_peak_resident_memory_bytes", "gauge", R, "Peak resident set size of the process."),
    _spec("process_cpu_seconds_total", "counter", R, "User + system CPU time of the process."),
    _spec("gpu_memory_allocated_bytes", "gauge", R, "CUDA memory allocated by torch; absent on CPU."),
    _spec("start_time_seconds", "gauge", R, "When this trainer process started (unix seconds)."),
)
SPECS: dict[str, MetricSpec] = {s.name: s for s in CATALOGUE}


def exported_names() -> frozenset[str]:
    """Every sample name a stream_ctr trainer can expose (histogram suffixes included)."""
    return frozenset(n for s in CATALOGUE for n in s.series_names)


def spec(short: str) -> MetricSpec:
    """The spec of ``stream_ctr_<short>``."""
    return SPECS[f"{NAMESPACE}_{short}"]


def _make(s: MetricSpec, registry: CollectorRegistry) -> Any:
    name = s.name[:-len("_total")] if s.kind == "counter" else s.name
    if s.kind == "counter":
        return Counter(name, s.help, s.labels, registry=registry)
    if s.kind == "gauge":
        return Gauge(name, s.help, s.labels, registry=registry)
    return Histogram(name, s.help, s.labels, registry=registry, buckets=PHASE_BUCKETS_S)


class TrainerMetrics:
    """The metrics one trainer rank updates directly, and the hooks that feed them.

    ``TrainerMetrics(registry, rank)``, then per chunk read `observe_read`,
    per trained batch `observe_batch`, per checkpoint `observe_checkpoint`,
    per merge `observe_merge`. `watch_*` register scrape-time collectors for
    values other components own. `snapshot()` is what the run-directory time
    series records.
    """

    def __init__(self, registry: CollectorRegistry, rank: int = 0,
                 clock: Callable[[], float] = time.time,
                 reasons: Iterable[str] = (), auc_baseline: float = 0.0) -> None:
        from stream_ctr import metrics_collectors as mc
        self.registry, self.rank, self.clock = registry, str(rank), clock
        self._m = {s.name: _make(s, registry) for s in CATALOGUE if s.name in _DIRECT}
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
        self._store = mc.StoreCollector(self.rank)
        self._source = mc.SourceCollector(self.rank)
        self._run = mc.RunCollector(self)
        for c in (self._store, self._source, self._run, mc.ProcessCollector(self.rank)):
            registry.register(c)
        self._init_series(reasons, auc_baseline)

    def _metric(self, short: str) -> Any:
        return self._m[f"{NAMESPACE}_{short}"]

    def _init_series(self, reasons: Iterable[str], auc_baseline: float) -> None:
        """Create every fixed-label child at 0, so panels and alerts see 0, not nothing."""
        r = self.rank
        for short in ("records_trained_total", "batches_trained_total", "embedding_rows_clipped_total",
                      "checkpoints_total", "merges_total", "merge_bytes_total"):
            self._metric(short).labels(rank=r)
        self._metric("batches_skipped_total").labels(rank=r, reason=SKIP_NONFINITE)
        for reason in reasons:
            self._metric("records_rejected_total").labels(rank=r, reason=reason)
        for phase in PHASES:
            self._metric("step_phase_seconds").labels(rank=r, phase=phase)
        # Read at scrape time: a trainer that stops (a hang, an idle stream) must not keep
        # showing its last rate.
        self._metric("samples_per_second").labels(rank=r).set_function(self.current_samples_per_s)
        self._metric("start_time_seconds").labels(rank=r).set(self.started_s)
        if auc_baseline > 0:
            self._metric("prequential_auc_baseline").labels(rank=r).set(auc_baseline)

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
        consumed = self._metric("records_consumed_total")
        if len(partition_index):
            counts = np.bincount(partition_index, minlength=len(partitions))
            for name, n in zip(partitions, counts.tolist()):
                if n:
                    consumed.labels(rank=self.rank, partition=name).inc(n)
        if rejected:
            for name, n in _Tally(r.partition for r in rejected).items():
                consumed.labels(rank=self.rank, partition=name).inc(n)
            self.observe_rejected(_Tally(r.reason for r in rejected))
        if seconds:
            self.observe_phase("decode", seconds)

    def observe_rejected(self, counts: Mapping[str, int]) -> None:
        """Rejected records by reason (they went to the dead-letter sink)."""
        for reason, n in counts.items():
            self._metric("records_rejected_total").labels(rank=self.rank, reason=reason).inc(n)
            self.rejected += n

    def observe_phase(self, phase: str, seconds: float) -> None:
        self._metric("step_phase_seconds").labels(rank=self.rank, phase=phase).observe(seconds)

    def observe_batch(self, n_records: int, skipped: bool, phase_s: Mapping[str, float],
                      rows_clipped: int = 0, event_time_ms: np.ndarray | None = None,
                      accuracy: Mapping[str, float] | None = None, rows_touched: int = 0) -> None:
        """One micro-batch stepped: its size, whether its update was skipped, phase
        timings, CowClip's clipped rows, its event times, the window accuracy after
        it, and its working-set size (unique keys)."""
        r = self.rank
        self._metric("batches_trained_total").labels(rank=r).inc()
        if skipped:
            self._metric("batches_skipped_total").labels(rank=r, reason=SKIP_NONFINITE).inc()
            self.skipped_batches += 1
        self._metric("records_trained_total").labels(rank=r).inc(n_records)
        self.records_trained += n_records
        if rows_clipped:
            self._metric("embedding_rows_clipped_total").labels(rank=r).inc(rows_clipped)
        for phase, seconds in phase_s.items():
            self.observe_phase(phase, seconds)
        if event_time_ms is not None and len(event_time_ms):
            newest = int(event_time_ms.max())
            if newest >= 0:
                self.newest_event_s = max(self.newest_event_s or 0.0, newest / 1000.0)
                self._metric("last_trained_event_timestamp_seconds").labels(rank=r).set(self.newest_event_s)
        if accuracy is not None:
            self.observe_accuracy(accuracy)
        self._store.after_batch(rows_touched)
        self._update_rate()

    def observe_accuracy(self, acc: Mapping[str, float]) -> None:
        """Sliding-window accuracy: keys auc, logloss, calibration, records (NaN skipped)."""
        self.accuracy = dict(acc)
        for key, short in (("auc", "prequential_auc"), ("logloss", "prequential_logloss"),
                           ("calibration", "prequential_calibration"),
                           ("records", "prequential_window_records")):
            value = acc.get(key)
            if value is not None and np.isfinite(value):
                self._metric(short).labels(rank=self.rank).set(value)

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
        self._metric("last_checkpoint_timestamp_seconds").labels(rank=self.rank).set(saved_at_s)

    def observe_checkpoint(self, seconds: float, nbytes: int = 0) -> None:
        """A checkpoint became durable after `seconds`; it holds `nbytes` on disk."""
        r = self.rank
        self.last_checkpoint_s = self.clock()
        self._metric("checkpoints_total").labels(rank=r).inc()
        self._metric("last_checkpoint_timestamp_seconds").labels(rank=r).set(self.last_checkpoint_s)
        self._metric("last_checkpoint_bytes").labels(rank=r).set(nbytes)
        self.observe_phase("checkpoint", seconds)

    def observe_merge(self, seconds: float, nbytes: int) -> None:
        """A k-step merge of the dense replicas finished; this rank sent/received `nbytes`."""
        r = self.rank
        self.last_merge_s = self.clock()
        self._metric("merges_total").labels(rank=r).inc()
        self._metric("merge_bytes_total").labels(rank=r).inc(nbytes)
        self._metric("last_merge_timestamp_seconds").labels(rank=r).set(self.last_merge_s)
        self._metric("last_merge_bytes").labels(rank=r).set(nbytes)
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
            "rejected": self.rejected, "skipped_batches": self.skipped_batches,
            "lag_records": float(sum(lag.values())) if lag else None,
            "freshness_s": now - self.newest_event_s if self.newest_event_s is not None else None,
            "tiers": {t: {k: s.get(k) for k in ("lookups", "hits", "rows", "bytes")}
                      for t, s in tiers.items()},
        }


# Metrics set directly by TrainerMetrics; the rest come from the collectors.
_DIRECT = frozenset(f"{NAMESPACE}_{n}" for n in (
    "records_consumed_total", "records_trained_total", "records_rejected_total",
    "batches_trained_total", "batches_skipped_total", "samples_per_second", "step_phase_seconds",
    "embedding_rows_clipped_total", "prequential_auc", "prequential_logloss",
    "prequential_calibration", "prequential_window_records", "prequential_auc_baseline",
    "last_trained_event_timestamp_seconds", "checkpoints_total",
    "last_checkpoint_timestamp_seconds", "last_checkpoint_bytes", "merges_total",
    "merge_bytes_total", "last_merge_timestamp_seconds", "last_merge_bytes", "start_time_seconds"))


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
