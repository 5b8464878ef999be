"""MoE routing tool: one small run; replay uses the engine's experts everywhere, fp32 rollouts agree with the trainer."""

from __future__ import annotations

import pytest

from ais_lightning.rollout.base import SamplingConfig
from ais_lightning.toolkit.probes import compose, engine_factory, policy_like
from tests.tools.load_tool import load_tool

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_measure_fp32_and_fp4():
    tool = load_tool("moe_routing")
    _, c = compose(tool.POLICY)
    policy = c.policy.build(0)
    replayed = policy_like(compose([*tool.POLICY, "policy.router_replay=true"])[1].policy, policy)
    assert not policy.router_replay and replayed.router_replay
    prompts = [policy.tokenizer.encode(p) for p in ("12+34=", "5+67=")]
    sampling = SamplingConfig(n=2, max_new_tokens=6, stop_token_ids=[2], seed=0)
    fp32 = tool.measure(policy, replayed, engine_factory(tool.POLICY, precision="fp32"), prompts, sampling)
    assert fp32["disagree_none"] == 0.0 and fp32["k3_none"] < 1e-9
    fp4 = tool.measure(policy, replayed, engine_factory(tool.POLICY, precision="fp4"), prompts, sampling)
    assert fp4["disagree_none"] > 0 and fp4["used_differs_r3"] == 0.0 and fp4["used_differs_none"] > 0
    assert tool.warm_start(policy, c.task, 2, seed=0) > 0  # the SFT loss of a short warm start


def test_a_tiny_run_through_the_run_builder(capsys):
    """The command line: the policy, task and engines of the composed config (an ais-train override included)."""
    tool = load_tool("moe_routing")
    args = ["--precisions", "fp4", "--prompts", "2", "--n", "2", "--max-new-tokens", "4", "--seeds", "0"]
    tool.main([*args, "+policy.overrides.num_experts=4"])
    out = capsys.readouterr().out
    assert "2 prompts x 2, seeds [0]" in out and "| fp4 |" in out
