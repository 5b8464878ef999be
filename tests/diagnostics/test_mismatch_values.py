"""Hand-derived values of every diagnostic on small explicit tensors."""

from __future__ import annotations

import math

import pytest
import torch

from ais_lightning.diagnostics import (
    ChiSquare,
    CorrectionFraction,
    EffectiveSampleSize,
    MismatchDiagnostics,
    MismatchKL,
    PerplexityRatio,
    RatioStatistic,
    TokenEntropy,
)

LN2 = math.log(2.0)
NAN = float("nan")


def example():
    """3 sequences x 3 tokens; the last column and the whole last row are masked (NaN there).

    Valid log-ratios delta = log pi - log mu:
      seq0: [ln2, -ln2]  -> w = [2, 0.5], sequence ratio W0 = 1
      seq1: [0,   2 ln2] -> w = [1, 4],   sequence ratio W1 = 4
    so the valid token ratios are w = {2, 0.5, 1, 4}, N = 4, and 2 valid sequences.
    """
    rollout = torch.tensor([[-1.0, -2.0, NAN], [-1.5, -3.0, NAN], [NAN, NAN, NAN]])
    delta = torch.tensor([[LN2, -LN2, 0.0], [0.0, 2 * LN2, 0.0], [0.0, 0.0, 0.0]])
    train = rollout + delta
    mask = torch.tensor([[True, True, False], [True, True, False], [False, False, False]])
    return train, rollout, mask


def value(metric, *args):
    metric.update(*args)
    return float(metric.compute())


def test_kl_k1():
    # k1 = mean(-delta) = -(ln2 - ln2 + 0 + 2 ln2) / 4 = -ln2 / 2
    assert value(MismatchKL("k1"), *example()) == pytest.approx(-LN2 / 2, rel=1e-6)


def test_kl_k3():
    # k3 = mean(w - 1 - delta) = [(2-1-ln2) + (0.5-1+ln2) + (1-1-0) + (4-1-2ln2)] / 4
    #    = (3.5 - 2 ln2) / 4 = 0.875 - ln2 / 2 ~= 0.528426
    assert value(MismatchKL("k3"), *example()) == pytest.approx(0.875 - LN2 / 2, rel=1e-6)


def test_chi2_token():
    # mean(w^2) - 1 = (4 + 0.25 + 1 + 16) / 4 - 1 = 5.3125 - 1 = 4.3125
    assert value(ChiSquare("token"), *example()) == pytest.approx(4.3125, rel=1e-6)


def test_chi2_sequence_ignores_fully_masked_sequence():
    # sequence ratios W = {1, 4} (row 2 has no valid token): mean(W^2) - 1 = (1 + 16) / 2 - 1 = 7.5
    assert value(ChiSquare("sequence"), *example()) == pytest.approx(7.5, rel=1e-6)


def test_chi2_sequence_log_ratio_is_clamped():
    # two tokens with delta = 15 each: log W = 30 is clamped to 20, so chi2 = e^40 - 1 (finite)
    train = torch.tensor([[15.0, 15.0]])
    rollout = torch.zeros(1, 2)
    got = value(ChiSquare("sequence"), train, rollout, torch.ones(1, 2, dtype=torch.bool))
    assert got == pytest.approx(math.exp(40.0) - 1.0, rel=1e-5)


def test_ess():
    # (sum w)^2 / (N sum w^2) = 7.5^2 / (4 * 21.25) = 56.25 / 85
    assert value(EffectiveSampleSize(), *example()) == pytest.approx(56.25 / 85.0, rel=1e-6)


def test_ess_one_dominant_token_tends_to_one_over_n():
    # w = [e^20, e^-20, e^-20, e^-20]: ESS ~= (e^20)^2 / (4 e^40) = 1/4
    train = torch.tensor([[20.0, -20.0, -20.0, -20.0]])
    got = value(EffectiveSampleSize(), train, torch.zeros(1, 4), torch.ones(1, 4, dtype=torch.bool))
    assert got == pytest.approx(0.25, rel=1e-6)


