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
