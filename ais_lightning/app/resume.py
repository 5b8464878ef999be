"""Resuming a run: which checkpoint ``ckpt_path=last`` takes, and continuing the checkpoint's MLflow run.

A checkpoint records the MLflow run it belongs to (:class:`MLflowRunInCheckpoint`), the metrics of the step
it was written at and the config that trained it (:class:`ais_lightning.app.contract.ConfigInCheckpoint`); a
resume (:class:`Resume`) finds the newest checkpoint that verifies, compares the configs (what a resume may
change: :mod:`ais_lightning.app.contract`), reopens that run or starts one linked to it, tags it, and logs what
a kill between the checkpoint and the logging left out (:func:`log_missing_metrics`, :func:`recover_validation`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from ais_lightning.app.contract import (
    CONFIG_CHECKPOINT_KEY,
    check_state_fits,
    config_changes,
    continuing,
    describe_changes,
    run_config,
)
from ais_lightning.app.tracking import is_mlflow, log_run_start, reopen_run, sqlite_path, sqlite_uri
from ais_lightning.files import CorruptFileError, VerifiedCheckpointIO, hash_path, verify_file

log = logging.getLogger("ais_lightning.app.train")  # the run's own logger: resume messages read as the run's


@dataclass
class Resume:
    """Where a run starts: from scratch (``ckpt_path`` None) or from a verified checkpoint and its MLflow run."""

    ckpt_path: str | None = None
    checkpoint: dict[str, Any] = field(default_factory=dict)
    """The checkpoint's contents (memory-mapped: metadata read, tensors not copied); {} from scratch."""
    output_dir: str = ""
    """The run's output directory."""
    changes: dict[str, tuple[Any, Any]] | None = None
    """Config keys this run changed from the checkpoint's (:func:`ais_lightning.app.contract.config_changes`);
    None when the checkpoint records no config (or from scratch)."""

    @classmethod
    def of(cls, cfg: Any) -> Resume:
        """The config's ``ckpt_path`` resolved (``last``: :func:`resolve_checkpoint`) and read, compared with the
        config. With ``ckpt_path`` unset in a directory that holds checkpoints, a requeued SLURM job resumes from
        the newest (``last``); any other run is refused unless ``overwrite=true``
        (:func:`ais_lightning.app.rundir.check_fresh_start`)."""
        from ais_lightning.app.preemption import requeued
        from ais_lightning.app.rundir import check_fresh_start, existing_checkpoints

        ckpt_path, output_dir = cfg.ckpt_path, str(cfg.output_dir)
        if ckpt_path is None and existing_checkpoints(output_dir):
            if requeued():
                log.info("a requeued SLURM job: resuming the newest checkpoint of %s", output_dir)
                ckpt_path = "last"
            else:
                check_fresh_start(output_dir, bool(cfg.get("overwrite", False)))
        path = resolve_checkpoint(ckpt_path, output_dir)
        if not path:
            return cls(output_dir=output_dir)
        checkpoint = read_checkpoint(path)
        recorded = checkpoint.get(CONFIG_CHECKPOINT_KEY)
        changes = None if recorded is None else config_changes(recorded, run_config(cfg))
        return cls(path, checkpoint, output_dir, changes)

    @property
    def step(self) -> Any:
        """The checkpoint's global step (None from scratch)."""
        return self.checkpoint.get("global_step")

    @property
    def new_run(self) -> bool:
        """Whether this resume changed what shapes training (a key outside
        :data:`ais_lightning.app.contract.CONTINUING_KEYS`): it logs to a new MLflow run linked to the old one."""
        return bool(self.changes) and not all(continuing(k) for k in self.changes)

    @property
    def mlflow_run(self) -> dict[str, Any] | None:
        """The MLflow run this resume logs to: the checkpoint's (:func:`mlflow_run_of`, its store found in a copied
        run directory: :func:`relocated`), with ``run_id`` None when the resume starts a new run in that store
        (:attr:`new_run`); None from scratch or without an MLflow run in the checkpoint."""
        run = mlflow_run_of(self.checkpoint) if self.ckpt_path else None
        if run is None:
            return None
        run = relocated(run, self.ckpt_path, self.output_dir)
        return {**run, "run_id": None} if self.new_run else run

    def continues(self, logger: Any) -> bool:
        """Whether ``logger`` logs to the checkpoint's MLflow run (not so when sent to another store)."""
        run = self.mlflow_run
        return bool(run) and is_mlflow(logger) and logger.run_id == run["run_id"]

    def check_state(self, module: Any) -> None:
        """Refuse a module whose state does not fit the checkpoint, naming the keys
        (:func:`ais_lightning.app.contract.check_state_fits`); before any MLflow run is opened or changed."""
        if self.ckpt_path:
            check_state_fits(module, self.checkpoint, self.changes, self.ckpt_path)

    def open_record(self, logger: Any, cfg: Any, warm: Any, engine: Any = None) -> None:
        """The MLflow record of the run: the checkpoint's run continued (:meth:`reopen`), or a new run
        (``log_run_start``, with what the rollout ``engine`` spec runs on this host: from scratch, sent to another
        store, or a resume that changed the recipe, then linked to the checkpoint's run: :meth:`link`). Nothing
        without an MLflow logger."""
        if self.continues(logger):
            self.reopen(logger)
        elif logger:
            log_run_start(logger, cfg, warm, engine)
            self.link(logger)

    def reopen(self, logger: Any) -> None:
        """Continue the checkpoint's run: RUNNING again, tagged ``resumed_at_step_<N>`` with the checkpoint (and
        ``config_changes_at_step_<N>`` with what the resume changed), and the checkpointed step's metrics logged
        in case the process was killed before it logged them. The run's params stay those of its first start."""
        reopen_run(logger)
        client = logger.experiment
        client.set_tag(logger.run_id, f"resumed_at_step_{self.step}", self.ckpt_path)
        if self.changes:
            log.info("resuming from step %s with %s: the MLflow run continues", self.step, self._changes())
            client.set_tag(logger.run_id, f"config_changes_at_step_{self.step}", self._changes())
        log_missing_metrics(logger, self.mlflow_run.get("pending"))

    def link(self, logger: Any) -> None:
        """A new MLflow run that continues another's training (:attr:`new_run`): tagged with the run, step and
        checkpoint it continues and what changed. A no-op from scratch or without MLflow."""
        old = mlflow_run_of(self.checkpoint) if self.ckpt_path else None
        if not self.new_run or not is_mlflow(logger):
            return
        old_id = old["run_id"] if old else ""
        log.warning(
            "resuming from step %s with %s: these change the training, so a new MLflow run %s continues run %s "
            "(tags resumed_from_run, config_changes); that run is left as it was",
            self.step,
            self._changes(),
            logger.run_id,
            old_id or "(none recorded)",
        )
        client = logger.experiment
        for key, value in (
            ("resumed_from_run", old_id),
            ("resumed_from_step", str(self.step)),
            ("resumed_from_checkpoint", self.ckpt_path),
            ("config_changes", self._changes()),
        ):
            client.set_tag(logger.run_id, key, value)

    def _changes(self) -> str:
        return describe_changes(self.changes or {}, limit=40)

    def skipped_validation(self, val_check_batches: int) -> tuple[int, int] | None:
        """The validation ``fit`` would skip resuming from this checkpoint (:func:`skipped_validation`)."""
        return skipped_validation(self.checkpoint, val_check_batches) if self.ckpt_path else None


