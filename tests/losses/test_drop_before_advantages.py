"""group_advantages(valid=...): a dropped response leaves its group's baseline and std (hand-derived values)."""

from __future__ import annotations

import math

import pytest
import torch

from ais_lightning.losses import group_advantages

T, F = True, False


def test_a_dropped_response_does_not_shift_its_groups_baseline():
    # group 0 rewards 1 0 0 1, response 0 dropped: kept 0 0 1 -> mean 1/3, population std sqrt(2/9) = 0.471405
    #   advantages: 0 (dropped), -1/3 / 0.471405 = -0.707107 (twice), 2/3 / 0.471405 = 1.414214
    # group 1 rewards 5 5 5 1, response 3 dropped: the kept rewards are all 5 -> exact zeros
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 5.0, 1.0])
    valid = torch.tensor([F, T, T, T, T, T, T, F])
    got = group_advantages(rewards, 4, valid=valid, eps=0.0)
    s = math.sqrt(2 / 9)
    assert got.tolist() == pytest.approx([0.0, -1 / 3 / s, -1 / 3 / s, 2 / 3 / s, 0, 0, 0, 0], rel=1e-6)
    # without the drop the dropped reward shifts the baseline to 0.5: advantages +-1
    assert group_advantages(rewards, 4, eps=0.0)[:4].tolist() == pytest.approx([1, -1, -1, 1])


def test_the_dropped_reward_has_no_influence_at_all():
    valid = torch.tensor([F, T, T, T])
    a = group_advantages(torch.tensor([100.0, 0.0, 1.0, 3.0]), 4, valid=valid)
    b = group_advantages(torch.tensor([-7.0, 0.0, 1.0, 3.0]), 4, valid=valid)
    assert torch.equal(a, b) and a[0] == 0
    # the kept three alone, as a group of their own
    assert a[1:].tolist() == pytest.approx(group_advantages(torch.tensor([0.0, 1.0, 3.0]), 3).tolist())


def test_batch_and_none_scales_count_only_kept_responses():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 5.0, 1.0])
    valid = torch.tensor([F, T, T, T, T, T, T, F])
    # none: reward - kept group mean: group 0 -> 0, -1/3, -1/3, 2/3; group 1 all 5 -> zeros
    got = group_advantages(rewards, 4, scale="none", valid=valid)
    assert got.tolist() == pytest.approx([0, -1 / 3, -1 / 3, 2 / 3, 0, 0, 0, 0], rel=1e-6)
    # batch: kept rewards 0 0 1 5 5 5 -> mean 8/3, population variance (2 (8/3)^2 + (5/3)^2 + 3 (7/3)^2) / 6
    #   = (128/9 + 25/9 + 147/9) / 6 = 300/54 = 50/9 -> std 2.357023
    std = math.sqrt(50 / 9)
    got = group_advantages(rewards, 4, scale="batch", valid=valid, eps=0.0)
    assert got.tolist() == pytest.approx([0, -1 / 3 / std, -1 / 3 / std, 2 / 3 / std, 0, 0, 0, 0], rel=1e-6)


def test_groups_with_fewer_than_two_kept_and_all_kept():
    rewards = torch.tensor([1.0, 0.0, 2.0, 3.0])
    one_kept = group_advantages(rewards, 2, valid=torch.tensor([T, F, F, F]))
    assert one_kept.tolist() == [0.0, 0.0, 0.0, 0.0]
    every = torch.ones(4, dtype=torch.bool)
    for scale in ("group", "batch", "none"):
        assert group_advantages(rewards, 2, scale, valid=every).tolist() == pytest.approx(
            group_advantages(rewards, 2, scale).tolist(), rel=1e-6
        )


def test_bad_valid_names_itself():
    rewards = torch.zeros(4)
    for bad in (torch.ones(4), torch.ones(3, dtype=torch.bool), [True] * 4):
        with pytest.raises(ValueError, match="valid"):
            group_advantages(rewards, 2, valid=bad)
