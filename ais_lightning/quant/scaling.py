"""Scaling recipes: how a tensor is cut into blocks that share one scale, and the scales themselves.

Every scaling works on a 2-D view ``[M, K]`` of the tensor (``K`` = last dim, ``M`` = all leading
dims flattened; ``"channel"`` uses ``[shape[0], rest]``, i.e. one scale per output channel of a
weight ``[N, K]``) cut into blocks of shape ``(bm, bk)``:

| scaling  | block            | scale per block                                                  |
| -------- | ---------------- | ---------------------------------------------------------------- |
| tensor   | (M, K)           | amax / fmt.max                                                    |
| channel  | (1, K) on [N, .] | amax / fmt.max (per output channel)                              |
| token    | (1, K)           | amax / fmt.max (per token, dynamic)                              |
| block    | (128, 128)       | amax / fmt.max (DeepSeek-V3 weights, arXiv 2412.19437 sec. 3.3)   |
| group    | (1, 128)         | amax / fmt.max (DeepSeek-V3 / FP8-RL arXiv 2601.18150 activations)|
| mx       | (1, 32)          | E8M0 2^(floor(log2 amax) - emax_elem) (OCP MX spec v1.0 sec. 6.3)   |
| nvfp4    | (1, 16)          | E4M3 block scale times an FP32 per-tensor scale (NVIDIA NVFP4)     |
| group_e4m3       | (1, 32)  | any format: E4M3 block scale times an FP32 per-tensor scale        |
| token_group_e4m3 | (1, 32)  | any format: E4M3 block scale times an FP32 per-row (token) scale   |

``amax / fmt.max`` above reads ``amax / fmt.scale_max`` for nested integer formats (``2^(b-1)``, the
edge of their top cell; see :mod:`.formats`). The two ``*_e4m3`` scalings are the micro-scaled groups
of Bit-by-Bit (Xu et al., ACL 2026, arXiv 2604.07888: "microscaling groups with E4M3 scales, in
alignment with OCP/NVIDIA standards"); their group size is 32, the OCP MX block (the paper's exact
group size is not available to us; any ``block=(1, n)`` works). The per-tensor / per-row FP32 scale
only keeps every block scale inside E4M3's range (2^-9 .. 448); for activations it is per row so that
one token's quantization never depends on the other tokens of the batch. An all-zero block gets the
E4M3 block scale 0 (an exact E4M3 value) and decodes to exact zeros, which matters for nested ints
(they have no zero level); a non-zero block's scale is floored at 2^-9 as in NVFP4. Nested ints get the
scale 0 for an all-zero block under the one-level scalings too (not under ``mx``: E8M0 has no zero,
such a block decodes to +-2^-128).

Blocks that do not divide the view are zero-padded before the amax, so the last partial block has
its own correct scale (zeros never raise an amax). Otherwise an all-zero block gets a finite positive
scale (the floor :data:`SCALE_FLOOR`) and quantizes to zeros. Values beyond the format max after scaling
saturate (clamp). Non-finite inputs raise ValueError naming the tensor (``check_finite=True``,
the default); with ``check_finite=False`` (used on activations in the forward pass to avoid a
device sync), a non-finite value turns its block into NaN, as it would poison an fp32 matmul.

Everything is vectorized over blocks (reshape to ``[Mb, bm, Kb, bk]``): no Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .formats import FORMATS, NumberFormat, get_format

SCALINGS = ("tensor", "channel", "token", "block", "group", "mx", "nvfp4", "group_e4m3", "token_group_e4m3")
"""Known scaling names."""

SCALE_FLOOR = 1e-12
"""Smallest scale used (all-zero or tiny blocks), so that x / scale is never 0/0."""

DEFAULT_BLOCKS = {
    "block": (128, 128),
    "group": (1, 128),
    "mx": (1, 32),
    "nvfp4": (1, 16),
    "group_e4m3": (1, 32),
    "token_group_e4m3": (1, 32),
}
"""Default block shapes of the blocked scalings."""

E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127
"""Exponent range of the E8M0 scale (OCP MX spec v1.0 section 5.4; 0xFF = NaN is never produced)."""

_E4M3 = FORMATS["fp8_e4m3"]
_E4M3_MIN_SUBNORMAL = 2.0**-9


@dataclass
class QuantizedTensor:
    """Quantized data plus the scales needed to read it back (:func:`dequantize`)."""

    data: torch.Tensor
    """Same shape as the input; dtype ``fmt.dtype`` (float8 / int8) or float32 holding exact FP4 values."""
    scale: torch.Tensor
    """``[Mb, Kb]`` float32, one scale per block of the 2-D view (for nvfp4: the E4M3 block scales)."""
    fmt: str
    """Element format name (key of ``FORMATS``)."""
    scaling: str
    """Scaling name (one of ``SCALINGS``)."""
    block: tuple[int, int]
    """Block shape ``(bm, bk)`` on the 2-D view."""
    dtype: torch.dtype
    """dtype of the original tensor; :func:`dequantize` returns it."""
    tensor_scale: torch.Tensor | None = None
    """Second-level FP32 scale that multiplies the block scales: 0-d per tensor (``nvfp4``,
    ``group_e4m3``) or ``[Mb, 1]`` per row (``token_group_e4m3``); None for the other scalings."""

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def effective_scale(self) -> torch.Tensor:
        """Per-block scale actually applied (``scale * tensor_scale`` for two-level scalings).  # [Mb, Kb]"""
        return self.scale if self.tensor_scale is None else self.scale * self.tensor_scale


