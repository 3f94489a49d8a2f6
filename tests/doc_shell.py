"""Running a documentation page's commands as a user would: the shell commands of one
of its sections, and an environment whose `stream-ctr` is this interpreter's package."""
from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def section_commands(page: Path, title: str) -> list[str]:
    """The shell commands of `page`'s section `## title` (```bash blocks), continuation
    lines joined; a page without that section fails the test that asked for it."""
    text = page.read_text()
    assert f"\n## {title}\n" in text, f"{page} has no section '## {title}'"
    section = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        commands += [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]
    return commands


def stream_ctr_on_path(bin_dir: Path) -> dict:
    """An environment whose PATH starts with `bin_dir/stream-ctr`, a shim that runs this
    interpreter's package (so the commands run as written, from any directory)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    shim = bin_dir / "stream-ctr"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m stream_ctr "$@"\n')
    shim.chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False
