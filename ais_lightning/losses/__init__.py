"""Policy-gradient losses and advantages (pure torch, no Lightning import).

``group_advantages`` turns per-response rewards into GRPO group-relative advantages; ``GRPOLoss`` is
the PPO-clip surrogate with dual clip, corrector IS weights, k3 KL and an entropy bonus; ``TBPOLoss`` is
QaRL's sequence-level trust-band objective. Every loss subclasses ``PolicyLoss`` (one call signature).
"""

from __future__ import annotations

from ais_lightning.losses.advantages import ADVANTAGE_SCALES, group_advantages
from ais_lightning.losses.base import LossOutput, PolicyLoss
from ais_lightning.losses.grpo import (
    AGGREGATIONS,
    KL_RATIOS,
    MODES,
    GRPOLoss,
    aggregate,
    check_identity_weights,
    importance_ratio,
)
from ais_lightning.losses.tbpo import TBPOLoss, geometric_log_ratio

LOSSES: dict[str, type[PolicyLoss]] = {"grpo": GRPOLoss, "tbpo": TBPOLoss}
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
