"""Pareto-smoothed IS: the GPD fit, k-hat on weights drawn from a known Pareto tail, and the PSIS corrector."""

from __future__ import annotations

import math

import pytest
import torch

from ais_lightning.correctors import PSIS, gpd_fit, pareto_khat
from ais_lightning.correctors.psis import gpd_quantile, psis_tail_length, smooth_log_weights
from ais_lightning.diagnostics import PSISKHat


def zhang_stephens_reference(x: list[float]) -> tuple[float, float]:
    """Zhang & Stephens (2009) with the PSIS prior, written out with plain floats and loops.

    theta_j = 1/x_n + (1 - sqrt(m / (j - 1/2))) / (3 x_q), j = 1..m, m = 30 + floor(sqrt(n));
    k(theta) = mean_i log(1 - theta x_i); l(theta) = n (log(-theta / k) - k - 1);
    w_j = 1 / sum_l exp(l_l - l_j); theta_hat = sum_j w_j theta_j (after dropping w_j < 10 eps);
    k_hat = mean log(1 - theta_hat x), sigma = -k_hat / theta_hat, k_hat <- (n k_hat + 5) / (n + 10).
    """
    n = len(x)
    m = 30 + int(math.sqrt(n))
    xq = x[int(n / 4 + 0.5) - 1]
    thetas = [1 / x[-1] + (1 - math.sqrt(m / (j - 0.5))) / (3 * xq) for j in range(1, m + 1)]
    ks = [sum(math.log(1 - t * xi) for xi in x) / n for t in thetas]
    ls = [n * (math.log(-t / k) - k - 1) for t, k in zip(thetas, ks)]
    ws = [1 / sum(math.exp(lo - lj) for lo in ls) for lj in ls]
    ws = [w if w >= 10 * 2.220446049250313e-16 else 0.0 for w in ws]
    theta = sum(w * t for w, t in zip(ws, thetas)) / sum(ws)
    k = sum(math.log(1 - theta * xi) for xi in x) / n
    sigma = -k / theta
    return (n * k + 10 * 0.5) / (n + 10), sigma


def pareto_log_weights(alpha: float, size: int, seed: int) -> torch.Tensor:
    """log w for w ~ Pareto(alpha, x_m = 1): survival w^-alpha, GPD tail shape k = 1/alpha."""
    u = torch.rand(size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return -torch.log(u) / alpha


def test_tail_length():
    # M = ceil(min(0.2 S, 3 sqrt(S))): 100 -> min(20, 30) = 20; 10^4 -> min(2000, 300) = 300; 7 -> 2.
    assert [psis_tail_length(s) for s in (0, 7, 100, 10_000)] == [0, 2, 20, 300]


def test_gpd_fit_matches_the_written_out_algorithm():
    # 40 GPD(k = 0.6, sigma = 1.5) draws by inversion, sorted.
    u = torch.rand(40, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x = torch.sort(1.5 / 0.6 * ((1 - u) ** -0.6 - 1)).values
    k, sigma = gpd_fit(x)
    k_ref, sigma_ref = zhang_stephens_reference(x.tolist())
    assert float(k) == pytest.approx(k_ref, rel=1e-10)
    assert float(sigma) == pytest.approx(sigma_ref, rel=1e-10)


def test_gpd_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="exceedances"):
        gpd_fit(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))  # fewer than 5
    with pytest.raises(ValueError, match="exceedances"):
        gpd_fit(torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0], dtype=torch.float64))  # not ascending


def test_gpd_quantile_by_hand():
    # k = 0.5, sigma = 2, p = 0.75: sigma/k ((1-p)^-k - 1) = 4 (0.25^-0.5 - 1) = 4; k = 0: -2 ln 0.25.
    p = torch.tensor([0.75], dtype=torch.float64)
    assert float(gpd_quantile(p, torch.tensor(0.5), torch.tensor(2.0))) == pytest.approx(4.0)
    assert float(gpd_quantile(p, torch.tensor(0.0), torch.tensor(2.0))) == pytest.approx(-2 * math.log(0.25))


@pytest.mark.parametrize("k_true", [0.3, 0.5, 0.8, 1.2])
def test_khat_recovers_a_known_pareto_tail(k_true):
    # S = 10^5 draws, M = 949 tail draws: the fit's standard error is about (1 + k)/sqrt(M) ~ 0.04-0.07.
    log_w = pareto_log_weights(1.0 / k_true, 100_000, seed=11)
    k_hat, _ = pareto_khat(torch.topk(log_w, 2000).values, 100_000)
    assert float(k_hat) == pytest.approx(k_true, abs=0.1)
    assert (float(k_hat) > 0.7) == (k_true > 0.7)  # the reliability verdict is right


