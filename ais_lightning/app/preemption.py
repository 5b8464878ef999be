"""Preemption (SIGUSR1, SLURM's warning before a preemption or the time limit): checkpoint, requeue, resume.

Lightning's own requeue handler (``SLURMEnvironment(auto_requeue=True)``) does its work inside the signal
handler: it finalizes the loggers (an MLflow store call) and saves ``hpc_ckpt_<N>.ckpt`` there. A signal that
lands while the main thread is inside a store call then waits for the store's lock the main thread holds: the
process hangs, its SIGTERMs "bypassed", the run RUNNING for ever. Its checkpoint also gets a ``.sha256``
sidecar here, whose digits Lightning's name parser reads as part of the number (``hpc_ckpt_1.ckpt.sha256`` ->
1256), so the requeued job looked for a checkpoint that does not exist.

``ais-train`` therefore turns Lightning's handler off (:func:`slurm_plugins`) and handles the signal with
:class:`Preemption`: the handler only records the signal; at the end of the training batch it arrived in (or
at the next boundary between Lightning's entry points) every rank saves ``checkpoints/hpc_ckpt_<N>.ckpt``
through the verified-write protocol (:class:`ais_lightning.files.VerifiedCheckpointIO`), rank 0 asks SLURM to
requeue the job (``scontrol requeue``; outside SLURM nothing is requeued), and the run stops as
``preempted`` (summary, MLflow run KILLED, exit code 138 = 128 + SIGUSR1). The requeued job runs the same
command: with ``ckpt_path`` unset it resumes from the newest checkpoint that verifies (:func:`requeued`;
``ckpt_path=last`` finds the ``hpc_ckpt_<N>`` ones too), continuing the same MLflow run.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ais_lightning.app.signals import any_rank

log = logging.getLogger("ais_lightning.app.train")

PREEMPT_SIGNAL = signal.SIGUSR1
"""The signal SLURM sends before it preempts or times out a job (``sbatch --signal=USR1@90``)."""
HPC_NAME = re.compile(r"^hpc_ckpt_(\d+)\.ckpt$")
"""A preemption checkpoint's file name (Lightning's ``hpc_ckpt_<N>.ckpt``), matched whole: never its sidecar."""


class Preempted(SIGTERMException):
    """The run stopped because it received :data:`PREEMPT_SIGNAL` (a ``SIGTERMException``: Lightning and the
    run's stop handling treat it as the interruption it is)."""


def in_slurm() -> bool:
    """Whether this process is a SLURM task as Lightning tells it (``SLURMEnvironment.detect()``)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect()


def requeued() -> bool:
    """Whether this process is a SLURM job that SLURM restarted (``$SLURM_RESTART_COUNT`` >= 1: requeued)."""
    count = os.environ.get("SLURM_RESTART_COUNT", "0").strip()
    return in_slurm() and count.isdigit() and int(count) >= 1


def slurm_plugins() -> list[Any]:
    """``[SLURMEnvironment(auto_requeue=False)]`` under SLURM (Lightning's own requeue handler off: see the module
    docstring), else ``[]``."""
    if not in_slurm():
        return []
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return [SLURMEnvironment(auto_requeue=False)]


def next_hpc_checkpoint(directory: str | os.PathLike) -> Path:
    """``<directory>/hpc_ckpt_<N+1>.ckpt``, N the largest number of the ``hpc_ckpt_<N>.ckpt`` files there (0 if
    none); sidecars and other files never count."""
    directory = Path(directory)
    numbers = [int(m.group(1)) for p in directory.glob("hpc_ckpt_*") if (m := HPC_NAME.match(p.name))]
    return directory / f"hpc_ckpt_{max(numbers, default=0) + 1}.ckpt"


def slurm_job_id() -> str | None:
    """``$SLURM_JOB_ID``, or ``<array job>_<task>`` for a job array's task; None outside SLURM."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None and os.environ.get("SLURM_ARRAY_TASK_ID") is not None:
        return f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def requeue_job(job_id: str) -> str:
    """``scontrol requeue <job_id>``; returns what happened, in words (the failure's output included)."""
    if not re.fullmatch(r"[0-9_]+", job_id):
        return f"not requeued: SLURM job id {job_id!r} is not a job id"
    try:
        done = subprocess.run(
            ["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"not requeued: scontrol requeue {job_id} failed ({err})"
    if done.returncode != 0:
        return (
            f"not requeued: scontrol requeue {job_id} exited {done.returncode}: {done.stderr.strip()[-300:]}"
        )
    return f"SLURM job {job_id} requeued"


class Preemption(Callback):
    """Records :data:`PREEMPT_SIGNAL` while :meth:`installed`; at the end of the training batch it arrived in,
    saves a verified ``hpc_ckpt_<N>.ckpt`` under ``checkpoint_dir``, requeues the SLURM job (rank 0) and raises
    :class:`Preempted`. ``outcome`` then says what was saved and requeued (for the summary)."""

    def __init__(self, checkpoint_dir: str | os.PathLike) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        self.received = False
        self.outcome: dict[str, str] = {}

    def _record(self, signum: int, frame: Any) -> None:
        self.received = True  # nothing else here: a store call or a write from a handler can deadlock

    @contextmanager
    def installed(self) -> Iterator[Preemption]:
        """Record the signal instead of dying of it until the block ends (main thread only, as ``signal`` allows;
        with a handler in place Lightning does not install its own)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(PREEMPT_SIGNAL, self._record)
        try:
            yield self
        finally:
            signal.signal(PREEMPT_SIGNAL, previous)

    def raise_if_received(self) -> None:
        """Between Lightning's entry points (no training batch to checkpoint): requeue and stop if any rank
        received the signal; the checkpoints written so far are the ones the requeued job resumes from."""
        if any_rank(self.received):
            self._requeue(None)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.raise_if_received()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if any_rank(self.received):  # every rank decides alike: the save below is collective
            path = next_hpc_checkpoint(self.checkpoint_dir)
            trainer.save_checkpoint(path)
            self._requeue(path if trainer.is_global_zero else None, rank_zero=trainer.is_global_zero)

    def _requeue(self, checkpoint: Path | None, rank_zero: bool = True) -> None:
        job = slurm_job_id() if in_slurm() else None
        requeue = (requeue_job(job) if job else "not requeued (not a SLURM job)") if rank_zero else ""
        self.outcome = {"checkpoint": str(checkpoint) if checkpoint else "", "requeue": requeue}
        if rank_zero:
            saved = f"saved {checkpoint}" if checkpoint else "no new checkpoint (not in a training batch)"
            log.warning(
                "%s received: %s; %s; the run stops here (resume with ckpt_path=last)",
                PREEMPT_SIGNAL.name,
                saved,
                requeue,
            )
        raise Preempted
