"""The paper sweep, shrunk to a smoke run: real ais-train multirun -> one MLflow store -> sweep report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.helpers import REPO, run_train

pytestmark = pytest.mark.slow


def test_smoke_sweep_and_its_report(tmp_path: Path):
    sweep = tmp_path / "sweep"
    run_train(
        [
            "-m",
            "experiment=paper_smoke",
            "rollout=fp32,int8",
            "corrector=none,ais",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
    )
    out = tmp_path / "report"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "sweep_report.py"),
            "--tracking-uri",
            f"sqlite:///{sweep / 'mlflow.db'}",
            "--experiment",
            "paper_smoke",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    configs = {(r["group"]["rollout.precision"], r["group"]["corrector.name"]) for r in report["rows"]}
    assert configs == {("fp32", "none"), ("fp32", "ais"), ("int8", "none"), ("int8", "ais")}
    table = (out / "report.md").read_text()
    assert "int8" in table and "ais" in table
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(out.glob("*.png")), "at least the reward and KL plots"
