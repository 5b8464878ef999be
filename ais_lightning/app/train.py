"""``ais-train``: GRPO on low-precision rollouts, composed with Hydra, tracked in MLflow.

ais-train                                   # the embedded default (tiny Qwen3, int8 rollouts, AIS)
ais-train corrector=tis rollout=fp8         # swap components
ais-train -m corrector=none,tis,mis,ais     # a sweep: four MLflow runs in one experiment
ais-train trainer=fsdp2                     # FSDP2 over 2 CPU processes (gloo)
ais-train --cfg job                         # print the composed config and exit

Order of a run: compose and validate everything cheap (key-named errors), take the output directory
(one run at a time), check the tracking store and the checkpoint to resume from, then build the policy,
warm-start it, and train. SIGTERM / Ctrl+C end the run with exit code 143 / 130, a summary marked
interrupted and the MLflow run marked KILLED; SIGUSR1 (SLURM's preemption warning) checkpoints, requeues
the SLURM job and exits 138 (:mod:`ais_lightning.app.preemption`). A resume from a checkpoint continues the
same MLflow run, or a new one linked to it when the config changed what shapes training
(:mod:`ais_lightning.app.contract`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from ais_lightning.app.config import register_configs

register_configs()
if not OmegaConf.has_resolver("pid"):
    # Output directories carry the process id: two runs started in the same second never share one. Cached
    # like Hydra's own ${now:}: the parent resolves the sweep directory before it launches the jobs, and Hydra
    # copies the parent config's resolver cache into every job's config (``load_sweep_config``), so jobs run
    # by other processes (joblib, SLURM) get the parent's id, not their own: one sweep directory, one store.
    OmegaConf.register_new_resolver("pid", os.getpid, use_cache=True)
if not OmegaConf.has_resolver("fit_dirname"):  # a sweep job's directory name within the file system's limit
    from ais_lightning.app.rundir import fitting_dirname

    OmegaConf.register_new_resolver("fit_dirname", fitting_dirname)

log = logging.getLogger("ais_lightning.app.train")  # also when run as __main__

EXIT_CODES = {"sigterm": 143, "sigint": 130, "preempted": 128 + int(signal.SIGUSR1)}
"""Exit codes of an interrupted run (128 + the signal number, as shells report them)."""


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train with a composed config; returns the summary dict.

    Cheap checks come first (every component validated, the output directory taken for this run alone and the
    tracking store checked, the checkpoint to resume from found, verified and compared with the config), then
    the policy is built and warm-started (a resume's components checked against the checkpoint's state), and
    the Trainer validates and fits. A run that ends with an error leaves its MLflow run FAILED; a full disk or a
    tracking server that stopped answering ends it with ``SystemExit`` saying what to do
    (:func:`ais_lightning.app.failures.failure_handling`).
    """
    import lightning as L
    import torch

    from ais_lightning.app.build import validate
    from ais_lightning.app.checkpoint_space import check_checkpoint_space
    from ais_lightning.app.contract import ConfigInCheckpoint, ResumeSettings
    from ais_lightning.app.failures import failure_handling
    from ais_lightning.app.noise import silence_known_noise
    from ais_lightning.app.preemption import Preemption
    from ais_lightning.app.resume import Resume
    from ais_lightning.app.rundir import run_directory_lock
    from ais_lightning.app.signals import SigtermGuard
    from ais_lightning.app.store_client import request_budget
    from ais_lightning.app.summary import report_run
    from ais_lightning.app.tracking import build_logger, check_tracking_uri, check_writable
    from ais_lightning.app.trainer import build_trainer, validate_and_fit

    silence_known_noise()  # also in joblib workers, where main() does not run
    with failure_handling(cfg) as opened, contextlib.ExitStack() as held:
        components = validate(cfg)
        check_writable(Path(cfg.output_dir), "output_dir")
        held.enter_context(run_directory_lock(cfg.output_dir))  # one writer per run directory
        resume = Resume.of(cfg)
        check_tracking_uri(
            components.logger, cfg.output_dir, resume.mlflow_run
        )  # the store the run will log to
        settings = components.logger
        held.enter_context(request_budget(settings.request_retries, settings.request_timeout_s))
        if components.trainer.num_threads:
            torch.set_num_threads(components.trainer.num_threads)
        started = time.perf_counter()
        L.seed_everything(cfg.seed, workers=True, verbose=False)
        fresh = resume.ckpt_path is None  # a resume starts from the checkpoint's weights: no warm start
        policy, warm = components.initial_policy(
            cfg.seed, warm=fresh, progress_bar=components.trainer.enable_progress_bar
        )
        module = components.grpo_module(policy, cfg.seed)
        # a warning now, not a full disk at a checkpoint hours later
        check_checkpoint_space(module, components.trainer, cfg.output_dir)
        # a resume that cannot continue is refused before its MLflow run is touched
        resume.check_state(module)
        data = components.prompt_data(
            components.trainer.max_steps, cfg.seed
        )  # a resume may raise max_steps: batch k stays k
        logger = opened["logger"] = build_logger(components.logger, cfg.output_dir, resume=resume.mlflow_run)
        guard, preemption = SigtermGuard(), Preemption(Path(cfg.output_dir) / "checkpoints")
        callbacks = [guard, preemption, ConfigInCheckpoint(cfg), *([ResumeSettings()] if not fresh else [])]
        trainer = build_trainer(
            components.trainer, components.algorithm, cfg.output_dir, logger, policy, callbacks=callbacks
        )
        # From here the MLflow run is open: a SIGTERM or SIGUSR1 is recorded and ends the run at the next check
        # (summary, run KILLED, exit 143 / 138), never by the default action that would leave the run RUNNING or
        # FINISHED. The engines live from the validation before training to the end of the run.
        with guard.installed(), preemption.installed(), module.engines_released():
            resume.open_record(logger, cfg, warm, components.engine)  # the checkpoint's run, or a new one
            status, recovered = validate_and_fit(trainer, module, data, resume, [guard, preemption], logger)
            summary = report_run(
                cfg, components, trainer, module, logger, warm, resume, status, recovered, started, preemption
            )
        if status != "finished":
            raise SystemExit(EXIT_CODES[status])
        return summary


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def _hydra_main(cfg: DictConfig) -> float:
    summary = run(cfg)
    return float(summary.get("reward_last", float("nan")))


def main() -> None:
    """Console-script entry point (``ais-train``)."""
    from ais_lightning.app.noise import silence_known_noise

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    silence_known_noise()
    _hydra_main()


if __name__ == "__main__":
    main()
