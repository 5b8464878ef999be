"""The CPU's integer GEMMs behind :class:`~ais_lightning.quant.linear.QuantLinear`'s ``int8`` recipe, and which one
is fast on this CPU.

The ``int8`` recipe (int8 weights per output channel, int8 activations per token, both symmetric) is the integer
product ``codes_x [M, K] x codes_w [K, N]`` accumulated in int32 and scaled back in fp32. Two kernels in torch
compute it exactly, each fast on some x86 CPUs only:

- **``torch._int_mm``** (backend ``"int8"``): torch runs it through oneDNN only where the CPU has AVX512-VNNI
  (``aten/src/ATen/native/LinearAlgebra.cpp``: ``_int_mm_out_cpu`` checks ``at::cpu::is_avx512_vnni_supported()``),
  whose ``vpdpbusd`` accumulates u8 x s8 products straight into int32. Elsewhere (AVX2, AVX-VNNI without AVX-512,
  AVX-512 without VNNI) it runs a scalar reference loop, tens of times slower than an fp32 GEMM.
- **fbgemm's u8 x s8 GEMM** (backend ``"fbgemm"``, ``quantized::linear_with_input_q_dq_qweight_dq_output_fp32`` on
  a prepacked per-channel weight): fast on every x86 CPU with AVX2. Without VNNI its kernel multiplies with
  ``vpmaddubsw``, which adds the products of two adjacent K positions, ``a[2i] w[2i] + a[2i+1] w[2i+1]`` (``a``
  the activation as a u8, ``w`` the s8 weight), into a *saturating* int16 (fbgemm itself quantizes activations to 7
  bits, ``reduce_range``, for that reason). The activation codes enter as ``a = code + 128`` in [1, 255]. A pair of
  weights of opposite signs never leaves int16 (at most 255 * 127 - 1 in magnitude), one of equal signs stays within
  it whenever ``|w[2i]| + |w[2i+1]| <= 128`` (255 * 128 = 32640 <= 32767). So the weight's codes are split once per
  weight sync (:func:`split_weight_pairs`): the GEMM runs the weight with every equal-sign pair capped at 128, and
  the pairs beyond (two large weights of one sign side by side) leave their excess to a second product, exact as
  integers (:func:`fbgemm_linear`). The recipe's 8-bit activations stay 8-bit: the product is the emulated
  recipe's, as ``torch._int_mm``'s.

:func:`cpu_int8_isa` probes which case this CPU is (``"vnni"``, ``"avx2"``, or ``"none"``: neither kernel runs
fast); the environment variable ``AIS_LIGHTNING_INT8_ISA`` overrides the probe (the tests run both kinds of host
this way: every backend computes the same numbers on any x86 CPU, only the speed differs).
:func:`default_int8_backend` picks the fastest exact backend here.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from .scaling import SCALE_FLOOR, quantize

INT8_ISA_ENV = "AIS_LIGHTNING_INT8_ISA"
"""Environment variable overriding :func:`cpu_int8_isa` (one of :data:`INT8_ISAS`)."""
INT8_ISAS = ("vnni", "avx2", "none")
"""What a CPU multiplies int8 codes with fast: AVX512-VNNI int8 dot products (``torch._int_mm``), fbgemm's AVX2
kernels (any x86 CPU with AVX2), neither."""
INTEGER_BACKENDS = ("int8", "fbgemm")
"""QuantLinear backends on an integer GEMM (CPU only, recipe ``int8``): ``torch._int_mm``, fbgemm's."""
FBGEMM_ZERO_POINT = 128
"""fbgemm's activation zero point: an int8 code ``c`` in [-127, 127] enters its GEMM as the u8 ``c + 128``."""
FBGEMM_PAIR_LIMIT = 128
"""Largest ``|w[2i]| + |w[2i+1]|`` of an equal-sign weight pair fbgemm multiplies: 255 * 128 = 32640 fits its int16
pair sums."""
SPARSE_EXCESS = 0.02
"""Largest fraction of a weight's codes in its excess (:func:`split_weight_pairs`) computed as a sparse product;
above it the excess is a second fbgemm GEMM (with at most one nonzero code per pair it never saturates)."""


def cpu_int8_isa() -> str:
    """``"vnni"`` where the CPU has AVX512-VNNI (``torch._int_mm`` runs oneDNN's int8 kernels), else ``"avx2"``
    where fbgemm runs (x86 with AVX2), else ``"none"``; ``$AIS_LIGHTNING_INT8_ISA`` overrides the probe."""
    forced = os.environ.get(INT8_ISA_ENV, "").strip().lower()
    if forced:
        if forced not in INT8_ISAS:
            raise ValueError(f"{INT8_ISA_ENV} must be one of {list(INT8_ISAS)} (or unset), got {forced!r}")
        return forced
    probe = getattr(torch.cpu, "_is_vnni_supported", None)  # torch's own check (avx512_vnni), as _int_mm's
    if probe is not None and probe():
        return "vnni"
    return "avx2" if fbgemm_available() else "none"


