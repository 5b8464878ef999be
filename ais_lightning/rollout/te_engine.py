"""FP8 rollouts on CUDA with NVIDIA Transformer Engine (TE).

``TERolloutEngine`` is the torch engine's sampler (same prefill/decode loop, cache, sampling and
log-prob conventions) over a copy of the model whose ``nn.Linear`` layers are replaced by
``transformer_engine.pytorch.Linear`` and whose forwards run under ``te.autocast(recipe=...)``.

Recipes: every one computes its scales *from the tensor being quantized, at every forward*, so they
hold under ``torch.inference_mode`` and follow each weight sync:

- ``"current"``: ``Float8CurrentScaling``, one scale per tensor from its current amax (compute
  capability >= 8.9: Ada, Hopper, Blackwell), with FP32 accumulation in the forward GEMM (TE's default for
  this recipe is the fast FP8 accumulation; :func:`make_te_recipe`).
- ``"block"``: ``Float8BlockScaling`` with 1x128 activation groups and 128x128 weight blocks: the
  blockwise ``fp8`` recipe that the torch engine emulates (DeepSeek-V3, arXiv 2412.19437; FP8-RL, arXiv
  2601.18150). TE rounds these scales to powers of 2 by default; the engine sets FP32 scales
  (``amax / 448``, ``QParams(power_2_scale=False)``) so the numerics match the emulated recipe. Needs
  compute capability >= 9.0 and CUDA >= 12.9 (TE ``_compute_fp8_block_scaling_support``).
- ``"mxfp8"``: ``MXFP8BlockScaling`` (OCP MX: 32-element blocks, E8M0 scales), compute capability
  10.x (TE ``_compute_mxfp8_support`` refuses 12.0+).

``DelayedScaling`` is not offered: its scales only change when ``autocast`` exits with grad enabled
(TE ``pytorch/quantization.py``, ``FP8GlobalStateManager.autocast_exit``), and generation runs under
``inference_mode``, so every scale would stay at its initial 1.0: weights of ~0.02 fall into E4M3
subnormals and activations above 448 clip, silently. Read against TransformerEngine 2.20.0.dev0
(``transformer_engine/common/recipe/__init__.py``, ``pytorch/quantization.py``); ``te.autocast`` first
ships in TE 2.9 (tag v2.9; 2.8 has only ``fp8_autocast``, in ``pytorch/fp8.py``), the version
:meth:`TERolloutEngine.check_args` requires and :func:`import_transformer_engine` checks.

Kept in high precision: ``lm_head`` (FP8-RL practice) and any linear whose in/out features are not
divisible by 16 (TE's FP8 GEMM constraint; 32 for MXFP8). TE also needs the flattened token count
divisible by 8 (16/32 here): the swapped linears zero-pad the token dimension and slice the output,
so any decode batch size works.

Needs a CUDA GPU with FP8 support and ``pip install 'ais-lightning[te]'``.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, ClassVar

import torch
from torch import nn

from ais_lightning.rollout.base import RolloutEngine
from ais_lightning.rollout.engine_args import (
    bind_engine_args,
    check_capability,
    check_choice,
    check_cuda_device_type,
    cuda_device,
    require_package,
    require_version,
)
from ais_lightning.rollout.torch_engine import TorchRolloutEngine

TE_INSTALL_HINT = "pip install --no-build-isolation 'ais-lightning[te]' (docs/gpu.md)"
TE_MIN_VERSION = (2, 9)
"""``te.autocast(recipe=...)`` (first in TE 2.9; 2.8 has only ``fp8_autocast``) and the current/block/MX recipes."""
TE_PRECISIONS = ("fp8",)
"""Precisions TERolloutEngine runs."""
FP8_FORMATS = ("E4M3", "HYBRID")
"""Recipe formats: E4M3 everywhere (inference), or HYBRID (E4M3 forward, E5M2 gradients)."""
TE_RECIPES = ("current", "block", "mxfp8")
"""Scaling recipes (module docstring); all compute their scales at inference."""
TE_RECIPE_REQUIREMENTS: dict[str, dict[str, Any]] = {
    "current": {"minimum": (8, 9)},
    "block": {"minimum": (9, 0), "cuda": (12, 9)},
    "mxfp8": {"minimum": (10, 0), "below": (12, 0)},
}
"""Compute capability (and CUDA) each recipe needs, as TE checks them in ``pytorch/quantization.py``
(``_compute_fp8_support``, ``_compute_fp8_block_scaling_support``, ``_compute_mxfp8_support``)."""
_ALIGN = {"current": 16, "block": 16, "mxfp8": 32}
"""Feature and token alignment of each recipe's GEMM (TE ``get_align_size_for_quantization``)."""
_TE_SKIP = ("lm_head",)


