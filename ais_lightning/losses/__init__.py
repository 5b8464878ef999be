"""Policy-gradient losses and advantages (pure torch, no Lightning import).

``group_advantages`` turns per-response rewards into GRPO group-relative advantages; ``GRPOLoss`` is
the PPO-clip surrogate with dual clip, corrector IS weights, k3 KL and an entropy bonus; ``TBPOLoss`` is
QaRL's sequence-level trust-band objective. Every loss shares one call signature (``PolicyLoss``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ais_lightning.losses.advantages import ADVANTAGE_SCALES, group_advantages
from ais_lightning.losses.grpo import (
    AGGREGATIONS,
    KL_RATIOS,
    MODES,
    GRPOLoss,
    LossOutput,
    aggregate,
    check_identity_weights,
    importance_ratio,
)
from ais_lightning.losses.tbpo import TBPOLoss, geometric_log_ratio


@runtime_checkable
class PolicyLoss(Protocol):
    """What a training loop needs from a policy loss; ``GRPOLoss`` and ``TBPOLoss`` implement it.

    ``needs_entropy`` / ``needs_reference``: whether the caller must pass ``entropy`` / ``ref_logprobs``.
    ``own_correction``: None, or a sentence saying how the loss corrects the rollout mismatch itself (then
    it accepts only identity ``weights``, and the run's corrector must be ``none``).
    """

    needs_entropy: bool
    needs_reference: bool
    own_correction: str | None

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        weights: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
        denominator: float | torch.Tensor | None = None,
        rollout_logprobs: torch.Tensor | None = None,
    ) -> LossOutput: ...

    def denominator(
        self,
        mask: torch.Tensor,
        old_logprobs: torch.Tensor | None = None,
        rollout_logprobs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """What the loss of a batch divides by (at least 1): micro-batches of the batch that each pass it as
        ``denominator`` have losses (and ``LossOutput.shares`` stats) that add up to the batch's."""
        ...


LOSSES: dict[str, type[torch.nn.Module]] = {"grpo": GRPOLoss, "tbpo": TBPOLoss}
"""Config names of the built-in losses (``conf/loss``)."""

__all__ = [
    "ADVANTAGE_SCALES",
    "AGGREGATIONS",
    "KL_RATIOS",
    "LOSSES",
    "MODES",
    "GRPOLoss",
    "LossOutput",
    "PolicyLoss",
    "TBPOLoss",
    "aggregate",
    "check_identity_weights",
    "geometric_log_ratio",
    "group_advantages",
    "importance_ratio",
]
