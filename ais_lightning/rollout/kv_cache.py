"""The torch engine's KV cache: one workspace reused across ``generate`` calls, and FP8 KV-cache scales.

:class:`KVWorkspace` hands out per-layer ``[B, Hkv, T, D]`` K and V caches as views into one flat
buffer kept between calls (like vLLM's preallocated KV blocks).

:class:`FP8KVScales` emulates an FP8 KV cache (``kv_cache_dtype="fp8"``, FP8-RL arXiv 2601.18150):
keys (after RoPE) and values are stored fake-quantized to E4M3 with one scale per (layer, KV head)
(:mod:`ais_lightning.quant.kv`). Scales are calibrated *on the fly*: the prefill of the first
``generate`` after construction or after :meth:`FP8KVScales.reset` (every weight sync) measures the
per-head amax of K and V over the valid prompt tokens of that batch and fixes the scales until the
next reset (values beyond the calibrated amax saturate). The prefill itself attends over the
quantized K/V, exactly as the decode steps read them from the cache.
"""

from __future__ import annotations

import math

import torch


class KVWorkspace:
    """Per-layer K and V caches as views into one buffer kept across calls.

    The memory is allocated once and reused by every call whose caches fit in it (it grows when a
    call needs more). Freshly allocated memory costs a page fault per 4 KiB on first touch (~4 us
    each on this VM: ~0.2 s per call for a 168 MB cache) and successive rollouts have the same
    shapes. The caller never reads a slot it has not written in the same call (the torch engine's
    prefill zeroes the pad slots and writes every other slot before attending to it).
    """

    def __init__(self, num_layers: int) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.num_layers = num_layers
        self.buffer: torch.Tensor | None = None
        """The flat buffer, or None before the first call / after :meth:`release`."""

    def caches(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer K and V caches of ``shape`` ``[B, Hkv, T, D]`` (contents undefined)."""
        need = 2 * self.num_layers * math.prod(shape)
        ws = self.buffer
        if ws is None or ws.numel() < need or ws.dtype != dtype or ws.device != device:
            self.buffer = ws = None  # drop the old workspace before allocating the new one
            ws = self.buffer = torch.empty(need, dtype=dtype, device=device)
        caches = ws[:need].view(2, self.num_layers, *shape)  # [K|V, layers, B, Hkv, T, D]
        return list(caches[0].unbind(0)), list(caches[1].unbind(0))

    def release(self) -> None:
        """Free the buffer (the next call allocates it again)."""
        self.buffer = None


class FP8KVScales:
    """Per (layer, KV head) E4M3 scales of an emulated FP8 KV cache, calibrated by a prefill.

    :meth:`store` returns K/V as the cache holds them (fake-quantized); called at prefill with the
    ``valid`` mask, it first calibrates the layer's scales if they are stale.
    """

    def __init__(self, fmt: str = "fp8_e4m3") -> None:
        self.fmt = fmt
        self.scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        """Per layer ``(k_scale [Hkv], v_scale [Hkv])``, in layer order; None = stale."""

    def reset(self) -> None:
        """Mark the scales stale: the next prefill recalibrates them (call after every weight sync)."""
        self.scales = None

    def store(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V fake-quantized with the layer's scales.  k, v: [B, Hkv, T, D]

        ``valid`` ([B, T] bool) is given at prefill; if the scales are stale it calibrates them from
        the per-head amax over the valid positions. Decoding with stale scales raises RuntimeError.
        """
        from ais_lightning.quant import fake_quantize_kv, kv_scale_from_amax

        if self.scales is None or len(self.scales) <= layer:
            if valid is None:
                raise RuntimeError("FP8 KV scales must be calibrated by a prefill before decoding")
            if self.scales is None:
                self.scales = []
            w = valid[:, None, :, None]  # [B, 1, T, 1]
            k_amax = torch.where(w, k.float().abs(), 0.0).amax(dim=(0, 2, 3))  # [Hkv]
            v_amax = torch.where(w, v.float().abs(), 0.0).amax(dim=(0, 2, 3))  # [Hkv]
            self.scales.append((kv_scale_from_amax(k_amax, self.fmt), kv_scale_from_amax(v_amax, self.fmt)))
        k_scale, v_scale = self.scales[layer]  # [Hkv] each
        return fake_quantize_kv(k, k_scale, self.fmt), fake_quantize_kv(v, v_scale, self.fmt)
