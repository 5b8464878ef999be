"""Outlier input channels kept in high precision (ais_lightning.quant.outliers) and the int8 integer GEMM."""

import pytest
import torch
from torch import nn

from ais_lightning.quant import (
    InputRange,
    OutlierCalibration,
    QuantLinear,
    largest_channels,
    outlier_count,
)
from ais_lightning.quant.cpu_int8 import int8_linear, int8_weight_operands


def _linear(k: int, n: int, seed: int = 0, bias: bool = True) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias)


def _int8_by_hand(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """W8A8 written out: per-token / per-channel symmetric scales amax/127, integer product, scaled back."""
    s_x = x.abs().amax(1, keepdim=True) / 127  # [M, 1]
    s_w = w.abs().amax(1) / 127  # [N]
    q_x = torch.round(x / s_x).long()  # [M, K]
    q_w = torch.round(w / s_w[:, None]).long()  # [N, K]
    y = (q_x @ q_w.t()).double() * s_x.double() * s_w.double()
    return (y + (0 if b is None else b.double())).float()


def test_largest_channels_and_counts():
    amax = torch.tensor([1.0, 9.0, 3.0, 9.0, 0.5, 7.0])
    assert largest_channels(amax, 3).tolist() == [1, 3, 5]  # ascending indices
    assert largest_channels(amax, 1).tolist() == [1]  # a tie goes to the lower index
    assert largest_channels(amax, 0).tolist() == []
    with pytest.raises(ValueError, match="n must be an int in"):
        largest_channels(amax, 7)
    with pytest.raises(ValueError, match="1-D"):
        largest_channels(amax[None], 1)
    assert outlier_count(576, 0.05) == 29  # ceil(28.8)
    assert outlier_count(640, 0.1) == 64  # 0.1 * 640 is 64.000...01 in floating point
    assert outlier_count(10, 0.0) == 0
    with pytest.raises(ValueError, match="outlier_fraction must be a number in"):
        outlier_count(10, 1.0)


def test_int8_linear_is_the_integer_product_of_per_token_and_per_channel_codes():
    lin = _linear(96, 40)
    x = torch.randn(7, 96) * torch.linspace(0.1, 5, 96)
    w_t, w_scale = int8_weight_operands(lin.weight)
    assert w_t.dtype == torch.int8 and w_t.shape == (96, 40) and w_scale.shape == (40,)
    got = int8_linear(x, w_t, w_scale, lin.bias)
    torch.testing.assert_close(
        got, _int8_by_hand(x, lin.weight.detach(), lin.bias.detach()), rtol=1e-6, atol=1e-6
    )
    # the same numerics as the emulated recipe, to fp32 rounding
    emulated = QuantLinear.from_linear(lin, "int8", backend="emulate")
    integer = QuantLinear.from_linear(lin, "int8", backend="int8")
    with torch.no_grad():
        torch.testing.assert_close(integer(x), emulated(x), rtol=1e-5, atol=1e-5)
        assert (integer(x) - lin(x)).abs().max() > 0  # not silently fp32
    x3 = torch.randn(2, 3, 96)
    with torch.no_grad():
        assert integer(x3).shape == (2, 3, 40)
        torch.testing.assert_close(integer(x3)[1], integer(x3[1]))  # per token: rows do not interact


@pytest.mark.parametrize("backend", ["emulate", "int8", "fbgemm"])
def test_outlier_channels_run_in_high_precision(backend):
    """y = Q(x * keep) Q(W * keep)^T + x[:, out] W[:, out]^T + b, with the int8 recipe written by hand."""
    lin = _linear(64, 24)
    x = torch.randn(5, 64)
    x[:, 7] *= 300.0  # an outlier channel
    x[2, 40] = 90.0
    out = torch.tensor([7, 40])
    keep = torch.ones(64).index_fill(0, out, 0.0)
    w = lin.weight.detach()
    expected = _int8_by_hand(x * keep, w * keep, lin.bias.detach()) + x[:, out] @ w[:, out].t()
    layer = QuantLinear.from_linear(lin, "int8", backend=backend)
    layer.set_outlier_channels(out)
    with torch.no_grad():
        got = layer(x)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        plain = QuantLinear.from_linear(_linear(64, 24), "int8", backend=backend)(x)
        ref = lin(x)
        assert (got - ref).abs().max() < 0.1 * (plain - ref).abs().max()  # the outliers were the error
    layer.set_outlier_channels(None)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), plain)
    assert list(layer.state_dict()) == ["weight", "bias"]


