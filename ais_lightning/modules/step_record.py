"""What GRPOModule records of every rollout step for the end-of-run summary (``GRPOModule.history``)."""

from __future__ import annotations

from typing import Any

import torch


def history_entry(
    step: int, stats: dict[str, float], reward_min: float, reward_max: float, extra: dict[str, str]
) -> dict[str, float]:
    """One step's entry: ``step`` (rollout steps done), the reward (mean, min, max, failed), the mismatch KL k3, the
    entropy, AIS's lambda (NaN without AIS), and ``extra``: entry name -> the stats key it copies (a subclass's
    ``HISTORY_STATS``, the asynchronous mode's staleness), when the step logged it."""
    return {
        "step": float(step),
        "reward": stats["reward/mean"],
        "reward_min": reward_min,
        "reward_max": reward_max,
        "reward_failed": stats["reward/failed"],
        "kl_k3": stats.get("mismatch/kl_k3", float("nan")),
        "entropy": stats["train/entropy"],
        "lambda": stats.get("ais/lambda", float("nan")),
        **{name: stats[key] for name, key in extra.items() if key in stats},
    }


def reward_range(rewards: torch.Tensor, strategy: Any) -> tuple[float, float]:
    """The smallest and the largest of a step's rewards (``[B]``) over every rank (``strategy.reduce``, a
    collective)."""
    local = torch.stack([-rewards.min(), rewards.max()]).float()  # [2]
    both = strategy.reduce(local, reduce_op="max")
    return -float(both[0]), float(both[1])
