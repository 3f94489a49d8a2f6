"""Files shipped inside the package: the bundled samples, monitoring files, example config.

They are read through `importlib.resources`, so they are found the same way in
a source checkout, an editable install and a wheel (where `monitoring/` lives
at `stream_ctr/monitoring/`).
"""
from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

EXAMPLE_CONFIG = "example.toml"
# The runbook page the shipped alert rules link to (runbook_url = this + "#<alert name>");
# `.invalid` never resolves: `export_monitoring` writes the page's real URL in its place.
RUNBOOK_PLACEHOLDER = "https://stream-ctr.invalid/monitoring/RUNBOOK.md"
RUNBOOK_LINKING = ("alerts.yml", "alerts_test.yml")     # the files holding runbook_url values


def monitoring_files() -> list[str]:
    """Relative paths of the Prometheus and Grafana files (no Python), sorted."""
    root = resources.files("stream_ctr.monitoring")
    found: list[str] = []

    def walk(node, prefix: str) -> None:
        for child in node.iterdir():
            rel = f"{prefix}{child.name}"
            if child.is_dir():
                if child.name != "__pycache__":
                    walk(child, rel + "/")
            elif child.name.endswith((".yml", ".yaml", ".json", ".md")):
                found.append(rel)
    walk(root, "")
    return sorted(found)


def runbook_url_ok(url: str) -> str | None:
    """Why `url` cannot be the runbook page's URL in the alert rules, or None."""
    from urllib.parse import urlsplit
    try:
        parts = urlsplit(url)
    except ValueError as e:             # an unclosed [ of an IPv6 host
        return f"not a URL ({e})"
    if not parts.scheme or not (parts.netloc or parts.scheme == "file"):
        return "an absolute URL is needed (https://HOST/PATH, or file:///PATH)"
    if "#" in url:
        return "the page, without a #fragment (each alert adds #<its name>)"
    if any(c in url for c in "\"'\\ \t\n{}"):
        return "quotes, backslashes, braces and whitespace are not allowed (percent-encode them)"
    return None


def export_monitoring(target: str | Path, overwrite: bool = False,
                      runbook_url: str | None = None) -> list[Path]:
    """Copy every monitoring file into `target` (keeping the grafana/ tree); returns the paths.

    The alert rules' runbook links (`RUNBOOK_PLACEHOLDER#<alert>`) point at
    `runbook_url` (the page where the runbook is served), by default the file://
    URL of the RUNBOOK.md written here. Refuses (FileExistsError naming the first
    one) to replace an existing file unless `overwrite`: a user's edited dashboard
    or alert rules are not lost; ValueError for a `runbook_url` that cannot be one."""
    target = Path(target)
    if runbook_url is None:
        runbook_url = (target / "RUNBOOK.md").resolve().as_uri()
    why = runbook_url_ok(runbook_url)
    if why is not None:
        raise ValueError(f"runbook URL {runbook_url!r}: {why}")
    root = resources.files("stream_ctr.monitoring")
    names = monitoring_files()
    if not overwrite:
        for rel in names:
            if (target / rel).exists():
                raise FileExistsError(f"{target / rel} exists; pass --force to overwrite it")
    written = []
    for rel in names:
        out = target / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        source = root.joinpath(*rel.split("/"))
        if rel in RUNBOOK_LINKING:
            text = source.read_text(encoding="utf-8")
            out.write_text(text.replace(RUNBOOK_PLACEHOLDER + "#", runbook_url + "#"), encoding="utf-8")
        else:
            with resources.as_file(source) as src:
                shutil.copyfile(src, out)
        written.append(out)
    return written


def example_config_text() -> str:
    """The commented example TOML config (every section, the defaults that matter)."""
    return resources.files("stream_ctr").joinpath("configs", EXAMPLE_CONFIG).read_text()
