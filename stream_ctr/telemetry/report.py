"""`stream-ctr report RUN_DIR`: PNG plots and a one-page HTML summary of a run.

Reads the time series the trainer keeps in its run directory
(`stream_ctr.telemetry.timeseries`: ``timeseries.jsonl``, its rotated segments
``timeseries.jsonl.<n>`` and the thinned history of deleted ones ``timeseries.jsonl.0``,
one set per rank) and writes into ``RUN_DIR/report/``:

- ``quality.png``      prequential AUC, logloss and calibration (sliding window)
- ``throughput.png``   records trained per second
- ``lag.png``          consumer lag (Kafka sources only: a file has no lag to speak of)
- ``freshness.png``    event-time freshness (only when the records carry event times)
- ``tier_share.png``   share of embedding lookups each tier served, stacked
- ``index.html``       the run's summary and config table with the plots

Every plot has the same x axis, minutes since the run started, and the same
marks: restarts of a resumed run (grey dashed), checkpoints (blue dotted) and
the start of each further pass over a file (green; the window then scores rows
the model has trained on). A directory that holds several runs (written by an
older version into one directory) is refused rather than drawn as one line.

Runs of weeks hold millions of interval records, more than a plot can show or
memory should hold. The files are streamed line by line, the history and
segments oldest first, and each rank keeps at most `MAX_POINTS` intervals
evenly spaced in interval count: every interval while they fit, then every
2nd, 4th, ... (when the kept points pass the bound, every other one is dropped
and the stride doubles), plus the last interval read. Sampling, not averaging: a spike
between two kept intervals does not show. The summary's numbers (records
trained, the end record, the tiers seen) come from every record read.
"""
from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from stream_ctr.config import ConfigError
from stream_ctr.telemetry.timeseries import read_timeseries, timeseries_files

# Intervals kept per rank for plotting: several per pixel of an 8-inch plot at 110 dpi.
MAX_POINTS = 4000


@dataclass
class RankSeries:
    """One rank's time series as the report holds it: `intervals` is an evenly
    spaced sample (every `stride`-th interval read, then the last one); the
    other fields account for every record read."""
    rank: int
    intervals: list[dict[str, Any]] = field(default_factory=list)
    starts: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] | None = None
    intervals_read: int = 0
    stride: int = 1
    last: dict[str, Any] | None = None
    records_max: float = -math.inf         # most records trained in any interval
    tiers: set[str] = field(default_factory=set)
    checkpoints: list[float] = field(default_factory=list)     # their wall times
    epoch_starts: list[float] = field(default_factory=list)    # wall time a pass >= 2 began
    _epoch: int = 0

    def add_interval(self, rec: dict[str, Any], max_points: int) -> None:
        """Count `rec` and keep it when it falls on the stride."""
        if self.intervals_read % self.stride == 0:
            self.intervals.append(rec)
            if len(self.intervals) > max_points:
                # the kept intervals are those numbered 0, stride, 2*stride ...; dropping
                # every other one leaves 0, 2*stride ..., still evenly spaced
                del self.intervals[1::2]
                self.stride *= 2
        self.intervals_read += 1
        self.last = rec
        records = _num(rec.get("records"))
        if math.isfinite(records):
            self.records_max = max(self.records_max, records)
        self.tiers.update(rec.get("hit_ratio") or {})
        epoch = rec.get("epoch") or 0
        if epoch > self._epoch:
            self.epoch_starts.append(rec["t"])
            self._epoch = epoch

    def finish(self) -> None:
        """The plots and the summary end at the last interval read, kept or not."""
        if self.last is not None and (not self.intervals or self.intervals[-1] is not self.last):
            self.intervals.append(self.last)

    def column(self, key: str) -> list[float]:
        return [_num(r.get(key)) for r in self.intervals]

    def t0(self) -> float:
        return self.starts[0]["t"] if self.starts else (self.intervals[0]["t"] if self.intervals else 0.0)

    def minutes(self) -> list[float]:
        t0 = self.t0()
        return [(r["t"] - t0) / 60.0 for r in self.intervals]


