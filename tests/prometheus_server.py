"""Pytest plugin: a real Prometheus server on a loopback port, started per test.

Uses the Debian package ``prometheus`` (``/usr/bin/prometheus`` and
``promtool``; .ci/run installs it). Never the system service: each server is
our own process with a generated config, ``--web.listen-address=127.0.0.1:PORT``
and a temporary TSDB, stopped at the end of the test. A missing binary fails
the test with the command that installs it; it is never skipped.

Fixtures:
- ``prometheus_server``: a factory ``start(targets, rule_files=(), scrape_interval_s=1)``
  -> `PrometheusServer` (``targets`` maps job name -> ["127.0.0.1:PORT", ...]);
- ``promtool``: the path of promtool.
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

INSTALL_HINT = "apt-get update && apt-get install -y prometheus  (Debian package; provides promtool too)"


def find_binary(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if path is None:
        pytest.fail(f"{name} not found; install it with: {INSTALL_HINT}")
    return path


def free_port() -> int:
    """A port free on 127.0.0.1 right now (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> bytes:
    assert url.startswith("http://127.0.0.1:"), f"tests only talk to loopback, not {url}"
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


class PromQLError(AssertionError):
    """Prometheus refused a query (status error); the message has its errorType and error."""


def _yaml_list(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


class PrometheusServer:
    def __init__(self, binary: str, workdir: Path, targets: dict[str, list[str]],
                 rule_files: list[str | Path], scrape_interval_s: float) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = workdir / "prometheus.yml"
        self.config.write_text(self.render_config(targets, rule_files, scrape_interval_s))
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={self.config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready()

    @staticmethod
    def render_config(targets: dict[str, list[str]], rule_files: list[str | Path],
                      scrape_interval_s: float) -> str:
        every = f"{int(round(scrape_interval_s * 1000))}ms"
        lines = ["global:", f"  scrape_interval: {every}", f"  evaluation_interval: {every}",
                 f"  scrape_timeout: {every}"]
        if rule_files:
            lines.append(f"rule_files: {_yaml_list([str(p) for p in rule_files])}")
        lines.append("scrape_configs:")
        for job, addrs in targets.items():
            lines += [f"  - job_name: {job}", f"    static_configs: [{{targets: {_yaml_list(addrs)}}}]"]
        return "\n".join(lines) + "\n"

    def _wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.log()}")
            try:
                http_get(self.url + "/-/ready", timeout=1)
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.1)
        raise TimeoutError(f"prometheus not ready after {timeout_s}s: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; returns ``data``; raises PromQLError on status error."""
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            body = json.loads(http_get(url))
        except urllib.error.HTTPError as e:      # 400/422 carry the error JSON
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise PromQLError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query; the result vector (a scalar becomes one pseudo-sample)."""
        data = self.api("query", query=expr)
        return data["result"] if data["resultType"] in ("vector", "matrix") else [{"value": data["result"]}]

    def wait_for(self, what: str, check: Callable[[], bool], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus: {what} not reached in {timeout_s}s; log: {self.log()}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._log.close()


@pytest.fixture
def promtool() -> str:
    return find_binary("promtool")


@pytest.fixture
def prometheus_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., PrometheusServer]]:
    binary = find_binary("prometheus")
    started: list[PrometheusServer] = []

    def start(targets: dict[str, list[str]], rule_files: list[str | Path] = (),  # type: ignore[assignment]
              scrape_interval_s: float = 1.0) -> PrometheusServer:
        server = PrometheusServer(binary, tmp_path_factory.mktemp("prometheus"), targets,
                                  list(rule_files), scrape_interval_s)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


# -- expressions of the shipped dashboard and alert rules ---------------------------------

GRAFANA_VARS = {"$__rate_interval": "30s", "${job}": ".*", "$job": ".*", "${rank}": ".*", "$rank": ".*"}
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
             "bool", "offset", "inf", "nan", "Inf", "NaN"}


def grafana_to_promql(expr: str) -> str:
    """Replace the dashboard's Grafana variables with what "All" and a short range mean."""
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    return expr


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (not functions, labels or keywords)."""
    import re
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)     # string literals
    s = re.sub(r"\{[^}]*\}", " ", s)                                       # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)                                      # ranges, subqueries
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w.:])([a-zA-Z_:][\w:]*)(\s*\()?", s):
        if m.group(2) is None and m.group(1) not in _KEYWORDS:
            names.add(m.group(1))
    return names


def dashboard_panels(path: str | Path) -> list[dict]:
    """Panels with targets (rows skipped) of a Grafana dashboard JSON, nested rows included."""
    dash = json.loads(Path(path).read_text())
    out = []
    for p in dash["panels"]:
        out += p.get("panels", []) if p.get("type") == "row" else [p]
    return [p for p in out if p.get("targets")]


def dashboard_variable_selectors(path: str | Path) -> list[str]:
    """The series selectors inside the dashboard's label_values(...) variable queries."""
    import re
    out = []
    for v in json.loads(Path(path).read_text())["templating"]["list"]:
        q = v.get("query")
        q = q.get("query", "") if isinstance(q, dict) else (q or "")
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", q.strip())
        if m:
            out.append(m.group(1))
    return out


def alert_rules(path: str | Path) -> list[dict]:
    import yaml
    return [r for g in yaml.safe_load(Path(path).read_text())["groups"] for r in g["rules"]]
