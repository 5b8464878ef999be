"""Rollout engines: the RolloutEngine base class, the torch, vLLM and TE engines, the engine factory.

``VLLMRolloutEngine`` is exported lazily: ``from ais_lightning.rollout import VLLMRolloutEngine``
imports ``ais_lightning.rollout.vllm_engine`` on first access (module ``__getattr__``, PEP 562), and
vLLM itself only when an engine is constructed. ``TERolloutEngine`` imports Transformer Engine only
when constructed. Importing this package imports neither. Build engines by name with
:func:`build_engine`; check their arguments before any model exists with ``EngineClass.check_args``
or :func:`validate_engine_config`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ais_lightning.rollout.base import RolloutBatch, RolloutEngine, SamplingConfig
from ais_lightning.rollout.factory import (
    ENGINES,
    EngineSpec,
    build_engine,
    engine_class,
    engine_class_of,
    engine_precisions,
    validate_engine_config,
)
from ais_lightning.rollout.sampling import draw_next, sample_next, sampling_logprobs, truncation_mask
from ais_lightning.rollout.support import SamplingSupport
from ais_lightning.rollout.te_engine import TERolloutEngine
from ais_lightning.rollout.torch_engine import PRECISIONS, TorchRolloutEngine

if TYPE_CHECKING:
    from ais_lightning.rollout.vllm_engine import VLLMRolloutEngine

_LAZY = {"VLLMRolloutEngine": "ais_lightning.rollout.vllm_engine"}
"""Exported names whose module is imported on first access."""

__all__ = [
    "ENGINES",
    "PRECISIONS",
    "EngineSpec",
    "RolloutBatch",
    "RolloutEngine",
    "SamplingConfig",
    "SamplingSupport",
    "TERolloutEngine",
    "TorchRolloutEngine",
    "VLLMRolloutEngine",
    "build_engine",
    "draw_next",
    "engine_class",
    "engine_class_of",
    "engine_precisions",
    "sample_next",
    "sampling_logprobs",
    "truncation_mask",
    "validate_engine_config",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
