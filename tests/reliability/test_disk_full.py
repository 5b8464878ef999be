"""A full disk during a run: a clear error naming the file, the MLflow run FAILED, nothing unverified left where
a resume looks, and the resume works once there is space again (issue #33, case 7).

The disk cannot be filled safely here, so it is emulated: from the third checkpoint save on, every write of
``ais_lightning.files`` fails with ``OSError(ENOSPC)``, and the first attempt to mark the MLflow run terminated
fails with SQLite's "database or disk is full" (what Lightning's own ``finalize("failed")`` met on the full
disk, leaving the run RUNNING). Before, the run ended with a 355-line traceback, the run RUNNING and a
checkpoint without its hash.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import torch

from ais_lightning import files
from ais_lightning.files import VerifiedCheckpointIO, verify_file
from tests.reliability.runs import SMOKE, mlflow_runs


class _FullDisk:
    """``open`` for ``ais_lightning.files`` whose writes fail with ENOSPC once ``full`` is set."""

    def __init__(self) -> None:
        self.full = False

    def open(self, path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = open(path, mode, *args, **kwargs)
        if self.full and ("x" in mode or "w" in mode):
            disk = self

            class Full:
                def write(self, data: Any) -> int:
                    if disk.full:
                        raise OSError(errno.ENOSPC, "No space left on device")
                    return handle.write(data)

                def __getattr__(self, name: str) -> Any:
                    return getattr(handle, name)

                def __enter__(self) -> Any:
                    return self

                def __exit__(self, *exc: Any) -> None:
                    handle.close()

            return Full()
        return handle


@pytest.mark.slow  # a fresh SQLite store and two ais-train runs (about 20 s)
def test_a_full_disk_fails_naming_the_checkpoint_marks_the_run_failed_and_leaves_only_verified_files(
    tmp_path: Path, monkeypatch
):
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from ais_lightning.app.config import compose_train_config
    from ais_lightning.app.train import run as train_run

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("AIS_LIGHTNING_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    common = [*SMOKE, "trainer.checkpoint_every_n_steps=1", "logger=mlflow", f"output_dir={out}"]

    disk = _FullDisk()
    saves = []
    save = VerifiedCheckpointIO.save_checkpoint

    def filling_save(io: Any, checkpoint: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        saves.append(Path(path).name)
        if len(saves) == 3:  # step 1's two checkpoints are on disk; the disk fills during step 2's
            disk.full = True
        save(io, checkpoint, path, *args, **kwargs)

    terminated = MlflowClient.set_terminated

    def store_full_once(client: Any, run_id: str, status: str | None = None, *args: Any, **kw: Any) -> Any:
        if disk.full and status == "FAILED" and not getattr(store_full_once, "failed", False):
            store_full_once.failed = True
            raise MlflowException("(sqlite3.OperationalError) database or disk is full")
        return terminated(client, run_id, status, *args, **kw)

    monkeypatch.setattr(files, "open", disk.open, raising=False)
    monkeypatch.setattr(VerifiedCheckpointIO, "save_checkpoint", filling_save)
    monkeypatch.setattr(MlflowClient, "set_terminated", store_full_once)
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as ended:
            train_run(compose_train_config(common))
        message = str(ended.value.code)
        assert message.startswith("ais-train: the disk is full."), message
        assert (
            f"No space left on device: could not write the checkpoint: {ckpts / 'step000002.ckpt'}" in message
        )
        assert "marked FAILED" in message and "ckpt_path=last" in message
        assert len(message) < 600 and "Traceback" not in message

        (record,) = mlflow_runs(out / "mlflow.db")
        assert record.info.status == "FAILED"
        left = sorted(p.name for p in ckpts.iterdir())
        assert left == ["last.ckpt", "last.ckpt.sha256", "step000001.ckpt", "step000001.ckpt.sha256"], left
        for path in ckpts.glob("*.ckpt"):
            verify_file(path)

        disk.full = False  # space freed: the run resumes where it stopped, in the same MLflow run
        summary = train_run(compose_train_config([*common, "ckpt_path=last"]))
        assert summary["status"] == "finished" and summary["steps"] == 2
        (record,) = mlflow_runs(out / "mlflow.db")
        assert record.info.status == "FINISHED" and "resumed_at_step_1" in record.data.tags
    finally:
        torch.set_num_threads(threads)
