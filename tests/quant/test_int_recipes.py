"""Nested-integer recipes in QuantLinear / quantize_model: numerics, OCS forward and gradients, state dicts,
switching recipes in place."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ais_lightning.quant import (
    NESTED_INT_RECIPES,
    RECIPES,
    QuantLinear,
    QuantRecipe,
    dequantize,
    fake_quantize,
    get_recipe,
    nested_int_recipe,
    nested_view,
    ocs_split,
    quantize,
    quantize_model,
    switch_recipe,
)

transformers = pytest.importorskip("transformers")
Qwen3Config, Qwen3ForCausalLM = transformers.Qwen3Config, transformers.Qwen3ForCausalLM


def _linear(k, n, seed=0, bias=True):
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias)


def _tiny_qwen3(seed=0):
    torch.manual_seed(seed)
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


def test_recipe_table():
    assert len(NESTED_INT_RECIPES) == 12 and all(n in RECIPES for n in NESTED_INT_RECIPES)
    r = get_recipe("int4")
    assert (r.weight_fmt, r.weight_scaling, r.weight_block) == ("nint4", "group_e4m3", (1, 32))
    assert (r.act_fmt, r.act_scaling, r.act_block, r.ocs_ratio) == ("nint4", "token_group_e4m3", (1, 32), 0.0)
    assert get_recipe("int2_w").weight_only and get_recipe("int2_w").weight_fmt == "nint2"
    assert get_recipe("int8_nested_ocs").ocs_ratio == 0.05 and get_recipe("int4_w_ocs").weight_only
    assert get_recipe("int8").weight_fmt == "int8" and get_recipe("int8").ocs_ratio == 0.0  # unchanged
    assert nested_int_recipe(2, weight_only=True, ocs_ratio=0.05) == RECIPES["int2_w_ocs"]
    with pytest.raises(ValueError, match="integer weight_fmt"):
        QuantRecipe("bad", "fp4_e2m1", "nvfp4", (1, 16), ocs_ratio=0.1)
    with pytest.raises(ValueError, match="ocs_ratio must be in"):
        QuantRecipe("bad", "nint4", "group_e4m3", ocs_ratio=1.0)
    with pytest.raises(ValueError, match="bits must be"):
        nested_int_recipe(3)


def test_one_int8_quantization_serves_int4_and_int2_layers():
    """The weight an int4 / int2 layer uses is the nested view of the int8_nested layer's weight."""
    lin = _linear(96, 40)
    q8 = quantize(lin.weight.detach(), "nint8", "group_e4m3", (1, 32))
    for bits, recipe in ((8, "int8_nested"), (4, "int4"), (2, "int2"), (4, "int4_w"), (2, "int2_w")):
        layer = QuantLinear.from_linear(lin, recipe)
        assert torch.equal(layer.weight_fq, dequantize(nested_view(q8, bits)))


@pytest.mark.parametrize("recipe,bits", [("int4", 4), ("int2", 2), ("int8_nested", 8)])
def test_emulated_forward_quantizes_weight_and_activation(recipe, bits):
    lin = _linear(64, 24)
    x = torch.randn(3, 5, 64)
    layer = QuantLinear.from_linear(lin, recipe)
    with torch.no_grad():
        w_q = fake_quantize(lin.weight, f"nint{bits}", "group_e4m3", 32)
        x_q = fake_quantize(x, f"nint{bits}", "token_group_e4m3", 32)
        assert torch.equal(layer(x), F.linear(x_q, w_q, lin.bias))
        weight_only = QuantLinear.from_linear(lin, f"{recipe}_w")(x)
        assert torch.equal(weight_only, F.linear(x, w_q, lin.bias))


@pytest.mark.parametrize("recipe", ["int4_ocs", "int2_ocs", "int4_w_ocs"])
def test_ocs_layer_runs_the_split_with_duplicated_columns(recipe):
    r = get_recipe(recipe)
    lin = _linear(128, 48)
    with torch.no_grad():
        lin.weight[:, [5, 70]] *= 20.0  # outlier input channels
    x = torch.randn(4, 128)
    layer = QuantLinear.from_linear(lin, recipe)
    split = ocs_split(lin.weight, ratio=0.05, fmt=r.weight_fmt, scaling="group_e4m3", block=(1, 32))
    assert split.n_split == 7 and {5, 70} <= set(split.channels.tolist())
    assert torch.equal(layer.ocs_index, split.index)
    with torch.no_grad():
        xs = x[:, split.index]  # [4, 135]
        if r.act_fmt is not None:
            xs = fake_quantize(xs, r.act_fmt, "token_group_e4m3", 32)
        assert torch.equal(layer(x), F.linear(xs, split.dequantized(), lin.bias))
        # The effective weight is the split summed back, and it beats the unsplit recipe's weight.
        eff = layer.effective_weight()
        assert torch.equal(eff, split.merge(split.dequantized()))
        plain = QuantLinear.from_linear(lin, recipe.replace("_ocs", "")).effective_weight()
        assert ((eff - lin.weight) ** 2).mean() < 0.5 * ((plain - lin.weight) ** 2).mean()
    assert "ocs_split=7" in repr(layer)


