"""FP8 rollouts on CUDA with NVIDIA Transformer Engine (TE).

``TERolloutEngine`` is the torch engine's sampler (same prefill/decode loop, cache, sampling and
log-prob conventions) over a copy of the model whose ``nn.Linear`` layers are replaced by
``transformer_engine.pytorch.Linear`` and whose forwards run under TE's FP8 autocast with a
``DelayedScaling`` recipe (per-tensor scales from an amax history; Micikevicius et al. 2022,
"FP8 Formats for Deep Learning"). ``te.autocast(enabled=True, recipe=...)`` is used where TE has it
(TE >= 2.8), otherwise ``te.fp8_autocast(enabled=True, fp8_recipe=...)``.

Kept in high precision: ``lm_head`` (FP8-RL arXiv 2601.18150 practice) and any linear whose
in/out features are not divisible by 16 (TE's FP8 GEMM constraint). TE also needs the flattened
token count divisible by 8: the swapped linears zero-pad the token dimension to a multiple of 16
and slice the output, so any decode batch size works.

Needs a CUDA GPU with FP8 support (Ada/Hopper or newer) and ``pip install 'ais-lightning[te]'``.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import torch
from torch import nn

from ais_lightning.rollout.torch_engine import TorchRolloutEngine

TE_INSTALL_HINT = "pip install 'ais-lightning[te]'"
TE_PRECISIONS = ("fp8",)
"""Precisions TERolloutEngine runs."""
_TE_SKIP = ("lm_head",)


def import_transformer_engine() -> Any:
    """Import ``transformer_engine.pytorch``, or raise ImportError saying what to install."""
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except ImportError as err:
        raise ImportError(f"TERolloutEngine needs Transformer Engine: {TE_INSTALL_HINT} ({err})") from err


def _padded_linear_class(te: Any) -> type:
    class PaddedTELinear(te.Linear):
        """``te.Linear`` that zero-pads the token dimension to a multiple of 16 (FP8 GEMM shapes)."""

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            lead, k = x.shape[:-1], x.shape[-1]
            x2d = x.reshape(-1, k)  # [M, K]
            m = x2d.shape[0]
            pad = (-m) % 16
            if pad:
                x2d = torch.cat([x2d, x2d.new_zeros(pad, k)], dim=0)  # [M + pad, K]
            y = super().forward(x2d, *args, **kwargs)  # [M + pad, N]
            return y[:m].reshape(*lead, y.shape[-1])

    return PaddedTELinear


def swap_linears_for_te(model: nn.Module, params_dtype: torch.dtype, device: torch.device | str) -> int:
    """Replace eligible ``nn.Linear`` layers of ``model`` in place by TE linears (weights copied).

    Returns how many were swapped. Names and therefore ``state_dict`` keys (``weight``/``bias``)
    are kept, so ``load_state_dict`` weight sync works unchanged.
    """
    te = import_transformer_engine()
    cls = _padded_linear_class(te)
    targets = [
        name
        for name, mod in model.named_modules()
        if type(mod) is nn.Linear
        and not any(s in name for s in _TE_SKIP)
        and mod.in_features % 16 == 0
        and mod.out_features % 16 == 0
    ]
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        new = cls(
            old.in_features,
            old.out_features,
            bias=old.bias is not None,
            params_dtype=params_dtype,
            device=device,
        )
        with torch.no_grad():
            new.weight.copy_(old.weight)
            if old.bias is not None:
                new.bias.copy_(old.bias)
        setattr(parent, child, new)
    return len(targets)


class TERolloutEngine(TorchRolloutEngine):
    """Torch-engine sampler with Transformer Engine FP8 linears (CUDA only).

    Args:
        model: a Llama-family Hugging Face causal LM (see ``TorchRolloutEngine``); deep-copied.
        precision: only ``"fp8"``.
        kv_cache_dtype: None or ``"fp8"`` (fake-quantized E4M3 cache, as in the torch engine).
        fp8_format: ``"E4M3"`` (inference: all FP8 tensors E4M3) or ``"HYBRID"``.
        amax_history_len: DelayedScaling amax history length.
        margin: DelayedScaling margin (scale = fp8_max / amax / 2**margin).
        params_dtype: dtype of the high-precision weights and activations (bf16 by default).
        device: CUDA device.
    """

    def __init__(
        self,
        model: nn.Module,
        precision: str = "fp8",
        kv_cache_dtype: str | None = None,
        *,
        fp8_format: str = "E4M3",
        amax_history_len: int = 16,
        margin: int = 0,
        params_dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cuda",
        pad_token_id: int | None = None,
        compact_below: float = 0.5,
    ) -> None:
        if precision not in TE_PRECISIONS:
            raise ValueError(f"TERolloutEngine precision must be one of {TE_PRECISIONS}, got {precision!r}")
        if fp8_format not in ("E4M3", "HYBRID"):
            raise ValueError(f"fp8_format must be 'E4M3' or 'HYBRID', got {fp8_format!r}")
        if amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {amax_history_len}")
        if not torch.cuda.is_available():
            raise RuntimeError(
                "TERolloutEngine needs a CUDA GPU (Transformer Engine FP8 kernels); none is available. "
                "On CPU use TorchRolloutEngine(model, precision='fp8') for emulated FP8 numerics."
            )
        self._te = import_transformer_engine()
        recipe = importlib.import_module("transformer_engine.common.recipe")
        self._recipe = recipe.DelayedScaling(
            margin=margin,
            fp8_format=getattr(recipe.Format, fp8_format),
            amax_history_len=amax_history_len,
            amax_compute_algo="max",
        )
        self._params_dtype = params_dtype
        self._te_device = torch.device(device)
        super().__init__(
            model,
            precision="fp8",
            kv_cache_dtype=kv_cache_dtype,
            pad_token_id=pad_token_id,
            compact_below=compact_below,
        )
        self.backend = "transformer_engine"

    def _prepare_model(self) -> None:
        self.model.to(device=self._te_device, dtype=self._params_dtype)
        self.num_te_linears = swap_linears_for_te(self.model, self._params_dtype, self._te_device)

    def _after_sync(self) -> None:
        """TE casts weights to FP8 inside every autocast forward: nothing cached to refresh."""

    def forward_context(self) -> contextlib.AbstractContextManager:
        te = self._te
        if hasattr(te, "autocast"):
            return te.autocast(enabled=True, recipe=self._recipe)
        return te.fp8_autocast(enabled=True, fp8_recipe=self._recipe)
