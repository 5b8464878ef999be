"""Mean token entropy of the trainer policy over valid response tokens."""

from __future__ import annotations

import torch

from ais_lightning.diagnostics.base import MaskedMeanMetric
from ais_lightning.ops import check_mask, check_token_tensor


class TokenEntropy(MaskedMeanMetric):
    """Mean of per-token entropies (nats) over every valid token seen; 0.0 when none.

    ``update(entropy, mask)``: ``entropy`` is ``[B, T]`` float (e.g. ``ais_lightning.ops.
    entropy_from_logits``), ``mask`` ``[B, T]`` bool. Low entropy = a concentrated policy, where the
    same mismatch hurts more (AIS divergence severity, docs/design.md section 4).
    """

    def update(self, entropy: torch.Tensor, mask: torch.Tensor) -> None:
        check_mask(mask)
        check_token_tensor(entropy, "entropy", mask)
        self._accumulate(entropy.detach(), mask)
