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


def test_averaged_noise_factor_closed_forms_with_several_steps_per_batch():
    # m mini-batches, one epoch: every step sees a fresh 1/m of the data, variance m per step, so m (1-b)/(1+b)
    assert averaged_noise_factor(0.9, 1, 4) == pytest.approx(4 / 19, rel=1e-12)
    assert averaged_noise_factor(0.5, 1, 2) == pytest.approx(2 / 3, rel=1e-12)
    # no momentum: m_k is the step's own gradient, a mini-batch of 1/m of the batch (any number of epochs)
    assert averaged_noise_factor(0.0, 3, 2) == pytest.approx(2.0, rel=1e-12)
    assert averaged_noise_factor(0.0, 2, 1) == pytest.approx(1.0, rel=1e-12)
    # two epochs of one step, b = 1/2: the batch's noise enters two consecutive steps. Read at its first
    # step m = (1/2)(x_0 + (1/2 + 1/4) x_1 + ...), at its second (1/2)((1 + 1/2) x_0 + (1/4 + 1/8) x_1 + ...);
    # every older batch's coefficient is b^2 times the next one's, so the sums of squares are 1/4 (1 + 9/16 * 1/(1 - 1/16))
    # = 1/4 * 8/5 and 1/4 (9/4 + 9/64 * 16/15) = 1/4 * 12/5, whose mean is 1/2
    assert averaged_noise_factor(0.5, 2, 1) == pytest.approx(0.5, rel=1e-12)


@pytest.mark.parametrize(("beta1", "epochs", "minis"), [(0.9, 2, 1), (0.9, 3, 2), (0.5, 2, 4), (0.9, 1, 4)])
def test_averaged_noise_factor_matches_a_simulated_ppo_schedule(beta1, epochs, minis):
    # the trainer's schedule (update_policy): per rollout batch, `epochs` passes, each a fresh shuffle of the
    # rows into `minis` mini-batches, one Adam step per mini-batch on the mini-batch's mean
    gen = torch.Generator().manual_seed(1)
    chains, rows = 20000, 8
    per = rows // minis
    m = torch.zeros(chains, dtype=torch.float64)
    batches = 1 + int(25 / ((1 - beta1) * epochs * minis))  # beta1^(2 steps) ~ e^-50: stationary
    reads = []
    for batch in range(batches):
        noise = torch.randn(chains, rows, generator=gen, dtype=torch.float64) * rows**0.5  # batch mean: var 1
        for _ in range(epochs):
            shuffled = (
                noise
                if minis == 1
                else noise.gather(1, torch.rand(chains, rows, generator=gen).argsort(dim=1))
            )
            for mb in range(minis):
                m = beta1 * m + (1 - beta1) * shuffled[:, mb * per : (mb + 1) * per].mean(dim=1)
                if batch == batches - 1:
                    reads.append(float(m.var()))
    simulated = sum(reads) / len(reads)  # the mean over the steps of one batch, as lambda serves them all
    assert simulated == pytest.approx(averaged_noise_factor(beta1, epochs, minis), rel=0.05)


@pytest.mark.parametrize(("epochs", "minis"), [(0, 1), (1, 0), (1.5, 1), (True, 1)])
def test_averaged_noise_factor_refuses_bad_step_counts(epochs, minis):
    with pytest.raises(ValueError, match="ppo_epochs|mini_batches"):
        averaged_noise_factor(0.9, epochs, minis)


@pytest.mark.parametrize("beta1", [-0.1, 1.0, 1.5])
def test_averaged_noise_factor_refuses_beta1_outside_0_1(beta1):
    with pytest.raises(ValueError, match="beta1"):
        averaged_noise_factor(beta1)
