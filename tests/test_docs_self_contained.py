"""The product stands on its own: no file points at anything outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The design page is only ever docs/design.md, an absolute path of a development machine is never written,
# and a path that climbs out of its folder ("../x") must land on a file or folder inside the repository.
OUTSIDE = re.compile(r"/work/|(?<![\w/])design\.md")
PARENT_PATH = re.compile(r"(?<![\w.])(?:\.\./)+[\w-][\w./-]*")


def _files():
    for path in REPO.rglob("*"):
        parts = set(path.relative_to(REPO).parts)
        if parts & {
            ".git",
            ".venv",
            ".venv-vllm",
            ".venv-gpu",
            "outputs",
            "multirun",
            "__pycache__",
            ".ruff_cache",
        }:
            continue
        if path.is_file() and path.suffix in {".py", ".md", ".yaml", ".toml", ".sh", ".cfg", ".txt"}:
            yield path


def _inside_repository(target: Path) -> bool:
    target = target.resolve()
    return target.is_relative_to(REPO) and target.exists()


def test_no_file_points_outside_the_repository():
    offenders = []
    for path in _files():
        if path == Path(__file__):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            climbs_out = any(
                not _inside_repository(path.parent / ref.group(0).rstrip("."))
                for ref in PARENT_PATH.finditer(line)
            )
            if OUTSIDE.search(line) or climbs_out:
                offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()[:100]}")
    assert not offenders, "references outside the repository:\n" + "\n".join(offenders)


def test_the_design_page_the_code_cites_exists_with_its_sections():
    text = (REPO / "docs/design.md").read_text()
    for n in range(1, 8):
        assert re.search(rf"^## {n}\. ", text, re.M), f"docs/design.md lacks section {n}"
