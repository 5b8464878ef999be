"""NoCorrection: every valid token has weight 1 (plain on-sample policy gradient, biased under mismatch)."""

from __future__ import annotations

import torch

from ais_lightning.correctors.base import Corrector, RawCorrection


class NoCorrection(Corrector):
    """Weight 1 on every valid token; nothing clipped or masked. The baseline of design.md section 1.

    Args:
        c: threshold of the raw-ratio stats only (``ratio/frac_above_c_high`` counts w > c,
            ``ratio/frac_below_c_low`` counts w < 1/c), so logs compare with TIS/AIS at the same C.
    """

    def __init__(self, c: float = 2.0) -> None:
        super().__init__()
        if not c >= 1.0:
            raise ValueError(f"c must be >= 1, got {c}")
        self.c = float(c)
        self.stat_c_high = self.c
        self.stat_c_low = 1.0 / self.c

    def correct(
        self,
        delta: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor | None,
        entropy: torch.Tensor | None,
    ) -> RawCorrection:
        weights = mask.to(delta.dtype)  # [B, T]
        return RawCorrection(weights, mask, torch.zeros_like(mask), {})

    def extra_repr(self) -> str:
        return f"c={self.c}"
