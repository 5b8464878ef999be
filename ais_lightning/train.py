"""``ais-train``: GRPO on low-precision rollouts, composed with Hydra, tracked in MLflow.

ais-train                                   # the embedded default (tiny Qwen3, int8 rollouts, AIS)
ais-train corrector=tis rollout=fp8         # swap components
ais-train -m corrector=none,tis,mis,ais     # a sweep: four MLflow runs in one experiment
ais-train trainer=fsdp2                     # FSDP2 over 2 CPU processes (gloo)
ais-train --cfg job                         # print the composed config and exit

Order of a run: compose and validate everything cheap (key-named errors), check the output directory
and the tracking store, then build the policy, warm-start it, and train. SIGTERM / Ctrl+C end the run
with exit code 143 / 130, a summary marked interrupted and the MLflow run marked KILLED; a resume from
a checkpoint continues the same MLflow run.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from ais_lightning.config import register_configs

register_configs()
if not OmegaConf.has_resolver("pid"):
    # Output directories carry the process id: two runs started in the same second never share one. Cached
    # like Hydra's own ${now:}: the parent resolves the sweep directory before it launches the jobs, and Hydra
    # copies the parent config's resolver cache into every job's config (``load_sweep_config``), so jobs run
    # by other processes (joblib, SLURM) get the parent's id, not their own: one sweep directory, one store.
    OmegaConf.register_new_resolver("pid", os.getpid, use_cache=True)

log = logging.getLogger("ais_lightning.train")  # also when run as __main__

EXIT_CODES = {"sigterm": 143, "sigint": 130}
"""Exit codes of an interrupted run (128 + the signal number, as shells report them)."""


def resolve_checkpoint(ckpt_path: str | None, output_dir: str) -> str | None:
    """``ckpt_path``, or for ``"last"`` the newest checkpoint under ``<output_dir>/checkpoints``."""
    if ckpt_path != "last":
        if ckpt_path is not None and not Path(ckpt_path).is_file():
            raise ValueError(f"ckpt_path={ckpt_path} does not exist")
        return ckpt_path
    from ais_lightning.files import CorruptFileError, hash_path, verify_file

    directory = Path(output_dir) / "checkpoints"
    found = sorted(directory.glob("*.ckpt"), key=_mtime, reverse=True)  # newest first
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
            skipped.append(f"{path.name}: {getattr(err, 'reason', err)}")
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


def _read_checkpoint(path: str) -> dict[str, Any]:
    """The checkpoint's contents (memory-mapped: the metadata is read, the tensors are not copied)."""
    import torch

    from ais_lightning.files import VerifiedCheckpointIO

    if not Path(path).is_dir():  # a distributed checkpoint (a directory) carries no sidecar
        VerifiedCheckpointIO().verify(path)  # a missing or wrong hash is refused, naming the file
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as err:
        raise ValueError(f"ckpt_path={path} cannot be read as a checkpoint: {err}") from err


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train with a composed config; returns the summary dict.

    A run that ends with an error leaves its MLflow run FAILED (also when Lightning's own attempt to mark it
    could not write the store). A full disk ends it with ``SystemExit`` naming the file that could not be
    written, rather than a traceback; the checkpoint directory then holds only verified checkpoints.
    """
    opened: dict[str, Any] = {}
    try:
        return _run(cfg, opened)
    except Exception as err:
        failed = _mark_failed(opened.get("logger"))
        full = _disk_full_message(err, cfg, opened.get("logger"), failed)
        if full is not None:
            raise SystemExit(full) from err
        if failed:
            log.error("%s", failed)
        raise


def _mark_failed(logger: Any) -> str:
    """Mark ``logger``'s MLflow run FAILED (a no-op for other loggers); "" when done, else what went wrong."""
    if not logger or not hasattr(logger, "run_id"):
        return ""
    try:
        logger.experiment.set_terminated(logger.run_id, "FAILED")
    except Exception as err:  # e.g. the store is on the full disk too
        return f"the MLflow run {logger.run_id} could not be marked FAILED ({type(err).__name__}: {err})"
    return ""


def _disk_full_message(err: BaseException, cfg: DictConfig, logger: Any, failed: str) -> str | None:
    """The one-paragraph error of a run that ran out of disk space, or None if ``err`` is something else."""
    from ais_lightning.files import disk_full, find_cause

    full = disk_full(err)
    if full is not None:
        where = f"{full.strerror}: {full.filename}" if full.filename else str(full)
    else:
        if find_cause(err, lambda e: "database or disk is full" in str(e)) is None:
            return None
        store = getattr(logger, "_tracking_uri", None) or "the MLflow store"
        where = f"{store} could not be written (database or disk is full)"
    tracking = failed or (f"MLflow run {logger.run_id} is marked FAILED" if hasattr(logger, "run_id") else "")
    tracking = f"; {tracking}" if tracking else ""
    return (
        f"ais-train: the disk is full. {where}. The checkpoints under {Path(str(cfg.output_dir), 'checkpoints')} "
        f"are only complete, verified ones{tracking}. Free some space and resume with ckpt_path=last."
    )