def relocated(run: dict[str, Any], ckpt_path: str, output_dir: str) -> dict[str, Any]:
    """``run`` (:func:`mlflow_run_of`) with its store read from this run directory when the directory was copied
    or moved: the checkpoint lies under ``output_dir``, it was written in another directory, and the run's
    SQLite store was under that one (the default store). Otherwise ``run`` unchanged: a resume in the directory
    it was written in, a server, a sweep's store, or a checkpoint resumed from elsewhere keep the recorded
    store."""
    written_in, db = run.get("output_dir"), sqlite_path(run.get("tracking_uri", ""))
    if not written_in or db is None:
        return run
    here, there = Path(output_dir).absolute(), Path(written_in)
    if here == there or not Path(ckpt_path).absolute().is_relative_to(here) or not db.is_relative_to(there):
        return run
    return {**run, "tracking_uri": sqlite_uri(here / db.relative_to(there))}


def resolve_checkpoint(ckpt_path: str | None, output_dir: str) -> str | None:
    """``ckpt_path``, or for ``"last"`` the newest checkpoint under ``<output_dir>/checkpoints``."""
    if ckpt_path != "last":
        if ckpt_path is not None and not Path(ckpt_path).is_file():
            raise ValueError(f"ckpt_path={ckpt_path} does not exist")
        return ckpt_path
    from ais_lightning.app.rundir import existing_checkpoints

    directory = Path(output_dir) / "checkpoints"
    found = sorted(existing_checkpoints(output_dir), key=_mtime, reverse=True)  # newest first
    if not found:
        raise ValueError(f"ckpt_path=last but {directory} holds no checkpoint")
    if not any(hash_path(p.resolve()).exists() for p in found):
        raise ValueError(
            f"ckpt_path=last but no checkpoint under {directory} has its .sha256 sidecar (incomplete writes, "
            f"or written before checkpoints were hashed): {sorted(p.name for p in found)}"
        )
    # The newest checkpoint that verifies: a kill during a write can leave the newest one without its hash
    # (incomplete), and a damaged file never verifies; either is skipped, saying so, for the one before it.
    skipped = []
    for path in found:
        try:
            verify_file(path.resolve())
        except (CorruptFileError, OSError) as err:
            skipped.append(f"{path.name}: {err.reason if isinstance(err, CorruptFileError) else err}")
            continue
        if skipped:
            log.warning(
                "ckpt_path=last: resuming from %s, the newest checkpoint that verifies; skipped the newer %s",
                path,
                "; ".join(skipped),
            )
        else:
            log.info("ckpt_path=last: resuming from %s (the newest checkpoint; it verifies)", path)
        return str(path)
    raise ValueError(f"ckpt_path=last but no checkpoint under {directory} verifies: {'; '.join(skipped)}")


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:  # a dangling link or a file removed meanwhile: oldest, and refused when verified
        return -1


