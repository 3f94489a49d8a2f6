"""stream_ctr.telemetry.metrics: values after known sequences of events, on a fresh registry each."""
from __future__ import annotations

import urllib.request

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY, CollectorRegistry

from stream_ctr.connectors.batch import Rejected
from stream_ctr.config import ConfigError, ModelConfig
from stream_ctr.store.embedding import InMemoryEmbeddingStore
from stream_ctr.train.evaluation import PrequentialWindow
from stream_ctr.telemetry.catalogue import CATALOGUE, NAMESPACE, exported_names
from stream_ctr.telemetry.metrics import MetricsServer, TrainerMetrics
from tests.prometheus_server import free_port

FIXED_LABELS = {"rank", "partition", "tier", "reason", "phase"}
BUILD_LABELS = {"version", "torch", "python"}          # stream_ctr_build_info only


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def reg() -> CollectorRegistry:
    return CollectorRegistry()


def value(reg: CollectorRegistry, name: str, **labels: str) -> float | None:
    """A sample of a single-process trainer's metrics (no rank label)."""
    return reg.get_sample_value(name, labels)


def rejected(reason: str, n: int, partition: str = "file:x") -> list[Rejected]:
    return [Rejected(partition, i, reason, b"bad") for i in range(n)]


def test_catalogue_follows_the_naming_rules():
    for s in CATALOGUE:
        assert s.name.startswith(NAMESPACE + "_"), s.name
        assert (s.kind == "counter") == s.name.endswith("_total"), s.name
        allowed = FIXED_LABELS | (BUILD_LABELS if s.name.endswith("_build_info") else set())
        assert "rank" in s.labels and set(s.labels) <= allowed, s.name
        assert s.help.endswith(".") or s.help.endswith(")"), s.name
    assert len({s.name for s in CATALOGUE}) == len(CATALOGUE)


def test_three_bad_records_count_three_by_reason(reg):
    m = TrainerMetrics(reg, reasons=("bad_label", "bad_integer"))
    assert value(reg, "stream_ctr_records_rejected_total", reason="bad_integer") == 0
    m.observe_read(("file:x",), np.zeros(5, np.int32), rejected("bad_label", 3))
    assert value(reg, "stream_ctr_records_rejected_total", reason="bad_label") == 3
    assert value(reg, "stream_ctr_records_rejected_total", reason="bad_integer") == 0
    assert value(reg, "stream_ctr_records_consumed_total", partition="file:x") == 8
    m.observe_rejected({"field_count": 2})
    assert value(reg, "stream_ctr_records_rejected_total", reason="field_count") == 2
    assert m.rejected == 5


def test_consumed_counts_per_partition(reg):
    m = TrainerMetrics(reg)
    m.observe_read(("t-0", "t-1", "t-2"), np.array([0, 1, 1, 0, 1], np.int32), [], seconds=0.5)
    m.observe_read(("t-1",), np.zeros(4, np.int32), rejected("bad_time", 1, "t-1"))
    assert value(reg, "stream_ctr_records_consumed_total", partition="t-0") == 2
    assert value(reg, "stream_ctr_records_consumed_total", partition="t-1") == 8
    assert value(reg, "stream_ctr_records_consumed_total", partition="t-2") is None
    assert value(reg, "stream_ctr_step_phase_seconds_count", phase="decode") == 1
    assert value(reg, "stream_ctr_step_phase_seconds_sum", phase="decode") == 0.5


