"""PSISKHat: the Pareto k-hat of the importance weights pi/mu as a torchmetrics Metric.

k-hat (Vehtari et al., "Pareto Smoothed Importance Sampling", JMLR 2024) is the shape of a generalized
Pareto distribution fitted (Zhang & Stephens 2009) to the M = ceil(min(0.2 S, 3 sqrt(S))) largest of
the S weights; see ``ais_lightning.correctors.psis`` for the fit. k-hat < 0.5: the IS estimate has
finite variance; k-hat > 0.7 (``KHAT_UNRELIABLE``): unreliable, the mismatch is too heavy-tailed for
importance weighting to fix.

Exact sync across ranks and batches: the fit needs only the largest M + 1 log-weights and S. The
state ``top`` keeps the ``max_tail + 1`` largest log-weights seen (descending, -inf padded) and is
reduced with ``merge_top`` (the largest of the ranks' stacked states); ``count`` (S) is summed. The
union of the per-rank top-K contains the global top-K, so after a sync every rank holds exactly
the top-K of the concatenated data and ``compute()`` equals the single-process value. M is capped at
``max_tail`` (reached at S ~ 1.9M draws for the default 4096), the same cap in every process.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torchmetrics import Metric

from ais_lightning.correctors.psis import MIN_TAIL, pareto_khat
from ais_lightning.diagnostics.base import STATE_DTYPE, checked_log_ratio, sequence_mask
from ais_lightning.ops import masked_sum

KHAT_LEVELS = ("token", "sequence")


def merge_top(stacked: torch.Tensor) -> torch.Tensor:
    """``dist_reduce_fx`` of ``top``: the K largest entries of stacked ``[R, K]`` states, descending.  # [K]"""
    return torch.topk(stacked.reshape(-1), stacked.shape[-1]).values


class PSISKHat(Metric):
    """Pareto k-hat of the token ratios (``level="token"``) or of the sequence ratios (``"sequence"``).

    Args:
        level: ``"token"``: one draw per valid token, log-weight delta; ``"sequence"``: one draw per
            response with a valid token, log-weight sum_t delta (the product of ratios, not clamped:
            k-hat is scale-free, and exp is taken relative to the largest weight).
        max_tail: cap (>= 5) on the tail length M.

    ``compute()`` is 0.0 when no fit is possible: fewer than 5 draws above the cutoff (no data,
    S < 25 draws, or constant weights such as pi = mu). Lower is better.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = False

    top: torch.Tensor
    count: torch.Tensor

    def __init__(self, level: str = "token", max_tail: int = 4096, **kwargs: Any) -> None:
        if level not in KHAT_LEVELS:
            raise ValueError(f"level must be one of {KHAT_LEVELS}, got {level!r}")
        if isinstance(max_tail, bool) or not isinstance(max_tail, int) or max_tail < MIN_TAIL:
            raise ValueError(f"max_tail must be an int >= {MIN_TAIL}, got {max_tail!r}")
        super().__init__(**kwargs)
        self.level = level
        self.max_tail = max_tail
        top = torch.full((max_tail + 1,), -math.inf, dtype=STATE_DTYPE)
        self.add_state("top", default=top, dist_reduce_fx=merge_top)
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(
        self,
        train_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        mask: torch.Tensor,
        log_ratio: torch.Tensor | None = None,
    ) -> None:
        """``log_ratio``: optional precomputed ``ops.log_ratio(train_logprobs, rollout_logprobs, mask)``."""
        delta = checked_log_ratio(train_logprobs, rollout_logprobs, mask, log_ratio)  # [B, T] float64
        if self.level == "token":
            values = delta[mask]  # [N]
        else:
            values = masked_sum(delta, mask, dim=-1)[sequence_mask(mask)]  # [N]
        merged = torch.cat([self.top, values.to(self.top.dtype)])
        self.top = torch.topk(merged, self.top.numel()).values
        self.count += values.numel()

    def compute(self) -> torch.Tensor:
        k_hat, _ = pareto_khat(self.top, int(self.count))
        return torch.nan_to_num(k_hat, nan=0.0)