def test_outlier_channels_with_blockwise_fp8_keep_the_block_layout():
    """The outlier columns are zeroed in place: the 1x128 activation groups and 128x128 weight blocks of the
    other channels are those of the zeroed tensors (a kernel keeps its layout)."""
    from ais_lightning.quant import fake_quantize

    lin = _linear(256, 32)
    x = torch.randn(3, 256)
    x[:, 200] *= 1e3
    out = torch.tensor([200])
    keep = torch.ones(256).index_fill(0, out, 0.0)
    w = lin.weight.detach()
    xq = fake_quantize(x * keep, "fp8_e4m3", "group", (1, 128))
    wq = fake_quantize(w * keep, "fp8_e4m3", "block", (128, 128))
    expected = xq @ wq.t() + lin.bias.detach() + x[:, out] @ w[:, out].t()
    layer = QuantLinear.from_linear(lin, "fp8")
    layer.set_outlier_channels(out)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected)
        eff = layer.effective_weight()
    torch.testing.assert_close(eff[:, 200], w[:, 200])  # exact column
    torch.testing.assert_close(eff[:, :200], wq[:, :200])


def test_outlier_channels_gradients_flow_straight_through():
    lin = _linear(32, 8)
    layer = QuantLinear.from_linear(lin, "int8")
    layer.set_outlier_channels(torch.tensor([3]))
    x = torch.randn(4, 32, requires_grad=True)
    layer(x).sum().backward()
    # straight-through: d sum(y) / dW is the sum over tokens of the activation the GEMM saw, and d sum(y) / dx
    # the column sums of the weight it saw: quantized for the int8 columns, exact for the outlier one
    from ais_lightning.quant import fake_quantize

    keep = torch.ones(32).index_fill(0, torch.tensor([3]), 0.0)
    seen = fake_quantize(x.detach() * keep, "int8", "token") + x.detach() * (1 - keep)
    torch.testing.assert_close(layer.weight.grad, seen.sum(0).expand(8, 32))
    torch.testing.assert_close(x.grad, layer.effective_weight().sum(0).expand(4, 32))
    assert layer.effective_weight()[:, 3].equal(lin.weight.detach()[:, 3])


def test_set_outlier_channels_checks_its_input():
    layer = QuantLinear.from_linear(_linear(16, 4), "int8")
    with pytest.raises(ValueError, match=r"channels must lie in \[0, 16\)"):
        layer.set_outlier_channels(torch.tensor([16]))
    with pytest.raises(ValueError, match="1-D integer tensor"):
        layer.set_outlier_channels(torch.tensor([1.0]))
    layer.set_outlier_channels(torch.tensor([3, 1, 3]))
    assert layer.outlier_channels.tolist() == [1, 3]
    ocs = QuantLinear.from_linear(_linear(64, 4), "int4_ocs")
    with pytest.raises(ValueError, match="splits outlier channels itself"):
        ocs.set_outlier_channels(torch.tensor([1]))
    with pytest.raises(ValueError, match="use one or the other"):
        layer.set_recipe("int4_ocs")
    assert layer.recipe.name == "int8"  # a refused switch changes nothing


def test_input_range_is_a_running_max_per_channel():
    r = InputRange(3)
    r.update(torch.tensor([[1.0, -5.0, 0.0], [2.0, 1.0, -1.0]]))
    r.update(torch.tensor([[[-4.0, 0.5, 0.0]]]))
    assert r.amax.tolist() == [4.0, 5.0, 1.0]
    r.update(torch.empty(0, 3))
    assert r.amax.tolist() == [4.0, 5.0, 1.0]
    with pytest.raises(ValueError, match="input has 2 channels, the layer has 3"):
        r.update(torch.zeros(1, 2))


