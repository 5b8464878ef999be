"""QuantLinear backends, quantize_model on a tiny random Qwen3, refresh."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ais_lightning.quant import (
    QuantLinear,
    fake_quantize,
    quantize_model,
    refresh_quantized,
    scaled_mm_linear,
)

transformers = pytest.importorskip("transformers")
# Resolve the lazy Qwen3 classes at collection: importing them takes ~10 s on a loaded 2-core machine
# (shared with every other test that builds a Qwen3); the tests themselves take about a second.
Qwen3Config, Qwen3ForCausalLM = transformers.Qwen3Config, transformers.Qwen3ForCausalLM

E4M3_MAX = 448.0


def _linear(k, n, seed=0, bias=True):
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias)


def _ref_fp8_block_weight(w):
    """Independent per-block loop: 128x128 blocks, scale = amax / 448, E4M3 cast."""
    out = torch.empty_like(w)
    for i in range(0, w.shape[0], 128):
        for j in range(0, w.shape[1], 128):
            blk = w[i : i + 128, j : j + 128]
            s = blk.abs().max() / E4M3_MAX
            out[i : i + 128, j : j + 128] = (blk / s).to(torch.float8_e4m3fn).float() * s
    return out


def _ref_fp8_group_act(x):
    """Independent per-token 1x128 groups."""
    out = torch.empty_like(x)
    for j in range(0, x.shape[-1], 128):
        g = x[..., j : j + 128]
        s = g.abs().amax(dim=-1, keepdim=True) / E4M3_MAX
        out[..., j : j + 128] = (g / s).to(torch.float8_e4m3fn).float() * s
    return out


def test_emulate_fp8_block_matches_independent_reference():
    lin = _linear(200, 150)  # neither dim divides 128: padded blocks
    x = torch.randn(2, 5, 200)
    layer = QuantLinear.from_linear(lin, "fp8", backend="emulate")
    with torch.no_grad():
        expected = F.linear(_ref_fp8_group_act(x), _ref_fp8_block_weight(lin.weight), lin.bias)
        out = layer(x)
        assert torch.allclose(out, expected, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(out, lin(x), rtol=1e-4, atol=1e-5)  # it really quantized


def test_emulate_int8_recipe_matches_independent_reference():
    lin = _linear(64, 32)
    x = torch.randn(7, 64)
    with torch.no_grad():
        sw = lin.weight.abs().amax(1, keepdim=True) / 127
        sx = x.abs().amax(1, keepdim=True) / 127
        expected = F.linear(torch.round(x / sx) * sx, torch.round(lin.weight / sw) * sw, lin.bias)
        out = QuantLinear.from_linear(lin, "int8")(x)
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_from_linear_shares_parameters_and_keeps_state_dict_keys():
    lin = _linear(32, 16)
    keys = list(lin.state_dict())
    layer = QuantLinear.from_linear(lin, "mxfp4")
    assert layer.weight is lin.weight and layer.bias is lin.bias
    assert list(layer.state_dict()) == keys == ["weight", "bias"]
    assert isinstance(layer, nn.Linear)
    nobias = QuantLinear.from_linear(_linear(32, 16, bias=False), "nvfp4")
    assert list(nobias.state_dict()) == ["weight"] and nobias(torch.randn(3, 32)).shape == (3, 16)


@pytest.mark.parametrize("backend", ["int8", "fbgemm"])
def test_int8_backend_is_close_to_fp32_within_derived_bound(backend):
    """Integer W8A8: weight per channel (step s_w = amax_row/127), activation per token (step s_x = amax_token/127).
    |y - y_q| <= sum_k |x_k| s_w/2 + |W_nk| s_x/2 + s_x s_w/4 per output (products of rounding errors, each at
    most half a step)."""
    lin = _linear(256, 64)
    x = torch.randn(16, 256)
    layer = QuantLinear.from_linear(lin, "int8", backend=backend)
    with torch.no_grad():
        ref, out = lin(x), layer(x)
        s_w = lin.weight.abs().amax(1) / 127  # [N]
        s_x = x.abs().amax(1, keepdim=True) / 127  # [M, 1]
        k = x.shape[1]
        bound = x.abs().sum(1, keepdim=True) * s_w / 2 + lin.weight.abs().sum(1) * s_x / 2 + k * s_x * s_w / 4
    err = (out - ref).abs()
    assert (err <= bound * 1.01).all()
    assert err.max() > 0  # not silently running fp32
    assert list(layer.state_dict()) == ["weight", "bias"]
    assert torch.equal(layer.state_dict()["weight"], lin.weight)


def test_int8_backend_needs_int8_recipe():
    for backend in ("int8", "fbgemm"):
        with pytest.raises(ValueError, match=f"backend '{backend}' .*only runs the 'int8' recipe"):
            QuantLinear.from_linear(_linear(16, 16), "fp8", backend=backend)
    with pytest.raises(ValueError, match="backend"):
        QuantLinear.from_linear(_linear(16, 16), "fp8", backend="tpu")


@pytest.mark.parametrize("backend", ["int8", "fbgemm"])
def test_load_state_dict_then_refresh_int8_backend(backend):
    src, dst = _linear(64, 32, seed=1), _linear(64, 32, seed=2)
    layer = QuantLinear.from_linear(dst, "int8", backend=backend)
    x = torch.randn(4, 64)
    with torch.no_grad():
        layer.load_state_dict(src.state_dict())
        refresh_quantized(layer)
        expected = QuantLinear.from_linear(_linear(64, 32, seed=1), "int8", backend=backend)(x)
        assert torch.equal(layer(x), expected)


def test_refresh_after_weight_change_changes_output():
    lin = _linear(64, 32)
    layer = QuantLinear.from_linear(lin, "fp8")
    model = nn.Sequential(layer)
    x = torch.randn(4, 64)
    with torch.no_grad():
        before = model(x)
        layer.weight.data.mul_(2.0)  # `.data` writes bypass the version counter: cache is stale
        assert torch.equal(model(x), before)
        assert refresh_quantized(model) == 1
        after = model(x)
        assert torch.allclose(after - lin.bias, 2 * (before - lin.bias), rtol=1e-5, atol=1e-6)
        layer.weight.copy_(torch.zeros_like(layer.weight))  # in-place copy_: refreshed automatically
        assert torch.allclose(model(x), lin.bias.expand(4, 32))


def test_layer_built_under_inference_mode():
    with torch.inference_mode():
        lin = _linear(32, 16)
        out = QuantLinear.from_linear(lin, "fp8")(torch.ones(2, 32))
    assert out.shape == (2, 16)


def test_straight_through_gradients():
    lin = _linear(64, 8)
    layer = QuantLinear.from_linear(lin, "fp8")
    x = torch.randn(3, 64, requires_grad=True)
    layer(x).sum().backward()
    w_hat = fake_quantize(lin.weight.detach(), "fp8_e4m3", "block", (128, 128))
    x_hat = fake_quantize(x.detach(), "fp8_e4m3", "group", 128)
    assert torch.allclose(x.grad, w_hat.sum(0).expand(3, 64))
    assert torch.allclose(lin.weight.grad, x_hat.sum(0).expand(8, 64))


def test_fp8_gemm_refuses_cpu():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(RuntimeError, match="CUDA"):
        QuantLinear.from_linear(_linear(32, 32), "fp8_channel", backend="fp8_gemm")


def test_scaled_mm_linear_numerics_on_cpu():
    """The fp8_gemm forward through torch._scaled_mm (its CPU kernel) equals the emulated fp8_channel."""
    lin = _linear(64, 32)
    x = torch.randn(5, 64)
    w8 = (lin.weight.detach() / (lin.weight.detach().abs().amax(1, keepdim=True) / E4M3_MAX)).to(
        torch.float8_e4m3fn
    )
    w_scale = (lin.weight.detach().abs().amax(1) / E4M3_MAX).reshape(1, -1)
    with torch.no_grad():
        out = scaled_mm_linear(x, w8.t(), w_scale, lin.bias, "fp8_e4m3", "token")
        expected = QuantLinear.from_linear(lin, "fp8_channel")(x)
    assert torch.allclose(out, expected, rtol=2e-2, atol=2e-2)  # bf16 output of row-wise scaled_mm


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recipe", ["fp8_tensor", "fp8_channel"])
def test_fp8_gemm_backend_on_cuda(recipe):
    lin = _linear(256, 128).cuda()
    x = torch.randn(32, 256, device="cuda")
    with torch.no_grad():
        out = QuantLinear.from_linear(lin, recipe, backend="fp8_gemm")(x)
        expected = QuantLinear.from_linear(lin, recipe, backend="emulate")(x)
    assert torch.allclose(out, expected, rtol=2e-2, atol=2e-2)


def _tiny_qwen3():
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(cfg).eval()


def test_quantize_model_on_tiny_qwen3():
    model = _tiny_qwen3()
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    keys = list(model.state_dict())
    with torch.no_grad():
        ref = model(ids).logits
        quantize_model(model, "fp8", backend="emulate")
        out = model(ids).logits
    quantized = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert len(quantized) == 2 * 7 and all(any(n.endswith(p) for n in quantized) for p in projections)
    assert type(model.lm_head) is nn.Linear
    assert type(model.model.embed_tokens) is nn.Embedding
    assert not any("norm" in n or "embed" in n for n in quantized)
    assert list(model.state_dict()) == keys
    diff = (out - ref).abs().max().item()
    assert 0 < diff < 0.1 * ref.abs().max().item()
    # Weight sync: perturb the weights through load_state_dict, refresh, and the logits move.
    sd = {
        k: v + 0.05 * torch.randn_like(v) if k.endswith("q_proj.weight") else v
        for k, v in model.state_dict().items()
    }
    with torch.no_grad():
        model.load_state_dict(sd)
        assert refresh_quantized(model) == 14
        assert not torch.equal(model(ids).logits, out)


def test_quantize_model_skip_list():
    model = _tiny_qwen3()
    quantize_model(model, "int8", skip=[])
    assert isinstance(model.lm_head, QuantLinear)
    model = _tiny_qwen3()
    quantize_model(model, "int8", skip=["mlp"])
    assert isinstance(model.lm_head, QuantLinear) and type(model.model.layers[0].mlp.up_proj) is nn.Linear
    with pytest.raises(ValueError, match="skip"):
        quantize_model(model, "int8", skip="mlp")
