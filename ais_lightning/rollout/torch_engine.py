"""A pure-PyTorch batched rollout engine with a preallocated KV cache.

``TorchRolloutEngine`` owns a deep copy of a Hugging Face causal LM (like vLLM owns its weights),
optionally quantized (``ais_lightning.quant``), and samples with one prefill forward followed by
lean single-token decode steps. The pieces, one job per module:

- :mod:`ais_lightning.rollout.torch_model`: binding the Llama-family layout (Qwen3, Qwen2, Llama, Mistral,
  Gemma), fused q/k/v, and the per-layer math of the packed prefill and the decode step;
- :mod:`ais_lightning.rollout.decoders`: the forward state of one call, on that lean path or through the
  model's own Hugging Face forward (any other causal LM), behind one prefill / step / select protocol;
- :mod:`ais_lightning.rollout.kv_cache`: the KV-cache workspace kept across ``generate`` calls
  (:meth:`TorchRolloutEngine.release_kv_cache` frees it) and the FP8 KV-cache scales
  (``kv_cache_dtype="fp8"``, recalibrated by the first prefill after each weight sync);
- :mod:`ais_lightning.rollout.weight_sync`: all-or-nothing weight sync (validate the whole sync,
  then load, re-quantize, reset the KV scales);
- this module: argument checks (:meth:`TorchRolloutEngine.check_args`), the choice of forward and the
  sampling loop.

Position convention (shared with ``ais_lightning.policy``, see :mod:`ais_lightning.rollout.prompts`):
prompts are LEFT-padded and response token ``t`` of a prompt of length ``L`` sits at position ``L + t``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from ais_lightning.models.head import Float32Head, check_head_dtype
from ais_lightning.models.routing import RoutingRecorder, moe_routers, routing_dtype
from ais_lightning.quant.cpu_int8 import INTEGER_BACKENDS, cpu_int8_isa, default_int8_backend
from ais_lightning.quant.linear import BACKEND_KERNELS
from ais_lightning.quant.outliers import OutlierCalibration, check_fraction
from ais_lightning.quant.recipes import NESTED_INT_RECIPES
from ais_lightning.rollout.base import RolloutBatch, RolloutEngine, SamplingConfig, without_autocast
from ais_lightning.rollout.decoders import (
    CACHED_DECODE_TOLERANCE,
    LeanDecoder,
    TransformersDecoder,
    cached_decode_mismatch,
)
from ais_lightning.rollout.engine_args import (
    bind_engine_args,
    check_choice,
    check_pad_token_id,
    cuda_capability,
    cuda_device,
    cuda_runtime_version,
)
from ais_lightning.rollout.kv_cache import FP8KVScales, KVWorkspace
from ais_lightning.rollout.prompts import check_generate_args, context_length, left_pad
from ais_lightning.rollout.sampling import check_uniforms, draw_next, make_generator
from ais_lightning.rollout.support import SupportRecorder
from ais_lightning.rollout.torch_model import LeanLlama, lean_unsupported
from ais_lightning.rollout.weight_sync import load_validated, requantize, validate_sync

__all__ = [
    "KV_CACHE_DTYPES",
    "MODEL_IMPLS",
    "PRECISIONS",
    "QUANT_BACKENDS",
    "TorchRolloutEngine",
    "left_pad",
]

PRECISIONS = ("fp32", "bf16", "fp8", "fp4", "int8", *NESTED_INT_RECIPES, "fp8_tensor", "fp8_channel", "fp16")
"""Weight/activation precisions the torch engine supports: ``fp32`` (the model as the trainer hands it over, in
its own dtype), ``bf16`` / ``fp16`` (the copy cast to bfloat16 / float16), the quantized recipes: the Bit-by-Bit integer recipes
(``int4``, ``int2``, their weight-only ``_w`` and outlier-split ``_ocs`` variants, the nested int8 grid;
``ais_lightning.quant.NESTED_INT_RECIPES``) are emulated on CPU: exact numerics, no speed-up.
``fp8_tensor`` / ``fp8_channel`` (per-tensor / per-row E4M3 scales) are the FP8 recipes the real FP8
GEMM runs on every FP8 GPU (``backend="fp8_gemm"``); ``fp8`` (blockwise) runs there on Hopper only."""
CAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The precisions that cast the engine's copy of the model to a dtype (every weight, the head included)."""
KV_CACHE_DTYPES = (None, "auto", "fp8")
"""KV-cache storage formats: None or ``"auto"`` = the model dtype, ``"fp8"`` = fake-quantized E4M3."""
MODEL_IMPLS = ("auto", "lean", "transformers")
"""How the engine runs the model: ``lean`` (its own Llama-family forward over a preallocated KV cache,
:data:`ais_lightning.rollout.torch_model.LEAN_MODEL_TYPES`), ``transformers`` (the model's Hugging Face
forward and cache: any causal LM), ``auto`` (lean where it applies, else transformers)."""
QUANT_BACKENDS = ("emulate", "int8", "fbgemm", "fp8_gemm")
"""``ais_lightning.quant.quantize_model`` backends."""
FP8_GEMM_PRECISIONS = ("fp8", "fp8_tensor", "fp8_channel")
"""Precisions ``backend="fp8_gemm"`` (``torch._scaled_mm``) runs; requirements:
:func:`ais_lightning.quant.linear.fp8_gemm_requirement`."""
_log = logging.getLogger(__name__)
_DEFAULT_BACKEND = {
    "fp8": "emulate",
    "fp8_tensor": "emulate",
    "fp8_channel": "emulate",
    "fp4": "emulate",
    "int8": None,
    **dict.fromkeys(NESTED_INT_RECIPES, "emulate"),
}
"""The quantization backend of each quantized precision when ``backend`` is None; None (int8): the fastest exact
integer GEMM of this CPU, probed when an engine is checked (:func:`ais_lightning.quant.cpu_int8.default_int8_backend`:
``torch._int_mm`` with AVX512-VNNI, fbgemm on other x86 CPUs, else the same numerics emulated)."""
DEFAULT_OUTLIER_FRACTION = {"int8": 0.1, "fp8": 0.05}
"""Fraction of every quantized linear's input channels kept in high precision when ``outlier_fraction`` is None
(:mod:`ais_lightning.quant.outliers`); other precisions quantize every channel by default."""


