"""A Hugging Face causal LM made ready for RL training: dropout off, activation checkpointing on request.

:class:`ais_lightning.policy.Policy` calls both at construction (``disable_dropout=True`` by default,
``gradient_checkpointing=False``); they are plain functions on the model for use without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["disable_dropout_in", "enable_activation_checkpointing"]


def disable_dropout_in(model: nn.Module) -> int:
    """Set every dropout probability of ``model`` to 0, in place; returns how many were nonzero.

    ``nn.Dropout`` modules (GPT-2, OPT, ...), the float attributes Hugging Face modules read in training
    mode (``attention_dropout`` in Llama, Qwen, Phi-3; ``attn_dropout`` in GPTBigCode; any float attribute
    whose name contains ``drop``) and the config's (``config.attention_dropout``, read directly by some
    attention functions).
    """
    changed = 0
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            changed += module.p != 0
            module.p = 0.0
            continue
        config = getattr(module, "config", None)
        for owner in (module, config) if config is not None else (module,):
            for name, value in list(vars(owner).items()):
                if "drop" in name and isinstance(value, float) and not isinstance(value, bool) and value != 0:
                    setattr(owner, name, 0.0)
                    changed += 1
    return changed


def enable_activation_checkpointing(model: nn.Module, context_fn: Callable[[], Any] | None = None) -> None:
    """Hugging Face's activation checkpointing on every decoder layer of ``model``, non-reentrant.

    In training mode each layer keeps only its input and recomputes the rest in backward (what TRL's
    ``gradient_checkpointing`` and verl's ``enable_gradient_checkpointing`` turn on); parameter names and
    values are unchanged, so weight sync, checkpoints and FSDP2 sharding see the same model. ValueError
    for a model whose class does not support it. ``context_fn``: torch's non-reentrant checkpoint hook, called at
    each checkpointed forward and returning ``(forward context, recompute context)``, e.g. to recompute a layer
    under the routing replay of its forward (:meth:`ais_lightning.models.routing.RoutingReplay.checkpoint_contexts`).
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"gradient_checkpointing: {type(model).__name__} does not support Hugging Face activation "
            "checkpointing (supports_gradient_checkpointing is not True)"
        )
    kwargs: dict[str, Any] = {"use_reentrant": False}  # composes with FSDP2 and with inputs that need no grad
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
