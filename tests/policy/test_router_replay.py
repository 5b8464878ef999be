"""Rollout routing replay (R3): the engine records every token's experts, the trainer's forward replays them."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from ais_lightning.models import build_tiny_qwen3, build_tiny_qwen3_moe
from ais_lightning.models.routing import (
    moe_routers,
    replay_gate_weights,
    routing_dtype,
    routing_replay_mask,
    topk_sets_differ,
)
from ais_lightning.policy import Policy
from ais_lightning.rollout import TorchRolloutEngine
from ais_lightning.rollout.base import SamplingConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12]]
SAMPLING = SamplingConfig(n=4, max_new_tokens=12, stop_token_ids=[2], seed=0)


def test_replay_mask_by_hand():
    prompt_mask = torch.tensor([[False, True, True], [True, True, True]])
    response_mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    expected = torch.tensor(
        [
            [
                False,
                True,
                True,
                True,
                True,
                False,
                False,
            ],  # last valid response token (t = 2) is not replayed
            [True, True, True, True, True, True, False],
        ]
    )
    assert torch.equal(routing_replay_mask(prompt_mask, response_mask), expected)


def test_gate_weights_reproduce_the_router_on_its_own_experts_and_sets_ignore_order():
    router = moe_routers(build_tiny_qwen3_moe(seed=0))[2]
    with torch.no_grad():
        logits, weights, index = router(torch.randn(6, 128))
    torch.testing.assert_close(replay_gate_weights(logits, index, normalize=True), weights)
    probs = logits.softmax(-1)
    swapped = index.flip(-1)
    torch.testing.assert_close(replay_gate_weights(logits, swapped, False), probs.gather(-1, swapped))
    assert not topk_sets_differ(index, swapped).any()
    assert topk_sets_differ(index, (index + 1) % 8).all()
    assert routing_dtype(8) == torch.uint8 and routing_dtype(300) == torch.int16


def test_engine_records_every_position_and_agrees_with_the_trainer_at_fp32():
    model = build_tiny_qwen3_moe(seed=0)
    batch = TorchRolloutEngine(model, "fp32").generate(PROMPTS, SAMPLING)
    b, p, t = batch.response_ids.shape[0], batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    assert batch.routing.shape == (b, p + t, 4, 2) and batch.routing.dtype == torch.uint8
    policy = Policy(model)  # no replay: the trainer routes by itself, and its own top-k is kept
    with torch.no_grad():
        policy.batch_logprobs(batch)
    own, used = policy.routing_replay.last_routing()  # [B, P + T, L, k] each
    mask = routing_replay_mask(batch.prompt_mask, batch.response_mask)
    assert torch.equal(own, used)
    assert torch.equal(
        own[mask], batch.routing[mask].long()
    )  # same experts, same order, every token and layer
    assert TorchRolloutEngine(build_tiny_qwen3(), "fp32").generate(PROMPTS, SAMPLING).routing is None


def test_with_replay_the_trainer_uses_the_engines_experts_for_every_token():
    """Token by token at fp4, where the engine's routers disagree with the trainer's on many tokens."""
    model = build_tiny_qwen3_moe(seed=0)
    batch = TorchRolloutEngine(model, "fp4").generate(PROMPTS, SAMPLING)
    mask = routing_replay_mask(batch.prompt_mask, batch.response_mask)  # [B, P + T]
    engine = batch.routing.long()  # [B, P + T, L, k]
    policy = Policy(copy.deepcopy(model), router_replay=True)
    with torch.no_grad():
        replayed = policy.batch_logprobs(batch).logprobs
    own, used = policy.routing_replay.last_routing()
    assert topk_sets_differ(own, engine)[
        mask
    ].any()  # without replay the trainer would route some differently
    for row, pos in mask.nonzero().tolist():  # every replayed token, every layer: the engine's experts
        assert torch.equal(used[row, pos], engine[row, pos]), (row, pos)
    assert torch.equal(used[~mask], own[~mask])  # elsewhere the trainer's own routing
    with torch.no_grad():
        plain = Policy(copy.deepcopy(model)).batch_logprobs(batch).logprobs
    assert not torch.equal(replayed, plain)


def test_replay_routes_through_given_experts_and_trains_the_router():
    model = build_tiny_qwen3_moe(seed=0)
    batch = TorchRolloutEngine(model, "fp32").generate(PROMPTS, SAMPLING)
    shifted = (batch.routing.long() + 3) % 8  # other experts everywhere
    batch.routing = shifted.to(torch.uint8)
    policy = Policy(model, router_replay=True)
    logprobs = policy.batch_logprobs(batch).logprobs
    _, used = policy.routing_replay.last_routing()
    mask = routing_replay_mask(batch.prompt_mask, batch.response_mask)
    assert torch.equal(used[mask], shifted[mask])
    logprobs[batch.response_mask.clone()].sum().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in moe_routers(model))


def test_deep_copies_replay_on_their_own_routers():
    policy = Policy(build_tiny_qwen3_moe(seed=0), router_replay=True)
    reference = copy.deepcopy(policy)  # GRPO's reference policy
    batch = TorchRolloutEngine(policy.model, "fp32").generate(PROMPTS, SAMPLING)
    with torch.no_grad():
        reference.batch_logprobs(batch)
    assert reference.routing_replay.last is not None and policy.routing_replay.last is None


def test_bad_options_and_routing_are_refused():
    with pytest.raises(ValueError, match="router_replay=true .* TinyQwen3|no top-k routers"):
        Policy(build_tiny_qwen3(), router_replay=True)
    policy = Policy(build_tiny_qwen3_moe(), router_replay=True)
    batch = TorchRolloutEngine(policy.model, "fp32").generate(PROMPTS, SAMPLING)
    batch.routing = batch.routing[:, :, :3]
    with pytest.raises(ValueError, match=r"routing must be \[B, P \+ T, L, k\]"):
        policy.batch_logprobs(batch)


def test_activation_checkpointing_recomputes_layers_under_the_replayed_routing():
    """Backward recomputes each layer: it must route as the replayed forward did, even after other forwards."""
    model = build_tiny_qwen3_moe(seed=0)
    batch = TorchRolloutEngine(model, "fp32").generate(PROMPTS, SAMPLING)
    batch.routing = ((batch.routing.long() + 3) % 8).to(torch.uint8)  # far from the trainer's own routing
    mask = batch.response_mask.clone()
    grads = []
    for checkpointing in (False, True):
        policy = Policy(copy.deepcopy(model), router_replay=True, gradient_checkpointing=checkpointing)
        logprobs = policy.batch_logprobs(batch).logprobs
        with torch.no_grad():  # another forward in between (pi_old of another batch, a reference, ...)
            policy.batch_logprobs(dataclasses.replace(batch, routing=None))
        logprobs[mask].sum().backward()
        grads.append({n: p.grad.clone() for n, p in policy.model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def _other_family(name: str):
    import transformers as T

    common = dict(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    common |= dict(pad_token_id=0, eos_token_id=1, bos_token_id=1)
    config = {
        "mixtral": lambda: T.MixtralConfig(
            **common, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2
        ),
        "qwen2_moe": lambda: T.Qwen2MoeConfig(
            **common,
            intermediate_size=64,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
        ),  # fmt: skip
        "olmoe": lambda: T.OlmoeConfig(**common, intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    }[name]()
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", experts_implementation="eager"
    )


@pytest.mark.parametrize(("name", "normalize"), [("mixtral", True), ("qwen2_moe", False), ("olmoe", False)])
def test_other_families_quantize_experts_record_and_replay(name, normalize):
    """Mixtral (always renormalizes its top-k), Qwen2-MoE (a shared expert beside), OLMoE: int8 experts, R3."""
    from ais_lightning.quant import QuantExperts

    model = _other_family(name).float()
    engine = TorchRolloutEngine(model, "int8")
    assert sum(isinstance(m, QuantExperts) for m in engine.model.modules()) == 2
    batch = engine.generate(
        [[5, 6, 7], [8, 9]], SamplingConfig(n=2, max_new_tokens=6, stop_token_ids=[1], seed=0)
    )
    assert batch.routing.shape[2:] == (2, 2)
    policy = Policy(model, router_replay=True)
    assert policy.routing_replay.normalize == [normalize, normalize]
    with torch.no_grad():
        policy.batch_logprobs(batch)
    _, used = policy.routing_replay.last_routing()
    mask = routing_replay_mask(batch.prompt_mask, batch.response_mask)
    assert torch.equal(used[mask], batch.routing.long()[mask])


def test_a_router_replay_cannot_reproduce_is_refused():
    model = build_tiny_qwen3_moe(seed=0)
    router = moe_routers(model)[1]
    original = router.forward
    router.forward = lambda x: (lambda out: (out[0], out[1] * 0.5, out[2]))(
        original(x)
    )  # e.g. a scaling factor
    with pytest.raises(ValueError, match="router_replay=true: Qwen3MoeTopKRouter's gate weights"):
        Policy(model, router_replay=True)


def test_wrapping_a_model_twice_keeps_one_hook_per_router():
    model = build_tiny_qwen3_moe(seed=0)
    Policy(model)
    policy = Policy(model, router_replay=True)  # the newest owner gets the routers
    assert all(len(r._forward_hooks) == 1 for r in moe_routers(model))
    batch = TorchRolloutEngine(model, "fp32").generate(PROMPTS, SAMPLING)
    batch.routing = ((batch.routing.long() + 3) % 8).to(torch.uint8)
    with torch.no_grad():
        policy.batch_logprobs(batch)
    own, _ = policy.routing_replay.last_routing()
    plain = Policy(build_tiny_qwen3_moe(seed=0))
    with torch.no_grad():
        plain.batch_logprobs(batch)
    # The first MoE layer's input does not depend on any routing: its own top-k is the unreplayed trainer's (with a
    # second hook it would be the replayed experts).
    assert torch.equal(own[:, :, 0], plain.routing_replay.last_routing()[0][:, :, 0])
