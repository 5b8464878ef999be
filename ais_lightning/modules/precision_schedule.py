"""Progressive precision (Bit-by-Bit): the trainer's aligned forward and the rollout engine move through the stages
of ``policy.aligned_schedule`` (e.g. int8 -> int4 -> int2) together."""

from __future__ import annotations

from typing import Any

from ais_lightning.rollout.base import RolloutEngine


def apply_precision_schedule(policy: Any, engine: RolloutEngine | None, step: int) -> dict[str, float]:
    """Move the aligned forward of ``policy`` and ``engine`` to rollout step ``step``'s stage.

    The stage is a function of the step alone, so this is idempotent and a resumed run lands in the right stage.
    The trainer's quantized linears switch recipe (fp32 master weights and optimizer state untouched) and the engine
    switches its precision in place (``engine.set_precision``; ValueError for an engine that cannot). Returns the
    ``quant/stage`` and ``quant/bits`` (weight bits) to log; empty without a schedule.
    """
    if policy.aligned_schedule is None:
        return {}
    from ais_lightning.quant import FORMATS, get_recipe

    recipe = policy.set_aligned_step(step)
    if engine is not None and engine.precision != recipe:
        if not engine.SUPPORTS_SET_PRECISION:
            raise ValueError(
                f"policy.aligned_schedule moves to {recipe!r} at rollout step {step}, but the rollout engine "
                f"{type(engine).__name__} cannot switch its precision (no set_precision)"
            )
        engine.set_precision(recipe)
    return {
        "quant/stage": float(policy.aligned_stage_at(step)),
        "quant/bits": float(FORMATS[get_recipe(recipe).weight_fmt].bits),
    }
