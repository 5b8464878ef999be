"""Named quantization recipes: which format and scaling weights and activations use.

- ``fp8`` = ``fp8_block``: E4M3, weights in 128x128 blocks, activations in 1x128 groups per token
  (DeepSeek-V3, arXiv 2412.19437 section 3.3; FP8-RL, arXiv 2601.18150).
- ``fp8_e5m2_block``: the same blocks in E5M2 (more range, one mantissa bit less).
- ``fp8_tensor``: E4M3, one scale per weight tensor, one dynamic scale per activation tensor.
- ``fp8_channel``: E4M3, weights per output channel, activations per token.
- ``mxfp8`` / ``mxfp4``: OCP Microscaling spec v1.0: 32-element blocks along the reduction dim,
  E8M0 power-of-two scales, E4M3 / E2M1 elements.
- ``nvfp4`` = ``fp4``: E2M1 in 16-element blocks, E4M3 block scales times an FP32 per-tensor scale.
- ``int8``: weights per output channel symmetric, activations per token dynamic symmetric (W8A8,
  as in LLM.int8()/SmoothQuant-style per-token/per-channel schemes, arXiv 2211.10438).

Bit-by-Bit nested integer recipes (Xu et al., ACL 2026, arXiv 2604.07888; :mod:`.nested`, :mod:`.ocs`),
emulated only (``backend="emulate"``: exact fake quantization in fp32 on any device, CPU here; there is
no int4/int2 kernel behind them):

| recipe | weight | activation |
| --- | --- | --- |
| ``int8_nested`` / ``int8_nested_w`` | ``nint8``, groups of 32 along K, E4M3 block scale x FP32 per-tensor scale | ``nint8`` per token, groups of 32, E4M3 x FP32 per-token scale / none (weight-only) |
| ``int4`` / ``int4_w`` | ``nint4``, the same groups (the int4 view of ``int8_nested``'s weight, bit for bit) | ``nint4``, the same / none |
| ``int2`` / ``int2_w`` | ``nint2`` (the int2 view) | ``nint2`` (W2A2) / none (W2A16) |
| ``<name>_ocs`` (all six) | the same, after a rounding-aware outlier channel split of 5% of the input channels | the same, on the duplicated columns |

``*_w`` are weight-only (activations stay in the model dtype). The OCS ratio 0.05 is our choice
(Bit-by-Bit's is not available to us; with the rounding-aware split the weight error is flat from 0.01
to 0.1, see ``docs/quantization.md``): it costs 5% more input channels, which a real kernel pads to a
whole group.
"""

from __future__ import annotations

from dataclasses import dataclass

from .formats import FORMATS
from .scaling import SCALINGS, resolve_block


@dataclass(frozen=True)
class QuantRecipe:
    """Formats and scalings of a linear layer's weight and input activation."""

    name: str
    """Canonical recipe name."""
    weight_fmt: str
    """Element format of the weight (key of ``FORMATS``)."""
    weight_scaling: str
    """Scaling of the weight ``[N, K]`` (one of ``SCALINGS``)."""
    weight_block: tuple[int, int] | None = None
    """Block shape of the weight scaling (None = the scaling's default or not applicable)."""
    act_fmt: str | None = None
    """Element format of the input activation; None = weight-only quantization."""
    act_scaling: str = "token"
    """Scaling of the activation ``[..., K]`` (dynamic: computed on every forward)."""
    act_block: tuple[int, int] | None = None
    """Block shape of the activation scaling."""
    ocs_ratio: float = 0.0
    """Fraction of the input channels split by rounding-aware outlier channel splitting at weight-sync
    time (:func:`ais_lightning.quant.ocs.ocs_split`); 0 = off. Needs an integer ``weight_fmt``."""

    def __post_init__(self) -> None:
        for field, fmt in (("weight_fmt", self.weight_fmt), ("act_fmt", self.act_fmt)):
            if fmt is not None and fmt not in FORMATS:
                raise ValueError(f"{field} must be one of {sorted(FORMATS)}, got {fmt!r}")
        for field, scaling, fmt, block in (
            ("weight_scaling", self.weight_scaling, self.weight_fmt, self.weight_block),
            ("act_scaling", self.act_scaling, self.act_fmt, self.act_block),
        ):
            if scaling not in SCALINGS:
                raise ValueError(f"{field} must be one of {list(SCALINGS)}, got {scaling!r}")
            if scaling == "nvfp4" and fmt not in (None, "fp4_e2m1"):
                raise ValueError(f"{field}='nvfp4' needs format 'fp4_e2m1', got {fmt!r}")
            resolve_block(scaling, block, 1, 1)  # raises ValueError on a block that contradicts the scaling
        if self.act_fmt is not None and self.act_scaling == "channel":
            raise ValueError("act_scaling='channel' would scale activations per batch row; use 'token'")
        if isinstance(self.ocs_ratio, bool) or not isinstance(self.ocs_ratio, (int, float)):
            raise ValueError(f"ocs_ratio must be a number in [0, 1), got {self.ocs_ratio!r}")
        if not 0.0 <= self.ocs_ratio < 1.0:
            raise ValueError(f"ocs_ratio must be in [0, 1), got {self.ocs_ratio}")
        if self.ocs_ratio > 0 and not FORMATS[self.weight_fmt].is_uniform:
            raise ValueError(
                f"ocs_ratio > 0 needs an integer weight_fmt (int8, nint8, nint4, nint2) for the rounding-aware "
                f"split, got {self.weight_fmt!r}"
            )

    @property
    def weight_only(self) -> bool:
        return self.act_fmt is None


