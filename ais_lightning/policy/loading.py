"""Causal LMs for a policy: loaded from a local directory (never the hub), or a fresh copy of one's config."""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

__all__ = ["fresh_causal_lm", "load_causal_lm"]


def load_causal_lm(
    path: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    **model_kwargs,
) -> nn.Module:
    """``AutoModelForCausalLM`` from a *local* directory ``path`` (ValueError otherwise), in ``dtype``.
    ``attn_implementation`` None lets transformers pick; ``model_kwargs`` go to ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"path must be a local model directory, got {path!r}")
    if attn_implementation is not None:
        model_kwargs["attn_implementation"] = attn_implementation
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, **model_kwargs)


def fresh_causal_lm(model: nn.Module) -> nn.Module:
    """A new, unsharded CPU model of ``model``'s config, dtype and attention implementation, its weights
    freshly initialized. Works while ``model`` is sharded."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return AutoModelForCausalLM.from_config(
        config, dtype=dtype, attn_implementation=config._attn_implementation
    )
