"""How an ``ais-train`` run that fails ends: its MLflow run marked FAILED, a full disk named in one paragraph.

Interruptions (SIGTERM, Ctrl+C) are not failures: :func:`ais_lightning.app.trainer.validate_and_fit` reports them
as a status, and the run ends with a summary, the MLflow run KILLED and exit code 143 / 130.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from ais_lightning.app.tracking import is_mlflow
from ais_lightning.files import disk_full, find_cause

log = logging.getLogger("ais_lightning.app.train")


@contextmanager
def failure_handling(cfg: DictConfig) -> Iterator[dict[str, Any]]:
    """Run the block; if it raises, mark the MLflow run FAILED and re-raise (a full disk or a tracking server that
    stopped answering as ``SystemExit`` with one paragraph saying what to do).

    A failed warm start (before any run is opened) ends as ``SystemExit`` with its message. Yields a dict
    where the block puts the ``logger`` once it is opened. Lightning marks the run FAILED itself
    when ``fit`` raises; this also covers errors outside ``fit`` and a store that Lightning could not write.
    The checkpoint directory then holds only complete, verified checkpoints (each published with its hash).
    """
    from ais_lightning.app.warmstart import WarmStartError

    opened: dict[str, Any] = {}
    try:
        yield opened
    except WarmStartError as err:  # before the run is opened: a clear error naming the band, not a traceback
        raise SystemExit(f"ais-train: the warm start failed: {err}") from err
    except Exception as err:
        failed = mark_failed(opened.get("logger"))
        message = disk_full_message(err, cfg, opened.get("logger"), failed) or server_lost_message(err, cfg)
        if message is not None:
            raise SystemExit(message) from err
        if failed:
            log.error("%s", failed)
        raise


def server_lost_message(err: BaseException, cfg: DictConfig) -> str | None:
    """The one-paragraph error of a run whose tracking server stopped answering, or None if ``err`` is something
    else (:class:`ais_lightning.app.store_client.TrackingServerLost`)."""
    from ais_lightning.app.store_client import TrackingServerLost

    lost = find_cause(err, lambda e: isinstance(e, TrackingServerLost))
    if lost is None:
        return None
    return (
        f"ais-train: {lost}. The run stopped there. The checkpoints under "
        f"{Path(str(cfg.output_dir), 'checkpoints')} are only complete, verified ones; its MLflow run could not "
        "be marked FAILED on the server (it shows RUNNING). Resume with ckpt_path=last once the server answers "
        "again: the resume continues that run."
    )


def mark_failed(logger: Any) -> str:
    """Mark ``logger``'s MLflow run FAILED (a no-op for other loggers); "" when done, else what went wrong."""
    if not is_mlflow(logger):
        return ""
    try:
        logger.experiment.set_terminated(logger.run_id, "FAILED")
    except Exception as err:  # e.g. the store is on the full disk too
        return f"the MLflow run {logger.run_id} could not be marked FAILED ({type(err).__name__}: {err})"
    return ""


def disk_full_message(err: BaseException, cfg: DictConfig, logger: Any, failed: str) -> str | None:
    """The one-paragraph error of a run that ran out of disk space, or None if ``err`` is something else."""
    full = disk_full(err)
    if full is not None:
        where = f"{full.strerror}: {full.filename}" if full.filename else str(full)
    elif find_cause(err, lambda e: "database or disk is full" in str(e)) is not None:
        store = logger._tracking_uri if is_mlflow(logger) else "the MLflow store"
        where = f"{store} could not be written (database or disk is full)"
    else:
        return None
    tracking = failed or (f"MLflow run {logger.run_id} is marked FAILED" if is_mlflow(logger) else "")
    tracking = f"; {tracking}" if tracking else ""
    return (
        f"ais-train: the disk is full. {where}. The checkpoints under {Path(str(cfg.output_dir), 'checkpoints')} "
        f"are only complete, verified ones{tracking}. Free some space and resume with ckpt_path=last."
    )
