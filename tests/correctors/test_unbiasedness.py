"""Importance weights make REINFORCE unbiased under a mismatched sampler; no correction does not.

A 4-action categorical policy pi = softmax(theta), rewards r, and a different sampler mu.
Exact gradient (softmax score d log pi_a / d theta = e_a - pi):
    g* = grad E_pi[r] = sum_a pi_a r_a (e_a - pi) = pi * r - (pi . r) pi
With a ~ mu, the fully weighted estimate (1/n) sum_i (pi/mu)(a_i) r(a_i) (e_{a_i} - pi) has mean g*.
The uncorrected estimate (1/n) sum_i r(a_i) (e_{a_i} - pi) has mean mu * r - (mu . r) pi, so its bias
    b = (mu - pi) * r - ((mu - pi) . r) pi
does not vanish with n: its error stays above |b| - k SE, where SE ~ 1/sqrt(n).
The estimates below go through the correctors and autograd exactly as a policy-gradient loss would.
"""

from __future__ import annotations

import math

import torch

from ais_lightning.correctors import TIS, NoCorrection

THETA = torch.tensor([0.5, -0.2, 0.1, -1.0], dtype=torch.float64)  # pi logits
MU_LOGITS = torch.tensor([-0.4, 0.6, -0.3, 0.2], dtype=torch.float64)  # mu logits
REWARDS = torch.tensor([1.0, 0.0, 2.0, -1.0], dtype=torch.float64)
PI = torch.softmax(THETA, -1)
MU = torch.softmax(MU_LOGITS, -1)
EXACT = PI * REWARDS - (PI @ REWARDS) * PI
BIAS = (MU - PI) * REWARDS - ((MU - PI) @ REWARDS) * PI
REPEATS = 6
K_SE = 5.0  # tolerance in standard errors


def estimate(corrector, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(REINFORCE gradient estimate via autograd, per-coordinate standard error) from n samples of mu."""
    g = torch.Generator().manual_seed(seed)
    actions = torch.multinomial(MU.float(), n, replacement=True, generator=g)  # [n]
    train_logprobs = torch.log(PI)[actions].float().unsqueeze(-1)  # [n, 1]  log pi_old(a)
    rollout_logprobs = torch.log(MU)[actions].float().unsqueeze(-1)  # [n, 1]  log mu(a)
    out = corrector(train_logprobs, rollout_logprobs, torch.ones(n, 1, dtype=torch.bool))
    assert out.stats["corrector/clipped_frac"] == 0.0 and out.stats["corrector/masked_frac"] == 0.0
    weights = out.weights[:, 0].double()  # [n]
    theta = THETA.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)[actions]  # [n]
    surrogate = (weights * REWARDS[actions] * logp).mean()
    (grad,) = torch.autograd.grad(surrogate, theta)
    # Per-sample gradients in closed form, for the standard error (and to cross-check autograd).
    per_sample = (weights * REWARDS[actions]).unsqueeze(-1) * (
        torch.eye(4, dtype=torch.float64)[actions] - PI
    )
    torch.testing.assert_close(grad, per_sample.mean(0))
    return grad, per_sample.std(0) / math.sqrt(n)


def test_setup_has_a_real_mismatch_and_bias():
    assert float((MU - PI).abs().max()) > 0.1
    assert float(BIAS.norm()) > 0.15


def test_fully_weighted_estimate_converges_to_the_exact_gradient():
    untruncated = TIS(level="token", c_high=math.inf)  # weight = pi/mu exactly
    small = [estimate(untruncated, 400, seed) for seed in range(REPEATS)]
    large = [estimate(untruncated, 40_000, 100 + seed) for seed in range(REPEATS)]
    for grad, se in large:
        assert bool(((grad - EXACT).abs() <= K_SE * se).all()), (grad, EXACT, se)
    err_small = sum(float((grad - EXACT).norm()) for grad, _ in small) / REPEATS
    err_large = sum(float((grad - EXACT).norm()) for grad, _ in large) / REPEATS
    # 100x the samples: the error should shrink ~10x; demand at least 4x.
    assert err_large < err_small / 4, (err_small, err_large)


def test_uncorrected_estimate_stays_biased():
    none = NoCorrection()
    small = [estimate(none, 400, seed) for seed in range(REPEATS)]
    large = [estimate(none, 40_000, 100 + seed) for seed in range(REPEATS)]
    for grad, se in large:
        # It converges, but to EXACT + BIAS ...
        assert bool(((grad - EXACT - BIAS).abs() <= K_SE * se).all())
        # ... so its error is at least |b| - K_SE |se|, which is a large fraction of |b| at this n.
        bound = float(BIAS.norm()) - K_SE * float(se.norm())
        assert bound > 0.8 * float(BIAS.norm())
        assert float((grad - EXACT).norm()) >= bound
    err_small = sum(float((grad - EXACT).norm()) for grad, _ in small) / REPEATS
    err_large = sum(float((grad - EXACT).norm()) for grad, _ in large) / REPEATS
    assert err_large > 0.5 * err_small, "the uncorrected error must not shrink with n"
