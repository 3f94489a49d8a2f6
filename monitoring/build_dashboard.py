"""Generates grafana/dashboards/stream_ctr.json: the dashboard as code.

    python monitoring/build_dashboard.py          # rewrite the JSON
    python monitoring/build_dashboard.py --check  # exit 1 if the JSON is stale

Edit the panels here, not in the JSON; a test keeps the two equal, checks that
every metric name is one stream_ctr/telemetry/catalogue.py exports, and evaluates every
expression against a real Prometheus scraping a real trainer.

Grafana variables used in expressions: ``$job``, ``$rank`` (multi-value, All =
``.*``) and ``$__rate_interval``.

A trainer that runs alone exports no rank label; the ranks of a distributed job
carry ``rank="r"``. ``rank=~"$rank"`` matches both (All is ``.*``, which a missing
label matches, as it does ``""``), and the per-rank legends read "trained" alone
and "trained rank 1" in a job (`ranked`).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "grafana" / "dashboards" / "stream_ctr.json"
S = '{job=~"$job", rank=~"$rank"}'          # the selector every trainer panel uses
J = '{job=~"$job"}'                         # ... and every predict-server panel (no ranks)
RI = "[$__rate_interval]"
DS = {"type": "prometheus", "uid": "${datasource}"}
NONFINITE = '{job=~"$job", rank=~"$rank", reason="nonfinite"}'
RANK = "{{ranked}}"                         # legend suffix: " rank r" in a job, nothing alone


def ranked(expr: str) -> str:
    """`expr` with a label ``ranked`` = " rank r" on series that carry rank="r" (a rank of a
    distributed job) and none on those without (a trainer alone), for legends."""
    return f'label_replace({expr}, "ranked", " rank $1", "rank", "(.+)")'


def target(expr: str, legend: str, ref: str) -> dict:
    if RANK in legend:
        expr = ranked(expr)
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": True}


def panel(kind: str, title: str, targets: list[tuple[str, str]], unit: str = "short",
          w: int = 8, h: int = 8, description: str = "", stack: bool = False,
          minmax: tuple[float | None, float | None] = (None, None)) -> dict:
    defaults: dict = {"unit": unit}
    if minmax[0] is not None:
        defaults["min"] = minmax[0]
    if minmax[1] is not None:
        defaults["max"] = minmax[1]
    if kind == "timeseries":
        defaults["custom"] = {"lineWidth": 1, "fillOpacity": 20 if stack else 0,
                              "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
    p = {"type": kind, "title": title, "description": description, "datasource": DS,
         "gridPos": {"w": w, "h": h},
         "targets": [target(e, legend, chr(ord("A") + i)) for i, (e, legend) in enumerate(targets)],
         "fieldConfig": {"defaults": defaults, "overrides": []}}
    if kind == "stat":
        p["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "area", "textMode": "auto"}
    else:
        p["options"] = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "none"}}
    return p


def rows() -> list[tuple[str, list[dict]]]:
    return [
        ("Throughput", [
            panel("timeseries", "Records / s", [
                (f"sum by (rank) (rate(stream_ctr_records_trained_total{S}{RI}))", "trained" + RANK),
                (f"sum by (rank) (rate(stream_ctr_records_consumed_total{S}{RI}))", "consumed" + RANK)],
                "short", description="Records trained and read from the source per second."),
            panel("stat", "Samples / s (trainer)", [
                (f"sum(stream_ctr_samples_per_second{S})", "samples/s")], "short", w=4),
            panel("stat", "Records trained", [
                (f"sum(stream_ctr_records_trained_total{S})", "records")], "short", w=4),
            panel("timeseries", "Step time by phase (seconds per second)", [
                (f"sum by (phase) (rate(stream_ctr_step_phase_seconds_sum{S}{RI}))", "{{phase}}")],
                "s", stack=True, description="Where the wall time goes: decode, prepare (working set), "
                "forward_backward, update, eval (prequential window), merge, checkpoint."),
            panel("timeseries", "Phase latency p90", [
                (f"histogram_quantile(0.9, sum by (phase, le) "
                 f"(rate(stream_ctr_step_phase_seconds_bucket{S}{RI})))", "{{phase}}")], "s", w=12),
            panel("timeseries", "Batches / s", [
                (f"sum by (rank) (rate(stream_ctr_batches_trained_total{S}{RI}))", "batches" + RANK)],
                "short", w=12),
        ]),
        ("Quality (prequential: scored before training)", [
            panel("timeseries", "AUC (sliding window)", [
                (f"stream_ctr_prequential_auc{S}", "AUC" + RANK),
                (f"stream_ctr_prequential_auc_baseline{S}", "baseline" + RANK)], "none"),
            panel("timeseries", "Logloss", [
                (f"stream_ctr_prequential_logloss{S}", "window" + RANK),
                (f"sum by (rank) (rate(stream_ctr_prequential_logloss_nats_total{S}[5m])) / "
                 f"sum by (rank) (rate(stream_ctr_prequential_records_total{S}[5m]))", "5m" + RANK)],
                "none"),
            panel("timeseries", "Calibration (predicted / observed CTR)", [
                (f"stream_ctr_prequential_calibration{S}", "window" + RANK),
                (f"sum by (rank) (rate(stream_ctr_prequential_predicted_clicks_total{S}[5m])) / "
                 f"sum by (rank) (rate(stream_ctr_prequential_clicks_total{S}[5m]))", "5m" + RANK)],
                "none"),
            panel("timeseries", "Normalized entropy (logloss / base-rate logloss; < 1 beats the base rate)", [
                (f"stream_ctr_prequential_normalized_entropy{S}", "window" + RANK)], "none", w=16),
            panel("stat", "Records in the AUC window", [
                (f"sum(stream_ctr_prequential_window_records{S})", "records")], "short", w=4),
            panel("stat", "Passes completed (>= 1: the window re-reads trained rows)", [
                (f"max(stream_ctr_epochs_completed{S})", "passes")], "short", w=4),
        ]),
        ("Freshness and lag", [
            panel("timeseries", "Consumer lag per partition (records)", [
                (f"sum by (partition) (stream_ctr_consumer_lag_records{S})", "{{partition}}")], "short",
                w=12, description="Records in each partition after the last trained one."),
            panel("timeseries", "Event-time freshness", [
                (f"stream_ctr_event_freshness_seconds{S}", "freshness" + RANK)], "s", w=8,
                description="Now minus the event time of the newest trained record."),
            panel("stat", "Newest trained event time", [
                (f"max(stream_ctr_last_trained_event_timestamp_seconds{S}) * 1000", "event time")],
                "dateTimeAsIso", w=4, description="Where in the stream the model is (useful in replays)."),
            panel("timeseries", "Serving freshness: record -> answering model (predict servers)", [
                (f"max by (instance) (stream_ctr_serving_freshness_seconds{J})", "from arrival {{instance}}"),
                (f"max by (instance) (stream_ctr_serving_event_freshness_seconds{J})",
                 "from event time {{instance}}"),
                (f"max by (instance) (stream_ctr_serving_model_age_seconds{J})", "model age {{instance}}")],
                "s", w=12, description="`stream-ctr serve --follow` of a `train --publish` run: from "
                "the newest trained record's arrival at the trainer (and its event time) to when the "
                "server began answering with a model trained on it; model age: since its checkpoint."),
            panel("timeseries", "Served published version", [
                (f"max by (instance) (stream_ctr_serving_model_published_version{J})", "{{instance}}")],
                "short", w=6, description="Goes up with every version a following server applies."),
            panel("timeseries", "Update apply time p90", [
                (f"histogram_quantile(0.9, sum by (instance, le) "
                 f"(rate(stream_ctr_serving_update_apply_seconds_bucket{J}{RI})))", "{{instance}}")],
                "s", w=6, description="Reading and applying one published update, up to the swap."),
        ]),
        ("Embedding tiers", [
            panel("timeseries", "Rows per tier", [
                (f"sum by (tier) (stream_ctr_embedding_rows{S})", "{{tier}}")], "short", w=6),
            panel("timeseries", "Bytes per tier and budget", [
                (f"sum by (tier) (stream_ctr_embedding_bytes{S})", "{{tier}}"),
                (f"sum by (tier) (stream_ctr_embedding_capacity_bytes{S})", "{{tier}} budget")],
                "bytes", w=6),
            panel("timeseries", "Hit ratio per tier", [
                (f"sum by (tier) (rate(stream_ctr_embedding_hits_total{S}{RI})) / "
                 f"sum by (tier) (rate(stream_ctr_embedding_lookups_total{S}{RI}))", "{{tier}}")],
                "percentunit", w=6, minmax=(0, 1)),
            panel("timeseries", "Evictions, rejected admissions, expiry, clipping / s", [
                (f"sum by (tier) (rate(stream_ctr_embedding_evictions_total{S}{RI}))", "evicted {{tier}}"),
                (f"sum(rate(stream_ctr_embedding_admissions_rejected_total{S}{RI}))", "admission rejected"),
                (f"sum(rate(stream_ctr_embedding_expired_total{S}{RI}))", "expired (TTL)"),
                (f"sum(rate(stream_ctr_embedding_rows_clipped_total{S}{RI}))", "CowClip clipped"),
                (f"sum by (reason) (rate(stream_ctr_embedding_evictions_by_reason_total{S}{RI}))",
                 "evicted: {{reason}}")],
                "short", w=6),
            panel("timeseries", "Step waiting for tier I/O (s per s)", [
                (f"sum by (rank) (rate(stream_ctr_embedding_prefetch_wait_seconds_total{S}{RI}))",
                 "waiting" + RANK)], "percentunit", w=6,
                description="Share of wall time the step waited for rows from RAM/LMDB; "
                "growing with a large disk share asks for more RAM."),
            panel("timeseries", "CowClip: share of present rows clipped", [
                (f"1 - sum(rate(stream_ctr_cowclip_gradient_threshold_ratio_bucket{{job=~\"$job\", rank=~\"$rank\", le=\"1.0\"}}{RI}))"
                 f" / sum(rate(stream_ctr_cowclip_gradient_threshold_ratio_count{S}{RI}))", "clipped share")],
                "percentunit", w=6, minmax=(0, None),
                description="0 everywhere: the clip never binds (docs/large-batches.md)."),
            panel("timeseries", "CowClip: ||gradient|| / threshold per row (bucket bounds)", [
                (f"histogram_quantile(0.5, sum by (le) (rate(stream_ctr_cowclip_gradient_threshold_ratio_bucket{S}{RI})))",
                 "p50"),
                (f"histogram_quantile(0.99, sum by (le) (rate(stream_ctr_cowclip_gradient_threshold_ratio_bucket{S}{RI})))",
                 "p99")],
                "short", w=6, description="Each present row's gradient norm over its clip threshold; a "
                "row is clipped above 1. Buckets are powers of 4, so the quantiles are bucket bounds."),
        ]),
        ("Merges and checkpoints", [
            panel("stat", "Last checkpoint age", [
                (f"max(stream_ctr_last_checkpoint_age_seconds{S})", "age")], "s", w=6),
            panel("timeseries", "Checkpoint size", [
                (f"stream_ctr_last_checkpoint_bytes{S}", "size" + RANK)], "bytes", w=3),
            panel("timeseries", "Checkpoints per hour", [
                (f"sum by (rank) (increase(stream_ctr_checkpoints_total{S}[1h]))", "checkpoints" + RANK)],
                "short", w=3),
            panel("timeseries", "k-step merges / s", [
                (f"sum by (rank) (rate(stream_ctr_merges_total{S}{RI}))", "merges" + RANK)], "short", w=3),
            panel("timeseries", "Since the last merge", [
                (f"stream_ctr_last_merge_age_seconds{S}", "age" + RANK)], "s", w=3,
                description="Seconds since this rank's last k-step merge; empty on a single-rank run."),
            panel("timeseries", "Merge traffic", [
                (f"sum by (rank) (rate(stream_ctr_merge_bytes_total{S}{RI}))", "traffic" + RANK)], "Bps", w=3),
            panel("timeseries", "Last merge size", [
                (f"stream_ctr_last_merge_bytes{S}", "size" + RANK)], "bytes", w=3,
                description="Bytes this rank sent in its last k-step merge; empty on a single-rank run."),
        ]),
        ("Errors and process", [
            panel("timeseries", "Rejected records and source errors / s", [
                (f"sum by (reason) (rate(stream_ctr_records_rejected_total{S}{RI}))", "rejected {{reason}}"),
                (f"sum by (reason) (rate(stream_ctr_source_errors_total{S}{RI}))", "source {{reason}}"),
                (f"sum(rate(stream_ctr_source_rebalances_total{S}{RI}))", "group rebalances")],
                "short", w=6),
            panel("timeseries", "Skipped batches (NaN/inf loss), last hour", [
                (f"sum by (rank) (increase(stream_ctr_batches_skipped_total{NONFINITE}[1h]))",
                 "skipped" + RANK)], "short", w=6),
            panel("timeseries", "Memory", [
                ('process_resident_memory_bytes{job=~"$job"}', "RSS {{instance}}"),
                (f"stream_ctr_process_peak_resident_memory_bytes{S}", "peak RSS" + RANK),
                (f"stream_ctr_gpu_memory_allocated_bytes{S}", "GPU" + RANK)], "bytes", w=6),
            panel("stat", "Targets up", [('sum(up{job=~"$job"})', "up")], "short", w=3),
            panel("stat", "Uptime", [(f"max(time() - stream_ctr_start_time_seconds{S})", "uptime")],
                  "s", w=3),
            panel("stat", "Version (ranks)", [(f"count by (version, torch) (stream_ctr_build_info{S})",
                                               "{{version}} torch {{torch}}")], "short", w=6),
            panel("timeseries", "Up: scrape, broker connection, backpressure", [
                ('up{job=~"$job"}', "scraped {{instance}}"),
                (f"stream_ctr_source_connected{S}", "broker connected" + RANK),
                (f"stream_ctr_source_paused{S}", "fetch paused" + RANK)], "short", w=12, h=6,
                minmax=(0, 1)),
            panel("timeseries", "CPU (cores busy)", [
                (f'sum by (instance) (rate(process_cpu_seconds_total{{job=~"$job"}}{RI}))', "{{instance}}")],
                "short", w=12, h=6),
        ]),
    ]


def variable(name: str, query: str, label: str) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": f"{name}-var"}, "definition": query, "refresh": 2,
            "includeAll": True, "multi": True, "allValue": ".*", "sort": 1,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}}


def build() -> dict:
    panels, y, pid = [], 0, 1
    for title, members in rows():
        panels.append({"type": "row", "title": title, "collapsed": False, "id": pid,
                       "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []})
        pid, y, x, row_h = pid + 1, y + 1, 0, 0
        for p in members:
            w, h = p["gridPos"]["w"], p["gridPos"]["h"]
            if x + w > 24:
                x, y, row_h = 0, y + row_h, 0
            p["gridPos"] = {"x": x, "y": y, "w": w, "h": h}
            p["id"] = pid
            panels.append(p)
            pid, x, row_h = pid + 1, x + w, max(row_h, h)
        y += row_h
    return {
        "uid": "stream-ctr", "title": "stream_ctr trainer", "tags": ["stream_ctr"],
        "description": "Streaming CTR trainer: throughput, prequential quality, lag, embedding tiers, "
                       "merges/checkpoints, errors. Metrics from stream_ctr/telemetry/catalogue.py.",
        "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1,
        "refresh": "30s", "time": {"from": "now-6h", "to": "now"}, "timezone": "",
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1},
            variable("job", "label_values(stream_ctr_records_trained_total, job)", "Job"),
            variable("rank", 'label_values(stream_ctr_records_trained_total{job=~"$job"}, rank)', "Rank"),
        ]},
        "annotations": {"list": ANNOTATIONS},
        "panels": panels,
    }


# Marks on every time series: a trainer (re)start (a new process start time) and each
# checkpoint, so a dip or a jump can be read against them.
ANNOTATIONS = [
    {"name": name, "datasource": DS, "enable": True, "iconColor": color, "expr": ranked(expr),
     "step": "60s", "titleFormat": title, "textFormat": "{{instance}}" + RANK,
     "useValueForTime": False}
    for name, color, expr, title in (
        ("Trainer starts", "red", 'changes(stream_ctr_start_time_seconds{job=~"$job", rank=~"$rank"}[2m]) > 0',
         "trainer (re)started"),
        ("Checkpoints", "blue", 'increase(stream_ctr_checkpoints_total{job=~"$job", rank=~"$rank"}[1m]) > 0',
         "checkpoint written"),
    )
]


def render() -> str:
    return json.dumps(build(), indent=1) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        stale = not OUT.exists() or OUT.read_text() != text
        print(f"{OUT} is {'stale: run python monitoring/build_dashboard.py' if stale else 'up to date'}")
        return int(stale)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
