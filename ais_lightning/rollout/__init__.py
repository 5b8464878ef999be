"""Rollout engines: the RolloutEngine protocol, the torch engine, the engine factory.

``VLLMRolloutEngine`` (``ais_lightning.rollout.vllm_engine``) and ``TERolloutEngine``
(``ais_lightning.rollout.te_engine``) import their heavy packages lazily; build engines by name with
:func:`build_engine`.
"""

from ais_lightning.rollout.base import RolloutBatch, RolloutEngine, SamplingConfig
from ais_lightning.rollout.factory import ENGINES, build_engine, engine_precisions, validate_engine_config
from ais_lightning.rollout.sampling import sample_next, sampling_logprobs, truncation_mask
from ais_lightning.rollout.te_engine import TERolloutEngine
from ais_lightning.rollout.torch_engine import PRECISIONS, TorchRolloutEngine

__all__ = [
    "ENGINES",
    "PRECISIONS",
    "RolloutBatch",
    "RolloutEngine",
    "SamplingConfig",
    "TERolloutEngine",
    "TorchRolloutEngine",
    "build_engine",
    "engine_precisions",
    "sample_next",
    "sampling_logprobs",
    "truncation_mask",
    "validate_engine_config",
]