def fbgemm_available() -> bool:
    """Whether this torch build runs fbgemm's quantized kernels on this CPU (x86 with AVX2)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def default_int8_backend() -> str:
    """The fastest exact backend of the ``int8`` recipe on this CPU (:func:`cpu_int8_isa`): ``"int8"``
    (``torch._int_mm``) with AVX512-VNNI, ``"fbgemm"`` on other x86 CPUs with AVX2, else ``"emulate"``."""
    return {"vnni": "int8", "avx2": "fbgemm", "none": "emulate"}[cpu_int8_isa()]


def int8_per_token(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize(x2d, "int8", "token")``'s codes ``[M, K]`` and scales ``[M, 1]``, bit for bit, in fewer kernels
    (the decode step calls it once per linear): scale ``max(amax / 127, SCALE_FLOOR)``, codes ``round(x / scale)``."""
    codes, scale = _per_token_codes(x2d)
    return codes.to(torch.int8), scale


def _per_token_codes(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`int8_per_token` with the codes as float32 (integers in [-127, 127]).  # [M, K], [M, 1]"""
    x2d = x2d.float()
    scale = x2d.abs().amax(dim=-1, keepdim=True).div_(127.0).clamp_(min=SCALE_FLOOR)  # [M, 1]
    return torch.round(x2d / scale).clamp_(-127, 127), scale


def int8_weight_operands(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mat2, scale)`` of :func:`int8_linear` from ``weight [N, K]``: int8 per output channel (symmetric,
    scale ``amax / 127``), ``mat2`` ``[K, N]`` column-major (the transpose of the contiguous ``[N, K]``
    codes), ``scale`` ``[N]`` float32."""
    q = quantize(weight.detach(), "int8", "channel", name="weight")
    return q.data.contiguous().t(), q.scale.reshape(-1)


def int8_linear(
    x: torch.Tensor, weight_t: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T + bias`` as the ``int8`` recipe on ``torch._int_mm``; ``x [..., K]`` float.

    The activation is quantized per token exactly as the emulated recipe does
    (:func:`ais_lightning.quant.scaling.quantize` with ``("int8", "token")``), multiplied by the int8
    weight ``weight_t [K, N]`` (:func:`int8_weight_operands`) with exact int32 accumulation
    (``torch._int_mm``), and scaled by ``scale_x [M, 1] * weight_scale [N]`` in fp32.
    """
    k = x.shape[-1]
    codes, scale = int8_per_token(x.reshape(-1, k))  # [M, K] int8, [M, 1]
    y = torch._int_mm(codes, weight_t).float()  # [M, N] int32 -> fp32
    y = y.mul_(scale).mul_(weight_scale)
    if bias is not None:
        y = y.add_(bias.float())
    return y.to(x.dtype).reshape(*x.shape[:-1], weight_t.shape[1])


def split_weight_pairs(
    codes: torch.Tensor, limit: int = FBGEMM_PAIR_LIMIT
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(capped, excess)`` with ``capped + excess == codes`` (``[N, K]`` int8) and, in every row, ``|capped[2i]| +
    |capped[2i+1]| <= limit`` wherever the two have the same sign: of such a pair beyond ``limit`` the larger
    magnitude gives up the difference (keeping its sign), so ``excess`` is zero except there (one entry per such
    pair; pairs of opposite signs are left as they are). A zero column pads an odd K."""
    n, k = codes.shape
    wide = torch.nn.functional.pad(codes.to(torch.int16), (0, k % 2)).reshape(n, -1, 2)  # [N, K/2, 2]
    same_sign = wide[..., 0] * wide[..., 1] > 0  # [N, K/2]
    over = (wide.abs().sum(-1) - limit).clamp_(min=0) * same_sign  # [N, K/2]
    first_larger = wide[..., 0].abs() >= wide[..., 1].abs()  # [N, K/2]
    take = torch.stack([over * first_larger, over * ~first_larger], dim=-1) * wide.sign()  # [N, K/2, 2]
    excess = take.reshape(n, -1)[:, :k].to(torch.int8)  # [N, K]
    return codes - excess, excess


@dataclass
class FbgemmWeight:
    """A weight ready for :func:`fbgemm_linear` (:func:`fbgemm_weight_operands`): its codes are ``capped + excess``."""

    packed: torch.ScriptObject
    """fbgemm's prepacked int8 weight: the capped codes of :func:`split_weight_pairs` (scales 1: fbgemm returns the
    integer sums)."""
    scale: torch.Tensor
    """Per-output-channel scales ``[N]`` float32 (``amax / 127``)."""
    excess_packed: torch.ScriptObject | None = None
    """The excess prepacked likewise, when it holds more than :data:`SPARSE_EXCESS` of the codes."""
    excess_sparse: torch.Tensor | None = None
    """Otherwise (if any) the excess codes as a sparse CSR ``[N, K]`` float32 matrix."""
    excess_codes: int = 0
    """How many nonzero codes the excess holds."""


def _prepack(codes: torch.Tensor) -> torch.ScriptObject:
    """fbgemm's prepacked weight from int8 ``codes [N, K]``, with scales 1 and zero points 0 per output channel."""
    previous = torch.backends.quantized.engine
    n = codes.shape[0]
    try:
        torch.backends.quantized.engine = "fbgemm"  # prepack picks its kernel library from the global engine
        with warnings.catch_warnings():  # torch deprecates quantized tensors: fbgemm's only entry point
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch._make_per_channel_quantized_tensor(
                codes.contiguous(), torch.ones(n, dtype=torch.double), torch.zeros(n, dtype=torch.long), 0
            )
        return torch.ops.quantized.linear_prepack(qweight, None)
    finally:
        torch.backends.quantized.engine = previous


def _sparse_csr(matrix: torch.Tensor) -> torch.Tensor:
    """``matrix`` as a sparse CSR matrix with int32 indices (MKL's sparse product takes them as they are; int64
    ones it converts at every call)."""
    # torch warns "sparse CSR support is in beta"; the CSR x dense product has been in torch since 1.13
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        csr = matrix.to_sparse_csr()
        return torch.sparse_csr_tensor(
            csr.crow_indices().int(), csr.col_indices().int(), csr.values(), csr.shape
        )


def fbgemm_weight_operands(weight: torch.Tensor) -> FbgemmWeight:
    """``weight [N, K]`` quantized per output channel exactly as :func:`int8_weight_operands` does, its codes split
    by :func:`split_weight_pairs`, the capped part prepacked for fbgemm, the excess (if any) too or kept sparse."""
    q = quantize(weight.detach().float(), "int8", "channel", name="weight")
    capped, excess = split_weight_pairs(q.data)
    prepared = FbgemmWeight(_prepack(capped), q.scale.reshape(-1), excess_codes=int(excess.count_nonzero()))
    if prepared.excess_codes > SPARSE_EXCESS * excess.numel():
        prepared.excess_packed = _prepack(excess)
    elif prepared.excess_codes:
        prepared.excess_sparse = _sparse_csr(excess.float())
    return prepared


def fbgemm_linear(x: torch.Tensor, weight: FbgemmWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` as the ``int8`` recipe on fbgemm's integer GEMM, exact on every x86 CPU with AVX2.

    The activation is quantized per token as the emulated recipe does (:func:`int8_per_token`); its codes enter
    fbgemm as floats holding integers with scale 1 and zero point 128, so fbgemm's own quantization keeps them as
    they are (u8 ``code + 128``). fbgemm returns the int32 sums ``codes_x @ capped^T`` as fp32 (its weight scales are
    1), the weight's excess adds ``codes_x @ excess^T`` (a second fbgemm GEMM, or a sparse product of few codes),
    and the per-token and per-channel scales and the bias are applied as :func:`int8_linear` applies them: where
    the sums stay below 2^24 (fp32's exact integers; always for K <= 1040) the output is ``int8_linear``'s, bit
    for bit.
    """
    operand, scale = _per_token_codes(x.reshape(-1, x.shape[-1]))  # [M, K] integers in [-127, 127], [M, 1]
    gemm = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32
    y = gemm(operand, 1.0, FBGEMM_ZERO_POINT, weight.packed)  # [M, N] = codes_x @ capped^T
    if weight.excess_packed is not None:
        y = y.add_(gemm(operand, 1.0, FBGEMM_ZERO_POINT, weight.excess_packed))
    elif weight.excess_sparse is not None:  # beta=0: the product alone, over an uninitialized buffer
        rest = torch.addmm(y.new_empty(y.shape[::-1]), weight.excess_sparse, operand.t().contiguous(), beta=0)
        y = y.add_(rest.t())  # [M, N] += (excess @ codes_x^T)^T
    y = y.mul_(scale).mul_(weight.scale)
    if bias is not None:
        y = y.add_(bias.float())
    return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])
