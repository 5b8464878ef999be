"""The built-in tiny Qwen3-MoE: fused expert layout, router outputs, determinism, the policy option."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3MoeForCausalLM

from ais_lightning.models import build_tiny_qwen3_moe, tiny_qwen3_moe_config
from ais_lightning.policy import POLICIES, Policy, TinyQwen3Moe

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_config_and_fused_expert_layout():
    cfg = tiny_qwen3_moe_config()
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (
        8,
        2,
        96,
        True,
    )
    assert cfg._experts_implementation == "eager" and cfg._attn_implementation == "eager"
    model = build_tiny_qwen3_moe()
    assert isinstance(model, Qwen3MoeForCausalLM)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (8, 2 * 96, 128)  # [E, 2I, H]
    assert experts.down_proj.shape == (8, 128, 96)  # [E, H, I]
    # Hand count: attention as the dense tiny Qwen3; per layer router 8*128, experts 8*3*128*96
    per_layer = 2 * 128 * 128 + 2 * 128 * 64 + 2 * 32 + 8 * 128 + 8 * 3 * 128 * 96 + 2 * 128
    assert sum(p.numel() for p in model.parameters()) == 99 * 128 + 4 * per_layer + 128


def test_config_rejects_bad_options():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        tiny_qwen3_moe_config(num_experts=4, num_experts_per_tok=5)
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_qwen3_moe_config(vocab_size=10)


def test_router_returns_logits_weights_indices_and_expert_matches_hand_computation():
    model = build_tiny_qwen3_moe(seed=1)
    block = model.model.layers[1].mlp
    x = torch.randn(5, 128)
    with torch.no_grad():
        logits, weights, index = block.gate(x)  # [N, E], [N, k], [N, k]
        assert logits.shape == (5, 8) and weights.shape == (5, 2) and index.dtype == torch.long
        probs = logits.softmax(-1)
        top = probs.topk(2, dim=-1)
        assert torch.equal(index, top.indices)
        torch.testing.assert_close(weights, top.values / top.values.sum(-1, keepdim=True))
        # The block's output by hand: sum over the k routed experts of weight * SwiGLU expert.
        out = block(x[None])[0]  # [N, H]
        e = block.experts
        expected = torch.zeros_like(x)
        for n in range(5):
            for j in range(2):
                w_gu, w_d = e.gate_up_proj[index[n, j]], e.down_proj[index[n, j]]
                gate, up = (x[n] @ w_gu.T).chunk(2)
                expected[n] += weights[n, j] * ((F.silu(gate) * up) @ w_d.T)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_seed_determinism():
    a, b, c = build_tiny_qwen3_moe(seed=0), build_tiny_qwen3_moe(seed=0), build_tiny_qwen3_moe(seed=1)
    wa, wb, wc = (m.model.layers[0].mlp.experts.gate_up_proj for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_policy_option_builds_and_scores_like_the_model():
    assert POLICIES["tiny_qwen3_moe"] is TinyQwen3Moe
    policy = TinyQwen3Moe(overrides={"num_hidden_layers": 2}).build(seed=0)
    assert isinstance(policy, Policy) and policy.config.num_hidden_layers == 2
    prompt = torch.tensor([[0, 5, 6, 7]])
    pmask = prompt != 0
    resp = torch.tensor([[8, 9, 10]])
    rmask = torch.ones_like(resp, dtype=torch.bool)
    with torch.no_grad():
        lp = policy.response_logprobs(prompt, pmask, resp, rmask).logprobs  # [1, 3]
        ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
        ref = policy.model(input_ids=ids).logits.log_softmax(-1)[0, 2:5].gather(-1, resp[0, :, None])[:, 0]
    torch.testing.assert_close(lp[0], ref, rtol=0, atol=1e-5)


def test_policy_option_refuses_aligned_quantization():
    with pytest.raises(ValueError, match="policy.aligned_quantization"):
        TinyQwen3Moe(aligned_quantization="int8")
    with pytest.raises(ValueError, match="overrides"):
        TinyQwen3Moe(overrides={"num_experts_per_tok": 99})


def test_config_composes():
    from ais_lightning.app.build import validate
    from ais_lightning.app.config import compose_train_config

    cfg = compose_train_config(["output_dir=/tmp/ais-test-unused", "policy=tiny_qwen3_moe"])
    components = validate(cfg)
    assert isinstance(components.policy, TinyQwen3Moe)


def test_router_replay_needs_an_engine_that_records_routing(monkeypatch):
    from ais_lightning.app.build import validate
    from ais_lightning.app.config import compose_train_config
    from ais_lightning.rollout import TorchRolloutEngine

    overrides = ["output_dir=/tmp/ais-test-unused", "policy=tiny_qwen3_moe", "policy.router_replay=true"]
    assert validate(compose_train_config([*overrides, "rollout=int8"])).policy.router_replay
    monkeypatch.setattr(
        TorchRolloutEngine, "RECORDS_ROUTING", False
    )  # as an engine that records none (vLLM here)
    with pytest.raises(ValueError, match="policy.router_replay=true replays the routing .* records none"):
        validate(compose_train_config([*overrides, "rollout=int8"]))
