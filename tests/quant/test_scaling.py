"""Scalings: block scales, padding, zeros, MX and NVFP4 scales, error bounds, bad input; recipes."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ais_lightning.quant import (
    FORMATS,
    RECIPES,
    QuantRecipe,
    dequantize,
    fake_quantize,
    get_recipe,
    quantize,
)

E4M3_MAX = 448.0


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_block_scales_equal_block_amax_over_format_max():
    w = _randn(256, 384)
    q = quantize(w, "fp8_e4m3", "block", (128, 128))
    assert q.scale.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            amax = w[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)].abs().max()
            assert q.scale[i, j].item() == pytest.approx((amax / E4M3_MAX).item(), rel=1e-7)
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == w.shape


def test_channel_and_token_scales():
    w = _randn(6, 10)
    qc = quantize(w, "int8", "channel")
    assert torch.allclose(qc.scale[:, 0], w.abs().amax(dim=1) / 127.0)
    x = _randn(2, 3, 10)  # [B, T, K]: one scale per token
    qt = quantize(x, "int8", "token")
    assert torch.allclose(qt.scale[:, 0], x.reshape(6, 10).abs().amax(dim=1) / 127.0)
    assert quantize(x, "fp8_e4m3", "tensor").scale.item() == pytest.approx(x.abs().max().item() / E4M3_MAX)


def test_padding_matches_manual_padding():
    w = _randn(130, 130)
    padded = torch.zeros(256, 256)
    padded[:130, :130] = w
    expected = fake_quantize(padded, "fp8_e4m3", "block", (128, 128))[:130, :130]
    assert torch.equal(fake_quantize(w, "fp8_e4m3", "block", (128, 128)), expected)
    # The last partial block is scaled by its own amax, not by a neighbour's.
    q = quantize(w, "fp8_e4m3", "block", (128, 128))
    assert q.scale[1, 1].item() == pytest.approx(w[128:, 128:].abs().max().item() / E4M3_MAX)
    x = _randn(3, 130)
    xp = torch.cat([x, torch.zeros(3, 126)], dim=1)
    assert torch.equal(fake_quantize(x, "fp4_e2m1", "nvfp4"), fake_quantize(xp, "fp4_e2m1", "nvfp4")[:, :130])


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 40),
    k=st.integers(1, 70),
    bm=st.integers(1, 16),
    bk=st.integers(1, 32),
    fmt=st.sampled_from(["fp8_e4m3", "fp4_e2m1", "int8"]),
)
def test_any_block_shape_equals_manual_padding(m, k, bm, bk, fmt):
    x = _randn(m, k, seed=m * 100 + k)
    pm, pk = -(-m // bm) * bm, -(-k // bk) * bk
    padded = torch.zeros(pm, pk)
    padded[:m, :k] = x
    expected = fake_quantize(padded, fmt, "block", (bm, bk))[:m, :k]
    assert torch.equal(fake_quantize(x, fmt, "block", (bm, bk)), expected)
    assert quantize(x, fmt, "block", (bm, bk)).scale.shape == (pm // bm, pk // bk)


SCALING_CASES = [
    ("fp8_e4m3", "tensor", None),
    ("fp8_e4m3", "channel", None),
    ("fp8_e5m2", "token", None),
    ("fp8_e4m3", "block", (128, 128)),
    ("fp8_e5m2", "group", 128),
    ("fp8_e4m3", "mx", None),
    ("fp4_e2m1", "mx", None),
    ("fp4_e2m1", "nvfp4", None),
    ("int8", "token", None),
    ("int8", "block", (16, 16)),
]


@pytest.mark.parametrize("fmt,scaling,block", SCALING_CASES)
def test_zeros_give_zeros_and_finite_positive_scales(fmt, scaling, block):
    x = torch.zeros(40, 200)
    x[:8, :8] = 1.0  # one non-zero corner; every other block is all zeros
    q = quantize(x, fmt, scaling, block)
    assert torch.isfinite(q.effective_scale()).all() and (q.effective_scale() > 0).all()
    x_hat = dequantize(q)
    assert torch.equal(x_hat[8:], torch.zeros(32, 200))
    assert torch.equal(fake_quantize(torch.zeros(3, 5), fmt, scaling, block), torch.zeros(3, 5))


@pytest.mark.parametrize("fmt,scaling,block", SCALING_CASES)
def test_fake_quantize_equals_dequantize_of_quantize(fmt, scaling, block):
    x = _randn(37, 300, seed=1) * 3
    assert torch.equal(fake_quantize(x, fmt, scaling, block), dequantize(quantize(x, fmt, scaling, block)))


@pytest.mark.parametrize("fmt,scaling,block", SCALING_CASES)
def test_error_is_bounded_by_half_a_step_times_the_scale(fmt, scaling, block):
    x = _randn(37, 300, seed=2) * torch.logspace(-3, 2, 300)  # wide dynamic range across columns
    q = quantize(x, fmt, scaling, block)
    f = FORMATS[fmt]
    bm, bk = q.block
    m, k = x.shape
    # Per-element scale: repeat each block scale over its block, crop the padding.
    s = q.effective_scale().repeat_interleave(bm, 0).repeat_interleave(bk, 1)[:m, :k].reshape(x.shape)
    y = (x / s).abs()
    if f.kind == "int":
        half_step = torch.full_like(y, 0.5)
    else:  # 2^(floor(log2|y|) - m - 1), constant below the smallest normal 2^emin
        e = torch.floor(torch.log2(y.clamp(min=2.0**f.emin)))
        half_step = 2.0 ** (e - f.mantissa_bits - 1)
    saturated = (y - f.max).clamp(min=0)  # MX/NVFP4 block scales may put a few elements beyond max
    bound = (half_step + saturated) * s * (1 + 1e-6)
    assert ((fake_quantize(x, fmt, scaling, block) - x).abs() <= bound).all()


def test_mx_scales_are_powers_of_two_from_the_spec_formula():
    x = _randn(4, 96, seed=3) * 10
    for fmt, emax in (("fp8_e4m3", 8), ("fp4_e2m1", 2)):
        q = quantize(x, fmt, "mx")
        assert q.scale.shape == (4, 3)
        for i in range(4):
            for j in range(3):
                amax = x[i, 32 * j : 32 * (j + 1)].abs().max().item()
                assert q.scale[i, j].item() == 2.0 ** (math.floor(math.log2(amax)) - emax)


def test_mx_elements_beyond_format_max_saturate():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 480.0, 1.0  # amax 480 -> scale 2^(8 - 8) = 1; 480 > 448 saturates
    assert fake_quantize(x, "fp8_e4m3", "mx")[0, :2].tolist() == [448.0, 1.0]
    x[0, 0] = 7.0  # fp4: scale 2^(2 - 2) = 1; 7 -> 6
    assert fake_quantize(x, "fp4_e2m1", "mx")[0, :2].tolist() == [6.0, 1.0]


def test_nvfp4_two_level_scales():
    x = _randn(8, 64, seed=4) * torch.tensor([0.01, 1.0, 5.0, 100.0]).repeat_interleave(16)
    q = quantize(x, "fp4_e2m1", "nvfp4")
    amax_t = x.abs().max()
    assert q.tensor_scale.item() == pytest.approx((amax_t / (6 * E4M3_MAX)).item(), rel=1e-7)
    assert q.scale.shape == (8, 4)
    assert torch.equal(q.scale.to(torch.float8_e4m3fn).float(), q.scale)  # block scales are E4M3 values
    ideal = x.reshape(8, 4, 16).abs().amax(-1) / 6 / q.tensor_scale
    assert ((q.scale - ideal).abs() <= ideal * 2.0**-4).all()  # E4M3 rounding: 3 mantissa bits
    assert (q.scale <= E4M3_MAX).all()


def test_non_finite_input_raises_naming_the_tensor():
    with pytest.raises(ValueError, match="weight"):
        quantize(torch.tensor([1.0, float("nan")]), name="weight")
    with pytest.raises(ValueError, match="x has non-finite"):
        fake_quantize(torch.tensor([[1.0, float("inf")]]), "fp8_e4m3", "token")


def test_bad_arguments_raise():
    x = torch.ones(4, 4)
    with pytest.raises(ValueError, match="scaling"):
        quantize(x, "fp8_e4m3", "rowwise")
    with pytest.raises(ValueError, match="block"):
        quantize(x, "fp8_e4m3", "tensor", block=(2, 2))
    with pytest.raises(ValueError, match="nvfp4"):
        quantize(x, "fp8_e4m3", "nvfp4")
    with pytest.raises(ValueError, match="floating-point"):
        quantize(torch.ones(4, dtype=torch.long))


def test_dtype_and_shape_are_preserved():
    x = _randn(2, 3, 64).bfloat16()
    out = fake_quantize(x, "fp8_e4m3", "group", 32)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape


def test_recipes():
    fp8 = get_recipe("fp8")
    assert fp8 is RECIPES["fp8_block"]
    assert (fp8.weight_fmt, fp8.weight_scaling, fp8.weight_block) == ("fp8_e4m3", "block", (128, 128))
    assert (fp8.act_fmt, fp8.act_scaling, fp8.act_block) == ("fp8_e4m3", "group", (1, 128))
    assert get_recipe("fp4") is RECIPES["nvfp4"] and RECIPES["nvfp4"].weight_block == (1, 16)
    assert RECIPES["mxfp4"].weight_fmt == "fp4_e2m1" and RECIPES["mxfp8"].act_scaling == "mx"
    assert (RECIPES["int8"].weight_scaling, RECIPES["int8"].act_scaling) == ("channel", "token")
    assert RECIPES["fp8_e5m2_block"].weight_fmt == "fp8_e5m2"
    with pytest.raises(ValueError, match="fp8_block"):
        get_recipe("fp9")
    with pytest.raises(ValueError, match="nvfp4"):
        QuantRecipe("bad", "fp8_e4m3", "nvfp4")
    with pytest.raises(ValueError, match="block"):
        QuantRecipe("bad", "fp8_e4m3", "group", (2, 64))
