"""Truncated importance sampling (TIS): the ratio pi_old/mu clipped to at most ``c_high``.

Ionides, "Truncated importance sampling" (JCGS 2008); applied to rollout/trainer mismatch in
"Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (Yao et al. 2025) and
FP8-RL (arXiv 2601.18150). Levels as in verl's rollout correction: token, sequence (product over
the response) and geometric (exp of the mean log-ratio).
"""

from __future__ import annotations

import torch

from ais_lightning.correctors.ais import AISParams, ais_params
from ais_lightning.correctors.base import Corrector, RawCorrection, check_bounds, check_level, level_ratio


class TIS(Corrector):
    """weight = clamp(w_level, min=c_low, max=c_high) on valid tokens; no token leaves the mask.

    Args:
        level: ``"token"`` (w per token), ``"sequence"`` (product of the token ratios of the
            response, broadcast to its tokens) or ``"geometric"`` (geometric mean, broadcast).
        c_high: upper truncation C >= 1.
        c_low: optional lower truncation in [0, 1]; None = no lower bound.

    Example:
        >>> import torch
        >>> from ais_lightning.correctors import TIS
        >>> train = torch.log(torch.tensor([[0.5, 0.9, 0.2]]))  # log pi_old of the sampled tokens [B=1, T=3]
        >>> rollout = torch.log(torch.tensor([[0.1, 0.9, 0.4]]))  # log mu of the same tokens
        >>> out = TIS(c_high=2.0)(train, rollout, torch.ones(1, 3, dtype=torch.bool))
        >>> out.weights  # ratios 5, 1, 0.5: the first truncated to C = 2
        tensor([[2.0000, 1.0000, 0.5000]])
        >>> round(out.stats["corrector/clipped_frac"], 4)
        0.3333
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
        weights = ratio.clamp(min=self.c_low, max=self.c_high)  # [B, T]
        clipped = ratio > self.c_high
        if self.c_low is not None:
            clipped = clipped | (ratio < self.c_low)
        return RawCorrection(weights, mask, clipped & mask, {})

    def diagnostic_params(self) -> AISParams:
        """C = ``c_high``, the lower bound ``c_low`` (module :meth:`Corrector.diagnostic_params`)."""
        return ais_params(c=self.c_high, c_low=self.c_low)

    def extra_repr(self) -> str:
        return f"level={self.level!r}, c_high={self.c_high}, c_low={self.c_low}"