def test_khat_agrees_with_scipy_mle():
    stats = pytest.importorskip("scipy.stats")
    log_w = pareto_log_weights(2.0, 100_000, seed=5)
    k_hat, fit = pareto_khat(torch.topk(log_w, 2000).values, 100_000)
    x = (torch.exp(fit["tail"]) - torch.exp(fit["cutoff"])).numpy()
    k_mle, _, _ = stats.genpareto.fit(x, floc=0.0)
    assert float(k_hat) == pytest.approx(k_mle, abs=0.02)  # Zhang-Stephens ~ MLE for M = 949


def test_khat_is_scale_free_and_needs_a_tail():
    log_w = pareto_log_weights(2.0, 5000, seed=1)
    k1, _ = pareto_khat(log_w, 5000)
    k2, _ = pareto_khat(log_w + 7.0, 5000)  # every weight times e^7
    assert float(k1) == pytest.approx(float(k2), rel=1e-9)
    assert math.isnan(float(pareto_khat(torch.zeros(1000, dtype=torch.float64), 1000)[0]))  # constant
    assert math.isnan(float(pareto_khat(log_w[:20], 20)[0]))  # S = 20: M = 4 < 5


def test_smoothing_keeps_order_caps_at_the_max_and_spares_the_body():
    log_w = pareto_log_weights(1.0 / 0.8, 2000, seed=2)
    k_hat, fit = pareto_khat(log_w, 2000)
    smoothed = smooth_log_weights(log_w, fit)
    in_tail = log_w > fit["cutoff"]
    assert int(in_tail.sum()) == psis_tail_length(2000)  # 134 distinct draws above the cutoff
    assert torch.equal(smoothed[~in_tail], log_w[~in_tail])
    assert float(smoothed.max()) <= float(log_w.max()) + 1e-12
    order = torch.argsort(log_w[in_tail])
    assert bool((torch.diff(smoothed[in_tail][order]) >= 0).all())  # monotone in the raw weight
    assert bool((smoothed[in_tail] > fit["cutoff"]).all())


def test_psis_corrector_smooths_the_batch_tail(make_logprobs):
    # 40 x 50 tokens whose ratios are Pareto(1.25) (k = 0.8) divided by 3 (some below 1).
    log_w = pareto_log_weights(1.25, 2000, seed=4).reshape(40, 50) - math.log(3.0)
    mask = torch.ones(40, 50, dtype=torch.bool)
    mask[::7, 45:] = False  # ragged
    rollout = torch.full((40, 50), -1.0)
    train = rollout + log_w.float()
    out = PSIS()(train, rollout, mask)
    metric = PSISKHat()
    metric.update(train, rollout, mask)
    assert out.stats["psis/khat"] == pytest.approx(float(metric.compute()), rel=1e-9)
    assert out.stats["psis/khat"] > 0.5 and out.stats["psis/fitted"] == 1.0
    n = int(mask.sum())
    assert out.stats["psis/tail_frac"] == pytest.approx(psis_tail_length(n) / n)
    w = torch.exp(train - rollout)
    changed = mask & ~torch.isclose(out.weights, w, rtol=1e-6)
    assert 0 < int(changed.sum()) <= psis_tail_length(n)
    assert float(out.weights.max()) <= float(w[mask].max()) * (1 + 1e-6)
    assert torch.equal(out.mask, mask)


def test_psis_corrector_without_a_tail_keeps_the_raw_ratios(example):
    out = PSIS()(*example)  # 8 tokens: M = 2 < 5, no fit
    train, rollout, mask = example
    torch.testing.assert_close(out.weights, torch.where(mask, torch.exp(train - rollout), 0.0))
    assert out.stats["psis/fitted"] == 0.0 and out.stats["psis/khat"] == 0.0


def test_psis_sequence_level(make_logprobs):
    # 60 responses, one draw each (the product of 3 token ratios).
    log_w = pareto_log_weights(1.25, 180, seed=9).reshape(60, 3).float()
    rollout = torch.full((60, 3), -1.0)
    out = PSIS(level="sequence")(rollout + log_w, rollout, torch.ones(60, 3, dtype=torch.bool))
    assert out.stats["psis/fitted"] == 1.0
    assert out.stats["psis/tail_frac"] == pytest.approx(psis_tail_length(60) / 60)
    assert bool((out.weights == out.weights[:, :1]).all())  # one weight per response


@pytest.mark.parametrize(("kwargs", "name"), [(dict(level="tok"), "level"), (dict(max_tail=3), "max_tail")])
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        PSIS(**kwargs)
