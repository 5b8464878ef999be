"""The trainer's rollout-aligned forward: QaRL's quantized linears and Bit-by-Bit's progressive schedule.

QaRL (arXiv 2604.07853) runs the trainer's linears through the rollout's quantization recipe (emulated, with
straight-through gradients to the fp32 master weights); Bit-by-Bit (arXiv 2604.07888) moves that recipe along
a schedule of rollout steps (``((start_step, recipe), ...)``, e.g. int8 -> int4 -> int2). The options are
checked here, and the recipe of a step is a function of the schedule and the step alone, so a resumed run lands
in the right stage. :class:`ais_lightning.policy.Policy` keeps the options and calls these functions.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = [
    "aligned_options",
    "check_aligned_quantization",
    "check_aligned_schedule",
    "quantize_aligned",
    "schedule_recipe",
    "schedule_stage",
    "switch_aligned",
]


def check_aligned_quantization(recipe: str) -> None:
    """Raise ValueError unless ``recipe`` names an ``ais_lightning.quant`` quantization recipe."""
    from ais_lightning.quant.recipes import RECIPES

    if recipe not in RECIPES:
        raise ValueError(
            f"aligned_quantization={recipe!r} is not a quantization recipe (QaRL's aligned forward needs a "
            f"quantized rollout precision); known recipes: {sorted(RECIPES)}"
        )


def check_aligned_schedule(
    stages: Any, aligned_quantization: str | None = None
) -> tuple[tuple[int, str], ...]:
    """Validate a progressive aligned-quantization schedule; returns it as ``((start, recipe), ...)``.

    ``stages``: ``[[0, "int8_nested"], [N1, "int4"], [N2, "int2"]]`` (pairs as lists or tuples; Hydra's
    ``ListConfig`` works): recipe ``r`` runs from rollout step ``start`` to the next stage's start; starts
    are ints strictly increasing from 0; every recipe names an ``ais_lightning.quant`` recipe.
    ``aligned_quantization``, when given, must be the first stage's recipe (the forward before any step).
    """
    from ais_lightning.quant import RECIPES, PrecisionSchedule, get_recipe

    if isinstance(stages, (str, bytes)) or not hasattr(stages, "__len__") or len(stages) == 0:
        raise ValueError(
            f"aligned_schedule must be a non-empty list of [start_step, recipe] pairs, got {stages!r}"
        )
    pairs = []
    for i, stage in enumerate(stages):
        if isinstance(stage, (str, bytes)) or not hasattr(stage, "__len__") or len(stage) != 2:
            raise ValueError(f"aligned_schedule[{i}] must be a [start_step, recipe] pair, got {stage!r}")
        start, recipe = stage[0], stage[1]
        if not isinstance(recipe, str) or recipe not in RECIPES:
            raise ValueError(
                f"aligned_schedule[{i}] recipe {recipe!r} is not a quantization recipe; known: {sorted(RECIPES)}"
            )
        pairs.append((start, recipe))
    try:
        PrecisionSchedule(pairs)  # start steps: ints >= 0, strictly increasing, the first at 0
    except ValueError as err:
        raise ValueError(f"aligned_schedule: {err}") from err
    if aligned_quantization is not None:
        check_aligned_quantization(aligned_quantization)
        if get_recipe(aligned_quantization) != get_recipe(pairs[0][1]):
            raise ValueError(
                f"aligned_quantization={aligned_quantization!r} contradicts aligned_schedule, whose first stage "
                f"runs {pairs[0][1]!r}: the aligned forward starts at the first stage's recipe (with "
                "corrector=qarl, aligned_quantization follows rollout.precision: set the rollout to the first "
                "stage's precision)"
            )
    return tuple(pairs)


def aligned_options(
    aligned_quantization: str | None, aligned_schedule: Any
) -> tuple[str | None, tuple[tuple[int, str], ...] | None]:
    """``(aligned_quantization, aligned_schedule)`` checked (ValueError otherwise) as a policy keeps them: with a
    schedule, ``aligned_quantization`` is its first stage's recipe and the schedule ``((start, recipe), ...)``."""
    if aligned_quantization is not None:
        check_aligned_quantization(aligned_quantization)
    if aligned_schedule is not None:
        aligned_schedule = check_aligned_schedule(aligned_schedule, aligned_quantization)
        aligned_quantization = aligned_schedule[0][1]
    return aligned_quantization, aligned_schedule


def quantize_aligned(model: nn.Module, recipe: str | None) -> bool:
    """Run ``model``'s linears through the quantization ``recipe`` (emulated, straight-through gradients), unless
    some already are (idempotent); returns whether the forward is aligned (False and nothing done for None)."""
    if recipe is None:
        return False
    from ais_lightning.quant import QuantLinear, get_recipe, quantize_model

    if not any(isinstance(m, QuantLinear) for m in model.modules()):
        quantize_model(model, get_recipe(recipe), backend="emulate")
    return True


def schedule_stage(schedule: tuple[tuple[int, str], ...] | None, step: int) -> int:
    """Index of the ``schedule`` stage active at rollout step ``step`` (0 without a schedule).

    >>> schedule_stage(((0, "int8"), (10, "int4")), 9), schedule_stage(((0, "int8"), (10, "int4")), 10)
    (0, 1)
    """
    if schedule is None:
        return 0
    from ais_lightning.quant import PrecisionSchedule

    return PrecisionSchedule(schedule).stage_at(step)


def schedule_recipe(
    recipe: str | None, schedule: tuple[tuple[int, str], ...] | None, step: int
) -> str | None:
    """The recipe name the aligned forward runs at rollout step ``step``: ``recipe`` without a schedule (None: no
    aligned forward), else the stage's.

    >>> schedule_recipe("int8", ((0, "int8"), (10, "int4")), 12), schedule_recipe("fp4", None, 12)
    ('int4', 'fp4')
    """
    if schedule is None:
        return recipe
    return schedule[schedule_stage(schedule, step)][1]


def switch_aligned(model: nn.Module, recipe: str) -> None:
    """Switch every quantized linear of ``model`` to ``recipe`` in place (:func:`ais_lightning.quant.switch_recipe`;
    nothing when they all run it already): the fp32 master weights, the state dict and the optimizer state are
    untouched."""
    from ais_lightning.quant import QuantLinear, get_recipe, switch_recipe

    target = get_recipe(recipe)
    if any(m.recipe != target for m in model.modules() if isinstance(m, QuantLinear)):
        switch_recipe(model, target, backend="emulate")
