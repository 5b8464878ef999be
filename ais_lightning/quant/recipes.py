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


def get_recipe(name: str | QuantRecipe) -> QuantRecipe:
    """Look up a recipe by name (a :class:`QuantRecipe` passes through); ValueError lists the names."""
    if isinstance(name, QuantRecipe):
        return name
    if name not in RECIPES:
        raise ValueError(f"unknown quantization recipe {name!r}; known: {sorted(RECIPES)}")
    return RECIPES[name]
