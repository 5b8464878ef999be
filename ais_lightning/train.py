"""``ais-train``: GRPO on low-precision rollouts, composed with Hydra, tracked in MLflow.

ais-train                                   # the embedded default (tiny Qwen3, int8 rollouts, AIS)
ais-train corrector=tis rollout=fp8         # swap components
ais-train -m corrector=none,tis,mis,ais     # a sweep: four MLflow runs in one experiment
ais-train trainer=fsdp2                     # FSDP2 over 2 CPU processes (gloo)
ais-train --cfg job                         # print the composed config and exit
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from ais_lightning.config import register_configs, validate

register_configs()


def _strategy(cfg: DictConfig) -> Any:
    if cfg.trainer.strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        backend = "gloo" if cfg.trainer.accelerator == "cpu" else None
        return ModelParallelStrategy(
            data_parallel_size=cfg.trainer.devices, tensor_parallel_size=1, process_group_backend=backend
        )
    if cfg.trainer.strategy == "fsdp":
        if not torch.cuda.is_available():
            raise ValueError(
                "trainer.strategy=fsdp (Lightning FSDPStrategy) needs CUDA; on CPU use trainer=fsdp2"
            )
        from lightning.pytorch.strategies import FSDPStrategy

        return FSDPStrategy(auto_wrap_policy={_decoder_layer_class()}, state_dict_type="full")
    return "auto"


def _decoder_layer_class() -> type:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    return Qwen3DecoderLayer


def _resolve_ckpt(ckpt_path: str | None, output_dir: str) -> str | None:
    if ckpt_path != "last":
        return ckpt_path
    last = Path(output_dir) / "checkpoints" / "last.ckpt"
    if not last.exists():
        raise ValueError(f"ckpt_path=last but {last} does not exist")
    return str(last)


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train with a composed config; returns the summary dict."""
    from ais_lightning.build import (
        align_policy,
        build_corrector,
        build_loss,
        build_policy,
        build_task,
        check_engine,
        engine_factory,
    )
    from ais_lightning.modules.grpo import GRPOModule
    from ais_lightning.summary import format_summary, summarize, write_summary
    from ais_lightning.tasks import PromptDataModule
    from ais_lightning.tracking import build_logger, flatten_config, reopen_run
    from ais_lightning.warmstart import warm_start

    # --- cheap checks first: nothing heavy is built before the config is known to be sound.
    validate(cfg)
    check_engine(cfg.rollout)
    task = build_task(cfg.task)
    corrector = build_corrector(cfg.corrector)
    loss = build_loss(
        cfg.algorithm, max_response_length=cfg.algorithm.max_new_tokens, corrector=cfg.corrector
    )
    ckpt_path = _resolve_ckpt(cfg.ckpt_path, cfg.output_dir)
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)

    started = time.perf_counter()
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    policy, tokenizer = build_policy(cfg.policy, cfg.seed)
    warm_info = "off"
    if cfg.warmstart.enabled and ckpt_path is None:
        _, cache_path, cached = warm_start(
            policy,
            tokenizer,
            task,
            cfg.task.name,
            OmegaConf.to_container(cfg.task.params, resolve=True),
            steps=cfg.warmstart.steps,
            batch_size=cfg.warmstart.batch_size,
            lr=cfg.warmstart.lr,
            seed=cfg.seed if cfg.warmstart.seed is None else cfg.warmstart.seed,
            cache_dir=cfg.warmstart.cache_dir,
            progress_bar=cfg.trainer.enable_progress_bar,
        )
        warm_info = f"{'loaded from' if cached else 'trained, cached in'} {cache_path}"

    align_policy(policy, cfg.policy.aligned_quantization, cfg.rollout.precision)

    algo = cfg.algorithm
    module = GRPOModule(
        policy=policy,
        tokenizer=tokenizer,
        task=task,
        corrector=corrector,
        loss=loss,
        engine_factory=engine_factory(cfg.rollout),
        eval_engine_factory=engine_factory(cfg.rollout, precision="fp32")
        if cfg.rollout.engine == "torch"
        else None,
        group_size=algo.group_size,
        max_new_tokens=algo.max_new_tokens,
        temperature=algo.temperature,
        top_p=algo.top_p,
        top_k=algo.top_k,
        advantage_scale=algo.advantage_scale,
        ppo_epochs=algo.ppo_epochs,
        mini_batches=algo.mini_batches,
        lr=algo.lr,
        weight_decay=algo.weight_decay,
        grad_clip=algo.grad_clip,
        kl_coef=algo.kl_coef,
        logprob_chunk_size=cfg.policy.logprob_chunk_size,
        seed=cfg.seed,
    )
    world = cfg.trainer.devices if isinstance(cfg.trainer.devices, int) else 1
    steps = cfg.trainer.max_steps
    data = PromptDataModule(
        task,
        train_size=steps * algo.prompts_per_step * world,
        val_size=cfg.task.val_size,
        batch_size=algo.prompts_per_step,
        seed=cfg.seed,
    )
    logger = build_logger(cfg)
    from lightning.pytorch.callbacks import ModelCheckpoint

    optimizer_steps_per_rollout = algo.ppo_epochs * algo.mini_batches
    every = cfg.trainer.checkpoint_every_n_steps * optimizer_steps_per_rollout or None
    checkpoint = ModelCheckpoint(
        dirpath=Path(cfg.output_dir) / "checkpoints",
        filename="step{step:06d}",  # no "=" in the name: Hydra overrides (ckpt_path=...) take it unquoted
        auto_insert_metric_name=False,
        save_last=True,
        every_n_train_steps=every,
        save_top_k=-1 if every else 1,
    )
    trainer = L.Trainer(
        accelerator=cfg.trainer.accelerator,
        devices=cfg.trainer.devices,
        strategy=_strategy(cfg),
        precision=cfg.trainer.precision,
        max_steps=steps * optimizer_steps_per_rollout,
        val_check_interval=min(algo.val_every_n_steps, steps),
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=logger,
        callbacks=[checkpoint],
        enable_progress_bar=cfg.trainer.enable_progress_bar,
        enable_model_summary=False,
        log_every_n_steps=1,
        default_root_dir=cfg.output_dir,
    )
    if logger:
        logger.log_hyperparams(flatten_config(cfg))
    start_val: dict[str, float] = {}
    if ckpt_path is None:  # validation accuracy before RL, the reference for the end of the run
        (start_val,) = trainer.validate(module, datamodule=data, verbose=False)
        reopen_run(logger)  # validate() finalized the MLflow run; fit() is still to come
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)

    summary = summarize(module.history)
    val = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    summary["validation_start"] = {k: float(v) for k, v in start_val.items()}
    summary["validation"] = val
    summary["wall_time_s"] = time.perf_counter() - started
    if trainer.is_global_zero:
        extra = {"warm-start": warm_info, "wall time": f"{summary['wall_time_s']:.0f} s"}
        for key, value in val.items():
            before = summary["validation_start"].get(key)
            extra[key] = (
                f"{value:.3f}" if before is None else f"{before:.3f} -> {value:.3f} ({value - before:+.3f})"
            )
        files = write_summary(summary, module.history, cfg.output_dir)
        Path(cfg.output_dir, "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        files.append(Path(cfg.output_dir, "config.yaml"))
        if logger and hasattr(logger, "run_id"):
            _log_to_mlflow(logger, summary, files)
            extra["mlflow"] = (
                f"{logger._tracking_uri} (experiment {cfg.logger.experiment_name!r}, run {logger.run_id})"
            )
        extra["outputs"] = str(Path(cfg.output_dir).absolute())
        print(format_summary(summary, extra), flush=True)
    return summary


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
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _hydra_main()


if __name__ == "__main__":
    main()
