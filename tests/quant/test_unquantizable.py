"""quantize_model refuses to leave matrix weights it cannot quantize silently in high precision."""

import pytest
import torch
from torch import nn

from ais_lightning.quant import QuantLinear, check_quantizable, quantize_model, unquantizable_weights
from tests.architectures import build


def test_gpt2_conv1d_weights_are_named_and_nothing_changes():
    model = build("gpt2")
    names = [name for name, _ in unquantizable_weights(model)]
    assert names[:2] == ["transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight"]
    assert len(names) == 16  # c_attn, c_proj, c_fc, mlp.c_proj in each of 4 blocks
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        ValueError, match=r"16 matrix weights of GPT2LMHeadModel.*c_attn.weight \[64, 192\].*fp8"
    ):
        quantize_model(model, "fp8")
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_fused_experts_of_another_layout_are_named_and_skip_accepts_them():
    model = build("qwen3_moe")
    assert unquantizable_weights(model) == []  # Qwen3-MoE's fused layout: QuantExperts runs it
    for layer in model.model.layers:
        layer.mlp.experts.is_transposed = True  # a layout QuantExperts does not implement
    names = [name for name, _ in unquantizable_weights(model)]
    assert names[:2] == ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    with pytest.raises(ValueError, match=r"mlp.experts.gate_up_proj \[4, 64, 64\]"):
        check_quantizable(model, "fp4")  # what TorchRolloutEngine.check_model runs
    quantize_model(model, "fp4", skip=["embed", "lm_head", "norm", "experts"])  # kept in fp32 knowingly
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear)


def test_linears_and_torch_convolutions_are_not_reported():
    model = nn.Sequential(nn.Linear(4, 4), nn.Conv1d(4, 4, 3), nn.LayerNorm(4))
    assert unquantizable_weights(model) == []
    expert = nn.Module()
    expert.weight = nn.Parameter(torch.zeros(2, 4, 4))
    assert unquantizable_weights(nn.ModuleDict({"moe": expert})) == [("moe.weight", torch.Size([2, 4, 4]))]
    assert unquantizable_weights(nn.ModuleDict({"moe": expert}), skip=["moe"]) == []
