"""The rules between config groups of ``ais-train`` (policy x rollout x loss x corrector x algorithm x trainer).

Each component checks its own arguments when it is built (``ais_lightning.app.build.build_option``); an engine class
checks its arguments in ``check_args`` (run once, when ``ais_lightning.app.build`` makes the run's
:class:`~ais_lightning.rollout.EngineSpec`). What involves two groups or more is here, run once per run by
:func:`check_components` from ``ais_lightning.app.build.validate``, before any model is built; every rule reads only
what the components declare (``RolloutEngine``, ``PolicySpec``, ``PolicyLoss``, ``GRPOSettings``), and every error
is a ValueError naming the config keys. An algorithm adds its own rules in ``GRPOSettings.check_components``
(Sol-RL's), which runs here too.
"""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig

from ais_lightning.correctors import NoCorrection
from ais_lightning.policy.builders import check_aligned_schedule_engine

log = logging.getLogger(__name__)

FP16_TRAINER_PRECISIONS = ("32-true", "32", 32)
"""``trainer.precision`` values a float16 policy trains under: the policy keeps its own fp32 master weights and loss
scale (``ais_lightning.modules.mixed_precision``), so Lightning's precision plugin must not cast or scale again."""


def align_outlier_channels(cfg: DictConfig, engine_args: dict[str, Any]) -> None:
    """With an aligned trainer forward (``policy.aligned_quantization`` or ``policy.aligned_schedule`` set) the
    trainer runs the rollout recipe on every input channel, so the engine keeps no outlier channel in high precision:
    ``rollout.outlier_fraction`` left None becomes 0 in ``engine_args`` (before the engine checks its arguments).
    A positive value is refused by :func:`check_components`."""
    aligned = (
        cfg.policy.get("aligned_quantization") is not None or cfg.policy.get("aligned_schedule") is not None
    )
    if aligned and "outlier_fraction" in engine_args and engine_args["outlier_fraction"] is None:
        engine_args["outlier_fraction"] = 0.0


def check_components(c: Any, cfg: DictConfig) -> None:
    """Every rule between config groups, on the built components ``c`` (``ais_lightning.app.build.Components``: the
    policy spec, the engine specs, the loss, the corrector, the settings) and the composed ``cfg`` (for naming
    targets); ValueError naming the keys."""
    _check_outlier_channels(c)
    _check_family(c, cfg)
    _check_response_length(c)
    _check_router_replay(c, cfg)
    _check_correction(c, cfg)
    _check_integer_gemm(c)
    c.algorithm.check_components(c, cfg)  # the algorithm's own rules (Sol-RL's)
    if c.policy.aligned_quantization is not None and c.trainer.strategy != "auto":
        raise ValueError(
            "policy.aligned_quantization is not supported with sharded strategies yet (trainer.strategy)"
        )
    _check_float16(c)
    _check_head_precision(c, cfg)
    check_aligned_schedule_engine(
        c.policy.aligned_schedule, c.engine
    )  # the engine follows a progressive schedule


def _check_outlier_channels(c: Any) -> None:
    """An aligned trainer forward runs the recipe on every channel: the engine keeps none in high precision."""
    fraction = c.engine.keywords.get("outlier_fraction")
    if c.policy.aligned_quantization is not None and fraction is not None and fraction > 0:
        raise ValueError(
            f"rollout.outlier_fraction={fraction} keeps outlier channels in high precision in the engine, but "
            "policy.aligned_quantization runs the trainer's forward through the recipe on every channel: set "
            "rollout.outlier_fraction=0 (or leave it unset) for the aligned forward to match the engine"
        )


def _check_family(c: Any, cfg: DictConfig) -> None:
    policy_family, engine_family = c.policy.MODEL_FAMILY, c.engine.engine_class.MODEL_FAMILY
    if policy_family != engine_family:
        raise ValueError(
            f"rollout._target_={cfg.rollout._target_} samples {engine_family} models but the policy "
            f"({cfg.policy._target_}) is {policy_family}: pick a rollout option of the policy's family"
        )


def _check_response_length(c: Any) -> None:
    length = c.policy.response_length
    if length is not None and length != c.algorithm.max_new_tokens:
        raise ValueError(
            f"policy.response_length={length} must equal algorithm.max_new_tokens={c.algorithm.max_new_tokens} "
            "(a masked-diffusion policy is warm-started on the canvas length its engine samples)"
        )
    if length is not None and c.warmstart.enabled and c.warmstart.max_new_tokens != length:
        raise ValueError(
            f"warmstart.max_new_tokens={c.warmstart.max_new_tokens} must equal policy.response_length={length} "
            "(the warm start's greedy evaluation samples a canvas of that length)"
        )


def _check_router_replay(c: Any, cfg: DictConfig) -> None:
    if c.policy.router_replay and not c.engine.engine_class.RECORDS_ROUTING:
        raise ValueError(
            f"policy.router_replay=true replays the routing the rollout engine records, but rollout._target_="
            f"{cfg.rollout._target_} records none: use the torch engine (rollout=fp32/bf16/int8/fp8/fp4, ...) or "
            "policy.router_replay=false"
        )


