"""The documentation works: the Python API page runs as written, every relative
link of README.md and docs/*.md names a file of the repository, and the README's
test command is the one CI runs."""
from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


def relative_links(page: Path) -> list[str]:
    """Targets of the page's Markdown links and images that are not URLs or in-page anchors."""
    text = CODE_SPAN.sub("", FENCE.sub("", page.read_text()))
    targets = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I) or target.startswith("#"):
            continue                    # http://, https://, mailto: ...; a heading of this page
        targets.append(target)
    return targets


def test_python_api_page_runs_as_written(tmp_path, monkeypatch, capsys):
    """The blocks of docs/python-api.md in order, in one namespace, as a notebook runs them
    (3,000 rows of the bundled Criteo sample); whatever they write goes under tmp_path."""
    blocks = python_blocks(ROOT / "docs" / "python-api.md")
    assert len(blocks) >= 5
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    namespace: dict = {"__name__": "__docs__"}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"docs/python-api.md block {i + 1}", "exec"), namespace)
        except Exception as e:          # noqa: BLE001 - name the block that failed
            pytest.fail(f"docs/python-api.md block {i + 1} raised {type(e).__name__}: {e}\n{block}")
    out = capsys.readouterr().out
    assert "refused: " in out and "test AUC" in out and "held-out records, AUC" in out
    assert not (tmp_path / "runs").exists()         # the page's runs write into its own tmp dirs


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    missing = []
    for target in relative_links(page):
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(ROOT) or not path.exists():
            missing.append(target)
    assert missing == [], f"{page.relative_to(ROOT)} links to files that are not in the repository"


def test_link_checker_sees_links(tmp_path):
    """The checker finds the links it must check, and leaves code and URLs alone."""
    assert any(t.startswith("docs/") for t in relative_links(ROOT / "README.md"))
    sample = tmp_path / "x.md"
    sample.write_text("[a](docs/a.md) ![b](img.png#x) [c](https://x.y) [d](#here)\n"
                      "`[e](f.md)`\n```\n[g](h.md)\n```\n")
    assert relative_links(sample) == ["docs/a.md", "img.png#x"]


def test_readme_test_command_is_the_one_ci_runs():
    """The README's quick start shows the exact command `.ci/run` runs."""
    readme = (ROOT / "README.md").read_text().splitlines()
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if "python -m pytest" in line]
    assert len(ci) == 1 and ci[0] in readme
