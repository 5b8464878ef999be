"""Progressive precision schedule: which quantization recipe is active at a training step.

Bit-by-Bit (Xu et al., ACL 2026, arXiv 2604.07888) trains "stage by stage", reducing the precision
(e.g. 8 -> 4 -> 2 bits) so that each low-bit stage starts from a model already adapted to the stage
before; its nested grids make the 8-bit model's top bits a sensible 4-bit starting point. Here a
schedule is a pure map from the optimizer step to a :class:`QuantRecipe`, plus :meth:`PrecisionSchedule.apply`,
which switches a quantized model's :class:`QuantLinear` layers when the stage changes (fp32 master
weights untouched, :func:`ais_lightning.quant.model.switch_recipe`). The paper's schedule is "block-wise";
its exact form is not available to us: a schedule here acts on every layer, or on the layers whose name
contains one of ``names`` (e.g. ``"layers.0."``), so a trainer can lower one decoder block at a time
with one schedule per block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

from ais_lightning.checks import check_int

from .linear import QuantLinear
from .model import switch_recipe
from .recipes import QuantRecipe, get_recipe, nested_int_recipe


class PrecisionSchedule:
    """Stages ``[(start_step, recipe), ...]``: ``recipe`` is active from ``start_step`` to the next start.

    The first stage starts at step 0; starts are strictly increasing ints. Example:
    ``PrecisionSchedule([(0, "int8_nested"), (1000, "int4"), (2000, "int2")])`` is int8 for steps
    0..999, int4 for 1000..1999 and int2 from 2000 on.
    """

    def __init__(self, stages: Sequence[tuple[int, str | QuantRecipe]], names: Iterable[str] | None = None):
        if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence) or len(stages) == 0:
            raise ValueError(
                f"stages must be a non-empty sequence of (start_step, recipe) pairs, got {stages!r}"
            )
        starts, recipes = [], []
        for i, stage in enumerate(stages):
            if not isinstance(stage, (tuple, list)) or len(stage) != 2:
                raise ValueError(f"stages[{i}] must be a (start_step, recipe) pair, got {stage!r}")
            start, recipe = stage
            if not isinstance(start, int) or isinstance(start, bool) or start < 0:
                raise ValueError(f"stages[{i}] start_step must be an int >= 0, got {start!r}")
            if starts and start <= starts[-1]:
                raise ValueError(f"stage start steps must increase strictly, got {start} after {starts[-1]}")
            starts.append(start)
            recipes.append(get_recipe(recipe))
        if starts[0] != 0:
            raise ValueError(f"the first stage must start at step 0, got {starts[0]}")
        if isinstance(names, str):
            raise ValueError(f"names must be a list of module-name substrings, not a single string {names!r}")
        self.starts: tuple[int, ...] = tuple(starts)
        self.recipes: tuple[QuantRecipe, ...] = tuple(recipes)
        self.names: tuple[str, ...] | None = None if names is None else tuple(names)

    @classmethod
    def progressive(
        cls,
        steps_per_stage: int,
        bits: Sequence[int] = (8, 4, 2),
        weight_only: bool = False,
        ocs_ratio: float = 0.0,
        names: Iterable[str] | None = None,
    ) -> PrecisionSchedule:
        """Nested-integer stages ``bits[0] -> bits[1] -> ...``, each ``steps_per_stage`` steps long (the last
        one open-ended), built with :func:`ais_lightning.quant.recipes.nested_int_recipe`."""
        check_int(steps_per_stage, "steps_per_stage")
        if not bits:
            raise ValueError("bits must name at least one width (8, 4 or 2)")
        return cls(
            [(i * steps_per_stage, nested_int_recipe(b, weight_only, ocs_ratio)) for i, b in enumerate(bits)],
            names=names,
        )

    def __len__(self) -> int:
        return len(self.starts)

    def __repr__(self) -> str:
        stages = ", ".join(f"({s}, {r.name!r})" for s, r in zip(self.starts, self.recipes))
        return f"PrecisionSchedule([{stages}]" + (f", names={list(self.names)})" if self.names else ")")

    def stage_at(self, step: int) -> int:
        """Index of the stage active at ``step`` (an int >= 0)."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        stage = 0
        for i, start in enumerate(self.starts):
            if step >= start:
                stage = i
        return stage

    def recipe_at(self, step: int) -> QuantRecipe:
        """The recipe active at ``step``."""
        return self.recipes[self.stage_at(step)]

    def apply(self, model: nn.Module, step: int, backend: str | None = None) -> bool:
        """Switch ``model``'s selected QuantLinears to the recipe of ``step`` where it differs.

        Returns True when a layer was switched. The model must already be quantized
        (``quantize_model``); ValueError if no selected QuantLinear exists.
        """
        recipe = self.recipe_at(step)
        layers = [
            m
            for n, m in model.named_modules()
            if isinstance(m, QuantLinear) and (self.names is None or any(s in n for s in self.names))
        ]
        if not layers:
            raise ValueError(
                "model has no QuantLinear layers"
                + (f" matching names {list(self.names)}" if self.names else "")
                + "; quantize it first (ais_lightning.quant.quantize_model)"
            )
        if all(m.recipe == recipe and (backend is None or m.backend == backend) for m in layers):
            return False
        switch_recipe(model, recipe, backend=backend, names=self.names)
        return True
