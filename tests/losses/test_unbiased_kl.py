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


def test_nemo_clamp_caps_the_weighted_k3_and_detaches_the_weight_where_the_log_ratio_clamp_binds():
    """kl_clamp=10 (NeMo-RL's calculate_kl), kl_ratio="rollout", three tokens (d(v k3)/dlogp = -v ln r unclamped):
    - pi_theta = 0.5, ref = 0.25, mu = 0.25: v k3 = 2 (ln2 - 0.5) = 0.386 < 10: the same value and gradient 2 ln 2;
    - pi_theta = 0.5, ref = 0.5 e^-15, mu = 0.25: r = e^-15, k3 = 14 + e^-15, v k3 = 28.0000006 > 10: NeMo counts
      10 with gradient 0, without the clamp 28 with gradient -v ln r = 30;
    - pi_theta = e^-25, mu = e^-6, ref = 1: log r = 25 clamped to 20, so k3 = e^20 - 21 carries no gradient;
      v = e^-19, v k3 = e - 21 e^-19 < 10: the same value, but NeMo detaches v (gradient 0) where we keep
      dv/dlogp * k3 = v k3 = e."""
    logp = torch.tensor([[math.log(0.5), math.log(0.5), -25.0]], dtype=F64)
    ref = torch.tensor([[math.log(0.25), math.log(0.5) - 15.0, 0.0]], dtype=F64)
    mu = torch.tensor([[math.log(0.25), math.log(0.25), -6.0]], dtype=F64)
    adv, mask = torch.zeros(1, dtype=F64), torch.ones(1, 3, dtype=torch.bool)
    result = {}
    for clamp in (None, 10.0):
        x = logp.clone().requires_grad_(True)
        loss = GRPOLoss(
            kl_coef=1.0,
            kl_ratio="rollout",
            kl_clamp=clamp,
            aggregation="seq-mean-token-sum-norm",
            max_response_length=1,
        )  # fmt: skip  (the loss is the sum of the three terms)
        out = loss(x, x.detach(), adv, mask, ref_logprobs=ref, rollout_logprobs=mu)
        out.loss.backward()
        result[clamp] = (out.loss.item(), x.grad[0].tolist())
    (total_free, grad_free), (total_nemo, grad_nemo) = result[None], result[10.0]
    first, third = 2 * (LN2 - 0.5), math.e - 21 * math.exp(-19.0)
    assert total_free == pytest.approx(first + 2 * (14.0 + math.exp(-15.0)) + third, rel=1e-9)
    assert total_nemo == pytest.approx(first + 10.0 + third, rel=1e-9)
    assert grad_free[0] == pytest.approx(2 * LN2, rel=1e-9) and grad_nemo[0] == pytest.approx(
        2 * LN2, rel=1e-9
    )
    assert grad_free[1] == pytest.approx(30.0, rel=1e-9) and grad_nemo[1] == 0.0
    assert grad_free[2] == pytest.approx(third, rel=1e-9) and grad_nemo[2] == 0.0
    with pytest.raises(ValueError, match="kl_clamp"):
        GRPOLoss(kl_clamp=0.0)
