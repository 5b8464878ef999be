"""Element formats: exact round trips, RNE ties, saturation and the half-step error bound."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ais_lightning.quant import FORMATS, get_format, round_to_float_grid

FP4_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _all_fp8_values(dtype):
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    return vals[torch.isfinite(vals)]


@pytest.mark.parametrize("name,dtype", [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_every_fp8_value_round_trips(name, dtype):
    vals = _all_fp8_values(dtype)
    assert torch.equal(FORMATS[name].round(vals), vals)
    assert FORMATS[name].encode(vals).dtype == dtype


def test_fp4_values_round_trip_and_ties_go_to_even():
    fmt = FORMATS["fp4_e2m1"]
    vals = torch.tensor(FP4_MAGNITUDES + [-v for v in FP4_MAGNITUDES[1:]])
    assert torch.equal(fmt.round(vals), vals)
    # Midpoints: the neighbour with an even mantissa bit wins (0 even, 0.5 odd, 1 even, 1.5 odd, ...).
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0])
    assert fmt.round(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -4.0]
    near = torch.tensor([0.3, 0.7, 2.6, 4.9, 5.1])
    assert fmt.round(near).tolist() == [0.5, 0.5, 3.0, 4.0, 6.0]


@pytest.mark.parametrize("name,mantissa,emin", [("fp8_e4m3", 3, -6), ("fp8_e5m2", 2, -14)])
def test_generic_grid_rounding_matches_torch_fp8_casts(name, mantissa, emin):
    g = torch.Generator().manual_seed(0)
    y = torch.cat([torch.randn(20000, generator=g) * s for s in (1e-6, 1e-3, 0.1, 1.0, 30.0, 400.0, 1e5)])
    fmt = FORMATS[name]
    expected = y.clamp(-fmt.max, fmt.max).to(fmt.dtype).float()
    assert torch.equal(round_to_float_grid(y, mantissa, emin, fmt.max), expected)


def test_saturation_clamps_to_format_max():
    big = torch.tensor([1e3, -1e6, 6.5e4, 1e9])
    assert FORMATS["fp8_e4m3"].round(big).tolist() == [448.0, -448.0, 448.0, 448.0]
    assert FORMATS["fp8_e5m2"].round(big).tolist() == [1024.0, -57344.0, 57344.0, 57344.0]
    assert FORMATS["fp4_e2m1"].round(big).tolist() == [6.0, -6.0, 6.0, 6.0]
    assert FORMATS["int8"].round(big).tolist() == [127.0, -127.0, 127.0, 127.0]


def test_int8_rounds_half_to_even_and_is_symmetric():
    fmt = FORMATS["int8"]
    assert fmt.round(torch.tensor([2.5, 3.5, -2.5, 0.49, -128.0])).tolist() == [2.0, 4.0, -2.0, 0.0, -127.0]
    assert fmt.encode(torch.tensor([1.0])).dtype == torch.int8


def test_unknown_format_lists_names():
    with pytest.raises(ValueError, match="fp8_e4m3"):
        get_format("fp7")


def _half_step(y: float, mantissa: int, emin: int) -> float:
    """Half the spacing of a float format at |y| (hand-derived: 2^(floor(log2|y|) - m - 1), fixed below 2^emin)."""
    e = max(math.floor(math.log2(abs(y))), emin) if y != 0 else emin
    return 2.0 ** (e - mantissa - 1)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(["fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "int8"]), u=st.floats(-1.0, 1.0))
def test_rounding_error_is_at_most_half_a_step(name, u):
    fmt = FORMATS[name]
    y = u * fmt.max
    r = fmt.round(torch.tensor([y], dtype=torch.float64).float()).item()
    y32 = torch.tensor(y).float().item()
    bound = 0.5 if fmt.kind == "int" else _half_step(y32, fmt.mantissa_bits, fmt.emin)
    assert abs(r - y32) <= bound
