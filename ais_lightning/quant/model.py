"""Quantizing a whole model: every ``nn.Linear`` a :class:`~ais_lightning.quant.linear.QuantLinear`, every fused
mixture-of-experts module a :class:`~ais_lightning.quant.experts.QuantExperts`; what cannot be quantized, named;
refreshing the quantized caches and switching the recipe of every quantized layer in place."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .experts import (
    QuantExperts,
    fused_experts_unsupported,
    is_fused_experts,
    named_quantized_layers,
    quantized_layers,
)
from .linear import QuantLinear
from .recipes import QuantRecipe, get_recipe

DEFAULT_SKIP = ("embed", "lm_head", "norm")
"""Module-name substrings kept in high precision by :func:`quantize_model` when ``skip=None``."""


def quantize_model(
    model: nn.Module, recipe: str | QuantRecipe, backend: str = "emulate", skip: Iterable[str] | None = None
) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by a :class:`QuantLinear`; returns ``model``.

    ``skip``: module-name substrings to keep in high precision; None means :data:`DEFAULT_SKIP`
    (embeddings, ``lm_head`` and norms, the usual FP8 rollout practice, e.g. FP8-RL arXiv 2601.18150);
    ``[]`` quantizes every linear. Layers that are already QuantLinear are left alone.

    Fused mixture-of-experts modules (3-D ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``, e.g. Qwen3-MoE's
    experts) are replaced by :class:`~ais_lightning.quant.experts.QuantExperts` (each expert's matrices as
    QuantLinear layers; inference only: their weights must not require grad). Other matrix weights that are not
    ``nn.Linear`` layers (GPT-2's ``Conv1D``, experts of another layout) cannot be quantized here; rather than
    leave them silently in high precision, a model with any outside ``skip`` raises ValueError naming one (and
    changes nothing).
    """
    if isinstance(skip, str):
        raise ValueError(f"skip must be a list of name substrings, not a single string {skip!r}")
    skip = DEFAULT_SKIP if skip is None else tuple(skip)
    recipe = get_recipe(recipe)
    if isinstance(model, nn.Linear):
        raise ValueError("model is itself an nn.Linear; use QuantLinear.from_linear for a single layer")
    check_quantizable(model, recipe, skip)
    targets = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and not isinstance(module, QuantLinear)
        and not any(s in name for s in skip)
    ]
    experts = [
        name
        for name, module in model.named_modules()
        if name
        and is_fused_experts(module)
        and fused_experts_unsupported(module) is None
        and not any(s in name for s in skip)
    ]
    for name in experts:
        module = model.get_submodule(name)
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            raise ValueError(
                f"quantize_model: the fused experts {name} ({type(module).__name__}) require grad; quantized experts "
                "(QuantExperts) are for inference only (rollout engines): call model.requires_grad_(False) first. "
                "A mixture-of-experts trainer cannot run an aligned (QaRL) quantized forward"
            )
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantLinear.from_linear(getattr(parent, child), recipe, backend))
    for name in experts:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantExperts(getattr(parent, child), recipe, backend))
    return model


def unquantizable_weights(model: nn.Module, skip: Iterable[str] = ()) -> list[tuple[str, torch.Size]]:
    """``(name, shape)`` of matrix weights in ``model`` that :func:`quantize_model` cannot quantize.

    Weights of Hugging Face ``Conv1D`` layers (GPT-2's linears, ``[in, out]``) and parameters of three or
    more dimensions outside ``nn.Linear``, torch convolution layers and the fused experts
    :class:`~ais_lightning.quant.experts.QuantExperts` runs (fused expert weights of another layout), except where
    the module or parameter name contains a ``skip`` substring.
    """
    found = []
    for module_name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd, QuantExperts)) or any(
            s in module_name for s in skip
        ):
            continue  # torch convolutions (e.g. a Mamba mixer's conv1d) are not matrix weights
        if is_fused_experts(module) and fused_experts_unsupported(module) is None:
            continue  # quantize_model replaces it by QuantExperts
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if any(s in full for s in skip):
                continue
            conv1d = type(module).__name__ == "Conv1D" and param_name == "weight"
            if conv1d or param.dim() >= 3:
                found.append((full, param.shape))
    return found


def check_quantizable(model: nn.Module, recipe: str | QuantRecipe, skip: Iterable[str] | None = None) -> None:
    """ValueError naming a matrix weight of ``model`` that :func:`quantize_model` would leave in high
    precision (:func:`unquantizable_weights`; ``skip`` as in :func:`quantize_model`)."""
    left = unquantizable_weights(model, DEFAULT_SKIP if skip is None else tuple(skip))
    if left:
        name, shape = left[0]
        raise ValueError(
            f"quantize_model quantizes nn.Linear layers; {len(left)} matrix weights of {type(model).__name__} are "
            f"not, e.g. {name} {list(shape)}, and would stay in high precision under recipe "
            f"{get_recipe(recipe).name!r}. Pass skip= with their names to keep them in high precision knowingly; "
            "quantized rollouts of such models (GPT-2's Conv1D, mixture-of-experts blocks of another layout) run "
            "in vLLM (engine 'vllm')"
        )


def refresh_quantized(model: nn.Module) -> int:
    """Call :meth:`QuantLinear.refresh` on every QuantLinear in ``model`` (those of quantized experts too); returns
    how many were refreshed."""
    layers = quantized_layers(model)
    for layer in layers:
        layer.refresh()
    return len(layers)


def switch_recipe(
    model: nn.Module,
    recipe: str | QuantRecipe,
    backend: str | None = None,
    names: Iterable[str] | None = None,
) -> int:
    """Switch the :class:`QuantLinear` layers of ``model`` to ``recipe`` in place; returns how many.

    The fp32 master weights (``weight``/``bias`` Parameters, the state dict, optimizer state) are
    untouched; only the quantized caches are re-derived, so a trainer can lower the precision mid-run
    (:class:`ais_lightning.quant.schedule.PrecisionSchedule`). ``backend``: None keeps each layer's.
    ``names``: module-name substrings selecting the layers to switch (None = all), e.g. one decoder
    block at a time. Every layer is checked before any is switched: an incompatible recipe/backend
    raises ValueError and leaves the model unchanged.
    """
    if isinstance(names, str):
        raise ValueError(f"names must be a list of name substrings, not a single string {names!r}")
    recipe = get_recipe(recipe)
    selected = tuple(names) if names is not None else None
    layers = [
        m for n, m in named_quantized_layers(model) if selected is None or any(s in n for s in selected)
    ]
    for layer in layers:
        layer._check_backend(recipe, layer.backend if backend is None else backend)
    for layer in layers:
        layer.set_recipe(recipe, backend)
    return len(layers)
