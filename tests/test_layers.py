"""The package's layers, read from its imports (module-level and inside functions): the library imports nothing
of the ``ais-train`` application, neither imports what only the tools use, and no two modules import each other
in a circle."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ais_lightning"

LIBRARY = {
    "correctors", "losses", "diagnostics", "quant", "rollout", "policy", "models", "tasks", "modules",
    "staleness", "ops", "checks", "files",
}  # fmt: skip
"""What users lift into their own Lightning projects (``files``: verified files, used by the GGUF cache too)."""
LAYERS = {"app": "application", "toolkit": "tools-only"}
"""The two packages beside the library: ``ais_lightning.app`` (``ais-train``: config composition, building, the
Trainer, tracking, resume, warm start, summary) and ``ais_lightning.toolkit`` (what only ``tools/`` uses)."""
APPLICATION = {
    f"app.{p.stem if p.is_file() else p.name}"
    for p in (PACKAGE / "app").iterdir()
    if p.name != "__init__.py" and (p.suffix == ".py" or p.is_dir()) and p.name != "__pycache__"
}
"""The application's modules (``app.build``, ``app.warmstart``, ...)."""
TOOLS_ONLY = {
    f"toolkit.{p.stem if p.is_file() else p.name}"
    for p in (PACKAGE / "toolkit").iterdir()
    if p.name != "__init__.py" and (p.suffix == ".py" or p.is_dir()) and p.name != "__pycache__"
}
"""What only ``tools/`` (and tests) use."""


def unit(module: str) -> str:
    """``ais_lightning.rollout.base`` -> ``rollout``, ``ais_lightning.app.warmstart.cache`` -> ``app.warmstart``:
    the library package or top-level module, or the application / toolkit module, a module belongs to."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] in LAYERS:
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else ""


def import_graph() -> dict[str, set[str]]:
    """Unit -> the units it imports (anywhere in its files)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        here = unit(".".join(rel.parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                if name.startswith("ais_lightning.") and unit(name) != here:
                    graph[here].add(unit(name))
    return graph


def test_every_unit_has_a_layer():
    units = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if not p.name.startswith("__")}
    units = {u for u in units if (PACKAGE / u).is_dir() or (PACKAGE / f"{u}.py").is_file()}
    assert units == LIBRARY | set(LAYERS), "give a new module its layer here (or put it in app/ or toolkit/)"
    assert APPLICATION and TOOLS_ONLY


def test_the_library_imports_nothing_of_the_application_or_the_tools():
    graph = import_graph()
    wrong = {
        u: sorted(graph[u] & (APPLICATION | TOOLS_ONLY))
        for u in LIBRARY
        if graph[u] & (APPLICATION | TOOLS_ONLY)
    }
    assert not wrong, f"library -> application/tools imports: {wrong}"


def test_the_application_imports_nothing_only_the_tools_use():
    graph = import_graph()
    wrong = {u: sorted(graph[u] & TOOLS_ONLY) for u in APPLICATION if graph[u] & TOOLS_ONLY}
    assert not wrong, f"application -> tools-only imports: {wrong}"


def test_no_import_circle():
    graph = import_graph()

    def reachable(start: str) -> set[str]:
        seen, stack = set(), [start]
        while stack:
            for nxt in graph.get(stack.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    circles = sorted(u for u in graph if u in reachable(u))
    assert not circles, f"units on an import circle: {circles}"
