"""NeMo-RL, verl and prime-rl alignment metrics: hand-derived values, the peers' own formulas, edge cases.

Worked example: the probabilities of the sampled token under pi_old and mu (log-probs are their logs);
the third token of response 0 is padding (its probabilities must not count).

    response 0 (task "a"):  pi 0.5  0.2  [0.7]       mu 0.25  0.4  [0.01]     w = pi/mu: 2, 0.5
    response 1 (task "b"):  pi 0.9  0.2  0.3         mu 0.9   0.05 0.6        w: 1, 4, 0.5

Per valid token (delta = ln w):
    exp|delta|                 2        2         1    4            2         (sum 11)
    k3 = w - 1 - ln w          1-ln2    ln2-1/2   0    3-2ln2       ln2-1/2   (sum 3 - ln2)
    1/w - 1 + ln w             ln2-1/2  1-ln2     0    2ln2-3/4     1-ln2     (sum 3/4 + ln2)
    1 - w + w ln w             2ln2-1   (1-ln2)/2 0    8ln2-3       (1-ln2)/2 (sum 9ln2 - 3)
    ln cosh(ln(w)/2)           ln(3/2)-ln2/2 (both w = 2 and w = 1/2), 0, ln(5/4)
    |pi - mu|                  0.25     0.2       0    0.15         0.3       (sum 0.9)
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from ais_lightning.diagnostics import (
    JensenShannon,
    MismatchDiagnostics,
    MismatchKL,
    MismatchKLStatistic,
    ProbabilityCorrelation,
    ProbabilityDiff,
    ReverseKL,
    SequenceMultProbError,
    TokenMultProbError,
    sequence_mult_prob_error,
)
from ais_lightning.diagnostics.alignment import js_terms, reverse_kl_terms

LN2 = math.log(2.0)
T, F = True, False
PI = [[0.5, 0.2, 0.7], [0.9, 0.2, 0.3]]
MU = [[0.25, 0.4, 0.01], [0.9, 0.05, 0.6]]
MASK = [[T, T, F], [T, T, T]]
TASKS = ["a", "b"]


def example():
    """(train_logprobs, rollout_logprobs, mask) of the worked example, float32 like a real batch."""
    pi = torch.tensor(PI, dtype=torch.float64).log().float()
    mu = torch.tensor(MU, dtype=torch.float64).log().float()
    return pi, mu, torch.tensor(MASK)


def value(metric, *args, **kwargs) -> float:
    metric.update(*(args or example()), **kwargs)
    return float(metric.compute())


def test_token_mult_prob_error_by_hand():
    # mean exp|delta| = (2 + 2 + 1 + 4 + 2) / 5 = 2.2 (NeMo-RL: mean of exp(|generation - prev| * mask))
    assert value(TokenMultProbError()) == pytest.approx(2.2, rel=1e-6)


@pytest.mark.parametrize(("stat", "expected"), [("max", 7 / 3), ("mean", 13 / 6), ("min", 2.0)])
def test_sequence_mult_prob_error_by_hand(stat, expected):
    # response 0: (2 + 2) / 2 = 2; response 1: (1 + 4 + 2) / 3 = 7/3; mean 13/6
    assert value(SequenceMultProbError(stat)) == pytest.approx(expected, rel=1e-6)


def test_sequence_mult_prob_error_function_and_an_empty_response():
    pi, mu, mask = example()
    mask = torch.cat([mask, torch.zeros(1, 3, dtype=torch.bool)])  # a third response without tokens
    pi, mu = torch.cat([pi, torch.full((1, 3), float("nan"))]), torch.cat([mu, torch.zeros(1, 3)])
    got = sequence_mult_prob_error(pi, mu, mask)
    assert got.shape == (3,)
    assert got.tolist() == pytest.approx([2.0, 7 / 3, 1.0], rel=1e-6)  # no tokens: 1.0, not NaN


def test_gen_kl_error_is_mismatch_kl_k3():
    # NeMo-RL's gen_kl_error (k3 of log-ratio prev - generation): mean(w - 1 - ln w) = (3 - ln2) / 5
    assert value(MismatchKL("k3")) == pytest.approx((3 - LN2) / 5, rel=1e-6)


def test_reverse_kl_estimators_by_hand():
    assert value(ReverseKL("is_k3")) == pytest.approx((9 * LN2 - 3) / 5, rel=1e-6)  # 0.647665
    assert value(ReverseKL("swapped_k3")) == pytest.approx((0.75 + LN2) / 5, rel=1e-6)  # 0.288629


def test_jensen_shannon_estimators_by_hand():
    # is: 0.5 w ln(2w/(1+w)) + 0.5 ln(2/(1+w)):
    #   w = 2:   ln(4/3) + ln(2/3)/2    = 2.5 ln2 - 1.5 ln3
    #   w = 1/2: ln(2/3)/4 + ln(4/3)/2  = 1.25 ln2 - 0.75 ln3   (twice)
    #   w = 4:   2 ln(8/5) + ln(2/5)/2  = 6.5 ln2 - 2.5 ln5
    #   sum = 11.5 ln2 - 3 ln3 - 2.5 ln5 = 0.651759
    js = (11.5 * LN2 - 3 * math.log(3) - 2.5 * math.log(5)) / 5
    assert value(JensenShannon("is")) == pytest.approx(js, rel=1e-6)
    # log_cosh: 3 (ln(3/2) - ln2/2) + ln(5/4) = 3 ln3 + ln5 - 6.5 ln2 = 0.399818
    nemo = (3 * math.log(3) + math.log(5) - 6.5 * LN2) / 5
    assert value(JensenShannon("log_cosh")) == pytest.approx(nemo, rel=1e-6)


def test_nemo_js_divergence_error_equals_its_mixture_formula():
    """NeMo-RL's code: 0.5 k3(pi : m) + 0.5 k3(mu : m), m = (pi + mu) / 2 of the sampled token. For the
    first token (pi 0.5, mu 0.25, m 0.375): pi/m = 4/3, mu/m = 2/3, so
    0.5 (1/3 - ln(4/3)) + 0.5 (-1/3 - ln(2/3)) = -0.5 ln(8/9) = 0.058892 = ln cosh(ln(2)/2)."""
    term = float(js_terms(torch.tensor([LN2], dtype=torch.float64), "log_cosh"))
    assert term == pytest.approx(
        0.5 * (1 / 3 - math.log(4 / 3)) + 0.5 * (-1 / 3 - math.log(2 / 3)), rel=1e-12
    )
    assert term == pytest.approx(-0.5 * math.log(8 / 9), rel=1e-12)


def test_nemo_docs_extreme_token():
    """NeMo-RL docs/guides/grpo.md: log p_gen = -5, log p_policy = -15 (delta = -10)."""
    pi, mu, mask = torch.tensor([[-15.0]]), torch.tensor([[-5.0]]), torch.ones(1, 1, dtype=torch.bool)
    # gen_kl_error = e^-10 + 10 - 1 = 9.0000454 ("~9")
    assert value(MismatchKL("k3"), pi, mu, mask) == pytest.approx(9 + math.exp(-10), rel=1e-6)
    # policy_kl_error = e^10 - 10 - 1 = 22015.47 ("~22,015")
    assert value(ReverseKL("swapped_k3"), pi, mu, mask) == pytest.approx(math.exp(10) - 11, rel=1e-6)
    # js_divergence_error: the docs say "~9"; the code gives ln cosh(5) = 5 - ln2 + ln(1 + e^-10) = 4.306899
    assert value(JensenShannon("log_cosh"), pi, mu, mask) == pytest.approx(
        5 - LN2 + math.log1p(math.exp(-10))
    )
    # token_mult_prob_error = e^10
    assert value(TokenMultProbError(), pi, mu, mask) == pytest.approx(math.exp(10), rel=1e-6)


def test_is_estimators_are_unbiased_on_an_exact_expectation():
    """Two-token vocabulary, pi = (0.5, 0.5), mu = (0.8, 0.2): 4 tokens of the first and 1 of the second are
    mu's expectation exactly. KL(pi||mu) = 0.5 ln(5/8) + 0.5 ln(5/2) = 0.5 ln(25/16) = 0.223144;
    JS = 0.5 KL(pi||m) + 0.5 KL(mu||m), m = (0.65, 0.35):
       0.5 (0.5 ln(0.5/0.65) + 0.5 ln(0.5/0.35)) + 0.5 (0.8 ln(0.8/0.65) + 0.2 ln(0.2/0.35)) = 0.049021."""
    pi = torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.5]]).log()
    mu = torch.tensor([[0.8, 0.8, 0.8, 0.8, 0.2]]).log()
    mask = torch.ones(1, 5, dtype=torch.bool)
    kl = 0.5 * math.log(25 / 16)
    assert value(ReverseKL("is_k3"), pi, mu, mask) == pytest.approx(kl, rel=1e-6)
    js = 0.5 * (0.5 * math.log(0.5 / 0.65) + 0.5 * math.log(0.5 / 0.35))
    js += 0.5 * (0.8 * math.log(0.8 / 0.65) + 0.2 * math.log(0.2 / 0.35))
    assert value(JensenShannon("is"), pi, mu, mask) == pytest.approx(js, rel=1e-6)
    # NeMo's policy_kl_error on the same tokens: chi2(mu||pi) - KL(mu||pi), not KL(pi||mu):
    # chi2 = 0.8^2/0.5 + 0.2^2/0.5 - 1 = 0.36; KL(mu||pi) = 0.8 ln 1.6 + 0.2 ln 0.4 = 0.192745
    swapped = 0.36 - (0.8 * math.log(1.6) + 0.2 * math.log(0.4))
    assert value(ReverseKL("swapped_k3"), pi, mu, mask) == pytest.approx(swapped, rel=1e-6)


@pytest.mark.parametrize(("stat", "expected"), [("mean", 0.18), ("max", 0.3)])
def test_probability_diff_by_hand(stat, expected):
    assert value(ProbabilityDiff(stat)) == pytest.approx(expected, rel=1e-6)


def test_probability_diff_std_by_hand():
    # deviations from 0.18: 0.07, 0.02, -0.18, -0.03, 0.12; squares sum 0.053; Bessel: sqrt(0.053 / 4)
    assert value(ProbabilityDiff("std")) == pytest.approx(math.sqrt(0.053 / 4), rel=1e-6)  # 0.115109


def test_pearson_correlation_by_hand():
    # pi = .5 .2 .9 .2 .3 (mean .42), mu = .25 .4 .9 .05 .6 (mean .44)
    # deviations: pi .08 -.22 .48 -.22 -.12; mu -.19 -.04 .46 -.39 .16
    # sum of products .281; of squares .348 and .427 -> r = .281 / sqrt(.348 * .427) = 0.728958
    assert value(ProbabilityCorrelation()) == pytest.approx(0.281 / math.sqrt(0.348 * 0.427), rel=1e-6)


def test_mismatch_kl_statistics_by_hand():
    k3 = [1 - LN2, LN2 - 0.5, 0.0, 3 - 2 * LN2, LN2 - 0.5]  # the five tokens' k3, by hand above
    assert value(MismatchKLStatistic("mean")) == pytest.approx((3 - LN2) / 5, rel=1e-6)
    assert value(MismatchKLStatistic("std")) == pytest.approx(statistics.stdev(k3), rel=1e-6)  # 0.653548
    assert value(MismatchKLStatistic("max")) == pytest.approx(3 - 2 * LN2, rel=1e-6)


def test_mismatch_kl_statistics_per_task_by_hand():
    # task a: k3 1 - ln2, ln2 - 1/2 -> mean 1/4, std (1.5 - 2 ln2) / sqrt(2), max 1 - ln2
    # task b: k3 0, 3 - 2 ln2, ln2 - 1/2 -> mean (2.5 - ln2) / 3, max 3 - 2 ln2
    got = {
        (task, stat): value(MismatchKLStatistic(stat, task=task), *example(), tasks=TASKS)
        for task in ("a", "b")
        for stat in ("mean", "std", "max")
    }
    assert got["a", "mean"] == pytest.approx(0.25, rel=1e-6)
    assert got["a", "std"] == pytest.approx((1.5 - 2 * LN2) / math.sqrt(2), rel=1e-5)
    assert got["a", "max"] == pytest.approx(1 - LN2, rel=1e-6)
    assert got["b", "mean"] == pytest.approx((2.5 - LN2) / 3, rel=1e-6)
    assert got["b", "std"] == pytest.approx(statistics.stdev([0.0, 3 - 2 * LN2, LN2 - 0.5]), rel=1e-6)
    assert got["b", "max"] == pytest.approx(3 - 2 * LN2, rel=1e-6)
    assert value(MismatchKLStatistic("mean", task="c"), *example(), tasks=TASKS) == 0.0  # no row of "c"
    with pytest.raises(ValueError, match="tasks"):
        MismatchKLStatistic("mean", task="a").update(*example())


def test_collection_names_values_and_per_task_keys():
    coll = MismatchDiagnostics(tasks=("a", "b"))
    coll.update(*example(), tasks=TASKS)
    out = {k: float(v) for k, v in coll.compute().items()}
    expected = {
        "mismatch/token_mult_prob_error": 2.2,
        "mismatch/seq_mult_prob_error_max": 7 / 3,
        "mismatch/seq_mult_prob_error_mean": 13 / 6,
        "mismatch/seq_mult_prob_error_min": 2.0,
        "mismatch/kl_reverse": (9 * LN2 - 3) / 5,
        "mismatch/policy_kl_error": (0.75 + LN2) / 5,
        "mismatch/js": (11.5 * LN2 - 3 * math.log(3) - 2.5 * math.log(5)) / 5,
        "mismatch/js_divergence_error": (3 * math.log(3) + math.log(5) - 6.5 * LN2) / 5,
        "mismatch/probs_diff_mean": 0.18,
        "mismatch/probs_diff_max": 0.3,
        "mismatch/probs_diff_std": math.sqrt(0.053 / 4),
        "mismatch/probs_pearson": 0.281 / math.sqrt(0.348 * 0.427),
        "mismatch/kl_k3_max": 3 - 2 * LN2,
        "mismatch/by_task/a/kl_k3_mean": 0.25,
        "mismatch/by_task/b/kl_k3_max": 3 - 2 * LN2,
    }
    for name, want in expected.items():
        assert out[name] == pytest.approx(want, rel=1e-5), name
    assert "mismatch/by_task/a/kl_k3_std" in out and "mismatch/by_task/b/kl_k3_mean" in out
    assert not any("by_task" in k for k in MismatchDiagnostics().keys())  # only with tasks
    with pytest.raises(ValueError, match="duplicate"):
        MismatchDiagnostics(tasks=("a", "a"))
    with pytest.raises(ValueError, match="string"):
        MismatchDiagnostics(tasks="ab")


def test_identical_policies_and_empty_values():
    pi, _, mask = example()
    at_rest = {
        TokenMultProbError(): 1.0,
        SequenceMultProbError("max"): 1.0,
        ReverseKL("is_k3"): 0.0,
        ReverseKL("swapped_k3"): 0.0,
        JensenShannon("is"): 0.0,
        JensenShannon("log_cosh"): 0.0,
        ProbabilityDiff("max"): 0.0,
        ProbabilityCorrelation(): 1.0,
        MismatchKLStatistic("std"): 0.0,
    }
    for metric, want in at_rest.items():
        assert value(metric, pi, pi.clone(), mask) == pytest.approx(want, abs=1e-12), metric
    empty = torch.zeros_like(mask)
    documented = {TokenMultProbError: 1.0, SequenceMultProbError: 1.0, ProbabilityCorrelation: 1.0}
    for cls in (TokenMultProbError, SequenceMultProbError, ReverseKL, JensenShannon, ProbabilityDiff):
        assert value(cls(), pi, pi, empty) == documented.get(cls, 0.0), cls
    for cls in (ProbabilityCorrelation, MismatchKLStatistic):
        assert value(cls(), pi, pi, empty) == documented.get(cls, 0.0), cls


def test_correlation_is_defined_only_with_spread():
    one = torch.ones(1, 1, dtype=torch.bool)
    assert value(ProbabilityCorrelation(), torch.tensor([[-1.0]]), torch.tensor([[-2.0]]), one) == 1.0
    constant = torch.full((1, 3), -1.0)
    varied = torch.tensor([[-1.0, -2.0, -3.0]])
    assert value(ProbabilityCorrelation(), constant, varied, torch.ones(1, 3, dtype=torch.bool)) == 1.0
    # perfectly anti-correlated probabilities: pi = .5 .3 .1, mu = .1 .3 .5 -> r = -1
    anti = value(
        ProbabilityCorrelation(),
        torch.tensor([[0.5, 0.3, 0.1]]).log(),
        torch.tensor([[0.1, 0.3, 0.5]]).log(),
        torch.ones(1, 3, dtype=torch.bool),
    )
    assert anti == pytest.approx(-1.0, abs=1e-9)


def test_terms_are_nonnegative_and_second_order_near_zero():
    delta = torch.linspace(-20, 20, 4001, dtype=torch.float64)
    for terms in (
        reverse_kl_terms(delta, "is_k3"),
        reverse_kl_terms(delta, "swapped_k3"),
        js_terms(delta, "is"),
        js_terms(delta, "log_cosh"),
    ):
        assert bool(torch.isfinite(terms).all()) and bool((terms >= 0).all())
    small = torch.tensor([1e-3], dtype=torch.float64)
    # near 0: the reverse KL terms are delta^2 / 2, the JS terms delta^2 / 8 (to third order)
    assert float(reverse_kl_terms(small, "is_k3")) == pytest.approx(0.5e-6, rel=1e-2)
    assert float(reverse_kl_terms(small, "swapped_k3")) == pytest.approx(0.5e-6, rel=1e-2)
    assert float(js_terms(small, "is")) == pytest.approx(1e-6 / 8, rel=1e-2)
    assert float(js_terms(small, "log_cosh")) == pytest.approx(1e-6 / 8, rel=1e-2)


def test_masked_padding_may_hold_garbage_and_a_precomputed_log_ratio_is_accepted():
    pi, mu, mask = example()
    pi[0, 2], mu[0, 2] = float("nan"), float("-inf")
    from ais_lightning import ops

    delta = ops.log_ratio(pi, mu, mask)
    for make in (lambda: ProbabilityDiff("std"), ProbabilityCorrelation, TokenMultProbError):
        a, b = make(), make()
        a.update(pi, mu, mask)
        b.update(pi, mu, mask, log_ratio=delta)
        assert math.isfinite(float(a.compute())) and float(a.compute()) == float(b.compute())


@pytest.mark.parametrize(
    ("factory", "kwargs", "named"),
    [
        (SequenceMultProbError, {"stat": "median"}, "stat"),
        (ReverseKL, {"estimator": "k1"}, "estimator"),
        (JensenShannon, {"estimator": "k3"}, "estimator"),
        (ProbabilityDiff, {"stat": "min"}, "stat"),
        (MismatchKLStatistic, {"stat": "median"}, "stat"),
        (MismatchKLStatistic, {"task": "a.b"}, "task"),
        (MismatchKLStatistic, {"task": ""}, "task"),
    ],
)
def test_bad_constructor_arguments(factory, kwargs, named):
    with pytest.raises(ValueError, match=named):
        factory(**kwargs)


def test_bad_inputs_name_the_tensor():
    pi, mu, mask = example()
    for metric in (TokenMultProbError(), ProbabilityDiff(), ProbabilityCorrelation()):
        with pytest.raises(ValueError, match="rollout_logprobs"):
            metric.update(pi, mu[:, :2], mask)
    bad = pi.clone()
    bad[1, 0] = float("nan")
    with pytest.raises(ValueError, match="train_logprobs"):
        ProbabilityDiff().update(bad, mu, mask)
