"""Correctors that read the advantage: OPSM (TRL / DeepSeek-V3.2), prime-rl's DPPO mask, VESPO, by hand.

Worked example of conftest.py (log mu = -2 on every token, so mu = e^-2 = 0.135335 and pi = mu w):
    response 0: 3.0   0.25  1.5      product 1.125   mean(-ln w) = -ln(1.125)/3 = -0.039260
    response 1: 0.8   1.25  [0.01]   product 1.0     mean(-ln w) = 0
    response 2: 0.1   0.2   0.4      product 0.008   mean(-ln w) = -ln(0.008)/3 = 1.609438
"""

from __future__ import annotations

import math

import pytest
import torch

from ais_lightning import ops
from ais_lightning.correctors import VESPO, DPPOMask, OffPolicySequenceMask

T, F = True, False
VALID = torch.tensor([[T, T, T], [T, T, F], [T, T, T]])
MU = math.exp(-2.0)


def k3(w: float) -> float:
    return w - 1.0 - math.log(w)


# ---------------------------------------------------------------- OPSM


def test_opsm_drops_negative_advantage_sequences_that_drifted(example):
    # k1 means -0.039, 0, 1.609: only response 2 exceeds delta = 0.5; with A < 0 it is dropped.
    out = OffPolicySequenceMask(threshold=0.5)(*example, advantages=torch.tensor([-1.0, -1.0, -1.0]))
    torch.testing.assert_close(out.weights, torch.tensor([[1.0, 1, 1], [1, 1, 0], [0, 0, 0]]))
    assert torch.equal(out.mask, VALID)  # TRL: the dropped response stays in the denominator
    assert out.stats["opsm/dropped_frac"] == pytest.approx(3 / 8)
    assert out.stats["opsm/seq_dropped_frac"] == pytest.approx(1 / 3)
    assert out.stats["opsm/seq_kl_mean"] == pytest.approx(
        (-math.log(1.125) / 3 - math.log(0.008) / 3) / 3, rel=1e-5
    )
    assert out.stats["corrector/clipped_frac"] == pytest.approx(3 / 8)
    assert out.stats["corrector/masked_frac"] == 0.0


def test_opsm_keeps_non_negative_advantages_and_low_kl(example):
    # A >= 0 keeps response 2 whatever its drift (A = 0 counts as non-negative, as TRL's >= 0).
    for a2 in (1.0, 0.0):
        out = OffPolicySequenceMask(0.5)(*example, advantages=torch.tensor([-1.0, -1.0, a2]))
        assert bool((out.weights[VALID] == 1).all())
    # delta = 1.7 > 1.609: nothing drifted enough.
    out = OffPolicySequenceMask(1.7)(*example, advantages=-torch.ones(3))
    assert bool((out.weights[VALID] == 1).all())


def test_opsm_per_token_advantages_and_denominator_option(example):
    adv = torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0], [1.0, -1.0, 0.0]])
    out = OffPolicySequenceMask(0.5)(*example, advantages=adv)
    torch.testing.assert_close(out.weights, torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 1]]))
    out = OffPolicySequenceMask(0.5, drop_from_denominator=True)(*example, advantages=-torch.ones(3))
    assert torch.equal(out.mask, torch.tensor([[T, T, T], [T, T, F], [F, F, F]]))
    assert out.stats["corrector/masked_frac"] == pytest.approx(3 / 8)
    assert out.stats["corrector/clipped_frac"] == 0.0


def test_opsm_needs_advantages(example):
    with pytest.raises(ValueError, match="advantages"):
        OffPolicySequenceMask()(*example)
    with pytest.raises(ValueError, match="^threshold"):
        OffPolicySequenceMask(threshold=0.0)


# ---------------------------------------------------------------- prime-rl DPPO mask