def test_batches_trained_skipped_phases_and_clipping(reg):
    clock = Clock()
    m = TrainerMetrics(reg, clock=clock)
    assert value(reg, "stream_ctr_batches_skipped_total", reason="nonfinite") == 0
    phases = {"prepare": 0.01, "forward_backward": 0.2, "update": 0.03}
    for i in range(4):
        clock.t += 0.5
        m.observe_batch(64, skipped=(i == 2), phase_s=phases if i != 2 else {}, rows_clipped=3)
    assert value(reg, "stream_ctr_records_trained_total") == 256
    assert value(reg, "stream_ctr_batches_trained_total") == 4
    assert value(reg, "stream_ctr_batches_skipped_total", reason="nonfinite") == 1
    assert value(reg, "stream_ctr_embedding_rows_clipped_total") == 12
    assert value(reg, "stream_ctr_step_phase_seconds_count", phase="forward_backward") == 3
    assert value(reg, "stream_ctr_step_phase_seconds_sum", phase="forward_backward") == pytest.approx(0.6)
    assert value(reg, "stream_ctr_step_phase_seconds_bucket", phase="update", le="0.05") == 3
    assert value(reg, "stream_ctr_step_phase_seconds_count", phase="merge") == 0
    # 128 records per second: the gauge updates once a second has passed
    assert value(reg, "stream_ctr_samples_per_second") == pytest.approx(128.0)


def test_cowclip_ratio_histogram_from_pre_bucketed_steps(reg):
    """The update kernel buckets ||g||/threshold; the metric adds steps up, and the
    clipped share is 1 - bucket{le="1"} / count."""
    from stream_ctr.ops.cowclip_adam import CLIP_RATIO_EDGES
    m = TrainerMetrics(reg)
    assert value(reg, "stream_ctr_cowclip_gradient_threshold_ratio_count") is None    # no step yet
    one = CLIP_RATIO_EDGES.index(1.0)
    le = np.arange(1, len(CLIP_RATIO_EDGES) + 1) * 2
    m.observe_batch(64, False, {}, rows_clipped=50 - le[one], clip_ratio=(le, 7.5, 50))
    m.observe_batch(64, False, {}, rows_clipped=50 - le[one], clip_ratio=(le, 2.5, 50))
    m.observe_batch(64, False, {})                                # no cowclip: nothing added
    assert value(reg, "stream_ctr_cowclip_gradient_threshold_ratio_count") == 100
    assert value(reg, "stream_ctr_cowclip_gradient_threshold_ratio_sum") == 10.0
    assert value(reg, "stream_ctr_cowclip_gradient_threshold_ratio_bucket", le="1.0") == 2 * le[one]
    assert value(reg, "stream_ctr_cowclip_gradient_threshold_ratio_bucket", le="+Inf") == 100
    clipped = value(reg, "stream_ctr_embedding_rows_clipped_total")
    assert clipped == 100 - value(reg, "stream_ctr_cowclip_gradient_threshold_ratio_bucket", le="1.0")


def test_step_result_carries_the_ratio_histogram_to_the_metrics(reg):
    """A real trainer step (memory store, cowclip on) feeds the histogram its rows."""
    from stream_ctr.config import Config
    from stream_ctr.connectors.batch import Batch
    from stream_ctr.train.trainer import Trainer
    cfg = Config()
    cfg.optim.cowclip_units = "occurrence"          # binds on a fresh table
    t = Trainer(cfg, n_fields=3, n_dense=2)
    rng = np.random.default_rng(0)
    n = 256
    batch = Batch(labels=(rng.random(n) < 0.3).astype(np.float32),
                  dense=rng.random((n, 2), dtype=np.float32),
                  keys=rng.integers(0, 40, size=(n, 3)).astype(np.int64),
                  event_time_ms=np.zeros(n, np.int64), partition=np.zeros(n, np.int32),
                  offset=np.arange(n, dtype=np.int64), partitions=("file:x",))
    result = t.train_step(batch)
    le, total, rows = result.clip_ratio()
    assert rows == result.rows_touched > 0 and total > 0
    m = TrainerMetrics(reg)
    m.observe_batch(n, False, {}, int(result.rows_clipped), clip_ratio=result.clip_ratio())
    assert value(reg, "stream_ctr_cowclip_gradient_threshold_ratio_count") == rows
    assert value(reg, "stream_ctr_cowclip_gradient_threshold_ratio_bucket", le="1.0") == \
        rows - int(result.rows_clipped)


