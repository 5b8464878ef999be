"""The paper sweep protocol, shrunk to a smoke run: the documented commands end to end.

A real MLflow server on 127.0.0.1, a real Hydra multirun with two parallel jobs (joblib
launcher), the sweep report and the claims check on what the runs logged.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.helpers import REPO, run_train
from tests.mlflow_server import mlflow_server

pytestmark = pytest.mark.slow


def _tool(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_smoke_sweep_in_parallel_into_a_server_and_its_report(tmp_path: Path):
    sweep = tmp_path / "sweep"
    with mlflow_server(tmp_path) as uri:
        run_train(
            [
                "-m",
                "experiment=paper_smoke",
                "rollout=fp32,int8",
                "corrector=none,ais",
                "hydra/launcher=joblib",
                "hydra.launcher.n_jobs=2",
                f"logger.tracking_uri={uri}",
                f"hydra.sweep.dir={sweep}",
            ],
            cwd=tmp_path,
        )
        out = tmp_path / "report"
        _tool(
            str(REPO / "tools" / "sweep_report.py"),
            "--tracking-uri",
            uri,
            "--experiment",
            "paper_smoke",
            "--out",
            str(out),
            "--plot",
            "mismatch/ais_lambda",
        )
    assert not (sweep / "mlflow.db").exists(), "every job logged to the server, none to a local store"
    report = json.loads((out / "report.json").read_text())
    assert report["excluded_runs"] == [], "all four jobs FINISHED"
    configs = {(r["group"]["rollout"], r["group"]["corrector"]) for r in report["rows"]}
    assert configs == {("fp32", "none"), ("fp32", "ais"), ("int8", "none"), ("int8", "ais")}
    for row in report["rows"]:
        assert row["histories"]["mismatch/ais_lambda"]["step"], "lambda diagnostic logged by every run"
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "mismatch_ais_lambda.png").exists()

    claims = _tool(str(REPO / "tools" / "paper_claims.py"), str(out / "report.json")).stdout
    for heading in ("### 1.", "### 2.", "### 3.", "### 4.", "### 5."):
        assert heading in claims
    assert "| int8 |" in claims and "| int8, ais |" in claims
