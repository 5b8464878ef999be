"""prime-rl's squared log-ratio penalty kl_tau * (log pi_theta - log mu)^2, by hand and through autograd."""

from __future__ import annotations

import pytest
import torch

from ais_lightning.losses.penalties import (
    PRIME_RL_KL_TAU,
    squared_log_ratio_penalty,
    squared_log_ratio_penalty_loss,
)

T, F = True, False


def inputs():
    # log pi - log mu = 0.5, 0 on the two valid tokens; the padded one holds NaN.
    logprobs = torch.tensor([[-1.0, -2.0, float("nan")]], requires_grad=True)
    rollout = torch.tensor([[-1.5, -2.0, -0.3]])
    return logprobs, rollout, torch.tensor([[T, T, F]])


def test_per_token_penalty_by_hand():
    logprobs, rollout, mask = inputs()
    torch.testing.assert_close(
        squared_log_ratio_penalty(logprobs, rollout, mask), torch.tensor([[0.25, 0.0, 0.0]])
    )


def test_loss_and_gradient_by_hand():
    logprobs, rollout, mask = inputs()
    loss = squared_log_ratio_penalty_loss(logprobs, rollout, mask)
    # 1e-3 * (0.25 + 0) / 2 tokens = 1.25e-4; d/dlogp = 1e-3 * 2 * 0.5 / 2 = 5e-4 on token 0.
    assert PRIME_RL_KL_TAU == 1e-3
    assert float(loss.detach()) == pytest.approx(1.25e-4)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[5e-4, 0.0, 0.0]]))  # no NaN from padding
    logprobs, rollout, mask = inputs()
    loss = squared_log_ratio_penalty_loss(logprobs, rollout, mask, coef=0.1, denominator=10)
    assert float(loss.detach()) == pytest.approx(0.1 * 0.25 / 10)


def test_matches_prime_rl_formula_on_random_data():
    g = torch.Generator().manual_seed(0)
    trainer = -torch.rand(4, 7, generator=g) * 3
    inference = trainer + 0.3 * torch.randn(4, 7, generator=g)
    mask = torch.rand(4, 7, generator=g) < 0.7
    # prime-rl: kl_loss = loss_mask * log_importance_ratio**2, summed, / rl_scale (token count)
    want = PRIME_RL_KL_TAU * (mask * (trainer - inference) ** 2).sum() / mask.sum()
    got = squared_log_ratio_penalty_loss(trainer, inference, mask)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    empty = torch.zeros_like(mask)
    assert float(squared_log_ratio_penalty_loss(trainer, inference, empty)) == 0.0


def test_bad_input_names_the_culprit():
    logprobs, rollout, mask = inputs()
    with pytest.raises(ValueError, match="rollout_logprobs"):
        squared_log_ratio_penalty(logprobs, rollout[:, :2], mask)
    with pytest.raises(ValueError, match="^coef"):
        squared_log_ratio_penalty_loss(logprobs, rollout, mask, coef=-1.0)
    with pytest.raises(ValueError, match="^denominator"):
        squared_log_ratio_penalty_loss(logprobs, rollout, mask, denominator=0)