def _view_2d(x: torch.Tensor, scaling: str) -> torch.Tensor:
    """The 2-D view the blocks live on.  # [M, K]"""
    if x.dim() == 0:
        return x.reshape(1, 1)
    if scaling == "channel":
        return x.reshape(x.shape[0], -1)
    return x.reshape(-1, x.shape[-1])


def resolve_block(scaling: str, block, m: int, k: int) -> tuple[int, int]:
    if scaling in ("tensor", "channel", "token"):
        if block is not None:
            raise ValueError(f"block is only used with scalings {sorted(DEFAULT_BLOCKS)}, not {scaling!r}")
        return (max(m, 1), max(k, 1)) if scaling == "tensor" else (1, max(k, 1))
    if block is None:
        return DEFAULT_BLOCKS[scaling]
    if isinstance(block, int):
        block = (1, block)
    block = tuple(int(b) for b in block)
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"block must be an int or a pair of positive ints (rows, cols), got {block}")
    if scaling != "block" and block[0] != 1:
        raise ValueError(
            f"scaling {scaling!r} groups along the last dim: block must be (1, n) or n, got {block}"
        )
    return block


def _to_blocks(x2d: torch.Tensor, bm: int, bk: int) -> torch.Tensor:
    """Zero-pad ``[M, K]`` to multiples of the block and view it as blocks.  # [Mb, bm, Kb, bk]"""
    m, k = x2d.shape
    pad_m, pad_k = (-m) % bm, (-k) % bk
    if pad_m or pad_k:
        x2d = F.pad(x2d, (0, pad_k, 0, pad_m))
    return x2d.reshape((m + pad_m) // bm, bm, (k + pad_k) // bk, bk)


def _from_blocks(xb: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """Inverse of :func:`_to_blocks` (drops the padding).  # [M, K]"""
    mb, bm, kb, bk = xb.shape
    x2d = xb.reshape(mb * bm, kb * bk)
    return x2d if (mb * bm, kb * bk) == (m, k) else x2d[:m, :k]


def mx_scale(amax: torch.Tensor, fmt: NumberFormat) -> torch.Tensor:
    """E8M0 shared scale 2^(floor(log2(amax)) - emax_elem), OCP MX spec v1.0 section 6.3.

    The exponent is clamped to the E8M0 range [-127, 127]; an all-zero block gets 2^-127.
    Elements may then exceed ``fmt.max`` by up to 2x (e.g. E4M3: up to 512 > 448): they saturate,
    as the spec prescribes.
    """
    _, exp = torch.frexp(amax.float())  # floor(log2 amax) = exp - 1 for amax > 0
    e = torch.where(amax > 0, exp - 1 - fmt.emax, torch.full_like(exp, E8M0_MIN_EXP))
    return torch.pow(2.0, e.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP).float())


def nvfp4_scales(amax_blocks: torch.Tensor, amax_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 two-level scales (NVIDIA, "Introducing NVFP4", 2025; TensorRT-LLM / ModelOpt recipe).

    tensor_scale = amax_tensor / (6 * 448) in FP32, so that every block scale fits E4M3;
    block_scale = (amax_block / 6) / tensor_scale, rounded to E4M3 (floored at its smallest
    subnormal 2^-9 so it is never 0). Returns ``(block_scale [Mb, Kb] float32, tensor_scale 0-d)``.
    """
    tensor_scale = (amax_tensor.float() / (6.0 * _E4M3.max)).clamp(min=SCALE_FLOOR)
    block = _E4M3.round(amax_blocks.float() / 6.0 / tensor_scale)
    return block.clamp(min=_E4M3_MIN_SUBNORMAL), tensor_scale


def e4m3_group_scales(
    amax_blocks: torch.Tensor, amax_second: torch.Tensor, fmt: NumberFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-level scales of ``group_e4m3`` / ``token_group_e4m3``: :func:`nvfp4_scales` for any format.

    second = amax_second / (fmt.scale_max * 448) in FP32 (per tensor or per row, broadcastable to the
    blocks); block = (amax_block / fmt.scale_max) / second rounded *up* to an E4M3 value, floored at 2^-9
    for a non-zero block and exactly 0 for an all-zero one. This is the NVFP4 rule (:func:`nvfp4_scales`)
    for any format except the rounding direction: NVFP4 rounds to nearest, which rounds a block scale
    down by up to 1/16 half the time and then saturates the block's largest elements. At 8 bits that
    clipping dominates the error (relative MSE of a 512x512 Gaussian weight, nested int8, groups of 32:
    1.1e-4 nearest vs 3.2e-5 up, ``tools/quant_error.py``); at 4 bits the two differ by 1%, at 2 bits
    nearest is 6% lower.
    Rounding up never saturates, and one rule serves every view of a nested grid. For nested ints the
    b-bit scales are 2^(8-b) times the 8-bit ones bit for bit (the block scales are the same E4M3
    values, the second level differs by an exact power of two).
    Returns ``(block_scale [Mb, Kb], second_scale [] or [Mb, 1])``, float32.
    """
    second = (amax_second.float() / (fmt.scale_max * _E4M3.max)).clamp(min=SCALE_FLOOR)
    block = e4m3_round_up(amax_blocks.float() / fmt.scale_max / second).clamp(min=_E4M3_MIN_SUBNORMAL)
    return torch.where(amax_blocks > 0, block, torch.zeros_like(block)), second


def e4m3_round_up(v: torch.Tensor) -> torch.Tensor:
    """The smallest E4M3 value >= ``v`` for ``v`` in [0, 448] (448 above; NaN stays NaN), as float32."""
    v = v.float()
    nearest = _E4M3.round(v)
    # Non-negative E4M3 values are ordered like their bit patterns: the next one up is pattern + 1.
    pattern = nearest.clamp(min=0.0).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int16)
    up = (pattern + 1).clamp(max=0x7E).to(torch.uint8).view(torch.float8_e4m3fn).float()  # 0x7E = 448
    return torch.where(nearest < v, up, nearest)


def _quantize_blocks(x, fmt, scaling, block, check_finite, name):
    """Shared core of quantize/fake_quantize.

    Returns ``(data [Mb, bm, Kb, bk], scale [Mb, Kb], tensor_scale, (bm, bk), M, K, fmt)``.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point torch.Tensor, got {getattr(x, 'dtype', type(x))}")
    fmt = get_format(fmt)
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {list(SCALINGS)}, got {scaling!r}")
    if scaling == "nvfp4" and fmt.name != "fp4_e2m1":
        raise ValueError(f"scaling 'nvfp4' needs fmt 'fp4_e2m1', got {fmt.name!r}")
    if check_finite and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} has non-finite values (nan/inf); cannot quantize it")
    x2d = _view_2d(x, scaling).float()  # [M, K]
    m, k = x2d.shape
    bm, bk = resolve_block(scaling, block, m, k)
    xb = _to_blocks(x2d, bm, bk)  # [Mb, bm, Kb, bk]
    amax = xb.abs().amax(dim=(1, 3)) if xb.numel() else xb.new_zeros(xb.shape[0], xb.shape[2])  # [Mb, Kb]
    tensor_scale = None
    if scaling == "mx":
        scale = mx_scale(amax, fmt)
        applied = scale
    elif scaling == "nvfp4":
        amax_t = amax.amax() if amax.numel() else amax.new_zeros(())
        scale, tensor_scale = nvfp4_scales(amax, amax_t)
        applied = scale * tensor_scale
    elif scaling in ("group_e4m3", "token_group_e4m3"):
        if scaling == "group_e4m3":
            amax_2 = amax.amax() if amax.numel() else amax.new_zeros(())  # []
        else:
            amax_2 = amax.amax(dim=1, keepdim=True) if amax.numel() else amax.new_zeros(amax.shape[0], 1)
        scale, tensor_scale = e4m3_group_scales(amax, amax_2, fmt)  # [Mb, Kb], [] or [Mb, 1]
        applied = scale * tensor_scale
    else:
        scale = (amax / fmt.scale_max).clamp(min=SCALE_FLOOR)
        if fmt.kind == "nested_int":  # no zero level: an all-zero block needs the scale 0 to stay zero
            scale = torch.where(amax > 0, scale, torch.zeros_like(scale))
        applied = scale
    data = fmt.encode(xb / _divisor(applied)[:, None, :, None])  # [Mb, bm, Kb, bk]
    return data, scale, tensor_scale, (bm, bk), m, k, fmt


def _divisor(applied: torch.Tensor) -> torch.Tensor:
    """``applied`` with its zeros (all-zero ``*_e4m3`` blocks) replaced by 1, so x / scale is never 0/0."""
    return torch.where(applied == 0, torch.ones_like(applied), applied)


def quantize(
    x: torch.Tensor,
    fmt: str | NumberFormat = "fp8_e4m3",
    scaling: str = "tensor",
    block: int | tuple[int, int] | None = None,
    *,
    check_finite: bool = True,
    name: str = "x",
) -> QuantizedTensor:
    """Quantize ``x`` to ``fmt`` with the given scaling (see the module docstring for the recipes).

    ``block``: block shape ``(rows, cols)`` for ``"block"``; group size ``n`` or ``(1, n)`` for
    ``"group"``/``"mx"``/``"nvfp4"``; must be None for ``"tensor"``/``"channel"``/``"token"``.
    ``name`` names ``x`` in error messages.
    """
    data, scale, tensor_scale, blk, m, k, f = _quantize_blocks(x, fmt, scaling, block, check_finite, name)
    data = _from_blocks(data, m, k).reshape(x.shape)
    return QuantizedTensor(data, scale, f.name, scaling, blk, x.dtype, tensor_scale)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """Read a :class:`QuantizedTensor` back as ``q.dtype`` values (``data * scale`` per block)."""
    fmt = get_format(q.fmt)
    vals = _view_2d(fmt.decode(q.data), q.scaling)  # [M, K]
    m, k = vals.shape
    xb = _to_blocks(vals, *q.block) * q.effective_scale()[:, None, :, None]  # [Mb, bm, Kb, bk]
    return _from_blocks(xb, m, k).reshape(q.shape).to(q.dtype)


def quantize_with_scales(x: torch.Tensor, like: QuantizedTensor, *, name: str = "x") -> QuantizedTensor:
    """Quantize ``x`` on the blocks of ``like`` with ``like``'s scales (no amax is taken).

    For tensors built against fixed scales, e.g. a rounding-aware outlier channel split
    (:func:`ais_lightning.quant.ocs.ocs_split`): elements beyond the range saturate as usual.
    ``x`` must have ``like``'s shape.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point torch.Tensor, got {getattr(x, 'dtype', type(x))}")
    if tuple(x.shape) != tuple(like.shape):
        raise ValueError(
            f"{name} must have the shape {tuple(like.shape)} of the scales' tensor, got {tuple(x.shape)}"
        )
    fmt = get_format(like.fmt)
    x2d = _view_2d(x, like.scaling).float()  # [M, K]
    m, k = x2d.shape
    xb = _to_blocks(x2d, *like.block)  # [Mb, bm, Kb, bk]
    data = fmt.encode(xb / _divisor(like.effective_scale())[:, None, :, None])
    data = _from_blocks(data, m, k).reshape(x.shape)
    return QuantizedTensor(data, like.scale, like.fmt, like.scaling, like.block, x.dtype, like.tensor_scale)


def fake_quantize(
    x: torch.Tensor,
    fmt: str | NumberFormat = "fp8_e4m3",
    scaling: str = "tensor",
    block: int | tuple[int, int] | None = None,
    *,
    check_finite: bool = True,
    name: str = "x",
) -> torch.Tensor:
    """Quantize-dequantize in one pass, equal to ``dequantize(quantize(x, ...))``; returns ``x.dtype``.

    No gradient flows through the rounding (use a straight-through estimator on top if needed).
    """
    data, scale, tensor_scale, _, m, k, f = _quantize_blocks(x, fmt, scaling, block, check_finite, name)
    applied = scale if tensor_scale is None else scale * tensor_scale
    xb = f.decode(data) * applied[:, None, :, None]  # [Mb, bm, Kb, bk]
    return _from_blocks(xb, m, k).reshape(x.shape).to(x.dtype)
