"""SLURM preemption (issue 45, cases 1 and 2; case 12: SIGUSR1 outside SLURM), without a cluster.

A task of a one-task SLURM job is SLURM's variables in the environment and a ``scontrol`` on the PATH that
records what it was asked. SIGUSR1 (SLURM's warning before a preemption or the time limit) is sent by the run
to itself at chosen moments after its first checkpoint: inside an MLflow store call (Lightning's own handler,
which finalized the loggers from the handler, then waited for ever on the store lock the interrupted call
held: 2 of 6 real tries hung) and at file-system steps of the checkpoint writes. Each time the run must end
within seconds with a verified ``hpc_ckpt`` checkpoint, the job requeued and its MLflow run KILLED; the
requeued job (``SLURM_RESTART_COUNT=1``, the same command) must resume it and finish the same MLflow run
(Lightning's requeue read the ``.sha256`` sidecar's digits into the checkpoint's number and crashed).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ais_lightning.files import verify_file
from tests.integration.helpers import RENDEZVOUS_VARIABLES
from tests.reliability.faults import after_file_steps
from tests.reliability.runs import SMOKE, metric_by_step, mlflow_runs, read_json

SLURM_TASK = {
    "SLURM_NTASKS": "1",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_JOB_ID": "77",
    "SLURM_JOB_NAME": "ais-train",
    "SLURM_NODELIST": "node1",
    "SLURM_JOB_NUM_NODES": "1",
}
"""The one task of SLURM job 77."""
COMMON = [*SMOKE, "trainer.max_steps=3", "trainer.checkpoint_every_n_steps=1", "logger=mlflow"]
STORE_CALLS = ("log_batch", "log_metric", "set_tag", "update_run_info", "get_run", "get_metric_history")
"""The MLflow store's calls a run makes while it trains (each inside the store lock)."""


