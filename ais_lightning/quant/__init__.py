"""Number formats, scaling recipes, quantized linears and KV-cache quantization.

See :mod:`.formats` (FP8/FP4/INT8 and nested-integer rounding), :mod:`.scaling`
(tensor/channel/token/block/group/MX/NVFP4/E4M3-group scales), :mod:`.recipes` (named recipes),
:mod:`.linear` (QuantLinear), :mod:`.cpu_int8` (the integer GEMMs of the int8 recipe, ``torch._int_mm`` and
fbgemm's, and which one is fast on this CPU), :mod:`.experts` (QuantExperts: fused mixture-of-experts weights per
expert), :mod:`.model` (quantize_model, check_quantizable, switch_recipe: a whole model), :mod:`.kv`, and the Bit-by-Bit pieces
(arXiv 2604.07888): :mod:`.nested` (int8 -> int4 -> int2 views of one quantized weight), :mod:`.ocs`
(rounding-aware outlier channel splitting), :mod:`.schedule` (progressive precision schedule); :mod:`.outliers`
(outlier input channels kept in high precision, calibrated on activations).
"""

from .experts import QuantExperts, fused_experts_unsupported, named_quantized_layers, quantized_layers
from .formats import FORMATS, NumberFormat, get_format, round_to_float_grid
from .kv import fake_quantize_kv, kv_amax, kv_scale_from_amax
from .linear import BACKENDS, QuantLinear, scaled_mm_linear
from .model import (
    DEFAULT_SKIP,
    check_quantizable,
    quantize_model,
    refresh_quantized,
    switch_recipe,
    unquantizable_weights,
)
from .nested import NESTED_FORMATS, nested_format, nested_view, nested_views
from .ocs import OCSSplit, merge_split, ocs_split, rounding_aware_pieces, select_outlier_channels
from .outliers import InputRange, OutlierCalibration, largest_channels, outlier_count
from .recipes import NESTED_INT_RECIPES, RECIPES, QuantRecipe, get_recipe, nested_int_recipe
from .scaling import (
    SCALINGS,
    QuantizedTensor,
    dequantize,
    e4m3_round_up,
    fake_quantize,
    quantize,
    quantize_with_scales,
)
from .schedule import PrecisionSchedule

__all__ = [
    "BACKENDS",
    "DEFAULT_SKIP",
    "FORMATS",
    "InputRange",
    "NESTED_FORMATS",
    "NESTED_INT_RECIPES",
    "RECIPES",
    "SCALINGS",
    "NumberFormat",
    "OCSSplit",
    "OutlierCalibration",
    "PrecisionSchedule",
    "QuantExperts",
    "QuantLinear",
    "QuantRecipe",
    "QuantizedTensor",
    "check_quantizable",
    "dequantize",
    "e4m3_round_up",
    "fake_quantize",
    "fake_quantize_kv",
    "fused_experts_unsupported",
    "get_format",
    "get_recipe",
    "kv_amax",
    "kv_scale_from_amax",
    "largest_channels",
    "merge_split",
    "nested_format",
    "nested_int_recipe",
    "named_quantized_layers",
    "nested_view",
    "nested_views",
    "ocs_split",
    "outlier_count",
    "quantize",
    "quantize_model",
    "quantize_with_scales",
    "quantized_layers",
    "refresh_quantized",
    "round_to_float_grid",
    "rounding_aware_pieces",
    "scaled_mm_linear",
    "select_outlier_channels",
    "switch_recipe",
    "unquantizable_weights",
]
