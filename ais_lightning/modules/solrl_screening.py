"""Screening: which prompts of a cheap candidate pool carry a learning signal, and which candidates to keep.

Sol-RL (Li, Chen, Xue et al. 2026, "FP4 Explore, BF16 Train", arXiv 2604.06916) generates 96
candidates per prompt with a cheap NVFP4 model and trains on the 12 best and the 12 worst by reward,
regenerated in BF16: under selective training only the extremes drive the update, so a larger cheap
pool yields a more contrastive group at the same training cost. In GRPO a prompt whose rewards are
all equal has zero advantages and carries no gradient (DAPO's dynamic sampling, arXiv 2503.14476,
filters such groups), so screening also decides which prompts are worth regenerating.

Pure functions on a ``[P, K]`` reward table (P screened prompts, K candidates each):

- :func:`keep_candidates`: which ``k`` of the K candidates of each prompt to keep, by a rule in
  :data:`SELECTION_RULES`;
- :func:`select_candidates`: the informative prompts (reward spread above a tolerance), ranked, and the
  kept candidates of the chosen ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ais_lightning.checks import check_int

__all__ = ["SELECTION_RULES", "Selection", "keep_candidates", "select_candidates"]

SELECTION_RULES = ("contrastive", "max_variance", "random")
"""How the kept candidates of a prompt are chosen from its K screened ones:

- ``contrastive``: Sol-RL's rule, the ``ceil(k/2)`` highest and the ``floor(k/2)`` lowest rewards;
- ``max_variance``: the ``k``-subset whose rewards have the largest variance (the ``j`` highest and
  ``k - j`` lowest for the best ``j``; equal variances go to the most balanced ``j``);
- ``random``: ``k`` candidates uniformly at random (screening then only filters prompts).

