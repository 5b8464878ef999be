"""The paper protocol shrunk to a smoke run: ``tools/paper_protocol.py`` end to end on ``experiment=paper_smoke``.

The tool starts a real MLflow server on 127.0.0.1, runs real Hydra multiruns with two parallel jobs
(joblib launcher) into it, then the sweep report and the claims check on what the runs logged.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.integration.helpers import REPO

pytestmark = pytest.mark.slow


def test_the_protocol_tool_on_the_smoke_preset(tmp_path: Path):
    out = tmp_path / "protocol"
    cmd = [sys.executable, str(REPO / "tools" / "paper_protocol.py"), "--out", str(out)]
    cmd += ["--experiments", "paper_smoke", "--many-seeds", "0", "--many-seeds-precisions", "int8"]
    cmd += ["--precisions", "", "--correctors", "none,ais", "--plot", "mismatch/ais_lambda"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "AIS_LIGHTNING_CACHE": str(tmp_path / "cache")}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    # a real server on 127.0.0.1, started by the tool and stopped at its end
    uri = re.search(r"^MLflow: (http://127\.0\.0\.1:\d+)", proc.stdout, re.M).group(1)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{uri}/health", timeout=2)
    for name in (
        "paper_smoke/baseline",
        "paper_smoke/many-seeds",
        "paper_smoke/report",
        "paper_smoke/claims",
    ):
        assert re.search(rf"^\[\d\d:\d\d:\d\d\] {name}: .*\(\d+:\d\d:\d\d\)$", proc.stdout, re.M), proc.stdout
        assert re.search(rf"^  {name}\s+\d+:\d\d:\d\d$", proc.stdout, re.M), "its wall time in the summary"
    assert "paper_smoke/precisions" not in proc.stdout, "no --precisions: that sweep is skipped"
    assert re.search(r"^  total\s+\d+:\d\d:\d\d$", proc.stdout, re.M)

    # every job logged to the server, none to a local store
    multirun = out / "paper_smoke" / "multirun"
    assert sorted(p.name for p in multirun.iterdir()) == ["baseline", "many-seeds"]
    assert not list(multirun.rglob("mlflow.db")) and not list(multirun.rglob("mlruns"))
    with sqlite3.connect(out / "mlflow.db") as db:
        statuses = db.execute(
            "SELECT r.status FROM runs r JOIN experiments e ON r.experiment_id = e.experiment_id "
            "WHERE e.name = 'paper_smoke'"
        ).fetchall()
    assert statuses == [("FINISHED",)] * 3

    report_dir = out / "paper_smoke" / "report"
    report = json.loads((report_dir / "report.json").read_text())
    assert report["excluded_runs"] == [], "all three jobs FINISHED"
    configs = {(r["group"]["rollout"], r["group"]["corrector"]) for r in report["rows"]}
    assert configs == {("fp32", "none"), ("int8", "none"), ("int8", "ais")}
    for row in report["rows"]:
        assert row["histories"]["mismatch/ais_lambda"]["step"], "lambda diagnostic logged by every run"
        if row["group"]["corrector"] == "ais":
            assert row["histories"]["ais_lambda"]["step"], "the lambda AIS applied"
    pngs = list(report_dir.glob("*.png"))
    assert (report_dir / "mismatch_ais_lambda.png") in pngs and (report_dir / "ais_lambda.png") in pngs
    assert (report_dir / "lambda_regimes.png") in pngs, "paper_claims --lambda-plot drew the AIS rows"
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    claims = (out / "paper_smoke" / "claims.md").read_text()
    for heading in ("### 1.", "### 2.", "### 3.", "### 4.", "### 5."):
        assert heading in claims
    assert "| int8 |" in claims and "| int8, ais |" in claims
    assert f"{report_dir / 'report.md'}, {out / 'paper_smoke' / 'claims.md'}" in proc.stdout
