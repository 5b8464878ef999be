"""The torch engine on the tiny Qwen3-MoE: fp32 parity with the policy, quantized experts, weight sync."""

from __future__ import annotations

import pytest
import torch

from ais_lightning.models import build_tiny_qwen3_moe
from ais_lightning.policy import Policy
from ais_lightning.quant import QuantExperts
from ais_lightning.rollout import TorchRolloutEngine
from ais_lightning.rollout.base import SamplingConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12]]


def _sampling(seed: int = 0) -> SamplingConfig:
    return SamplingConfig(n=3, max_new_tokens=10, stop_token_ids=[2], seed=seed)


def _policy_logprobs(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return Policy(model).batch_logprobs(batch).logprobs  # [B, T]


def test_fp32_rollout_logprobs_match_the_policy():
    model = build_tiny_qwen3_moe(seed=0)
    engine = TorchRolloutEngine(model, "fp32")
    assert engine.model_impl == "transformers"  # the model's own forward: no lean MoE path
    batch = engine.generate(PROMPTS, _sampling())
    diff = (_policy_logprobs(model, batch) - batch.rollout_logprobs)[batch.response_mask]
    assert diff.abs().max().item() < 1e-5


@pytest.mark.parametrize("precision", ["int8", "fp8", "fp4"])
def test_quantized_experts_run_and_stay_close_to_the_policy(precision):
    model = build_tiny_qwen3_moe(seed=0)
    engine = TorchRolloutEngine(model, precision)
    experts = [layer.mlp.experts for layer in engine.model.model.layers]
    assert all(
        isinstance(e, QuantExperts) and e.recipe.name in (precision, "fp8_block", "nvfp4") for e in experts
    )
    assert not any(isinstance(m, QuantExperts) for m in model.modules())  # the caller's model is untouched
    assert len(engine.quantized) == 4 * (4 + 16)  # attention and every expert are re-quantized at a sync
    batch = engine.generate(PROMPTS, _sampling())
    delta = (_policy_logprobs(model, batch) - batch.rollout_logprobs)[batch.response_mask]
    assert 0 < delta.abs().max().item() < 0.5
    k3 = (delta.exp() - 1 - delta).mean().item()
    assert k3 < 5e-3
    if precision == "int8":  # default outlier_fraction 0.1: experts calibrated on the tokens routed to them
        assert any(layer.outlier_channels is not None for e in experts for layer in e.layers())


def test_weight_sync_requantizes_the_experts():
    old, new = build_tiny_qwen3_moe(seed=0), build_tiny_qwen3_moe(seed=1)
    synced = TorchRolloutEngine(old, "int8", backend="emulate", outlier_fraction=0.0)
    synced.generate(PROMPTS, _sampling())
    synced.sync_weights(Policy(new).full_state_dict())
    fresh = TorchRolloutEngine(new, "int8", backend="emulate", outlier_fraction=0.0)
    a, b = synced.generate(PROMPTS, _sampling(1)), fresh.generate(PROMPTS, _sampling(1))
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)


def test_set_precision_switches_the_experts():
    engine = TorchRolloutEngine(build_tiny_qwen3_moe(seed=0), "int8_nested")
    engine.set_precision("int4")
    assert {layer.recipe.name for layer in engine.quantized} == {"int4"}
    assert engine.model.model.layers[3].mlp.experts.down[2].recipe.name == "int4"


def test_calibration_state_restores_the_experts_outlier_channels():
    """What a resumed run restores: the outlier channels of every expert layer (checkpointed engine calibration)."""
    model = build_tiny_qwen3_moe(seed=0)
    first = TorchRolloutEngine(model, "int8", backend="emulate")
    first.generate(PROMPTS, _sampling())  # calibrates every layer on the tokens it saw
    resumed = TorchRolloutEngine(model, "int8", backend="emulate")
    resumed.load_calibration_state(first.calibration_state())
    a, b = first.generate(PROMPTS, _sampling(2)), resumed.generate(PROMPTS, _sampling(2))
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    assert torch.equal(a.routing, b.routing)