def test_accuracy_gauges_skip_nan(reg):
    m = TrainerMetrics(reg)
    m.observe_accuracy({"auc": float("nan"), "logloss": 0.5, "calibration": 1.1, "records": 10})
    assert value(reg, "stream_ctr_prequential_auc") is None
    assert value(reg, "stream_ctr_prequential_logloss") == 0.5
    m.observe_accuracy({"auc": 0.7, "logloss": 0.4, "calibration": 0.9, "records": 20})
    assert value(reg, "stream_ctr_prequential_auc") == 0.7
    assert value(reg, "stream_ctr_prequential_calibration") == 0.9
    assert value(reg, "stream_ctr_prequential_window_records") == 20


def test_auc_baseline_only_when_configured():
    reg = CollectorRegistry()
    TrainerMetrics(reg)
    assert value(reg, "stream_ctr_prequential_auc_baseline") is None
    reg = CollectorRegistry()
    TrainerMetrics(reg, auc_baseline=0.72)
    assert value(reg, "stream_ctr_prequential_auc_baseline") == 0.72


def test_event_freshness_at_scrape_time(reg):
    clock = Clock(5000.0)
    m = TrainerMetrics(reg, clock=clock)
    m.observe_batch(3, False, {}, event_time_ms=np.array([-1, -1, -1]))     # no event times (Criteo)
    assert value(reg, "stream_ctr_event_freshness_seconds") is None
    m.observe_batch(3, False, {}, event_time_ms=np.array([4_000_000, 4_100_000, 3_000_000]))
    assert value(reg, "stream_ctr_last_trained_event_timestamp_seconds") == 4100.0
    assert value(reg, "stream_ctr_event_freshness_seconds") == 900.0
    clock.t += 60                  # nothing trained: freshness keeps growing between scrapes
    assert value(reg, "stream_ctr_event_freshness_seconds") == 960.0


def test_samples_per_second_falls_when_batches_stop(reg):
    """It used to keep the last rate for as long as the trainer hung."""
    clock = Clock()
    m = TrainerMetrics(reg, clock=clock)
    for _ in range(4):
        clock.t += 0.5
        m.observe_batch(1000, skipped=False, phase_s={}, rows_clipped=0)
    assert value(reg, "stream_ctr_samples_per_second") == pytest.approx(2000.0)
    clock.t += 3600                          # a stall: no batch for an hour
    assert value(reg, "stream_ctr_samples_per_second") < 1.0


def test_checkpoint_age_after_a_resume_counts_from_the_checkpoint(reg):
    clock = Clock(1000.0)
    m = TrainerMetrics(reg, clock=clock)
    m.resumed_from_checkpoint(400.0)         # written ten minutes before this process started
    assert value(reg, "stream_ctr_last_checkpoint_age_seconds") == 600.0
    assert value(reg, "stream_ctr_last_checkpoint_timestamp_seconds") == 400.0


def test_checkpoint_and_merge_ages(reg):
    clock = Clock(100.0)
    m = TrainerMetrics(reg, clock=clock)
    clock.t = 130.0
    assert value(reg, "stream_ctr_last_checkpoint_age_seconds") == 30.0     # since start
    assert value(reg, "stream_ctr_last_merge_age_seconds") is None
    m.observe_checkpoint(2.5, nbytes=4096)
    clock.t = 175.0
    assert value(reg, "stream_ctr_last_checkpoint_age_seconds") == 45.0
    assert value(reg, "stream_ctr_checkpoints_total") == 1
    assert value(reg, "stream_ctr_last_checkpoint_bytes") == 4096
    assert value(reg, "stream_ctr_last_checkpoint_timestamp_seconds") == 130.0
    assert value(reg, "stream_ctr_step_phase_seconds_sum", phase="checkpoint") == 2.5
    m.observe_merge(0.1, 1000)
    m.observe_merge(0.2, 500)
    clock.t = 180.0
    assert value(reg, "stream_ctr_merges_total") == 2
    assert value(reg, "stream_ctr_merge_bytes_total") == 1500
    assert value(reg, "stream_ctr_last_merge_bytes") == 500
    assert value(reg, "stream_ctr_last_merge_age_seconds") == 5.0


