"""The front door: every symlink in the repository resolves, every relative Markdown link in README.md and docs/
lands on a file, and the top-level ``conf/`` is the configs ``ais-train`` composes and the wheel ships."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from ais_lightning.app.config import CONFIG_DIR, compose_train_config

REPO = Path(__file__).resolve().parents[1]
SKIPPED_DIRS = {".git", ".venv", ".venv-vllm", "outputs", "multirun", "__pycache__", ".ruff_cache", "build"}
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
"""An inline Markdown link or image, ``[text](target "title")``: group 1 is the target."""
REFERENCE = re.compile(r"^\s{0,3}\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
"""A reference definition, ``[label]: target``."""
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def broken_symlinks(root: Path) -> list[str]:
    """Symlinks under ``root`` (not followed) whose target does not exist or lies outside ``root``."""
    root = root.resolve()
    broken = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
        for name in [*dirs, *files]:
            path = Path(folder) / name
            if path.is_symlink():
                target = path.resolve()
                if not (target.exists() and target.is_relative_to(root)):
                    broken.append(f"{path.relative_to(root)} -> {os.readlink(path)}")
    return sorted(broken)


def markdown_links(text: str) -> list[str]:
    """The link targets of a Markdown text (inline links, images, reference definitions), outside fenced code."""
    text = FENCE.sub("", text)
    return [m.group(1) for m in LINK.finditer(text)] + [m.group(1) for m in REFERENCE.finditer(text)]


def broken_links(root: Path, pages: list[Path]) -> list[str]:
    """``page: target`` for every relative link of ``pages`` that does not land on an existing file or folder
    inside ``root`` (resolved from the page's own folder, the anchor dropped; URLs and in-page anchors skipped)."""
    root = root.resolve()
    broken = []
    for page in pages:
        for target in markdown_links(page.read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
                continue  # https:, mailto:, an anchor in the page
            resolved = (page.parent / target.split("#", 1)[0]).resolve()
            if not (resolved.exists() and resolved.is_relative_to(root)):
                broken.append(f"{page.relative_to(root)}: {target}")
    return broken


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_every_symlink_in_the_repository_resolves():
    assert (REPO / "conf").is_symlink() or (REPO / "conf").is_dir()
    assert not broken_symlinks(REPO), broken_symlinks(REPO)


def test_every_relative_markdown_link_lands_on_a_file():
    pages = _pages()
    links = sum(len(markdown_links(p.read_text())) for p in pages)
    assert len(pages) > 10 and links > 50, "the pages and their links were read"
    assert not broken_links(REPO, pages), "\n".join(broken_links(REPO, pages))


def test_the_checks_catch_a_broken_link_and_a_dead_symlink(tmp_path: Path):
    """A scratch tree: the checks pass on it, then name the dead symlink and the broken links added to it."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "ais.md").write_text("# AIS\n")
    (tmp_path / "README.md").write_text("See [AIS](docs/ais.md#lambda) and [the web](https://example.org).\n")
    (tmp_path / "docs" / "results.md").write_text("[ais](ais.md) ![plot](./ais.md)\n\n[ref]: ../README.md\n")
    (tmp_path / "conf").symlink_to("docs")
    pages = [tmp_path / "README.md", tmp_path / "docs" / "results.md"]
    assert broken_links(tmp_path, pages) == [] and broken_symlinks(tmp_path) == []

    (tmp_path / "docs" / "results.md").write_text(
        "[ais](docs/ais.md) written from inside docs/\n\n```\n[not a link](nowhere.md)\n```\n[ref]: gone.md\n"
    )
    (tmp_path / "conf").unlink()
    (tmp_path / "conf").symlink_to("ais_lightning/conf")  # what the top-level conf was: a link to nothing
    assert broken_links(tmp_path, pages) == ["docs/results.md: docs/ais.md", "docs/results.md: gone.md"]
    assert broken_symlinks(tmp_path) == ["conf -> ais_lightning/conf"]


def test_the_top_level_conf_is_the_configs_ais_train_composes_and_the_wheel_ships():
    import tomllib

    assert (REPO / "conf").resolve() == CONFIG_DIR.resolve() and (REPO / "conf" / "train.yaml").is_file()
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    package = REPO / "ais_lightning"
    shipped = {p.resolve() for pattern in package_data["ais_lightning"] for p in package.glob(pattern)}
    configs = {p.resolve() for p in (REPO / "conf").rglob("*.yaml")}
    assert len(configs) > 50 and configs <= shipped, sorted(configs - shipped)


@pytest.mark.parametrize("where", ["repository", "project"])
def test_the_readme_search_path_example_composes(where: str, tmp_path: Path, monkeypatch):
    """README: your own option in ``conf/<group>/<name>.yaml``, then ``hydra.searchpath=[file://conf]``; from the
    repository's root ``conf/`` is the built-in configs, which the search path then names a second time."""
    if where == "project":
        (tmp_path / "conf" / "corrector").mkdir(parents=True)
        mine = "_target_: ais_lightning.correctors.TIS\nc: 3.0\n"
        (tmp_path / "conf" / "corrector" / "mine.yaml").write_text(mine)
        monkeypatch.chdir(tmp_path)
        cfg = compose_train_config(["hydra.searchpath=[file://conf]", "corrector=mine"])
        assert dict(cfg.corrector) == {"_target_": "ais_lightning.correctors.TIS", "c": 3.0}
    else:
        monkeypatch.chdir(REPO)
        cfg = compose_train_config(["hydra.searchpath=[file://conf]", "corrector=tis_seq"])
        assert cfg.corrector.level == "sequence"
        assert cfg.corrector._target_ == "ais_lightning.correctors.tis.TIS"


CITED = re.compile(r"ais_lightning(?:\.[A-Za-z_]\w*)+")
"""A dotted name of the package as the docs, configs and docstrings cite it (``ais_lightning.modules.GRPOModule``)."""


def unresolved(name: str) -> str | None:
    """Why the cited ``name`` does not resolve (None when it does): the longest importable module prefix, then
    attributes; a dataclass field counts as an attribute of its class."""
    import dataclasses
    import importlib

    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    for part in parts[i:]:
        fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
        if not hasattr(obj, part) and part not in fields:
            return f"{'.'.join(parts[:i])} has no {part}"
        obj = getattr(obj, part, None)
        i += 1
    return None


def test_every_name_the_docs_configs_and_docstrings_cite_resolves():
    sources = [
        *_pages(),
        *sorted(CONFIG_DIR.rglob("*.yaml")),
        *sorted((REPO / "ais_lightning").rglob("*.py")),
    ]
    cited = {m.group(0).rstrip("."): p for p in sources for m in CITED.finditer(p.read_text())}
    assert len(cited) > 200
    assert unresolved("ais_lightning.modules.GRPOModule.training_step") is None
    assert unresolved("ais_lightning.modules.NoSuchModule") == "ais_lightning.modules has no NoSuchModule"
    wrong = {name: unresolved(name) for name in cited if unresolved(name)}
    assert not wrong, "\n".join(f"{cited[n].relative_to(REPO)}: {n}: {why}" for n, why in wrong.items())