def test_ocs_straight_through_gradients():
    """Weight-only OCS: y = x' W'_q^T, W' = S(W) (halves), so dL/dW = x.sum(0) as without splitting, and
    dL/dx = the effective (merged) weight's column sums."""
    lin = _linear(64, 8)
    with torch.no_grad():
        lin.weight[:, 3] *= 10
    layer = QuantLinear.from_linear(lin, "int4_w_ocs")
    x = torch.randn(5, 64, requires_grad=True)
    layer(x).sum().backward()
    assert torch.allclose(lin.weight.grad, x.detach().sum(0).expand(8, 64), rtol=1e-6, atol=1e-6)
    assert torch.allclose(x.grad, layer.effective_weight().sum(0).expand(5, 64), rtol=1e-6, atol=1e-6)
    # With activation quantization the weight gradient sees the quantized (duplicated) activations.
    lin.weight.grad = None
    layer = QuantLinear.from_linear(lin, "int4_ocs")
    layer(x).sum().backward()
    xs = fake_quantize(x.detach()[:, layer.ocs_index], "nint4", "token_group_e4m3", 32).sum(0)  # [K + S]
    expected = xs[:64].clone()
    expected[layer.ocs_channels] = 0.5 * expected[layer.ocs_channels] + 0.5 * xs[64:]
    assert torch.allclose(lin.weight.grad, expected.expand(8, 64), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recipe", NESTED_INT_RECIPES)
def test_state_dict_round_trip(recipe):
    fp32 = _tiny_qwen3(seed=0)
    keys = list(fp32.state_dict())
    ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    src = quantize_model(copy.deepcopy(fp32), recipe)
    dst = quantize_model(_tiny_qwen3(seed=1), recipe)  # other weights, same recipe
    sd = src.state_dict()
    assert list(sd) == keys  # fp32 names, no quantization caches (OCS index, fake-quantized weights)
    assert all(torch.equal(sd[k], v) for k, v in fp32.state_dict().items())  # the fp32 masters
    with torch.no_grad():
        dst.load_state_dict(sd)  # weight sync: in-place copies, the layers re-quantize on their own
        out_src, out_dst = src(ids).logits, dst(ids).logits
        assert torch.equal(out_src, out_dst)
        assert not torch.equal(out_src, fp32(ids).logits)  # it really quantized
    layers = [m for m in dst.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 14 and all(m.recipe.name == recipe for m in layers)


def test_switch_recipe_in_place_keeps_the_masters():
    model = quantize_model(_tiny_qwen3(), "int8_nested")
    ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    params = {n: p for n, p in model.named_parameters()}
    snapshot = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        out8 = model(ids).logits
        assert switch_recipe(model, "int2_ocs") == 14
        out2 = model(ids).logits
        expected = quantize_model(_tiny_qwen3(), "int2_ocs")(ids).logits
        assert torch.equal(out2, expected)
        assert switch_recipe(model, "int8_nested") == 14
        assert torch.equal(model(ids).logits, out8)  # back to int8: nothing was lost
    assert all(p is params[n] and torch.equal(p, snapshot[n]) for n, p in model.named_parameters())
    # Only some layers: one decoder block.
    assert switch_recipe(model, "int4", names=["layers.0."]) == 7
    recipes = {n: m.recipe.name for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert {r for n, r in recipes.items() if "layers.0." in n} == {"int4"}
    assert {r for n, r in recipes.items() if "layers.1." in n} == {"int8_nested"}


def test_switch_recipe_refuses_incompatible_backend_without_changing_anything():
    model = quantize_model(_tiny_qwen3(), "int8", backend="int8")  # integer-GEMM layers
    with pytest.raises(ValueError, match="backend 'int8'"):
        switch_recipe(model, "int4")
    assert all(m.recipe.name == "int8" for m in model.modules() if isinstance(m, QuantLinear))
    assert switch_recipe(model, "int4", backend="emulate") == 14
    with pytest.raises(ValueError, match="only backend 'emulate'"):
        QuantLinear.from_linear(_linear(32, 16), "int4_ocs").set_recipe("int4_ocs", backend="int8")
    with pytest.raises(ValueError, match="names"):
        switch_recipe(model, "int4", names="layers.0.")
    layer = QuantLinear.from_linear(_linear(32, 16), "int4")
    with pytest.raises(ValueError, match="effective_weight needs backend 'emulate'"):
        QuantLinear.from_linear(_linear(32, 16), "int8", backend="int8").effective_weight()
    assert layer.effective_weight().shape == (16, 32)
