"""The package's import graph, read from the source with `ast` (nothing is imported).

Every import counts: top-level, inside functions (lazy imports), and under
``if TYPE_CHECKING:``, since each is a dependency a reader must follow.
Modules are named as installed: ``connectors/`` is ``stream_ctr.connectors``,
``ops/`` is ``stream_ctr.ops``, ``monitoring/`` is ``stream_ctr.monitoring``.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# folder on disk -> package name once installed (pyproject's package mapping)
PACKAGE_DIRS = {"stream_ctr": "stream_ctr", "connectors": "stream_ctr.connectors",
                "ops": "stream_ctr.ops", "monitoring": "stream_ctr.monitoring"}

# Highest first. A module may import its own top package, or a package of a
# LOWER layer; never a higher layer, never a sibling of its own layer.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("stream_ctr.__main__",),
    ("stream_ctr.cli",),
    ("stream_ctr.bench", "stream_ctr.monitoring", "stream_ctr.chaos"),
    ("stream_ctr.distributed",),
    ("stream_ctr.train",),
    ("stream_ctr.serving",),       # bundles and scoring: below train, so a trainer can publish
    ("stream_ctr.store", "stream_ctr.telemetry", "stream_ctr.models"),
    ("stream_ctr.config", "stream_ctr.resources"),
    ("stream_ctr.connectors", "stream_ctr.ops", "stream_ctr.version"),
    ("stream_ctr.threads",),       # the cores a process may use: the trainer's and the decoder's
)


def module_names(dirs: dict[str, str], root: Path = ROOT) -> dict[str, Path]:
    """{dotted module name: file} for every .py file under the mapped folders."""
    out = {}
    for folder, package in dirs.items():
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root / folder).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join((package, *rel))] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The known modules that module `name` (file `path`) imports, wherever in the file."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                parent = parts if is_package else parts[:-1]
                parent = parent[:len(parent) - (node.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        for t in targets:
            # the longest known prefix: `from pkg import mod` names the module, else the package
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def import_graph(dirs: dict[str, str] = PACKAGE_DIRS, root: Path = ROOT) -> dict[str, set[str]]:
    files = module_names(dirs, root)
    known = set(files)
    return {name: imports_of(name, path, known) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer_of(module: str, layers=LAYERS) -> tuple[int, str] | None:
    """(layer index, the layer's package) of the longest matching package, or None."""
    best = None
    for i, layer in enumerate(layers):
        for package in layer:
            if module == package or module.startswith(package + "."):
                if best is None or len(package) > len(best[1]):
                    best = (i, package)
    return best


def layer_violations(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """`a -> b` for every import of a higher layer or of a sibling package of the same layer."""
    bad = []
    for a, targets in sorted(graph.items()):
        la = layer_of(a, layers)
        for b in sorted(targets):
            lb = layer_of(b, layers)
            if la is None or lb is None or la[1] == lb[1] or b == "stream_ctr":
                continue
            if lb[0] <= la[0]:
                kind = "higher layer" if lb[0] < la[0] else "sibling of the same layer"
                bad.append(f"{a} -> {b} ({kind})")
    return bad


def unplaced(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Modules no layer names (every module must have a place)."""
    roots = {p.split(".")[0] for layer in layers for p in layer}
    return sorted(m for m in graph if m not in roots and layer_of(m, layers) is None)


def folder_of(module: str) -> str:
    """The folder a module lives in, as a package name: `stream_ctr.train.loop` ->
    `stream_ctr.train`; a top-level module (`stream_ctr.config`) is its own."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else module


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between folders: an arrow where any module of one imports any
    module of the other (imports inside a folder are left out)."""
    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        fa = folder_of(a)
        out.setdefault(fa, set()).update(fb for fb in map(folder_of, targets) if fb != fa)
    return out