def test_in_memory_store_reports_one_device_tier(reg):
    m = TrainerMetrics(reg)
    store = InMemoryEmbeddingStore(ModelConfig(embed_dim=4), seed=0)
    store.prepare(torch.tensor([1, 2, 3]))          # rows that exist before watching are not misses
    m.watch_store(store)
    store.prepare(torch.tensor([1, 2, 3, 4]))       # 3 hits, 1 new
    m.observe_batch(8, False, {}, rows_touched=4)
    store.prepare(torch.tensor([4, 5]))             # 1 hit, 1 new
    m.observe_batch(8, False, {}, rows_touched=2)
    assert value(reg, "stream_ctr_embedding_rows", tier="device") == 5
    assert value(reg, "stream_ctr_embedding_bytes", tier="device") == 5 * 5 * 4 * 3
    assert value(reg, "stream_ctr_embedding_lookups_total", tier="device") == 6
    assert value(reg, "stream_ctr_embedding_hits_total", tier="device") == 4
    assert value(reg, "stream_ctr_embedding_evictions_total", tier="device") == 0
    assert value(reg, "stream_ctr_embedding_capacity_bytes", tier="device") is None
    assert m.snapshot()["tiers"]["device"]["hits"] == 4


class TieredStoreStub:
    """Any store with metrics_snapshot() plugs in (the tiered store's contract)."""

    def __init__(self) -> None:
        self.snap = {"tiers": {"device": {"rows": 10, "bytes": 1000, "capacity_bytes": 2000,
                                          "lookups": 50, "hits": 40, "evictions": 7},
                               "disk": {"rows": 900, "bytes": 90_000, "capacity_bytes": 100_000,
                                        "lookups": 10, "hits": 10}},
                     "admissions_rejected": 12, "expired": 3,
                     "evictions_by_reason": {"cache_to_ram": 7, "ttl_steps": 3}, "prefetch_wait_seconds": 0.25}

    def metrics_snapshot(self) -> dict:
        return self.snap


def test_store_snapshot_provider_read_at_scrape_time(reg):
    m = TrainerMetrics(reg)
    stub = TieredStoreStub()
    m.watch_store(stub)
    assert value(reg, "stream_ctr_embedding_capacity_bytes", tier="disk") == 100_000
    assert value(reg, "stream_ctr_embedding_hits_total", tier="device") == 40
    assert value(reg, "stream_ctr_embedding_evictions_total", tier="device") == 7
    assert value(reg, "stream_ctr_embedding_evictions_total", tier="disk") is None
    assert value(reg, "stream_ctr_embedding_admissions_rejected_total") == 12
    assert value(reg, "stream_ctr_embedding_evictions_by_reason_total", reason="ttl_steps") == 3
    assert value(reg, "stream_ctr_embedding_prefetch_wait_seconds_total") == 0.25
    assert value(reg, "stream_ctr_embedding_expired_total") == 3
    stub.snap["tiers"]["disk"]["rows"] = 950        # no mirroring: the next scrape sees it
    assert value(reg, "stream_ctr_embedding_rows", tier="disk") == 950


def test_source_lag_and_errors(reg):
    m = TrainerMetrics(reg)
    assert value(reg, "stream_ctr_consumer_lag_records", partition="t-0") is None

    class KafkaLike:
        def metrics_snapshot(self) -> dict:
            return {"lag": {"t-0": 5, "t-1": 7}, "errors": {"disconnect": 2}}

    lag = {"t-1": 9}
    m.watch_source(lag=lambda: lag, source=KafkaLike())
    assert value(reg, "stream_ctr_consumer_lag_records", partition="t-0") == 5
    assert value(reg, "stream_ctr_consumer_lag_records", partition="t-1") == 9   # lag() wins
    assert value(reg, "stream_ctr_source_errors_total", reason="disconnect") == 2
    lag["t-1"] = 3
    assert value(reg, "stream_ctr_consumer_lag_records", partition="t-1") == 3
    assert m.snapshot()["lag_records"] == 8


