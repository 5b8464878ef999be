"""docs/correctors.md: every metric its name table maps a peer's metric to really exists.

A ``mismatch/*`` name must be a key of ``MismatchDiagnostics()``; any other name is a stat of the
corrector named in the same cell (an option of ``conf/corrector`` or a registry name), which must
report it on a batch.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from ais_lightning.app.config import CONFIG_DIR
from ais_lightning.correctors import CORRECTORS, build_corrector
from ais_lightning.diagnostics import MismatchDiagnostics

DOC = Path(__file__).resolve().parents[2] / "docs" / "correctors.md"
CONF = CONFIG_DIR / "corrector"


def metric_rows() -> list[tuple[str, str, str, str | None]]:
    """(peer, their metric, our name, corrector or None) of the "Metric names" table."""
    section = DOC.read_text().split("## Metric names", 1)[1]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or cells[0] in ("peer", "---"):
            continue
        ours = re.findall(r"`([^`]+)`", cells[2])
        assert ours, line
        rows.append((cells[0], cells[1], ours[0], ours[1] if len(ours) > 1 else None))
    return rows


def corrector_from(name: str):
    """A corrector from an option file of this issue (``/schema/corrector/<registry>``) or a registry name."""
    path = CONF / f"{name}.yaml"
    if name not in CORRECTORS and path.exists():
        cfg = OmegaConf.to_container(OmegaConf.load(path))
        (schema,) = [d for d in cfg.pop("defaults") if isinstance(d, str) and d.startswith("/schema/")]
        return build_corrector(schema.split("/")[-1].removesuffix("@_here_"), **cfg)
    return build_corrector(name)


def test_table_is_parsed():
    rows = metric_rows()
    peers = {peer for peer, *_ in rows}
    assert {"verl", "TRL", "prime-rl"} <= peers and len(rows) >= 45


@pytest.mark.parametrize(("peer", "theirs", "ours", "corrector"), metric_rows())
def test_every_name_in_the_table_exists(peer, theirs, ours, corrector):
    if ours.startswith("mismatch/"):
        assert corrector is None or corrector.startswith("mismatch/")
        assert ours in MismatchDiagnostics().keys(), (peer, theirs)
        return
    assert corrector is not None, f"{ours} is a corrector stat: name its corrector in the cell"
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(4, 6, generator=g) * 3.0
    train = rollout + 0.3 * torch.randn(4, 6, generator=g)
    out = corrector_from(corrector)(
        train, rollout, torch.ones(4, 6, dtype=torch.bool), advantages=torch.randn(4, generator=g)
    )
    assert ours in out.stats, (peer, theirs, sorted(out.stats))


def test_every_option_file_of_the_issue_is_in_the_options_table():
    text = DOC.read_text().split("## Definitions", 1)[0]
    listed = set(re.findall(r"^\| `([a-z0-9_]+)` \|", text, flags=re.M))
    issue_15 = ("rs", "tis_bn", "icepop", "opsm", "dppo", "vespo", "m2po", "psis")
    ours = {
        p.stem for p in CONF.glob("*.yaml") for r in issue_15 if f"/schema/corrector/{r}@" in p.read_text()
    }
    assert len(ours) >= 16 and ours <= listed, sorted(ours - listed)
