"""Nested integer grids: one int8 quantization whose top bits are the int4 and int2 quantizations.

Bit-by-Bit (Xu et al., "Bit-by-Bit: Progressive QAT Strategy with Outlier Channel Splitting for Stable
Low-Bit LLMs", ACL 2026, arXiv 2604.07888) builds "nested integer quantization grids" so that one model
is served at several bit widths ("train once, deploy any precision"), after Matryoshka Quantization
(Nair et al., ICML 2025, arXiv 2502.06786), which slices the most significant bits of an int8 code.
Only the paper's abstract is available to us, so the grid below is our construction; what it
guarantees is stated exactly.

**The grid** (formats ``nint8`` / ``nint4`` / ``nint2``, :mod:`.formats`). A block with scale ``s``
(the int8 step) covers [-128 s, 128 s] = [-amax, amax] with 2^b equal cells at b bits, each of width
``Delta_b = 2^(8-b) s``; the b-bit code of ``x`` is the cell index ``c_b = floor(x / Delta_b)``
(clamped to [-2^(b-1), 2^(b-1) - 1]) and its value the cell midpoint ``(c_b + 1/2) Delta_b``:

    c_b = floor(x / (2^(8-b) s)) = floor(floor(x / s) / 2^(8-b)) = c_8 >> (8 - b)

(``floor(floor(y) / n) == floor(y / n)`` for an integer ``n > 0``; the clamp commutes with the
shift). So the int4 and int2 **views** are arithmetic right shifts of the int8 code with the scale
multiplied by 16 and 64, and each view is the *correctly rounded* b-bit value: the b-bit level nearest
to ``x`` (ties, i.e. ``x`` exactly on a cell edge, go up, at every width alike), not a truncation
and not a double rounding. In floating point the identity is exact bit for bit: ``x / (16 s)`` is
``(x / s) / 16`` exactly, and under every scaling the scale of a b-bit nested format is 2^(8-b) times
the 8-bit one exactly (barring subnormal FP32 scales and E8M0's clamp at 2^+-127), so ``quantize(x, "nint4", ...)`` equals
``nested_view(quantize(x, "nint8", ...), 4)`` bit for bit (tested).

Why cell midpoints and not the symmetric grid with a zero: on the grid ``{i Delta}`` the b-bit cells
[(16 m - 8) Delta, (16 m + 8) Delta) are not unions of 8-bit cells (their edges fall on 8-bit levels),
so no function of the int8 code can give the correctly rounded int4 value (an int8 code 16 m + 8
covers both sides of an int4 decision edge); MatQuant's ``round(q8 / 16)`` is a double rounding that
is wrong there. The price is that no level is 0: a zero weight in a non-zero block is quantized to
+-Delta/2 (an all-zero block decodes to exact zeros, see :mod:`.scaling`). At 2 bits the grid is
{-1.5, -0.5, 0.5, 1.5} Delta, the usual symmetric 4-level grid; every width uses all 2^b codes.

One weight sync therefore serves several rollout precisions: quantize once to ``nint8``, keep the codes
and scales, and give an int4 / int2 engine the shifted codes (:func:`nested_view`).
"""

from __future__ import annotations

import torch

from .formats import get_format
from .scaling import QuantizedTensor

NESTED_FORMATS: dict[int, str] = {8: "nint8", 4: "nint4", 2: "nint2"}
"""Nested integer format name by bit width."""


def nested_format(bits: int) -> str:
    """Name of the nested integer format with ``bits`` bits (8, 4 or 2)."""
    if bits not in NESTED_FORMATS:
        raise ValueError(f"bits must be one of {sorted(NESTED_FORMATS)}, got {bits!r}")
    return NESTED_FORMATS[bits]


def nested_view(q: QuantizedTensor, bits: int) -> QuantizedTensor:
    """The ``bits``-bit view of a nested-integer :class:`QuantizedTensor` (its ``bits`` top bits).

    ``q`` must hold a nested format (``nint8``, ``nint4``...) with at least ``bits`` bits. The codes are
    shifted right by ``m = q_bits - bits`` (arithmetic shift: floor division by 2^m) and the scale is
    multiplied by 2^m (the second-level FP32 scale when there is one, so E4M3 block scales stay E4M3
    values). ``dequantize`` of the result is the correctly rounded ``bits``-bit quantization of the
    original tensor (module docstring). Views of views are views: ``view(view(q, 4), 2) == view(q, 2)``.
    """
    if not isinstance(q, QuantizedTensor):
        raise ValueError(f"q must be a QuantizedTensor, got {type(q).__name__}")
    src = get_format(q.fmt)
    if src.kind != "nested_int":
        raise ValueError(
            f"q must hold a nested integer format {sorted(NESTED_FORMATS.values())}, got {q.fmt!r}"
        )
    target = nested_format(bits)
    if bits > src.bits:
        raise ValueError(f"bits must be <= the {src.bits} bits of q ({q.fmt}), got {bits}")
    m = src.bits - bits
    data = torch.bitwise_right_shift(q.data, m)  # arithmetic on int8: floor(c / 2^m)
    factor = float(2**m)
    if q.tensor_scale is not None:
        scale, tensor_scale = q.scale, q.tensor_scale * factor
    else:
        scale, tensor_scale = q.scale * factor, None
    return QuantizedTensor(data, scale, target, q.scaling, q.block, q.dtype, tensor_scale)


def nested_views(q: QuantizedTensor, bits: tuple[int, ...] = (8, 4, 2)) -> dict[int, QuantizedTensor]:
    """``{b: nested_view(q, b)}`` for every ``b`` in ``bits`` (the views one weight sync serves)."""
    return {b: nested_view(q, b) for b in bits}
