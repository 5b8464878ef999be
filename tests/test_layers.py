"""The package's layers, read from the imports of every file (module-level, inside functions and under
``TYPE_CHECKING``; absolute and relative): the library imports nothing of the ``ais-train`` application, neither
imports what only the tools use, nothing imports the tool scripts, and no two files import each other in a
circle, in ``ais_lightning/`` or ``tools/``."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "ais_lightning"

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


def python_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for the package ``root/ais_lightning`` and the scripts ``root/tools/*.py``
    (named ``tools.<script>``: a script imports a sibling by its bare name, through ``sys.path``)."""
    files = {}
    for path in sorted((root / "ais_lightning").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in sorted((root / "tools").glob("*.py")):
        files[f"tools.{path.stem}"] = path
    return files


def imported_names(module: str, path: Path) -> list[tuple[str, ...]]:
    """What the file of ``module`` imports anywhere, relative imports resolved against its package: per imported
    name, the absolute module names it may be, first choice first (``from pkg import name``: ``pkg.name`` if that
    is a module, else ``pkg``)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names: list[tuple[str, ...]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [(alias.name,) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names += [(f"{base}.{alias.name}", base) for alias in node.names]
    return names


def file_graph(root: Path = REPO) -> dict[str, set[str]]:
    """File -> the files it imports (by dotted name): ``from pkg import name`` counts as an import of the file
    ``pkg/name.py`` when there is one, else of ``pkg``'s own file; a script's bare ``import sibling`` as one of
    ``tools/sibling.py``; imports of anything outside ``root`` are left out."""
    files = python_files(root)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        prefixes = ("", "tools.") if module.startswith("tools.") else ("",)
        targets = set()
        for choices in imported_names(module, path):
            found = [prefix + name for name in choices for prefix in prefixes if prefix + name in files]
            if found and found[0] != module:
                targets.add(found[0])
        graph[module] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The import circles of ``graph``: its strongly connected components of two or more files (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def unit(module: str) -> str:
    """``ais_lightning.rollout.base`` -> ``rollout``, ``ais_lightning.app.warmstart.cache`` -> ``app.warmstart``,
    ``tools.bench_rollout`` -> ``tools``: the library package or top-level module, the application / toolkit
    module, or the tool scripts, a file belongs to."""
    parts = module.split(".")
    if parts[0] == "tools":
        return "tools"
    if len(parts) > 2 and parts[1] in LAYERS:
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else ""


def import_graph() -> dict[str, set[str]]:
    """Unit -> the other units its files import."""
    graph: dict[str, set[str]] = defaultdict(set)
    for module, targets in file_graph().items():
        graph[unit(module)] |= {unit(t) for t in targets if unit(t) != unit(module)}
    return graph


def test_every_unit_has_a_layer():
    units = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if not p.name.startswith("__")}
    units = {u for u in units if (PACKAGE / u).is_dir() or (PACKAGE / f"{u}.py").is_file()}
    assert units == LIBRARY | set(LAYERS), "give a new module its layer here (or put it in app/ or toolkit/)"
    assert APPLICATION and TOOLS_ONLY


def test_the_library_imports_nothing_of_the_application_or_the_tools():
    graph = import_graph()
    above = APPLICATION | TOOLS_ONLY | {"tools"}
    wrong = {u: sorted(graph[u] & above) for u in LIBRARY if graph[u] & above}
    assert not wrong, f"library -> application/tools imports: {wrong}"


def test_the_application_imports_nothing_only_the_tools_use():
    graph = import_graph()
    above = TOOLS_ONLY | {"tools"}
    wrong = {u: sorted(graph[u] & above) for u in APPLICATION if graph[u] & above}
    assert not wrong, f"application -> tools-only imports: {wrong}"


def test_the_package_imports_no_tool_script():
    graph = file_graph()
    wrong = {
        m: sorted(t for t in ts if t.startswith("tools.")) for m, ts in graph.items() if m[:6] != "tools."
    }
    assert not {m: ts for m, ts in wrong.items() if ts}


def test_no_import_circle_between_files():
    graph = file_graph()
    assert len(graph) > 150 and sum(map(len, graph.values())) > 400  # the files and their imports were read
    found = circles(graph)
    assert not found, f"files on an import circle: {[sorted(c) for c in found]}"


def test_no_import_circle_between_units():
    found = circles(import_graph())
    assert not found, f"units on an import circle: {found}"


def test_a_circle_between_two_files_is_found(tmp_path: Path):
    """A scratch tree: the detector finds nothing, then the circles added to it, however the imports are written
    (a relative import, one under TYPE_CHECKING or inside a function, a tool's sibling through ``sys.path``)."""

    def write(path: str, text: str) -> None:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)

    write("ais_lightning/__init__.py", "")
    write("ais_lightning/losses/__init__.py", "from ais_lightning.losses.grpo import GRPOLoss\n")
    write("ais_lightning/losses/base.py", "class LossOutput: ...\n")
    write(
        "ais_lightning/losses/grpo.py",
        "from ais_lightning.losses.base import LossOutput\nclass GRPOLoss: ...\n",
    )
    write("ais_lightning/quant/__init__.py", "from .linear import QuantLinear\n")
    write("ais_lightning/quant/linear.py", "class QuantLinear: ...\n")
    write("ais_lightning/quant/experts.py", "from .linear import QuantLinear\n")
    write("tools/bench.py", "import sys\nimport profile_tool\n")
    write("tools/profile_tool.py", "import torch\n")
    graph = file_graph(tmp_path)
    assert graph["ais_lightning.losses.grpo"] == {"ais_lightning.losses.base"}
    assert graph["ais_lightning.quant.experts"] == {"ais_lightning.quant.linear"}
    assert graph["tools.bench"] == {"tools.profile_tool"}
    assert circles(graph) == []

    write(
        "ais_lightning/losses/base.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ais_lightning.losses.grpo import GRPOLoss\n",
    )
    write("ais_lightning/quant/linear.py", "def quantize_model():\n    from .experts import QuantExperts\n")
    write("tools/profile_tool.py", "import bench\n")
    found = sorted(sorted(c) for c in circles(file_graph(tmp_path)))
    assert found == [
        ["ais_lightning.losses.base", "ais_lightning.losses.grpo"],
        ["ais_lightning.quant.experts", "ais_lightning.quant.linear"],
        ["tools.bench", "tools.profile_tool"],
    ]
