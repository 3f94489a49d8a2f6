"""The run directory's time series: one compact JSON line per interval.

``RUN_DIR/timeseries.jsonl`` (``timeseries-rank<R>.jsonl`` for ranks > 0) is
what `stream-ctr report` plots. Each line is one JSON object with ``kind``:

- ``start``: ``t``, ``rank``, ``model``, ``source``, ``batch_size``, ``records``
  (records trained before this invocation: a resumed run continues the axis);
- ``interval``: ``t`` (unix s), ``records`` (trained so far in the run),
  ``samples_per_s`` (over the interval), ``auc``, ``logloss``, ``calibration``
  (sliding prequential window), ``lag_records``, ``freshness_s``,
  ``hit_ratio`` (per tier, over the interval), ``rows`` (per tier),
  ``rejected``, ``skipped_batches``; with several tiers ``served_share`` (the
  share of all lookups each tier served), and from the second pass over a file
  on ``epoch`` (passes completed when this one began);
- ``checkpoint``: a checkpoint was written (``t``, ``path``, ``records``);
- ``end``: the run's summary (records, seconds, test AUC ...).

Unknown values are ``null``. Lines are flushed but not fsynced: losing the
last second of a crashed run's plot is fine; an fsync per second is not.

Rotation (runs of weeks would otherwise grow one file by GBs). Once the
current file reaches ``max_bytes`` (``metrics.timeseries_max_bytes``, default
64 MiB, two to three days of 1 s intervals; 0 = never rotate) it is renamed to
the next numbered segment and a new current file is started::

    timeseries.jsonl.1  timeseries.jsonl.2  ...  timeseries.jsonl.<n>  timeseries.jsonl
    oldest ----------------------------------------------------------> newest (written now)

Segment numbers only grow: the oldest kept has the lowest number and no file
is renamed twice. Rank files rotate the same way (``timeseries-rank1.jsonl.<n>``).
A resumed run appends to the current file it finds (rotating it first if it
is already full) and numbers its next segment after the highest on disk.

At most ``keep_segments`` segments (``metrics.timeseries_keep_segments``,
default 8) are kept in full. An older one is folded into the history,
``timeseries.jsonl.0`` (read before every segment), then deleted: its
start, checkpoint and end records all, its intervals thinned to at most
`FOLD_INTERVALS`; a history past ``max_bytes`` keeps every other interval
until it fits. So a rank's series takes about (keep_segments + 2) x max_bytes
on disk, and the report of a run of months still spans it all, its old weeks
at a coarser step. The start record of the invocation that is writing is copied to the
head of every new current file, so the report still knows its model, source
and start time; readers treat a start record whose ``t`` they have already
seen as that copy, not as a new invocation.

Order of a rotation, so that a crash at any point loses no line: close the
current file; rename it to the segment (atomic: every line is under exactly
one of the two names); open the new current file and copy the start record
into it; only then fold the segments beyond ``keep_segments`` into the
history (a new history file renamed over the old) and delete them. A crash
after the rename leaves no current file (the writer creates it on resume,
the report reads the segments); one before the deletion leaves a segment too
many, folded again at the next rotation: a fold skips the lines whose ``t``
the history already reaches, so nothing is in it twice.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TextIO

from stream_ctr.config import MetricsConfig

# timeseries.jsonl, timeseries-rank3.jsonl, timeseries.jsonl.12, timeseries-rank3.jsonl.12
# (number 0: the history of deleted segments)
_FILE_NAME = re.compile(r"timeseries(?:-rank([0-9]+))?\.jsonl(?:\.([0-9]+))?")
FOLD_INTERVALS = 1000       # a deleted segment's intervals kept in the history, at most


def timeseries_path(run_dir: str | Path, rank: int = 0) -> Path:
    """The current (newest) time-series file of `rank` in `run_dir`."""
    name = "timeseries.jsonl" if rank == 0 else f"timeseries-rank{rank}.jsonl"
    return Path(run_dir) / name


def segment_paths(path: str | Path) -> list[Path]:
    """The rotated segments of the time-series file `path`, oldest first."""
    p = Path(path)
    numbered = []
    if p.parent.is_dir():
        for q in p.parent.iterdir():
            suffix = q.name[len(p.name) + 1:]
            if q.name.startswith(p.name + ".") and suffix.isascii() and suffix.isdigit() and int(suffix):
                numbered.append((int(suffix), q))
    # numerically: timeseries.jsonl.10 comes after timeseries.jsonl.9
    return [q for _, q in sorted(numbered)]


def history_path(path: str | Path) -> Path:
    """The history of the time-series file `path`: its deleted segments, thinned."""
    return Path(path).with_name(f"{Path(path).name}.0")


def timeseries_files(run_dir: str | Path) -> dict[int, list[Path]]:
    """Every rank's time-series files in `run_dir` in the order they were written:
    its history, its segments oldest first, then its current file (absent right
    after a crash mid-rotation). Ranks without any file are not in the result."""
    d = Path(run_dir)
    segments: dict[int, list[tuple[float, Path]]] = {}
    if d.is_dir():
        for p in d.iterdir():
            m = _FILE_NAME.fullmatch(p.name)
            if m and p.is_file():
                rank = int(m.group(1) or 0)
                # the current file has no number and sorts after every segment
                number = int(m.group(2)) if m.group(2) is not None else math.inf
                segments.setdefault(rank, []).append((number, p))
    return {rank: [p for _, p in sorted(files)] for rank, files in sorted(segments.items())}


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
    """Appends a record every `every_s` seconds (checked per batch, so cheap to call often).

    Opens `path` for appending (a resumed run continues its file) and rotates it
    into numbered segments once it holds `max_bytes` (0 = never), keeping at
    most `keep_segments` of them; the module docstring has the scheme.
    """

    def __init__(self, path: str | Path, every_s: float, records_before: int = 0,
                 clock: Callable[[], float] = time.time, *,
                 max_bytes: int = MetricsConfig.timeseries_max_bytes,
                 keep_segments: int = MetricsConfig.timeseries_keep_segments) -> None:
        if max_bytes < 0 or keep_segments < 1:
            raise ValueError(f"TimeSeriesLog: max_bytes must be >= 0 and keep_segments >= 1, "
                             f"got {max_bytes} and {keep_segments}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.every_s = every_s
        self.records_before = records_before
        self.clock = clock
        self.max_bytes = max_bytes
        self.keep_segments = keep_segments
        segments = segment_paths(self.path)
        self._next_segment = int(segments[-1].name.rsplit(".", 1)[1]) + 1 if segments else 1
        self._start_line: str | None = None     # this invocation's start, copied into each new file
        self._file: TextIO | None = None
        self._bytes = 0                         # size of the current file
        self._open()
        if self._full():            # resumed into a file that is already full
            self._rotate()
        self._last_t = clock()
        self._last_records = 0
        self._last_tiers: dict[str, dict[str, Any]] = {}

    def _open(self) -> None:
        self._file = open(self.path, "a", encoding="utf-8")
        self._bytes = os.fstat(self._file.fileno()).st_size
        if self._bytes and not _ends_with_newline(self.path):
            # a crash tore the last line: end it, or the next record would be glued to it
            self._file.write("\n")
            self._bytes += 1

    def _full(self) -> bool:
        return self.max_bytes > 0 and self._bytes >= self.max_bytes

    def _write(self, line: str) -> None:
        try:
            self._file.write(line)
            self._file.flush()
        except OSError as e:        # a full disk says which file, not just "No space left"
            raise OSError(e.errno, e.strerror, str(self.path)) from None
        # json.dumps escapes every non-ASCII character, so characters are bytes
        self._bytes += len(line)

    def _rotate(self) -> None:
        """Current file -> next segment, a new current file, then drop old segments
        (this order loses no line whatever step a crash interrupts)."""
        self._file.close()
        os.rename(self.path, self.path.with_name(f"{self.path.name}.{self._next_segment}"))
        self._next_segment += 1
        self._open()
        if self._start_line is not None:
            self._write(self._start_line)
        for old in segment_paths(self.path)[:-self.keep_segments]:
            self._fold(old)
            old.unlink(missing_ok=True)

    def _fold(self, segment: Path) -> None:
        """Add `segment` to the history (module docstring): every record but intervals,
        and at most FOLD_INTERVALS evenly spaced intervals; lines whose ``t`` the history
        already reaches are skipped (a fold repeated after a crash, a start record's
        copy). Streams the files (a segment is max_bytes of lines); the new history
        replaces the old in one rename."""
        history = history_path(self.path)
        last_t = max((_t(r) for r in read_timeseries(history)), default=-math.inf) \
            if history.exists() else -math.inf
        new = sum(r.get("kind") == "interval" and _t(r) > last_t for r in read_timeseries(segment))
        tmp = history.with_name(history.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as out:
            if history.exists():
                out.writelines(line + "\n" for line, _ in _lines(history))
            out.writelines(line + "\n" for line, _ in _thin(
                ((line, r) for line, r in _lines(segment) if _t(r) > last_t), -(-new // FOLD_INTERVALS)))
        while self.max_bytes and tmp.stat().st_size > self.max_bytes \
                and sum(r.get("kind") == "interval" for _, r in _lines(tmp)) > 1:
            thinner = tmp.with_name(tmp.name + ".2")
            with open(thinner, "w", encoding="utf-8") as out:
                out.writelines(line + "\n" for line, _ in _thin(_lines(tmp), 2))
            os.replace(thinner, tmp)
        os.replace(tmp, history)

    def append(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        line = json.dumps(_clean(record), separators=(",", ":")) + "\n"
        if record.get("kind") == "start":
            self._start_line = line
        self._write(line)
        if self._full():
            self._rotate()

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
        hit_ratio, rows, hits_by_tier = {}, {}, {}
        all_lookups = None                  # the first tier sees every key looked up
        for tier, s in snap.get("tiers", {}).items():
            prev = self._last_tiers.get(tier, {})
            lookups = (s.get("lookups") or 0) - (prev.get("lookups") or 0)
            hits = (s.get("hits") or 0) - (prev.get("hits") or 0)
            hit_ratio[tier] = hits / lookups if lookups > 0 else None
            hits_by_tier[tier] = hits
            all_lookups = lookups if all_lookups is None else all_lookups
            rows[tier] = s.get("rows")
        # Share of all lookups each tier served ("do I need more RAM?": the disk's share).
        served = {t: h / all_lookups for t, h in hits_by_tier.items()} if all_lookups else {}
        extra = {}
        if len(served) > 1:                 # with one tier it is the hit ratio again
            extra["served_share"] = served
        if snap.get("epoch"):               # passes over a file begun after the first
            extra["epoch"] = snap["epoch"]
        self.append({"kind": "interval", "t": now, "records": self.records_before + snap["records"],
                     # a stub interval (the run's last, cut short) gives no honest rate
                     "samples_per_s": (snap["records"] - self._last_records) / dt
                     if dt >= 0.5 * self.every_s else None,
                     "auc": snap.get("auc"), "logloss": snap.get("logloss"),
                     "calibration": snap.get("calibration"), "lag_records": snap.get("lag_records"),
                     "freshness_s": snap.get("freshness_s"), "hit_ratio": hit_ratio, "rows": rows,
                     "rejected": snap.get("rejected"), "skipped_batches": snap.get("skipped_batches"),
                     **extra})
        self._last_t, self._last_records = now, snap["records"]
        self._last_tiers = snap.get("tiers", {})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_timeseries(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records of a time-series file; a torn last line (crash mid-write) is skipped."""
    return (record for _, record in _lines(Path(path)))


def _lines(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(line, record) of a time-series file, streamed; torn lines (a crash mid-write) skipped."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            try:
                record = json.loads(line) if line else None
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                yield line, record


def _t(record: dict[str, Any]) -> float:
    t = record.get("t")
    return float(t) if isinstance(t, (int, float)) else -math.inf


def _thin(lines: Iterable[tuple[str, dict]], stride: int) -> Iterator[tuple[str, dict]]:
    """(line, record) pairs: every `stride`-th interval (the first kept) and every record of
    another kind."""
    i = 0
    for line, r in lines:
        if r.get("kind") == "interval":
            i += 1
            if (i - 1) % max(stride, 1):
                continue
        yield line, r


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"
