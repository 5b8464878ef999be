"""LightningModules that only orchestrate: GRPO on low-precision rollouts (``GRPOModule`` with its
``GRPOSettings``), Sol-RL (``SolRLModule``, ``SolRLSettings``), and the SFT warm start's ``SFTModule``; what a
rollout step hands the update (``Experience``) and fp16 training on fp32 master weights
(``MasterWeightOptimizer``, ``DynamicLossScale``)."""

from ais_lightning.modules.experience import Experience
from ais_lightning.modules.grpo import GRPOModule
from ais_lightning.modules.grpo_settings import GRPOSettings
from ais_lightning.modules.mixed_precision import DynamicLossScale, MasterWeightOptimizer
from ais_lightning.modules.sft import SFTModule
from ais_lightning.modules.solrl import SolRLModule, SolRLSettings

__all__ = [
    "DynamicLossScale",
    "Experience",
    "GRPOModule",
    "GRPOSettings",
    "MasterWeightOptimizer",
    "SFTModule",
    "SolRLModule",
    "SolRLSettings",
]