def read_checkpoint(path: str) -> dict[str, Any]:
    """The checkpoint's contents (memory-mapped: the metadata is read, the tensors are not copied)."""
    if not Path(path).is_dir():  # a distributed checkpoint (a directory) carries no sidecar
        VerifiedCheckpointIO().verify(path)  # a missing or wrong hash is refused, naming the file
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as err:
        raise ValueError(f"ckpt_path={path} cannot be read as a checkpoint: {err}") from err


MLFLOW_CHECKPOINT_KEY = "ais_mlflow_run"
"""Where a checkpoint records the MLflow run it belongs to (``{"run_id", "tracking_uri", "output_dir",
"pending"}``)."""


class MLflowRunInCheckpoint(Callback):
    """Lightning callback: every checkpoint records its MLflow run, so a resume continues that run.

    It also records the metrics of the step being checkpointed: Lightning saves a step's checkpoint
    (``ModelCheckpoint.on_train_batch_end``) *before* it sends that step's metrics to the loggers, and a
    resume starts after the step, so a process killed in between would leave a hole in the run's history.
    :func:`log_missing_metrics` fills it on resume.
    """

    def __init__(self, logger: Any, output_dir: str | Path) -> None:
        self.logger = logger
        self.output_dir = str(Path(output_dir).absolute())

    def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
        if is_mlflow(self.logger):
            checkpoint[MLFLOW_CHECKPOINT_KEY] = {
                "run_id": self.logger.run_id,
                "tracking_uri": self.logger._tracking_uri,
                "output_dir": self.output_dir,  # where the run was: a copied run directory finds its store
                "pending": pending_metrics(trainer),
            }


