"""tools/spread_bound.py: the two spreads by hand, and the real pipeline on the tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from tests.tools.load_tool import load_tool


def test_token_spreads_hand_values():
    tool = load_tool("spread_bound")
    # pi = (0.9, 0.1): H = -(0.9 ln 0.9 + 0.1 ln 0.1) = 0.3250830; bound 1 - e^-H = 0.2775326; 1 - 0.81 - 0.01 = 0.18
    logits = torch.tensor([[math.log(0.9), math.log(0.1)]], dtype=torch.float64)
    bound, collision = tool.token_spreads(logits)
    assert float(bound) == pytest.approx(1 - math.exp(-0.3250830), abs=1e-7)
    assert float(bound) == pytest.approx(0.2775326, abs=1e-6)
    assert float(collision) == pytest.approx(0.18, abs=1e-12)
    # uniform over 4: H = ln 4, both spreads 3/4 (the bound is tight there)
    bound, collision = tool.token_spreads(torch.zeros(1, 4))
    assert float(bound) == pytest.approx(0.75, abs=1e-12) and float(collision) == pytest.approx(
        0.75, abs=1e-12
    )
    # temperature 2 halves the logits: pi = softmax(ln(0.9, 0.1) / 2) = (0.75, 0.25), collision 1 - 0.625
    _, collision = tool.token_spreads(logits, temperature=2.0)
    assert float(collision) == pytest.approx(0.375, abs=1e-12)


def test_measures_the_pipelines_own_tokens_and_the_bound_is_above_the_exact_spread():
    tool = load_tool("spread_bound")
    result = tool.measure(["experiment=smoke", "trainer.num_threads=1", "rollout=fp4"], batches=2, seed=0)
    assert result["tokens"] > 0
    assert result["entropy_max_abs_error"] < 1e-4, "the tool scores the distribution the corrector sees"
    assert result["impurity_max_abs_error"] < 1e-5, "the pipeline's impurity is the exact spread"
    assert result["spread_entropy_bound"] >= result["spread_collision"] > 0
    assert result["bound_over_collision"] >= 1.0
    assert result["mismatch_kl_k3"] > 0, "fp4 rollouts of an fp32 policy mismatch"
    # a smaller spread is a larger severity, so lambda can only rise with the exact spread
    assert 0.0 <= result["lambda_entropy_bound"] <= result["lambda_collision"] <= 1.0
    assert "bound / exact" in tool.format_result(result)


def test_batches_must_be_positive():
    with pytest.raises(SystemExit):
        load_tool("spread_bound").main(["--batches", "0"])
