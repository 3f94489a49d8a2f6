"""`stream-ctr train` as a subprocess on a small model: what tests of run directories and
checkpoints start (a real process, so locks, signals and exit statuses are real)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CLI = [sys.executable, "-m", "stream_ctr"]
SMALL = ["--batch-size", "64", "--threads", "1", "--quiet", "--json", "--set", "model.mlp_dims=16"]
EXIT_STATE = 4          # stream_ctr.cli.main.EXIT_STATE: checkpoints, the run directory


def cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`stream-ctr train SMALL ARGS` in `cwd`, waited for (at most 300 s)."""
    return subprocess.run(CLI + ["train", *SMALL, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)
