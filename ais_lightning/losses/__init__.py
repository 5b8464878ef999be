"""Policy-gradient losses and advantages (pure torch, no Lightning import).

``group_advantages`` turns per-response rewards into GRPO group-relative advantages; ``GRPOLoss`` is
the PPO-clip surrogate with dual clip, corrector IS weights, k3 KL and an entropy bonus.
"""

from ais_lightning.losses.advantages import ADVANTAGE_SCALES, group_advantages
from ais_lightning.losses.grpo import AGGREGATIONS, MODES, GRPOLoss, LossOutput, aggregate
from ais_lightning.losses.tbpo import TBPOLoss, geometric_log_ratio

__all__ = [
    "ADVANTAGE_SCALES",
    "AGGREGATIONS",
    "MODES",
    "GRPOLoss",
    "LossOutput",
    "TBPOLoss",
    "aggregate",
    "geometric_log_ratio",
    "group_advantages",
]
