"""The blockwise FP8 GEMM (1x128 activation groups x 128x128 weight blocks) as torch and cuBLASLt run it, on a CPU.

torch's CPU kernels have no blockwise GEMM. :class:`EmulatedBlockwiseGemm` stands in for
``torch.nn.functional.scaled_mm`` (and the legacy ``torch._scaled_mm``): it checks the operands as torch's
``aten/src/ATen/native/cuda/ScaledBlas.cpp`` does for ``_scaled_block1x128_block128x128`` (activation scales
``[M, ceil(K/128)]`` outer-dim-major, weight scales of ``mat2`` ``[K, N]`` as ``[L4, ceil(N/128)]`` with strides
``(1, L4)``, L4 = ceil(K/128) rounded up to a multiple of 4) and computes what cuBLASLt computes from them: it gets
only the weight scales' data pointer (torch ``cuBlasCommonArgs.h``) and reads the scale of K block ``i`` and N block
``j`` at element ``j * L4 + i`` of the memory there (:func:`cublaslt_weight_scales`), which is why an unpadded
layout gave silently wrong products (PyTorch PR 166752). It records every call (``calls``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F


def _size_stride(scale: torch.Tensor, dim: int, size: int, stride: int) -> bool:
    """``check_size_stride`` of ScaledBlas.cpp: the stride only matters when the size is > 1."""
    return scale.size(dim) == size and (size <= 1 or scale.stride(dim) == stride)


def k_blocks_padded(k: int) -> int:
    """L4: the K-block count of 128x128 weight scales, rounded up to a multiple of 4 (cuBLASLt's layout)."""
    return -(-math.ceil(k / 128) // 4) * 4


def is_blockwise_1x128(t: torch.Tensor, scale: torch.Tensor) -> bool:
    """``is_blockwise_1x128_scaling`` of ScaledBlas.cpp: ``[M, ceil(K/128)]`` float32 scales, strides ``(1, M)``."""
    return (
        t.dtype == torch.float8_e4m3fn
        and scale.dtype == torch.float32
        and scale.dim() == 2
        and _size_stride(scale, 0, t.size(0), 1)
        and _size_stride(scale, 1, math.ceil(t.size(1) / 128), t.size(0))
    )


def is_cublaslt_128x128(mat2: torch.Tensor, scale_b: torch.Tensor) -> bool:
    """``_scaled_block1x128_block128x128``'s check of ``scale_b`` for ``mat2`` ``[K, N]``: ``[L4, ceil(N/128)]``,
    strides ``(1, L4)`` (the column stride is free when there is one column)."""
    k, n = mat2.shape
    l4 = k_blocks_padded(k)
    return (
        mat2.dtype == torch.float8_e4m3fn
        and scale_b.dtype == torch.float32
        and tuple(scale_b.shape) == (l4, math.ceil(n / 128))
        and scale_b.stride(0) == 1
        and (scale_b.stride(1) == l4 or (scale_b.size(1) == 1 and scale_b.stride(1) == 1))
    )


def cublaslt_weight_scales(scale_b: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """The 128x128 block scales cuBLASLt applies to ``mat2`` ``[K, N]``, as ``[ceil(K/128), ceil(N/128)]``.

    Read as cuBLASLt reads them: from ``scale_b``'s data pointer, the scale of K block ``i`` and N block ``j`` at
    element ``j * L4 + i``. Reads past the tensor's storage come back NaN (on a GPU: whatever lies there).
    """
    kb, nb, l4 = math.ceil(k / 128), math.ceil(n / 128), k_blocks_padded(k)
    memory = torch.empty(0, dtype=scale_b.dtype).set_(scale_b.untyped_storage())[scale_b.storage_offset() :]
    index = torch.arange(nb)[None, :] * l4 + torch.arange(kb)[:, None]  # [kb, nb]
    read = torch.full((kb, nb), float("nan"))
    inside = index < memory.numel()
    read[inside] = memory[index[inside]]
    return read


def dequantize_blocks(data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``data * scale`` with each scale repeated over its block (partial edge blocks cut off).  # data's shape"""
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return data.float() * full[: data.shape[0], : data.shape[1]]


class EmulatedBlockwiseGemm:
    """Stands in for the blockwise ``F.scaled_mm`` (:meth:`scaled_mm`) and ``torch._scaled_mm``
    (:meth:`scaled_mm_legacy`); see the module docstring. ``calls``: ``(mat_a, mat_b, scale_a, scale_b, recipes)``
    of every call (``recipes`` None for the legacy API, which infers the scaling from the shapes)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def _gemm(self, mat_a, mat_b, scale_a, scale_b, out_dtype, recipes=None) -> torch.Tensor:
        self.calls.append((mat_a, mat_b, scale_a, scale_b, recipes))
        if not is_blockwise_1x128(mat_a, scale_a):
            raise RuntimeError(
                f"Invalid scaling configuration (stand-in of ScaledBlas.cpp): scale_a {tuple(scale_a.shape)} strides "
                f"{scale_a.stride()} is not 1x128 block scaling of mat_a {tuple(mat_a.shape)}"
            )
        k, n = mat_b.shape
        a = dequantize_blocks(mat_a, scale_a, (1, 128))  # [M, K]
        b = dequantize_blocks(mat_b.t(), cublaslt_weight_scales(scale_b, k, n).t(), (128, 128)).t()  # [K, N]
        return (a @ b).to(out_dtype)  # [M, N]

    def scaled_mm_legacy(
        self, mat_a, mat_b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, **_
    ):
        return self._gemm(mat_a, mat_b, scale_a, scale_b, out_dtype)

    def scaled_mm(
        self,
        mat_a,
        mat_b,
        scale_a,
        scale_recipe_a,
        scale_b,
        scale_recipe_b,
        *_,
        output_dtype=torch.bfloat16,
        **__,
    ):
        recipes = (scale_recipe_a, scale_recipe_b)
        if recipes != (F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128):
            raise NotImplementedError(
                f"the stand-in runs the 1x128 x 128x128 blockwise GEMM only, got {recipes}"
            )
        if not is_cublaslt_128x128(mat_b, scale_b):
            raise RuntimeError(
                f"scale_b must have shape {k_blocks_padded(mat_b.shape[0])} x {math.ceil(mat_b.shape[1] / 128)} with "
                f"strides (1, L4) (stand-in of _scaled_block1x128_block128x128), got {tuple(scale_b.shape)} "
                f"strides {scale_b.stride()}"
            )
        return self._gemm(mat_a, mat_b, scale_a, scale_b, output_dtype, recipes)
