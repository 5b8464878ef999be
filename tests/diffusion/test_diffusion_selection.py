"""The position-selection factor of low-confidence remasking (an analysis quantity, not used by correctors)."""

from __future__ import annotations

import math

import pytest
import torch

from ais_lightning.models import build_tiny_diffusion
from ais_lightning.policy.diffusion import low_confidence_selection_logprobs, selection_event_logprob
from ais_lightning.rollout.base import SamplingConfig
from ais_lightning.rollout.diffusion_engine import DiffusionRolloutEngine

PROMPTS = [[20, 21, 14, 22, 23, 32], [24, 14, 25, 32]]


def test_selection_event_by_hand():
    logits = torch.tensor([0.5, 0.3, 0.2]).log()[None]
    # T = 1: candidates with probability < 0.35 are tokens 1 and 2, of mass 0.3 + 0.2
    assert selection_event_logprob(logits, torch.tensor([0.35]), 1.0).item() == pytest.approx(math.log(0.5))
    # T = 2: candidates ~ sqrt(p) normalized; tokens 1, 2 carry (sqrt(.3) + sqrt(.2)) / (sqrt(.5) + sqrt(.3) + sqrt(.2))
    q = (math.sqrt(0.3) + math.sqrt(0.2)) / (math.sqrt(0.5) + math.sqrt(0.3) + math.sqrt(0.2))
    assert selection_event_logprob(logits, torch.tensor([0.35]), 2.0).item() == pytest.approx(
        math.log(q), rel=1e-6
    )
    # greedy: the candidate is the argmax (p = 0.5), re-masked only when the kept confidence exceeds it
    assert selection_event_logprob(logits, torch.tensor([0.35]), 0.0).item() == -math.inf
    assert selection_event_logprob(logits, torch.tensor([0.6]), 0.0).item() == 0.0
    assert selection_event_logprob(logits, torch.tensor([0.1]), 1.0).item() == -math.inf  # nothing below


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_selection_probabilities_of_one_step_sum_to_one(temperature):
    """Two masked positions, keep one: P(keep i with token x) = q_i(x) * P_j(p_j(c) < p_i(x)); summed over
    (i, x) it is 1 (one of them is kept), a check of the formula independent of any sampler code."""
    logits = build_tiny_diffusion(seed=0)(torch.tensor([[20, 21, 99, 99]]))[0, 2:].detach().float()  # [2, V]
    logits[:, 99] = -1e4
    p = logits.softmax(-1)  # confidences [2, V]
    q = (logits / temperature).softmax(-1)  # candidate distributions [2, V]
    total = 0.0
    for i, j in ((0, 1), (1, 0)):
        other = logits[j].expand(logits.shape[1], -1)  # [V, V]
        event = selection_event_logprob(other, p[i], temperature).exp()  # [V]
        total += float((q[i] * event).sum())
    assert total == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("block_length, steps", [(None, 4), (4, 4), (3, None)])
def test_greedy_path_is_the_selection_of_its_own_model(block_length, steps):
    """A greedy low-confidence path keeps the most confident argmax candidates, so under the same model
    every re-masked candidate was below the kept ones: log P(selection) = 0 at every step; under a
    different model some step's selection is impossible (-inf)."""
    model = build_tiny_diffusion(seed=0)
    engine = DiffusionRolloutEngine(model, block_length=block_length, steps=steps)
    batch = engine.generate(
        PROMPTS, SamplingConfig(n=1, temperature=0.0, max_new_tokens=8, stop_token_ids=[2])
    )
    schedule = engine.schedule(8)
    own = low_confidence_selection_logprobs(model, batch, schedule, 0.0)
    assert own.shape == (2, len(schedule)) and torch.equal(own, torch.zeros_like(own))
    other = low_confidence_selection_logprobs(build_tiny_diffusion(seed=1), batch, schedule, 0.0)
    assert (other == -math.inf).any()


def test_sampled_path_selection_is_finite_and_engine_copy_matches():
    model = build_tiny_diffusion(seed=0)
    engine = DiffusionRolloutEngine(model, block_length=4)
    batch = engine.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=8, stop_token_ids=[2], seed=3))
    schedule = engine.schedule(8)
    pi = low_confidence_selection_logprobs(model, batch, schedule, 1.0)
    mu = low_confidence_selection_logprobs(engine.model, batch, schedule, 1.0)
    assert torch.isfinite(pi).all() and (pi <= 0).all() and (pi < 0).any()
    torch.testing.assert_close(pi, mu, rtol=0, atol=1e-5)
    last_of_block = [
        s
        for s, st in enumerate(schedule)
        if s + 1 == len(schedule) or schedule[s + 1].block_start != st.block_start
    ]
    assert (pi[:, last_of_block] == 0).all()  # the last step of a block keeps everything left: no choice
    with pytest.raises(ValueError, match="schedule"):
        low_confidence_selection_logprobs(model, batch, schedule[:-1], 1.0)
