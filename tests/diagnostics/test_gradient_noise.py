"""gradient_noise_scale: hand-derived values and the known noise scale of a synthetic gradient."""

from __future__ import annotations

import pytest
import torch

from ais_lightning.diagnostics.gradient_noise import (
    GradientNoise,
    averaged_noise_factor,
    gradient_noise_scale,
)


def test_hand_derived_values():
    # mean [2, 0]; deviations [-1,0] [1,0] [0,2] [0,-2]: 10 / (4 - 1) = 10/3; |G|² = 4 - (10/3)/4 = 19/6
    grads = torch.tensor([[1.0, 0.0], [3.0, 0.0], [2.0, 2.0], [2.0, -2.0]])
    noise = gradient_noise_scale(grads)
    assert noise.units == 4
    assert noise.trace == pytest.approx(10 / 3)
    assert noise.signal_sq == pytest.approx(19 / 6)
    assert noise.noise_scale == pytest.approx(20 / 19)
    assert noise.noise_to_signal(4) == pytest.approx(5 / 19)


def test_recovers_the_noise_scale_of_a_known_distribution():
    """Units ~ N(G, σ² I) in P dimensions: B_noise = P σ² / |G|² = 64 * 0.25 / 4 = 4."""
    gen = torch.Generator().manual_seed(0)
    true = torch.zeros(64)
    true[:4] = 1.0  # |G|² = 4
    grads = true + 0.5 * torch.randn(4000, 64, generator=gen)
    noise = gradient_noise_scale(grads)
    assert noise.trace == pytest.approx(16.0, rel=0.02)
    assert noise.signal_sq == pytest.approx(4.0, rel=0.03)
    assert noise.noise_scale == pytest.approx(4.0, rel=0.04)


def test_a_signal_lost_in_noise_reads_as_an_infinite_scale():
    assert GradientNoise(trace=1.0, signal_sq=-0.1, units=8).noise_scale == float("inf")


@pytest.mark.parametrize(
    "grads, match",
    [
        (torch.ones(1, 3), r"U >= 2"),
        (torch.ones(3), r"\[U, P\]"),
        (torch.tensor([[1.0, float("nan")], [0.0, 0.0]]), "non-finite"),
    ],
)
def test_bad_input_is_refused(grads, match):
    with pytest.raises(ValueError, match=match):
        gradient_noise_scale(grads)


def test_batch_units_must_be_positive():
    with pytest.raises(ValueError, match="batch_units"):
        GradientNoise(trace=1.0, signal_sq=1.0, units=2).noise_to_signal(0)


def test_averaged_noise_factor_hand_values():
    # (1 - b) / (1 + b): no averaging at b = 0; b = 1/2 gives (1/2) / (3/2); Adam's b = 0.9 gives 1/19
    assert averaged_noise_factor(0.0) == 1.0
    assert averaged_noise_factor(0.5) == pytest.approx(1 / 3)
    assert averaged_noise_factor(0.9) == pytest.approx(1 / 19)


def test_averaged_noise_factor_matches_a_simulated_exponential_average():
    # independent unit-variance noise plus a persistent bias of 0.3, averaged like Adam's first moment
    gen = torch.Generator().manual_seed(0)
    beta1, bias, chains, steps = 0.9, 0.3, 20000, 200  # 0.9**200 ~ 7e-10: stationary at the end
    m = torch.zeros(chains, dtype=torch.float64)
    for _ in range(steps):
        m = beta1 * m + (1 - beta1) * (bias + torch.randn(chains, generator=gen, dtype=torch.float64))
    # variance shrinks by the factor (s.e. of a sample variance: var * sqrt(2 / chains), ~1.4%), the bias stays
    assert float(m.var()) == pytest.approx(averaged_noise_factor(beta1), rel=0.05)
    assert float(m.mean()) == pytest.approx(bias, abs=4 * (averaged_noise_factor(beta1) / chains) ** 0.5)


@pytest.mark.parametrize("beta1", [-0.1, 1.0, 1.5])
def test_averaged_noise_factor_refuses_beta1_outside_0_1(beta1):
    with pytest.raises(ValueError, match="beta1"):
        averaged_noise_factor(beta1)
