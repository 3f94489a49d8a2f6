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


def export_monitoring(target: str | Path, overwrite: bool = False) -> list[Path]:
    """Copy every monitoring file into `target` (keeping the grafana/ tree); returns the paths.

    Refuses (FileExistsError naming the first one) to replace an existing file
    unless `overwrite`: a user's edited dashboard or alert rules are not lost."""
    target = Path(target)
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
        with resources.as_file(root.joinpath(*rel.split("/"))) as src:
            shutil.copyfile(src, out)
        written.append(out)
    return written


def example_config_text() -> str:
    """The commented example TOML config (every section, the defaults that matter)."""
    return resources.files("stream_ctr").joinpath("configs", EXAMPLE_CONFIG).read_text()
