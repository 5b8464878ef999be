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

from omegaconf import DictConfig, OmegaConf

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


SEED_MAX = 2**32 - 1
"""The largest seed numpy (and so Lightning's ``seed_everything``) accepts; the smallest is 0."""


def check_seeds(cfg: DictConfig) -> None:
    """``seed`` and ``warmstart.seed`` are ints from 0 to :data:`SEED_MAX` (ValueError naming the key; numpy's
    own error named neither the key nor the run)."""
    for key in ("seed", "warmstart.seed"):
        value = OmegaConf.select(cfg, key, default=None)
        if value is None and key != "seed":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= SEED_MAX:
            raise ValueError(
                f"{key} must be an int from 0 to {SEED_MAX} (the seeds numpy, torch and Lightning accept), "
                f"got {value!r}"
            )


def check_components(components: Any, cfg: DictConfig) -> None:
    """Every rule between config groups, on the built components ``components`` (``ais_lightning.app.build.Components``: the
    policy spec, the engine specs, the loss, the corrector, the settings) and the composed ``cfg`` (for naming
    targets); ValueError naming the keys."""
    _check_outlier_channels(components)
    _check_family(components, cfg)
    _check_response_length(components)
    _check_router_replay(components, cfg)
    _check_correction(components, cfg)
    _check_integer_gemm(components)
    _check_staleness(components)
    components.algorithm.check_components(components, cfg)  # the algorithm's own rules (Sol-RL's)
    if components.policy.aligned_quantization is not None and components.trainer.strategy != "auto":
        raise ValueError(
            "policy.aligned_quantization is not supported with sharded strategies yet (trainer.strategy)"
        )
    _check_float16(components)
    _check_head_precision(components, cfg)
    check_aligned_schedule_engine(
        components.policy.aligned_schedule, components.engine
    )  # the engine follows a progressive schedule


def _check_outlier_channels(components: Any) -> None:
    """An aligned trainer forward runs the recipe on every channel: the engine keeps none in high precision."""
    fraction = components.engine.keywords.get("outlier_fraction")
    if components.policy.aligned_quantization is not None and fraction is not None and fraction > 0:
        raise ValueError(
            f"rollout.outlier_fraction={fraction} keeps outlier channels in high precision in the engine, but "
            "policy.aligned_quantization runs the trainer's forward through the recipe on every channel: set "
            "rollout.outlier_fraction=0 (or leave it unset) for the aligned forward to match the engine"
        )


def _check_family(components: Any, cfg: DictConfig) -> None:
    policy_family, engine_family = components.policy.MODEL_FAMILY, components.engine.engine_class.MODEL_FAMILY
    if policy_family != engine_family:
        raise ValueError(
            f"rollout._target_={cfg.rollout._target_} samples {engine_family} models but the policy "
            f"({cfg.policy._target_}) is {policy_family}: pick a rollout option of the policy's family"
        )


def _check_response_length(components: Any) -> None:
    length = components.policy.response_length
    if length is not None and length != components.algorithm.max_new_tokens:
        raise ValueError(
            f"policy.response_length={length} must equal algorithm.max_new_tokens={components.algorithm.max_new_tokens} "
            "(a masked-diffusion policy is warm-started on the canvas length its engine samples)"
        )
    if length is not None and components.warmstart.enabled and components.warmstart.max_new_tokens != length:
        raise ValueError(
            f"warmstart.max_new_tokens={components.warmstart.max_new_tokens} must equal policy.response_length={length} "
            "(the warm start's greedy evaluation samples a canvas of that length)"
        )


def _check_router_replay(components: Any, cfg: DictConfig) -> None:
    if components.policy.router_replay and not components.engine.engine_class.RECORDS_ROUTING:
        raise ValueError(
            f"policy.router_replay=true replays the routing the rollout engine records, but rollout._target_="
            f"{cfg.rollout._target_} records none: use the torch engine (rollout=fp32/bf16/int8/fp8/fp4, ...) or "
            "policy.router_replay=false"
        )


