"""FP8 KV-cache quantization with per-head scales.

vLLM / TensorRT-LLM store the KV cache in FP8 with one scale per (layer, kv head) computed from a
calibrated amax: ``scale = amax / fmt.max``; ``kv_fp8 = saturate(round(kv / scale))``
(FP8-RL, arXiv 2601.18150, section on KV-cache quantization; OCP OFP8 saturating conversion).
These helpers emulate that on any device.
"""

from __future__ import annotations

import torch

from .formats import NumberFormat, get_format
from .scaling import SCALE_FLOOR


def kv_amax(kv: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head amax of a ``[B, H, T, D]`` K or V tensor over valid positions.  # [H]

    ``mask``: optional ``[B, T]`` bool, True = a real (non-padding) position; padding is ignored.
    """
    _check_kv(kv)
    mag = kv.detach().float().abs()  # [B, H, T, D]
    if mask is not None:
        b, _, t, _ = kv.shape
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (b, t):
            raise ValueError(
                f"mask must be a bool [B, T]=[{b}, {t}] tensor, got {getattr(mask, 'shape', mask)}"
            )
        mag = torch.where(mask[:, None, :, None], mag, torch.zeros_like(mag))
    return mag.amax(dim=(0, 2, 3))


def kv_scale_from_amax(
    amax: torch.Tensor | float, fmt: str | NumberFormat = "fp8_e4m3", floor: float = SCALE_FLOOR
) -> torch.Tensor:
    """Per-head scale ``max(amax / fmt.max, floor)`` (float32, same shape as ``amax``).

    The floor keeps an all-zero head finite (its values then quantize to zero).
    """
    f = get_format(fmt)
    amax = torch.as_tensor(amax, dtype=torch.float32)
    if not bool(torch.isfinite(amax).all()) or bool((amax < 0).any()):
        raise ValueError("amax must be finite and >= 0")
    if floor <= 0:
        raise ValueError(f"floor must be > 0, got {floor}")
    return (amax / f.max).clamp(min=floor)


def fake_quantize_kv(
    kv: torch.Tensor, scale: torch.Tensor | float, fmt: str | NumberFormat = "fp8_e4m3"
) -> torch.Tensor:
    """Quantize-dequantize ``kv [B, H, T, D]`` with per-head ``scale`` (``[H]``, ``[1, H, 1, 1]`` or a scalar).

    Values beyond ``scale * fmt.max`` saturate; returns ``kv.dtype``. Non-finite kv values are not
    checked (no device sync in the attention loop): they stay non-finite.
    """
    _check_kv(kv)
    f = get_format(fmt)
    scale = torch.as_tensor(scale, dtype=torch.float32, device=kv.device)
    h = kv.shape[1]
    if scale.dim() == 1:
        if scale.shape[0] != h:
            raise ValueError(
                f"scale has shape {tuple(scale.shape)}; expected [H]={h} for kv {tuple(kv.shape)}"
            )
        scale = scale.reshape(1, h, 1, 1)
    elif scale.dim() == 4:
        if scale.shape not in ((1, h, 1, 1), (1, 1, 1, 1)):
            raise ValueError(f"scale has shape {tuple(scale.shape)}; expected [1, {h}, 1, 1]")
    elif scale.dim() != 0:
        raise ValueError(f"scale must be a scalar, [H] or [1, H, 1, 1], got shape {tuple(scale.shape)}")
    if not bool((scale > 0).all()):
        raise ValueError("scale must be > 0 (use kv_scale_from_amax, which applies a floor)")
    return (f.round(kv.float() / scale) * scale).to(kv.dtype)  # [B, H, T, D]


def _check_kv(kv: torch.Tensor) -> None:
    if not isinstance(kv, torch.Tensor) or not kv.is_floating_point() or kv.dim() != 4:
        raise ValueError(
            f"kv must be a floating-point [B, H, T, D] tensor, got {getattr(kv, 'dtype', type(kv))} "
            f"with shape {tuple(getattr(kv, 'shape', ()))}"
        )
