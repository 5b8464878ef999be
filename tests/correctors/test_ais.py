"""AIS v2 on hand-computed examples: every diagnostic, lambda, the limits, options, EMA, registry.

Example B: two responses of two valid tokens (a third, padded token in response 1), C = 2,
token entropy H = ln 2 everywhere, advantages A = +1 (response 0) and -1 (response 1).
    w   = [1, 4] | [0.5, 1]           b = min(w, 2) = [1, 2] | [0.5, 1]
    k3  = w - 1 - ln w = [0, 3 - ln 4] | [ln 2 - 0.5, 0] = [0, 1.6137056] | [0.1931472, 0]
    N = 4, S = 2 responses, n_s = 2, K_0 = 1.6137056, K_1 = 0.1931472
    D   = (K_0 + K_1) / N = 1.8068528 / 4 = 0.4517132
    se^2 = S / (S - 1) * sum_s (K_s - D n_s)^2 / N^2
         = 2 * ((1.6137056 - 0.9034264)^2 + (0.1931472 - 0.9034264)^2) / 16
         = 2 * 2 * 0.7102792^2 / 16 = 2.0179863 / 16 = 0.1261241
    R   = 1 - se^2 / D^2 = 1 - 0.1261241 / 0.2040448 = 0.3818802
    G   = mean(1 - exp(-H)) = 1 - 1/2 = 0.5
    beta = 2 D / G = 1.8068528,   bias_sq = R beta^2 = 0.3818802 * 3.2647172 = 1.2467308
    chi2_A = sum (b - 1)^2 A^2 / sum A^2 = (0 + 1 + 0.25 + 0) / 4 = 0.3125  (A^2 = 1)
    V = 1.3125,   AdamW's averaging a = (1 - 0.9) / (1 + 0.9) = 1/19 (the default momentum 0.9)
    variance_excess = a phi chi2_A = 0.3125 / 19 = 0.0164474
    lambda = 1.2467308 / (1.2467308 + 0.0164474) = 0.9869792
    (one step, momentum 0: variance_excess = 0.3125, lambda = 1.2467308 / 1.5592308 = 0.7995807)
    weights = (1 - lambda) + lambda b = [1, 1 + lambda] | [1 - lambda / 2, 1]
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings

import pytest
import torch

from ais_lightning.correctors import (
    AIS,
    MIS,
    TIS,
    AISParams,
    AISv1,
    NoCorrection,
    ais_params,
    build_corrector,
)
from ais_lightning.correctors.ais import (
    AIS_COMPONENTS,
    ais_base_weights,
    ais_coefficient,
    ais_sufficient_statistics,
)
from ais_lightning.diagnostics import AISCoefficient
from ais_lightning.ops import log_ratio

LN2 = math.log(2.0)
K0, K1 = 3.0 - math.log(4.0), LN2 - 0.5
D_B = (K0 + K1) / 4.0
SE2_B = 2.0 * ((K0 - 2 * D_B) ** 2 + (K1 - 2 * D_B) ** 2) / 16.0
R_B = 1.0 - SE2_B / D_B**2
BETA_B = 2.0 * D_B / 0.5
BIAS_B = R_B * BETA_B**2
CHI2_B = 0.3125
ADAM = 1.0 / 19.0  # (1 - beta1) / (1 + beta1) at AdamW's beta1 = 0.9
LAMBDA_B = BIAS_B / (BIAS_B + ADAM * CHI2_B)
LAMBDA_B_ONE_STEP = BIAS_B / (BIAS_B + CHI2_B)


@pytest.fixture
def example_b(make_logprobs):
    train, rollout, mask = make_logprobs([[1.0, 4.0, 1.0], [0.5, 1.0, 0.01]], [[1, 1, 0], [1, 1, 0]])
    entropy = torch.full(mask.shape, LN2)
    advantages = torch.tensor([1.0, -1.0])
    return train, rollout, mask, advantages, entropy


def test_hand_values_of_the_numbers_above():
    # Guard against a typo in the constants themselves.
    assert D_B == pytest.approx(0.4517132, abs=1e-7)
    assert SE2_B == pytest.approx(0.1261241, abs=1e-7)
    assert R_B == pytest.approx(0.3818802, abs=1e-6)
    assert BIAS_B == pytest.approx(1.2467308, abs=1e-6)
    assert LAMBDA_B == pytest.approx(0.9869792, abs=1e-6)
    assert LAMBDA_B_ONE_STEP == pytest.approx(0.7995807, abs=1e-6)


def test_every_component_and_lambda_on_example_b(example_b):
    train, rollout, mask, adv, ent = example_b
    out = AIS()(train, rollout, mask, advantages=adv, entropy=ent)
    s = out.stats
    assert s["ais/kl_k3"] == pytest.approx(D_B, rel=1e-6)
    assert s["ais/kl_k3_se"] == pytest.approx(math.sqrt(SE2_B), rel=1e-6)
    assert s["ais/reliability"] == pytest.approx(R_B, rel=1e-6)
    assert s["ais/spread"] == pytest.approx(0.5, rel=1e-6)
    assert s["ais/severity"] == pytest.approx(BETA_B, rel=1e-6)
    assert s["ais/bias_sq"] == pytest.approx(BIAS_B, rel=1e-6)
    assert s["ais/variance_amplification"] == pytest.approx(1.0 + CHI2_B, rel=1e-6)
    assert s["ais/variance_excess"] == pytest.approx(CHI2_B / 19, rel=1e-6)
    assert s["ais/lambda_raw"] == pytest.approx(LAMBDA_B, rel=1e-6)
    assert s["ais/lambda"] == pytest.approx(LAMBDA_B, rel=1e-6)
    assert set(s) == {f"ais/{k}" for k in AIS_COMPONENTS} | {
        "corrector/clipped_frac",
        "corrector/masked_frac",
        "corrector/weight_mean",
    }
    lam = LAMBDA_B
    want = torch.tensor([[1.0, 1.0 + lam, 0.0], [1.0 - lam / 2, 1.0, 0.0]])
    torch.testing.assert_close(out.weights, want, atol=1e-6, rtol=0)
    assert torch.equal(out.mask, mask)
    # w = 4 > C is the one clipped token of 4; weight mean (1 + 1 + lam + 1 - lam/2 + 1) / 4.
    assert s["corrector/clipped_frac"] == pytest.approx(0.25)
    assert s["corrector/weight_mean"] == pytest.approx(1.0 + lam / 8, abs=1e-6)


@pytest.mark.parametrize("beta1", [0.0, 0.5, 0.9])
def test_lambda_is_the_minimiser_of_the_estimated_mse(example_b, beta1):
    # The update m = beta1 m' + (1 - beta1) G_lambda of independent batches: the bias (1 - l) beta passes
    # whole, the noise variance phi (1 + l^2 chi2_A) shrinks by (1 - beta1)^2 sum_j beta1^2j. Summed over
    # 2000 terms (not the closed form), its MSE on a fine grid has its argmin at the corrector's lambda.
    shrink = (1 - beta1) ** 2 * sum(beta1 ** (2 * j) for j in range(2000))
    grid = torch.linspace(0, 1, 100001, dtype=torch.float64)
    mse = (1 - grid) ** 2 * BIAS_B + shrink * (1 + grid**2 * CHI2_B)
    train, rollout, mask, adv, ent = example_b
    lam = AIS(momentum=beta1)(train, rollout, mask, advantages=adv, entropy=ent).stats["ais/lambda"]
    assert float(grid[mse.argmin()]) == pytest.approx(lam, abs=1e-5)


def test_without_entropy_the_spread_is_one(example_b):
    # G = 1: beta = 2 D = 0.9034264, bias_sq = R beta^2 = 0.3116827, lambda = 0.3116827 / 0.6241827.
    train, rollout, mask, adv, _ = example_b
    with pytest.warns(UserWarning, match="neither impurity= nor entropy="):
        out = AIS()(train, rollout, mask, advantages=adv)
    with pytest.warns(UserWarning, match="neither impurity= nor entropy="):  # the metric says the same
        AISCoefficient().update(train, rollout, mask, advantages=adv)
    assert out.stats["ais/spread"] == 1.0
    assert out.stats["ais/severity"] == pytest.approx(2 * D_B, rel=1e-6)
    bias = R_B * (2 * D_B) ** 2
    assert bias == pytest.approx(0.3116827, abs=1e-6)
    assert out.stats["ais/lambda"] == pytest.approx(bias / (bias + ADAM * CHI2_B), rel=1e-6)
    # use_entropy=False ignores a given entropy the same way, but still reports the measured G.
    off = AIS(use_entropy=False)(*example_b[:3], advantages=adv, entropy=example_b[4])
    assert off.stats["ais/lambda"] == pytest.approx(out.stats["ais/lambda"], rel=1e-12)
    assert off.stats["ais/spread"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    "given, use_entropy",
    [(("entropy",), True), (("impurity",), True), ((), False)],
    ids=["entropy", "impurity", "g_one_asked_for"],
)
def test_a_missing_spread_is_warned_about_only_when_it_is_missing(example_b, given, use_entropy):
    # The corrector and the metric with the same parameters stay silent once a spread is given or G = 1
    # is asked for (the test above: both warn without either).
    train, rollout, mask, adv, ent = example_b
    spreads = {"entropy": ent, "impurity": torch.full(mask.shape, 0.25)}
    given = {k: spreads[k] for k in given}
    corrector = AIS(use_entropy=use_entropy)
    metric = AISCoefficient(params=corrector.params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        corrector(train, rollout, mask, advantages=adv, **given)
        metric.update(train, rollout, mask, advantages=adv, **given)


def test_impurity_is_the_spread_when_given(example_b):
    # Example B with the impurity g = 0.25 everywhere (entropy ln 2 as before, whose bound is 0.5):
    # G = 0.25, beta = 2 D / 0.25 = 2 BETA_B, bias_sq = 4 BIAS_B = 4.9869232,
    # lambda = 4.9869232 / (4.9869232 + 0.3125 / 19) = 0.9967127.
    train, rollout, mask, adv, ent = example_b
    imp = torch.full(mask.shape, 0.25)
    bias = 4.0 * BIAS_B
    assert bias == pytest.approx(4.9869232, abs=1e-6)
    lam = bias / (bias + ADAM * CHI2_B)
    assert lam == pytest.approx(0.9967127, abs=1e-6)
    out = AIS()(train, rollout, mask, advantages=adv, entropy=ent, impurity=imp)
    assert out.stats["ais/spread"] == pytest.approx(0.25, rel=1e-6)
    assert out.stats["ais/severity"] == pytest.approx(2 * BETA_B, rel=1e-6)
    assert out.stats["ais/bias_sq"] == pytest.approx(bias, rel=1e-6)
    assert out.stats["ais/lambda"] == pytest.approx(lam, rel=1e-6)
    # Without entropy the impurity still serves; padded positions do not count (0.9 there changes nothing).
    padded = torch.where(mask, imp, torch.full_like(imp, 0.9))
    alone = AIS()(train, rollout, mask, advantages=adv, impurity=padded)
    assert alone.stats["ais/lambda"] == pytest.approx(lam, rel=1e-6)
    # spread="entropy_bound" ignores the impurity: example B's values (G = 1 - exp(-ln 2) = 0.5).
    bound = AIS(spread="entropy_bound")(train, rollout, mask, advantages=adv, entropy=ent, impurity=imp)
    assert bound.stats["ais/spread"] == pytest.approx(0.5, rel=1e-6)
    assert bound.stats["ais/lambda"] == pytest.approx(LAMBDA_B, rel=1e-6)
    # The default without impurity falls back to the bound, and use_entropy=False still means G = 1.
    fallback = AIS()(train, rollout, mask, advantages=adv, entropy=ent)
    assert fallback.stats["ais/lambda"] == pytest.approx(LAMBDA_B, rel=1e-6)
    off = AIS(use_entropy=False)(train, rollout, mask, advantages=adv, entropy=ent, impurity=imp)
    assert off.stats["ais/severity"] == pytest.approx(2 * D_B, rel=1e-6)


def test_from_log_ratio_hands_the_impurity_to_ais_only(example_b):
    train, rollout, mask, adv, ent = example_b
    imp = torch.full(mask.shape, 0.25)
    delta = log_ratio(train, rollout, mask)
    out = AIS().from_log_ratio(delta, mask, advantages=adv, entropy=ent, impurity=imp)
    assert out.stats["ais/spread"] == pytest.approx(0.25, rel=1e-6)
    # Correctors that do not read it accept it and give what they give without it.
    for corrector in (TIS(), AISv1()):
        with_imp = corrector.from_log_ratio(delta, mask, advantages=adv, entropy=ent, impurity=imp)
        without = corrector.from_log_ratio(delta, mask, advantages=adv, entropy=ent)
        assert torch.equal(with_imp.weights, without.weights) and with_imp.stats == without.stats


def test_a_misshapen_impurity_is_named(example_b):
    train, rollout, mask, adv, ent = example_b
    with pytest.raises(ValueError, match="impurity"):
        AIS()(train, rollout, mask, advantages=adv, impurity=torch.zeros(2, 2))


def test_bad_spread_is_named():
    with pytest.raises(ValueError, match="spread must be one of"):
        AIS(spread="entropy")


@pytest.mark.parametrize(
    "probs, want",
    [
        ([0.25, 0.25, 0.25, 0.25], 0.75),  # uniform over V = 4: 1 - 1/4
        ([0.75, 0.25, 0.0, 0.0], 0.375),  # 1 - (9/16 + 1/16)
        ([1.0, 0.0, 0.0, 0.0], 0.0),  # deterministic
    ],
)
def test_impurity_from_logits_by_hand(probs, want):
    from ais_lightning.ops import impurity_from_logits

    logits = torch.tensor(probs).log()  # -inf for 0: softmax gives the probabilities back
    assert float(impurity_from_logits(logits)) == pytest.approx(want, abs=1e-7)
    # temperature 2 squares the odds' root: p ~ sqrt(probs)
    root = torch.tensor(probs).sqrt()
    tempered = root / root.sum()
    assert float(impurity_from_logits(logits, 2.0)) == pytest.approx(
        float(1 - tempered.square().sum()), abs=1e-7
    )


def test_impurity_keeps_its_digits_for_a_peaked_policy():
    # logits (30, 0, 0, 0): eps = 3 e^-30 / (1 + 3 e^-30) off the top token, impurity = 2 eps - (4/3) eps^2
    # = 5.6e-13; 1 - sum p^2 in float32 rounds it to 0.
    from ais_lightning.ops import impurity_from_logits

    eps = 3 * math.exp(-30) / (1 + 3 * math.exp(-30))
    got = float(impurity_from_logits(torch.tensor([30.0, 0.0, 0.0, 0.0])))
    assert got == pytest.approx(2 * eps - 4 / 3 * eps**2, rel=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        impurity_from_logits(torch.zeros(3), 0.0)


def test_advantages_weight_the_variance(example_b):
    # A = [2, 1] per response: A^2 = [4, 4 | 1, 1]; chi2_A = (0*4 + 1*4 + 0.25*1 + 0*1) / 10 = 0.425.
    train, rollout, mask, _, ent = example_b
    out = AIS()(train, rollout, mask, advantages=torch.tensor([2.0, 1.0]), entropy=ent)
    assert out.stats["ais/variance_amplification"] == pytest.approx(1.425, rel=1e-6)
    assert out.stats["ais/lambda"] == pytest.approx(BIAS_B / (BIAS_B + ADAM * 0.425), rel=1e-6)
    per_token = AIS()(train, rollout, mask, advantages=torch.tensor([[2.0] * 3, [1.0] * 3]), entropy=ent)
    assert per_token.stats == out.stats


def test_zero_or_missing_advantages_use_the_unweighted_chi2(example_b):
    # chi2 = mean (b - 1)^2 = (0 + 1 + 0.25 + 0) / 4 = 0.3125, the value with A^2 = 1 above.
    train, rollout, mask, _, ent = example_b
    for adv in (None, torch.zeros(2)):
        out = AIS()(train, rollout, mask, advantages=adv, entropy=ent)
        assert out.stats["ais/variance_excess"] == pytest.approx(ADAM * CHI2_B, rel=1e-6)
        assert out.stats["ais/lambda"] == pytest.approx(LAMBDA_B, rel=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"use_reliability": False}, BETA_B**2 / (BETA_B**2 + ADAM * CHI2_B)),
        ({"noise_to_signal": 4.0}, BIAS_B / (BIAS_B + 4.0 * ADAM * CHI2_B)),
        ({"noise_to_signal": 0.0}, 1.0),  # variance ignored: correct fully whenever beta > 0
        ({"momentum": 0.0}, LAMBDA_B_ONE_STEP),  # one batch's gradient: no averaging
        ({"momentum": 0.5}, BIAS_B / (BIAS_B + CHI2_B / 3.0)),  # (1 - 0.5) / (1 + 0.5) = 1/3
        ({"momentum": 0.0, "noise_to_signal": 4.0}, BIAS_B / (BIAS_B + 4.0 * CHI2_B)),
        ({"mini_batches": 4}, BIAS_B / (BIAS_B + 4.0 * ADAM * CHI2_B)),  # each step sees a quarter: 4/19
        ({"momentum": 0.0, "mini_batches": 2}, BIAS_B / (BIAS_B + 2.0 * CHI2_B)),  # one half-batch step
        ({"momentum": 0.5, "ppo_epochs": 2}, BIAS_B / (BIAS_B + 0.5 * CHI2_B)),  # reused twice: 1/3 -> 1/2
        ({"lambda_max": 0.5}, 0.5),
        ({"lambda_min": 0.99}, 0.99),
    ],
)
def test_options(example_b, kwargs, expected):
    train, rollout, mask, adv, ent = example_b
    out = AIS(**kwargs)(train, rollout, mask, advantages=adv, entropy=ent)
    assert out.stats["ais/lambda"] == pytest.approx(expected, rel=1e-6)
    assert out.stats["ais/reliability"] == pytest.approx(R_B, rel=1e-6)  # reported as measured


def test_base_mis(make_logprobs):
    # Responses [1, 0.25] and [4, 1], C = 2, c_low = 1/C = 0.5 (MIS defaults), no advantages/entropy.
    # b = w inside [0.5, 2] else 0: [1, 0] | [0, 1]  (0.25 and 4 rejected; TIS would give 0.25, 2).
    # k3: [0, 0.25 - 1 + ln 4] | [3 - ln 4, 0] = [0, 0.6362944] | [1.6137056, 0];  D = 2.25 / 4 = 0.5625
    # se^2 = 2 * ((0.6362944 - 1.125)^2 + (1.6137056 - 1.125)^2) / 16 = 2 * 2 * 0.4887056^2 / 16 = 0.0597082
    # R = 1 - 0.0597082 / 0.3164063 = 0.8112924; beta = 2 D = 1.125; bias_sq = R * 1.265625 = 1.0267920
    # chi2 = mean (b - 1)^2 = (0 + 1 + 1 + 0) / 4 = 0.5, variance_excess = 0.5 / 19 = 0.0263158
    # lambda = 1.0267920 / 1.0531078 = 0.9750112  (one step: 1.0267920 / 1.5267920 = 0.6725158)
    train, rollout, mask = make_logprobs([[1.0, 0.25], [4.0, 1.0]], [[1, 1], [1, 1]])
    out = AIS(base="mis")(train, rollout, mask)
    k_a, k_b = 0.25 - 1 + math.log(4.0), 3 - math.log(4.0)
    d = (k_a + k_b) / 4
    assert d == pytest.approx(0.5625, abs=1e-12)  # ln 4 cancels
    r = 1 - 2 * ((k_a - 2 * d) ** 2 + (k_b - 2 * d) ** 2) / 16 / d**2
    assert r == pytest.approx(0.8112924, abs=1e-6)
    lam = r * (2 * d) ** 2 / (r * (2 * d) ** 2 + 0.5 / 19)
    assert lam == pytest.approx(0.9750112, abs=1e-6)
    assert out.stats["ais/variance_excess"] == pytest.approx(0.5 / 19, rel=1e-6)
    assert out.stats["ais/lambda"] == pytest.approx(lam, rel=1e-6)
    # Rejected tokens keep weight 1 - lambda and stay in the mask (and in the loss's denominator).
    torch.testing.assert_close(out.weights, torch.tensor([[1.0, 1 - lam], [1 - lam, 1.0]]), atol=1e-6, rtol=0)
    assert bool(out.mask.all())
    assert out.stats["corrector/clipped_frac"] == pytest.approx(0.5)


@pytest.mark.parametrize("base", ["tis", "mis"])
def test_limits_are_none_and_the_base_corrector(example, base):
    train, rollout, mask = example
    none = NoCorrection()(train, rollout, mask)
    zero = AIS(base=base, fixed_lambda=0.0)(train, rollout, mask)
    assert torch.equal(zero.weights, none.weights) and torch.equal(zero.mask, none.mask)
    full = AIS(base=base, c=2.0, fixed_lambda=1.0)(train, rollout, mask)
    if base == "tis":
        ref = TIS(level="token", c_high=2.0)(train, rollout, mask)
        assert torch.equal(full.weights, ref.weights) and torch.equal(full.mask, ref.mask)
    else:
        ref = MIS(level="token", c_low=0.5, c_high=2.0)(train, rollout, mask)
        # Same weights where MIS keeps a token, 0 where it rejects one; the mask stays whole.
        torch.testing.assert_close(
            full.weights, torch.where(ref.mask, ref.weights, torch.zeros_like(ref.weights))
        )
        assert torch.equal(full.mask, mask)


def test_on_policy_gives_lambda_zero_and_unit_weights(make_logprobs):
    # pi = mu: D = 0, so beta = 0, R = 0 (no evidence) and chi2 = 0: lambda = 0 / 0 := 0.
    train, rollout, mask = make_logprobs([[1.0, 1.0], [1.0, 1.0]], [[1, 1], [1, 0]])
    out = AIS()(train, rollout, mask, advantages=torch.tensor([1.0, -1.0]), entropy=torch.ones(2, 2))
    assert out.stats["ais/lambda"] == 0.0
    assert out.stats["ais/kl_k3"] == 0.0 and out.stats["ais/reliability"] == 0.0
    assert out.stats["ais/variance_amplification"] == 1.0
    torch.testing.assert_close(out.weights, mask.float())


def test_one_response_is_no_evidence(make_logprobs):
    # The clustered standard error needs 2 responses: with 1, R = 0 and lambda = 0 however large D.
    train, rollout, mask = make_logprobs([[1.0, 40.0]], [[1, 1]])
    out = AIS()(train, rollout, mask)
    assert out.stats["ais/kl_k3"] > 10 and out.stats["ais/reliability"] == 0.0
    assert out.stats["ais/lambda"] == 0.0
    assert AIS(use_reliability=False)(train, rollout, mask).stats["ais/lambda"] > 0.99


@pytest.mark.parametrize("log_ratio_value", [-15.0, 15.0, 30.0])
def test_extreme_mismatch_gives_lambda_near_one(log_ratio_value):
    # Every token off by e^{+-15} (30: beyond the +-20 clamp) in 4 responses of 3 tokens: k3 >= 14,
    # beta >= 28 / G, the clustered se is 0 (identical responses), chi2 <= max(1, (C - 1)^2) = 1.
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(4, 3, generator=g) - 0.1
    train = rollout + log_ratio_value
    mask = torch.ones(4, 3, dtype=torch.bool)
    out = AIS()(train, rollout, mask, advantages=torch.randn(4, generator=g), entropy=torch.full((4, 3), 0.5))
    assert out.stats["ais/reliability"] == pytest.approx(1.0)
    assert out.stats["ais/lambda"] > 0.999


@pytest.mark.parametrize(("momentum", "first_below", "last_above"), [(0.0, 0.02, 0.8), (0.9, 0.15, 0.98)])
def test_lambda_grows_as_the_policy_concentrates(momentum, first_below, last_above):
    # The same small mismatch (log-ratios ~ N(0, 0.1^2), 16 responses of 8 tokens) at falling
    # entropy: G = 1 - exp(-H) shrinks, beta = 2 D / G grows, and lambda climbs from near 0 to near 1
    # ("exploration early, bias later"). In odds, lambda / (1 - lambda) = R beta^2 / (a phi chi2_A):
    # the averaged update (a = 1/19) multiplies the one-step odds by 19 (0.0065 -> 0.11 at H = 3).
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(16, 8, generator=g) - 0.1
    train = rollout + 0.1 * torch.randn(16, 8, generator=g)
    mask = torch.ones(16, 8, dtype=torch.bool)
    adv = torch.randn(16, generator=g)
    lams = [
        AIS(momentum=momentum)(train, rollout, mask, advantages=adv, entropy=torch.full(mask.shape, h))
        for h in (3.0, 1.0, 0.3, 0.1, 0.03)
    ]
    lams = [out.stats["ais/lambda"] for out in lams]
    assert lams == sorted(lams)
    assert lams[0] < first_below and lams[-1] > last_above


@pytest.mark.parametrize("shape", [(0, 4), (3, 0), (2, 3)])
def test_empty_inputs_give_zero_weights_and_finite_stats(shape):
    train = torch.full(shape, -1.0)
    rollout = torch.full(shape, -3.0)
    mask = torch.zeros(shape, dtype=torch.bool)
    out = AIS()(train, rollout, mask, advantages=torch.ones(shape[0]), entropy=torch.ones(shape))
    assert out.weights.shape == shape and bool((out.weights == 0).all())
    assert all(math.isfinite(v) for v in out.stats.values())
    assert out.stats["ais/lambda"] == 0.0


def test_fixed_lambda_ema_and_state_dict(example_b, make_logprobs):
    train, rollout, mask, adv, ent = example_b
    on_policy = make_logprobs([[1.0, 1.0], [1.0, 1.0]], [[1, 1], [1, 1]])  # lambda_raw = 0
    fixed = AIS(fixed_lambda=0.25)(train, rollout, mask, advantages=adv, entropy=ent)
    assert fixed.stats["ais/lambda"] == 0.25
    assert fixed.stats["ais/lambda_raw"] == pytest.approx(LAMBDA_B, rel=1e-6)
    ais = AIS(ema_decay=0.5)
    assert ais(train, rollout, mask, advantages=adv, entropy=ent).stats["ais/lambda"] == pytest.approx(
        LAMBDA_B
    )
    state = {k: v.clone() for k, v in ais.state_dict().items()}
    assert set(state) == {"ema_lambda", "ema_steps"}
    assert ais(*on_policy).stats["ais/lambda"] == pytest.approx(0.5 * LAMBDA_B, rel=1e-6)  # 0.5 l1 + 0.5 * 0
    restored = AIS(ema_decay=0.5)
    restored.load_state_dict(state)
    restored.eval()  # eval mode: the EMA is used but not advanced
    assert restored(*on_policy).stats["ais/lambda"] == pytest.approx(0.5 * LAMBDA_B, rel=1e-6)
    assert restored(*on_policy).stats["ais/lambda"] == pytest.approx(0.5 * LAMBDA_B, rel=1e-6)
    assert int(restored.ema_steps) == 1


def test_sufficient_statistics_are_additive_over_responses(make_random_inputs):
    train, rollout, mask, adv, ent = make_random_inputs(0, 6, 5, 0.5)
    delta = log_ratio(train, rollout, mask)
    params = ais_params()
    base, _ = ais_base_weights(delta, mask, params)

    def stats(rows):
        return ais_sufficient_statistics(
            delta[rows], mask[rows], base[rows], advantages=adv[rows], entropy=ent[rows]
        )

    whole = stats(slice(0, 6))
    torch.testing.assert_close(stats(slice(0, 2)) + stats(slice(2, 3)) + stats(slice(3, 6)), whole)
    # Independent check of some entries: N, responses, sum k3, sum_s K_s^2, sum (1 - e^-H), sum (b - 1)^2.
    d = delta.double()
    k3 = (d.exp() - 1 - d) * mask
    b = torch.minimum(d.exp(), torch.tensor(2.0, dtype=torch.float64))
    assert float(whole[0]) == float(mask.sum())
    assert float(whole[1]) == float(mask.any(-1).sum())
    assert float(whole[2]) == pytest.approx(float(k3.sum()), rel=1e-6)
    assert float(whole[3]) == pytest.approx(float((k3.sum(-1) ** 2).sum()), rel=1e-6)
    assert float(whole[6]) == pytest.approx(float(((1 - torch.exp(-ent.double())) * mask).sum()), rel=1e-9)
    assert float(whole[11]) == pytest.approx(float((((b - 1) ** 2) * mask).sum()), rel=1e-5)


def test_k3_is_accurate_for_tiny_mismatch():
    # delta = 1e-4 on every token: k3 = d^2/2 + d^3/6 per token, accurate in float64 with expm1.
    delta = torch.full((2, 3), 1e-4).float()
    mask = torch.ones(2, 3, dtype=torch.bool)
    d = float(delta[0, 0])
    base, _ = ais_base_weights(delta, mask, ais_params())
    coef = ais_coefficient(ais_sufficient_statistics(delta, mask, base), ais_params())
    assert float(coef["kl_k3"]) == pytest.approx(d * d / 2 + d**3 / 6, rel=1e-6)


def test_severity_recovers_the_logit_noise_variance():
    # The model behind beta: mu = softmax(z + eta), eta ~ N(0, sigma^2) iid per logit. Then
    # E KL(mu || pi) = sigma^2 G / 2 to second order, G = 1 - sum pi^2, so 2 KL / G estimates sigma^2.
    # Exact KL and G per context (no token sampling), averaged over 4000 contexts and noise draws.
    g = torch.Generator().manual_seed(0)
    z = 3.0 * torch.randn(4000, 50, generator=g, dtype=torch.float64)  # concentrated and spread contexts
    log_pi = torch.log_softmax(z, -1)
    for sigma in (0.05, 0.1, 0.2):
        log_mu = torch.log_softmax(z + sigma * torch.randn(z.shape, generator=g, dtype=torch.float64), -1)
        kl = (log_mu.exp() * (log_mu - log_pi)).sum(-1)  # KL(mu || pi) per context
        gini = 1 - (log_pi.exp() ** 2).sum(-1)
        assert float(2 * kl.sum() / gini.sum()) == pytest.approx(sigma**2, rel=0.05)
        # ... and the spread bound G <= 1 - exp(-H) (Renyi-2 entropy <= Shannon entropy) holds.
        entropy = -(log_pi.exp() * log_pi).sum(-1)
        assert bool((gini <= -torch.expm1(-entropy) + 1e-12).all())


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"c": 0.5}, "c must"),
        ({"c": float("nan")}, "c must"),
        ({"base": "psis"}, "base must"),
        ({"c_low": 1.5}, "c_low"),
        ({"c_low": -0.1}, "c_low"),
        ({"noise_to_signal": -1.0}, "noise_to_signal"),
        ({"noise_to_signal": float("inf")}, "noise_to_signal"),
        ({"momentum": 1.0}, "momentum"),
        ({"momentum": -0.1}, "momentum"),
        ({"momentum": True}, "momentum"),
        ({"ppo_epochs": 0}, "ppo_epochs"),
        ({"mini_batches": 2.0}, "mini_batches"),
        ({"use_entropy": 1}, "use_entropy"),
        ({"use_reliability": "yes"}, "use_reliability"),
        ({"lambda_min": 0.6, "lambda_max": 0.4}, "lambda_min"),
        ({"lambda_max": 1.5}, "lambda_max"),
        ({"ema_decay": 1.0}, "ema_decay"),
        ({"fixed_lambda": 1.5}, "fixed_lambda"),
    ],
)
def test_bad_options_name_the_argument_first(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        AIS(**kwargs)


def test_defaults_live_only_in_the_signature():
    # AISParams has no defaults; AIS's signature is keyword-only with config-friendly types.
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(AISParams))
    sig = inspect.signature(AIS)
    assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in sig.parameters.values())
    fields = {f.name for f in dataclasses.fields(AISParams)}
    assert fields | {"ema_decay", "fixed_lambda"} == set(sig.parameters)
    assert ais_params() == AIS().params
    assert ais_params(c=3.0).c == 3.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        AIS().params.c = 3.0


def test_registry_and_repr():
    assert type(build_corrector("ais")) is AIS
    assert type(build_corrector("ais_v1", kappa=0.1)) is AISv1
    assert "noise_to_signal=1.0, momentum=0.9" in repr(AIS()) and "ema_decay=0.9" in repr(AIS(ema_decay=0.9))