@pytest.mark.parametrize(
    ("stat", "expected"),
    [
        ("mean", 7.5 / 4),  # (2 + 0.5 + 1 + 4) / 4
        ("min", 0.5),
        ("max", 4.0),
        ("frac_above", 0.5),  # c = 1.5: w > 1.5 for {2, 4}
        ("frac_below", 0.25),  # 1/c = 2/3: w < 2/3 for {0.5}
    ],
)
def test_ratio_statistics(stat, expected):
    assert value(RatioStatistic(stat, c=1.5), *example()) == pytest.approx(expected, rel=1e-6)


def test_ratio_max_uses_per_token_clamp():
    # delta = 25 is clamped to 20 before exp
    got = value(
        RatioStatistic("max"), torch.tensor([[25.0]]), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool)
    )
    assert got == pytest.approx(math.exp(20.0), rel=1e-6)


def test_perplexity_ratio_example():
    # exp(mean delta) = exp((ln2 - ln2 + 0 + 2 ln2) / 4) = exp(ln2 / 2) = sqrt(2)
    assert value(PerplexityRatio(), *example()) == pytest.approx(math.sqrt(2.0), rel=1e-6)


def test_perplexity_ratio_above_one_when_trainer_finds_tokens_more_likely():
    # log pi = -1 > log mu = -2 on every token: ppl_pi = e^1, ppl_mu = e^2, ppl_mu / ppl_pi = e
    train = torch.full((2, 2), -1.0)
    rollout = torch.full((2, 2), -2.0)
    got = value(PerplexityRatio(), train, rollout, torch.ones(2, 2, dtype=torch.bool))
    assert got == pytest.approx(math.e, rel=1e-6)
    assert got > 1.0
    # and the other way round
    got_reverse = value(PerplexityRatio(), rollout, train, torch.ones(2, 2, dtype=torch.bool))
    assert got_reverse == pytest.approx(1.0 / math.e, rel=1e-6)


