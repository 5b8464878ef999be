"""Number formats, scaling recipes, quantized linears and KV-cache quantization.

See :mod:`.formats` (FP8/FP4/INT8 rounding), :mod:`.scaling` (tensor/channel/token/block/group/MX/NVFP4
scales), :mod:`.recipes` (named recipes), :mod:`.linear` (QuantLinear, quantize_model) and :mod:`.kv`.
"""

from .formats import FORMATS, NumberFormat, get_format, round_to_float_grid
from .kv import fake_quantize_kv, kv_amax, kv_scale_from_amax
from .linear import BACKENDS, DEFAULT_SKIP, QuantLinear, quantize_model, refresh_quantized, scaled_mm_linear
from .recipes import RECIPES, QuantRecipe, get_recipe
from .scaling import SCALINGS, QuantizedTensor, dequantize, fake_quantize, quantize

__all__ = [
    "BACKENDS",
    "DEFAULT_SKIP",
    "FORMATS",
    "RECIPES",
    "SCALINGS",
    "NumberFormat",
    "QuantLinear",
    "QuantRecipe",
    "QuantizedTensor",
    "dequantize",
    "fake_quantize",
    "fake_quantize_kv",
    "get_format",
    "get_recipe",
    "kv_amax",
    "kv_scale_from_amax",
    "quantize",
    "quantize_model",
    "refresh_quantized",
    "round_to_float_grid",
    "scaled_mm_linear",
]