def test_dppo_masks_by_advantage_sign(example):
    # pi - mu = mu (w - 1): 3.0 -> +0.270671, 0.25 -> -0.101501, 1.5 -> +0.067668,
    # 0.8 -> -0.027067, 1.25 -> +0.033834, 0.1 -> -0.121802, 0.2 -> -0.108268, 0.4 -> -0.081201.
    # Thresholds 0.1 / 0.1, A = (+1, -1, 0): response 0 masks pi - mu > 0.1 (the 3.0 only; 0.25's
    # -0.10 is a decrease, ignored for A > 0); response 1 nothing below -0.1; response 2 has A = 0,
    # which takes prime-rl's low branch: 0.1 and 0.2 (< -0.1) are masked, 0.4 (-0.081) kept.
    out = DPPOMask(mask_low=0.1, mask_high=0.1)(*example, advantages=torch.tensor([1.0, -1.0, 0.0]))
    torch.testing.assert_close(out.weights, torch.tensor([[0.0, 0.25, 1.5], [0.8, 1.25, 0], [0, 0, 0.4]]))
    assert torch.equal(out.mask, VALID)  # prime-rl: masked tokens stay in the normaliser
    s = out.stats
    assert s["dppo/is_masked"] == pytest.approx(3 / 8)
    assert s["dppo/is_masked_high"] == pytest.approx(1 / 8)  # the 3.0 (A > 0)
    assert s["dppo/is_masked_low"] == 0.0  # A = 0 is neither positive nor negative
    assert s["dppo/masked_advantage_positive"] == pytest.approx(1 / 3)
    assert s["dppo/masked_advantage_negative"] == 0.0
    assert s["dppo/masked_mismatch_kl"] == pytest.approx((k3(3.0) + k3(0.1) + k3(0.2)) / 3, rel=1e-5)
    kept = (k3(0.25) + k3(1.5) + k3(0.8) + k3(1.25) + k3(0.4)) / 5
    assert s["dppo/unmasked_mismatch_kl"] == pytest.approx(kept, rel=1e-5)
    assert s["corrector/clipped_frac"] == pytest.approx(3 / 8)


def test_dppo_negative_advantages_and_defaults(example):
    # A < 0 everywhere with the default 0.2 / 0.2: no mu - pi exceeds 0.2 (largest 0.1218): nothing.
    out = DPPOMask()(*example, advantages=-torch.ones(3))
    assert out.stats["dppo/is_masked"] == 0.0
    # mask_low = 0.105: 0.1 (-0.1218) and 0.2 (-0.1083) masked, counted as low (A < 0).
    out = DPPOMask(mask_low=0.105, drop_from_denominator=True)(*example, advantages=-torch.ones(3))
    assert torch.equal(out.mask, torch.tensor([[T, T, T], [T, T, F], [F, F, T]]))
    assert out.stats["dppo/is_masked_low"] == pytest.approx(2 / 8)
    assert out.stats["corrector/masked_frac"] == pytest.approx(2 / 8)


def test_dppo_uses_probabilities_not_the_clamped_log_ratio():
    # log mu = -25, log pi = -0.1: delta = 24.9 is clamped to 20, but pi - mu = 0.905 must be seen.
    train, rollout, mask = torch.tensor([[-0.1]]), torch.tensor([[-25.0]]), torch.tensor([[True]])
    out = DPPOMask(mask_high=0.5)(train, rollout, mask, advantages=torch.ones(1))
    assert out.stats["dppo/is_masked"] == 1.0


def test_dppo_from_log_ratio_needs_the_log_probs(example):
    train, rollout, mask = example
    delta = ops.log_ratio(train, rollout, mask)
    adv = torch.tensor([1.0, -1.0, 0.0])
    with pytest.raises(ValueError, match="train_logprobs"):
        DPPOMask().from_log_ratio(delta, mask, adv)
    direct = DPPOMask(0.1, 0.1)(train, rollout, mask, advantages=adv)
    via = DPPOMask(0.1, 0.1).from_log_ratio(delta, mask, adv, train_logprobs=train, rollout_logprobs=rollout)
    assert torch.equal(direct.weights, via.weights) and direct.stats == via.stats


@pytest.mark.parametrize(
    ("kwargs", "name"), [(dict(mask_low=-0.1), "mask_low"), (dict(mask_high=1.5), "mask_high")]
)
def test_dppo_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        DPPOMask(**kwargs)


