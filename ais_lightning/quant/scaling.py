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

Blocks that do not divide the view are zero-padded before the amax, so the last partial block has
its own correct scale (zeros never raise an amax). An all-zero block gets a finite positive scale
(the floor :data:`SCALE_FLOOR`) and quantizes to zeros. Values beyond the format max after scaling
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

SCALINGS = ("tensor", "channel", "token", "block", "group", "mx", "nvfp4")
"""Known scaling names."""

SCALE_FLOOR = 1e-12
"""Smallest scale used (all-zero or tiny blocks), so that x / scale is never 0/0."""

DEFAULT_BLOCKS = {"block": (128, 128), "group": (1, 128), "mx": (1, 32), "nvfp4": (1, 16)}
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
    """nvfp4 only: the FP32 per-tensor scale (0-d) that multiplies every block scale."""

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def effective_scale(self) -> torch.Tensor:
        """Per-block scale actually applied (``scale * tensor_scale`` for nvfp4).  # [Mb, Kb]"""
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
    else:
        scale = (amax / fmt.max).clamp(min=SCALE_FLOOR)
        applied = scale
    data = fmt.encode(xb / applied[:, None, :, None])  # [Mb, bm, Kb, bk]
    return data, scale, tensor_scale, (bm, bk), m, k, fmt


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
