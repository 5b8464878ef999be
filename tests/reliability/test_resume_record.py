"""The pieces that keep a resumed run's record whole (issue #13, case 4), on their own.

``tests/reliability/test_resume.py`` runs them end to end; here each decision is checked on its inputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ais_lightning.app.resume import log_missing_metrics, skipped_validation


def _checkpoint(ready: int, completed: int, batches_that_stepped: int, epoch: int = 0) -> dict:
    progress = {"ready": ready, "started": ready, "processed": ready, "completed": completed}
    return {
        "epoch": epoch,
        "loops": {
            "fit_loop": {
                "epoch_loop.batch_progress": {"total": progress, "current": dict(progress)},
                "epoch_loop.state_dict": {"_batches_that_stepped": batches_that_stepped},
            }
        },
    }


@pytest.mark.parametrize(
    "checkpoint, every, expected",
    [
        (_checkpoint(ready=2, completed=1, batches_that_stepped=1), 2, (1, 0)),  # end of batch 2, val due
        (_checkpoint(ready=3, completed=2, batches_that_stepped=2), 2, None),  # end of batch 3, no val due
        (_checkpoint(ready=4, completed=3, batches_that_stepped=3, epoch=1), 1, (3, 1)),
        (_checkpoint(ready=2, completed=2, batches_that_stepped=2), 2, None),  # saved after the batch ended
        ({}, 2, None),  # no loop state (not a Lightning fit checkpoint)
    ],
)
def test_skipped_validation_is_the_validation_due_after_a_batch_end_checkpoint(checkpoint, every, expected):
    assert skipped_validation(checkpoint, every) == expected


@pytest.mark.slow  # a fresh SQLite store runs MLflow's schema migrations
def test_log_missing_metrics_logs_only_what_the_mlflow_run_lacks_at_that_step(tmp_path: Path):
    from lightning.pytorch.loggers import MLFlowLogger

    logger = MLFlowLogger(experiment_name="e", tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    logger.log_metrics({"a": 1.0, "b": 2.0}, step=0)
    logged = log_missing_metrics(logger, {"step": 0, "metrics": {"a": 9.0, "c": 3.0}})
    assert logged == ["c"]
    client = logger.experiment
    assert [(m.step, m.value) for m in client.get_metric_history(logger.run_id, "a")] == [(0, 1.0)]
    assert [(m.step, m.value) for m in client.get_metric_history(logger.run_id, "c")] == [(0, 3.0)]
    assert log_missing_metrics(logger, {"step": 1, "metrics": {"a": 4.0}}) == ["a"]  # another step
    assert (
        log_missing_metrics(logger, None) == []
        and log_missing_metrics(False, {"step": 0, "metrics": {}}) == []
    )


def test_last_is_the_newest_checkpoint_whose_hash_was_written(tmp_path: Path):
    """A kill between a checkpoint and its sidecar leaves the newest file incomplete: ``last`` skips it."""
    import os

    from ais_lightning.app.resume import resolve_checkpoint
    from ais_lightning.files import write_hash

    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    older, newest = ckpts / "step000001.ckpt", ckpts / "step000002.ckpt"
    for i, path in enumerate((older, newest)):
        path.write_bytes(b"checkpoint")
        os.utime(path, ns=(10**9 * (i + 1), 10**9 * (i + 1)))
    with pytest.raises(ValueError, match=r"no checkpoint .* has its \.sha256 sidecar"):
        resolve_checkpoint("last", str(tmp_path))
    write_hash(older)
    assert resolve_checkpoint("last", str(tmp_path)) == str(older)  # the newest has no hash yet
    write_hash(newest)
    assert resolve_checkpoint("last", str(tmp_path)) == str(newest)


# ------------------------------------------------------------------- resume as a contract (issue 45, case 4)
def test_a_resume_continues_its_run_only_when_the_length_or_the_bookkeeping_changed():
    from ais_lightning.app.contract import config_changes, continuing

    before = {
        "config": {"algorithm.lr": 3e-5, "trainer.max_steps": 2, "ckpt_path": None},
        "choices": {"rollout": "int8"},
    }
    after = {
        "config": {"algorithm.lr": 1e-4, "trainer.max_steps": 4, "ckpt_path": "last"},
        "choices": {"rollout": "fp8"},
    }
    changes = config_changes(before, after)
    assert changes == {"algorithm.lr": (3e-5, 1e-4), "rollout": ("int8", "fp8"), "trainer.max_steps": (2, 4)}
    assert [k for k in changes if not continuing(k)] == ["algorithm.lr", "rollout"]
    for key in (
        "trainer.max_steps",
        "logger",
        "logger.tracking_uri",
        "warmstart.steps",
        "output_dir",
        "overwrite",
    ):
        assert continuing(key), key
    for key in (
        "seed",
        "corrector",
        "corrector.c",
        "algorithm.group_size",
        "trainer",
        "trainer.devices",
        "policy.dtype",
    ):
        assert not continuing(key), key


def test_the_state_that_does_not_fit_is_named_by_part():
    import torch

    from ais_lightning.app.contract import state_mismatch

    mine = {"policy.w": torch.zeros(2, 3), "corrector.c": torch.zeros(())}
    theirs = {
        "policy.w": torch.zeros(3, 3),
        "corrector.ema_lambda": torch.zeros(()),
        "corrector.c": torch.zeros(()),
    }
    assert state_mismatch(mine, theirs) == {
        "corrector": ["corrector.ema_lambda (in the checkpoint only)"],
        "policy": ["policy.w (shape [3, 3] in the checkpoint, [2, 3] here)"],
    }
    assert state_mismatch(mine, dict(mine)) == {}


def test_only_a_copied_run_directory_reads_its_own_copy_of_the_store(tmp_path: Path):
    from ais_lightning.app.resume import relocated
    from ais_lightning.app.tracking import sqlite_uri

    original, copy = tmp_path / "a b?", tmp_path / "copy"
    run = {"run_id": "r", "tracking_uri": sqlite_uri(original / "mlflow.db"), "output_dir": str(original)}
    ckpt = str(copy / "checkpoints" / "last.ckpt")
    assert relocated(run, ckpt, str(copy))["tracking_uri"] == sqlite_uri(copy / "mlflow.db")
    assert (
        relocated(run, str(original / "checkpoints" / "last.ckpt"), str(original)) == run
    )  # where it was written
    assert (
        relocated(run, str(original / "last.ckpt"), str(copy)) == run
    )  # another run's checkpoint, resumed here
    sweep = {**run, "tracking_uri": sqlite_uri(tmp_path / "mlflow.db")}  # a sweep's store, above the run
    assert relocated(sweep, ckpt, str(copy)) == sweep
    server = {**run, "tracking_uri": "http://127.0.0.1:5000"}
    assert relocated(server, ckpt, str(copy)) == server
