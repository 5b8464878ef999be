"""The base of every policy loss: one call signature, and what a training loop asks of a loss."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class LossOutput:
    """What every :class:`PolicyLoss` returns."""

    loss: torch.Tensor
    """Scalar loss, differentiable w.r.t. ``logprobs`` (and ``entropy`` when the loss has an entropy bonus)."""
    stats: dict[str, float] = field(default_factory=dict)
    """Detached scalars, keys ``loss/...`` (each loss documents its own)."""
    shares: frozenset[str] = frozenset()
    """The stats that are this call's share of the batch's value when the call got the batch's
    ``denominator``: over the micro-batches of one batch they add up (the others are per-call means)."""


class PolicyLoss(nn.Module):
    """What a training loop needs from a policy loss; ``GRPOLoss`` and ``TBPOLoss`` subclass it.

    A subclass implements ``forward`` with the call signature below (every loss gets the same inputs and uses
    what it needs) and :meth:`denominator`, and overrides the declared capabilities it has (as attributes or
    properties):

    - :attr:`needs_entropy` [False] / :attr:`needs_reference` [False]: whether the caller must pass ``entropy``
      (with its gradient) / ``ref_logprobs`` (then it keeps a frozen reference policy).
    - :attr:`own_correction` [None]: None, or a sentence saying how the loss corrects the rollout mismatch itself
      (then it accepts only identity ``weights``, and a run's corrector must be ``none``).
    - :attr:`trust_region` [None]: how far one update may move a token's ratio to the old policy (PPO's clip
      epsilon), or None; an adaptive staleness bound keeps stale rows within it by default.

    Example:
        >>> from ais_lightning.losses import GRPOLoss, PolicyLoss, TBPOLoss
        >>> loss = GRPOLoss(entropy_coef=0.01)
        >>> isinstance(loss, PolicyLoss), loss.needs_entropy, loss.needs_reference, loss.own_correction
        (True, True, False, None)
        >>> TBPOLoss().own_correction is not None  # it corrects the mismatch itself: corrector=none
        True
    """

    needs_entropy: bool = False
    """Whether ``forward`` needs ``entropy`` with its gradient (an entropy bonus)."""
    needs_reference: bool = False
    """Whether ``forward`` needs ``ref_logprobs`` (a KL penalty against a frozen reference)."""
    own_correction: str | None = None
    """How the loss corrects the rollout mismatch itself (it then takes no importance weights), or None."""
    trust_region: float | None = None
    """How far one update may move a token's ratio pi_theta / pi_old away from 1 (PPO's clip epsilon), or None."""

    def forward(
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
    ) -> LossOutput:
        """The loss of a batch (``[B, T]`` tensors, ``advantages`` ``[B]``) and its stats; with ``denominator``
        (:meth:`denominator` of the whole batch) the share of one micro-batch."""
        raise NotImplementedError(f"{type(self).__name__} does not implement forward")

    def denominator(
        self,
        mask: torch.Tensor,
        old_logprobs: torch.Tensor | None = None,
        rollout_logprobs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """What the loss of a batch divides by (at least 1): micro-batches of the batch that each pass it as
        ``denominator`` have losses (and ``LossOutput.shares`` stats) that add up to the batch's."""
        raise NotImplementedError(f"{type(self).__name__} does not implement denominator")
