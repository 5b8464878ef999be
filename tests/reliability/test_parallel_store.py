"""Parallel runs on the default SQLite store, and runs started in the same second (issue #13, case 2).

Real processes only: a joblib sweep of 5 jobs writing one ``mlflow.db`` at once (it used to fail on
concurrent schema creation: ``duplicate column name``, alembic "Online migration expected to match
one row"...), and two plain runs that start in the same second (they used to share
``outputs/<date>/<time>`` and die).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability.faults import FROZEN_NOW
from tests.reliability.runs import SMOKE, TIMED, Run, metric_by_step, mlflow_runs, read_json

pytestmark = pytest.mark.slow

CORRECTORS = ["none", "tis", "mis", "ais", "tis_seq"]


def test_a_parallel_sweep_of_five_jobs_on_the_default_store_all_finish(tmp_path: Path):
    sweep = tmp_path / "sweep"
    run = Run(
        [
            "-m",
            *SMOKE,
            "trainer.max_steps=1",
            "logger=mlflow",
            f"corrector={','.join(CORRECTORS)}",
            "hydra/launcher=joblib",
            "hydra.launcher.n_jobs=5",
            f"hydra.sweep.dir={sweep}",
        ],
        tmp_path,
    )
    run.expect(0, timeout=1200)
    assert [p.relative_to(sweep) for p in sweep.rglob("mlflow.db")] == [Path("mlflow.db")], (
        "one store for the whole sweep"
    )
    runs = mlflow_runs(sweep / "mlflow.db")
    assert sorted(r.data.params["corrector"] for r in runs) == sorted(CORRECTORS)
    assert len({r.info.experiment_id for r in runs}) == 1
    for record in runs:
        assert record.info.status == "FINISHED", record.info
        assert list(metric_by_step(sweep / "mlflow.db", record.info.run_id, "reward/mean")) == [0]
        assert "summary/reward_last" in record.data.metrics


def test_two_runs_started_in_the_same_second_get_their_own_directories(tmp_path: Path):
    """Two plain runs at once with the default run directory, Hydra's clock frozen at one second in both
    (see ``tests/reliability/faults.py``): each gets its own directory and store, and both finish."""
    env = {FROZEN_NOW: "2026-01-02T03:04:05"}
    args = [*SMOKE, "trainer.max_steps=1", "logger=mlflow"]
    runs = [Run(args, tmp_path, module=TIMED, env=env, log_name=f"run{i}") for i in range(2)]
    for r in runs:
        r.expect(0)
    dirs = sorted((tmp_path / "outputs" / "2026-01-02").iterdir())
    assert [d.name.startswith("03-04-05") for d in dirs] == [True, True], f"two directories: {dirs}"
    for d in dirs:
        (record,) = mlflow_runs(d / "mlflow.db")
        assert record.info.status == "FINISHED"
        assert read_json(d / "summary.json")["steps"] == 1