def _resolve_model_impl(model: nn.Module, model_impl: str, kv_cache_dtype: str | None) -> str:
    """``"lean"`` or ``"transformers"`` for ``model`` (``model_impl`` already checked); ValueError when the
    caller insists on the lean forward, or needs it for an FP8 KV cache, and it cannot run the model."""
    if model_impl == "transformers":
        return model_impl
    reason = lean_unsupported(model)
    if reason is None:
        return "lean"
    if model_impl == "lean" or kv_cache_dtype == "fp8":
        wanted = "model_impl='lean'" if model_impl == "lean" else "kv_cache_dtype='fp8' (lean forward only)"
        raise ValueError(
            f"TorchRolloutEngine {wanted}: the lean forward cannot run {type(model).__name__}: {reason}; "
            "model_impl='transformers' (or 'auto') runs the model's own forward"
        )
    return "transformers"


def _check_cached_decoding(model: nn.Module) -> None:
    """ValueError when ``model``'s own forward decodes differently with its cache than without (a probe:
    :func:`ais_lightning.rollout.decoders.cached_decode_mismatch`)."""
    dtype = model.get_input_embeddings().weight.dtype
    tolerance = CACHED_DECODE_TOLERANCE.get(dtype, CACHED_DECODE_TOLERANCE[None])
    try:
        mismatch = cached_decode_mismatch(model)
    except (TypeError, ValueError, AttributeError, RuntimeError, IndexError) as err:
        raise ValueError(
            f"TorchRolloutEngine cannot run {type(model).__name__} through its own forward with a cache "
            f"({type(err).__name__}: {err}); engine 'vllm' may support it"
        ) from err
    if not mismatch <= tolerance:
        raise ValueError(
            f"TorchRolloutEngine cannot run {type(model).__name__} through its own forward: decoding with its "
            f"cache differs from a full forward by {mismatch:.3g} nats (> {tolerance:g}) on a probe of left-padded "
            "prompts, so its rollout log-probs would not be the model's. State-space and hybrid models (Mamba, "
            "Jamba, ...) are not supported by the torch engine; engine 'vllm' runs them"
        )


def _resolve_outlier_fraction(name: str, precision: str, fraction: float | None) -> float:
    """The engine's ``outlier_fraction`` at ``precision``: None -> :data:`DEFAULT_OUTLIER_FRACTION`, 0 when
    nothing is quantized; ValueError on a value outside [0, 1) or beside a recipe that splits outliers itself."""
    if fraction is None:
        fraction = DEFAULT_OUTLIER_FRACTION.get(precision, 0.0)
    fraction = check_fraction(fraction)
    if precision not in _DEFAULT_BACKEND:
        return 0.0
    from ais_lightning.quant import get_recipe

    if fraction > 0 and get_recipe(precision).ocs_ratio > 0:
        raise ValueError(
            f"outlier_fraction={fraction} keeps outlier channels in high precision, and precision={precision!r} "
            f"splits them (outlier channel splitting) in {name}: use one, e.g. outlier_fraction=0"
        )
    return fraction


def _quantized_modules(model: nn.Module) -> list[nn.Module]:
    """Every QuantLinear of ``model``, the per-expert layers of quantized experts included."""
    from ais_lightning.quant import quantized_layers

    return quantized_layers(model)