def pending_metrics(trainer: Any) -> dict[str, Any] | None:
    """``{"step", "metrics"}``: what Lightning will log for the current training step, as it would log it.

    Reads Lightning's logger connector (no public API exposes the current step's metrics alone); None
    outside a training step or when those internals are not there.
    """
    try:
        connector = trainer._logger_connector
        if not trainer.training or connector._first_loop_iter is None:
            return None
        logged = connector.metrics["log"]
        step = int(trainer.fit_loop.epoch_loop._batches_that_stepped)
    except (AttributeError, KeyError, TypeError, AssertionError):
        return None
    metrics = {k: float(v) for k, v in logged.items()}
    if not metrics:
        return None
    metrics.setdefault("epoch", float(trainer.current_epoch))  # as Lightning adds it
    return {"step": step, "metrics": metrics}


def log_missing_metrics(logger: Any, pending: dict[str, Any] | None) -> list[str]:
    """Log the ``pending`` metrics (``{"step", "metrics"}``) that ``logger``'s run lacks at their step.

    Called when a run resumes from a checkpoint: its process may have been killed after writing the
    checkpoint but before logging the checkpointed step (:func:`pending_metrics`) or its validation. An
    MLflow run is asked what it has; other loggers (a resumed CSV logger writes a new version) get all.
    Returns the keys it logged.
    """
    if not pending or not logger or not pending.get("metrics"):
        return []
    step, metrics = int(pending["step"]), dict(pending["metrics"])
    if is_mlflow(logger):
        client = logger.experiment
        metrics = {
            key: value
            for key, value in metrics.items()
            if not any(m.step == step for m in client.get_metric_history(logger.run_id, key))
        }
    if metrics:
        logger.log_metrics(metrics, step=step)
        logger.save()
    return sorted(metrics)


def mlflow_run_of(checkpoint: dict[str, Any]) -> dict[str, str] | None:
    """The MLflow run a checkpoint belongs to, or None (no MLflow logger, or an older checkpoint)."""
    return checkpoint.get(MLFLOW_CHECKPOINT_KEY)


def skipped_validation(checkpoint: dict[str, Any], val_check_batches: int) -> tuple[int, int] | None:
    """``(log step, epoch)`` of the validation a resume from ``checkpoint`` would skip, or None.

    Lightning saves a periodic checkpoint at the end of a training batch (``ModelCheckpoint
    .on_train_batch_end``), before the validation due after that batch. Resuming from it, Lightning counts
    that validation as done (``_TrainingEpochLoop.advance`` fast-forwards the validation loop), so if the
    process was killed before the validation ended, the run's record never gets it. This reads the
    checkpoint's loop state the way Lightning does (a batch processed but not completed = saved at the end
    of a training batch; validation every ``val_check_batches`` batches) and returns where Lightning would
    have logged that validation.
    """
    try:
        fit = checkpoint["loops"]["fit_loop"]
        total = fit["epoch_loop.batch_progress"]["total"]
        step = int(fit["epoch_loop.state_dict"]["_batches_that_stepped"])
        saved_at_batch_end = total["completed"] == total["processed"] - 1 == total["ready"] - 1
        batches = int(total["ready"])
    except (KeyError, TypeError, ValueError):
        return None
    if not saved_at_batch_end or batches % val_check_batches:
        return None
    return step, int(checkpoint.get("epoch", 0))


def recover_validation(
    trainer: Any, module: Any, data: Any, ckpt_path: str, logger: Any, step: int, epoch: int
) -> dict[str, float]:
    """Validate the checkpoint's weights and log what the run's record lacks at ``step``.

    A periodic checkpoint is written before the validation due after its step, and ``fit`` resumed from it
    skips that validation (:func:`skipped_validation`); a run killed in between would
    miss it. Run without loggers here; only the missing values are logged, where ``fit`` would have.
    """
    loggers, trainer.loggers = trainer.loggers, []
    try:
        (val,) = trainer.validate(module, datamodule=data, ckpt_path=ckpt_path, verbose=False)
    finally:
        trainer.loggers = loggers
    metrics = {k: float(v) for k, v in val.items()}
    if logger:
        log_missing_metrics(logger, {"step": step, "metrics": {**metrics, "epoch": float(epoch)}})
    return metrics
