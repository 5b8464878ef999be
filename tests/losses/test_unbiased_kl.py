"""GRPOLoss(kl_ratio=...): the importance-weighted k3 reference KL, by hand (values and gradients).

One token, advantage 0 (the policy term is 0), kl_coef = 1, token-mean: the loss is the weighted k3 itself.
pi_theta = 0.5, ref = 0.25, pi_old = 0.4, mu = 0.25:
    r = ref / pi_theta = 0.5, k3 = r - 1 - ln r = ln 2 - 0.5 = 0.193147
    "none":    v = 1                    loss 0.193147   d/dlogp = 1 - r = 0.5
    "old":     v = 0.5 / 0.4 = 1.25     loss 0.241434   d/dlogp = v (k3 + 1 - r) = v ln(pi_theta/ref) = 1.25 ln 2
    "rollout": v = 0.5 / 0.25 = 2       loss 0.386294   d/dlogp = 2 ln 2 = 1.386294
(d(v k3)/dlogp = v k3 + v (1 - r) = v (r - ln r - 1 + 1 - r) = -v ln r.)
"""

from __future__ import annotations

import math

import pytest
import torch

from ais_lightning.losses import KL_RATIOS, GRPOLoss

F64 = torch.float64
LN2 = math.log(2.0)


def _one_token(pi=0.5, ref=0.25, old=0.4, mu=0.25):
    logp = torch.tensor([[math.log(pi)]], dtype=F64, requires_grad=True)
    t = lambda p: torch.tensor([[math.log(p)]], dtype=F64)  # noqa: E731
    return logp, t(old), t(ref), t(mu)


@pytest.mark.parametrize(("kl_ratio", "weight"), [("none", 1.0), ("old", 1.25), ("rollout", 2.0)])
def test_weighted_k3_and_its_gradient_by_hand(kl_ratio, weight):
    logp, old, ref, mu = _one_token()
    loss = GRPOLoss(kl_coef=1.0, kl_ratio=kl_ratio)
    adv, mask = torch.zeros(1, dtype=F64), torch.ones(1, 1, dtype=torch.bool)
    out = loss(logp, old, adv, mask, ref_logprobs=ref, rollout_logprobs=mu)
    k3 = LN2 - 0.5
    assert out.loss.item() == pytest.approx(weight * k3, rel=1e-12)
    assert out.stats["loss/kl"] == pytest.approx(weight * k3, rel=1e-12)
    out.loss.backward()
    grad = 0.5 if kl_ratio == "none" else weight * LN2  # -v ln r with r = 1/2; "none": 1 - r
    assert logp.grad.item() == pytest.approx(grad, rel=1e-12)
    if kl_ratio != "none":
        assert out.stats["loss/kl_ratio_mean"] == pytest.approx(weight, rel=1e-12)


def test_rollout_ratio_makes_the_penalty_the_exact_kl_under_mu():
    """Vocabulary {a, b}: pi_theta = (0.5, 0.5), ref = (0.25, 0.75), mu = (0.8, 0.2). Four tokens a and one b
    are mu's expectation exactly. k3(a) = 0.5 - ln 0.5 - 1 = ln2 - 0.5 = 0.193147,
    k3(b) = 1.5 - ln 1.5 - 1 = 0.5 - ln 1.5 = 0.094535.
    KL(pi_theta || ref) = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 ln(4/3) = 0.143841.
    "rollout": (4 * (0.5/0.8) k3(a) + (0.5/0.2) k3(b)) / 5 = 0.5 k3(a) + 0.5 k3(b) = 0.143841 = the KL;
    "none":    (4 k3(a) + k3(b)) / 5 = 0.173425, biased towards mu's favourite token."""
    logp = torch.tensor([[0.5] * 5], dtype=F64).log().requires_grad_(True)
    ref = torch.tensor([[0.25] * 4 + [0.75]], dtype=F64).log()
    mu = torch.tensor([[0.8] * 4 + [0.2]], dtype=F64).log()
    mask = torch.ones(1, 5, dtype=torch.bool)
    adv = torch.zeros(1, dtype=F64)
    ka, kb = LN2 - 0.5, 0.5 - math.log(1.5)
    kl = 0.5 * math.log(4 / 3)
    assert 0.5 * ka + 0.5 * kb == pytest.approx(kl, rel=1e-12)
    unbiased = GRPOLoss(kl_coef=1.0, kl_ratio="rollout")(
        logp, logp.detach(), adv, mask, ref_logprobs=ref, rollout_logprobs=mu
    )
    plain = GRPOLoss(kl_coef=1.0)(logp, logp.detach(), adv, mask, ref_logprobs=ref, rollout_logprobs=mu)
    assert unbiased.stats["loss/kl"] == pytest.approx(kl, rel=1e-12)
    assert plain.stats["loss/kl"] == pytest.approx((4 * ka + kb) / 5, rel=1e-12)


def test_old_ratio_is_one_before_the_first_update_and_bypass_uses_mu():
    logp, _, ref, mu = _one_token()
    adv, mask = torch.zeros(1, dtype=F64), torch.ones(1, 1, dtype=torch.bool)
    # pi_old = pi_theta (first optimizer step): v = 1 in value, so the loss is plain k3 (the gradient is not)
    out = GRPOLoss(kl_coef=1.0, kl_ratio="old")(logp, logp.detach(), adv, mask, ref_logprobs=ref)
    assert out.loss.item() == pytest.approx(LN2 - 0.5, rel=1e-12)
    out.loss.backward()
    assert logp.grad.item() == pytest.approx(LN2, rel=1e-12)  # -v ln r = ln 2, the score-function term kept
    # bypass: pi_old is mu, so "old" weighs by pi_theta / mu = 2
    logp2 = logp.detach().clone().requires_grad_(True)
    by = GRPOLoss(kl_coef=1.0, kl_ratio="old", mode="bypass")(
        logp2, logp2.detach(), adv, mask, ref_logprobs=ref, rollout_logprobs=mu
    )
    assert by.loss.item() == pytest.approx(2 * (LN2 - 0.5), rel=1e-12)


def test_masked_tokens_and_the_total():
    logp = torch.tensor([[math.log(0.5), float("nan")]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[math.log(0.25), float("-inf")]], dtype=F64)
    mu = torch.tensor([[math.log(0.25), float("nan")]], dtype=F64)
    mask = torch.tensor([[True, False]])
    out = GRPOLoss(kl_coef=0.1, kl_ratio="rollout")(
        logp, logp.detach(), torch.zeros(1, dtype=F64), mask, ref_logprobs=ref, rollout_logprobs=mu
    )
    assert out.stats["loss/total"] == pytest.approx(0.1 * 2 * (LN2 - 0.5), rel=1e-12)
    out.loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 1] == 0


def test_bad_options_and_missing_inputs():
    assert KL_RATIOS == ("none", "old", "rollout")
    with pytest.raises(ValueError, match="kl_ratio"):
        GRPOLoss(kl_ratio="sequence")
    logp, old, ref, _ = _one_token()
    with pytest.raises(ValueError, match="rollout_logprobs.*kl_ratio='rollout'"):
        GRPOLoss(kl_coef=1.0, kl_ratio="rollout")(
            logp, old, torch.zeros(1, dtype=F64), torch.ones(1, 1, dtype=torch.bool), ref_logprobs=ref
        )
    assert "kl_ratio='rollout'" in repr(GRPOLoss(kl_ratio="rollout"))