def _check_correction(c: Any, cfg: DictConfig) -> None:
    """One correction of the rollout mismatch, and a mu that a corrector can correct: with truncated sampling the
    ratio is exact only when the engine records the tokens it kept and the policy replays them."""
    own = c.loss.own_correction
    if own and not isinstance(c.corrector, NoCorrection):
        raise ValueError(
            f"{own}; it takes no separate importance weights: set corrector=none "
            f"(got corrector._target_={cfg.corrector._target_})"
        )
    corrected = own or not isinstance(c.corrector, NoCorrection)
    a = c.algorithm
    if not (corrected and a.truncated):
        return
    keys = f"algorithm.top_p={a.top_p}, top_k={a.top_k}, min_p={a.min_p}"
    if not a.replay_support:
        raise ValueError(
            f"{keys} renormalize mu over the tokens the engine keeps; with a corrector on and "
            "algorithm.replay_support=false the policy scores pi over the whole vocabulary and every ratio pi/mu is "
            "off by the kept mass: set algorithm.replay_support=true, or turn truncation off (top_p=1.0, top_k=0, "
            "min_p=0)"
        )
    gap = c.engine.engine_class.support_replay_gap(a.top_k, a.top_p, a.min_p)
    if gap is not None:
        raise ValueError(
            f"{keys} with a corrector on needs the tokens the engine kept, replayed in the trainer, but "
            f"rollout._target_={cfg.rollout._target_} cannot record them: {gap}. Use the torch engine "
            "(rollout=fp32/bf16/int8/fp8/fp4, ...), or turn truncation off (top_p=1.0, top_k=0, min_p=0)"
        )


def _check_integer_gemm(c: Any) -> None:
    checked = c.engine.checked_arguments
    if c.trainer.on_gpu() and checked.get("backend") == "int8" and checked.get("device") != "cpu":
        raise ValueError(
            "rollout.backend=int8 (the integer W8A8 GEMM) runs on CPU; with a GPU trainer pick rollout.backend="
            "emulate, rollout=bf16/fp8_gemm/te_fp8/vllm_fp8, or keep the int8 engine on the CPU with rollout.device=cpu"
        )


def _check_float16(c: Any) -> None:
    """``policy.dtype=float16`` trains on fp32 master weights with a loss scale of its own: on one process or DDP
    (``trainer.strategy=auto``) under Lightning's plain fp32 plugin."""
    if c.policy.dtype != "float16":
        return
    if c.trainer.strategy != "auto":
        raise ValueError(
            f"policy.dtype=float16 (fp32 master weights and a dynamic loss scale) is not supported with "
            f"trainer.strategy={c.trainer.strategy} yet: use trainer.strategy=auto, or policy.dtype=bfloat16"
        )
    if c.trainer.precision not in FP16_TRAINER_PRECISIONS:
        raise ValueError(
            f"policy.dtype=float16 keeps its own fp32 master weights and loss scale; trainer.precision="
            f"{c.trainer.precision} would cast or scale again: leave trainer.precision=32-true"
        )


def _check_head_precision(c: Any, cfg: DictConfig) -> None:
    """With a bfloat16/float16 policy, warn (naming both keys) when the LM head computes in fp32 on one side only.

    Both sides compute the head from the same low-precision weights; in the model dtype both round the logits to
    the same grid, so where the hidden states agree the rounding cancels in log pi - log mu, and an fp32 head on one
    side leaves the other side's rounding in the mismatch. NeMo-RL refuses that configuration
    (``validate_fp32_lm_head_config``: "a one-sided fp32 head increases the generation/training logprob mismatch").
    Measured here (docs/correctors.md, docs/real_model.md): where trainer and engine compute bit-identical hidden
    states (the built-in model through the model's own forward) one side only is worse than neither (3e-6 of KL
    against 0); on SmolLM2, whose engine's hidden states differ by their own rounding, it lands between neither and
    both (bf16: 1.4-1.7e-3 against 1.9-2.2e-3 and 0.9-1.1e-3). Both sides is the best in every measurement, one side
    is not always worse than neither, so this warns rather than refuses. With a float32 policy the trainer's head is
    fp32 anyway and ``rollout.head_dtype=float32`` only brings a bf16/fp16 or quantized engine closer to it.
    """
    dtype = c.policy.dtype
    if dtype == "float32":
        return
    engine_args = c.engine.checked_arguments
    policy_head = c.policy.head_dtype
    engine_head = engine_args.get("head_dtype")
    policy_fp32, engine_fp32 = policy_head == "float32", engine_head == "float32"
    if policy_fp32 == engine_fp32:
        return
    on, off = ("policy", "rollout") if policy_fp32 else ("rollout", "policy")
    fix = f"set {off}.head_dtype=float32 as well"
    if "head_dtype" not in engine_args:
        fix = (
            f"rollout._target_={cfg.rollout._target_} has no rollout.head_dtype option (its head computes in the "
            "model dtype): use the torch engine with rollout.head_dtype=float32"
        )
    log.warning(
        "policy.head_dtype=%s and rollout.head_dtype=%s with policy.dtype=%s: the LM head computes in fp32 on the %s "
        "side only. Both sides in fp32 gave the smallest train/rollout mismatch in every measurement "
        "(docs/correctors.md); one side only leaves the other side's rounding of the logits in the mismatch (worse "
        "than neither where both sides compute the same hidden states; NeMo-RL refuses it). To fix: %s, or unset "
        "%s.head_dtype",
        policy_head, engine_head, dtype, on, fix, on,
    )  # fmt: skip
