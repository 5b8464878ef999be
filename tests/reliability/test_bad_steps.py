"""Runs whose numbers or rewards go bad end, loudly (issue #13, cases 1 and 7), in real ``ais-train`` processes.

The faults are plugged in the way a user plugs in a component: one YAML file on Hydra's search path
naming a class in ``tests/reliability/faults.py``.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tests.reliability.faults import USER_WARNING
from tests.reliability.runs import (
    NOISE,
    SMOKE,
    TIMED,
    metric_by_step,
    mlflow_runs,
    read_json,
    run_seconds,
    train,
)
from tests.reliability.runs import user_conf as _user_conf

pytestmark = pytest.mark.slow

CONF = {
    "rollout/nan_logprobs.yaml": (
        "_target_: tests.reliability.faults.NaNLogprobEngine\n_partial_: true\nprecision: fp32\n"
    ),
    "task/flaky.yaml": "_target_: tests.reliability.faults.FlakyArithmetic\nfail: always\n",
}


def user_conf(tmp_path: Path) -> str:
    return f"hydra.searchpath=[file://{_user_conf(tmp_path, CONF)}]"


def test_nan_temperature_fails_at_validation_in_seconds(tmp_path: Path):
    """The issue's command (``algorithm.temperature=nan``) skipped every step without counting it and
    never ended; now it is refused before anything is built."""
    out = tmp_path / "run"
    run = train(
        [*SMOKE, "algorithm.temperature=nan", "logger=csv", f"hydra.run.dir={out}"],
        tmp_path,
        module=TIMED,
        timeout=300,
    )
    assert run.proc.returncode != 0
    assert "algorithm.temperature must be a finite number" in run.stderr
    assert run_seconds(run.stderr) < 30, "validation is cheap: nothing heavy may run before it"
    assert not (out / "checkpoints").exists() and not (out / "csv").exists()


def test_an_engine_with_nan_logprobs_aborts_after_max_bad_steps(tmp_path: Path):
    """Every rollout step has NaN log-probs: each counts as an (empty) optimizer step and the run aborts
    after ``algorithm.max_bad_steps`` of them, with the cause and the limit named, its MLflow run FAILED."""
    out = tmp_path / "run"
    run = train(
        [
            *SMOKE,
            user_conf(tmp_path),
            "rollout=nan_logprobs",
            "trainer.max_steps=40",
            "algorithm.max_bad_steps=3",
            "logger=mlflow",
            f"hydra.run.dir={out}",
        ],
        tmp_path,
        timeout=600,
    )
    assert run.proc.returncode == 1, run.output[-4000:]
    assert "3 consecutive rollout steps had non-finite log-probs" in run.stderr, run.stderr[-4000:]
    assert "algorithm.max_bad_steps" in run.stderr
    (record,) = mlflow_runs(out / "mlflow.db")
    assert record.info.status == "FAILED"
    bad = metric_by_step(out / "mlflow.db", record.info.run_id, "train/nonfinite_logprobs")
    # the aborting step raises before Lightning logs its metrics: 2 or 3 values, all "bad", not 40
    assert set(bad.values()) == {1.0} and 2 <= len(bad) <= 3, bad
    assert not (out / "summary.json").exists()


def test_a_reward_that_always_raises_aborts_naming_the_reward(tmp_path: Path):
    """Every reward call raises: every sample scores 0, no step carries a signal; the run used to end
    FINISHED with no word about it. Now ``max_bad_steps`` such steps abort it, naming the reward."""
    out = tmp_path / "run"
    run = train(
        [
            *SMOKE,
            user_conf(tmp_path),
            "task=flaky",
            "trainer.max_steps=40",
            "algorithm.max_bad_steps=2",
            "logger=csv",
            f"hydra.run.dir={out}",
        ],
        tmp_path,
        timeout=600,
    )
    assert run.proc.returncode == 1, run.output[-4000:]
    assert "2 consecutive rollout steps had a reward function that failed on every sample" in run.stderr
    assert "algorithm.max_bad_steps" in run.stderr
    assert "flaky reward failed on call" in run.output, "the reward's own error is in the log"
    rows = list(csv.DictReader((out / "csv" / "version_0" / "metrics.csv").open()))
    failed = [float(r["reward/failed"]) for r in rows if r.get("reward/failed")]
    # every sample of every step failed; the aborting step raises before Lightning logs it: 1 or 2, not 40
    assert set(failed) == {16.0} and 1 <= len(failed) <= 2, failed


def test_a_reward_that_sometimes_raises_is_counted_and_noise_stays_silent(tmp_path: Path):
    """A reward that raises on every other call: the run ends, and the summary says how many samples it
    failed on. Checkpoints every step: none of the known third-party noise (the 13-line "manual
    optimization" warning at every checkpoint...) is printed, while the task's own warning is."""
    out = tmp_path / "run"
    run = train(
        [
            *SMOKE,
            user_conf(tmp_path),
            "task=flaky",
            "task.fail=every_other",
            "trainer.checkpoint_every_n_steps=1",
            "logger=csv",
            f"hydra.run.dir={out}",
        ],
        tmp_path,
        timeout=600,
    )
    assert run.proc.returncode == 0, run.output[-4000:]
    summary = read_json(out / "summary.json")
    failures = summary["reward_failures"]
    assert failures > 0 and failures % 16 == 0 and failures < 2 * 16, summary
    assert f"the reward function failed on {failures} samples" in run.stdout
    assert summary["status"] == "finished"
    assert {p.name for p in (out / "checkpoints").glob("step*.ckpt")} == {
        "step000001.ckpt",
        "step000002.ckpt",
    }
    assert USER_WARNING in run.stderr, "a real warning must still be shown"
    for fragment in NOISE:
        assert fragment not in run.output, fragment
