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
from typing import Any, ClassVar

import torch
from torch import nn

from ais_lightning.rollout.engine_args import bind_engine_args, check_choice, require_package
from ais_lightning.rollout.torch_engine import TorchRolloutEngine

TE_INSTALL_HINT = "pip install 'ais-lightning[te]'"
TE_PRECISIONS = ("fp8",)
"""Precisions TERolloutEngine runs."""
FP8_FORMATS = ("E4M3", "HYBRID")
"""``DelayedScaling`` formats: E4M3 everywhere (inference), or HYBRID (E4M3 forward, E5M2 gradients)."""
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
        kv_cache_dtype: None / ``"auto"`` or ``"fp8"`` (fake-quantized E4M3 cache, as in the torch engine).
        fp8_format: ``"E4M3"`` (inference: all FP8 tensors E4M3) or ``"HYBRID"``.
        amax_history_len: DelayedScaling amax history length.
        margin: DelayedScaling margin (scale = fp8_max / amax / 2**margin).
        params_dtype: dtype of the high-precision weights and activations (bf16 by default), or its name.
        device: CUDA device.

    Arguments are validated by :meth:`check_args` (which also needs CUDA and Transformer Engine).
    """

    PRECISIONS: ClassVar[tuple[str, ...]] = TE_PRECISIONS
    TRAINER_PRECISION_COPY: ClassVar[dict[str, Any] | None] = None
    """No fp32 copy: Transformer Engine runs fp8 only (validation reports the engine's precision)."""

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
        args = TERolloutEngine.check_args(
            precision=precision,
            kv_cache_dtype=kv_cache_dtype,
            fp8_format=fp8_format,
            amax_history_len=amax_history_len,
            margin=margin,
            params_dtype=params_dtype,
            device=device,
            pad_token_id=pad_token_id,
            compact_below=compact_below,
        )
        self._te = import_transformer_engine()
        recipe = importlib.import_module("transformer_engine.common.recipe")
        self._recipe = recipe.DelayedScaling(
            margin=args["margin"],
            fp8_format=getattr(recipe.Format, args["fp8_format"]),
            amax_history_len=args["amax_history_len"],
            amax_compute_algo="max",
        )
        self._params_dtype = args["params_dtype"]
        self._te_device = torch.device(args["device"])
        super().__init__(
            model,
            precision="fp8",
            kv_cache_dtype=args["kv_cache_dtype"],
            pad_token_id=pad_token_id,
            compact_below=compact_below,
        )
        self.backend = "transformer_engine"

    @classmethod
    def check_args(cls, **kwargs: Any) -> dict[str, Any]:
        """Validate constructor arguments (all but ``model``) without building anything.

        ValueError naming the argument for a value TE cannot run; then, since TE's FP8 kernels need
        both, when there is no CUDA GPU or Transformer Engine is not installed (with the pip extra to
        install). ``kv_cache_dtype`` and the sampler options follow :meth:`TorchRolloutEngine.check_args`.
        Returns the arguments with the constructor's defaults filled in.
        """
        name = "TERolloutEngine"
        args = bind_engine_args(TERolloutEngine, kwargs)
        check_choice(name, "precision", args["precision"], TE_PRECISIONS)
        check_choice(name, "fp8_format", args["fp8_format"], FP8_FORMATS)
        if isinstance(args["amax_history_len"], bool) or not isinstance(args["amax_history_len"], int):
            raise ValueError(
                f"amax_history_len must be an int >= 1 for {name}, got {args['amax_history_len']!r}"
            )
        if args["amax_history_len"] < 1:
            raise ValueError(f"amax_history_len must be >= 1 for {name}, got {args['amax_history_len']}")
        if isinstance(args["margin"], bool) or not isinstance(args["margin"], int) or args["margin"] < 0:
            raise ValueError(f"margin must be an int >= 0 for {name}, got {args['margin']!r}")
        dtype = args["params_dtype"]
        if isinstance(dtype, str):  # a config value such as "bfloat16"
            dtype = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(
                f"params_dtype must be a floating torch.dtype (or its name, e.g. 'bfloat16') for {name}, "
                f"got {args['params_dtype']!r}"
            )
        args["params_dtype"] = dtype
        try:
            device = torch.device(args["device"])
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"device must be a CUDA device for {name}, got {args['device']!r}") from err
        if device.type != "cuda":
            raise ValueError(f"device must be a CUDA device for {name}, got {args['device']!r}")
        sampler = TorchRolloutEngine.check_args(
            precision="fp8",
            kv_cache_dtype=args["kv_cache_dtype"],
            pad_token_id=args["pad_token_id"],
            compact_below=args["compact_below"],
        )
        args["kv_cache_dtype"] = sampler["kv_cache_dtype"]
        if not torch.cuda.is_available():
            raise ValueError(
                f"{name} needs a CUDA GPU (Transformer Engine FP8 kernels); none is available. "
                "On CPU use TorchRolloutEngine(model, precision='fp8') (engine 'torch') for emulated FP8 numerics."
            )
        require_package(name, "transformer_engine", "Transformer Engine", TE_INSTALL_HINT)
        return args

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
