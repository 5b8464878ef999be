"""AIS under staleness: the staleness part of the log-ratio is a drift the trainer's own updates made, whose bias is
first order in it (docs/async.md), while the rollout's rounding noise biases only to second order (docs/ais.md
section 3). Checked on exact softmax policies, then on the coefficient by hand."""

from __future__ import annotations

import pytest
import torch

from ais_lightning.correctors import AIS
from ais_lightning.correctors.ais import (
    ais_base_weights,
    ais_coefficient,
    ais_params,
    ais_sufficient_statistics,
)


def _contexts(n: int = 200, k: int = 12, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(n, k, generator=gen, dtype=torch.float64)  # [N, K] the behaviour's logits z_v
    rewards = torch.randn(n, k, generator=gen, dtype=torch.float64)  # [N, K] A(a) per context
    return logits, rewards


def _relative_bias(z_behaviour, z_trained, rewards):
    """|E_{a ~ pi_v}[A grad_z log pi(a)] - E_{a ~ pi}[A grad_z log pi(a)]| / |the latter|, per context (exact)."""
    pv, p = z_behaviour.softmax(-1), z_trained.softmax(-1)  # [N, K]
    score = torch.eye(p.shape[-1], dtype=p.dtype)[None] - p[:, None, :]  # [N, K(a), K] grad_z log pi(a)
    sampled = torch.einsum("na,na,nak->nk", pv, rewards, score)  # [N, K]
    target = torch.einsum("na,na,nak->nk", p, rewards, score)
    return (sampled - target).norm(dim=-1) / target.norm(dim=-1)  # [N]


def _severity(z_behaviour, z_trained):
    """2 KL(pi_v || pi) / G(pi) per context: beta of docs/ais.md (the logit-noise variance)."""
    pv, p = z_behaviour.softmax(-1), z_trained.softmax(-1)
    kl = (pv * (pv.log() - p.log())).sum(-1)
    return 2.0 * kl / (1.0 - (p * p).sum(-1))  # [N]


def test_a_drift_along_the_gradient_biases_to_first_order_and_noise_to_second():
    z, rewards = _contexts()
    pv = z.softmax(-1)
    step = pv * (rewards - (pv * rewards).sum(-1, keepdim=True))  # [N, K] the policy-gradient step in logits
    drift = [_relative_bias(z, z + eps * step, rewards).median() for eps in (0.05, 0.1)]
    assert float(drift[1] / drift[0]) == pytest.approx(2.0, rel=0.1)  # linear in the drift
    beta_sq = _severity(z, z + 0.1 * step)  # 2 KL / G: second order in the drift
    assert float(drift[1] / beta_sq.sqrt().median()) == pytest.approx(
        1.0, abs=0.7
    )  # ~ sqrt(2 KL / G), not 2 KL / G
    assert float(drift[1] / beta_sq.median()) > 5.0
    assert _noise_bias(z, rewards, 0.2) / _noise_bias(z, rewards, 0.1) == pytest.approx(4.0, rel=0.15)


def _noise_bias(z: torch.Tensor, rewards: torch.Tensor, sigma: float, pairs: int = 200) -> float:
    """The relative bias of the *expected* uncorrected gradient when the rollout's logits are the trainer's plus
    i.i.d. noise of scale ``sigma`` (docs/ais.md A3), averaged over antithetic draws (+eta, -eta: the first-order
    part, which averages out over batches, cancels exactly); median over contexts."""
    gen = torch.Generator().manual_seed(1)
    pi = z.softmax(-1)  # [N, K] the trainer's policy
    score = torch.eye(z.shape[-1], dtype=z.dtype)[None] - pi[:, None, :]  # [N, K(a), K]
    target = torch.einsum("na,na,nak->nk", pi, rewards, score)
    acc = torch.zeros_like(z)
    for _ in range(pairs):
        eta = sigma * torch.randn(z.shape, generator=gen, dtype=z.dtype)
        for mu in ((z + eta).softmax(-1), (z - eta).softmax(-1)):
            acc += torch.einsum("na,na,nak->nk", mu, rewards, score) - target
    return float(((acc / (2 * pairs)).norm(dim=-1) / target.norm(dim=-1)).median())


def _stats(precision: torch.Tensor, stale: torch.Tensor | None, impurity: float = 0.4):
    mask = torch.ones(precision.shape, dtype=torch.bool)
    delta = precision + (stale if stale is not None else 0.0)
    params = ais_params()
    base, _ = ais_base_weights(delta, mask, params)
    adv = torch.linspace(-1, 1, precision.shape[0])
    spread = torch.full(precision.shape, impurity)
    return ais_sufficient_statistics(delta, mask, base, adv, None, spread, stale), params


def test_without_staleness_lambda_is_unchanged_bit_for_bit():
    gen = torch.Generator().manual_seed(3)
    precision = 0.05 * torch.randn(16, 8, generator=gen)
    none, params = _stats(precision, None)
    zeros, _ = _stats(precision, torch.zeros_like(precision))
    assert torch.equal(ais_coefficient(none, params)["lambda"], ais_coefficient(zeros, params)["lambda"])
    assert float(ais_coefficient(zeros, params)["kl_k3_staleness"]) == 0.0


def test_the_staleness_part_is_a_first_order_severity_by_hand():
    gen = torch.Generator().manual_seed(4)
    precision = 0.02 * torch.randn(32, 8, generator=gen)
    stale = 0.1 * torch.randn(32, 8, generator=gen)
    stats, params = _stats(precision, stale)
    coef = ais_coefficient(stats, params)
    k3 = lambda x: torch.expm1(x.double()) - x.double()  # noqa: E731
    d_p, d_s, g = float(k3(precision).mean()), float(k3(stale).mean()), 0.4
    assert float(coef["kl_k3"]) == pytest.approx(d_p, rel=1e-6)
    assert float(coef["kl_k3_staleness"]) == pytest.approx(d_s, rel=1e-6)
    assert float(coef["severity_staleness"]) == pytest.approx((2 * d_s / g) ** 0.5, rel=1e-6)
    r_p, r_s = float(coef["reliability"]), 1.0  # R_s: many responses, one sign: close to 1
    expected_bias_sq = r_p * (2 * d_p / g) ** 2 + r_s * 2 * d_s / g
    assert float(coef["bias_sq"]) == pytest.approx(expected_bias_sq, rel=0.02)
    # the same log-ratio read as all precision gives a far smaller lambda
    blind, _ = _stats(precision + stale, None)
    assert float(coef["lambda"]) > 0.9 > float(ais_coefficient(blind, params)["lambda"])


def test_the_corrector_reads_the_staleness_part():
    gen = torch.Generator().manual_seed(5)
    mu = -torch.rand(16, 6, generator=gen)
    stale = 0.1 * torch.randn(16, 6, generator=gen)
    prox = mu + 0.02 * torch.randn(16, 6, generator=gen) + stale
    mask = torch.ones(16, 6, dtype=torch.bool)
    kwargs = dict(advantages=torch.randn(16, generator=gen), impurity=torch.full((16, 6), 0.4))
    aware = AIS()(prox, mu, mask, **kwargs)
    delta = (prox - mu).clamp(-20, 20)
    staled = AIS().from_log_ratio(delta, mask, stale_log_ratio=stale, **kwargs)
    assert staled.stats["ais/lambda"] > aware.stats["ais/lambda"]
    assert staled.stats["ais/kl_k3_staleness"] > 0 and aware.stats["ais/kl_k3_staleness"] == 0