def test_kafka_source_stats_are_read_through_a_getter(reg):
    from stream_ctr.connectors.kafka.source import KafkaStats

    class Run:                      # the train loop passes `lambda: run.source`
        source = None

    m = TrainerMetrics(reg)
    m.watch_source(source=lambda: Run.source)
    assert value(reg, "stream_ctr_source_connected") is None
    Run.source = type("KafkaSourceLike", (), {"stats": KafkaStats(outages=2, commit_failures=1,
                                                                  rebalances=3, connected=False)})()
    assert value(reg, "stream_ctr_source_connected") == 0
    assert value(reg, "stream_ctr_source_paused") == 0
    assert value(reg, "stream_ctr_source_rebalances_total") == 3
    assert value(reg, "stream_ctr_source_errors_total", reason="broker_outage") == 2
    assert value(reg, "stream_ctr_source_errors_total", reason="commit_failed") == 1


def test_prequential_totals_from_the_window(reg):
    m = TrainerMetrics(reg)
    window = PrequentialWindow(4)
    m.watch_window(window)
    window.add(np.array([0.9, 0.1, 0.8], np.float32), np.array([1, 0, 0], np.float32))
    window.add(np.array([0.5, 0.5], np.float32), np.array([1, 1], np.float32))
    assert value(reg, "stream_ctr_prequential_records_total") == 5
    assert value(reg, "stream_ctr_prequential_clicks_total") == 3
    assert value(reg, "stream_ctr_prequential_predicted_clicks_total") == pytest.approx(2.8, rel=1e-6)
    expected = -(np.log(0.9) + np.log(0.9) + np.log(0.2) + 2 * np.log(0.5))
    assert value(reg, "stream_ctr_prequential_logloss_nats_total") == pytest.approx(expected, rel=1e-5)


def test_prequential_totals_of_a_resumed_window_count_from_the_resume(reg):
    """A resumed window holds the run's totals; the counters start at 0 in the new process
    (they used to start at the run's totals, and drop after a crash: a false reset)."""
    window = PrequentialWindow(4)
    window.add(np.array([0.9, 0.1], np.float32), np.array([1, 0], np.float32))   # before the resume
    m = TrainerMetrics(reg)
    m.watch_window(window)
    assert value(reg, "stream_ctr_prequential_records_total") == 0
    window.add(np.array([0.5], np.float32), np.array([1], np.float32))
    assert value(reg, "stream_ctr_prequential_records_total") == 1
    assert value(reg, "stream_ctr_prequential_clicks_total") == 1


def test_process_metrics(reg):
    TrainerMetrics(reg, rank=3)
    rss = reg.get_sample_value("process_resident_memory_bytes")        # the standard collector
    peak = reg.get_sample_value("stream_ctr_process_peak_resident_memory_bytes", {"rank": "3"})
    assert rss and rss > 1 << 20 and peak >= rss * 0.5
    assert reg.get_sample_value("process_cpu_seconds_total") > 0
    assert reg.get_sample_value("stream_ctr_start_time_seconds", {"rank": "3"}) > 0


def test_scrape_is_clean_per_the_client_guide(reg):
    """What Prometheus reads: no _created series, a build_info, NE, the standard process
    families; no counter named like a histogram's _sum."""
    from stream_ctr import __version__
    m = TrainerMetrics(reg)
    m.observe_batch(64, False, {"update": 0.01}, 1, None,
                    {"auc": 0.7, "logloss": 0.4, "calibration": 1.0, "records": 64, "ne": 0.85}, 10)
    m.observe_read(("p",), np.zeros(2, np.int32), rejected("bad_label", 1, "p"), 0.1)
    from prometheus_client import generate_latest
    text = generate_latest(reg).decode()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}
    assert not [n for n in names if n.endswith("_created")], text
    assert f'version="{__version__}"' in text and "stream_ctr_build_info{" in text
    assert value(reg, "stream_ctr_prequential_normalized_entropy") == 0.85
    for family in ("process_resident_memory_bytes", "process_cpu_seconds_total",
                   "process_start_time_seconds", "process_open_fds"):
        assert family in names, family
    assert not [n for n in names if n.endswith("_sum_total")]


