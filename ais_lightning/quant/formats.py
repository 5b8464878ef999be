"""Low-precision number formats: FP8 (E4M3, E5M2), FP4 (E2M1) and INT8.

A :class:`NumberFormat` knows how to round a float32 tensor that is already divided by its scale
onto the format's representable values (``encode``) and how to read them back (``decode``).
Rounding is round-to-nearest-even with saturation: magnitudes beyond ``fmt.max`` clamp to
``fmt.max`` (never inf/NaN), which is the conversion the OCP 8-bit FP spec (OFP8, 2023) calls
"saturating" and what FP8 training recipes use (Micikevicius et al., "FP8 Formats for Deep
Learning", arXiv 2209.05433; DeepSeek-V3, arXiv 2412.19437).

- FP8 E4M3 / E5M2: torch has ``float8_e4m3fn`` / ``float8_e5m2``; casting to them gives the exact
  RNE rounding, so they are used for storage and rounding.
- FP4 E2M1 (OCP MX spec v1.0, section 5.3.3): no torch dtype. Its 8 magnitudes are
  {0, 0.5, 1, 1.5, 2, 3, 4, 6}; :func:`round_to_float_grid` rounds to them with round-to-nearest-even
  (ties go to the value with an even mantissa bit: 0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4) and the
  data is stored as float32 holding those exact values.
- INT8: symmetric, integers in [-127, 127] (-128 unused), ``torch.round`` (half to even).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def round_to_float_grid(y: torch.Tensor, mantissa_bits: int, emin: int, max_value: float) -> torch.Tensor:
    """Round ``y`` to a binary float format with ``mantissa_bits`` explicit mantissa bits.

    Round-to-nearest-even, subnormals below ``2**emin`` (the smallest normal), saturating at
    ``max_value``. Within the binade [2^e, 2^(e+1)) the spacing is 2^(e - mantissa_bits); below
    2^emin it is 2^(emin - mantissa_bits). ``y`` must be finite. Works for any such format (E2M1 here; it reproduces
    torch's E4M3/E5M2 casts, which the tests use as an independent check). Returns float32.
    """
    y = y.float()
    mag = y.abs().clamp(max=max_value)  # [...]
    # Normal range: round the float32 bit pattern to `mantissa_bits` bits, ties to even
    # (add 0x7f..f plus the lowest kept bit, then truncate), exact and vectorized.
    shift = 23 - mantissa_bits
    bits = mag.view(torch.int32)
    bits = bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)
    normal = ((bits >> shift) << shift).view(torch.float32)
    # Subnormal range: fixed spacing 2^(emin - mantissa_bits); torch.round is half-to-even.
    step = 2.0 ** (emin - mantissa_bits)
    subnormal = torch.round(mag / step) * step
    rounded = torch.where(mag < 2.0**emin, subnormal, normal).clamp(max=max_value)
    return torch.copysign(rounded, y)


@dataclass(frozen=True)
class NumberFormat:
    """A low-precision element format."""

    name: str
    """Registry key, e.g. ``"fp8_e4m3"``."""
    kind: str
    """``"float"`` or ``"int"``."""
    bits: int
    """Storage bits per element."""
    max: float
    """Largest representable magnitude; larger inputs saturate to it."""
    mantissa_bits: int
    """Explicit mantissa bits (float formats); 0 for int."""
    emin: int
    """Exponent of the smallest normal number (float formats); 0 for int."""
    emax: int
    """floor(log2(max)): ``emax_elem`` of the OCP MX spec v1.0 section 6.3 (8 for E4M3, 15 for E5M2,
    2 for E2M1; 6 for INT8, the largest power of two not above 127)."""
    dtype: torch.dtype | None
    """torch storage dtype, or None when torch has none (E2M1 data is stored as float32)."""

    def __post_init__(self) -> None:
        if self.kind not in ("float", "int"):
            raise ValueError(f"kind must be 'float' or 'int', got {self.kind!r}")
        if self.max <= 0:
            raise ValueError(f"max must be > 0, got {self.max}")

    def encode(self, y: torch.Tensor) -> torch.Tensor:
        """Round scaled values ``y`` (= x / scale) to the format, saturating; returns storage data."""
        if self.kind == "int":
            return torch.round(y.float()).clamp(-self.max, self.max).to(self.dtype)
        if self.dtype is not None:  # exact RNE by torch's cast; clamp first so nothing becomes NaN/inf
            return y.float().clamp(-self.max, self.max).to(self.dtype)
        return round_to_float_grid(y, self.mantissa_bits, self.emin, self.max)

    def decode(self, data: torch.Tensor) -> torch.Tensor:
        """Storage data -> float32 values."""
        return data.float()

    def round(self, y: torch.Tensor) -> torch.Tensor:
        """``decode(encode(y))``: the nearest representable values as float32."""
        return self.decode(self.encode(y))


FORMATS: dict[str, NumberFormat] = {
    "fp8_e4m3": NumberFormat("fp8_e4m3", "float", 8, 448.0, 3, -6, 8, torch.float8_e4m3fn),
    "fp8_e5m2": NumberFormat("fp8_e5m2", "float", 8, 57344.0, 2, -14, 15, torch.float8_e5m2),
    "fp4_e2m1": NumberFormat("fp4_e2m1", "float", 4, 6.0, 1, 0, 2, None),
    "int8": NumberFormat("int8", "int", 8, 127.0, 0, 0, 6, torch.int8),
}
"""Known formats by name."""


def get_format(fmt: str | NumberFormat) -> NumberFormat:
    """Look up a format by name (a :class:`NumberFormat` passes through); ValueError lists the names."""
    if isinstance(fmt, NumberFormat):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
    return FORMATS[fmt]
