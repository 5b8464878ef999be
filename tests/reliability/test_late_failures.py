"""What used to fail late fails early, and an interrupted run says so (issue #13, case 5), in real processes."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.mlflow_server import free_port
from tests.reliability.runs import (
    SMOKE,
    TIMED,
    Run,
    metric_by_step,
    mlflow_runs,
    read_json,
    run_seconds,
    train,
    user_conf,
)


@pytest.mark.slow
def test_a_dead_tracking_uri_fails_within_seconds_naming_the_key(tmp_path: Path):
    """No server on the port: MLflow's client used to retry for minutes (after the warm start); now the
    store is checked before anything heavy."""
    out = tmp_path / "run"
    uri = f"http://127.0.0.1:{free_port()}"
    run = train(
        [*SMOKE, "logger=mlflow", f"logger.tracking_uri={uri}", f"hydra.run.dir={out}"],
        tmp_path,
        module=TIMED,
        timeout=300,
    )
    assert run.proc.returncode == 1, run.output[-4000:]
    assert f"logger.tracking_uri={uri} is not reachable" in run.stderr, run.stderr[-4000:]
    assert run_seconds(run.stderr) < 30
    assert not (out / "checkpoints").exists()


@pytest.mark.slow
def test_a_resume_whose_mlflow_server_is_gone_fails_within_seconds(tmp_path: Path):
    """A resume continues the checkpoint's MLflow run in the store it was logged to, so that store is the
    one checked: a server that is gone fails the resume at once (not after minutes of retries)."""
    import torch

    from ais_lightning.app.resume import MLFLOW_CHECKPOINT_KEY
    from ais_lightning.files import write_hash

    uri = f"http://127.0.0.1:{free_port()}"
    ckpt = tmp_path / "from_a_server_run.ckpt"  # only what ais-train reads before anything heavy
    torch.save({MLFLOW_CHECKPOINT_KEY: {"run_id": "0" * 32, "tracking_uri": uri}, "global_step": 1}, ckpt)
    write_hash(ckpt)  # as every checkpoint ais-train writes
    run = train(
        [*SMOKE, "logger=mlflow", f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path / 'run'}"],
        tmp_path,
        module=TIMED,
        timeout=600,
    )
    assert run.proc.returncode == 1, run.output[-4000:]
    assert f"ckpt_path's MLflow run is logged at {uri}, which is not reachable" in run.stderr, run.stderr[
        -3000:
    ]
    assert "set logger.tracking_uri" in run.stderr
    assert run_seconds(run.stderr) < 30


@pytest.mark.slow
def test_an_unwritable_output_dir_fails_before_any_training(tmp_path: Path):
    """``output_dir`` under a regular file (unwritable even for root): it used to fail at the first
    checkpoint, after the training; now before anything is built. 50 steps make the old way obvious."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory\n")
    run = train(
        [
            *SMOKE,
            "logger=none",  # (a CSV or MLflow logger would create its directory, and fail, at its start)
            "trainer.max_steps=50",
            f"hydra.run.dir={tmp_path / 'hydra'}",
            f"output_dir={blocker / 'run'}",
        ],
        tmp_path,
        module=TIMED,
        timeout=600,
    )
    assert run.proc.returncode == 1, run.output[-4000:]
    assert f"output_dir: {blocker / 'run'} is not writable" in run.stderr, run.stderr[-4000:]
    assert run_seconds(run.stderr) < 30
    assert "reward" not in run.stdout, "no training step and no summary"


@pytest.mark.slow
def test_sigterm_exits_143_with_a_summary_and_a_killed_mlflow_run_that_resumes(tmp_path: Path):
    """SIGTERM during training: exit code 143 (it was 0), ``summary.json`` marked interrupted (there was
    none), the MLflow run KILLED; a resume from the newest checkpoint continues that run to FINISHED."""
    out = tmp_path / "run"
    common = [*SMOKE, "trainer.max_steps=3", "trainer.checkpoint_every_n_steps=1", "logger=mlflow"]
    run = Run([*common, f"hydra.run.dir={out}"], tmp_path, log_name="first")
    run.wait_for(out / "checkpoints" / "step000001.ckpt")
    run.kill(signal.SIGTERM)
    run.expect(143)
    summary = read_json(out / "summary.json")
    assert summary["status"] == "interrupted"
    assert 1 <= summary["steps"] < 3
    assert summary["validation_start"], "the validation before training is in the summary"
    assert "INTERRUPTED" in run.stdout
    (killed,) = mlflow_runs(out / "mlflow.db")
    assert killed.info.status == "KILLED"

    Run([*common, "ckpt_path=last", f"hydra.run.dir={out}"], tmp_path, log_name="resume").expect(0)
    (resumed,) = mlflow_runs(out / "mlflow.db")
    assert resumed.info.run_id == killed.info.run_id and resumed.info.status == "FINISHED"
    assert list(metric_by_step(out / "mlflow.db", resumed.info.run_id, "reward/mean")) == [0, 1, 2]
    summary = read_json(out / "summary.json")
    assert summary["status"] == "finished" and summary["steps"] == 3
    assert summary["validation_start"]


@pytest.mark.slow
def test_sigterm_during_the_validation_before_training_ends_the_run_killed(tmp_path: Path):
    """SIGTERM in the last (here: only) batch of the validation before RL: Lightning's evaluation loop does
    not check its last batch and ``fit`` resets its flag, so the run used to train to the end and exit 0.
    Now it stops before its first step: exit 143, summary interrupted, MLflow run KILLED."""
    out = tmp_path / "run"
    conf = user_conf(
        tmp_path,
        {
            "rollout/sigterm.yaml": "_target_: tests.reliability.faults.SigtermOnGreedyEngine\n_partial_: true\n"
        },
    )
    run = Run(
        [
            *SMOKE,
            "rollout=sigterm",
            "algorithm.val_size=4",  # one validation batch of prompts_per_step=4
            "logger=mlflow",
            f"hydra.searchpath=[file://{conf}]",
            f"hydra.run.dir={out}",
        ],
        tmp_path,
    )
    run.expect(143)
    summary = read_json(out / "summary.json")
    assert summary["status"] == "interrupted" and summary["steps"] == 0, summary
    assert "INTERRUPTED" in run.stdout
    (killed,) = mlflow_runs(out / "mlflow.db")
    assert killed.info.status == "KILLED"
    assert not metric_by_step(out / "mlflow.db", killed.info.run_id, "reward/mean"), "no RL step ran"


def test_warmstart_steps_zero_fails_validation_naming_the_key():
    """``warmstart.steps=0`` (issue case 5), once the warm start has its settings class."""
    warmstart = pytest.importorskip("ais_lightning.app.warmstart")
    if not hasattr(warmstart, "WarmStartSettings"):
        pytest.skip("ais_lightning.app.warmstart.WarmStartSettings does not exist yet")
    from tests.reliability.test_bad_configs import make, validate

    with pytest.raises(ValueError, match=r"warmstart\b.*\bsteps\b"):
        validate(make("warmstart.steps=0"))