class SourceStub:
    def metrics_snapshot(self) -> dict:
        return {"errors": {"disconnect": 1}, "connected": True, "paused": False, "rebalances": 2}


@pytest.mark.parametrize("rank", [None, 1])
def test_every_sample_is_in_the_catalogue_and_the_global_registry_is_untouched(reg, rank):
    """Every series of a trainer, the scrape-time collectors' too, carries rank="r" in a
    job of several ranks and no rank label at all in a single process."""
    clock = Clock()
    m = TrainerMetrics(reg, rank=rank, clock=clock, reasons=("bad_label",), auc_baseline=0.6)
    m.watch_store(TieredStoreStub())
    m.watch_window(PrequentialWindow(8))
    m.watch_source(lag=lambda: {"p": 1}, source=SourceStub())
    m.observe_read(("p",), np.zeros(2, np.int32), rejected("bad_label", 1, "p"), 0.1)
    m.observe_batch(2, True, {"update": 0.1}, 1, np.array([1000, 2000]),
                    {"auc": 0.6, "logloss": 0.6, "calibration": 1.0, "records": 2, "ne": 0.9}, 4,
                    (np.arange(11), 1.0, 20))
    m.observe_checkpoint(0.1, 10)
    m.observe_merge(0.1, 10)
    names = {s.name for fam in reg.collect() for s in fam.samples if not s.name.endswith("_created")}
    assert names <= exported_names(), sorted(names - exported_names())
    missing = {s.name for s in CATALOGUE if not set(s.series_names) & names}
    assert missing <= {"stream_ctr_gpu_memory_allocated_bytes"}, missing   # CUDA only
    ours = [(fam.name, s) for fam in reg.collect() for s in fam.samples
            if not fam.name.startswith("process_")]        # the standard collector has no rank
    specs = {spec.name.removesuffix("_total"): spec for spec in CATALOGUE}
    for name, sample in ours:
        want = set(specs[name].labels) - ({"rank"} if rank is None else set())
        assert set(sample.labels) - {"le"} == want, (name, sample.labels)
        if rank is not None:
            assert sample.labels["rank"] == "1", (name, sample.labels)
    assert not any(n.startswith("stream_ctr") for n in REGISTRY._names_to_collectors)


def test_two_ranks_in_one_process_do_not_collide():
    a, b = CollectorRegistry(), CollectorRegistry()
    TrainerMetrics(a, rank=0).observe_batch(5, False, {})
    TrainerMetrics(b, rank=1).observe_batch(7, False, {})
    assert a.get_sample_value("stream_ctr_records_trained_total", {"rank": "0"}) == 5
    assert b.get_sample_value("stream_ctr_records_trained_total", {"rank": "1"}) == 7


def test_server_serves_on_loopback_and_refuses_a_busy_port(reg):
    TrainerMetrics(reg).observe_batch(11, False, {})
    port = free_port()
    server = MetricsServer(reg, port)
    try:
        assert server.addr == "127.0.0.1" and server.port == port
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "stream_ctr_records_trained_total 11.0" in text
        with pytest.raises(ConfigError, match="metrics.port"):
            MetricsServer(CollectorRegistry(), port)
    finally:
        server.close()


def test_clip_ratio_quantiles_are_bucket_upper_bounds():
    from stream_ctr.telemetry.metrics import ClipRatioTally
    t = ClipRatioTally()
    assert t.summary()["rows"] == 0
    edges = np.array(t.edges)
    ratios = np.concatenate([np.full(60, 1e-3), np.full(39, 0.3), [100.0]])    # 100 rows
    t.add((ratios[:, None] <= edges[None, :]).sum(0), float(ratios.sum()), 100)
    s = t.summary()
    assert s["p50_le"] == edges[edges >= 1e-3][0] and s["p99_le"] == edges[edges >= 0.3][0]
    assert t.quantile_upper(1.0) == float("inf") and np.isclose(s["mean"], ratios.mean())
