"""Group-relative advantages for GRPO.

GRPO (Shao et al. 2024, "DeepSeekMath", arXiv 2402.03300) samples ``group_size`` responses per
prompt and uses the reward relative to its group as the advantage of every token of a response:
``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)``. Dr. GRPO (Liu et al. 2025, "Understanding
R1-Zero-Like Training", arXiv 2503.20783) drops the std division because it re-weights prompts by
their difficulty; TRL's ``scale_rewards="batch"`` divides by the std of the whole batch instead.

Standard deviations here are *population* stds (``unbiased=False``, divide by n): they are
defined for ``group_size=1`` and bound ``|A| <= sqrt(group_size - 1)``. TRL and verl use the
Bessel-corrected std (divide by n - 1), which is ``sqrt(n / (n - 1))`` times larger, so their
advantages are that factor smaller; the difference is a constant per group size.

``valid`` drops responses before the advantages: a dropped response gets advantage 0 and leaves its
group's mean and std (and the batch std), so removing it from the loss does not shift the baseline of the
responses that stay. NeMo-RL's ``seq_logprob_error_threshold`` drops responses before its advantages too
(``nemo_rl/algorithms/grpo.py``), but its GRPO estimator computes the baseline with
``torch.ones_like(rewards)`` as the valid mask (``nemo_rl/algorithms/advantage_estimator.py``), so there a
dropped response still enters its group's baseline.
"""

from __future__ import annotations

import torch

ADVANTAGE_SCALES = ("group", "batch", "none")


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale: str = "group",
    eps: float = 1e-6,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages of ``rewards`` relative to their group.  # [B]

    Args:
        rewards: ``[B]`` float rewards; the ``group_size`` responses of one prompt are contiguous
            rows (rows ``g * group_size ... (g + 1) * group_size - 1`` form group ``g``).
        group_size: responses per prompt; must divide ``B``.
        scale: ``"group"``: ``(r - group mean) / (group std + eps)`` (GRPO);
            ``"batch"``: ``(r - group mean) / (std of all B rewards + eps)`` (TRL's batch scaling);
            ``"none"``: ``r - group mean`` (Dr. GRPO, no scaling).
        eps: added to the std before dividing; ``>= 0``.
        valid: ``[B]`` bool, the responses that stay (None: all). A dropped response gets advantage 0 and
            enters neither its group's mean and std nor the batch std (module doc).

    A group whose rewards are all equal gets an advantage of exactly 0 (never NaN, whatever ``eps``),
    which includes every group when ``group_size == 1``; with ``valid``, a group whose kept rewards are all
    equal (or with fewer than 2 kept) likewise. Stds are population stds (see module doc).
    """
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() != 1 or not rewards.is_floating_point():
        raise ValueError(
            f"rewards must be a 1-D floating tensor [B], got shape {tuple(rewards.shape)} dtype {rewards.dtype}"
        )
    if rewards.numel() == 0:
        raise ValueError("rewards must not be empty")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards has non-finite values")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"group_size={group_size} does not divide the number of rewards B={rewards.numel()}")
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"scale must be one of {ADVANTAGE_SCALES}, got {scale!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if valid is not None:
        if not isinstance(valid, torch.Tensor):
            raise ValueError(f"valid must be a torch.Tensor, got {type(valid).__name__}")
        if valid.dtype != torch.bool or valid.shape != rewards.shape:
            raise ValueError(
                f"valid must be a bool tensor of the rewards' shape {tuple(rewards.shape)}, got shape "
                f"{tuple(valid.shape)} dtype {valid.dtype}"
            )
        return _kept_group_advantages(rewards.detach(), group_size, scale, eps, valid)

    grouped = rewards.detach().view(-1, group_size)  # [G, n]
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # [G, n]
    if scale == "group":
        centered = centered / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)
    elif scale == "batch":
        centered = centered / (rewards.detach().std(unbiased=False) + eps)
    # Equal rewards: the mean of n copies of r need not round back to r; force exact zeros.
    constant = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)  # [G, 1]
    centered = torch.where(constant, torch.zeros_like(centered), centered)
    return centered.reshape(-1)  # [B]


def _kept_group_advantages(
    rewards: torch.Tensor, group_size: int, scale: str, eps: float, valid: torch.Tensor
) -> torch.Tensor:
    """``group_advantages`` over the ``valid`` rows only; dropped rows get 0.  # [B]"""
    grouped = rewards.view(-1, group_size)  # [G, n]
    keep = valid.view(-1, group_size)  # [G, n]
    kept = keep.to(grouped.dtype)  # [G, n]
    count = kept.sum(dim=1, keepdim=True)  # [G, 1]
    mean = (grouped * kept).sum(dim=1, keepdim=True) / count.clamp(min=1.0)  # [G, 1]
    centered = (grouped - mean) * kept  # [G, n], 0 on dropped rows
    if scale == "group":
        std = ((centered**2).sum(dim=1, keepdim=True) / count.clamp(min=1.0)).sqrt()  # [G, 1]
        centered = centered / (std + eps)
    elif scale == "batch":
        n_kept = kept.sum().clamp(min=1.0)
        batch_mean = (rewards * valid).sum() / n_kept
        batch_std = ((((rewards - batch_mean) * valid) ** 2).sum() / n_kept).sqrt()
        centered = centered / (batch_std + eps)
    high = torch.where(keep, grouped, -torch.inf).amax(dim=1, keepdim=True)  # [G, 1], max kept reward
    low = torch.where(keep, grouped, torch.inf).amin(dim=1, keepdim=True)  # [G, 1], min kept reward
    constant = (count < 2) | (high == low)  # [G, 1]
    centered = torch.where(constant | ~keep, torch.zeros_like(centered), centered)
    return centered.reshape(-1)  # [B]