# ---------------------------------------------------------------- VESPO


def phi(w: float, k: float, lam: float) -> float:
    """phi(W) = W^k exp(lambda (1 - W))."""
    return w**k * math.exp(lam * (1.0 - w))


def test_vespo_gamma_weights_by_hand(example):
    # Token ratios truncated at C = 2.5 before the product (TRL token_truncate): response 0
    # 2.5 * 0.25 * 1.5 = 0.9375, response 1 1.0, response 2 0.008. A = (+1, -1, +1):
    # phi_pos(0.9375) = 0.9375^2 e^(3 * 0.0625) = 1.060163, phi_neg(1) = 1,
    # phi_pos(0.008) = 0.008^2 e^(3 * 0.992) = 6.4e-5 * 19.60922 = 0.00125499.
    out = VESPO(token_c_high=2.5)(*example, advantages=torch.tensor([1.0, -1.0, 1.0]))
    w0, w2 = phi(0.9375, 2, 3), phi(0.008, 2, 3)
    assert w0 == pytest.approx(1.060163, rel=1e-6) and w2 == pytest.approx(0.00125499, rel=1e-5)
    expected = torch.tensor([[w0] * 3, [1.0, 1.0, 0.0], [w2] * 3])
    torch.testing.assert_close(out.weights, expected, rtol=1e-5, atol=1e-7)
    assert torch.equal(out.mask, VALID)
    assert out.stats["vespo/token_clipped_frac"] == pytest.approx(1 / 8)
    assert out.stats["vespo/log_w_mean"] == pytest.approx((math.log(0.9375) + math.log(0.008)) / 3, rel=1e-5)
    assert out.stats["vespo/phi_mean"] == pytest.approx((w0 + 1.0 + w2) / 3, rel=1e-5)


def test_vespo_uses_the_product_not_the_geometric_mean(make_logprobs):
    # Two responses with the same geometric mean 1.1 but lengths 1 and 4: W = 1.1 vs 1.1^4 = 1.4641.
    train, rollout, mask = make_logprobs(
        [[1.1, 0.3, 0.3, 0.3], [1.1, 1.1, 1.1, 1.1]], [[T, F, F, F], [T] * 4]
    )
    out = VESPO(k_neg=3.0, lambda_neg=2.0)(train, rollout, mask, advantages=-torch.ones(2))
    assert float(out.weights[0, 0]) == pytest.approx(phi(1.1, 3, 2), rel=1e-5)
    assert float(out.weights[1, 0]) == pytest.approx(phi(1.1**4, 3, 2), rel=1e-5)


def test_vespo_token_mask_mode(example):
    # token_mask with [0.5, 2.5]: 3.0 and 0.25 become 0 -> log 1e-8 each; log W clamps at log 1e-8.
    out = VESPO(token_c_high=2.5, token_c_low=0.5, token_mask=True)(*example, advantages=torch.ones(3))
    assert float(out.weights[0, 0]) == pytest.approx(phi(1e-8, 2, 3), rel=1e-4)
    assert out.stats["vespo/token_clipped_frac"] == pytest.approx(5 / 8)  # 3.0, .25, .1, .2, .4


def test_vespo_on_policy_weight_is_one_and_needs_advantages(example):
    _, rollout, mask = example
    out = VESPO()(rollout.clone(), rollout, mask, advantages=torch.tensor([1.0, -1.0, 0.0]))
    torch.testing.assert_close(out.weights[mask], torch.ones(int(mask.sum())))
    with pytest.raises(ValueError, match="advantages"):
        VESPO()(rollout, rollout, mask)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(k_pos=-1.0), "k_pos"),
        (dict(lambda_pos=0.0), "lambda_pos"),
        (dict(k_neg=float("nan")), "k_neg"),
        (dict(lambda_neg=-2.0), "lambda_neg"),
        (dict(token_c_high=0.5), "token_c_high"),
        (dict(token_c_low=2.0), "token_c_low"),
        (dict(token_c_high=None, token_c_low=-1.0), "token_c_low"),
    ],
)
def test_vespo_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        VESPO(**kwargs)
