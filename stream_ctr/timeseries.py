"""The run directory's time series: one compact JSON line per interval.

``RUN_DIR/timeseries.jsonl`` (``timeseries-rank<R>.jsonl`` for ranks > 0) is
what `stream-ctr report` plots. Each line is one JSON object with ``kind``:

- ``start``: ``t``, ``rank``, ``model``, ``source``, ``batch_size``, ``records``
  (records trained before this invocation: a resumed run continues the axis);
- ``interval``: ``t`` (unix s), ``records`` (trained so far in the run),
  ``samples_per_s`` (over the interval), ``auc``, ``logloss``, ``calibration``
  (sliding prequential window), ``lag_records``, ``freshness_s``,
  ``hit_ratio`` (per tier, over the interval), ``rows`` (per tier),
  ``rejected``, ``skipped_batches``;
- ``end``: the run's summary (records, seconds, test AUC ...).

Unknown values are ``null``. Lines are flushed but not fsynced: losing the
last second of a crashed run's plot is fine; an fsync per second is not.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterator


def timeseries_path(run_dir: str | Path, rank: int = 0) -> Path:
    name = "timeseries.jsonl" if rank == 0 else f"timeseries-rank{rank}.jsonl"
    return Path(run_dir) / name


def _clean(x: Any) -> Any:
    """NaN/inf -> None (JSON has no NaN); floats rounded to keep lines short."""
    if isinstance(x, float):
        return round(x, 6) if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


class TimeSeriesLog:
    """Appends a record every `every_s` seconds (checked per batch, so cheap to call often)."""

    def __init__(self, path: str | Path, every_s: float, records_before: int = 0,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.every_s = every_s
        self.records_before = records_before
        self.clock = clock
        self._file = open(self.path, "a", encoding="utf-8")
        self._last_t = clock()
        self._last_records = 0
        self._last_tiers: dict[str, dict[str, Any]] = {}

    def append(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(_clean(record), separators=(",", ":")) + "\n")
        self._file.flush()

    @property
    def last_records(self) -> int:
        """Records (this invocation) at the last interval record."""
        return self._last_records

    def due(self) -> bool:
        return self.clock() - self._last_t >= self.every_s

    def append_interval(self, snap: dict[str, Any]) -> None:
        """One ``interval`` record from `TrainerMetrics.snapshot()`."""
        now = snap.get("t", self.clock())
        dt = max(now - self._last_t, 1e-9)
        hit_ratio, rows = {}, {}
        for tier, s in snap.get("tiers", {}).items():
            prev = self._last_tiers.get(tier, {})
            lookups = (s.get("lookups") or 0) - (prev.get("lookups") or 0)
            hits = (s.get("hits") or 0) - (prev.get("hits") or 0)
            hit_ratio[tier] = hits / lookups if lookups > 0 else None
            rows[tier] = s.get("rows")
        self.append({"kind": "interval", "t": now, "records": self.records_before + snap["records"],
                     # a stub interval (the run's last, cut short) gives no honest rate
                     "samples_per_s": (snap["records"] - self._last_records) / dt
                     if dt >= 0.5 * self.every_s else None,
                     "auc": snap.get("auc"), "logloss": snap.get("logloss"),
                     "calibration": snap.get("calibration"), "lag_records": snap.get("lag_records"),
                     "freshness_s": snap.get("freshness_s"), "hit_ratio": hit_ratio, "rows": rows,
                     "rejected": snap.get("rejected"), "skipped_batches": snap.get("skipped_batches")})
        self._last_t, self._last_records = now, snap["records"]
        self._last_tiers = snap.get("tiers", {})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_timeseries(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records of a time-series file; a torn last line (crash mid-write) is skipped."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
