"""A pure-PyTorch batched rollout engine with a preallocated KV cache.

``TorchRolloutEngine`` owns a deep copy of a Hugging Face causal LM (like vLLM owns its weights),
optionally quantized (``ais_lightning.quant``), and samples with one prefill forward followed by
lean single-token decode steps. The pieces, one job per module:

- :mod:`ais_lightning.rollout.torch_model`: binding the Llama-family layout (Qwen3, Qwen2, Llama),
  fused q/k/v, and the per-layer math of the packed prefill and the decode step;
- :mod:`ais_lightning.rollout.kv_cache`: the KV-cache workspace kept across ``generate`` calls
  (:meth:`TorchRolloutEngine.release_kv_cache` frees it) and the FP8 KV-cache scales
  (``kv_cache_dtype="fp8"``, recalibrated by the first prefill after each weight sync);
- :mod:`ais_lightning.rollout.weight_sync`: all-or-nothing weight sync (validate the whole sync,
  then load, re-quantize, reset the KV scales);
- this module: argument checks (:meth:`TorchRolloutEngine.check_args`) and the prefill/decode loop.

Position convention (shared with ``ais_lightning.policy``, see :mod:`ais_lightning.rollout.prompts`):
prompts are LEFT-padded and response token ``t`` of a prompt of length ``L`` sits at position ``L + t``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from ais_lightning.quant.recipes import NESTED_INT_RECIPES
from ais_lightning.rollout.base import RolloutBatch, SamplingConfig
from ais_lightning.rollout.engine_args import (
    bind_engine_args,
    check_choice,
    check_pad_token_id,
    cuda_capability,
    cuda_device,
    cuda_runtime_version,
)
from ais_lightning.rollout.kv_cache import FP8KVScales, KVWorkspace
from ais_lightning.rollout.prompts import check_prompts, left_pad
from ais_lightning.rollout.sampling import check_uniforms, make_generator, sample_next
from ais_lightning.rollout.torch_model import LeanLlama, sign_sin
from ais_lightning.rollout.weight_sync import load_validated, requantize, validate_sync

__all__ = [
    "KV_CACHE_DTYPES",
    "PRECISIONS",
    "QUANT_BACKENDS",
    "TorchRolloutEngine",
    "left_pad",
]

PRECISIONS = ("fp32", "bf16", "fp8", "fp4", "int8", *NESTED_INT_RECIPES, "fp8_tensor", "fp8_channel")
"""Weight/activation precisions the torch engine supports: the Bit-by-Bit integer recipes
(``int4``, ``int2``, their weight-only ``_w`` and outlier-split ``_ocs`` variants, the nested int8 grid;
``ais_lightning.quant.NESTED_INT_RECIPES``) are emulated on CPU: exact numerics, no speed-up.
``fp8_tensor`` / ``fp8_channel`` (per-tensor / per-row E4M3 scales) are the FP8 recipes the real FP8
GEMM runs on every FP8 GPU (``backend="fp8_gemm"``); ``fp8`` (blockwise) runs there on Hopper only."""
KV_CACHE_DTYPES = (None, "auto", "fp8")
"""KV-cache storage formats: None or ``"auto"`` = the model dtype, ``"fp8"`` = fake-quantized E4M3."""
QUANT_BACKENDS = ("emulate", "int8", "fp8_gemm")
"""``ais_lightning.quant.quantize_model`` backends."""
FP8_GEMM_PRECISIONS = ("fp8", "fp8_tensor", "fp8_channel")
"""Precisions ``backend="fp8_gemm"`` (``torch._scaled_mm``) runs; requirements:
:func:`ais_lightning.quant.linear.fp8_gemm_requirement`."""
_DEFAULT_BACKEND = {
    "fp8": "emulate",
    "fp8_tensor": "emulate",
    "fp8_channel": "emulate",
    "fp4": "emulate",
    "int8": "int8",
    **dict.fromkeys(NESTED_INT_RECIPES, "emulate"),
}
"""The quantization backend of each quantized precision when ``backend`` is None."""


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
        if backend == "int8" and dev.type != "cpu":
            raise ValueError(
                f"device={device!r}: backend='int8' (fbgemm W8A8) runs on CPU only in {name}; use device='cpu'"
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


class TorchRolloutEngine:
    """Batched sampler over a private (optionally quantized) copy of ``model``.

    Args:
        model: a Hugging Face causal LM with the Llama-family layout (Qwen3, Qwen2, Llama).
            It is deep-copied; the caller's module is never modified.
        precision: ``fp32`` | ``bf16`` | ``fp8`` (blockwise E4M3 W8A8) | ``fp4`` (NVFP4) | ``int8``.
        kv_cache_dtype: None or ``"auto"`` (model dtype), or ``"fp8"`` (E4M3 fake-quantized, per-head scales).
        backend: quantization backend for fp8/fp4/int8: ``"emulate"`` (exact-numerics fake
            quantization, any device), ``"int8"`` (fbgemm dynamic W8A8, the real CPU speed path, int8
            only) or ``"fp8_gemm"`` (the real FP8 GEMM, ``torch._scaled_mm``, CUDA: ``fp8_tensor`` and
            ``fp8_channel`` on compute capability >= 8.9, blockwise ``fp8`` on Hopper with CUDA >= 12.9;
            checked by :meth:`check_args`). None: fp8/fp4 -> emulate, int8 -> int8.
        device: where the engine's copy of the model lives (``"cpu"``, ``"cuda"``, ``"cuda:1"``); None:
            the device of ``model`` (``ais-train`` hands the engine a model on the trainer's device).
            ``"cuda"`` without an index is the current CUDA device (each rank's own GPU under Lightning).
        pad_token_id: id used to pad prompts and responses; default ``config.pad_token_id`` or 0.
        compact_below: when the fraction of still-running rows drops to this or below, finished
            rows are dropped from the batch (one gather of the KV cache) so they stop costing work.
            0 disables compaction.
    """

    PRECISIONS: ClassVar[tuple[str, ...]] = PRECISIONS
    """Precisions this engine runs (what :func:`ais_lightning.rollout.engine_precisions` reports)."""
    TRAINER_PRECISION_COPY: ClassVar[dict[str, Any] | None] = {
        "precision": "fp32",
        "kv_cache_dtype": None,
        "backend": None,
    }
    """Arguments that turn this engine into a plain fp32 copy of itself (the trainer's precision), used
    to measure validation accuracy at the trainer's precision beside the engine's; None = no such copy."""

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
    ) -> None:
        args = TorchRolloutEngine.check_args(
            precision=precision,
            kv_cache_dtype=kv_cache_dtype,
            backend=backend,
            device=device,
            pad_token_id=pad_token_id,
            compact_below=compact_below,
        )
        self.precision = args["precision"]
        self.kv_cache_dtype = args["kv_cache_dtype"]
        self.backend = args["backend"]
        self.compact_below = args["compact_below"]

        self.model = copy.deepcopy(model).eval()
        self.model.requires_grad_(False)
        target = args["device"] if args["device"] is not None else _module_device(self.model)
        self._check_device(target)
        self.model.to(target)
        self._prepare_model()
        self.lean = LeanLlama(self.model)
        """The bound lean forward (:class:`ais_lightning.rollout.torch_model.LeanLlama`)."""
        self.vocab_size = self.lean.vocab_size
        if pad_token_id is None:
            pad_token_id = getattr(self.model.config, "pad_token_id", None)
        self.pad_token_id = int(pad_token_id) if pad_token_id is not None else 0
        self.kv_workspace = KVWorkspace(len(self.lean.layers))
        """KV-cache memory kept across ``generate`` calls."""
        self.kv_scales = FP8KVScales() if self.kv_cache_dtype == "fp8" else None
        """FP8 KV-cache scales, or None for a cache in the model dtype."""

    @classmethod
    def check_args(cls, **kwargs: Any) -> dict[str, Any]:
        """Validate constructor arguments (all but ``model``) without building anything.

        Unknown names, and values outside what the engine runs, raise ValueError naming the argument
        and the allowed values. Returns every argument with the constructor's defaults filled in and
        normalized: ``kv_cache_dtype`` ``"auto"`` -> None, ``backend`` None -> the precision's default.
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
            if backend == "int8" and precision != "int8":
                raise ValueError(
                    f"backend='int8' (fbgemm) only runs precision='int8' in {name}, got precision={precision!r}; "
                    f"backend for precision={precision!r} must be 'emulate' or None"
                )
        args["backend"] = backend if backend is not None else _DEFAULT_BACKEND.get(precision)
        args["device"] = _check_engine_device(name, args["device"], args["backend"], precision)
        compact_below = args["compact_below"]
        if isinstance(compact_below, bool) or not isinstance(compact_below, (int, float)):
            raise ValueError(f"compact_below must be a number in [0, 1) for {name}, got {compact_below!r}")
        if not 0.0 <= compact_below < 1.0:
            raise ValueError(f"compact_below must be in [0, 1) for {name}, got {compact_below}")
        check_pad_token_id(name, args["pad_token_id"])
        return args

    # ------------------------------------------------------------------ setup
    def _check_device(self, device: torch.device) -> None:
        """Refuse a device the backend cannot run on (the model's own device is only known here)."""
        if self.backend == "int8" and device.type != "cpu":
            raise ValueError(
                f"device={str(device)!r}: backend='int8' (fbgemm W8A8) runs on CPU only; pass device='cpu' "
                "for CPU rollouts, or pick a GPU precision (bf16, fp8 with backend='fp8_gemm', engine 'te' "
                "or 'vllm')"
            )
        if self.backend == "fp8_gemm":
            _check_engine_device("TorchRolloutEngine", str(device), "fp8_gemm", self.precision)

    def _prepare_model(self) -> None:
        """Cast or quantize the private copy in place."""
        if self.precision == "bf16":
            self.model.to(torch.bfloat16)
        elif self.precision in _DEFAULT_BACKEND:
            from ais_lightning.quant import get_recipe, quantize_model

            quantize_model(self.model, get_recipe(self.precision), backend=self.backend)

    @property
    def dtype(self) -> torch.dtype:
        return self.lean.dtype

    @property
    def device(self) -> torch.device:
        return self.lean.device

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Context every forward runs in (subclasses add e.g. an FP8 autocast)."""
        return contextlib.nullcontext()

    def release_kv_cache(self) -> None:
        """Free the KV-cache memory kept between ``generate`` calls (the next call allocates it again)."""
        self.kv_workspace.release()

    def set_precision(self, precision: str) -> None:
        """Switch the engine to another emulated quantization recipe in place (progressive precision).

        For an engine on the ``emulate`` backend (fp8, fp4 and the nested integer recipes ``int8_nested``,
        ``int4``, ``int2``, ``_w``, ``_ocs``): every quantized linear re-derives its cache from the weights
        it holds (:func:`ais_lightning.quant.switch_recipe`), exactly as if the engine had been built at
        ``precision`` from its current weights; FP8 KV-cache scales are recalibrated on the next prefill. A
        precision that needs another backend or no quantization (fp32, bf16, fbgemm int8) raises ValueError
        and changes nothing: build a new engine for those.
        """
        name = "TorchRolloutEngine.set_precision"
        check_choice(name, "precision", precision, PRECISIONS)
        if precision == self.precision:
            return
        if self.backend != "emulate" or _DEFAULT_BACKEND.get(precision) is None:
            raise ValueError(
                f"{name} switches between emulated quantized precisions, got {self.precision!r} (backend "
                f"{self.backend!r}) -> {precision!r}; build a new engine for this change"
            )
        from ais_lightning.quant import get_recipe, switch_recipe

        switch_recipe(self.model, get_recipe(precision), backend="emulate")
        self.precision = precision
        if self.kv_scales is not None:
            self.kv_scales.reset()

    # ------------------------------------------------------------- weight sync
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

    def _after_sync(self) -> None:
        """Re-derive cached low-precision weights after new weights were loaded."""
        requantize(self.lean.quantized)  # empty at fp32/bf16

    # --------------------------------------------------------------- generate
    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, *, uniforms: torch.Tensor | None = None
    ) -> RolloutBatch:
        """Sample ``sampling.n`` responses per prompt (rows of one prompt are contiguous).

        ``uniforms``: an optional ``[len(prompts) * n, >= max_new_tokens]`` table in [0, 1); row ``i``
        then samples step ``t`` with ``uniforms[i, t]`` (its own noise, kept through compaction) instead
        of the seeded generator, and the batch records the table in ``extras["uniforms"]`` so that rows
        can be generated again with the same noise (``ais_lightning.rollout.coupled.regenerate``).
        """
        check_prompts(prompts, self.vocab_size)
        if uniforms is not None:
            check_uniforms(uniforms, (len(prompts) * sampling.n, -1))
            if uniforms.shape[1] < sampling.max_new_tokens:
                raise ValueError(
                    f"uniforms has {uniforms.shape[1]} columns, fewer than max_new_tokens="
                    f"{sampling.max_new_tokens}"
                )
        with self.forward_context():
            return self._generate(prompts, sampling, uniforms)

    def _generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, uniforms: torch.Tensor | None = None
    ) -> RolloutBatch:
        lean, kv_scales = self.lean, self.kv_scales
        dev, dtype, n = self.device, self.dtype, sampling.n
        num_layers = len(lean.layers)
        gen = make_generator(sampling.seed, dev)
        noise = uniforms.to(dev) if uniforms is not None else None  # [B, >= N], indexed by original row
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_token_id)  # [Bp, P]
        prompt_ids, prompt_mask = prompt_ids.to(dev), prompt_mask.to(dev)
        bp, plen = prompt_ids.shape
        batch, new = bp * n, sampling.max_new_tokens
        total = plen + new
        lengths = prompt_mask.sum(-1)  # [Bp]
        qk_ws = lean.qk_norm_weights()

        # Positions of every slot: prompt per the convention, response token t at L + t.
        pos = torch.cat(
            [
                (prompt_mask.long().cumsum(-1) - 1).clamp(min=0),
                lengths[:, None] + torch.arange(new, device=dev),
            ],
            dim=1,
        )  # [Bp, P + N]
        cos, sin = lean.rotary(lean.embed.weight[:1], pos)  # [Bp, P + N, D]
        cos, sin_signed = cos.to(dtype), sign_sin(sin.to(dtype))

        # Prefill once per distinct prompt, over its real tokens only (packed: no pad token goes through
        # the projections or the MLP); causal attention over valid keys (a pad query sees itself: no NaN).
        causal = torch.ones(plen, plen, dtype=torch.bool, device=dev).tril()  # [P, P]
        eye = torch.eye(plen, dtype=torch.bool, device=dev)
        pre_mask = (causal & prompt_mask[:, None, :]) | eye  # [Bp, P, P]
        pre_mask = pre_mask[:, None]  # [Bp, 1, P, P]
        tokens = prompt_mask.nonzero(as_tuple=True)  # (row [N], slot [N]), row-major
        last = lengths.cumsum(0) - 1  # [Bp] packed index of each prompt's last token
        cache_shape = (batch, lean.n_kv, total, lean.head_dim)
        k_caches, v_caches = self.kv_workspace.caches(cache_shape, dtype, dev)
        x = lean.embed(prompt_ids[tokens])  # [N, H]
        pre_cos, pre_sin = cos[tokens][:, None], sin_signed[tokens][:, None]  # [N, 1, D]
        for i in range(num_layers):
            # Pad slots are masked, but must hold finite values (0 * NaN is NaN in the attention GEMMs).
            k_caches[i][:bp, :, :plen].zero_()
            v_caches[i][:bp, :, :plen].zero_()
            x = lean.prefill_layer(
                i, x, pre_cos, pre_sin, k_caches[i], v_caches[i], tokens, pre_mask, qk_ws[i], kv_scales
            )
            if n > 1:  # fan the prompt's K/V out to its n sample rows (rows [0, Bp) were scratch)
                k_caches[i][:, :, :plen] = k_caches[i][:bp, :, :plen].repeat_interleave(n, dim=0)
                v_caches[i][:, :, :plen] = v_caches[i][:bp, :, :plen].repeat_interleave(n, dim=0)
        logits = lean.logits(x[last])  # [Bp, V]

        # Decode tables, per row: cos/sin of every slot and, when some prompt is padded, an additive
        # key bias (0 / -inf) already expanded over the KV heads (the attention runs on B * Hkv).
        cos, sin_signed = cos[:, :, None], sin_signed[:, :, None]  # [Bp, P + N, 1, D]
        key_bias = None
        if not bool(prompt_mask.all()):
            key_bias = torch.zeros((bp, lean.n_kv, 1, total), dtype=dtype, device=dev)
            key_bias[:, :, 0, :plen].masked_fill_(~prompt_mask[:, None], float("-inf"))  # [Bp, Hkv, 1, P+N]
        if n > 1:
            logits = logits.repeat_interleave(n, dim=0)  # [B, V]
            cos, sin_signed = cos.repeat_interleave(n, dim=0), sin_signed.repeat_interleave(n, dim=0)
            if key_bias is not None:
                key_bias = key_bias.repeat_interleave(n, dim=0)
        out_ids = torch.full((batch, new), self.pad_token_id, dtype=torch.long, device=dev)
        out_lp = torch.zeros((batch, new), dtype=torch.float32, device=dev)
        out_mask = torch.zeros((batch, new), dtype=torch.bool, device=dev)
        stopped = torch.zeros(batch, dtype=torch.bool, device=dev)
        stop_ids = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=dev)
        rows = torch.arange(batch, device=dev)  # original row of each running row
        out_rows: torch.Tensor | slice = slice(None)  # rows to write outputs to: all until compaction
        alive = torch.ones(batch, dtype=torch.bool, device=dev)  # [R]
        steps = 0
        for t in range(new):
            u = noise[rows, t] if noise is not None else None  # [R]
            tok, lp = sample_next(logits, sampling.temperature, sampling.top_k, sampling.top_p, gen, u)  # [R]
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
                    k_caches = [c[keep] for c in k_caches]
                    v_caches = [c[keep] for c in v_caches]
                    cos, sin_signed = cos[keep], sin_signed[keep]
                    key_bias = key_bias[keep] if key_bias is not None else None
                    rows, alive, tok = rows[keep], alive[keep], tok[keep]
                    out_rows = rows
            slot = plen + t
            x = lean.embed(tok)  # [R, H]
            step_bias = key_bias[..., : slot + 1] if key_bias is not None else None  # [R, Hkv, 1, slot + 1]
            step_cos, step_sin = cos[:, slot], sin_signed[:, slot]  # [R, 1, D]
            for i in range(num_layers):
                x = lean.decode_layer(
                    i, x, step_cos, step_sin, k_caches[i], v_caches[i], slot, step_bias, qk_ws[i], kv_scales
                )
            logits = lean.logits(x)  # [R, V]

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
        )
