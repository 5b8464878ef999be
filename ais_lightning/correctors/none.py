"""NoCorrection: every valid token has weight 1 (plain on-sample policy gradient, biased under mismatch)."""

from __future__ import annotations

import torch

from ais_lightning.correctors.base import Corrector, RawCorrection


class NoCorrection(Corrector):
    """Weight 1 on every valid token; nothing clipped or masked. The biased baseline.

    The raw ratio statistics of the batch (how far off-policy it is) come from
    ``ais_lightning.diagnostics.MismatchDiagnostics``, whichever corrector runs.
    """

    def correct(
        self,
        delta: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor | None,
        entropy: torch.Tensor | None,
    ) -> RawCorrection:
        weights = mask.to(delta.dtype)  # [B, T]
        return RawCorrection(weights, mask, torch.zeros_like(mask), {})
