"""The shipped monitoring/ files: valid for promtool, only names metrics.py exports,
a dashboard generated from its code, alert rules that fire on synthetic series."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from stream_ctr.telemetry.catalogue import CATALOGUE, exported_names
from tests.prometheus_server import (alert_rules, dashboard_panels, dashboard_variable_selectors,
                                     metric_names)

ROOT = Path(__file__).resolve().parents[2]
MON = ROOT / "monitoring"
DASHBOARD = MON / "grafana" / "dashboards" / "stream_ctr.json"
ALERTS = MON / "alerts.yml"
BUILTIN = {"up"}                     # series Prometheus itself makes
# Timestamps whose age is on the dashboard; the raw timestamp is for joins and alerts.
NOT_ON_DASHBOARD = {"stream_ctr_last_checkpoint_timestamp_seconds", "stream_ctr_last_merge_timestamp_seconds"}
REQUIRED_ALERTS = {"StreamCtrTrainerDown", "StreamCtrNoProgress", "StreamCtrLagGrowing",
                   "StreamCtrAucBelowBaseline", "StreamCtrNonFiniteBatches",
                   "StreamCtrCheckpointTooOld", "StreamCtrDiskTierNearBudget"}


def dashboard_exprs() -> list[str]:
    """Every panel's queries and the annotation (restart / checkpoint mark) queries."""
    marks = json.loads(DASHBOARD.read_text())["annotations"]["list"]
    return [t["expr"] for p in dashboard_panels(DASHBOARD) for t in p["targets"]] + [m["expr"] for m in marks]


def test_dashboard_json_is_what_the_generator_writes():
    r = subprocess.run([sys.executable, str(MON / "build_dashboard.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dashboard_and_alerts_use_only_exported_metric_names():
    known = exported_names() | BUILTIN
    exprs = dashboard_exprs() + dashboard_variable_selectors(DASHBOARD) + [r["expr"] for r in alert_rules(ALERTS)]
    used = set().union(*(metric_names(e) for e in exprs))
    assert used, "no metric names parsed"
    assert used <= known, f"not exported by stream_ctr/telemetry/catalogue.py: {sorted(used - known)}"


def test_metric_name_parser():
    expr = ('sum by (tier) (rate(stream_ctr_embedding_hits_total{job=~"$job", tier="x y"}[5m])) / '
            'on (tier) group_left max without (rank) (up) > bool 1e5 and time() - foo:bar offset 5m')
    assert metric_names(expr) == {"stream_ctr_embedding_hits_total", "up", "foo:bar"}


def test_every_metric_is_on_the_dashboard():
    used = set().union(*(metric_names(e) for e in dashboard_exprs()))
    missing = {s.name for s in CATALOGUE
               if not set(s.series_names) & used and s.name not in NOT_ON_DASHBOARD}
    assert not missing, f"metrics without a panel: {sorted(missing)}"


def test_dashboard_structure():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    names = [v["name"] for v in dash["templating"]["list"]]
    assert {"datasource", "job", "rank"} <= set(names)
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    for want in ("Throughput", "Quality", "Freshness", "Embedding tiers", "checkpoints", "Errors"):
        assert any(want.lower() in r.lower() for r in rows), (want, rows)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "xywh") and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
    for p in dashboard_panels(DASHBOARD):
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(refs), p["title"]
        assert p["datasource"]["uid"] == "${datasource}"
        assert all(t["expr"].strip() for t in p["targets"])


def test_dashboard_legends_name_the_rank_only_in_a_distributed_job(tmp_path, promtool):
    """A trainer alone exports no rank label, a distributed job's ranks rank="r": the
    per-rank expressions (and the restart marks) select both, and their legend label
    `ranked` reads " rank r" for a rank and is absent for a trainer alone."""
    exprs = [t["expr"] for p in dashboard_panels(DASHBOARD) for t in p["targets"]
             if t["legendFormat"] == "trained{{ranked}}"]
    mark = next(m for m in json.loads(DASHBOARD.read_text())["annotations"]["list"]
                if m["name"] == "Checkpoints")
    assert len(exprs) == 1 and mark["textFormat"] == "{{instance}}{{ranked}}"
    test = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [
            {"series": 'stream_ctr_records_trained_total{job="j", instance="alone:9420"}', "values": "0+60x10"},
            {"series": 'stream_ctr_records_trained_total{job="j", instance="n:9421", rank="1"}', "values": "0+120x10"},
            {"series": 'stream_ctr_checkpoints_total{job="j", instance="alone:9420"}', "values": "0 0 0 0 1 1 1"},
            {"series": 'stream_ctr_checkpoints_total{job="j", instance="n:9421", rank="1"}', "values": "0 0 0 0 1 1 1"}],
        "promql_expr_test": [
            {"expr": exprs[0].replace("$__rate_interval", "5m").replace("$job", ".*").replace("$rank", ".*"),
             "eval_time": "8m",
             "exp_samples": [{"labels": "{}", "value": 1.0},
                             {"labels": '{rank="1", ranked=" rank 1"}', "value": 2.0}]},
            {"expr": mark["expr"].replace("$job", ".*").replace("$rank", ".*"), "eval_time": "4m",
             "exp_samples": [{"labels": '{job="j", instance="alone:9420"}', "value": 1.0},
                             {"labels": '{job="j", instance="n:9421", rank="1", ranked=" rank 1"}',
                              "value": 1.0}]}]}]}
    (tmp_path / "legends_test.yml").write_text(yaml.safe_dump(test))
    r = subprocess.run([promtool, "test", "rules", "legends_test.yml"], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_alert_rules_cover_the_required_cases():
    rules = alert_rules(ALERTS)
    assert REQUIRED_ALERTS <= {r["alert"] for r in rules}
    for r in rules:
        assert r["labels"]["severity"] in ("critical", "warning"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]


def test_promtool_checks_configs_and_rules(promtool):
    for cfg in ("prometheus.yml", "prometheus-ranks.yml"):
        r = subprocess.run([promtool, "check", "config", str(MON / cfg)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_alert_rules_fire_on_synthetic_series(promtool):
    """monitoring/alerts_test.yml: each alert fires (and stays quiet) when it should."""
    r = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], cwd=MON,
                       capture_output=True, text=True)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    tested = set(__import__("re").findall(r"alertname: (\w+)", (MON / "alerts_test.yml").read_text()))
    assert {r["alert"] for r in alert_rules(ALERTS)} <= tested


def test_grafana_provisioning_files():
    prov = MON / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "stream_ctr.yml").read_text())
    assert ds["apiVersion"] == 1 and ds["datasources"][0]["type"] == "prometheus"
    dashboards = yaml.safe_load((prov / "dashboards" / "stream_ctr.yml").read_text())
    provider = dashboards["providers"][0]
    assert dashboards["apiVersion"] == 1 and provider["type"] == "file" and provider["options"]["path"]


