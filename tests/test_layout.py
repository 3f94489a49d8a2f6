"""The package's layout: imports flow one way, no cycles, and the wheel's names.

The checker reads the source with `ast` (tests/import_graph.py); the fixture
packages below show that it catches what it is meant to catch.
"""
from __future__ import annotations

import textwrap

from tests.import_graph import (LAYERS, cycles, folder_graph, import_graph, layer_violations, unplaced)


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_folders_import_each_other_without_cycles():
    """Modules may be acyclic while their folders are not (train.a -> serving.b ->
    train.c): the folders are what a reader navigates, so they are checked too."""
    assert cycles(folder_graph(import_graph())) == []


def test_serving_imports_neither_train_nor_distributed():
    """A predict server loads a bundle: it must not pull in the trainer or torch.distributed."""
    folders = folder_graph(import_graph())
    assert folders["stream_ctr.serving"] & {"stream_ctr.train", "stream_ctr.distributed"} == set()


def test_imports_flow_down_the_layers():
    assert layer_violations(import_graph()) == []


def test_every_module_has_a_layer():
    assert unplaced(import_graph()) == []


def test_every_subpackage_says_what_lives_there_and_what_it_may_import():
    graph = import_graph()
    packages = {m for m in graph if (m.count(".") <= 2 and m != "stream_ctr")}
    from tests.import_graph import module_names, PACKAGE_DIRS
    files = module_names(PACKAGE_DIRS)
    for name in packages:
        path = files[name]
        if path.name != "__init__.py":
            continue
        doc = path.read_text()
        assert doc.startswith('"""') and "import" in doc.split('"""')[1].lower(), \
            f"{path}: its docstring must say what lives there and what it may import"


def _write(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_checker_finds_a_cycle_in_a_cyclic_fixture_package(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import g\ndef f(): return g()\n",
        "pkg/b.py": "def g():\n    from pkg import c   # a lazy import closes the circle\n    return c.h()\n",
        "pkg/c.py": "import pkg.a\ndef h(): return 1\n",
        "pkg/d.py": "from . import a   # relative imports are resolved too\n",
    })
    graph = import_graph({"pkg": "pkg"}, tmp_path)
    assert graph["pkg.d"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_checker_finds_a_type_checking_cycle(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import B\n",
        "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\nclass B: ...\n",
    })
    assert cycles(import_graph({"pkg": "pkg"}, tmp_path)) == [["pkg.a", "pkg.b"]]


def test_checker_finds_upward_and_sibling_imports(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/top/__init__.py": "",
        "pkg/top/run.py": "from pkg.low.x import y\n",          # down: fine
        "pkg/low/__init__.py": "",
        "pkg/low/x.py": "def y():\n    from pkg.top import run\n",   # up: a violation
        "pkg/low/z.py": "from pkg.side import w\n",              # sibling: a violation
        "pkg/side.py": "w = 1\n",
    })
    layers = (("pkg.top",), ("pkg.low", "pkg.side"))
    graph = import_graph({"pkg": "pkg"}, tmp_path)
    assert layer_violations(graph, layers) == [
        "pkg.low.x -> pkg.top.run (higher layer)",
        "pkg.low.z -> pkg.side (sibling of the same layer)"]
    assert unplaced(graph, layers) == []          # the root package needs no layer


def test_layers_name_the_installed_packages():
    names = {p for layer in LAYERS for p in layer}
    assert {"stream_ctr.connectors", "stream_ctr.ops", "stream_ctr.cli", "stream_ctr.bench"} <= names


def test_folder_check_finds_a_cycle_between_folders_of_acyclic_modules(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/train/__init__.py": "",
        "pkg/train/loop.py": "from pkg.serving import export\n",
        "pkg/train/heap.py": "",
        "pkg/serving/__init__.py": "",
        "pkg/serving/export.py": "",
        "pkg/serving/commands.py": "from pkg.train import heap\n",
    })
    graph = import_graph({"pkg": "pkg"}, tmp_path)
    assert cycles(graph) == []
    assert cycles(folder_graph(graph)) == [["pkg.serving", "pkg.train"]]
