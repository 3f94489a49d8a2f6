"""The catalogue of every Prometheus metric stream_ctr exports: names, kinds, labels, help.

Names follow ``stream_ctr_<subsystem>_<name>_<unit>``: base units (seconds,
bytes), counters end in ``_total``, and label names come from the fixed set
``rank, partition, tier, reason, phase``. ``rank`` tells the ranks of a
distributed job apart; a trainer that runs alone exports every series without
it (`stream_ctr.telemetry.collectors.label_names`), as the predict server does.
`CATALOGUE` is the single list of metric names; `monitoring/` (dashboard,
alerts) may use only names from `exported_names()`, which a test checks. This
module holds data only: the objects that update the metrics
(`stream_ctr.telemetry.metrics`) and read them at scrape time
(`stream_ctr.telemetry.collectors`) both import it.
"""
from __future__ import annotations

from dataclasses import dataclass

NAMESPACE = "stream_ctr"
PHASES = ("decode", "prepare", "forward_backward", "update", "eval", "merge", "checkpoint")
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
    _spec("cowclip_gradient_threshold_ratio", "histogram", R,
          "Per embedding row present in a batch: ||gradient|| / CowClip threshold (clipped "
          "when > 1); _count is every present row, so 1 - bucket{le=\"1\"} / _count is the "
          "clipped share."),
    # quality
    _spec("prequential_auc", "gauge", R, "AUC of the sliding prequential window (scored before training)."),
    _spec("prequential_logloss", "gauge", R, "Mean logloss (nats) of the sliding prequential window."),
    _spec("prequential_calibration", "gauge", R,
          "Mean predicted CTR / observed CTR over the sliding window; 1 is perfect."),
    _spec("prequential_normalized_entropy", "gauge", R,
          "Normalized entropy of the sliding window: logloss / logloss of predicting its observed "
          "CTR (below 1 beats the base rate)."),
    _spec("prequential_window_records", "gauge", R, "Records currently in the sliding window."),
    _spec("epochs_completed", "gauge", R,
          "Passes over a file source completed (--epochs); from 1 on, the prequential window "
          "scores rows the model has trained on (not held out)."),
    _spec("prequential_auc_baseline", "gauge", R,
          "Configured AUC baseline (metrics.auc_baseline) for the AUC alert; absent when unset."),
    _spec("prequential_records_total", "counter", R, "Records scored prequentially over the run."),
    _spec("prequential_logloss_nats_total", "counter", R,
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
    _spec("embedding_evictions_by_reason_total", "counter", "rank reason",
          "Rows moved down or deleted, by reason: cache_to_ram, ram_to_disk, ttl_steps, "
          "ttl_seconds, disk_capacity."),
    _spec("embedding_prefetch_wait_seconds_total", "counter", R,
          "Time the step waited for the tier I/O thread (the I/O it did not hide); growing "
          "with a large disk share asks for more RAM."),
    # process (RSS, CPU, fds: prometheus_client's standard process_* collector, STANDARD_NAMES)
    _spec("process_peak_resident_memory_bytes", "gauge", R, "Peak resident set size of the process."),
    _spec("gpu_memory_allocated_bytes", "gauge", R, "CUDA memory allocated by torch; absent on CPU."),
    _spec("start_time_seconds", "gauge", R, "When this trainer process started (unix seconds)."),
    _spec("build_info", "gauge", "rank version torch python",
          "Always 1; the labels say which stream_ctr, torch and Python the trainer runs."),
)
# Families of prometheus_client's standard process collector (Linux), exported beside ours.
STANDARD_NAMES = frozenset({
    "process_resident_memory_bytes", "process_virtual_memory_bytes", "process_cpu_seconds_total",
    "process_start_time_seconds", "process_open_fds", "process_max_fds"})
SPECS: dict[str, MetricSpec] = {s.name: s for s in CATALOGUE}

# The predict server's (`stream-ctr serve`, stream_ctr/serving/metrics.py): another process,
# scraped beside the trainers; a trainer exposes none of them, so they are not in CATALOGUE.
# The last six only while it follows a publish directory (`serve --follow`).
SERVING_CATALOGUE: tuple[MetricSpec, ...] = (
    _spec("serving_request_seconds", "histogram", "", "Wall time of one POST /predict, from its body "
          "read to its answer (histogram; rejected requests included)."),
    _spec("serving_records_scored_total", "counter", "", "Records scored and answered."),
    _spec("serving_requests_total", "counter", "code",
          "POST /predict requests answered, by code (200, 400, 413, 500, 503)."),
    _spec("serving_batch_records", "histogram", "", "Records per scoring call: concurrent requests "
          "coalesced by the scoring thread (histogram)."),
    _spec("serving_model_info", "gauge", "version",
          "Always 1; the label version names the model answering (checkpoint@step)."),
    _spec("serving_model_step", "gauge", "", "The training step of the model answering."),
    _spec("serving_model_age_seconds", "gauge", "", "Now minus the time its checkpoint was written "
          "(absent for a bundle exported before manifests carried that time)."),
    _spec("serving_model_swaps_total", "counter", "", "Models swapped in while serving."),
    _spec("serving_build_info", "gauge", "version torch python",
          "Always 1; the labels name the stream_ctr, torch and Python versions serving."),
    _spec("serving_model_published_version", "gauge", "",
          "The published version (train --publish) of the model answering."),
    _spec("serving_freshness_seconds", "gauge", "", "Freshness: from the arrival at the trainer of "
          "the newest record the model answering trained on to when this server began answering "
          "with it; absent when unknown (a resumed run's first snapshot)."),
    _spec("serving_event_freshness_seconds", "gauge", "", "The same from that record's event time "
          "(absent when the records carry none)."),
    _spec("serving_update_apply_seconds", "histogram", "", "Time to read and apply one update from the "
          "publish directory (deltas, or a full snapshot and its chain) up to the swap."),
    _spec("serving_updates_total", "counter", "kind", "Published versions applied, by kind (full, delta)."),
    _spec("serving_update_failures_total", "counter", "",
          "Polls of the publish directory that failed to apply (a missing or corrupt version)."),
)
FOLLOW_ONLY = frozenset(s.name for s in SERVING_CATALOGUE[-6:])


def exported_names() -> frozenset[str]:
    """Every sample name a stream_ctr trainer or predict server can expose (histogram
    suffixes included)."""
    return frozenset(n for s in CATALOGUE + SERVING_CATALOGUE for n in s.series_names) | STANDARD_NAMES


def spec(short: str) -> MetricSpec:
    """The spec of ``stream_ctr_<short>``."""
    return SPECS[f"{NAMESPACE}_{short}"]
