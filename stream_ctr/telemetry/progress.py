"""Live progress on stderr: records/s, batches, windowed prequential AUC/logloss.

On a terminal the line is redrawn in place; otherwise (logs, CI) one line is
printed every `every_s` seconds so a long run still shows it is alive.
"""
from __future__ import annotations

import math
import sys
import time
from typing import TextIO


def _fmt(x: float, digits: int = 4) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _duration(seconds: float) -> str:
    """`42 s`, `3 min 05 s`, `2 h 07 min`."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class Progress:
    def __init__(self, label: str, every_s: float = 1.0, stream: TextIO | None = None,
                 enabled: bool = True, total: int | None = None) -> None:
        """`total`: the records this invocation will train when known (a file, a limit):
        the line then shows the share done and an estimate of the time left."""
        self.label = label
        self.total = total
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every_s = every_s if self.tty else max(every_s, 10.0)
        self.enabled = enabled
        self.start = time.perf_counter()
        self._last = 0.0
        self._drawn = False

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start

    def update(self, records: int, batches: int, auc: float, logloss: float,
               force: bool = False, window: str = "prequential window") -> None:
        """One progress line (at most every `every_s` unless `force`); `window` says what
        the AUC and logloss are of (after the first pass: rows the model has seen)."""
        now = time.perf_counter()
        if not self.enabled or (not force and now - self._last < self.every_s):
            return
        self._last = now
        rate = records / max(now - self.start, 1e-9)
        done = ""
        if self.total:
            share = min(records / self.total, 1.0)
            left = (self.total - records) / rate if rate > 0 and records < self.total else 0.0
            done = f" ({share:.0%}, {_duration(left)} left)"
        line = (f"{self.label}: {records:,}{'' if not self.total else f' of {self.total:,}'} records{done} | "
                f"{rate:,.0f} rec/s | {batches:,} batches | AUC {_fmt(auc)} | logloss {_fmt(logloss)} ({window})")
        if self.tty:
            self.stream.write("\r\033[K" + line)
            self._drawn = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
