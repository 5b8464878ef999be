"""Properties: accumulation over updates, pi = mu, empty masks, k3 >= 0, input validation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


def random_batch(seed: int, b: int = 6, t: int = 5):
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(b, t, generator=gen) * 3.0  # [B, T] log mu
    train = rollout + torch.randn(b, t, generator=gen) * 0.7  # [B, T] log pi
    mask = torch.rand(b, t, generator=gen) < 0.7
    mask[0] = False  # one empty sequence
    mask[1, 0] = True
    return train, rollout, mask


def as_floats(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def test_several_updates_equal_one_update_on_the_concatenation():
    train, rollout, mask = random_batch(0)
    entropy = torch.rand(mask.shape, generator=torch.Generator().manual_seed(1)) * 2.0
    weights = torch.where(train > rollout, torch.full_like(train, 2.0), torch.ones_like(train))
    corrected = mask & (torch.arange(mask.shape[1]) % 2 == 0)

    def build():
        return (
            MismatchDiagnostics(c=1.5),
            TokenEntropy(),
            CorrectionFraction("masked"),
            CorrectionFraction("clipped", c=2.0),
        )

    whole, pieces = build(), build()
    whole[0].update(train, rollout, mask)
    whole[1].update(entropy, mask)
    for m in whole[2:]:
        m.update(mask, corrected, weights)
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        pieces[0].update(train[rows], rollout[rows], mask[rows])
        pieces[1].update(entropy[rows], mask[rows])
        for m in pieces[2:]:
            m.update(mask[rows], corrected[rows], weights[rows])

    got, want = as_floats(pieces[0].compute()), as_floats(whole[0].compute())
    assert got.keys() == want.keys()
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=1e-9, abs=1e-12), name
    for a, b in zip(pieces[1:], whole[1:]):
        assert float(a.compute()) == pytest.approx(float(b.compute()), rel=1e-12)


def test_accumulates_across_batches_with_different_lengths():
    # batch 1: one token with w = 2; batch 2 (T = 3): tokens with w = 1, 4 -> mean(w^2) - 1 = 7 - 1
    metric = ChiSquare("token")
    ln2 = math.log(2.0)
    metric.update(torch.tensor([[ln2]]), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool))
    metric.update(torch.tensor([[0.0, 2 * ln2, 5.0]]), torch.zeros(1, 3), torch.tensor([[True, True, False]]))
    assert float(metric.compute()) == pytest.approx((4 + 1 + 16) / 3 - 1, rel=1e-6)


def test_identical_policies():
    _, rollout, mask = random_batch(2)
    coll = MismatchDiagnostics(c=2.0)
    coll.update(rollout.clone(), rollout, mask)
    out = as_floats(coll.compute())
    expected = {
        "kl_k1": 0.0,
        "kl_k3": 0.0,
        "chi2_token": 0.0,
        "chi2_seq": 0.0,
        "ess": 1.0,
        "ppl_ratio": 1.0,
        "ratio_mean": 1.0,
        "ratio_min": 1.0,
        "ratio_max": 1.0,
        "ratio_frac_above": 0.0,
        "ratio_frac_below": 0.0,
    }
    for name, want in expected.items():
        assert out[f"mismatch/{name}"] == pytest.approx(want, abs=1e-12), name


def test_empty_mask_gives_documented_finite_values():
    train, rollout, mask = random_batch(3)
    empty = torch.zeros_like(mask)
    coll = MismatchDiagnostics(prefix="")
    coll.update(train, rollout, empty)
    out = as_floats(coll.compute())
    # documented empty values: 1 for ratio-like quantities (ESS, ppl ratio, mean/min/max), 0 otherwise
    ones = {"ess", "ppl_ratio", "ratio_mean", "ratio_min", "ratio_max", "train_ppl", "rollout_ppl"}
    ones |= {"ppl_ratio_seq", "ess_clipped", "seq_ratio_mean", "seq_ratio_max", "seq_ratio_min"}
    # NeMo-RL's multiplicative errors (1 = agreement) and verl's correlation (1 while undefined)
    ones |= {"token_mult_prob_error", "probs_pearson", "seq_mult_prob_error_max"}
    ones |= {"seq_mult_prob_error_mean", "seq_mult_prob_error_min"}
    for name, got in out.items():
        if name == "ais_lambda":
            assert math.isfinite(got)
            continue
        assert got == (1.0 if name in ones else 0.0), name
    entropy = TokenEntropy()
    entropy.update(torch.full(mask.shape, float("nan")), empty)
    assert float(entropy.compute()) == 0.0
    for kind in ("masked", "clipped"):
        frac = CorrectionFraction(kind)
        frac.update(empty, empty, torch.zeros(mask.shape))
        assert float(frac.compute()) == 0.0


def test_empty_update_does_not_change_accumulated_value():
    train, rollout, mask = random_batch(4)
    a, b = MismatchDiagnostics(prefix=""), MismatchDiagnostics(prefix="")
    a.update(train, rollout, mask)
    b.update(train, rollout, mask)
    b.update(train, rollout, torch.zeros_like(mask))
    assert as_floats(a.compute()) == as_floats(b.compute())


def test_ess_in_unit_interval_and_chi2_nonnegative_on_random_data():
    for seed in range(5):
        train, rollout, mask = random_batch(seed)
        ess, chi2 = EffectiveSampleSize(), ChiSquare("token")
        ess.update(train, rollout, mask)
        chi2.update(train, rollout, mask)
        assert 0.0 < float(ess.compute()) <= 1.0
        # Jensen: E[w^2] >= E[w]^2 and with ESS = E[w]^2 / E[w^2]
        ratio_mean = RatioStatistic("mean")
        ratio_mean.update(train, rollout, mask)
        assert float(ess.compute()) == pytest.approx(
            float(ratio_mean.compute()) ** 2 / (float(chi2.compute()) + 1.0), rel=1e-9
        )


logprob = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(logprob, logprob, st.booleans()), min_size=1, max_size=12))
def test_k3_nonnegative_and_matches_independent_formula(tokens):
    train = torch.tensor([[t for t, _, _ in tokens]], dtype=torch.float32)
    rollout = torch.tensor([[r for _, r, _ in tokens]], dtype=torch.float32)
    mask = torch.tensor([[m for _, _, m in tokens]])
    k1, k3 = MismatchKL("k1"), MismatchKL("k3")
    k1.update(train, rollout, mask)
    k3.update(train, rollout, mask)
    # independent computation in plain Python on the float32-rounded inputs
    deltas = [
        min(max(float(t) - float(r), -20.0), 20.0)
        for t, r, m in zip(train[0].tolist(), rollout[0].tolist(), mask[0].tolist())
        if m
    ]
    want_k3 = sum(math.exp(d) - 1.0 - d for d in deltas) / len(deltas) if deltas else 0.0
    want_k1 = sum(-d for d in deltas) / len(deltas) if deltas else 0.0
    got_k3 = float(k3.compute())
    assert got_k3 >= 0.0
    assert got_k3 == pytest.approx(want_k3, rel=1e-5, abs=1e-9)
    assert float(k1.compute()) == pytest.approx(want_k1, rel=1e-5, abs=1e-6)


def test_reset_clears_state():
    train, rollout, mask = random_batch(5)
    metric = RatioStatistic("min")
    metric.update(train, rollout, mask)
    metric.reset()
    metric.update(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool))
    assert float(metric.compute()) == 1.0


def test_collection_accepts_and_filters_extra_kwargs():
    train, rollout, mask = random_batch(6)
    a, b = MismatchDiagnostics(prefix=""), MismatchDiagnostics(prefix="")
    a.update(train, rollout, mask)
    b.update(train, rollout, mask, advantages=torch.ones(mask.shape[0]), entropy=torch.ones(mask.shape))
    got, want = as_floats(b.compute()), as_floats(a.compute())
    for name in want:
        if name != "ais_lambda":  # lambda legitimately depends on advantages/entropy
            assert got[name] == want[name], name


@pytest.mark.parametrize(
    ("factory", "kwargs", "named"),
    [
        (MismatchKL, {"estimator": "k2"}, "estimator"),
        (ChiSquare, {"level": "geometric"}, "level"),
        (RatioStatistic, {"stat": "median"}, "stat"),
        (RatioStatistic, {"stat": "frac_above", "c": 0.5}, "c must"),
        (RatioStatistic, {"c": float("inf")}, "c must"),
        (CorrectionFraction, {"kind": "rejected"}, "kind"),
        (CorrectionFraction, {"c": 0.0}, "c must"),
    ],
)
def test_bad_constructor_arguments(factory, kwargs, named):
    with pytest.raises(ValueError, match=named):
        factory(**kwargs)


def test_bad_inputs_raise_value_error_naming_the_tensor():
    train, rollout, mask = random_batch(7)
    metric = MismatchKL()
    with pytest.raises(ValueError, match="mask"):
        metric.update(train, rollout, mask.float())
    with pytest.raises(ValueError, match="rollout_logprobs"):
        metric.update(train, rollout[:, :-1], mask)
    bad = train.clone()
    bad[mask] = float("inf")
    with pytest.raises(ValueError, match="train_logprobs"):
        metric.update(bad, rollout, mask)
    with pytest.raises(ValueError, match="entropy"):
        TokenEntropy().update(torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2, dtype=torch.bool))
    frac = CorrectionFraction("clipped")
    with pytest.raises(ValueError, match="corrected_mask"):
        frac.update(mask, mask[:, :-1], train)
    with pytest.raises(ValueError, match="weights"):
        frac.update(mask, mask)


def test_masked_tokens_may_hold_garbage():
    train, rollout, mask = random_batch(8)
    dirty_train, dirty_rollout = train.clone(), rollout.clone()
    dirty_train[~mask] = float("nan")
    dirty_rollout[~mask] = float("-inf")
    a, b = PerplexityRatio(), PerplexityRatio()
    a.update(train, rollout, mask)
    b.update(dirty_train, dirty_rollout, mask)
    assert float(a.compute()) == float(b.compute())


def test_collection_members_keep_separate_states_after_an_identical_first_batch():
    # After a pi = mu batch, kl_k1, kl_k3, ppl_ratio and the ratio fractions all hold total = 0 and
    # the same count; torchmetrics' compute groups would merge them. Each must still match a
    # standalone metric after a second, mismatched batch.
    _, rollout, mask = random_batch(9)
    train, rollout2, mask2 = random_batch(10)
    coll = MismatchDiagnostics(prefix="", c=1.5)
    coll.update(rollout.clone(), rollout, mask)
    coll.update(train, rollout2, mask2)
    standalone = {
        "kl_k1": MismatchKL("k1"),
        "kl_k3": MismatchKL("k3"),
        "ppl_ratio": PerplexityRatio(),
        "ratio_frac_above": RatioStatistic("frac_above", c=1.5),
        "ratio_frac_below": RatioStatistic("frac_below", c=1.5),
    }
    out = as_floats(coll.compute())
    for name, metric in standalone.items():
        metric.update(rollout.clone(), rollout, mask)
        metric.update(train, rollout2, mask2)
        assert out[name] == pytest.approx(float(metric.compute()), rel=1e-12), name
