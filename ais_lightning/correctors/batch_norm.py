"""Batch-normalised truncated IS: TIS weights rescaled to mean 1 over the (global) batch.

verl's ``rollout_is_batch_normalize`` (``verl/trainer/ppo/rollout_corr_helper.py``,
``compute_rollout_correction_weights``; documented in verl's ``docs/algo/rollout_corr.md``): the IS weights
are truncated first (``clamp(max=rollout_is_threshold)``) and then divided by their mean, so the
truncation threshold is applied to the raw ratio and the normalised weights may exceed it.

- token level: the mean is over every valid token of the batch;
- sequence level (and our geometric level): one weight per sequence, the mean is over the sequences
  with at least one valid token (verl averages each sequence's token weights, which are all equal).

verl all-reduces the sum and the count (``verl_F.distributed_masked_mean``) when ``torch.distributed``
is initialized; so do we, so every rank divides by the mean of the concatenated global batch. Like
verl, a mean <= 1e-8 (or no valid token at all) leaves the weights unnormalised and reports a
factor of 1.
"""

from __future__ import annotations

import torch

from ais_lightning import ops
from ais_lightning.correctors.ais import AISParams, ais_params
from ais_lightning.correctors.base import Corrector, RawCorrection, check_bounds, check_level, level_ratio
from ais_lightning.correctors.distributed import all_reduce_sum

MIN_BATCH_MEAN = 1e-8
"""Below this batch mean the weights are left unnormalised (verl's guard)."""


def batch_normalize(
    weights: torch.Tensor, mask: torch.Tensor, level: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights / mean, mean)`` with the mean over the global batch at ``level``.

    Args:
        weights: ``[B, T]`` non-negative weights (constant along each response at a sequence level).
        mask: ``[B, T]`` bool, the tokens (or, at a sequence level, the sequences with at least one
            such token) over which the mean is taken.
        level: ``"token"`` (mean over tokens) or ``"sequence"`` / ``"geometric"`` (mean over sequences).

    Returns the normalised ``[B, T]`` weights (same dtype) and the factor (0-dim float64; 1 when the
    mean is <= 1e-8 or nothing is valid). All-reduced across ranks when distributed (a collective).
    """
    check_level(level)
    w = weights.double()  # [B, T]
    if level == "token":
        stats = torch.stack([ops.masked_sum(w, mask), mask.sum().double()])  # [2]
    else:
        per_seq = ops.masked_mean(w, mask, dim=-1)  # [B], 0 for empty rows
        has_tokens = mask.any(dim=-1)  # [B]
        stats = torch.stack([ops.masked_sum(per_seq, has_tokens), has_tokens.sum().double()])  # [2]
    total, count = all_reduce_sum(stats).unbind()
    mean = total / count.clamp(min=1.0)
    factor = torch.where((count > 0) & (mean > MIN_BATCH_MEAN), mean, torch.ones_like(mean))
    return (w / factor).to(weights.dtype), factor


class BatchNormalizedTIS(Corrector):
    """weight = clamp(w_level, c_low, c_high) / (its mean over the global batch); nothing leaves the mask.

    verl ``rollout_is=token|sequence`` with ``rollout_is_batch_normalize=True`` (see the module
    docstring). The weights average exactly 1 over the batch's valid tokens (token level) or
    sequences (sequence / geometric level), so the correction changes the relative weighting of the
    tokens but not the overall loss scale. If ``torch.distributed`` is initialized every rank must call
    the corrector (the mean is all-reduced).

    Args:
        level: ``"token"``, ``"sequence"`` (product of the token ratios) or ``"geometric"``.
        c_high: truncation C >= 1 applied before the normalisation (verl ``rollout_is_threshold``).
        c_low: optional lower truncation in [0, 1]; None = no lower bound (verl has none).

    Extra stats: ``tis/batch_norm_factor`` (the mean the weights were divided by; verl
    ``rollout_is_batch_norm_factor``).
    """

    def __init__(self, level: str = "token", c_high: float = 2.0, c_low: float | None = None) -> None:
        super().__init__()
        check_level(level)
        check_bounds(c_low, c_high)
        self.level = level
        self.c_high = float(c_high)
        self.c_low = None if c_low is None else float(c_low)

    def correct(
        self,
        delta: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor | None,
        entropy: torch.Tensor | None,
    ) -> RawCorrection:
        ratio = level_ratio(delta, mask, self.level)  # [B, T]
        truncated = ratio.clamp(min=self.c_low, max=self.c_high)  # [B, T]
        clipped = ratio > self.c_high
        if self.c_low is not None:
            clipped = clipped | (ratio < self.c_low)
        weights, factor = batch_normalize(truncated, mask, self.level)  # [B, T]
        return RawCorrection(weights, mask, clipped & mask, {"tis/batch_norm_factor": factor})

    def diagnostic_params(self) -> AISParams:
        """C = ``c_high``, the lower bound ``c_low`` (:meth:`Corrector.diagnostic_params`)."""
        return ais_params(c=self.c_high, c_low=self.c_low)

    def extra_repr(self) -> str:
        return f"level={self.level!r}, c_high={self.c_high}, c_low={self.c_low}"
