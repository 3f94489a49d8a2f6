"""`stream-ctr --help`, `--version` and argument errors answer without loading torch.

Each check runs in a fresh interpreter and reads its `sys.modules`: the parser
of every command is built from plain values, and the heavy modules (torch,
numba's decoders, matplotlib, triton) load only in the command that uses them.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "numba", "matplotlib", "triton")


def heavy_modules_after(code: str) -> list[str]:
    """Run `code` in a fresh interpreter; the HEAVY modules it left imported."""
    probe = (f"import sys\n{code}\n"
             f"print('MODULES', __import__('json').dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("MODULES ")][-1]
    return json.loads(line.split(" ", 1)[1])


def test_building_the_parser_imports_no_torch():
    loaded = heavy_modules_after("import stream_ctr.cli.main\n"
                                 "sys.modules['stream_ctr.cli.main'].build_parser()")
    assert loaded == [], f"building the parser imported {loaded}"


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["train", "--bogus"], ["train", "--help"],
                                  ["serve", "--help"], ["chaos", "--help"], ["broker", "--help"],
                                  ["bench", "scaling", "--help"]])
def test_help_version_and_argument_errors_import_no_torch(argv):
    loaded = heavy_modules_after("from stream_ctr.cli.main import main\n"
                                 "import contextlib, io\n"
                                 "with contextlib.redirect_stdout(io.StringIO()), "
                                 "contextlib.redirect_stderr(io.StringIO()):\n"
                                 "    try:\n"
                                 f"        main({argv!r})\n"
                                 "    except SystemExit:\n"
                                 "        pass")
    assert loaded == [], f"stream-ctr {' '.join(argv)} imported {loaded}"


def test_a_command_that_needs_no_model_imports_no_torch(tmp_path):
    loaded = heavy_modules_after("from stream_ctr.cli.main import main\n"
                                 "import contextlib, io\n"
                                 "with contextlib.redirect_stdout(io.StringIO()):\n"
                                 f"    assert main(['config', 'example', '-o', {str(tmp_path / 'c.toml')!r}]) == 0")
    assert "torch" not in loaded
