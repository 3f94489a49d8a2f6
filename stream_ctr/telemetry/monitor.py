"""What a training run reports to: Prometheus metrics, their endpoint, the run time series.

The train loop holds one `RunMonitor` and calls one hook per phase
(`on_read`, `on_batch`, `on_checkpoint`, `close`); everything here is per
chunk or per batch, never per record.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from prometheus_client import CollectorRegistry

from stream_ctr.config import Config
from stream_ctr.telemetry.metrics import MetricsServer, TrainerMetrics
from stream_ctr.telemetry.timeseries import TimeSeriesLog, timeseries_path


def process_rank() -> tuple[int, int]:
    """(global rank, local rank) from torchrun's environment; (0, 0) when run alone."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))


def metrics_rank() -> int | None:
    """The rank label of this process's metrics: its rank in a job of several
    (torchrun's WORLD_SIZE > 1), or None when it trains alone (no rank label)."""
    return process_rank()[0] if int(os.environ.get("WORLD_SIZE", 1)) > 1 else None


def _dir_bytes(path: str | Path) -> int:
    p = Path(path)
    return sum(f.stat().st_size for f in p.iterdir() if f.is_file()) if p.is_dir() else 0


class RunMonitor:
    """Metrics (served on `metrics.port` + local rank when it is not 0; labelled with the
    rank only in a job of several ranks) and the time series."""

    def __init__(self, cfg: Config, run_dir: str | Path, records_before: int = 0,
                 registry: CollectorRegistry | None = None) -> None:
        from stream_ctr.connectors.decode import REASONS
        self.rank, local_rank = process_rank()
        m = cfg.metrics
        self.registry = registry or CollectorRegistry()
        self.metrics = TrainerMetrics(self.registry, metrics_rank(), reasons=REASONS[1:],
                                      auc_baseline=m.auc_baseline)
        self.server = MetricsServer(self.registry, m.port + local_rank, m.addr) if m.port else None
        self.series = (TimeSeriesLog(timeseries_path(run_dir, self.rank), m.timeseries_every_s,
                                     records_before, max_bytes=m.timeseries_max_bytes,
                                     keep_segments=m.timeseries_keep_segments)
                       if m.timeseries_every_s > 0 else None)
        if self.series is not None:
            self.series.append({"kind": "start", "t": time.time(), "rank": self.rank,
                                "model": cfg.model.name, "source": cfg.data.source,
                                "batch_size": cfg.data.batch_size, "records": records_before})

    @property
    def url(self) -> str:
        return f"http://{self.server.addr}:{self.server.port}/metrics" if self.server else ""

    def watch(self, store: object, window: object,
              lag: Callable[[], Mapping[str, float]] | None = None, source: object | None = None) -> None:
        """Providers read at scrape time: the embedding store, the prequential window, the source."""
        self.metrics.watch_store(store)
        self.metrics.watch_window(window)
        self.metrics.watch_source(lag=lag, source=source)

    def on_read(self, chunk: Any, rejected: list, seconds: float) -> None:
        """A chunk came from the source (decoded rows + rejected records) in `seconds`."""
        self.metrics.observe_read(chunk.partitions, chunk.partition, rejected, seconds)

    def interval_due(self) -> bool:
        """Whether the next `on_batch` writes a time-series record (then its accuracy
        should be computed now, not the last cached one)."""
        return self.series is not None and self.series.due()

    def on_batch(self, batch: Any, result: Any, accuracy: Any, interval: bool) -> None:
        """A batch was stepped (`trainer.StepResult`); `accuracy` is the window after it.
        `interval`: whether to write a time-series record now (the caller's
        `interval_due()`, asked before computing `accuracy` for it)."""
        self.metrics.observe_batch(len(batch), bool(result.skipped), result.phase_s,
                                   int(result.rows_clipped), batch.event_time_ms,
                                   accuracy.as_dict(), int(result.rows_touched), result.clip_ratio())
        if self.series is not None and interval:
            self.series.append_interval(self.metrics.snapshot())

    def on_checkpoint(self, seconds: float, path: str | Path) -> None:
        self.metrics.observe_checkpoint(seconds, _dir_bytes(path))
        if self.series is not None:         # a mark on the report's time axis
            self.series.append({"kind": "checkpoint", "t": time.time(), "path": str(path),
                                "records": self.metrics.records_trained + self.series.records_before})

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Last interval record, the run summary, then stop serving. Idempotent."""
        if self.series is not None:
            snap = self.metrics.snapshot()
            if snap["records"] != self.series.last_records:     # else the last record says it all
                self.series.append_interval(snap)
            if summary is not None:
                self.series.append({"kind": "end", "t": time.time(), **summary})
            self.series.close()
            self.series = None
        if self.server is not None:
            self.server.close()
            self.server = None
