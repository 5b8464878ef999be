"""What one rollout step hands to the policy update: the rollout batch, rewards, advantages, pi_old and the
corrector's weights (:meth:`ais_lightning.modules.grpo.GRPOModule.build_experience` makes it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ais_lightning import ops
from ais_lightning.policy import ResponseLogprobs
from ais_lightning.rollout.base import RolloutBatch
from ais_lightning.tasks import safe_rewards

__all__ = ["Experience", "rollout_stats", "score_rows"]


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


def score_rows(
    task: Any, tokenizer: Any, batch: RolloutBatch, prompts: list[str], fields: dict[str, list]
) -> tuple[list[float], int]:
    """The task's reward of every row of ``batch`` (rows answer ``prompts[batch.prompt_index]``, with the task
    ``fields`` of their prompt) and how many rewards failed (scored 0; ``ais_lightning.tasks.safe_rewards``)."""
    index = batch.prompt_index.tolist()
    completions = [
        tokenizer.decode(ids[mask].tolist(), skip_special_tokens=True)
        for ids, mask in zip(batch.response_ids, batch.response_mask)
    ]
    row_fields = {k: [v[i] for i in index] for k, v in fields.items()}
    rewards, n_failed = safe_rewards(task.reward, [prompts[i] for i in index], completions, row_fields)
    return rewards, int(n_failed)


def rollout_stats(batch: RolloutBatch, rewards: torch.Tensor, n_failed: int) -> dict[str, float]:
    """What a rollout step logs of its samples: ``reward/mean``, ``reward/std``, ``reward/failed``,
    ``response/length_mean`` and ``response/stop_frac``."""
    return {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std(unbiased=False).item(),
        "reward/failed": float(n_failed),
        "response/length_mean": batch.response_mask.sum(-1).float().mean().item(),
        "response/stop_frac": sum(r == "stop" for r in batch.finish_reason)
        / max(len(batch.finish_reason), 1),
    }