def import_transformer_engine() -> Any:
    """Import ``transformer_engine.pytorch``, or raise ImportError saying what to install.

    Also refuses a Transformer Engine without ``te.autocast`` (before 2.9), whatever its package metadata says
    (:meth:`TERolloutEngine.check_args` compares the metadata's version)."""
    try:
        te = importlib.import_module("transformer_engine.pytorch")
    except ImportError as err:
        raise ImportError(f"TERolloutEngine needs Transformer Engine: {TE_INSTALL_HINT} ({err})") from err
    if not hasattr(te, "autocast"):
        shown = ".".join(map(str, TE_MIN_VERSION))
        raise ImportError(
            f"TERolloutEngine needs Transformer Engine >= {shown} (te.autocast); the installed one has "
            f"{'only fp8_autocast' if hasattr(te, 'fp8_autocast') else 'no autocast'}: {TE_INSTALL_HINT}"
        )
    return te


def make_te_recipe(recipe: str, fp8_format: str) -> Any:
    """The Transformer Engine recipe object for ``recipe`` (``current`` | ``block`` | ``mxfp8``).

    Every recipe's forward GEMM accumulates in full FP32 (``fp8_gemm_fprop = MMParams(use_split_accumulator=True)``,
    which turns cuBLASLt's ``CUBLASLT_MATMUL_DESC_FAST_ACCUM`` off: TE ``common/gemm/cublaslt_gemm.cu``), as the
    emulated recipes and the ``fp8_gemm`` backend do. TE's ``Float8CurrentScaling`` defaults to
    ``fp8_gemm_fprop = MMParams(use_split_accumulator=False)``, Hopper's fast FP8 accumulation, which keeps fewer
    bits of the running sum (DeepSeek-V3, arXiv 2412.19437 section 3.3.2: errors near 2% at K = 4096), so the
    TE engine's mismatch would exceed what the emulation predicts. ``MXFP8BlockScaling`` has no such field and
    TE's linear then uses ``_2X_ACC_FPROP = False`` (``pytorch/module/base.py``, ``module/linear.py``); the engine
    sets the field on it too. ``Float8BlockScaling`` requires the split accumulator already. Read at TE 2.9 and
    2.20.0.dev0 (``common/recipe/__init__.py``).

    ``block`` gets FP32 scales (``power_2_scale=False``) for activations and weights, TE's default being
    power-of-2 scales (``Float8BlockScaling.use_f32_scales``); our emulated ``fp8`` recipe uses
    ``amax / 448``.
    """
    module = importlib.import_module("transformer_engine.common.recipe")
    fmt = getattr(module.Format, fp8_format)
    fp32_accumulation = module.MMParams(use_split_accumulator=True)
    if recipe == "current":
        return module.Float8CurrentScaling(fp8_format=fmt, fp8_gemm_fprop=fp32_accumulation)
    if recipe == "mxfp8":
        built = module.MXFP8BlockScaling(fp8_format=fmt)
        built.fp8_gemm_fprop = fp32_accumulation  # read by te.Linear's forward when the recipe has it
        return built
    built = module.Float8BlockScaling(fp8_format=fmt)
    fp32 = module.QParams(power_2_scale=False, amax_epsilon=0.0)
    built.fp8_quant_fwd_inp = fp32  # read per quantizer by Float8BlockScalingRecipeState.make_quantizers
    built.fp8_quant_fwd_weight = fp32
    return built


def _padded_linear_class(te: Any, align: int) -> type:
    class PaddedTELinear(te.Linear):
        """``te.Linear`` that zero-pads the token dimension to a multiple of ``align`` (FP8 GEMM shapes)."""

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            lead, k = x.shape[:-1], x.shape[-1]
            x2d = x.reshape(-1, k)  # [M, K]
            m = x2d.shape[0]
            pad = (-m) % align
            if pad:
                x2d = torch.cat([x2d, x2d.new_zeros(pad, k)], dim=0)  # [M + pad, K]
            y = super().forward(x2d, *args, **kwargs)  # [M + pad, N]
            return y[:m].reshape(*lead, y.shape[-1])

    return PaddedTELinear


