"""QuantExperts: each expert of fused mixture-of-experts weights quantized like a dense QuantLinear."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ais_lightning.models import build_tiny_qwen3_moe
from ais_lightning.quant import (
    QuantExperts,
    QuantLinear,
    fake_quantize,
    fused_experts_unsupported,
    quantize_model,
    quantized_layers,
    switch_recipe,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _experts(seed: int = 0) -> nn.Module:
    experts = (
        build_tiny_qwen3_moe(seed=seed).model.layers[0].mlp.experts
    )  # gate_up [8, 192, 128], down [8, 128, 96]
    return experts.requires_grad_(False)


def _routing(
    n: int = 12, k: int = 2, e: int = 8, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 128, generator=gen)  # [N, H]
    index = torch.stack(
        [torch.randperm(e, generator=gen)[:k] for _ in range(n)]
    )  # [N, k], distinct per token
    weights = torch.rand(n, k, generator=gen)  # [N, k]
    return x, index, weights


def _independent_layer(weight: torch.Tensor, recipe: str) -> QuantLinear:
    plain = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    plain.weight = nn.Parameter(weight.clone(), requires_grad=False)
    return QuantLinear.from_linear(plain, recipe, "emulate")


@pytest.mark.parametrize("recipe", ["int8", "fp8", "fp4"])
def test_each_expert_equals_a_quantlinear_of_its_slice_on_its_tokens(recipe):
    experts = _experts()
    quant = QuantExperts(copy.deepcopy(experts), recipe, "emulate")
    x, index, weights = _routing()
    with torch.no_grad():
        out = quant(x, index, weights)  # [N, H]
        expected = torch.zeros_like(x)
        for e in range(8):
            tokens, pos = torch.where(index == e)  # the tokens routed to e (their set is what a recipe sees)
            if tokens.numel() == 0:
                continue
            gate_up = _independent_layer(experts.gate_up_proj[e], recipe)  # [2I, H]
            down = _independent_layer(experts.down_proj[e], recipe)  # [H, I]
            gate, up = gate_up(x[tokens]).chunk(2, dim=-1)
            expected.index_add_(0, tokens, down(F.silu(gate) * up) * weights[tokens, pos, None])
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        exact = experts(x, index, weights)
    assert 0 < (out - exact).norm() < 0.5 * exact.norm()  # quantized, near the fp32 experts (fp4: ~25% apart)


def test_int8_expert_by_hand_from_per_token_and_per_channel_scales():
    """W8A8 by hand: per-token int8 activations times per-output-channel int8 weights of the expert's slice."""
    experts = _experts()
    quant = QuantExperts(copy.deepcopy(experts), "int8", "emulate")
    x, _, _ = _routing(n=5)
    index = torch.full((5, 1), 3)  # every token to expert 3, weight 1
    with torch.no_grad():
        out = quant(x, index, torch.ones(5, 1))
        q = lambda t, s: fake_quantize(t, "int8", s)  # noqa: E731
        gate, up = (q(x, "token") @ q(experts.gate_up_proj[3], "channel").T).chunk(2, dim=-1)
        h = F.silu(gate) * up  # [5, I]
        expected = q(h, "token") @ q(experts.down_proj[3], "channel").T
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["int8", "fbgemm"])
def test_int8_integer_gemm_backend_matches_emulation(backend):
    experts = _experts()
    x, index, weights = _routing()
    with torch.no_grad():
        emulated = QuantExperts(copy.deepcopy(experts), "int8", "emulate")(x, index, weights)
        integer = QuantExperts(copy.deepcopy(experts), "int8", backend)(x, index, weights)
    torch.testing.assert_close(integer, emulated, rtol=1e-5, atol=1e-5)


def test_views_follow_in_place_weight_changes_and_device_or_dtype_moves():
    quant = QuantExperts(_experts(), "fp8", "emulate")
    x, index, weights = _routing()
    with torch.no_grad():
        before = quant(x, index, weights)
        quant.gate_up_proj.mul_(
            2.0
        )  # an in-place write (as a weight sync's copy_): the version counter moves
        after = quant(x, index, weights)
        assert not torch.allclose(before, after)
        assert quant.gate_up[5].weight.data_ptr() == quant.gate_up_proj[5].data_ptr()
        quant.double()
        assert quant.gate_up[5].weight.dtype == torch.float64
        assert quant.gate_up[5].weight.data_ptr() == quant.gate_up_proj[5].data_ptr()
        assert quant(x.double(), index, weights.double()).dtype == torch.float64


def test_quantize_model_replaces_experts_and_refuses_trainable_ones():
    model = build_tiny_qwen3_moe(seed=0)
    with pytest.raises(ValueError, match=r"fused experts model.layers.0.mlp.experts .*require grad"):
        quantize_model(model, "int8")
    assert not any(isinstance(m, (QuantLinear, QuantExperts)) for m in model.modules())  # nothing changed
    names = set(model.state_dict())
    quantize_model(model.requires_grad_(False), "int8")
    assert set(model.state_dict()) == names  # the same parameters under the same names
    assert all(isinstance(layer.mlp.experts, QuantExperts) for layer in model.model.layers)
    assert len(quantized_layers(model)) == 4 * (4 + 2 * 8)  # q, k, v, o and 2 per expert in each layer
    assert isinstance(model.model.layers[0].mlp.gate.weight, nn.Parameter)  # the router stays in fp32
    assert switch_recipe(model, "int4_w", backend="emulate") == 80  # experts included
    assert model.model.layers[2].mlp.experts.down[7].recipe.name == "int4_w"


def test_unsupported_layouts_are_named():
    experts = _experts()
    assert fused_experts_unsupported(experts) is None
    experts.is_transposed = True
    assert "is_transposed=True" in fused_experts_unsupported(experts)
    with pytest.raises(ValueError, match="QuantExperts cannot run Qwen3MoeExperts: is_transposed"):
        QuantExperts(experts, "int8")
    assert "no gate_up_proj" in fused_experts_unsupported(nn.Linear(2, 2))


def test_a_deep_copy_rebinds_its_views_to_its_own_parameters():
    quant = QuantExperts(_experts(), "int8", "emulate")
    quant.down[3].set_outlier_channels(torch.tensor([1, 5]))
    twin = copy.deepcopy(quant)
    assert (
        twin.gate_up[2].weight.data_ptr()
        == twin.gate_up_proj[2].data_ptr()
        != quant.gate_up_proj[2].data_ptr()
    )
    assert twin.down[3].outlier_channels.tolist() == [1, 5] and twin.recipe.name == "int8"
    x, index, weights = _routing()
    with torch.no_grad():
        assert torch.equal(twin(x, index, weights), quant(x, index, weights))
        twin.down_proj.zero_()  # a sync into the copy reaches its experts, not the original's
        assert torch.equal(twin(x, index, weights), torch.zeros_like(x))
        assert quant(x, index, weights).abs().sum() > 0