@pytest.fixture
def slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process as the task of SLURM job 77, with a ``scontrol`` that appends its arguments to the file
    returned."""
    calls = tmp_path / "scontrol.calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for key, value in SLURM_TASK.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    for key in RENDEZVOUS_VARIABLES:  # Lightning's SLURMEnvironment writes some: removed after the test
        monkeypatch.delenv(key, raising=False)
    return calls


@contextlib.contextmanager
def sigusr1_at(kind: str, index: int, armed_by: Path) -> Iterator[dict[str, Any]]:
    """Send SIGUSR1 to this process once, at the ``index``-th (from 1) moment of ``kind`` after ``armed_by``
    exists: ``store`` (inside an MLflow store call, the store lock held) or ``file`` (right after a file-system
    step of a checkpoint write, :func:`tests.reliability.faults.after_file_steps`).
    Yields ``{"sent": bool}``."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    state = {"sent": False, "seen": 0}

    def moment(this_kind: str) -> None:
        if state["sent"] or this_kind != kind or not armed_by.exists():
            return
        state["seen"] += 1
        if state["seen"] == index:
            state["sent"] = True
            os.kill(os.getpid(), signal.SIGUSR1)  # handled at the next bytecode: still inside this moment

    def store_call(method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            moment("store")
            return method(*args, **kwargs)

        return call

    with pytest.MonkeyPatch.context() as patch, after_file_steps(lambda: moment("file")):
        for name in STORE_CALLS:
            patch.setattr(SqlAlchemyStore, name, store_call(getattr(SqlAlchemyStore, name)))
        yield state


MOMENTS = [("store", 1), ("store", 3), ("file", 8), ("file", 26)]
"""After step 1's checkpoint is published: the first store call (step 1's metrics, right after its checkpoint,
where the old handler hung), the third (step 2's validation), and two file-system steps of the checkpoint writes
(9 per file: created, written, its hash file created, written and renamed, renamed over the old one, its hash
file again). Moments 1-4 end ``step000001.ckpt``, 5-13 are step 1's new ``last.ckpt`` (8: its hash file being
written), 14-22 ``step000002.ckpt``, 23-31 ``last.ckpt`` replaced (26: its hash file listing the old and the new
hash being written)."""


@pytest.mark.slow
@pytest.mark.timeout(300, method="signal")  # a hang (the old handler) fails here instead of never ending
@pytest.mark.parametrize("kind, index", MOMENTS, ids=[f"{k}{i}" for k, i in MOMENTS])
def test_sigusr1_checkpoints_requeues_and_the_requeued_job_finishes_the_same_run(
    kind, index, slurm, in_process, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    out = tmp_path / "run"
    args = [*COMMON, f"output_dir={out}"]
    with sigusr1_at(kind, index, out / "checkpoints" / "step000001.ckpt.sha256") as state:
        with pytest.raises(SystemExit) as stopped:
            in_process(args)
    assert state["sent"], f"no {kind} moment {index} after the first checkpoint"
    assert stopped.value.code == 128 + signal.SIGUSR1, "the run ends at the batch the signal arrived in"
    (hpc,) = (out / "checkpoints").glob("hpc_ckpt_*.ckpt")
    verify_file(hpc)
    assert slurm.read_text().split() == ["requeue", "77"]
    summary = read_json(out / "summary.json")
    assert summary["status"] == "preempted" and summary["preemption"]["checkpoint"] == str(hpc)
    (killed,) = mlflow_runs(out / "mlflow.db")
    assert killed.info.status == "KILLED"

    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the requeued job: the same command
    summary = in_process(args)
    assert summary["status"] == "finished" and summary["steps"] == 3
    (record,) = mlflow_runs(out / "mlflow.db")
    assert record.info.run_id == killed.info.run_id and record.info.status == "FINISHED"
    assert list(metric_by_step(out / "mlflow.db", record.info.run_id, "reward/mean")) == [0, 1, 2]
    assert slurm.read_text().split() == ["requeue", "77"], "the finished job is not requeued again"


@pytest.mark.slow
def test_sigusr1_outside_slurm_checkpoints_and_ends_the_run_killed(in_process, tmp_path: Path):
    """Case 12: outside SLURM the default action of SIGUSR1 killed the process, its MLflow run left RUNNING."""
    out = tmp_path / "run"
    args = [*COMMON, f"output_dir={out}"]
    ignored = signal.signal(
        signal.SIGUSR1, lambda *_: None
    )  # the test process survives a run that ignores it
    try:
        with sigusr1_at("store", 1, out / "checkpoints" / "step000001.ckpt.sha256"):
            with pytest.raises(SystemExit) as stopped:
                in_process(args)
    finally:
        signal.signal(signal.SIGUSR1, ignored)
    assert stopped.value.code == 128 + signal.SIGUSR1
    summary = read_json(out / "summary.json")
    assert summary["preemption"]["requeue"] == "not requeued (not a SLURM job)"
    verify_file(summary["preemption"]["checkpoint"])
    (record,) = mlflow_runs(out / "mlflow.db")
    assert record.info.status == "KILLED"
    assert in_process([*args, "ckpt_path=last"])["steps"] == 3


def test_the_next_preemption_checkpoint_number_ignores_hash_sidecars(tmp_path: Path):
    """Lightning's parser keeps every digit of any name containing ``hpc_ckpt_``: beside
    ``hpc_ckpt_1.ckpt.sha256`` it numbers the next checkpoint 1257 and resumes from one that does not exist."""
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    from ais_lightning.app.preemption import next_hpc_checkpoint

    assert next_hpc_checkpoint(tmp_path).name == "hpc_ckpt_1.ckpt"
    for name in ("hpc_ckpt_1.ckpt", "hpc_ckpt_1.ckpt.sha256", "hpc_ckpt_2.ckpt", "hpc_ckpt_2.ckpt.sha256"):
        (tmp_path / name).write_text("x")
    assert next_hpc_checkpoint(tmp_path).name == "hpc_ckpt_3.ckpt"
    assert (
        Path(_CheckpointConnector.hpc_save_path(tmp_path)).name == "hpc_ckpt_2257.ckpt"
    )  # why not Lightning's


@pytest.mark.slow
def test_a_requeued_job_resumes_from_the_preemption_checkpoint_lightning_left(
    slurm, in_process, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Case 2 as the issue found it: Lightning's handler left ``hpc_ckpt_1.ckpt`` and its ``.sha256`` at the top of
    the run directory, and the requeued job asked for ``hpc_ckpt_1256.ckpt`` (FileNotFoundError, a new MLflow run
    left FAILED). ``ckpt_path`` unset in a requeued job now means the newest checkpoint that verifies."""
    import shutil

    out = tmp_path / "run"
    in_process([*COMMON, "trainer.max_steps=2", f"output_dir={out}"])
    (first,) = mlflow_runs(out / "mlflow.db")
    for suffix in ("", ".sha256"):  # written after the run's own checkpoints: the newest
        shutil.copy(out / "checkpoints" / f"step000001.ckpt{suffix}", out / f"hpc_ckpt_1.ckpt{suffix}")
    (out / "hpc_ckpt_1.ckpt.sha256").write_text(
        (out / "hpc_ckpt_1.ckpt.sha256").read_text().replace("step000001.ckpt", "hpc_ckpt_1.ckpt")
    )
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    summary = in_process([*COMMON, "trainer.max_steps=3", f"output_dir={out}"])
    assert summary["status"] == "finished" and summary["steps"] == 3
    (record,) = mlflow_runs(out / "mlflow.db")
    assert record.info.run_id == first.info.run_id and record.info.status == "FINISHED"
    assert "resumed_at_step_1" in record.data.tags
