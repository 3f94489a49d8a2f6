"""The predict server's Prometheus metrics (`stream-ctr serve`, GET /metrics).

Names follow the trainer's catalogue (`stream_ctr_<subsystem>_<name>_<unit>`,
counters end in ``_total``); the subsystem is ``serving``. They are not in
`telemetry.catalogue.CATALOGUE`, which lists what a *trainer* exports (its tests
demand every one of those in a trainer's scrape and on the dashboard).

The registry is passed in. The model's version and age are read at scrape time
from the predictor (a custom collector), never mirrored: after a swap the next
scrape shows the new model.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

NS = "stream_ctr_serving"
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.075,
                     0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)

# name -> help, for the README and the tests
SERIES = {
    f"{NS}_request_seconds": "Wall time of one POST /predict, from its body read to its answer "
                             "(histogram; rejected requests included).",
    f"{NS}_records_scored_total": "Records scored and answered.",
    f"{NS}_requests_total": "POST /predict requests answered, by code (200, 400, 413, 500, 503).",
    f"{NS}_batch_records": "Records per scoring call: concurrent requests coalesced by the "
                           "scoring thread (histogram).",
    f"{NS}_model_info": "Always 1; the label version names the model answering (checkpoint@step).",
    f"{NS}_model_step": "The training step of the model answering.",
    f"{NS}_model_age_seconds": "Now minus the time its checkpoint was written (absent for a "
                               "bundle exported before manifests carried that time).",
    f"{NS}_model_swaps_total": "Models swapped in while serving.",
}


class ServingMetrics:
    """What the server updates per request and per scoring call."""

    def __init__(self, registry: CollectorRegistry, model: Callable[[], tuple[str, int, float | None]],
                 clock: Callable[[], float] = time.time) -> None:
        self.registry = registry
        self.request_seconds = Histogram(f"{NS}_request_seconds", SERIES[f"{NS}_request_seconds"],
                                         registry=registry, buckets=LATENCY_BUCKETS_S)
        self.records_scored = Counter(f"{NS}_records_scored", SERIES[f"{NS}_records_scored_total"],
                                      registry=registry)
        self.requests = Counter(f"{NS}_requests", SERIES[f"{NS}_requests_total"], ["code"],
                                registry=registry)
        self.batch_records = Histogram(f"{NS}_batch_records", SERIES[f"{NS}_batch_records"],
                                       registry=registry, buckets=BATCH_BUCKETS)
        self.swaps = Counter(f"{NS}_model_swaps", SERIES[f"{NS}_model_swaps_total"], registry=registry)
        registry.register(_ModelCollector(model, clock))


class _ModelCollector:
    """model_info / model_step / model_age_seconds of the model answering now."""

    def __init__(self, model: Callable[[], tuple[str, int, float | None]], clock: Callable[[], float]) -> None:
        self.model, self.clock = model, clock

    def describe(self) -> list[Metric]:
        return []                       # no collect() at registration: the predictor may not exist yet

    def collect(self) -> Iterator[Metric]:
        version, step, time_s = self.model()
        info = GaugeMetricFamily(f"{NS}_model_info", SERIES[f"{NS}_model_info"], labels=["version"])
        info.add_metric([version], 1.0)
        yield info
        yield GaugeMetricFamily(f"{NS}_model_step", SERIES[f"{NS}_model_step"], value=float(step))
        if time_s is not None:
            yield GaugeMetricFamily(f"{NS}_model_age_seconds", SERIES[f"{NS}_model_age_seconds"],
                                    value=max(self.clock() - time_s, 0.0))