def test_token_entropy():
    # valid entropies {1, 2, 0.5}: mean = 3.5 / 3
    entropy = torch.tensor([[1.0, 2.0, NAN], [0.5, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert value(TokenEntropy(), entropy, mask) == pytest.approx(3.5 / 3, rel=1e-6)


def correction_example():
    """5 valid tokens; the corrector removed (0,1); kept tokens (0,0) and (1,0) sit at c = 2.

    (0,1) was removed even though its weight is 2 (not counted as clipped); (0,3) is not valid
    (ignored although corrected_mask is True there and its weight is 2).
    """
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    corrected = torch.tensor([[True, False, True, True], [True, True, False, False]])
    weights = torch.tensor([[2.0, 2.0, 1.3, 2.0], [2.0000002, 0.7, 0.0, 0.0]])
    return mask, corrected, weights


def test_correction_fraction_masked():
    # 1 removed of 5 valid
    assert value(CorrectionFraction("masked"), *correction_example()) == pytest.approx(0.2)


def test_correction_fraction_clipped():
    # kept & valid & |weight - 2| < 1e-6: (0,0), (1,0) -> 2 of 5 valid
    assert value(CorrectionFraction("clipped", c=2.0), *correction_example()) == pytest.approx(0.4)


def test_correction_fraction_masked_needs_no_weights():
    mask, corrected, _ = correction_example()
    assert value(CorrectionFraction("masked"), mask, corrected) == pytest.approx(0.2)


def test_collection_names_and_values():
    coll = MismatchDiagnostics(c=1.5)
    coll.update(*example())
    out = {k: float(v) for k, v in coll.compute().items()}
    expected = {
        "mismatch/kl_k1": -LN2 / 2,
        "mismatch/kl_k3": 0.875 - LN2 / 2,
        "mismatch/chi2_token": 4.3125,
        "mismatch/chi2_seq": 7.5,
        "mismatch/ess": 56.25 / 85.0,
        "mismatch/ratio_mean": 1.875,
        "mismatch/ratio_min": 0.5,
        "mismatch/ratio_max": 4.0,
        "mismatch/ratio_frac_above": 0.5,
        "mismatch/ratio_frac_below": 0.25,
        "mismatch/ppl_ratio": math.sqrt(2.0),
    }
    # ais_lambda: AIS v2 at C = 1.5 (docs/ais.md), no advantages/entropy (G = 1). Responses [2, 0.5], [1, 4]:
    # K = [0.5, 3 - 2 ln2]; R = 1 - 2 * 2 (0.5 - 2 D)^2 / 16 / D^2; beta = 2 D; chi2 = mean(min(w,1.5) - 1)^2 = 0.1875
    k3 = 0.875 - LN2 / 2
    r = 1 - 2 * 2 * (0.5 - 2 * k3) ** 2 / 16 / k3**2
    # variance term scaled by AdamW's averaging (1 - 0.9) / (1 + 0.9) = 1/19 (AIS's default momentum)
    expected["mismatch/ais_lambda"] = r * (2 * k3) ** 2 / (r * (2 * k3) ** 2 + 0.1875 / 19)  # ~0.9879170
    assert set(expected) <= set(out)  # the peer metrics' values: tests/diagnostics/test_peer_metrics.py
    for name, want in expected.items():
        assert out[name] == pytest.approx(want, rel=1e-6), name


def test_the_collection_takes_its_clip_bounds_and_lambda_from_the_correctors_params():
    """One clip bound per run: with the corrector's params (ratios w = {2, 0.5, 1, 4} of example()), MIS's band
    [0.6, 3] counts w > 3 and w < 0.6, clamps to it, and ais_lambda is AIS's with those params; AIS(c=4)'s own."""
    from ais_lightning.correctors import AIS, MIS, NoCorrection

    def run(**kwargs):
        coll = MismatchDiagnostics(**kwargs)
        coll.update(*example())
        return {k.removeprefix("mismatch/"): float(v) for k, v in coll.compute().items()}

    band = run(params=MIS(c_low=0.6, c_high=3.0).diagnostic_params())
    assert band["ratio_frac_above"] == 0.25 and band["ratio_frac_below"] == 0.25  # 4 > 3; 0.5 < 0.6
    clamped = torch.tensor([2.0, 0.6, 1.0, 3.0])  # w clamped to [0.6, 3]
    assert band["ratio_std"] == pytest.approx(float(clamped.std(unbiased=False)), rel=1e-6)
    default = run()  # C = 2, AIS's defaults: what a corrector without a bound shares
    assert run(params=NoCorrection().diagnostic_params()) == default == run(c=2.0)
    assert default["ratio_std"] != band["ratio_std"]
    ais = AIS(c=4.0)
    out = ais(*example(), entropy=None)
    assert run(params=ais.diagnostic_params())["ais_lambda"] == pytest.approx(
        out.stats["ais/lambda"], rel=1e-6
    )
    assert run(c=4.0)["ais_lambda"] != pytest.approx(default["ais_lambda"], rel=1e-3)
    with pytest.raises(ValueError, match="c=2.0 disagrees with params.c=4.0"):
        MismatchDiagnostics(c=2.0, params=ais.diagnostic_params())


def test_a_precomputed_log_ratio_gives_the_same_values_as_the_log_probs():
    """A training loop computes delta once and hands it to every metric: same result, no re-validation."""
    from ais_lightning import ops
    from ais_lightning.diagnostics import MismatchDiagnostics

    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(4, 6, generator=g) * 3
    train = rollout + 0.3 * torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) < 0.8
    adv = torch.randn(4, generator=g)
    plain, shared = MismatchDiagnostics(), MismatchDiagnostics()
    plain.update(train, rollout, mask, advantages=adv)
    delta = ops.log_ratio(train, rollout, mask)
    # Garbage log-probs prove that the ratio metrics read delta only; perplexities and verl's probability
    # difference and correlation need the log-probs themselves (not functions of the ratio).
    nan = torch.full_like(train, float("nan"))
    shared.update(nan, nan, mask, advantages=adv, log_ratio=delta)
    with_logprobs = MismatchDiagnostics()
    with_logprobs.update(train, rollout, mask, advantages=adv, log_ratio=delta)
    a, b, c = plain.compute(), shared.compute(), with_logprobs.compute()
    assert a.keys() == b.keys() == c.keys()
    for key in a:
        assert torch.equal(a[key], c[key]), key
        if not key.endswith("_ppl") and "/probs_" not in key:
            assert torch.equal(a[key], b[key]), key
