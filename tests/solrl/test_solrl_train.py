"""End to end: ``ais-train experiment=solrl_smoke`` at int8 and fp4 screening, MLflow, checkpoints, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.integration.helpers import run_train

pytestmark = pytest.mark.slow

SOLRL = ["experiment=solrl_smoke", "trainer.num_threads=1"]


def test_int8_and_fp4_screening_log_their_figures_to_one_mlflow_experiment(tmp_path: Path):
    sweep = tmp_path / "sweep"
    run_train(["-m", *SOLRL, "logger=mlflow", "rollout=int8,fp4", f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    client = MlflowClient(tracking_uri=f"sqlite:///{sweep / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("ais_lightning").experiment_id])
    assert sorted(r.data.params["rollout.precision"] for r in runs) == ["fp4", "int8"]
    for run in runs:
        assert run.info.status == "FINISHED"
        assert run.data.params["algorithm"] == "solrl" and run.data.params["corrector"] == "none"
        for key in ("solrl/token_agreement", "solrl/informative_frac", "time/screen_s", "time/regen_s"):
            assert len(client.get_metric_history(run.info.run_id, key)) == 2, key
        agreement = run.data.metrics["solrl/token_agreement"]
        assert 0.0 < agreement <= 1.0
        assert run.data.metrics["mismatch/kl_k3"] < 1e-9, "trained on trainer-precision regenerations"
        assert "val/accuracy_trainer" in run.data.metrics and "val/accuracy_engine" in run.data.metrics
    for job in sweep.glob("*_*"):
        if job.is_dir():
            assert (job / "checkpoints" / "last.ckpt").exists()


def test_a_resumed_run_keeps_screening(tmp_path: Path):
    out = tmp_path / "run"
    run_train([*SOLRL, "logger=none", f"hydra.run.dir={out}"], cwd=tmp_path)
    assert len(json.loads((out / "history.json").read_text())) == 2
    run_train(
        [
            *SOLRL,
            "logger=none",
            "trainer.max_steps=3",
            f"ckpt_path={out / 'checkpoints' / 'last.ckpt'}",
            f"hydra.run.dir={tmp_path / 'resumed'}",
        ],
        cwd=tmp_path,
    )
    history = json.loads((tmp_path / "resumed" / "history.json").read_text())
    assert [h["step"] for h in history] == [1.0, 2.0, 3.0]
    assert all("informative_frac" in h and "token_agreement" in h for h in history)
    summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert summary["steps"] == 3
