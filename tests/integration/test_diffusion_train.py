"""``ais-train`` end to end with the masked-diffusion family: warm start, GRPO, corrector, summary."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.integration.helpers import SMOKE, run_train

pytestmark = pytest.mark.slow


def test_a_diffusion_policy_warm_starts_and_trains_with_a_corrector(tmp_path: Path):
    out = tmp_path / "llada"
    args = [
        *SMOKE,
        "policy=tiny_llada",
        "rollout=llada_fp4",
        "corrector=ais",
        "warmstart=default",  # the smoke preset turns it off: the diffusion SFT and its greedy evaluation
        "warmstart.steps=3",
        "warmstart.batch_size=8",
        "warmstart.eval_size=8",
        "logger=csv",
        f"hydra.run.dir={out}",
    ]
    proc = run_train(args, cwd=tmp_path)
    assert "ais-train summary" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2
    warm = summary["warm_start"]
    assert warm["steps"] == 3 and warm["eval_size"] == 8 and 0.0 <= warm["accuracy"] <= 1.0
    # fp4 diffusion rollouts against the fp32 policy: a real, finite mismatch reached the corrector
    assert math.isfinite(summary["kl_k3_mean"]) and summary["kl_k3_mean"] > 0
    metrics = (out / "csv").rglob("metrics.csv")
    header = next(iter(metrics)).read_text().splitlines()[0]
    assert "ais/lambda" in header and "val/accuracy_engine" in header
