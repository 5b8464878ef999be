"""Tests for ais_lightning.losses.group_advantages: hand-computed values for every scale."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ais_lightning.losses import group_advantages


def test_group_scale_hand_values_population_std():
    # group [1, 0, 0, 1]: mean 0.5, population std 0.5 -> [1, -1, -1, 1]
    # group [0, 1, 2]-like check below; constant group [2, 2, 2, 2] -> zeros
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, group_size=4, scale="group", eps=0.0)
    assert torch.equal(adv, torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0, 0.0, 0.0, 0.0]))


def test_group_scale_uses_population_not_bessel_std():
    # [0, 1, 2]: mean 1, population var 2/3 -> adv = [-1, 0, 1] / sqrt(2/3) = [-sqrt(1.5), 0, sqrt(1.5)]
    # (Bessel's std would be 1 and give [-1, 0, 1]).
    adv = group_advantages(torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64), group_size=3, eps=0.0)
    s = math.sqrt(1.5)
    torch.testing.assert_close(adv, torch.tensor([-s, 0.0, s], dtype=torch.float64))


def test_group_scale_eps_is_added_to_std():
    # [0, 1]: mean 0.5, std 0.5 -> +-0.5 / (0.5 + 0.25) = +-2/3
    adv = group_advantages(torch.tensor([0.0, 1.0]), group_size=2, eps=0.25)
    torch.testing.assert_close(adv, torch.tensor([-2.0 / 3.0, 2.0 / 3.0]))


def test_batch_scale_hand_values():
    # groups [0, 1] and [3, 3]: centered [-0.5, 0.5, 0, 0];
    # batch population std of [0, 1, 3, 3]: mean 1.75, var (3.0625 + 0.5625 + 1.5625 * 2) / 4 = 1.6875
    rewards = torch.tensor([0.0, 1.0, 3.0, 3.0], dtype=torch.float64)
    adv = group_advantages(rewards, group_size=2, scale="batch", eps=0.0)
    a = 0.5 / math.sqrt(1.6875)
    torch.testing.assert_close(adv, torch.tensor([-a, a, 0.0, 0.0], dtype=torch.float64))


def test_none_scale_is_dr_grpo_centering_only():
    adv = group_advantages(torch.tensor([0.0, 1.0, 3.0, 5.0]), group_size=2, scale="none")
    assert torch.equal(adv, torch.tensor([-0.5, 0.5, -1.0, 1.0]))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_identical_rewards_give_exact_zero(scale, eps):
    # In float32 the mean of 8 copies of 0.1 (or 0.9) does not round back to it: naive r - mean != 0.
    rewards = torch.tensor([0.1] * 8 + [0.9] * 8)
    grouped = rewards.view(2, 8)
    assert bool(((grouped - grouped.mean(dim=1, keepdim=True)) != 0).any())  # the trap is real
    adv = group_advantages(rewards, group_size=8, scale=scale, eps=eps)
    assert torch.equal(adv, torch.zeros(16))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_size_one_gives_zero(scale):
    adv = group_advantages(torch.tensor([0.3, -1.0, 5.0]), group_size=1, scale=scale, eps=0.0)
    assert torch.equal(adv, torch.zeros(3))


def test_constant_group_beside_a_varying_one_with_batch_scale():
    adv = group_advantages(torch.tensor([0.2, 0.2, 0.0, 4.0]), group_size=2, scale="batch", eps=0.0)
    assert adv[0].item() == 0.0 and adv[1].item() == 0.0
    assert adv[2] < 0 < adv[3]


def test_output_is_detached():
    rewards = torch.tensor([0.0, 1.0], requires_grad=True)
    assert not group_advantages(rewards, group_size=2).requires_grad


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(min_value=-5, max_value=5), min_size=8, max_size=8))
def test_group_scale_has_zero_mean_and_unit_population_std(values):
    rewards = torch.tensor(values, dtype=torch.float64)
    adv = group_advantages(rewards, group_size=4, eps=0.0).view(2, 4)
    for g, row in zip(rewards.view(2, 4), adv):
        assert abs(row.mean().item()) < 1e-12
        expected_std = 0.0 if bool((g == g[0]).all()) else 1.0
        assert abs(row.std(unbiased=False).item() - expected_std) < 1e-12


@pytest.mark.parametrize(
    ("rewards", "group_size", "scale", "eps", "match"),
    [
        (torch.zeros(6), 4, "group", 1e-6, "group_size"),
        (torch.zeros(6), 0, "group", 1e-6, "group_size"),
        (torch.zeros(6), True, "group", 1e-6, "group_size"),
        (torch.zeros(6), 2.0, "group", 1e-6, "group_size"),
        (torch.zeros(2, 3), 3, "group", 1e-6, "rewards"),
        (torch.zeros(6, dtype=torch.long), 3, "group", 1e-6, "rewards"),
        (torch.tensor([0.0, float("nan")]), 2, "group", 1e-6, "rewards"),
        (torch.zeros(0), 1, "group", 1e-6, "rewards"),
        ([0.0, 1.0], 2, "group", 1e-6, "rewards"),
        (torch.zeros(6), 3, "std", 1e-6, "scale"),
        (torch.zeros(6), 3, "group", -1.0, "eps"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(rewards, group_size, scale, eps, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, group_size, scale=scale, eps=eps)
