"""Build the training components from a composed ``TrainConfig`` (see ``ais_lightning.config``).

Each builder is small and usable on its own, e.g. ``build_corrector(cfg.corrector)`` in a
user's own LightningModule.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from ais_lightning.correctors import build_corrector as _corrector_by_name
from ais_lightning.losses import GRPOLoss, TBPOLoss
from ais_lightning.policy import Policy
from ais_lightning.rollout.factory import build_engine, validate_engine_config
from ais_lightning.tasks import Task, get_task

_CORRECTOR_FIELDS = {
    "none": (),
    "tis": ("level", "c_high", "c_low"),
    "mis": ("level", "c_low", "c_high", "veto"),
    "ais": (
        "c",
        "kappa",
        "alpha",
        "beta",
        "lambda_min",
        "lambda_max",
        "use_reliability",
        "use_severity",
        "use_variance",
        "ema_decay",
        "fixed_lambda",
    ),
}


def build_corrector(cfg: DictConfig) -> torch.nn.Module:
    """The corrector named by ``cfg.name`` with the fields that apply to it.

    ``qarl`` corrects in its loss (TBPO's trust band) and by aligning the trainer's forward, so its
    per-token corrector is ``NoCorrection`` (which still reports the raw ratio statistics).
    """
    if cfg.name == "qarl":
        return _corrector_by_name("none")
    fields = _CORRECTOR_FIELDS.get(cfg.name)
    if fields is None:
        raise ValueError(f"corrector.name={cfg.name!r} is not one of {list(_CORRECTOR_FIELDS)}")
    kwargs = {k: cfg[k] for k in fields}
    if cfg.name == "mis" and kwargs["c_low"] is None:
        kwargs["c_low"] = 1.0 / kwargs["c_high"]
    return _corrector_by_name(cfg.name, **kwargs)


def build_policy(cfg: DictConfig, seed: int) -> tuple[Policy, Any]:
    """(policy, tokenizer): the built-in tiny Qwen3 or a local Hugging Face directory."""
    dtype = getattr(torch, cfg.dtype)
    if cfg.name == "tiny_qwen3":
        from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3

        overrides = OmegaConf.to_container(cfg.overrides, resolve=True) if cfg.overrides else {}
        model = build_tiny_qwen3(seed=seed, **overrides).to(dtype)
        return Policy(model), build_char_tokenizer()
    from transformers import AutoTokenizer

    policy = Policy.from_pretrained(cfg.path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(cfg.path, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return policy, tokenizer


def align_policy(policy: Policy, aligned: str | None, rollout_precision: str) -> Policy:
    """QaRL: quantize the trainer's linears with the rollout's recipe (emulated, straight-through grads).

    ``aligned="rollout"`` takes the recipe the torch engine uses for ``rollout_precision``. State-dict
    keys are unchanged, so weight sync and checkpoints work as before.
    """
    if aligned is None:
        return policy
    from ais_lightning.quant import get_recipe, quantize_model

    recipe = get_recipe(rollout_precision if aligned == "rollout" else aligned)
    quantize_model(policy.model, recipe, backend="emulate")
    return policy


def build_task(cfg: DictConfig) -> Task:
    params = OmegaConf.to_container(cfg.params, resolve=True) if cfg.params else {}
    try:
        return get_task(cfg.name, **params)
    except TypeError as err:
        raise ValueError(f"task.params do not fit task {cfg.name!r}: {err}") from err


def engine_kwargs(cfg: DictConfig) -> dict[str, Any]:
    kwargs = dict(OmegaConf.to_container(cfg.engine_kwargs, resolve=True) if cfg.engine_kwargs else {})
    if cfg.kv_cache_dtype is not None:
        kwargs["kv_cache_dtype"] = cfg.kv_cache_dtype
    return kwargs


def check_engine(cfg: DictConfig) -> None:
    """Fail at config time for an unknown or uninstalled engine/precision (nothing heavy is built)."""
    validate_engine_config(cfg.engine, cfg.precision, **engine_kwargs(cfg))


def engine_factory(cfg: DictConfig, precision: str | None = None):
    """A callable ``model -> RolloutEngine`` for ``cfg`` (precision overridable, e.g. fp32 for evaluation)."""
    return functools.partial(
        build_engine, cfg.engine, precision=precision or cfg.precision, **engine_kwargs(cfg)
    )


def build_loss(
    cfg: DictConfig, max_response_length: int, corrector: DictConfig | None = None
) -> torch.nn.Module:
    """GRPO's clipped surrogate, or TBPO when the corrector is QaRL."""
    if corrector is not None and corrector.name == "qarl":
        return TBPOLoss(
            epsilon_low=corrector.tbpo_epsilon_low,
            epsilon_high=corrector.tbpo_epsilon_high,
            dual_clip=corrector.tbpo_dual_clip,
            band_low=corrector.band_low,
            band_high=corrector.band_high,
        )
    return GRPOLoss(
        epsilon_low=cfg.epsilon_low,
        epsilon_high=cfg.epsilon_high,
        dual_clip=cfg.dual_clip,
        kl_coef=cfg.kl_coef,
        entropy_coef=cfg.entropy_coef,
        aggregation=cfg.aggregation,
        max_response_length=max_response_length,
        mode=cfg.mode,
    )
