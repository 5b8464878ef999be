"""Masked importance sampling (MIS): reject tokens or sequences whose ratio leaves [c_low, c_high].

"When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch"
(Liu, Li et al. 2025) and verl's rollout correction (token/sequence/geometric rejection, veto).
Rejected tokens leave the loss *and* its denominator (slime #657, verl #4852); kept tokens carry
their level ratio as weight.
"""

from __future__ import annotations

import torch

from ais_lightning.correctors.ais import AISParams, ais_params
from ais_lightning.correctors.base import Corrector, RawCorrection, check_bounds, check_level, level_ratio


class MIS(Corrector):
    """Keep a token iff its level ratio is in [c_low, c_high] (and its sequence passes the veto).

    Args:
        level: ``"token"`` (reject single tokens), ``"sequence"`` (reject whole responses on the
            product of their token ratios) or ``"geometric"`` (on the geometric mean).
        c_low: lower acceptance bound in [0, 1].
        c_high: upper acceptance bound >= 1.
        veto: optional threshold in (0, 1]: a response with ANY valid token ratio below ``veto``
            is rejected whole, whatever the level (catastrophic-token veto).

    Example:
        >>> import torch
        >>> from ais_lightning.correctors import MIS
        >>> train = torch.log(torch.tensor([[0.5, 0.9, 0.2]]))  # log pi_old [B=1, T=3]
        >>> rollout = torch.log(torch.tensor([[0.1, 0.9, 0.4]]))  # log mu: ratios 5, 1, 0.5
        >>> out = MIS(c_low=0.6, c_high=2.0)(train, rollout, torch.ones(1, 3, dtype=torch.bool))
        >>> out.mask  # only the ratio inside [0.6, 2] stays in the loss and its denominator
        tensor([[False,  True, False]])
        >>> out.weights
        tensor([[0., 1., 0.]])
    """

    def __init__(
        self, level: str = "token", c_low: float = 0.5, c_high: float = 2.0, veto: float | None = None
    ) -> None:
        super().__init__()
        check_level(level)
        check_bounds(c_low, c_high)
        if veto is not None and not 0.0 < veto <= 1.0:
            raise ValueError(f"veto must be in (0, 1] or None, got {veto}")
        self.level = level
        self.c_low = float(c_low)
        self.c_high = float(c_high)
        self.veto = None if veto is None else float(veto)

    def correct(
        self,
        delta: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor | None,
        entropy: torch.Tensor | None,
    ) -> RawCorrection:
        ratio = level_ratio(delta, mask, self.level)  # [B, T]
        keep = mask & (ratio >= self.c_low) & (ratio <= self.c_high)  # [B, T]
        if self.veto is not None:
            vetoed = (mask & (torch.exp(delta) < self.veto)).any(dim=-1, keepdim=True)  # [B, 1]
            keep = keep & ~vetoed
        return RawCorrection(ratio, keep, torch.zeros_like(mask), {})

    def diagnostic_params(self) -> AISParams:
        """C = ``c_high``, the lower bound ``c_low`` (:meth:`Corrector.diagnostic_params`)."""
        return ais_params(c=self.c_high, c_low=self.c_low, base="mis")

    def extra_repr(self) -> str:
        return f"level={self.level!r}, c_low={self.c_low}, c_high={self.c_high}, veto={self.veto}"
