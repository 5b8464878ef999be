"""One job per piece: no function of ``ais_lightning/`` is longer than 80 lines (docstring included) unless a comment
in it says why it must be one piece (a comment line starting ``# One piece``)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ais_lightning"
LIMIT = 80
"""Lines of a function, from its ``def`` to its last line."""


def long_functions(root: Path, limit: int = LIMIT) -> dict[str, int]:
    """``file::Class.function`` -> lines, for every function of the ``.py`` files under ``root`` longer than
    ``limit`` lines without a ``# One piece`` comment line inside it."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        stack: list[tuple[ast.AST, str]] = [(ast.parse("\n".join(lines)), "")]
        while stack:
            node, prefix = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    stack.append((child, f"{prefix}{child.name}."))
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    body = lines[child.lineno - 1 : child.end_lineno]
                    explained = any(line.strip().startswith("# One piece") for line in body)
                    if len(body) > limit and not explained:
                        found[f"{path.relative_to(root).as_posix()}::{prefix}{child.name}"] = len(body)
    return found


def test_no_long_function_without_a_reason():
    found = long_functions(PACKAGE)
    assert not found, (
        f"functions over {LIMIT} lines: split them, or say why in a '# One piece' comment: {found}"
    )


def test_the_check_finds_a_long_function_and_takes_a_reason(tmp_path: Path):
    statements = [f"x{i} = {i}" for i in range(LIMIT)]
    method = ["class A:", "    def long(self):", *(f"        {x}" for x in statements)]  # 81 lines
    (tmp_path / "m.py").write_text("\n".join(method) + "\n")
    (tmp_path / "n.py").write_text(
        "\n".join(["def short():", *(f"    {x}" for x in statements[1:])]) + "\n"
    )  # 80
    assert long_functions(tmp_path) == {"m.py::A.long": LIMIT + 1}
    method.insert(2, "        # One piece on purpose: the test says so.")
    (tmp_path / "m.py").write_text("\n".join(method) + "\n")
    assert long_functions(tmp_path) == {}