def _fp8_block(name: str, fmt: str) -> QuantRecipe:
    return QuantRecipe(name, fmt, "block", (128, 128), fmt, "group", (1, 128))


RECIPES: dict[str, QuantRecipe] = {
    "fp8_block": _fp8_block("fp8_block", "fp8_e4m3"),
    "fp8_e5m2_block": _fp8_block("fp8_e5m2_block", "fp8_e5m2"),
    "fp8_tensor": QuantRecipe("fp8_tensor", "fp8_e4m3", "tensor", None, "fp8_e4m3", "tensor"),
    "fp8_channel": QuantRecipe("fp8_channel", "fp8_e4m3", "channel", None, "fp8_e4m3", "token"),
    "mxfp8": QuantRecipe("mxfp8", "fp8_e4m3", "mx", (1, 32), "fp8_e4m3", "mx", (1, 32)),
    "mxfp4": QuantRecipe("mxfp4", "fp4_e2m1", "mx", (1, 32), "fp4_e2m1", "mx", (1, 32)),
    "nvfp4": QuantRecipe("nvfp4", "fp4_e2m1", "nvfp4", (1, 16), "fp4_e2m1", "nvfp4", (1, 16)),
    "int8": QuantRecipe("int8", "int8", "channel", None, "int8", "token"),
}
"""Recipes by name; the aliases ``fp8`` (-> ``fp8_block``) and ``fp4`` (-> ``nvfp4``) map to the same objects."""
RECIPES["fp8"] = RECIPES["fp8_block"]
RECIPES["fp4"] = RECIPES["nvfp4"]

INT_GROUP = (1, 32)
"""Group (block) of the nested integer recipes: 32 elements along K, the OCP MX block size."""
DEFAULT_OCS_RATIO = 0.05
"""Fraction of input channels the ``*_ocs`` recipes split."""


def nested_int_recipe(
    bits: int, weight_only: bool = False, ocs_ratio: float = 0.0, name: str | None = None
) -> QuantRecipe:
    """A nested-integer recipe at ``bits`` (8, 4, 2): ``nint<bits>`` in groups of 32 with E4M3 scales.

    Weights: ``group_e4m3`` (FP32 per-tensor second level); activations (unless ``weight_only``):
    ``token_group_e4m3`` (FP32 per-token second level, so no token depends on the rest of the batch).
    The default name follows the table of the module docstring.
    """
    if bits not in (8, 4, 2):
        raise ValueError(f"bits must be 8, 4 or 2, got {bits!r}")
    fmt = f"nint{bits}"
    if name is None:
        name = ("int8_nested" if bits == 8 else f"int{bits}") + ("_w" if weight_only else "")
        name += "_ocs" if ocs_ratio > 0 else ""
    act = (None, "token", None) if weight_only else (fmt, "token_group_e4m3", INT_GROUP)
    return QuantRecipe(name, fmt, "group_e4m3", INT_GROUP, *act, ocs_ratio=ocs_ratio)


def _nested_int_recipes() -> dict[str, QuantRecipe]:
    out = {}
    for ocs in (False, True):
        for bits in (8, 4, 2):
            for weight_only in (False, True):
                recipe = nested_int_recipe(bits, weight_only, DEFAULT_OCS_RATIO if ocs else 0.0)
                out[recipe.name] = recipe
    return out


_NESTED_INT = _nested_int_recipes()
RECIPES.update(_NESTED_INT)
NESTED_INT_RECIPES: tuple[str, ...] = tuple(_NESTED_INT)
"""Names of the nested integer recipes (emulated): ``int8_nested``, ``int8_nested_w``, ``int4``, ``int4_w``,
``int2``, ``int2_w`` and the same six with ``_ocs``."""


def get_recipe(name: str | QuantRecipe) -> QuantRecipe:
    """Look up a recipe by name (a :class:`QuantRecipe` passes through); ValueError lists the names."""
    if isinstance(name, QuantRecipe):
        return name
    if name not in RECIPES:
        raise ValueError(f"unknown quantization recipe {name!r}; known: {sorted(RECIPES)}")
    return RECIPES[name]
