"""A real Prometheus scrapes a real trainer; every dashboard panel and alert rule is evaluated.

The trainer runs `stream-ctr train` on the bundled Avazu sample (it carries event
times, so the freshness panels have data) for many epochs with small batches,
serving metrics on a free loopback port; the test SIGTERMs it at the end, and it
checkpoints and exits 0.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
from pathlib import Path

import pytest

from stream_ctr.telemetry.catalogue import SERVING_CATALOGUE
from tests.prometheus_server import (PromQLError, alert_rules, dashboard_panels,
                                     dashboard_variable_selectors, free_port, grafana_to_promql,
                                     http_get, metric_names)

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "monitoring" / "grafana" / "dashboards" / "stream_ctr.json"
ALERTS = ROOT / "monitoring" / "alerts.yml"
# Metrics a single-rank CPU run on a file cannot have; an expression may come back
# empty only if every stream_ctr metric it uses is one of these (and its panel still
# shows something else).
MAY_BE_EMPTY = {
    "stream_ctr_embedding_capacity_bytes",      # the in-memory store has no byte budget
    "stream_ctr_last_merge_age_seconds",        # one rank: no k-step merges
    "stream_ctr_last_merge_bytes",
    "stream_ctr_gpu_memory_allocated_bytes",    # CPU machine
    "stream_ctr_embedding_evictions_by_reason_total",   # the in-memory store never evicts
}
# A predict server is another process: these tests scrape trainers only.
MAY_BE_EMPTY |= {n for spec in SERVING_CATALOGUE for n in spec.series_names}
# Panels that show only such metrics are blank on one rank (or without a predict server).
MAY_BE_BLANK = {"Since the last merge", "Last merge size", "Served published version", "Update apply time p90",
                "Serving freshness: record -> answering model (predict servers)"}
# A file source has no broker: no connection state, errors or group rebalances.
FILE_SOURCE_EMPTY = {"stream_ctr_source_errors_total", "stream_ctr_source_connected",
                     "stream_ctr_source_paused", "stream_ctr_source_rebalances_total"}


def start_trainer(tmp_path: Path, port: int, source: str = "avazu:sample",
                  extra: list[str] | tuple[str, ...] = ()) -> subprocess.Popen:
    epochs = [] if source.startswith("kafka://") else ["--epochs", "10000"]   # a stream: one epoch
    cmd = [sys.executable, "-m", "stream_ctr", "train", source, "--quiet", *epochs, "--batch-size", "32", "--threads", "1", "--checkpoint-every", "100",
           "--run-dir", str(tmp_path / "run"), "--metrics-port", str(port),
           "--set", "metrics.auc_baseline=0.55", "--set", "train.eval_window_records=2000", *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_for_endpoint(proc: subprocess.Popen, port: int, timeout_s: float = 180.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"trainer exited with {proc.returncode}: {proc.stderr.read()[-3000:]}")
        try:
            text = http_get(f"http://127.0.0.1:{port}/metrics").decode()
            if "stream_ctr_records_trained_total" in text:
                return text
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.5)
    pytest.fail(f"trainer metrics endpoint on port {port} not up after {timeout_s}s")


def stop_trainer(proc: subprocess.Popen) -> tuple[int, str, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)       # finish the batch, checkpoint, exit 0
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err


def first_value(prom, expr: str) -> float:
    result = prom.query(expr)
    return float(result[0]["value"][1]) if result else float("nan")


def evaluate_dashboard(prom) -> tuple[dict[str, list[str]], list[str]]:
    """Per panel title, its expressions that returned nothing; raises on an invalid one."""
    empty: dict[str, list[str]] = {}
    for panel in dashboard_panels(DASHBOARD):
        for t in panel["targets"]:
            expr = grafana_to_promql(t["expr"])
            try:
                result = prom.query(expr)
            except PromQLError as e:
                pytest.fail(f"panel {panel['title']!r}: invalid expression {expr!r}: {e}")
            if not result:
                empty.setdefault(panel["title"], []).append(t["expr"])
    no_data = [p["title"] for p in dashboard_panels(DASHBOARD)
               if len(empty.get(p["title"], [])) == len(p["targets"])]
    return empty, no_data


def check_against_prometheus(prom, may_be_empty: set[str], job: str = "stream_ctr") -> None:
    """Every panel returns data, every alert rule is valid and healthy, variables resolve."""
    prom.wait_for("two checkpoints and 8 scrapes of the trainer", lambda: (
        first_value(prom, "sum(stream_ctr_checkpoints_total)") >= 2
        and first_value(prom, "min(count_over_time(stream_ctr_records_trained_total[2m]))") >= 8),
        timeout_s=180)
    deadline = time.monotonic() + 90
    while True:
        empty, no_data = evaluate_dashboard(prom)
        if not no_data or time.monotonic() > deadline or set(no_data) <= MAY_BE_BLANK:
            break
        time.sleep(2)
    # A panel may be blank only when every metric it shows is one this run cannot have
    # (the last-merge panels of a single rank); all others must show data.
    unexplained = [title for title in no_data
                   if not all({n for n in metric_names(e) if n.startswith("stream_ctr_")} <= may_be_empty
                              for e in empty[title])]
    assert not unexplained, f"panels without data: {unexplained}; empty expressions: {empty}"
    for title, exprs in empty.items():
        for expr in exprs:
            used = {n for n in metric_names(expr) if n.startswith("stream_ctr_")}
            assert used and used <= may_be_empty, f"panel {title!r}: {expr!r} returned no data"

    for rule in alert_rules(ALERTS):
        prom.query(rule["expr"])          # raises PromQLError if Prometheus rejects it
    marks = json.loads(DASHBOARD.read_text())["annotations"]["list"]
    assert {m["name"] for m in marks} == {"Trainer starts", "Checkpoints"}
    for mark in marks:                    # restart and checkpoint marks: valid PromQL here
        prom.query(mark["expr"].replace("$job", job).replace("$rank", ".*"))
    prom.wait_for("every alert rule evaluated", lambda: all(
        r.get("lastEvaluation", "").startswith("20")
        for g in prom.api("rules")["groups"] for r in g["rules"]), timeout_s=60)
    rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
    assert {r["name"] for r in rules} == {r["alert"] for r in alert_rules(ALERTS)}
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad, f"alert rules failing in Prometheus: {bad}"
    firing = [r["name"] for r in rules if r["state"] == "firing"]
    assert not firing, f"a healthy trainer fires alerts: {firing}"

    for selector in dashboard_variable_selectors(DASHBOARD):
        series = prom.api("series", **{"match[]": grafana_to_promql(selector)})
        assert series and all(s["job"] == job for s in series), selector
    # A trainer alone: no series of its own carries a rank label (a distributed job's do).
    ranked = prom.query('count by (__name__) ({__name__=~"stream_ctr_.+", rank!=""})')
    assert not ranked, [r["metric"] for r in ranked]
    # The per-rank legends' label (`ranked` in build_dashboard.py) is absent too: "trained",
    # not "trained rank ".
    legend = prom.query(grafana_to_promql(next(
        t["expr"] for p in dashboard_panels(DASHBOARD) for t in p["targets"] if "{{ranked}}" in t["legendFormat"])))
    assert legend and all("ranked" not in r["metric"] for r in legend), legend


def test_dashboard_and_alerts_against_real_prometheus_and_trainer(tmp_path, prometheus_server, promtool):
    port = free_port()
    trainer = start_trainer(tmp_path, port)
    try:
        text = wait_for_endpoint(trainer, port)
        assert "\nstream_ctr_records_trained_total " in text      # alone: no rank label
        prom = prometheus_server({"stream_ctr": [f"127.0.0.1:{port}"]}, rule_files=[ALERTS])
        r = subprocess.run([promtool, "check", "config", str(prom.config)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        check_against_prometheus(prom, MAY_BE_EMPTY | FILE_SOURCE_EMPTY)
        assert first_value(prom, 'up{job="stream_ctr"}') == 1
        assert first_value(prom, "sum(stream_ctr_prequential_auc_baseline)") == pytest.approx(0.55)
        assert first_value(prom, "sum(stream_ctr_records_rejected_total)") == 0
    finally:
        code, out, err = stop_trainer(trainer)
    assert code == 0, err[-3000:]
    assert "trained" in out
    series = (tmp_path / "run" / "timeseries.jsonl").read_text().splitlines()
    assert '"kind":"end"' in series[-1]


def test_dashboard_and_alerts_against_real_prometheus_and_kafka_trainer(tmp_path, prometheus_server,
                                                                        kafka):
    """The same with a Kafka source (the test broker): lag per topic partition, broker state."""
    from stream_ctr.connectors.kafka.replay import replay_file
    from tests.kafka_broker import kafka_set_args
    topic = kafka.topic(partitions=2)
    for _ in range(3):              # ~30k records: the trainer is busy while Prometheus scrapes
        replay_file("avazu:sample", kafka.url(topic), packed=20)
    port = free_port()
    source = kafka.url(topic, "metrics") + "&format=avazu"
    trainer = start_trainer(tmp_path, port, source, kafka_set_args())
    try:
        wait_for_endpoint(trainer, port)
        prom = prometheus_server({"stream_ctr": [f"127.0.0.1:{port}"]}, rule_files=[ALERTS])
        check_against_prometheus(prom, MAY_BE_EMPTY)
        lag = prom.query("stream_ctr_consumer_lag_records")
        assert {r["metric"]["partition"] for r in lag} == {f"{topic}/0", f"{topic}/1"}
        assert first_value(prom, "sum(stream_ctr_source_connected)") == 1
        assert first_value(prom, "sum(stream_ctr_records_consumed_total)") > 0
    finally:
        code, out, err = stop_trainer(trainer)
    assert code == 0, err[-3000:]