def swap_linears_for_te(
    model: nn.Module, params_dtype: torch.dtype, device: torch.device | str, align: int = 16
) -> int:
    """Replace eligible ``nn.Linear`` layers of ``model`` in place by TE linears (weights copied).

    Eligible: not ``lm_head``, in/out features divisible by ``align``. Returns how many were swapped.
    Names and therefore ``state_dict`` keys (``weight``/``bias``) are kept, so weight sync works unchanged.
    """
    te = import_transformer_engine()
    cls = _padded_linear_class(te, align)
    targets = [
        name
        for name, mod in model.named_modules()
        if type(mod) is nn.Linear
        and not any(s in name for s in _TE_SKIP)
        and mod.in_features % align == 0
        and mod.out_features % align == 0
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
        model: a Hugging Face causal LM (see ``TorchRolloutEngine``: the lean forward for the Llama
            family, the model's own forward otherwise); deep-copied.
        precision: only ``"fp8"``.
        kv_cache_dtype: None / ``"auto"`` or ``"fp8"`` (fake-quantized E4M3 cache, as in the torch engine).
        recipe: ``"current"`` (per-tensor current scaling), ``"block"`` (1x128 x 128x128 blocks, the
            ``fp8`` recipe) or ``"mxfp8"``; see the module docstring for what each needs.
        fp8_format: ``"E4M3"`` (inference: all FP8 tensors E4M3) or ``"HYBRID"``.
        params_dtype: dtype of the high-precision weights and activations (bf16 by default), or its name.
        device: CUDA device; None or ``"cuda"`` = the current CUDA device (each rank's own GPU under
            Lightning, which sets it before the engine is built).

    Arguments, the GPU's compute capability, the CUDA version and the installed Transformer Engine
    version are validated by :meth:`check_args`.
    """

    PRECISIONS: ClassVar[tuple[str, ...]] = TE_PRECISIONS
    TRAINER_PRECISION_COPY: ClassVar[dict[str, Any] | None] = None
    """No fp32 copy: Transformer Engine runs fp8 only (validation reports the engine's precision)."""
    SUPPORTS_SET_PRECISION: ClassVar[bool] = False
    """Transformer Engine runs fp8 only: no precision to switch to (a progressive schedule is refused)."""
    set_precision = (
        RolloutEngine.set_precision
    )  # the torch engine's switches emulated recipes, which TE has none of

    def __init__(
        self,
        model: nn.Module,
        precision: str = "fp8",
        kv_cache_dtype: str | None = None,
        *,
        recipe: str = "current",
        fp8_format: str = "E4M3",
        params_dtype: torch.dtype = torch.bfloat16,
        device: str | None = None,
        pad_token_id: int | None = None,
        compact_below: float = 0.5,
    ) -> None:
        args = TERolloutEngine.check_args(
            precision=precision,
            kv_cache_dtype=kv_cache_dtype,
            recipe=recipe,
            fp8_format=fp8_format,
            params_dtype=params_dtype,
            device=device,
            pad_token_id=pad_token_id,
            compact_below=compact_below,
        )
        self._te = import_transformer_engine()
        self.recipe = args["recipe"]
        self._recipe = make_te_recipe(args["recipe"], args["fp8_format"])
        self._align = _ALIGN[args["recipe"]]
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
        them: no CUDA GPU, a GPU below the recipe's compute capability or a torch build below its CUDA
        version (:data:`TE_RECIPE_REQUIREMENTS`), Transformer Engine missing or older than
        :data:`TE_MIN_VERSION` (with the pip extra to install). ``kv_cache_dtype`` and the sampler
        options follow :meth:`TorchRolloutEngine.check_args`. Returns the arguments with the
        constructor's defaults filled in and ``device`` resolved to an indexed CUDA device.
        """
        name = "TERolloutEngine"
        args = bind_engine_args(TERolloutEngine, kwargs)
        check_choice(name, "precision", args["precision"], TE_PRECISIONS)
        check_choice(name, "recipe", args["recipe"], TE_RECIPES)
        check_choice(name, "fp8_format", args["fp8_format"], FP8_FORMATS)
        dtype = args["params_dtype"]
        if isinstance(dtype, str):  # a config value such as "bfloat16"
            dtype = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(
                f"params_dtype must be a floating torch.dtype (or its name, e.g. 'bfloat16') for {name}, "
                f"got {args['params_dtype']!r}"
            )
        args["params_dtype"] = dtype
        device = args["device"]
        check_cuda_device_type(device, name)
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
        dev = cuda_device(device, name)
        args["device"] = str(dev)
        check_capability(
            name,
            f"recipe={args['recipe']!r} (Transformer Engine FP8)",
            dev,
            **TE_RECIPE_REQUIREMENTS[args["recipe"]],
        )
        require_package(name, "transformer_engine", "Transformer Engine", TE_INSTALL_HINT)
        require_version(
            name,
            ("transformer_engine", "transformer-engine"),
            TE_MIN_VERSION,
            "Transformer Engine (te.autocast)",
        )
        return args

    def _prepare_model(self) -> None:
        self.model.to(device=self._te_device, dtype=self._params_dtype)
        self.num_te_linears = swap_linears_for_te(
            self.model, self._params_dtype, self._te_device, self._align
        )

    def _after_sync(self) -> None:
        """TE quantizes weights inside every autocast forward (current/block/MX scaling): nothing cached."""

    def forward_context(self) -> contextlib.AbstractContextManager:
        return self._te.autocast(enabled=True, recipe=self._recipe)