Ties in reward go to the lower candidate index among the lowest rewards and to the higher index among
the highest (one stable ascending sort), so the choice is deterministic."""


def _check_rewards(rewards: torch.Tensor) -> None:
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 2 or not rewards.is_floating_point():
        shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a floating [P, K] tensor, got {shape}")
    if rewards.shape[0] == 0 or rewards.shape[1] == 0:
        raise ValueError(
            f"rewards must have at least one prompt and one candidate, got {tuple(rewards.shape)}"
        )
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards has non-finite values")


def _subset_variance(sorted_rewards: torch.Tensor, keep: int, top: torch.Tensor) -> torch.Tensor:
    """Population variance of the ``top`` highest and ``keep - top`` lowest rewards.  # [P, J]

    ``sorted_rewards``: ``[P, K]`` ascending; ``top``: ``[J]`` long in ``[0, keep]``.
    """
    x = sorted_rewards.double()  # [P, K]
    k_all = x.shape[1]
    zero = torch.zeros_like(x[:, :1])
    s1 = torch.cat([zero, x.cumsum(-1)], dim=-1)  # [P, K + 1] prefix sums
    s2 = torch.cat([zero, (x * x).cumsum(-1)], dim=-1)  # [P, K + 1]
    low, high_start = keep - top, k_all - top  # [J] each
    total1 = s1[:, low] + s1[:, -1:] - s1[:, high_start]  # [P, J]
    total2 = s2[:, low] + s2[:, -1:] - s2[:, high_start]  # [P, J]
    mean = total1 / keep
    return (total2 / keep - mean * mean).clamp(min=0)


def keep_candidates(
    rewards: torch.Tensor, keep: int, rule: str = "contrastive", generator: torch.Generator | None = None
) -> torch.Tensor:
    """The ``keep`` candidates of each prompt to train on, in ascending index order.  # [P, keep] long

    ``rewards``: ``[P, K]`` rewards of K screened candidates per prompt; ``rule``: one of
    :data:`SELECTION_RULES`; ``generator`` seeds ``random``.
    """
    _check_rewards(rewards)
    n_prompts, k_all = rewards.shape
    check_int(keep, "keep", 1)
    if keep > k_all:
        raise ValueError(f"keep must be <= the {k_all} candidates per prompt, got {keep}")
    if rule not in SELECTION_RULES:
        raise ValueError(f"rule must be one of {list(SELECTION_RULES)}, got {rule!r}")
    if rule == "random":
        scores = torch.rand((n_prompts, k_all), generator=generator)  # [P, K]
        return scores.argsort(dim=-1)[:, :keep].sort(dim=-1).values
    order = rewards.sort(dim=-1, stable=True).indices  # [P, K] ascending, ties by index
    if rule == "contrastive":
        top = torch.full((n_prompts,), (keep + 1) // 2, dtype=torch.long)  # [P]
    else:  # max_variance: the best split, the most balanced one among equals
        splits = torch.arange(keep + 1)  # [J]
        preference = 2 * (2 * splits - keep).abs() + (2 * splits < keep).long()  # [J]
        splits = splits[preference.argsort()]  # most balanced first; more high than low on a tie
        var = _subset_variance(rewards.gather(-1, order), keep, splits)  # [P, J]
        top = splits[var.argmax(dim=-1)]  # [P], argmax returns the first (most balanced) maximum
    cols = torch.arange(k_all)  # [K]
    chosen = (cols[None, :] < (keep - top)[:, None]) | (cols[None, :] >= (k_all - top)[:, None])  # [P, K]
    picked = order.masked_select(chosen).view(n_prompts, keep)  # [P, keep]
    return picked.sort(dim=-1).values


@dataclass
class Selection:
    """What screening keeps: the prompts to regenerate (best first) and their kept candidates."""

    prompts: torch.Tensor
    """``[S]`` long: screened prompt indices to regenerate, informative ones first, by spread."""
    candidates: torch.Tensor
    """``[S, keep]`` long: the kept candidate indices (within the prompt's K) of each chosen prompt."""
    informative: torch.Tensor
    """``[P]`` bool: the prompt's K rewards spread by more than the tolerance."""
    kept_std: torch.Tensor
    """``[P]`` float: the standard deviation of each prompt's kept rewards (what the ranking uses)."""

    def rows(self, group: int) -> torch.Tensor:
        """``[S, keep]`` long: the chosen candidates as rows of a batch with ``group`` rows per prompt."""
        return self.prompts[:, None] * group + self.candidates


def select_candidates(
    rewards: torch.Tensor,
    keep: int,
    rule: str = "contrastive",
    max_prompts: int = 0,
    tol: float = 1e-6,
    generator: torch.Generator | None = None,
) -> Selection:
    """Screen ``[P, K]`` rewards: informative prompts, their kept candidates, the prompts to regenerate.

    A prompt is informative when ``max - min`` of its K rewards exceeds ``tol``. Prompts are ranked
    informative first, then by the standard deviation of their kept rewards (higher first), then by
    index. ``max_prompts`` > 0 regenerates exactly ``min(max_prompts, P)`` prompts (uninformative ones
    fill up when too few are informative, so the trained batch keeps its size); 0 regenerates every
    informative prompt, and the best-ranked one when none is.
    """
    _check_rewards(rewards)
    check_int(max_prompts, "max_prompts", 0)
    if not (isinstance(tol, (int, float)) and not isinstance(tol, bool) and tol >= 0):
        raise ValueError(f"tol must be a number >= 0, got {tol!r}")
    candidates = keep_candidates(rewards, keep, rule, generator)  # [P, keep]
    spread = rewards.max(dim=-1).values - rewards.min(dim=-1).values  # [P]
    informative = spread > tol  # [P]
    kept_std = rewards.gather(-1, candidates).double().std(dim=-1, unbiased=False).float()  # [P]
    n_prompts = rewards.shape[0]
    # Rank: informative first, then the kept spread (descending), then the index (a stable sort).
    by_std = kept_std.argsort(descending=True, stable=True)  # [P]
    ranked = by_std[(~informative[by_std]).long().argsort(stable=True)]  # [P]
    if max_prompts > 0:
        count = min(max_prompts, n_prompts)
    else:
        count = max(int(informative.sum()), 1)
    chosen = ranked[:count]  # [S]
    return Selection(
        prompts=chosen, candidates=candidates[chosen], informative=informative, kept_std=kept_std
    )
