"""A stand-in ``transformer_engine.common.recipe``: the recipe classes ``TERolloutEngine`` builds, with TE's defaults.

Read at Transformer Engine 2.9 and 2.20.0.dev0 (``transformer_engine/common/recipe/__init__.py``): ``MMParams``
(frozen, ``use_split_accumulator=True`` by default), ``QParams``, ``Format``; ``Float8CurrentScaling`` defaults to
``fp8_gemm_fprop = MMParams(use_split_accumulator=False)`` (Hopper's fast FP8 accumulation in the forward GEMM) and
``fp8_format = Format.HYBRID``; ``Float8BlockScaling`` requires the split accumulator in every GEMM;
``MXFP8BlockScaling`` has no ``fp8_gemm_fprop`` (TE's linear then uses ``_2X_ACC_FPROP = False``,
``pytorch/module/base.py``). :func:`te_recipe_modules` gives the modules for ``sys.modules``.
"""

from __future__ import annotations

import importlib.machinery
import types
from dataclasses import dataclass, field
from enum import Enum
from types import ModuleType


class Format(Enum):
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


@dataclass(frozen=True)
class MMParams:
    use_split_accumulator: bool = True


@dataclass(frozen=True)
class QParams:
    power_2_scale: bool = False
    amax_epsilon: float = 0.0


@dataclass
class Float8CurrentScaling:
    fp8_format: Format = Format.HYBRID
    fp8_gemm_fprop: MMParams = field(default_factory=lambda: MMParams(use_split_accumulator=False))
    fp8_gemm_dgrad: MMParams = field(default_factory=lambda: MMParams(use_split_accumulator=True))
    fp8_gemm_wgrad: MMParams = field(default_factory=lambda: MMParams(use_split_accumulator=True))


@dataclass
class Float8BlockScaling:
    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams = field(default_factory=lambda: QParams(power_2_scale=True))
    fp8_quant_fwd_weight: QParams = field(default_factory=lambda: QParams(power_2_scale=True))
    fp8_gemm_fprop: MMParams = field(default_factory=MMParams)

    def __post_init__(self) -> None:
        assert self.fp8_gemm_fprop.use_split_accumulator, "Split accumulator required for fprop."


@dataclass
class MXFP8BlockScaling:
    fp8_format: Format = Format.E4M3


def te_recipe_modules() -> dict[str, ModuleType]:
    """``transformer_engine``, ``transformer_engine.common`` and ``transformer_engine.common.recipe`` for
    ``sys.modules``."""
    modules = {}
    for name in ("transformer_engine", "transformer_engine.common", "transformer_engine.common.recipe"):
        modules[name] = types.ModuleType(name)
        modules[name].__spec__ = importlib.machinery.ModuleSpec(
            name, None
        )  # importlib.util.find_spec finds it
    recipe = modules["transformer_engine.common.recipe"]
    for cls in (Format, MMParams, QParams, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling):
        setattr(recipe, cls.__name__, cls)
    modules["transformer_engine.common"].recipe = recipe
    modules["transformer_engine"].common = modules["transformer_engine.common"]
    return modules