@dataclass
class Report:
    html: Path
    plots: list[Path]
    records: int


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan


def find_run_dir(path: str | Path) -> Path:
    """The run directory holding ``timeseries.jsonl``: `path` itself, or the run a
    checkpoint directory / checkpoint root belongs to."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"report: no such directory: {p}")
    candidates = [p, p.parent, p.parent.parent]
    state = p / "state.json"
    if state.exists():      # a checkpoint records the run directory it was written for
        try:
            run_dir = json.loads(state.read_text())["config"]["train"]["run_dir"]
            candidates.append(Path(run_dir))
        except (OSError, KeyError, TypeError, json.JSONDecodeError):
            pass
    for c in candidates:
        if 0 in timeseries_files(c):    # rank 0's file, or only its segments (crash mid-rotation)
            return c
    raise ConfigError(f"report: no timeseries.jsonl in {p} or the run it belongs to; the trainer "
                      "writes it while training unless metrics.timeseries_every_s is 0")


def load_series(run_dir: Path, max_points: int = MAX_POINTS) -> list[RankSeries]:
    """Every rank's series, its files streamed in the order written, at most
    `max_points` (+ the last) intervals kept per rank; ranks in order."""
    out = []
    for rank, paths in timeseries_files(run_dir).items():
        s = RankSeries(rank)
        start_times: set[Any] = set()
        for rec in _read_files(paths):
            kind = rec.get("kind")
            if kind == "interval" and "t" in rec:
                s.add_interval(rec, max_points)
            elif kind == "start":
                if rec.get("t") in start_times:
                    continue        # the copy a rotation puts at the head of a new file
                start_times.add(rec.get("t"))
                s.starts.append(rec)
                s.end = None        # an end belongs to the invocation it closed, not a later one
            elif kind == "end":
                s.end = rec
            elif kind == "checkpoint" and "t" in rec:
                s.checkpoints.append(rec["t"])
        s.finish()
        out.append(s)
    return out


def _read_files(paths: list[Path]) -> Iterator[dict[str, Any]]:
    for path in paths:
        try:
            yield from read_timeseries(path)
        except FileNotFoundError:
            continue        # a live run rotated it away (deleted) since the listing


def _axes_note(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")


def _marks(ax: Any, s: RankSeries) -> None:
    """Restarts (grey dashed), checkpoints (blue dotted), further passes (green)."""
    t0 = s.t0()
    for start in s.starts[1:]:
        ax.axvline((start["t"] - t0) / 60.0, color="0.6", linestyle="--", linewidth=0.8)
    for t in s.checkpoints:
        ax.axvline((t - t0) / 60.0, color="tab:blue", linestyle=":", linewidth=0.6, alpha=0.6)
    for t in s.epoch_starts:
        ax.axvline((t - t0) / 60.0, color="tab:green", linestyle="-.", linewidth=1.0)


def _line(ax: Any, series: list[RankSeries], y_key: str, label: str) -> bool:
    drew = False
    for s in series:
        pts = [(x, y) for x, y in zip(s.minutes(), s.column(y_key)) if math.isfinite(x) and math.isfinite(y)]
        if pts:
            # A restart breaks the line: the time the run was down has no samples, and a
            # straight segment across it would draw a ramp that never happened.
            t0 = s.t0()
            for start in s.starts[1:]:
                pts.append(((start["t"] - t0) / 60.0, math.nan))
            pts.sort(key=lambda p: p[0])
            name = f"{label} (rank {s.rank})" if len(series) > 1 else label
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, linewidth=1.4)
            _marks(ax, s)
            drew = True
    if drew:
        _legend(ax, series)
    return drew


def _legend(ax: Any, series: list[RankSeries]) -> None:
    """The plotted lines and, when present, what the vertical marks mean."""
    from matplotlib.lines import Line2D
    handles, labels = ax.get_legend_handles_labels()
    marks = (("restart (the run was down until here)", any(len(s.starts) > 1 for s in series),
              dict(color="0.6", linestyle="--", linewidth=0.8)),
             ("checkpoint", any(s.checkpoints for s in series),
              dict(color="tab:blue", linestyle=":", linewidth=0.8)),
             ("next pass over the file", any(s.epoch_starts for s in series),
              dict(color="tab:green", linestyle="-.", linewidth=1.0)))
    for text, present, style in marks:
        if present:
            handles.append(Line2D([], [], **style))
            labels.append(text)
    ax.legend(handles, labels, loc="best", fontsize="small")


def _tiers(series: list[RankSeries]) -> list[str]:
    names = {t for s in series for t in s.tiers}
    order = {"device": 0, "host": 1, "disk": 2}
    return sorted(names, key=lambda t: (order.get(t, 9), t))


def plot_all(series: list[RankSeries], out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    source = str((series[0].starts[0] if series[0].starts else {}).get("source", ""))
    reread = any(s.epoch_starts for s in series)
    x_label = "minutes since the run started"

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)

    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    fig.suptitle("Prequential quality (sliding window, scored before training)"
                 + ("\nafter a green line the window re-reads rows trained on: not held out" if reread else ""))
    for ax, key, unit, empty in zip(axes, ("auc", "logloss", "calibration"),
                                    ("AUC", "logloss (nats)", "predicted / observed CTR"),
                                    ("no AUC yet (window needs both classes)", "no logloss yet",
                                     "no calibration yet")):
        if not _line(ax, series, key, unit):
            _axes_note(ax, empty)
        ax.set_ylabel(unit)
    axes[2].axhline(1.0, color="0.5", linewidth=0.6)
    axes[2].set_xlabel(x_label)
    save(fig, "quality.png")

    plots = [("throughput.png", "Throughput: records trained per second", "samples_per_s", "records / s",
              "no throughput samples")]
    if source.lower().startswith("kafka://"):
        plots.append(("lag.png", "Consumer lag: records in the topic not yet trained", "lag_records",
                      "records", "no lag reported by the source"))
    if any(math.isfinite(v) for s in series for v in s.column("freshness_s")):
        plots.append(("freshness.png", "Freshness: now minus the newest trained event time",
                      "freshness_s", "seconds", "no event times"))
    for name, title, column, unit, empty in plots:
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.set_title(title)
        if not _line(ax, series, column, unit):
            _axes_note(ax, empty)
        ax.set_xlabel(x_label)
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        save(fig, name)

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.set_title("Embedding lookups served by each tier (share of all lookups, stacked)")
    main = series[0]
    tiers = _tiers(series)
    xs = main.minutes()
    # served_share is written with several tiers; with one, its hit ratio is the same number
    shares = [[_num((r.get("served_share") or r.get("hit_ratio") or {}).get(t)) for r in main.intervals]
              for t in tiers]
    keep = [i for i in range(len(xs)) if all(math.isfinite(col[i]) for col in shares)] if tiers else []
    if keep:
        ys = [[col[i] for i in keep] for col in shares]
        new = [max(0.0, 1.0 - sum(col[i] for col in ys)) for i in range(len(keep))]
        ax.stackplot([xs[i] for i in keep], *ys, new, labels=[*tiers, "new keys (no row yet)"], alpha=0.8)
        _marks(ax, main)
        ax.legend(loc="lower left", fontsize="small")
        ax.set_ylim(0, 1.0)
    else:
        _axes_note(ax, "no tier statistics reported by the store")
    ax.set_xlabel(x_label)
    ax.set_ylabel("share of lookups")
    save(fig, "tier_share.png")
    return paths


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        if not math.isfinite(x):
            return "-"
        if x != 0 and abs(x) < 0.01:        # an l2 of 1e-05 is not 0.0000
            return f"{x:.4g}"
        return f"{x:,.4f}" if abs(x) < 100 else f"{x:,.0f}"
    if isinstance(x, int) and not isinstance(x, bool):
        return f"{x:,}"
    return "-" if x is None else str(x)


SUMMARY_KEYS = (("records_trained_total", "records trained (run)"),
                ("records_trained", "records trained (last invocation)"),
                ("records_rejected", "records rejected"), ("skipped_batches", "batches skipped (NaN/inf)"),
                ("seconds", "seconds (last invocation)"), ("samples_per_s", "records / s"),
                ("window_auc", "prequential AUC (window)"), ("window_logloss", "prequential logloss"),
                ("window_calibration", "calibration (window)"), ("test_auc", "held-out AUC"),
                ("test_logloss", "held-out logloss"), ("test_calibration", "held-out calibration"),
                ("test_ne", "held-out normalized entropy"), ("checkpoint", "last checkpoint"))


def render_html(run_dir: Path, series: list[RankSeries], plots: list[Path]) -> str:
    main = series[0]
    first = main.starts[0] if main.starts else {}
    last = main.intervals[-1] if main.intervals else {}
    end = main.end or {}
    # runs/latest is a link: name the run it points at
    rows = [("run directory", str(run_dir.resolve())), ("model", first.get("model")),
            ("source", first.get("source")), ("batch size", first.get("batch_size")),
            ("invocations", len(main.starts)), ("ranks", len(series))]
    rows += [(label, end[key]) for key, label in SUMMARY_KEYS if key in end]
    if not end:
        rows += [("records trained", last.get("records")), ("prequential AUC", last.get("auc")),
                 ("status", "no end record: the run is still going or crashed")]
    for e in end.get("test_per_epoch") or []:
        rows.append((f"held-out AUC after pass {e.get('epoch')}", e.get("auc")))
    rows += [(f"optim.{k}", v) for k, v in (end.get("optim") or {}).items()
             if k in ("batch_size", "scale_from_batch", "lr_dense", "lr_embed", "l2", "warmup_samples",
                      "embed_lr_rule", "count_lr_s", "cowclip", "cowclip_r")]
    rows += [("checkpoints (this report)", len(main.checkpoints)), ("passes begun", 1 + len(main.epoch_starts))]
    if not any(p.name == "lag.png" for p in plots):
        rows.append(("consumer lag", "not plotted: a file source (lag is for Kafka topics)"))
    table = "\n".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(_fmt(v))}</td></tr>"
                      for k, v in rows)
    imgs = "\n".join(f'<figure><img src="{html.escape(p.name)}" alt="{html.escape(p.stem)}"></figure>'
                     for p in plots)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>stream_ctr run report: {html.escape(run_dir.resolve().name)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1em; }}
th, td {{ text-align: left; padding: 2px 12px; border-bottom: 1px solid #ddd; }}
.plots {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 8px; }}
img {{ max-width: 100%; }} figure {{ margin: 0; }}
</style></head><body>
<h1>stream_ctr run report</h1>
<table>
{table}
</table>
<div class="plots">
{imgs}
</div>
</body></html>
"""


def write_report(path: str | Path, out: str | Path | None = None) -> Report:
    """Write the plots and ``index.html`` for the run at `path`; returns where."""
    run_dir = find_run_dir(path)
    series = load_series(run_dir)
    if not series or not any(s.intervals for s in series):
        raise ConfigError(f"report: {run_dir}/timeseries.jsonl has no interval records yet")
    # A resume starts where its checkpoint left off (records > 0); a start at 0 after
    # the first is another run written into the same directory by an older version.
    fresh = [st for st in series[0].starts[1:] if st.get("records") == 0]
    if fresh:
        names = ", ".join(f"{st.get('model')} on {st.get('source')}" for st in series[0].starts[:1] + fresh)
        raise ConfigError(f"report: {run_dir} holds {len(fresh) + 1} runs in one time series ({names}): "
                          "an older version wrote them into one directory; a report would draw them "
                          "as one line. Train again into separate run directories")
    out_dir = Path(out) if out else run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = plot_all(series, out_dir)
    index = out_dir / "index.html"
    index.write_text(render_html(run_dir, series, plots), encoding="utf-8")
    records = int(max((s.records_max for s in series if math.isfinite(s.records_max)), default=0))
    return Report(index, plots, records)