def test_calibration_observes_bypasses_and_sets_channels_per_window():
    a = QuantLinear.from_linear(_linear(40, 8, seed=1), "int8")
    b = QuantLinear.from_linear(_linear(40, 8, seed=2), "int8")
    cal = OutlierCalibration([a, b], fraction=0.05)  # ceil(2.0) = 2 channels
    x = torch.randn(6, 40)
    x[:, 11] *= 50
    x[:, 30] *= 20
    with torch.no_grad():
        with cal.observe(bypass=True):
            torch.testing.assert_close(a(x), nn.functional.linear(x, a.weight, a.bias))  # unquantized
            b(x)
        assert a.input_range is None and not cal.calibrated
        assert cal.apply() == 2 and cal.calibrated
        assert a.outlier_channels.tolist() == b.outlier_channels.tolist() == [11, 30]
        # a later window that only sees `a`, with a new outlier: `a` moves, `b` keeps its channels
        y = torch.randn(6, 40)
        y[:, 2] *= 80
        y[:, 11] *= 40
        with cal.observe():
            quantized = a(y)
        assert not torch.equal(quantized, nn.functional.linear(y, a.weight, a.bias))  # observed, not bypassed
        assert cal.apply() == 1
        assert a.outlier_channels.tolist() == [2, 11] and b.outlier_channels.tolist() == [11, 30]
        assert cal.apply() == 0  # nothing observed since: nothing changes
        assert a.outlier_channels.tolist() == [2, 11]


def test_calibration_state_round_trip_resumes_the_same_channels():
    """A checkpoint of the calibration (channels, and the ranges seen since the last apply) restored on a
    fresh copy of the layers picks the same channels at the next apply as the original does."""
    g = torch.Generator().manual_seed(0)
    layers = [QuantLinear.from_linear(nn.Linear(32, 4), "int8") for _ in range(2)]
    twins = [QuantLinear.from_linear(nn.Linear(32, 4), "int8") for _ in range(2)]
    original, restored = OutlierCalibration(layers, 0.1), OutlierCalibration(twins, 0.1)
    x1, x2 = torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)
    x1[:, 5] *= 50
    x2[:, 9] *= 80
    with original.observe(bypass=True):
        for layer in layers:
            layer(x1)
    original.apply()  # channels from x1 (5 among them)
    with original.observe():
        for layer in layers:
            layer(x2)  # ranges since the apply: x2's
    restored.load_state_dict(original.state_dict())
    assert restored.calibrated
    for a, b in zip(layers, twins):
        assert torch.equal(a.outlier_channels, b.outlier_channels) and 5 in b.outlier_channels.tolist()
    original.apply()
    restored.apply()
    for a, b in zip(layers, twins):
        assert torch.equal(a.outlier_channels, b.outlier_channels) and 9 in b.outlier_channels.tolist()


def test_calibration_state_of_other_layers_or_fraction_is_refused():
    layers = [QuantLinear.from_linear(nn.Linear(32, 4), "int8")]
    state = OutlierCalibration(layers, 0.1).state_dict()
    with pytest.raises(ValueError, match="does not fit"):
        OutlierCalibration(layers, 0.2).load_state_dict(state)
    with pytest.raises(ValueError, match="does not fit"):
        OutlierCalibration(layers * 2, 0.1).load_state_dict(state)
    state["ranges"] = [torch.ones(7)]
    with pytest.raises(ValueError, match="shape"):
        OutlierCalibration(layers, 0.1).load_state_dict(state)


def test_int8_per_token_is_quantize_bit_for_bit():
    """The decode path's one-pass token quantization gives ``quantize(x, "int8", "token")``'s codes and scales,
    zero rows (the scale floor) and a wide row included."""
    from ais_lightning.quant import quantize
    from ais_lightning.quant.cpu_int8 import int8_per_token

    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
    x[1] = 0.0
    x[2, 7] = 3000.0
    codes, scale = int8_per_token(x)
    ref = quantize(x, "int8", "token")
    assert codes.dtype == torch.int8 and torch.equal(codes, ref.data)
    assert torch.equal(scale, ref.scale)


def test_setting_the_same_outlier_channels_keeps_the_quantized_caches():
    layer = QuantLinear.from_linear(_linear(32, 4), "int8")
    layer.set_outlier_channels(torch.tensor([3, 9]))
    x = torch.randn(5, 32)
    y = layer(x)
    stamp = layer._stamp
    layer.set_outlier_channels(torch.tensor([9, 3]))  # the same set
    assert layer._stamp is stamp and torch.equal(layer(x), y)
    layer.set_outlier_channels(torch.tensor([3]))
    assert layer._stamp is None