def test_shipped_scrape_config_targets_the_job_the_alerts_use():
    cfg = yaml.safe_load((MON / "prometheus.yml").read_text())
    assert [j["job_name"] for j in cfg["scrape_configs"]] == ["stream_ctr"]
    assert cfg["rule_files"] == ["alerts.yml"]
    assert 'job="stream_ctr"' in ALERTS.read_text()


def test_every_alert_links_its_runbook_section():
    """An absolute URL on the one documented placeholder (`monitoring export --runbook-url`
    replaces it), the anchor of the alert's own section of RUNBOOK.md."""
    import yaml
    from stream_ctr.resources import RUNBOOK_LINKING, RUNBOOK_PLACEHOLDER
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    runbook = (MON / "RUNBOOK.md").read_text()
    sections = {line[3:].strip().lower() for line in runbook.splitlines() if line.startswith("## ")}
    for rule in rules:
        url = rule["annotations"]["runbook_url"]
        assert url == f"{RUNBOOK_PLACEHOLDER}#{rule['alert'].lower()}", rule["alert"]
        assert rule["alert"].lower() in sections, rule["alert"]
    # Every file that links the runbook is one the export rewrites.
    linking = {p.name for p in MON.rglob("*") if p.is_file() and "RUNBOOK.md#" in p.read_text(errors="replace")}
    assert linking == set(RUNBOOK_LINKING)


def test_compose_file_wires_the_shipped_files():
    """monitoring/compose.yaml (no Docker here): every bind mount is a shipped file, the
    Prometheus it starts reads the config promtool checks (and its rule files), Grafana's
    data source points at that Prometheus, and its dashboard provider reads the mount."""
    compose = yaml.safe_load((MON / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"prometheus", "grafana"}

    def mounts(svc: dict) -> dict[str, str]:
        out = {}
        for vol in svc["volumes"]:
            src, dst = vol.split(":")[:2]
            assert (MON / src[2:]).exists() if src.startswith("./") else src in compose["volumes"], vol
            out[dst] = src
        return out

    for svc in services.values():
        assert svc["network_mode"] == "host"        # 127.0.0.1 is the host: the trainer's port
    prom = services["prometheus"]
    args = dict(a.split("=", 1) for a in prom["command"])
    prom_mounts = mounts(prom)
    config = args["--config.file"]
    assert prom_mounts[config] == "./prometheus.yml"
    for rule_file in yaml.safe_load((MON / "prometheus.yml").read_text())["rule_files"]:
        assert str(Path(config).parent / rule_file) in prom_mounts, rule_file
    assert args["--web.listen-address"].startswith("127.0.0.1:")
    datasource = yaml.safe_load((MON / "grafana/provisioning/datasources/stream_ctr.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://" + args["--web.listen-address"]
    grafana_mounts = mounts(services["grafana"])
    provider = yaml.safe_load((MON / "grafana/provisioning/dashboards/stream_ctr.yml").read_text())
    assert grafana_mounts[provider["providers"][0]["options"]["path"]] == "./grafana/dashboards"
    assert grafana_mounts["/etc/grafana/provisioning/datasources"] == "./grafana/provisioning/datasources"
