"""FP8 KV-cache fake quantization with per-head scales."""

import pytest
import torch

from ais_lightning.quant import fake_quantize_kv, kv_amax, kv_scale_from_amax
from ais_lightning.quant.scaling import SCALE_FLOOR


def test_scale_from_amax_with_floor():
    scale = kv_scale_from_amax(torch.tensor([448.0, 2.0, 0.0]), "fp8_e4m3")
    assert scale.tolist() == pytest.approx([1.0, 2.0 / 448.0, SCALE_FLOOR])
    assert kv_scale_from_amax(57344.0, "fp8_e5m2").item() == 1.0
    with pytest.raises(ValueError, match="amax"):
        kv_scale_from_amax(torch.tensor([float("nan")]))


def test_per_head_scale_round_trip_saturation_and_zeros():
    # Head 0 scale 1: representable E4M3 values round-trip, 1000 saturates to 448, 1.0625 -> 1.0 (tie to even).
    # Head 1 scale 0.5: the same values times 0.5. Head 2 is all zeros (floored scale).
    kv = torch.zeros(1, 3, 2, 4)
    kv[0, 0] = torch.tensor([[1.0, -2.5, 448.0, 1000.0], [0.015625, 1.0625, -3.0, 0.0]])
    kv[0, 1] = 0.5 * kv[0, 0]
    scale = kv_scale_from_amax(torch.tensor([448.0, 224.0, 0.0]))
    expected = torch.zeros_like(kv)
    expected[0, 0] = torch.tensor([[1.0, -2.5, 448.0, 448.0], [0.015625, 1.0, -3.0, 0.0]])
    expected[0, 1] = 0.5 * expected[0, 0]
    out = fake_quantize_kv(kv, scale)
    assert torch.equal(out, expected)
    assert torch.equal(fake_quantize_kv(kv, scale.reshape(1, 3, 1, 1)), out)


def test_error_bound_and_dtype():
    kv = torch.randn(2, 4, 8, 16, generator=torch.Generator().manual_seed(0)).bfloat16()
    scale = kv_scale_from_amax(kv_amax(kv))
    assert scale.shape == (4,)
    out = fake_quantize_kv(kv, scale)
    assert out.dtype == torch.bfloat16
    # E4M3: relative half step 2^-4 for normals, absolute 2^-10 * scale below 2^-6 * scale; plus bf16 output rounding.
    err = (out.float() - kv.float()).abs()
    s = scale.reshape(1, 4, 1, 1)
    bound = torch.maximum(kv.float().abs() * 2.0**-4, 2.0**-10 * s) + out.float().abs() * 2.0**-8
    assert (err <= bound).all()


def test_bad_shapes_raise():
    kv = torch.zeros(1, 3, 2, 4)
    with pytest.raises(ValueError, match="scale"):
        fake_quantize_kv(kv, torch.ones(2))
    with pytest.raises(ValueError, match="kv"):
        fake_quantize_kv(torch.zeros(3, 2, 4), torch.ones(3))
    with pytest.raises(ValueError, match="scale"):
        fake_quantize_kv(kv, torch.zeros(3))


def test_kv_amax_ignores_masked_positions():
    kv = torch.ones(2, 3, 4, 5)
    kv[0, :, 3] = 100.0  # padding position of sequence 0
    kv[1, 2, 0, 0] = -7.0
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    assert kv_amax(kv).tolist() == [100.0, 100.0, 100.0]
    assert kv_amax(kv, mask).tolist() == [1.0, 1.0, 7.0]
    with pytest.raises(ValueError, match="mask"):
        kv_amax(kv, mask[:, :3])
