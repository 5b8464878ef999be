"""Build rollout engines by name, and validate an engine config before any model is built.

Every engine class validates its own arguments in one classmethod, ``check_args(**kwargs)``
(:meth:`TorchRolloutEngine.check_args`, :meth:`VLLMRolloutEngine.check_args`,
:meth:`TERolloutEngine.check_args`), which its constructor calls too. This module only maps names
to classes: :func:`engine_class` imports an engine's module lazily (importing this module never
imports vLLM or Transformer Engine, and importing an engine module does not either), and
:func:`validate_engine_config` / :func:`build_engine` are thin users of ``check_args``.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from ais_lightning.rollout.base import RolloutEngine

ENGINES = ("torch", "vllm", "te", "diffusion")
"""Engine names ``build_engine`` knows."""

_ENGINE_CLASSES = {
    "torch": ("ais_lightning.rollout.torch_engine", "TorchRolloutEngine"),
    "vllm": ("ais_lightning.rollout.vllm_engine", "VLLMRolloutEngine"),
    "te": ("ais_lightning.rollout.te_engine", "TERolloutEngine"),
    "diffusion": ("ais_lightning.rollout.diffusion_engine", "DiffusionRolloutEngine"),
}


def engine_class(name: str) -> type:
    """The engine class registered as ``name`` (its module imported on first use); ValueError if unknown."""
    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; known: {list(ENGINES)}")
    module_name, class_name = _ENGINE_CLASSES[name]
    return getattr(importlib.import_module(module_name), class_name)


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
    """Validate, lazily import and construct engine ``name`` (``torch`` | ``vllm`` | ``te``).

    ``kwargs`` go to the engine's constructor (e.g. ``precision``, ``kv_cache_dtype``).
    """
    validate_engine_config(name, **kwargs)
    return engine_class(name)(model, **kwargs)
