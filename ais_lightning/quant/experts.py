"""Quantized mixture-of-experts weights: each expert of a fused Hugging Face experts module as QuantLinear layers.

transformers (>= 5) keeps a mixture-of-experts block's experts fused in 3-D parameters, e.g. Qwen3-MoE's
``Qwen3MoeExperts``: ``gate_up_proj [E, 2 I, H]`` (each expert's gate rows, then its up rows) and
``down_proj [E, H, I]``, called as ``experts(hidden [N, H], top_k_index [N, k], top_k_weights [N, k])``.
:class:`QuantExperts` replaces such a module in a rollout engine's private model: it keeps the same two
parameters (state-dict names unchanged, so a weight sync copies into them as before) and runs expert ``e``
as two :class:`~ais_lightning.quant.QuantLinear` layers over views of ``gate_up_proj[e]`` and
``down_proj[e]``, so every recipe, backend and outlier-channel calibration of the dense path applies to each
expert unchanged:

    y_n = sum_j w_nj * down_e( act(gate_e(x_n)) * up_e(x_n) ),   e = top_k_index[n, j]

with ``[gate_e | up_e] = QuantLinear(gate_up_proj[e])`` and ``down_e = QuantLinear(down_proj[e])``: the weight
quantized per expert with the recipe's weight scaling (int8: per output channel of that expert; fp8: its own
128x128 blocks; nvfp4: 16-element groups and a per-tensor scale of that expert's matrix), the activation
quantized dynamically per token as the dense path does (recipes with a per-tensor activation scale, fp8_tensor
and nvfp4's second level, take it over the tokens routed to that expert: what a grouped GEMM's per-expert
problem sees). The router (``mlp.gate``, a 2-D weight, not a linear layer) stays in the model dtype, as in
vLLM's FP8/FP4 MoE paths. Inference only: the expert weights are views without gradients
(:func:`~ais_lightning.quant.model.quantize_model` refuses fused experts whose weights require grad).

The per-expert layers are not registered submodules (their weights are views of the fused parameters, which
the state dict already holds); :func:`quantized_layers` lists them with every other QuantLinear of a model,
which is what weight syncs re-quantize and outlier calibrations observe.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from .linear import QuantLinear
from .recipes import QuantRecipe, get_recipe

__all__ = [
    "QuantExperts",
    "fused_experts_unsupported",
    "is_fused_experts",
    "named_quantized_layers",
    "quantized_layers",
]

_LAYOUT_FLAGS = {
    "is_transposed": False,
    "has_bias": False,
    "has_gate": True,
    "is_concatenated": True,
    "has_post_expert_norm": False,
}
"""Flags transformers' ``use_experts_implementation`` sets on fused experts modules, and the values of the layout
:class:`QuantExperts` implements (``[gate; up]`` concatenated, ``[out, in]`` per expert, no bias, no norm)."""


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds fused 3-D expert weights ``gate_up_proj`` / ``down_proj`` (supported or not)."""
    params = dict(module.named_parameters(recurse=False))
    return any(name in params and params[name].dim() == 3 for name in ("gate_up_proj", "down_proj"))


