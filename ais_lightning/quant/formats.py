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
- Nested integers ``nint8`` / ``nint4`` / ``nint2`` (``kind="nested_int"``, see :mod:`.nested`): a
  b-bit code ``c`` in [-2^(b-1), 2^(b-1) - 1] stands for the value ``c + 1/2``, the midpoint of the
  unit cell [c, c + 1); the 2^b cells tile [-2^(b-1), 2^(b-1)] and ``encode`` is
  ``floor(y)`` clamped to the code range. No level is 0 (the smallest magnitudes are +-1/2, the
  usual symmetric 2-bit grid {-1.5, -0.5, 0.5, 1.5}). What this buys: with the scale of a b-bit grid
  equal to 2^(8-b) times the 8-bit scale, the b-bit cells are unions of 8-bit cells, so the b-bit code
  of ``x`` is exactly ``c8 >> (8 - b)`` (``floor(floor(y) / 2^m) == floor(y / 2^m)``): the most
  significant bits of one int8 code *are* the correctly rounded int4 / int2 values.
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
    """``"float"``, ``"int"`` (symmetric, levels ``i``) or ``"nested_int"`` (levels ``c + 1/2``)."""
    bits: int
    """Storage bits per element."""
    max: float
    """Largest representable magnitude; larger inputs saturate to it (``2^(b-1) - 1/2`` for nested ints)."""
    mantissa_bits: int
    """Explicit mantissa bits (float formats); 0 for int."""
    emin: int
    """Exponent of the smallest normal number (float formats); 0 for int."""
    emax: int
    """floor(log2(max)): ``emax_elem`` of the OCP MX spec v1.0 section 6.3 (8 for E4M3, 15 for E5M2,
    2 for E2M1; 6 for INT8, the largest power of two not above 127; b - 2 for a b-bit nested int)."""
    dtype: torch.dtype | None
    """torch storage dtype, or None when torch has none (E2M1 data is stored as float32)."""

    def __post_init__(self) -> None:
        if self.kind not in ("float", "int", "nested_int"):
            raise ValueError(f"kind must be 'float', 'int' or 'nested_int', got {self.kind!r}")
        if self.max <= 0:
            raise ValueError(f"max must be > 0, got {self.max}")

    @property
    def scale_max(self) -> float:
        """The scaled value a block's amax is mapped to (``scale = amax / scale_max``).

        ``max`` for float and int formats (amax lands on the largest level); ``2^(b-1)`` for nested ints,
        the outer edge of the top cell, so the 2^b cells tile exactly [-amax, amax] and every b-bit
        view of the grid is the uniform b-bit quantizer of that interval.
        """
        return float(2 ** (self.bits - 1)) if self.kind == "nested_int" else self.max

    @property
    def is_uniform(self) -> bool:
        """True for integer grids (equally spaced levels, one unit apart)."""
        return self.kind in ("int", "nested_int")

    def encode(self, y: torch.Tensor) -> torch.Tensor:
        """Round scaled values ``y`` (= x / scale) to the format, saturating; returns storage data."""
        if self.kind == "int":
            return torch.round(y.float()).clamp(-self.max, self.max).to(self.dtype)
        if self.kind == "nested_int":  # the cell [c, c + 1) holding y; the top cell also takes y = 2^(b-1)
            half = 2 ** (self.bits - 1)
            return torch.floor(y.float()).clamp(-half, half - 1).to(self.dtype)
        if self.dtype is not None:  # exact RNE by torch's cast; clamp first so nothing becomes NaN/inf
            return y.float().clamp(-self.max, self.max).to(self.dtype)
        return round_to_float_grid(y, self.mantissa_bits, self.emin, self.max)

    def decode(self, data: torch.Tensor) -> torch.Tensor:
        """Storage data -> float32 values (nested ints: the cell midpoint ``c + 1/2``)."""
        if self.kind == "nested_int":
            return data.float() + 0.5
        return data.float()

    def round(self, y: torch.Tensor) -> torch.Tensor:
        """``decode(encode(y))``: the nearest representable values as float32."""
        return self.decode(self.encode(y))


FORMATS: dict[str, NumberFormat] = {
    "fp8_e4m3": NumberFormat("fp8_e4m3", "float", 8, 448.0, 3, -6, 8, torch.float8_e4m3fn),
    "fp8_e5m2": NumberFormat("fp8_e5m2", "float", 8, 57344.0, 2, -14, 15, torch.float8_e5m2),
    "fp4_e2m1": NumberFormat("fp4_e2m1", "float", 4, 6.0, 1, 0, 2, None),
    "int8": NumberFormat("int8", "int", 8, 127.0, 0, 0, 6, torch.int8),
    "nint8": NumberFormat("nint8", "nested_int", 8, 127.5, 0, 0, 6, torch.int8),
    "nint4": NumberFormat("nint4", "nested_int", 4, 7.5, 0, 0, 2, torch.int8),
    "nint2": NumberFormat("nint2", "nested_int", 2, 1.5, 0, 0, 0, torch.int8),
}
"""Known formats by name."""


def get_format(fmt: str | NumberFormat) -> NumberFormat:
    """Look up a format by name (a :class:`NumberFormat` passes through); ValueError lists the names."""
    if isinstance(fmt, NumberFormat):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
    return FORMATS[fmt]
