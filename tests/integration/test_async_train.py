"""``ais-train algorithm.max_staleness=2`` end to end (the deterministic mode) as a user runs it: the summary, the
history's staleness, the split of the mismatch in the logged metrics, and the bound's config errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.integration.helpers import SMOKE, run_train

pytestmark = pytest.mark.slow


def test_max_staleness_2_trains_with_stale_rows_and_logs_both_parts(tmp_path: Path):
    out = tmp_path / "run"
    proc = run_train(
        [*SMOKE, "algorithm.max_staleness=2", "trainer.max_steps=4", "logger=csv", f"hydra.run.dir={out}"],
        tmp_path,
    )
    assert (
        "ais-train summary" in proc.stdout
        and "staleness (versions)  mean 1.25, max 2, dropped 0 rows;" in proc.stdout
    )
    history = json.loads((out / "history.json").read_text())
    assert [h["staleness"] for h in history] == [0.0, 1.0, 2.0, 2.0]
    rows = [r for r in csv.DictReader(open(next(out.glob("csv/**/metrics.csv")))) if r.get("staleness/mean")]
    for key in (
        "mismatch/precision/kl_k3",
        "mismatch/staleness/kl_k3",
        "staleness/frac_2",
        "ais/kl_k3_staleness",
    ):
        assert all(r.get(key) not in (None, "") for r in rows), key


def test_a_lag_without_a_bound_is_refused_naming_the_keys(tmp_path: Path):
    with pytest.raises(AssertionError, match=r"rollout_lag=\[1, 2\].*needs max_staleness > 0"):
        run_train([*SMOKE, "algorithm.rollout_lag=[1,2]", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["workers=ray", "trainer=fsdp2"], "workers=ray with several trainer processes"),
        (
            ["workers=ray", "policy=tiny_qwen3_moe", "policy.router_replay=true"],
            "workers=ray runs autoregressive, dense",
        ),
        (
            ["algorithm.max_staleness=2", "algorithm.adaptive_staleness=true", "loss=tbpo", "corrector=none"],
            "adaptive_staleness",
        ),
    ],
)
def test_asynchronous_rules_are_checked_before_anything_heavy(overrides, message):
    from ais_lightning.app.build import validate
    from ais_lightning.app.config import compose_train_config

    with pytest.raises(ValueError, match=message):
        validate(compose_train_config([*SMOKE, "output_dir=/tmp/unused", *overrides]))
