"""What one rollout step hands to the policy update: the rollout batch, rewards, advantages, pi_old and the
corrector's weights (:meth:`ais_lightning.modules.grpo.GRPOModule.build_experience` makes it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ais_lightning import ops
from ais_lightning.policy import ResponseLogprobs
from ais_lightning.rollout.base import RolloutBatch

__all__ = ["Experience"]


@dataclass
class Experience:
    """One rollout step, ready for the policy update (rows grouped by prompt). All ``[B, T]`` unless noted."""

    rollout: RolloutBatch
    rewards: torch.Tensor  # [B]
    advantages: torch.Tensor  # [B]
    train_logprobs: torch.Tensor  # pi_old, the trainer's log-probs before the update
    weights: torch.Tensor  # corrector IS weights (0 where not kept)
    loss_mask: torch.Tensor  # response_mask & corrector mask
    current: ResponseLogprobs | None = None
    """pi_old's forward with its autograd graph, for the loss of the one optimizer step that follows
    (``build_experience(keep_graph=True)``); None: the loss runs its own forward."""

    def rows(self, index: torch.Tensor) -> Experience:
        """The rows ``index`` (``[R]`` long) of every tensor, for a mini-batch."""
        return ops.take_rows(self, index)
