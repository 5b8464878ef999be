"""MoE routing tool: one small run; replay uses the engine's experts everywhere, fp32 rollouts agree with the trainer."""

from __future__ import annotations

import pytest

from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3_moe
from ais_lightning.policy import Policy
from ais_lightning.rollout.base import SamplingConfig
from tests.tools.load_tool import load_tool

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_measure_fp32_and_fp4():
    tool = load_tool("moe_routing")
    policy = Policy(build_tiny_qwen3_moe(seed=0), build_char_tokenizer())
    prompts = [policy.tokenizer.encode(p) for p in ("12+34=", "5+67=")]
    sampling = SamplingConfig(n=2, max_new_tokens=6, stop_token_ids=[2], seed=0)
    fp32 = tool.measure(policy, "fp32", prompts, sampling)
    assert fp32["disagree_none"] == 0.0 and fp32["k3_none"] < 1e-9
    fp4 = tool.measure(policy, "fp4", prompts, sampling)
    assert fp4["disagree_none"] > 0 and fp4["used_differs_r3"] == 0.0 and fp4["used_differs_none"] > 0
    assert tool.warm_start(policy, 2, seed=0) > 0  # the SFT loss of a short warm start