def fused_experts_unsupported(module: nn.Module) -> str | None:
    """Why :class:`QuantExperts` cannot run ``module`` exactly, or None when it can.

    It must have ``gate_up_proj [E, 2 I, H]``, ``down_proj [E, H, I]`` and ``act_fn``, and transformers' layout
    flags (where present) must be those of :data:`_LAYOUT_FLAGS`.
    """
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return "it has no gate_up_proj / down_proj tensors"
    if gate_up.dim() != 3 or down.dim() != 3:
        return f"gate_up_proj {list(gate_up.shape)} and down_proj {list(down.shape)} must be 3-D [experts, out, in]"
    e, two_i, h = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (e, h, two_i // 2):
        return f"gate_up_proj {list(gate_up.shape)} and down_proj {list(down.shape)} are not [E, 2I, H] and [E, H, I]"
    if not callable(getattr(module, "act_fn", None)):
        return "it has no act_fn"
    for flag, value in _LAYOUT_FLAGS.items():
        if getattr(module, flag, value) != value:
            return f"{flag}={getattr(module, flag)!r} (QuantExperts runs {flag}={value!r})"
    return None


class QuantExperts(nn.Module):
    """Fused experts (``gate_up_proj [E, 2 I, H]``, ``down_proj [E, H, I]``) run as per-expert QuantLinear layers.

    Built from the fused module (:func:`fused_experts_unsupported` must be None); shares its parameter objects.
    ``forward(hidden [N, H], top_k_index [N, k], top_k_weights [N, k]) -> [N, H]`` like Hugging Face's eager
    loop (experts in ascending order, each on the tokens routed to it). See the module docstring.

    Example:
        >>> import torch
        >>> from ais_lightning.models import build_tiny_qwen3_moe
        >>> from ais_lightning.quant import QuantExperts
        >>> block = build_tiny_qwen3_moe().model.layers[0].mlp
        >>> block.experts.requires_grad_(False)  # doctest: +ELLIPSIS
        Qwen3MoeExperts(...)
        >>> block.experts = QuantExperts(block.experts, "int8", "emulate")
        >>> len(block.experts.layers()), block(torch.randn(1, 3, 128)).shape
        (16, torch.Size([1, 3, 128]))
    """

    def __init__(self, experts: nn.Module, recipe: str | QuantRecipe, backend: str = "emulate") -> None:
        super().__init__()
        reason = fused_experts_unsupported(experts)
        if reason is not None:
            raise ValueError(f"QuantExperts cannot run {type(experts).__name__}: {reason}")
        if experts.gate_up_proj.requires_grad or experts.down_proj.requires_grad:
            raise ValueError(
                f"QuantExperts quantizes fused experts for inference (rollout engines): {type(experts).__name__}'s "
                "gate_up_proj / down_proj require grad, and the per-expert quantized views would not pass gradients "
                "to them; call requires_grad_(False) on the model first"
            )
        self.gate_up_proj = experts.gate_up_proj  # [E, 2I, H], the same Parameter
        self.down_proj = experts.down_proj  # [E, H, I]
        self.act_fn = experts.act_fn
        self.num_experts = int(self.gate_up_proj.shape[0])
        self.wrapped_class = type(experts).__name__
        self._bind(get_recipe(recipe), backend, channels=None)

    def _bind(self, recipe: QuantRecipe, backend: str, channels: list[torch.Tensor | None] | None) -> None:
        """(Re)build the per-expert layers over views of the current fused parameters (after a device move too);
        ``channels``: each layer's outlier channels to keep (None: none)."""

        def linear(weight: torch.Tensor) -> QuantLinear:
            out_features, in_features = weight.shape
            plain = nn.Linear(in_features, out_features, bias=False, device="meta")
            plain.weight = nn.Parameter(
                weight.detach(), requires_grad=False
            )  # a view: shares storage and version
            return QuantLinear.from_linear(plain, recipe, backend)

        self.gate_up = [linear(self.gate_up_proj[e]) for e in range(self.num_experts)]  # [2I, H] each
        self.down = [linear(self.down_proj[e]) for e in range(self.num_experts)]  # [H, I] each
        if channels is not None:
            for layer, kept in zip(self.layers(), channels):
                layer.set_outlier_channels(kept)

    def layers(self) -> list[QuantLinear]:
        """Every per-expert layer: the E gate/up layers, then the E down layers."""
        return [*self.gate_up, *self.down]

    @property
    def recipe(self) -> QuantRecipe:
        return self.gate_up[0].recipe

    @property
    def backend(self) -> str:
        return self.gate_up[0].backend

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - nn.Module's signature
        out = super()._apply(fn, recurse)
        channels = [layer.outlier_channels for layer in self.layers()]  # moved by set_outlier_channels
        self._bind(self.recipe, self.backend, channels)  # the views must follow the moved parameters
        return out

    def __getstate__(self) -> dict:
        """Copies and pickles keep the fused parameters only; the per-expert views are rebuilt over the copy's."""
        state = dict(super().__getstate__())
        layers = state.pop("gate_up") + state.pop("down")
        state["_layer_setup"] = (
            layers[0].recipe,
            layers[0].backend,
            [layer.outlier_channels for layer in layers],
        )
        return state

    def __setstate__(self, state: dict) -> None:
        recipe, backend, channels = state.pop("_layer_setup")
        super().__setstate__(state)
        self._bind(recipe, backend, channels)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """``hidden_states [N, H]``, ``top_k_index [N, k]`` (expert ids), ``top_k_weights [N, k]`` -> ``[N, H]``."""
        out = torch.zeros_like(hidden_states)  # [N, H]
        routed = top_k_index.t()  # [k, N]
        for e in torch.unique(top_k_index).tolist():
            if not 0 <= e < self.num_experts:
                continue  # transformers marks dropped tokens with the id num_experts
            pos, token = torch.where(routed == e)  # [n_e] each, ordered by (pos, token) as in transformers
            gate, up = self.gate_up[e](hidden_states[token]).chunk(2, dim=-1)  # [n_e, I] each
            y = self.down[e](self.act_fn(gate) * up)  # [n_e, H]
            y = y * top_k_weights[token, pos, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def extra_repr(self) -> str:
        e, two_i, h = self.gate_up_proj.shape
        return (
            f"experts={e}, hidden={h}, intermediate={two_i // 2}, recipe={self.recipe.name}, backend={self.backend}, "
            f"replaces={self.wrapped_class}"
        )


def named_quantized_layers(model: nn.Module) -> Iterator[tuple[str, QuantLinear]]:
    """``(module name, layer)`` of every QuantLinear in ``model``, those inside :class:`QuantExperts` included
    (named after their QuantExperts module), in module order."""
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            yield name, module
        elif isinstance(module, QuantExperts):
            for layer in module.layers():
                yield name, layer


def quantized_layers(model: nn.Module) -> list[QuantLinear]:
    """Every QuantLinear :func:`named_quantized_layers` finds: what a weight sync re-quantizes."""
    return [layer for _, layer in named_quantized_layers(model)]
