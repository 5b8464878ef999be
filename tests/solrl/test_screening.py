"""Screening: the selection rules and the prompt ranking on hand-made rewards."""

from __future__ import annotations

import itertools

import pytest
import torch

from ais_lightning.modules.solrl_screening import keep_candidates, select_candidates

# 3 prompts x 8 candidates: a binary prompt with 2 of 8 right, an all-right prompt, a graded one.
REWARDS = torch.tensor(
    [
        [0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0],
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        [0.1, 0.9, 0.5, 0.3, 0.7, 0.2, 0.8, 0.4],
    ]
)


def test_contrastive_keeps_the_best_half_and_the_worst_half():
    kept = keep_candidates(REWARDS, 4, "contrastive")
    # prompt 0: the two right answers (1, 4) and the two lowest-index wrong ones (0, 2)
    # prompt 1: all equal: the two lowest indices as "worst", the two highest as "best"
    # prompt 2: 0.9 (1) and 0.8 (6) best, 0.1 (0) and 0.2 (5) worst
    assert kept.tolist() == [[0, 1, 2, 4], [0, 1, 6, 7], [0, 1, 5, 6]]


def test_contrastive_with_an_odd_budget_takes_one_more_from_the_top():
    kept = keep_candidates(REWARDS[2:], 3, "contrastive")
    assert kept.tolist() == [[0, 1, 6]]  # 0.9, 0.8 and 0.1


def test_max_variance_balances_a_binary_prompt_with_few_right_answers():
    """1 right answer in 8, keep 4: contrastive keeps it with 3 wrong ones (and would keep 2 right if there
    were); max_variance also reaches the best variance, 1 right + 3 wrong = 3/16, as no subset beats it."""
    rewards = torch.tensor(
        [[0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]]
    )
    for rule in ("contrastive", "max_variance"):
        kept = keep_candidates(rewards, 4, rule)
        assert kept[0].tolist().count(3) == 1 and kept[1].tolist().count(3) == 1
        assert torch.allclose(
            rewards.gather(-1, kept).var(-1, unbiased=False), torch.tensor([3 / 16, 3 / 16])
        )


def test_max_variance_takes_the_lopsided_split_when_it_spreads_more():
    """One outlier far above the rest: with it, the three lowest spread more than two low and two high."""
    rewards = torch.tensor([[0.0, 0.1, 0.2, 0.3, 0.4, 10.0]])
    assert keep_candidates(rewards, 4, "contrastive").tolist() == [[0, 1, 4, 5]]  # variance 18.152
    best = keep_candidates(rewards, 4, "max_variance")  # 10 with the 3 lowest: variance 18.382
    assert best.tolist() == [[0, 1, 2, 5]]


def test_max_variance_is_the_best_subset_by_brute_force():
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        k_all = int(torch.randint(2, 8, (1,), generator=gen))
        keep = int(torch.randint(1, k_all + 1, (1,), generator=gen))
        if trial % 2:
            rewards = torch.randint(0, 3, (1, k_all), generator=gen).float()
        else:
            rewards = torch.rand(1, k_all, generator=gen)
        best = max(
            rewards[0, list(c)].var(unbiased=False).item() for c in itertools.combinations(range(k_all), keep)
        )
        got = rewards[0, keep_candidates(rewards, keep, "max_variance")[0]].var(unbiased=False).item()
        assert got == pytest.approx(best, abs=1e-6), (rewards, keep)


def test_random_is_seeded_distinct_and_sorted():
    a = keep_candidates(REWARDS, 4, "random", torch.Generator().manual_seed(3))
    b = keep_candidates(REWARDS, 4, "random", torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    for row in a.tolist():
        assert row == sorted(set(row)) and len(row) == 4
    draws = {
        tuple(keep_candidates(REWARDS, 4, "random", torch.Generator().manual_seed(s))[0].tolist())
        for s in range(20)
    }
    assert len(draws) > 5, "different seeds pick different candidates"


def test_select_ranks_informative_prompts_and_regenerates_them_only():
    sel = select_candidates(REWARDS, 4)
    assert sel.informative.tolist() == [True, False, True]
    # kept stds: prompt 0 {0,1,0,1} = 0.5, prompt 2 {0.1,0.9,0.2,0.8} = 0.354: prompt 0 first
    assert sel.prompts.tolist() == [0, 2]
    assert sel.candidates.tolist() == [[0, 1, 2, 4], [0, 1, 5, 6]]
    assert sel.kept_std[1] == 0
    # as rows of a batch with 8 candidates per prompt
    assert sel.rows(8).tolist() == [[0, 1, 2, 4], [16, 17, 21, 22]]


def test_a_fixed_prompt_budget_fills_with_uninformative_prompts_or_cuts():
    assert select_candidates(REWARDS, 4, max_prompts=3).prompts.tolist() == [0, 2, 1]
    assert select_candidates(REWARDS, 4, max_prompts=1).prompts.tolist() == [0]
    assert select_candidates(REWARDS, 4, max_prompts=9).prompts.numel() == 3


def test_no_informative_prompt_still_regenerates_one():
    flat = torch.ones(3, 4)
    sel = select_candidates(flat, 2)
    assert sel.prompts.tolist() == [0] and not sel.informative.any()


def test_the_tolerance_decides_what_counts_as_informative():
    rewards = torch.tensor([[0.5, 0.5 + 1e-7], [0.0, 0.01]])  # a float32 step of 1.2e-7
    assert select_candidates(rewards, 2).informative.tolist() == [False, True]
    assert select_candidates(rewards, 2, tol=0.1).informative.tolist() == [False, False]
    assert select_candidates(rewards, 2, tol=0.0).informative.tolist() == [True, True]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rewards": torch.zeros(4)}, "rewards"),
        ({"rewards": torch.zeros(2, 3, dtype=torch.long)}, "rewards"),
        ({"rewards": torch.zeros(0, 3)}, "rewards"),
        ({"rewards": torch.tensor([[0.0, float("nan")]])}, "rewards"),
        ({"keep": 0}, "keep"),
        ({"keep": 5}, "keep"),
        ({"rule": "best"}, "rule"),
        ({"max_prompts": -1}, "max_prompts"),
        ({"tol": -1.0}, "tol"),
    ],
)
def test_bad_input_raises_naming_the_argument(kwargs, match):
    args = {"rewards": torch.zeros(2, 4), "keep": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        select_candidates(**args)