def _module_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (or buffer); CPU for a module without tensors."""
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def _check_engine_device(name: str, device: Any, backend: str | None, precision: str) -> str | None:
    """``device`` checked (a torch device string, or None = the model's) and, for ``backend="fp8_gemm"``,
    the GPU's requirements (:func:`ais_lightning.quant.linear.fp8_gemm_requirement`).

    With ``device=None`` the model's device is not known yet (config time): the current CUDA device is
    checked when there is one, and a machine without CUDA is refused for ``fp8_gemm``.
    """
    if device is not None:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise ValueError(
                f"device must be None or a torch device such as 'cpu' or 'cuda:0', got {device!r}"
            ) from err
        if dev.type == "cuda":
            dev = cuda_device(device, name)
        device = str(dev)
        if backend in INTEGER_BACKENDS and dev.type != "cpu":
            raise ValueError(
                f"device={device!r}: backend={backend!r} (integer GEMM) runs on CPU only in {name}; use device='cpu' "
                "or backend='emulate'"
            )
    if backend != "fp8_gemm":
        return device
    from ais_lightning.quant.linear import fp8_gemm_requirement

    recipe = "fp8_block" if precision == "fp8" else precision
    if device is None and torch.cuda.is_available():
        dev = cuda_device(None, name)
    elif device is None:
        dev = torch.device("cpu")
    else:
        dev = torch.device(device)
    capability = cuda_capability(dev) if dev.type == "cuda" else None
    reason = fp8_gemm_requirement(recipe, capability, cuda_runtime_version())
    if reason is not None:
        raise ValueError(
            f"backend='fp8_gemm' with precision={precision!r} cannot run on {dev}: {reason}. backend='emulate' "
            f"gives the same recipe's numerics on any device [{name}]"
        )
    return device


class TorchRolloutEngine(RolloutEngine):
    """Batched sampler over a private (optionally quantized) copy of ``model``.

    Args:
        model: a Hugging Face causal LM. It is deep-copied; the caller's module is never modified.
        precision: ``fp32`` (the model's own dtype) | ``bf16`` | ``fp16`` | ``fp8`` (blockwise E4M3 W8A8) | ``fp4``
            (NVFP4) | ``int8`` | ... (:data:`PRECISIONS`).
        kv_cache_dtype: None or ``"auto"`` (model dtype), or ``"fp8"`` (E4M3 fake-quantized, per-head scales).
        backend: quantization backend for fp8/fp4/int8: ``"emulate"`` (exact-numerics fake
            quantization, any device), ``"int8"`` / ``"fbgemm"`` (the int8 recipe on an integer GEMM, CPU only:
            ``torch._int_mm``, fast where the CPU has AVX512-VNNI, or fbgemm's, fast on any x86 CPU with AVX2; same
            numerics as ``emulate``; int8 only) or
            ``"fp8_gemm"`` (the real FP8 GEMM, ``torch._scaled_mm``, CUDA: ``fp8_tensor`` and ``fp8_channel``
            on compute capability >= 8.9, blockwise ``fp8`` on Hopper with CUDA >= 12.9; checked by
            :meth:`check_args`). None: fp8/fp4 -> emulate, int8 -> the fastest exact backend of this CPU
            (:func:`ais_lightning.quant.cpu_int8.default_int8_backend`); :attr:`backend` is the one that runs.
        device: where the engine's copy of the model lives (``"cpu"``, ``"cuda"``, ``"cuda:1"``); None:
            the device of ``model`` (``ais-train`` hands the engine a model on the trainer's device).
            ``"cuda"`` without an index is the current CUDA device (each rank's own GPU under Lightning).
        pad_token_id: id used to pad prompts and responses; default ``config.pad_token_id`` or 0.
        compact_below: when the fraction of still-running rows drops to this or below, finished
            rows are dropped from the batch (one gather of the KV cache) so they stop costing work.
            0 disables compaction.
        model_impl: ``"auto"`` (default): the lean forward for the Llama-family models it reproduces
            exactly (:func:`ais_lightning.rollout.torch_model.lean_unsupported`: Llama, Mistral, Qwen2,
            Qwen3, Gemma without sliding windows), the model's own Hugging Face forward for every other
            causal LM; ``"lean"`` insists on the lean forward (ValueError saying why it cannot run a model);
            ``"transformers"`` always runs the model's forward (slower per step on small models). An FP8 KV
            cache needs the lean forward. The resolved choice is :attr:`model_impl`.
        outlier_fraction: the fraction of every quantized linear's input channels kept in the model dtype,
            those with the largest activation range (:mod:`ais_lightning.quant.outliers`), in [0, 1). The ranges
            are calibrated by an unquantized pass over the prompts of the first ``generate`` and then observed at
            every prefill; each weight sync picks the channels from what the prefills since the previous sync
            saw. None: 0.1 for int8, 0.05 for fp8 (real LLMs' outlier features break both otherwise), 0 for the other
            precisions (:data:`DEFAULT_OUTLIER_FRACTION`). Ignored at fp32/bf16/fp16.
        head_dtype: the precision of ``lm_head``'s projection (never quantized: :data:`ais_lightning.quant.model.DEFAULT_SKIP`).
            None / ``"auto"`` / ``"model"``: the engine's model dtype (fp32 for an fp32 model at fp32 or a quantized
            precision, bf16 / fp16 at ``bf16`` / ``fp16``: the behaviour before this option); ``"float32"``: fp32
            logits from the model-dtype hidden states and weights (:class:`ais_lightning.models.head.Float32Head`;
            prime-rl's ``enable_fp32_lm_head``). Pair it with the trainer's ``Policy(head_dtype=...)``: with a bf16
            or fp16 policy set both (``ais-train`` warns about a head in fp32 on one side only).

    Example:
        >>> import torch
        >>> from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3
        >>> from ais_lightning.policy import Policy
        >>> from ais_lightning.rollout import SamplingConfig, TorchRolloutEngine
        >>> model, tokenizer = build_tiny_qwen3(seed=0), build_char_tokenizer()
        >>> engine = TorchRolloutEngine(model, precision="int8")  # a private int8 copy of the model
        >>> batch = engine.generate([tokenizer.encode("1+2=")], SamplingConfig(n=2, max_new_tokens=4, seed=0))
        >>> batch.rollout_logprobs.shape  # log mu of each sampled token, under the int8 forward [n, max_new_tokens]
        torch.Size([2, 4])
        >>> with torch.no_grad():  # the same tokens scored by the fp32 policy: log pi
        ...     train = Policy(model, tokenizer).batch_logprobs(batch, temperature=1.0).logprobs
        >>> bool((train - batch.rollout_logprobs)[batch.response_mask].abs().max() < 0.05)
        True
        >>> engine.sync_weights(model.named_parameters())  # after an optimizer step: re-quantize the new weights
    """

    PRECISIONS: ClassVar[tuple[str, ...]] = PRECISIONS
    """Precisions this engine runs (what :func:`ais_lightning.rollout.engine_precisions` reports)."""
    RECORDS_ROUTING: ClassVar[bool] = True
    """It records mixture-of-experts routing (``RolloutBatch.routing``) for ``policy.router_replay``."""
    TRAINER_PRECISION_COPY: ClassVar[dict[str, Any] | None] = {
        "precision": "fp32",
        "kv_cache_dtype": None,
        "backend": None,
    }
    """Arguments that turn this engine into a plain fp32 copy of itself (the trainer's precision), used
    to measure validation accuracy at the trainer's precision beside the engine's; None = no such copy."""
    SUPPORTS_SET_PRECISION: ClassVar[bool] = True
    """:meth:`set_precision` switches between emulated quantized precisions in place (progressive precision)."""

    @classmethod
    def support_replay_gap(cls, top_k: int, top_p: float, min_p: float) -> str | None:
        """None: every truncation's kept set is recorded (``RolloutBatch.support``), exactly as the engine drew."""
        return None

    def __init__(
        self,
        model: nn.Module,
        precision: str = "fp32",
        kv_cache_dtype: str | None = None,
        backend: str | None = None,
        *,
        device: str | None = None,
        pad_token_id: int | None = None,
        compact_below: float = 0.5,
        model_impl: str = "auto",
        outlier_fraction: float | None = None,
        head_dtype: str | None = None,
    ) -> None:
        args = TorchRolloutEngine.check_args(
            precision=precision,
            kv_cache_dtype=kv_cache_dtype,
            backend=backend,
            device=device,
            pad_token_id=pad_token_id,
            compact_below=compact_below,
            model_impl=model_impl,
            outlier_fraction=outlier_fraction,
            head_dtype=head_dtype,
        )
        self.precision = args["precision"]
        self.kv_cache_dtype = args["kv_cache_dtype"]
        self.backend = args["backend"]
        self.compact_below = args["compact_below"]
        self._outlier_fraction_arg = outlier_fraction
        self.outlier_fraction = args["outlier_fraction"]
        """Fraction of each quantized linear's input channels kept in high precision (None resolved)."""
        self.head_dtype = args["head_dtype"]
        """The precision of ``lm_head``'s projection (None: the model dtype; ``"float32"``)."""
        self.float32_head: Float32Head | None = None
        """The fp32 head installed on the private copy (``head_dtype="float32"``), else None."""

        self.model_impl = self.check_model(
            model, precision=self.precision, kv_cache_dtype=self.kv_cache_dtype, model_impl=args["model_impl"]
        )
        """The forward this engine runs: ``"lean"`` or ``"transformers"`` (``model_impl="auto"`` resolved)."""
        self.model = copy.deepcopy(model).eval()
        self.model.requires_grad_(False)
        target = args["device"] if args["device"] is not None else _module_device(self.model)
        self._check_device(target)
        self.model.to(target)
        self._prepare_model()
        self._log_choices(model)
        self.lean = LeanLlama(self.model) if self.model_impl == "lean" else None
        """The bound lean forward (:class:`ais_lightning.rollout.torch_model.LeanLlama`), or None when the
        engine runs the model's own forward."""
        self.quantized = self.lean.quantized if self.lean is not None else _quantized_modules(self.model)
        """Every ``QuantLinear`` the forward calls, once: what a weight sync re-quantizes."""
        self.outliers = (
            OutlierCalibration(self.quantized, self.outlier_fraction)
            if self.outlier_fraction > 0 and self.quantized
            else None
        )
        """Calibration of the outlier channels kept in high precision, or None (no quantized layer, or 0)."""
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        if pad_token_id is None:
            pad_token_id = getattr(self.model.config, "pad_token_id", None)
        self.pad_token_id = int(pad_token_id) if pad_token_id is not None else 0
        self.kv_workspace = KVWorkspace(len(self.lean.layers)) if self.lean is not None else None
        """KV-cache memory of the lean forward, kept across ``generate`` calls (None: the model's own cache)."""
        self.kv_scales = FP8KVScales() if self.kv_cache_dtype == "fp8" else None
        """FP8 KV-cache scales, or None for a cache in the model dtype."""
        routers = moe_routers(self.model)
        self.routing_recorder = RoutingRecorder(routers) if routers else None
        """Hooks recording each token's top-k experts in every MoE layer (``RolloutBatch.routing``); None for a
        dense model."""

    @classmethod
    def check_args(cls, **kwargs: Any) -> dict[str, Any]:
        """Validate constructor arguments (all but ``model``) without building anything.

        Unknown names, and values outside what the engine runs, raise ValueError naming the argument
        and the allowed values. Returns every argument with the constructor's defaults filled in and
        normalized: ``kv_cache_dtype`` ``"auto"`` -> None, ``backend`` None -> the precision's default,
        ``outlier_fraction`` None -> the precision's default (0 at fp32/bf16/fp16), ``head_dtype`` ``"auto"`` /
        ``"model"`` -> None.
        """
        name = "TorchRolloutEngine"
        args = bind_engine_args(TorchRolloutEngine, kwargs)
        precision, backend = args["precision"], args["backend"]
        check_choice(name, "precision", precision, PRECISIONS)
        check_choice(name, "kv_cache_dtype", args["kv_cache_dtype"], KV_CACHE_DTYPES)
        if args["kv_cache_dtype"] == "auto":
            args["kv_cache_dtype"] = None
        if backend is not None:
            if precision not in _DEFAULT_BACKEND:
                raise ValueError(
                    f"backend={backend!r} is only used by {name} with precision in {sorted(_DEFAULT_BACKEND)}, "
                    f"got precision={precision!r}; use backend=None"
                )
            check_choice(name, "backend", backend, QUANT_BACKENDS)
            if backend == "fp8_gemm" and precision not in FP8_GEMM_PRECISIONS:
                raise ValueError(
                    f"backend='fp8_gemm' (torch._scaled_mm) runs precision in {list(FP8_GEMM_PRECISIONS)} in "
                    f"{name}, got precision={precision!r}"
                )
            if backend in INTEGER_BACKENDS and precision != "int8":
                raise ValueError(
                    f"backend={backend!r} (integer GEMM) only runs precision='int8' in {name}, got "
                    f"precision={precision!r}; backend for precision={precision!r} must be 'emulate' or None"
                )
        if backend is None:
            backend = default_int8_backend() if precision == "int8" else _DEFAULT_BACKEND.get(precision)
        args["backend"] = backend
        args["device"] = _check_engine_device(name, args["device"], args["backend"], precision)
        compact_below = args["compact_below"]
        if isinstance(compact_below, bool) or not isinstance(compact_below, (int, float)):
            raise ValueError(f"compact_below must be a number in [0, 1) for {name}, got {compact_below!r}")
        if not 0.0 <= compact_below < 1.0:
            raise ValueError(f"compact_below must be in [0, 1) for {name}, got {compact_below}")
        check_pad_token_id(name, args["pad_token_id"])
        check_choice(name, "model_impl", args["model_impl"], MODEL_IMPLS)
        args["outlier_fraction"] = _resolve_outlier_fraction(name, precision, args["outlier_fraction"])
        args["head_dtype"] = (
            "float32" if check_head_dtype(args["head_dtype"], f"head_dtype of {name}") else None
        )
        if args["model_impl"] == "transformers" and args["kv_cache_dtype"] == "fp8":
            raise ValueError(
                f"kv_cache_dtype='fp8' needs the lean forward in {name}; model_impl='transformers' runs the "
                "model's own cache in the model dtype"
            )
        return args

    @staticmethod
    def check_model(
        model: nn.Module,
        precision: str = "fp32",
        kv_cache_dtype: str | None = None,
        model_impl: str = "auto",
        **other_arguments: Any,
    ) -> str:
        """Check what depends on ``model`` itself, without copying it; returns the forward the engine will run.

        ``model_impl`` is resolved (``"lean"`` or ``"transformers"``; ValueError when ``"lean"``, or an FP8 KV
        cache, is asked of a model the lean forward cannot run), and a quantized ``precision`` must find every
        matrix weight quantizable (:func:`ais_lightning.quant.check_quantizable`). ``ais-train`` calls this
        on the initial policy before its warm start; ``other_arguments`` (the engine's other constructor
        arguments) are ignored.
        """
        kv = None if kv_cache_dtype == "auto" else kv_cache_dtype
        impl = _resolve_model_impl(model, model_impl, kv)
        if impl == "transformers":
            _check_cached_decoding(model)
        if precision in _DEFAULT_BACKEND:
            from ais_lightning.quant import check_quantizable, get_recipe

            check_quantizable(model, get_recipe(precision))
        return impl

    # ------------------------------------------------------------------ setup
    def _log_choices(self, model: nn.Module) -> None:
        """Log the GEMM backend (with the CPU's int8 kernels) and a forward other than the lean one."""
        if self.backend is not None:
            _log.info(
                "TorchRolloutEngine: precision %s on backend %s (%s; this CPU's int8 kernels: %s)",
                self.precision,
                self.backend,
                BACKEND_KERNELS[self.backend],
                cpu_int8_isa(),
            )
        if self.model_impl != "lean":
            why = lean_unsupported(model) or "model_impl='transformers'"
            _log.info("TorchRolloutEngine runs %s through its own forward: %s", type(model).__name__, why)

    def _check_device(self, device: torch.device) -> None:
        """Refuse a device the backend cannot run on (the model's own device is only known here)."""
        if self.backend in INTEGER_BACKENDS and device.type != "cpu":
            raise ValueError(
                f"device={str(device)!r}: backend={self.backend!r} (integer W8A8 GEMM) runs on CPU only; pass device='cpu' "
                "for CPU rollouts, or pick a GPU precision (bf16, fp8 with backend='fp8_gemm', engine 'te' "
                "or 'vllm')"
            )
        if self.backend == "fp8_gemm":
            _check_engine_device("TorchRolloutEngine", str(device), "fp8_gemm", self.precision)

    def _prepare_model(self) -> None:
        """Cast or quantize the private copy in place; install the fp32 head (``head_dtype="float32"``)."""
        if self.precision in CAST_DTYPES:
            self.model.to(CAST_DTYPES[self.precision])
        elif self.precision in _DEFAULT_BACKEND:
            from ais_lightning.quant import get_recipe, quantize_model

            quantize_model(self.model, get_recipe(self.precision), backend=self.backend)
        if self.head_dtype == "float32":
            self.float32_head = Float32Head(self.model.get_output_embeddings())

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Context every forward runs in (subclasses add e.g. an FP8 autocast)."""
        return contextlib.nullcontext()

    def release_kv_cache(self) -> None:
        """Free the KV-cache memory kept between ``generate`` calls (the next call allocates it again)."""
        if self.kv_workspace is not None:
            self.kv_workspace.release()

    def set_precision(self, precision: str) -> None:
        """Switch the engine to another emulated quantization recipe in place (progressive precision).

        For an engine on the ``emulate`` backend (fp8, fp4 and the nested integer recipes ``int8_nested``,
        ``int4``, ``int2``, ``_w``, ``_ocs``): every quantized linear re-derives its cache from the weights
        it holds (:func:`ais_lightning.quant.switch_recipe`), exactly as if the engine had been built at
        ``precision`` from its current weights; FP8 KV-cache scales, and the outlier channels at the new
        precision's ``outlier_fraction``, are recalibrated on the next prefill. A
        precision that needs another backend or no quantization (fp32, bf16, fp16, int8 on the integer GEMM) raises ValueError
        and changes nothing: build a new engine for those.
        """
        name = "TorchRolloutEngine.set_precision"
        check_choice(name, "precision", precision, PRECISIONS)
        if precision == self.precision:
            return
        if self.backend != "emulate" or precision not in _DEFAULT_BACKEND:
            raise ValueError(
                f"{name} switches between emulated quantized precisions, got {self.precision!r} (backend "
                f"{self.backend!r}) -> {precision!r}; build a new engine for this change"
            )
        from ais_lightning.quant import get_recipe, switch_recipe

        fraction = _resolve_outlier_fraction(name, precision, self._outlier_fraction_arg)
        channels = [layer.outlier_channels for layer in self.quantized]
        for layer in self.quantized:  # a fresh engine starts uncalibrated
            layer.set_outlier_channels(None)
        try:
            switch_recipe(self.model, get_recipe(precision), backend="emulate")
        except ValueError:
            for layer, kept in zip(self.quantized, channels):
                layer.set_outlier_channels(kept)
            raise
        self.precision = precision
        self.outlier_fraction = fraction
        self.outliers = OutlierCalibration(self.quantized, fraction) if fraction > 0 else None
        if self.kv_scales is not None:
            self.kv_scales.reset()

    # ------------------------------------------------------------- weight sync
    @without_autocast
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the trainer's weights and buffers, all or nothing; re-quantize; recalibrate KV scales.

        ``named_tensors``: ``(name, tensor)`` pairs named like the trainer model's parameters and
        buffers, e.g. ``Policy.full_state_dict()`` (quantized copies keep the same names). The whole
        sync is validated first (:func:`ais_lightning.rollout.weight_sync.validate_sync`: known names,
        shapes, finite values in the engine's dtype); a rejected sync raises ValueError naming the
        tensor and leaves the engine exactly as it was. Names not sent keep their current value.
        """
        pairs = validate_sync(self.model, named_tensors)
        load_validated(pairs)
        self._after_sync()
        if self.kv_scales is not None:
            self.kv_scales.reset()  # recalibrated on the next prefill

    def calibration_state(self) -> dict[str, Any] | None:
        """The engine's own calibration beyond the weights a sync delivers: its outlier channels and the
        activation ranges observed since the last sync (None without outlier channels). A checkpoint keeps it
        so that a resumed run quantizes exactly as the uninterrupted one (:meth:`load_calibration_state`)."""
        if self.outliers is None:
            return None
        return {"precision": self.precision, "outliers": self.outliers.state_dict()}

    def load_calibration_state(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`calibration_state` (after the weights are synced); ValueError if it was taken from an
        engine of another precision, outlier fraction or model, leaving this engine's calibration as it was."""
        if state is None:
            return
        if self.outliers is None or state.get("precision") != self.precision:
            raise ValueError(
                f"calibration state of a {state.get('precision')!r} engine with outlier channels does not fit this "
                f"{self.precision!r} engine (outlier_fraction={self.outlier_fraction})"
            )
        self.outliers.load_state_dict(state["outliers"])

    def _after_sync(self) -> None:
        """Re-derive cached low-precision weights after new weights were loaded (outlier channels picked
        first, from the activation ranges the prefills since the previous sync saw)."""
        if self.outliers is not None:
            self.outliers.apply()
        requantize(self.quantized)  # empty at fp32/bf16/fp16
        if self.float32_head is not None:
            self.float32_head.refresh()

    # --------------------------------------------------------------- generate
    @torch.inference_mode()
    @without_autocast
    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, *, uniforms: torch.Tensor | None = None
    ) -> RolloutBatch:
        """Sample ``sampling.n`` responses per prompt (rows of one prompt are contiguous).

        Computes in the engine's own precision: a caller's ``torch.autocast`` (Lightning's ``bf16-mixed``
        around ``training_step``) is turned off inside, as in :meth:`sync_weights`.

        ``uniforms``: an optional ``[len(prompts) * n, >= max_new_tokens]`` table in [0, 1); row ``i``
        then samples step ``t`` with ``uniforms[i, t]`` (its own noise, kept through compaction) instead
        of the seeded generator, and the batch records the table in ``extras["uniforms"]`` so that rows
        can be generated again with the same noise (``ais_lightning.rollout.coupled.regenerate``).
        """
        check_generate_args(prompts, sampling, self.vocab_size, context_length(self.model))
        if uniforms is not None:
            check_uniforms(uniforms, (len(prompts) * sampling.n, -1))
            if uniforms.shape[1] < sampling.max_new_tokens:
                raise ValueError(
                    f"uniforms has {uniforms.shape[1]} columns, fewer than max_new_tokens="
                    f"{sampling.max_new_tokens}"
                )
        with self.forward_context():
            return self._generate(prompts, sampling, uniforms)

    def _decoder(self, fp8_kv: bool = True) -> LeanDecoder | TransformersDecoder:
        """A fresh forward state for one ``generate`` call (:mod:`ais_lightning.rollout.decoders`);
        ``fp8_kv=False``: the cache in the model dtype even when the engine's is FP8 (a calibration pass,
        which must not calibrate the FP8 KV scales)."""
        if self.lean is not None:
            return LeanDecoder(self.lean, self.kv_workspace, self.kv_scales if fp8_kv else None)
        return TransformersDecoder(self.model)

    def _calibrate_outliers(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int, new: int
    ) -> None:
        """Pick the outlier channels from an unquantized prefill of these prompts (its logits are discarded)."""
        assert self.outliers is not None
        with self.outliers.observe(bypass=True):
            self._decoder(fp8_kv=False).prefill(prompt_ids, prompt_mask, n, new)
        self.outliers.apply()
        requantize(self.quantized)

    def _generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, uniforms: torch.Tensor | None = None
    ) -> RolloutBatch:
        # One piece on purpose: the prefill and the decode loop share the running state (the rows still alive, their
        # original rows after a compaction, the decoder's cache, the routing being recorded) step by step; split,
        # every piece would take and return all of it.
        dev, n = self.device, sampling.n
        gen = make_generator(sampling.seed, dev)
        noise = uniforms.to(dev) if uniforms is not None else None  # [B, >= N], indexed by original row
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_token_id)  # [Bp, P]
        prompt_ids, prompt_mask = prompt_ids.to(dev), prompt_mask.to(dev)
        bp = prompt_ids.shape[0]
        batch, new = bp * n, sampling.max_new_tokens
        if self.outliers is not None and not self.outliers.calibrated:
            self._calibrate_outliers(prompt_ids, prompt_mask, n, new)
        decoder = self._decoder()
        recorder = self.routing_recorder
        capture = recorder.capture if recorder is not None else contextlib.nullcontext
        with self.outliers.observe() if self.outliers is not None else contextlib.nullcontext(), capture():
            logits = decoder.prefill(prompt_ids, prompt_mask, n, new)  # [B, V]
        routing = (
            None if recorder is None else _routing_buffer(recorder, bp, prompt_ids.shape[1], n, new, dev)
        )

        out_ids = torch.full((batch, new), self.pad_token_id, dtype=torch.long, device=dev)
        out_lp = torch.zeros((batch, new), dtype=torch.float32, device=dev)
        out_mask = torch.zeros((batch, new), dtype=torch.bool, device=dev)
        stopped = torch.zeros(batch, dtype=torch.bool, device=dev)
        stop_ids = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=dev)
        rows = torch.arange(batch, device=dev)  # original row of each running row
        kept_sets = SupportRecorder() if sampling.records_support(self.vocab_size) else None
        out_rows: torch.Tensor | slice = slice(None)  # rows to write outputs to: all until compaction
        alive = torch.ones(batch, dtype=torch.bool, device=dev)  # [R]
        steps = 0
        for t in range(new):
            u = noise[rows, t] if noise is not None else None  # [R]
            draw = draw_next(
                logits, sampling.temperature, sampling.top_k, sampling.top_p, gen, u, sampling.min_p
            )
            tok, lp = draw.tokens, draw.logprobs  # [R]
            if kept_sets is not None and draw.kept is not None:  # the kept sets of the rows still generating
                kept_sets.add(rows[alive], t, draw.kept[alive])
            steps = t + 1
            if stop_ids.numel():
                out_ids[out_rows, t] = torch.where(alive, tok, self.pad_token_id)
                out_lp[out_rows, t] = torch.where(alive, lp, 0.0)
                out_mask[out_rows, t] = alive
                hit = alive & torch.isin(tok, stop_ids)
                stopped[rows[hit]] = True
                alive = alive & ~hit
            else:  # no stop tokens: every row runs to the end (no masking, no compaction, no sync)
                out_ids[:, t] = tok
                out_lp[:, t] = lp
                out_mask[:, t] = True
            if t + 1 == new:
                break
            if stop_ids.numel():
                n_alive = int(alive.sum())
                if n_alive == 0:
                    break
                if n_alive <= self.compact_below * rows.numel():
                    keep = alive.nonzero().squeeze(-1)  # [R']
                    decoder.select(keep)
                    rows, alive, tok = rows[keep], alive[keep], tok[keep]
                    out_rows = rows
            with capture():
                logits = decoder.step(tok, t)  # [R, V]
            if routing is not None:  # token t of each running row went through the routers
                routing[out_rows, prompt_ids.shape[1] + t] = recorder.take().to(routing.dtype)  # [R, L, k]

        finish = ["stop" if s else "length" for s in stopped.tolist()]
        index = torch.arange(bp, device=dev).repeat_interleave(n)
        return RolloutBatch(
            prompt_ids=prompt_ids.repeat_interleave(n, dim=0),
            prompt_mask=prompt_mask.repeat_interleave(n, dim=0),
            response_ids=out_ids[:, :steps],
            response_mask=out_mask[:, :steps],
            rollout_logprobs=out_lp[:, :steps],
            finish_reason=finish,
            prompt_index=index,
            extras={"uniforms": uniforms} if uniforms is not None else {},
            routing=routing[:, : prompt_ids.shape[1] + steps] if routing is not None else None,
            support=kept_sets.build(out_mask[:, :steps]) if kept_sets is not None else None,
        )


def _routing_buffer(
    recorder: RoutingRecorder, prompts: int, plen: int, n: int, new: int, device: torch.device
) -> torch.Tensor:
    """The routing record of a batch, ``[B, P + N, L, k]`` (``B = prompts * n``): the prompts' routing, which the
    prefill just recorded, fanned out to their ``n`` rows; the responses' positions are written as they are
    decoded."""
    router = recorder.routers[0]
    routing = torch.zeros(
        (prompts * n, plen + new, len(recorder.routers), router.top_k),
        dtype=routing_dtype(router.num_experts),
        device=device,
    )
    prompt_routing = recorder.take().view(prompts, plen, *routing.shape[2:])  # [Bp, P, L, k]
    routing[:, :plen] = prompt_routing.repeat_interleave(n, dim=0).to(routing.dtype)
    return routing
