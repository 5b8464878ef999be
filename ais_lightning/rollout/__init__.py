"""Rollout engines: the RolloutEngine base class, the torch, vLLM, Transformer Engine and LLaDA engines, the registry.

Importing this package imports neither vLLM nor Transformer Engine: each engine imports its package only when
it is constructed. Build engines by name with :func:`build_engine`; check their arguments before any model exists
with ``EngineClass.check_args`` or :func:`validate_engine_config`; an engine to build later from a model is an
:class:`EngineSpec`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ais_lightning.checks import registered
from ais_lightning.rollout.base import RolloutBatch, RolloutEngine, SamplingConfig
from ais_lightning.rollout.diffusion_engine import DiffusionRolloutEngine
from ais_lightning.rollout.factory import EngineSpec, engine_class_of
from ais_lightning.rollout.sampling import draw_next, sample_next, sampling_logprobs, truncation_mask
from ais_lightning.rollout.support import SamplingSupport
from ais_lightning.rollout.te_engine import TERolloutEngine
from ais_lightning.rollout.torch_engine import PRECISIONS, TorchRolloutEngine
from ais_lightning.rollout.vllm_engine import VLLMRolloutEngine

ENGINES: dict[str, type[RolloutEngine]] = {
    "torch": TorchRolloutEngine,
    "vllm": VLLMRolloutEngine,
    "te": TERolloutEngine,
    "diffusion": DiffusionRolloutEngine,
}
"""The registry of rollout engines: config name -> class (:func:`build_engine`; ``ais-train`` generates the schema
``schema/rollout/<name>`` of each; docs/design.md, "Adding an engine")."""


def engine_class(name: str) -> type[RolloutEngine]:
    """The engine class registered as ``name``; ValueError if unknown."""
    return registered(ENGINES, name, "rollout engine")


def engine_precisions(name: str) -> tuple[str, ...]:
    """Precisions engine ``name`` accepts (its class's ``PRECISIONS``; ValueError for an unknown engine)."""
    return tuple(engine_class(name).PRECISIONS)


def validate_engine_config(name: str, precision: str | None = None, **kwargs: Any) -> dict[str, Any]:
    """Raise ValueError now for a config that cannot build an engine later; return the checked arguments.

    ``name`` must be a known engine; ``precision`` (None: the engine's default) and ``kwargs`` are the
    engine's constructor arguments, checked by its ``check_args``: values it does not run, unknown
    argument names, and a package (vLLM, Transformer Engine) or device (CUDA for ``te``) it needs
    but this machine lacks, with the pip extra to install.
    """
    if precision is not None:
        kwargs = {**kwargs, "precision": precision}
    return engine_class(name).check_args(**kwargs)


def build_engine(name: str, model: nn.Module, **kwargs: Any) -> RolloutEngine:
    """Validate and construct engine ``name`` (``torch`` | ``vllm`` | ``te`` | ``diffusion``).

    ``kwargs`` go to the engine's constructor (e.g. ``precision``, ``kv_cache_dtype``).
    """
    validate_engine_config(name, **kwargs)
    return engine_class(name)(model, **kwargs)


__all__ = [
    "ENGINES",
    "PRECISIONS",
    "DiffusionRolloutEngine",
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