def _check_correction(components: Any, cfg: DictConfig) -> None:
    """One correction of the rollout mismatch, and a mu that a corrector can correct: with truncated sampling the
    ratio is exact only when the engine records the tokens it kept and the policy replays them."""
    own = components.loss.own_correction
    if own and not isinstance(components.corrector, NoCorrection):
        raise ValueError(
            f"{own}; it takes no separate importance weights: set corrector=none "
            f"(got corrector._target_={cfg.corrector._target_})"
        )
    corrected = own or not isinstance(components.corrector, NoCorrection)
    a = components.algorithm
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
    gap = components.engine.engine_class.support_replay_gap(a.top_k, a.top_p, a.min_p)
    if gap is not None:
        raise ValueError(
            f"{keys} with a corrector on needs the tokens the engine kept, replayed in the trainer, but "
            f"rollout._target_={cfg.rollout._target_} cannot record them: {gap}. Use the torch engine "
            "(rollout=fp32/bf16/int8/fp8/fp4, ...), or turn truncation off (top_p=1.0, top_k=0, min_p=0)"
        )


def _check_integer_gemm(components: Any) -> None:
    """A CPU-only integer GEMM beside a GPU trainer is refused; int8 rollouts left to run emulated on a CPU with no
    integer GEMM are warned about (slower than fp32 rollouts there)."""
    from ais_lightning.quant.cpu_int8 import INTEGER_BACKENDS, cpu_int8_isa

    checked = components.engine.checked_arguments
    backend = checked.get("backend")
    chosen = components.engine.keywords.get("backend") is not None
    on_gpu = components.trainer.on_gpu()
    if checked.get("precision") == "int8" and backend == "emulate" and not chosen and not on_gpu:
        log.warning(
            "rollout.precision=int8 runs emulated (exact numerics, slower than fp32 rollouts): this CPU has no "
            "integer GEMM torch runs fast (int8 kernels: %s; docs/engines.md)",
            cpu_int8_isa(),
        )
    if on_gpu and backend in INTEGER_BACKENDS and checked.get("device") != "cpu":
        raise ValueError(
            f"rollout.backend={backend} (the integer W8A8 GEMM, the CPU's default for rollout.precision=int8) runs on "
            "CPU; with a GPU trainer pick rollout.backend=emulate, rollout=bf16/fp8_gemm/te_fp8/vllm_fp8, or keep "
            "the int8 engine on the CPU with rollout.device=cpu"
        )


def _check_float16(components: Any) -> None:
    """``policy.dtype=float16`` trains on fp32 master weights with a loss scale of its own: on one process or DDP
    (``trainer.strategy=auto``) under Lightning's plain fp32 plugin."""
    if components.policy.dtype != "float16":
        return
    if components.trainer.strategy != "auto":
        raise ValueError(
            f"policy.dtype=float16 (fp32 master weights and a dynamic loss scale) is not supported with "
            f"trainer.strategy={components.trainer.strategy} yet: use trainer.strategy=auto, or policy.dtype=bfloat16"
        )
    if components.trainer.precision not in FP16_TRAINER_PRECISIONS:
        raise ValueError(
            f"policy.dtype=float16 keeps its own fp32 master weights and loss scale; trainer.precision="
            f"{components.trainer.precision} would cast or scale again: leave trainer.precision=32-true"
        )


def _check_head_precision(components: Any, cfg: DictConfig) -> None:
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
    dtype = components.policy.dtype
    if dtype == "float32":
        return
    engine_args = components.engine.checked_arguments
    policy_head = components.policy.head_dtype
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


def _check_staleness(components: Any) -> None:
    """Asynchronous GRPO's rules between groups: an adaptive bound needs a target or a loss that declares its trust
    region; rollout workers generate autoregressive, dense rollouts (their chunks carry no routing or extras)."""
    algorithm, loss = components.algorithm, components.loss
    if algorithm.adaptive_staleness and algorithm.staleness_chi2_target is None and not loss.trust_region:
        raise ValueError(
            "algorithm.adaptive_staleness=true with algorithm.staleness_chi2_target=null takes the loss's trust region "
            f"squared, and loss ({type(loss).__name__}) declares none: set algorithm.staleness_chi2_target"
        )
    if components.workers is None:
        return
    trainer = components.trainer
    if trainer.strategy != "auto" or trainer.world_size > 1:
        raise ValueError(
            "workers=ray with several trainer processes (trainer.strategy / devices / num_nodes) is not supported yet: "
            "each rank would start its own workers; train in one process (trainer=cpu) or use the in-process engine"
        )
    if components.policy.MODEL_FAMILY != "autoregressive" or components.policy.router_replay:
        raise ValueError(
            "workers=ray runs autoregressive, dense rollouts: a masked-diffusion policy (policy.MODEL_FAMILY) or "
            "policy.router_replay=true needs the in-process engine (workers=null)"
        )
