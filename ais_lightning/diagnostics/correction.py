"""What a corrector did to a batch: the fraction of valid tokens it masked or clipped."""

from __future__ import annotations

from typing import Any

import torch

from ais_lightning.diagnostics.base import MaskedMeanMetric, check_threshold
from ais_lightning.ops import check_mask, check_token_tensor

CORRECTION_KINDS = ("masked", "clipped")
CLIP_TOLERANCE = 1e-6
"""A kept token's weight counts as clipped when |weight - c| < CLIP_TOLERANCE."""


class CorrectionFraction(MaskedMeanMetric):
    """Fraction of valid tokens a corrector removed (``masked``) or clipped (``clipped``).

    ``update(mask, corrected_mask, weights)`` takes the input ``mask`` and the corrector's
    ``CorrectionOutput.mask`` / ``.weights`` (all ``[B, T]``). Both kinds share the denominator, the
    number of valid tokens (``mask``), so they are comparable and sum to at most 1:

    - ``masked``: tokens with ``mask & ~corrected_mask`` (rejected by MIS, removed from the loss);
    - ``clipped``: tokens with ``mask & corrected_mask & (|weights - c| < 1e-6)``, i.e. kept tokens
      whose weight sits at the clip bound ``c`` (TIS with ``c_high = c``). For AIS the mixed weight
      (1 - lambda) + lambda * min(w, C) only sits at C when lambda = 1; use
      ``RatioStatistic("frac_above", c=C)`` for the raw fraction of ratios above C instead.

    ``weights`` may be None for ``kind="masked"``. 0.0 when no valid token was seen.
    """

    higher_is_better = False

    def __init__(self, kind: str = "masked", c: float = 2.0, **kwargs: Any) -> None:
        if kind not in CORRECTION_KINDS:
            raise ValueError(f"kind must be one of {CORRECTION_KINDS}, got {kind!r}")
        check_threshold(c, "c", 0.0, inclusive=False)
        super().__init__(**kwargs)
        self.kind = kind
        self.c = float(c)

    def update(
        self, mask: torch.Tensor, corrected_mask: torch.Tensor, weights: torch.Tensor | None = None
    ) -> None:
        check_mask(mask)
        check_mask(corrected_mask, "corrected_mask")
        if corrected_mask.shape != mask.shape:
            raise ValueError(
                f"corrected_mask has shape {tuple(corrected_mask.shape)} but mask has shape {tuple(mask.shape)}"
            )
        if self.kind == "masked":
            hit = ~corrected_mask  # [B, T]
        else:
            if weights is None:
                raise ValueError("weights is required for CorrectionFraction(kind='clipped')")
            check_token_tensor(weights, "weights", mask)
            hit = corrected_mask & ((weights.detach().double() - self.c).abs() < CLIP_TOLERANCE)  # [B, T]
        self._accumulate(hit.double(), mask)
