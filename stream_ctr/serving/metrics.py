"""The predict server's Prometheus metrics (`stream-ctr serve`, GET /metrics).

Names and help come from `telemetry.catalogue.SERVING_CATALOGUE`
(`stream_ctr_serving_<name>_<unit>`, counters end in ``_total``); they are
not in `CATALOGUE`, which lists what a *trainer* exports (its tests demand
every one of those in a trainer's scrape).

The registry is passed in. The model's version, age and freshness are read at
scrape time from the predictor (a custom collector), never mirrored: after a
swap the next scrape shows the new model. `FollowMetrics` (update counts and
apply times) exist only on a server that follows a publish directory.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import platform
import sys

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from stream_ctr.telemetry.catalogue import FOLLOW_ONLY, SERVING_CATALOGUE

NS = "stream_ctr_serving"
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.075,
                     0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)
APPLY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 300.0)

# name -> help of what every server exports, for the README and the tests
SERIES = {s.name: s.help for s in SERVING_CATALOGUE if s.name not in FOLLOW_ONLY}
# ... and of what a following server exports besides
FOLLOW_SERIES = {s.name: s.help for s in SERVING_CATALOGUE if s.name in FOLLOW_ONLY}
_HELP = {**SERIES, **FOLLOW_SERIES}


# Every counter and histogram would also export a `_created` series per label set (the
# client_python default): twice the series for no use, and the trainer's scrape has none.
prometheus_client.disable_created_metrics()


def _version() -> str:
    from stream_ctr import __version__
    return __version__


@dataclass(frozen=True)
class ModelStatus:
    """What the scrape says about the model answering now."""
    version: str
    step: int
    checkpoint_time_s: float | None         # None: a bundle exported before manifests had it
    published_version: int | None = None    # a version of a publish directory
    freshness_s: float | None = None        # newest record's arrival at the trainer -> answering
    event_freshness_s: float | None = None  # ... from its event time


class ServingMetrics:
    """What the server updates per request and per scoring call."""

    def __init__(self, registry: CollectorRegistry, model: Callable[[], ModelStatus],
                 clock: Callable[[], float] = time.time) -> None:
        self.registry = registry
        self.request_seconds = Histogram(f"{NS}_request_seconds", _HELP[f"{NS}_request_seconds"],
                                         registry=registry, buckets=LATENCY_BUCKETS_S)
        self.records_scored = Counter(f"{NS}_records_scored", _HELP[f"{NS}_records_scored_total"],
                                      registry=registry)
        self.requests = Counter(f"{NS}_requests", _HELP[f"{NS}_requests_total"], ["code"],
                                registry=registry)
        self.batch_records = Histogram(f"{NS}_batch_records", _HELP[f"{NS}_batch_records"],
                                       registry=registry, buckets=BATCH_BUCKETS)
        self.swaps = Counter(f"{NS}_model_swaps", _HELP[f"{NS}_model_swaps_total"], registry=registry)
        build = Gauge(f"{NS}_build_info", _HELP[f"{NS}_build_info"], ["version", "torch", "python"],
                      registry=registry)
        build.labels(_version(), getattr(sys.modules.get("torch"), "__version__", "not loaded"),
                     platform.python_version()).set(1)
        registry.register(_ModelCollector(model, clock))
        # process_cpu_seconds_total, process_resident_memory_bytes, process_start_time_seconds,
        # open fds: what the trainer's scrape has, and what the shipped alerts read.
        prometheus_client.ProcessCollector(registry=registry)


class FollowMetrics:
    """A following server's updates: how many, how long each took to apply, failures."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.apply_seconds = Histogram(f"{NS}_update_apply_seconds", _HELP[f"{NS}_update_apply_seconds"],
                                       registry=registry, buckets=APPLY_BUCKETS_S)
        self.updates = Counter(f"{NS}_updates", _HELP[f"{NS}_updates_total"], ["kind"], registry=registry)
        self.failures = Counter(f"{NS}_update_failures", _HELP[f"{NS}_update_failures_total"],
                                registry=registry)
        for kind in ("full", "delta"):
            self.updates.labels(kind)


class _ModelCollector:
    """model_info / step / age, and for a published model its version and freshness."""

    def __init__(self, model: Callable[[], ModelStatus], clock: Callable[[], float]) -> None:
        self.model, self.clock = model, clock

    def describe(self) -> list[Metric]:
        return []                       # no collect() at registration: the predictor may not exist yet

    def collect(self) -> Iterator[Metric]:
        m = self.model()
        info = GaugeMetricFamily(f"{NS}_model_info", _HELP[f"{NS}_model_info"], labels=["version"])
        info.add_metric([m.version], 1.0)
        yield info
        yield GaugeMetricFamily(f"{NS}_model_step", _HELP[f"{NS}_model_step"], value=float(m.step))
        if m.checkpoint_time_s is not None:
            yield GaugeMetricFamily(f"{NS}_model_age_seconds", _HELP[f"{NS}_model_age_seconds"],
                                    value=max(self.clock() - m.checkpoint_time_s, 0.0))
        for name, value in (("model_published_version", m.published_version),
                            ("freshness_seconds", m.freshness_s),
                            ("event_freshness_seconds", m.event_freshness_s)):
            if value is not None:
                yield GaugeMetricFamily(f"{NS}_{name}", _HELP[f"{NS}_{name}"], value=float(value))