def _run(cfg: DictConfig, opened: dict[str, Any]) -> dict[str, Any]:
    import lightning as L
    import torch
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from ais_lightning.build import validate
    from ais_lightning.files import VerifiedCheckpointIO
    from ais_lightning.noise import silence_known_noise
    from ais_lightning.signals import SigtermGuard
    from ais_lightning.summary import format_summary, summarize, write_summary
    from ais_lightning.tracking import (
        MLflowRunInCheckpoint,
        build_logger,
        check_tracking_uri,
        check_writable,
        flatten_config,
        log_missing_metrics,
        mlflow_run_of,
        option_choices,
        reopen_run,
    )
    from ais_lightning.trainer import checkpoint_callback, progress_bar, skipped_validation
    from ais_lightning.warmstart import WarmStartError

    silence_known_noise()  # also in joblib workers, where main() does not run
    # --- cheap checks first: nothing heavy is built before the config is known to be sound.
    c = validate(cfg)
    check_writable(Path(cfg.output_dir), "output_dir")
    ckpt_path = resolve_checkpoint(cfg.ckpt_path, cfg.output_dir)
    checkpoint = _read_checkpoint(ckpt_path) if ckpt_path else {}
    resume = mlflow_run_of(checkpoint) if ckpt_path else None
    check_tracking_uri(c.logger, cfg.output_dir, resume)  # the store the run will log to
    if c.trainer.num_threads:
        torch.set_num_threads(c.trainer.num_threads)

    started = time.perf_counter()
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    try:  # a resume starts from the checkpoint's weights: no warm start
        policy, warm = c.initial_policy(
            cfg.seed, warm=ckpt_path is None, progress_bar=c.trainer.enable_progress_bar
        )
    except WarmStartError as err:  # a clear error naming the band and what to change, not a traceback
        raise SystemExit(f"ais-train: the warm start failed: {err}") from err
    warm_info = (
        warm.describe() if warm else ("off" if ckpt_path is None else f"off (resumed from {ckpt_path})")
    )

    algo = c.algorithm
    module = c.grpo_module(policy, cfg.seed)
    steps = c.trainer.max_steps
    data = c.prompt_data(steps, cfg.seed)  # a resume may raise max_steps: batch k stays batch k
    logger = build_logger(c.logger, cfg.output_dir, resume=resume)
    opened["logger"] = logger  # marked FAILED by run() if anything below raises
    per_rollout = algo.optimizer_steps_per_rollout
    every = c.trainer.checkpoint_every_n_steps * per_rollout or None
    val_every = min(algo.val_every_n_steps, steps)  # in training batches = rollout steps
    guard = SigtermGuard()
    trainer = L.Trainer(
        accelerator=c.trainer.accelerator,
        devices=c.trainer.devices,
        num_nodes=c.trainer.num_nodes,
        strategy=c.trainer.strategy_object(type(policy.decoder_layers()[0])),
        precision=c.trainer.precision,
        max_steps=steps * per_rollout,
        val_check_interval=val_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=logger,
        plugins=[VerifiedCheckpointIO()],  # every checkpoint gets a SHA-256 sidecar, checked on resume
        callbacks=[
            guard,
            checkpoint_callback(cfg.output_dir, every),
            MLflowRunInCheckpoint(logger),
            *([progress_bar("GRPO")] if c.trainer.enable_progress_bar else []),
        ],
        enable_progress_bar=c.trainer.enable_progress_bar,
        enable_model_summary=False,
        log_every_n_steps=1,
        default_root_dir=cfg.output_dir,
    )
    # From here the MLflow run is open: a SIGTERM is recorded and ends the run at the next check (summary,
    # run KILLED, exit 143), never by the default action that would leave the run RUNNING or FINISHED. The
    # engines live from the validation before training to the end of the run, then release their memory.
    with guard.installed(), module.engines_released():
        continues = bool(resume) and getattr(logger, "run_id", None) == resume["run_id"]
        if logger and not continues:  # a new run (also when a resume is sent to another store explicitly)
            logger.log_hyperparams({**flatten_config(cfg), **option_choices()})
            if warm is not None:  # the start the run's gains are measured from
                logger.log_metrics(
                    {"warmstart/accuracy": warm.accuracy, "warmstart/steps": warm.steps}, step=0
                )
        elif continues:
            reopen_run(logger)  # continue the checkpoint's run; its params stay those of its first start
            logger.experiment.set_tag(
                logger.run_id, f"resumed_at_step_{checkpoint.get('global_step')}", ckpt_path
            )
            # the checkpointed step's metrics, in case the process was killed before it logged them
            log_missing_metrics(logger, resume.get("pending"))

        status = "finished"
        recovered: dict[str, float] = {}
        skipped = skipped_validation(checkpoint, val_every) if ckpt_path else None
        try:
            guard.raise_if_received()
            if ckpt_path is None:  # validation accuracy before RL, the reference for the end of the run
                (start,) = trainer.validate(module, datamodule=data, verbose=False)
                module.validation_start = {k: float(v) for k, v in start.items()}
                reopen_run(logger)  # validate() finalized the MLflow run; fit() is still to come
            elif skipped is not None:  # the validation due right after the checkpoint, which fit() would skip
                recovered = _recover_validation(trainer, module, data, ckpt_path, logger, *skipped)
            guard.raise_if_received()  # e.g. during validate()'s last batch, which Lightning does not check
            trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        except SIGTERMException:
            status = "sigterm"
        except SystemExit as exc:  # Lightning turns Ctrl+C into sys.exit(1) after finalizing the loggers
            if trainer.state.status.value != "interrupted":
                raise
            status = "sigint" if exc.code == 1 else "sigterm"
        except KeyboardInterrupt:
            status = "sigint"

        summary = summarize(
            module.history,
            validations=module.validation_history,  # a 0 accuracy at every validation
            task=c.task.name or type(c.task).__name__,  # named in the summary's reward warnings
        )
        summary["status"] = "finished" if status == "finished" else "interrupted"
        val = {
            **recovered,
            **{k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")},
        }
        summary["validation_start"] = dict(module.validation_start)
        if warm is not None:
            summary["warm_start"] = {
                "accuracy": warm.accuracy,
                "eval_size": warm.eval_size,
                "steps": warm.steps,
                "from_cache": warm.from_cache,
                "path": str(warm.path),
            }
        summary["validation"] = val
        summary["wall_time_s"] = time.perf_counter() - started
        if trainer.is_global_zero:
            extra = {
                "warm-start": warm_info,
                "rollout engine": _describe_engine(module.engine),
                "wall time": f"{summary['wall_time_s']:.0f} s",
            }
            for key, value in val.items():
                before = summary["validation_start"].get(key)
                extra[key] = (
                    f"{value:.3f}"
                    if before is None
                    else f"{before:.3f} -> {value:.3f} ({value - before:+.3f})"
                )
            files = write_summary(summary, module.history, cfg.output_dir)
            Path(cfg.output_dir, "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
            files.append(Path(cfg.output_dir, "config.yaml"))
            if logger and hasattr(logger, "run_id"):
                _log_to_mlflow(logger, summary, files)
                if status != "finished":
                    logger.experiment.set_terminated(logger.run_id, "KILLED")
                extra["mlflow"] = (
                    f"{logger._tracking_uri} (experiment {c.logger.experiment_name!r}, run {logger.run_id})"
                )
            extra["outputs"] = str(Path(cfg.output_dir).absolute())
            print(format_summary(summary, extra), flush=True)
        if status != "finished":
            raise SystemExit(EXIT_CODES[status])
    return summary


def _describe_engine(engine: Any) -> str:
    """``TorchRolloutEngine int8 (lean forward)``: the engine class, its precision and, for the torch engine,
    the forward it ran (``model_impl``); "not built" before setup."""
    if engine is None:
        return "not built"
    text = f"{type(engine).__name__} {engine.precision or ''}".strip()
    return f"{text} ({engine.model_impl} forward)" if engine.model_impl else text


def _recover_validation(
    trainer: Any, module: Any, data: Any, ckpt_path: str, logger: Any, step: int, epoch: int
) -> dict[str, float]:
    """Validate the checkpoint's weights and log what the run's record lacks at ``step``.

    A periodic checkpoint is written before the validation due after its step, and ``fit`` resumed from it
    skips that validation (:func:`ais_lightning.trainer.skipped_validation`); a run killed in between would
    miss it. Run without loggers here; only the missing values are logged, where ``fit`` would have.
    """
    from ais_lightning.tracking import log_missing_metrics

    loggers, trainer.loggers = trainer.loggers, []
    try:
        (val,) = trainer.validate(module, datamodule=data, ckpt_path=ckpt_path, verbose=False)
    finally:
        trainer.loggers = loggers
    metrics = {k: float(v) for k, v in val.items()}
    if logger:
        log_missing_metrics(logger, {"step": step, "metrics": {**metrics, "epoch": float(epoch)}})
    return metrics


def _log_to_mlflow(logger: Any, summary: dict[str, Any], files: list[Path]) -> None:
    client = logger.experiment
    for key in ("reward_first", "reward_last", "reward_gain", "kl_k3_mean", "wall_time_s"):
        if key in summary:
            client.log_metric(logger.run_id, f"summary/{key}", float(summary[key]))
    for path in files:
        client.log_artifact(logger.run_id, str(path))


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def _hydra_main(cfg: DictConfig) -> float:
    summary = run(cfg)
    return float(summary.get("reward_last", float("nan")))


def main() -> None:
    """Console-script entry point (``ais-train``)."""
    from ais_lightning.noise import silence_known_noise

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    silence_known_noise()
    _hydra_main()


if __name__ == "__main__":
    main()
