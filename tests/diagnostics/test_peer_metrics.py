"""The verl / TRL metrics and the Pareto k-hat: hand-derived values, the peers' formulas, exact merging.

Worked example (log mu = -2 on every token, pi = mu w), 8 valid tokens, the third token of response
1 is padding with w = 0.01:
    response 0: 3.0   0.25  1.5      mean w 1.583333   d = -mean ln w = -ln(1.125)/3 = -0.039260
    response 1: 0.8   1.25  [0.01]   mean w 1.025      d = 0
    response 2: 0.1   0.2   0.4      mean w 0.233333   d = -ln(0.008)/3 = 1.609438
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ais_lightning import ops
from ais_lightning.correctors import pareto_khat
from ais_lightning.diagnostics import (
    AbsLogRatio,
    ClippedRatioMoment,
    LogPerplexityDiff,
    MismatchDiagnostics,
    PSISKHat,
    SequencePerplexity,
    SequenceRatioStatistic,
)
from ais_lightning.diagnostics.psis import merge_top

T, F = True, False
RATIOS = [[3.0, 0.25, 1.5], [0.8, 1.25, 0.01], [0.1, 0.2, 0.4]]
MASK = [[T, T, T], [T, T, F], [T, T, T]]
D = [-math.log(1.125) / 3, 0.0, -math.log(0.008) / 3]  # d_i = mean_t (log mu - log pi)


def example():
    r = torch.tensor(RATIOS, dtype=torch.float64)
    rollout = torch.full_like(r, -2.0)
    return (rollout + torch.log(r)).float(), rollout.float(), torch.tensor(MASK)


def value(metric, *args) -> float:
    metric.update(*(args or example()))
    return float(metric.compute())


def test_sequence_perplexities_by_hand():
    # -mean log pi per response = 2 + d_i; -mean log mu = 2 everywhere.
    nll = [2.0 + d for d in D]
    assert value(SequencePerplexity("train", log=True)) == pytest.approx(sum(nll) / 3, rel=1e-6)
    assert value(SequencePerplexity("train")) == pytest.approx(sum(math.exp(x) for x in nll) / 3, rel=1e-6)
    assert value(SequencePerplexity("rollout", log=True)) == pytest.approx(2.0)
    assert value(SequencePerplexity("rollout")) == pytest.approx(math.exp(2.0))


def test_log_ppl_diffs_by_hand():
    assert value(LogPerplexityDiff("mean")) == pytest.approx(sum(D) / 3, rel=1e-6)  # 0.523393
    assert value(LogPerplexityDiff("abs_mean")) == pytest.approx(sum(map(abs, D)) / 3, rel=1e-6)
    assert value(LogPerplexityDiff("max")) == pytest.approx(1.609438, rel=1e-6)
    assert value(LogPerplexityDiff("min")) == pytest.approx(-0.039260, rel=1e-4)
    # verl ppl_ratio = mean_i exp(d_i) = (1.125^(-1/3) + 1 + 5) / 3 = 2.320500
    assert value(LogPerplexityDiff("exp_mean")) == pytest.approx((1.125 ** (-1 / 3) + 6.0) / 3, rel=1e-6)


def test_clipped_ratio_moments_by_hand():
    # clamp(w, 0.5, 2): 2, .5, 1.5, .8, 1.25, .5, .5, .5 -> sum 7.55, sum of squares 9.4525
    mean, second = 7.55 / 8, 9.4525 / 8
    assert value(ClippedRatioMoment("std", c=2.0)) == pytest.approx(math.sqrt(second - mean**2), rel=1e-6)
    assert value(ClippedRatioMoment("ess", c=2.0)) == pytest.approx(7.55**2 / (8 * 9.4525), rel=1e-6)


def test_sequence_ratio_statistics_by_hand():
    s = [4.75 / 3, 2.05 / 2, 0.7 / 3]  # 1.583333, 1.025, 0.233333
    mean = sum(s) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in s) / 2)  # Bessel, as torch.std in verl
    expected = {
        "mean": mean,
        "std": std,
        "max": s[0],
        "min": s[2],
        "max_deviation": 1 - s[2],  # |0.233 - 1| = 0.767 > |1.583 - 1| = 0.583
        "frac_above": 1 / 3,  # c = 1.5: only 1.583
        "frac_below": 1 / 3,  # < 1/1.5 = 0.667: only 0.233
    }
    for stat, want in expected.items():
        assert value(SequenceRatioStatistic(stat, c=1.5)) == pytest.approx(want, rel=1e-6), stat


def test_abs_log_ratio_by_hand():
    logs = [abs(math.log(w)) for row, m in zip(RATIOS, MASK) for w, v in zip(row, m) if v]
    assert value(AbsLogRatio("mean")) == pytest.approx(sum(logs) / 8, rel=1e-6)  # 1.020622
    assert value(AbsLogRatio("max")) == pytest.approx(math.log(10.0), rel=1e-6)


def test_against_the_peers_formulas_on_random_batches():
    """verl's compute_offpolicy_metrics / compute_is_metrics and TRL's sampling metrics, transcribed."""
    g = torch.Generator().manual_seed(0)
    rollout = (-torch.rand(7, 11, generator=g) * 3 - 0.01).double()
    train = rollout + 0.5 * torch.randn(7, 11, generator=g, dtype=torch.float64)
    mask = torch.ones(7, 11, dtype=torch.bool)
    mask[2, 6:] = False
    mask[5, 1:] = False
    m = mask.double()
    lp_pi = (train * m).sum(-1) / m.sum(-1)  # verl masked_mean(old_log_prob, axis=-1)
    lp_mu = (rollout * m).sum(-1) / m.sum(-1)
    log_ppl_diff = lp_mu - lp_pi
    w = torch.exp(train - rollout)
    w_c = w.clamp(0.5, 2.0)
    mean_c = (w_c * m).sum() / m.sum()
    seq_w = (w * m).sum(-1) / m.sum(-1)
    verl = {
        "train_ppl": torch.exp(-lp_pi).mean(),
        "train_log_ppl": (-lp_pi).mean(),
        "rollout_ppl": torch.exp(-lp_mu).mean(),
        "rollout_log_ppl": (-lp_mu).mean(),
        "log_ppl_diff": log_ppl_diff.mean(),
        "log_ppl_abs_diff": log_ppl_diff.abs().mean(),
        "log_ppl_diff_max": log_ppl_diff.max(),
        "log_ppl_diff_min": log_ppl_diff.min(),
        "ppl_ratio_seq": torch.exp(log_ppl_diff).mean(),
        "ratio_std": torch.sqrt((w_c**2 * m).sum() / m.sum() - mean_c**2),
        "ess_clipped": 1.0 / (((w_c / mean_c) ** 2 * m).sum() / m.sum()),
        "seq_ratio_mean": seq_w.mean(),
        "seq_ratio_std": seq_w.std(),
        "seq_ratio_max": seq_w.max(),
        "seq_ratio_min": seq_w.min(),
        "seq_ratio_max_deviation": (seq_w - 1).abs().max(),
        "seq_ratio_frac_above": (seq_w > 2.0).double().mean(),
        "seq_ratio_frac_below": (seq_w < 0.5).double().mean(),
        "abs_log_ratio_mean": (train - rollout).abs()[mask].mean(),  # TRL sampling_logp_difference
        "abs_log_ratio_max": (train - rollout).abs()[mask].max(),
        "kl_k1": ((rollout - train) * m).sum() / m.sum(),  # verl kl
        "kl_k3": ((w - (train - rollout) - 1) * m).sum() / m.sum(),  # verl k3_kl
        "chi2_token": ((w**2) * m).sum() / m.sum() - 1,
    }
    coll = MismatchDiagnostics(prefix="", c=2.0)
    coll.update(train, rollout, mask)
    got = {k: float(v) for k, v in coll.compute().items()}
    for name, want in verl.items():  # delta is float32 (ops.log_ratio): agreement to float32 precision
        assert got[name] == pytest.approx(float(want), rel=2e-6, abs=1e-9), name


def test_empty_values_are_finite_and_documented():
    train, rollout, _ = example()
    empty = torch.zeros(3, 3, dtype=torch.bool)
    ones = {"SequencePerplexity": 1.0, "exp_mean": 1.0, "ess": 1.0, "mean": 1.0, "max": 1.0, "min": 1.0}
    for metric, want in [
        (SequencePerplexity("train"), ones["SequencePerplexity"]),
        (SequencePerplexity("rollout", log=True), 0.0),
        (LogPerplexityDiff("exp_mean"), 1.0),
        (LogPerplexityDiff("max"), 0.0),
        (ClippedRatioMoment("ess"), 1.0),
        (ClippedRatioMoment("std"), 0.0),
        (SequenceRatioStatistic("mean"), 1.0),
        (SequenceRatioStatistic("std"), 0.0),
        (SequenceRatioStatistic("max_deviation"), 0.0),
        (AbsLogRatio("max"), 0.0),
        (PSISKHat(), 0.0),
    ]:
        assert value(metric, train, rollout, empty) == want, metric


# ---------------------------------------------------------------- PSIS k-hat


def pareto_batch(k: float, b: int, t: int, seed: int):
    """Log-probs whose token ratios are Pareto(1/k) draws (tail shape k), with a ragged mask."""
    g = torch.Generator().manual_seed(seed)
    log_w = -torch.log(torch.rand(b, t, generator=g, dtype=torch.float64)) * k
    rollout = torch.full((b, t), -15.0, dtype=torch.float64)  # room for log pi = log mu + log w <= 0
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[::5, t // 2 :] = False
    return rollout + log_w, rollout, mask


@pytest.mark.parametrize("k_true", [0.4, 0.9])
def test_khat_of_a_known_pareto_tail(k_true):
    # ~54000 tokens, M = 697 tail draws: the fit's standard error is ~0.055 (30 seeds at k = 0.4).
    train, rollout, mask = pareto_batch(k_true, 200, 300, seed=3)
    metric = PSISKHat()
    metric.update(train, rollout, mask)
    assert float(metric.compute()) == pytest.approx(k_true, abs=0.1)
    direct, _ = pareto_khat(ops.log_ratio(train, rollout, mask)[mask].double(), int(mask.sum()))
    assert float(metric.compute()) == pytest.approx(float(direct), rel=1e-12)


def test_khat_updates_and_merges_are_exact():
    train, rollout, mask = pareto_batch(0.7, 60, 50, seed=2)
    whole = PSISKHat(max_tail=64)
    whole.update(train, rollout, mask)
    pieces, a, b = PSISKHat(max_tail=64), PSISKHat(max_tail=64), PSISKHat(max_tail=64)
    for rows in (slice(0, 7), slice(7, 40), slice(40, 60)):
        pieces.update(train[rows], rollout[rows], mask[rows])
    a.update(train[:25], rollout[:25], mask[:25])
    b.update(train[25:], rollout[25:], mask[25:])
    # torchmetrics' merge_state applies merge_top to the stacked states (as a DDP sync does to the
    # gathered ones) and sums the counts
    merged = copy.deepcopy(a)
    merged.merge_state(b)
    stacked = merge_top(torch.stack([b.top, a.top]))
    assert torch.equal(merged.top, stacked) and int(merged.count) == int(mask.sum())
    want = float(whole.compute())
    assert want > 0.3  # a real fit, capped at M = 64 of S ~ 2700 draws
    assert float(pieces.compute()) == want and float(merged.compute()) == want
    assert float(a.compute()) != pytest.approx(want)  # one shard alone differs


def test_khat_sequence_level_uses_the_log_ratio_sums():
    train, rollout, mask = pareto_batch(0.5, 400, 3, seed=3)
    metric = PSISKHat("sequence")
    metric.update(train, rollout, mask)
    sums = (ops.log_ratio(train, rollout, mask).double() * mask).sum(-1)[mask.any(-1)]
    direct, _ = pareto_khat(sums, sums.numel())
    assert float(metric.compute()) == pytest.approx(float(direct), rel=1e-12)


def test_khat_on_policy_and_short_batches_is_zero():
    _, rollout, mask = pareto_batch(0.5, 30, 30, seed=4)
    assert value(PSISKHat(), rollout.clone(), rollout, mask) == 0.0  # constant weights: no tail
    train, rollout, mask = pareto_batch(0.5, 2, 10, seed=4)  # S <= 20: M < 5
    assert value(PSISKHat(), train, rollout, mask) == 0.0


def test_collection_has_the_new_stable_names():
    names = set(MismatchDiagnostics(prefix="").keys())
    new = {
        "train_ppl", "train_log_ppl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff", "log_ppl_abs_diff",
        "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio_seq", "ratio_std", "ess_clipped",
        "seq_ratio_mean", "seq_ratio_std", "seq_ratio_max", "seq_ratio_min", "seq_ratio_max_deviation",
        "seq_ratio_frac_above", "seq_ratio_frac_below", "abs_log_ratio_mean", "abs_log_ratio_max",
        "psis_khat", "psis_khat_seq",
    }  # fmt: skip
    alignment = {  # NeMo-RL, verl debug metrics, prime-rl (tests/diagnostics/test_alignment_metrics.py)
        "token_mult_prob_error", "seq_mult_prob_error_max", "seq_mult_prob_error_mean", "seq_mult_prob_error_min",
        "kl_reverse", "policy_kl_error", "js", "js_divergence_error", "probs_diff_mean", "probs_diff_max",
        "probs_diff_std", "probs_pearson", "kl_k3_std", "kl_k3_max",
    }  # fmt: skip
    assert new | alignment <= names and len(names) == 12 + len(new) + len(alignment)


@pytest.mark.parametrize(
    ("factory", "name"),
    [
        (lambda: SequencePerplexity("sampler"), "policy"),
        (lambda: LogPerplexityDiff("median"), "stat"),
        (lambda: ClippedRatioMoment("var"), "stat"),
        (lambda: ClippedRatioMoment("std", c=0.5), "c"),
        (lambda: SequenceRatioStatistic("p90"), "stat"),
        (lambda: AbsLogRatio("min"), "stat"),
        (lambda: PSISKHat("geometric"), "level"),
        (lambda: PSISKHat(max_tail=2), "max_tail"),
    ],
)
def test_bad_arguments_name_themselves(factory, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        factory()
