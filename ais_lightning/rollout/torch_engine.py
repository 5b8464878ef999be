"""A pure-PyTorch batched rollout engine with a preallocated KV cache.

``TorchRolloutEngine`` owns a deep copy of a Hugging Face causal LM (like vLLM owns its weights),
optionally quantized (``ais_lightning.quant``), and samples with one prefill forward followed by
lean single-token decode steps. The decode step calls the model's own submodules (norms,
projections, MLP, lm_head: so quantized ``QuantLinear`` layers are used as they are) but not
HF's generic forward/cache machinery, which costs more per step than the math on small models.

Supported architectures: the Llama family layout that Qwen3, Qwen2 and Llama share
(``model.model.{embed_tokens, layers, norm, rotary_emb}``, ``model.lm_head``, attention with
``q_proj/k_proj/v_proj/o_proj`` and optional per-head ``q_norm/k_norm``), full attention only.

Position convention (shared with ``ais_lightning.policy``): prompts are LEFT-padded and
``position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)``, so response token ``t`` of a
prompt of length ``L`` sits at position ``L + t``.

FP8 KV cache (``kv_cache_dtype="fp8"``, FP8-RL arXiv 2601.18150): keys (after RoPE) and values are
stored fake-quantized to E4M3 with one scale per (layer, KV head). Scales are calibrated *on the
fly*: the prefill of the first ``generate`` after construction or after each ``sync_weights``
measures the per-head amax of K and V over the valid prompt tokens of that batch and fixes the
scales until the next sync (values beyond the calibrated amax saturate). The prefill itself
attends over the quantized K/V, exactly as the decode steps read them from the cache.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ais_lightning.rollout.base import RolloutBatch, SamplingConfig
from ais_lightning.rollout.sampling import make_generator, sample_next

PRECISIONS = ("fp32", "bf16", "fp8", "fp4", "int8")
"""Weight/activation precisions the torch engine supports."""
KV_CACHE_DTYPES = (None, "fp8")
"""KV-cache storage formats: None = the model dtype, ``"fp8"`` = fake-quantized E4M3."""
QUANT_BACKENDS = ("emulate", "int8")
"""``ais_lightning.quant.quantize_model`` backends."""
_DEFAULT_BACKEND = {"fp8": "emulate", "fp4": "emulate", "int8": "int8"}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (Su et al. 2021, RoFormer), HF's half-rotation layout.

    x: ``[B, H, T, D]``; cos, sin: ``[B, T, D]``.
    """
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


def left_pad(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token-id lists into ``(ids [B, P] long, mask [B, P] bool)``."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        if p:
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = True
    return ids, mask


class TorchRolloutEngine:
    """Batched sampler over a private (optionally quantized) copy of ``model``.

    Args:
        model: a Hugging Face causal LM with the Llama-family layout (Qwen3, Qwen2, Llama).
            It is deep-copied; the caller's module is never modified.
        precision: ``fp32`` | ``bf16`` | ``fp8`` (blockwise E4M3 W8A8) | ``fp4`` (NVFP4) | ``int8``.
        kv_cache_dtype: None (model dtype) or ``"fp8"`` (E4M3 fake-quantized, per-head scales).
        backend: quantization backend for fp8/fp4/int8: ``"emulate"`` (exact-numerics fake
            quantization) or ``"int8"`` (fbgemm dynamic W8A8, the real CPU speed path, int8 only).
            Defaults: fp8/fp4 -> emulate, int8 -> int8.
        pad_token_id: id used to pad prompts and responses; default ``config.pad_token_id`` or 0.
        compact_below: when the fraction of still-running rows drops to this or below, finished
            rows are dropped from the batch (one gather of the KV cache) so they stop costing work.
            0 disables compaction.
    """

    def __init__(
        self,
        model: nn.Module,
        precision: str = "fp32",
        kv_cache_dtype: str | None = None,
        backend: str | None = None,
        *,
        pad_token_id: int | None = None,
        compact_below: float = 0.5,
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        if backend is not None:
            if precision not in _DEFAULT_BACKEND:
                raise ValueError(
                    f"backend is only used with precision fp8/fp4/int8, got backend={backend!r} "
                    f"with precision={precision!r}"
                )
            if backend not in QUANT_BACKENDS:
                raise ValueError(f"backend must be one of {QUANT_BACKENDS}, got {backend!r}")
            if backend == "int8" and precision != "int8":
                raise ValueError(f"backend='int8' (fbgemm) only runs precision='int8', got {precision!r}")
        if not 0.0 <= compact_below < 1.0:
            raise ValueError(f"compact_below must be in [0, 1), got {compact_below}")
        self.precision = precision
        self.kv_cache_dtype = kv_cache_dtype
        self.backend = backend if backend is not None else _DEFAULT_BACKEND.get(precision)
        self.compact_below = compact_below

        self.model = copy.deepcopy(model).eval()
        self.model.requires_grad_(False)
        self._prepare_model()
        self._bind_architecture()
        self._fuse_projections()
        cfg = self.model.config
        if pad_token_id is None:
            pad_token_id = getattr(cfg, "pad_token_id", None)
        self.pad_token_id = int(pad_token_id) if pad_token_id is not None else 0
        self._kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    # ------------------------------------------------------------------ setup
    def _prepare_model(self) -> None:
        """Cast or quantize the private copy in place."""
        if self.precision == "bf16":
            self.model.to(torch.bfloat16)
        elif self.precision in _DEFAULT_BACKEND:
            from ais_lightning.quant import get_recipe, quantize_model

            quantize_model(self.model, get_recipe(self.precision), backend=self.backend)

    def _bind_architecture(self) -> None:
        """Find the submodules the lean forward calls; raise on layouts it does not cover."""
        inner = getattr(self.model, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if inner is None or not all(hasattr(inner, a) for a in needed) or not hasattr(self.model, "lm_head"):
            raise ValueError(
                f"TorchRolloutEngine supports Llama-family causal LMs (model.model.{{{', '.join(needed)}}} and "
                f"model.lm_head; e.g. Qwen3, Qwen2, Llama), got {type(self.model).__name__}"
            )
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            if getattr(attn, "sliding_window", None):
                raise ValueError(
                    f"layer {i} uses sliding-window attention, which TorchRolloutEngine does not support"
                )
        cfg = self.model.config
        self._embed = inner.embed_tokens
        self._layers = list(inner.layers)
        self._norm = inner.norm
        self._rotary = inner.rotary_emb
        self._lm_head = self.model.lm_head
        self._n_heads = cfg.num_attention_heads
        self._n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self._head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self._scaling = [
            float(getattr(layer.self_attn, "scaling", self._head_dim**-0.5)) for layer in self._layers
        ]
        self.vocab_size = cfg.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        return self._embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self._embed.weight.device

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Context every forward runs in (subclasses add e.g. an FP8 autocast)."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------- weight sync
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the trainer's weights and buffers, re-quantize, and mark KV scales for recalibration.

        ``named_tensors``: ``(name, tensor)`` pairs named like the trainer model's parameters and
        buffers, e.g. ``Policy.full_state_dict()`` (quantized copies keep the same names). Unknown
        names raise ValueError naming them, before anything is copied; names not sent keep their
        current value (a partial sync is allowed). Values are cast to the engine's dtype/device.
        """
        from ais_lightning.policy import load_named_tensors

        incoming = list(named_tensors)
        known = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        known |= {n for n, _ in self.model.named_buffers(remove_duplicate=False)}
        unknown = sorted({n for n, _ in incoming} - known)
        if unknown:  # checked before copying anything, so a bad sync leaves the engine unchanged
            shown = ", ".join(unknown[:10]) + (" ..." if len(unknown) > 10 else "")
            raise ValueError(
                f"sync_weights got {len(unknown)} names the engine's model does not have: {shown}"
            )
        load_named_tensors(self.model, incoming)
        self._after_sync()
        self._kv_scales = None  # recalibrated on the next prefill

    def _after_sync(self) -> None:
        """Re-derive cached low-precision weights after new weights were loaded."""
        if self.precision in _DEFAULT_BACKEND:
            from ais_lightning.quant import refresh_quantized

            refresh_quantized(self.model)

    # ---------------------------------------------------------------- forward
    def _kv_store(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V as the cache stores them (fake-quantized for an FP8 cache).  k, v: [B, Hkv, T, D]

        ``valid`` ([B, T] bool) is given at prefill; if the scales are stale it calibrates them.
        """
        if self.kv_cache_dtype is None:
            return k, v
        from ais_lightning.quant import fake_quantize_kv, kv_scale_from_amax

        if self._kv_scales is None or len(self._kv_scales) <= layer:
            if valid is None:
                raise RuntimeError("FP8 KV scales must be calibrated by a prefill before decoding")
            if self._kv_scales is None:
                self._kv_scales = []
            w = valid[:, None, :, None]  # [B, 1, T, 1]
            k_amax = torch.where(w, k.float().abs(), 0.0).amax(dim=(0, 2, 3))  # [Hkv]
            v_amax = torch.where(w, v.float().abs(), 0.0).amax(dim=(0, 2, 3))  # [Hkv]
            self._kv_scales.append((kv_scale_from_amax(k_amax), kv_scale_from_amax(v_amax)))
        k_scale, v_scale = self._kv_scales[layer]  # [Hkv] each
        return fake_quantize_kv(k, k_scale), fake_quantize_kv(v, v_scale)

    def _fuse_projections(self) -> None:
        """Give q/k/v and gate/up one weight each, so a decode step runs 2 GEMMs where it ran 5.

        Only for plain ``nn.Linear`` layers (fp32/bf16; quantized layers keep their own per-module
        scales). The module weights become views into the fused tensor, so weight sync by copying
        into them updates the fused weight with no extra memory and no re-fusion.
        """
        self._fused: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None] = []
        for layer in self._layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
            gu = [getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)]
            plain = all(type(m) is nn.Linear for m in qkv + gu)
            if not plain or gu[0].bias is not None or gu[1].bias is not None:
                self._fused.append(None)
                continue
            self._fused.append((self._fuse(qkv, "weight"), self._fuse(qkv, "bias"), self._fuse(gu, "weight")))

    @staticmethod
    def _fuse(mods: list[nn.Linear], attr: str) -> torch.Tensor | None:
        params = [getattr(m, attr) for m in mods]
        if any(p is None for p in params):
            return None
        fused = torch.cat([p.detach() for p in params], dim=0)  # [sum N, K] or [sum N]
        start = 0
        for m, p in zip(mods, params):
            view = fused[start : start + p.shape[0]]
            setattr(m, attr, nn.Parameter(view, requires_grad=False))
            start += p.shape[0]
        return fused

    @staticmethod
    def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """HF RMSNorm modules through the fused ``F.rms_norm`` kernel in fp32, else the module."""
        eps = getattr(norm, "variance_epsilon", None)
        if eps is not None and x.dtype == torch.float32 and type(norm).__name__.endswith("RMSNorm"):
            return F.rms_norm(x, (x.shape[-1],), norm.weight, eps)
        return norm(x)

    def _decode_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Single-query attention with grouped KV heads as two small batched GEMMs.

        q: [B, Hq, 1, D]; k, v: [B, Hkv, L, D]; bias: [B, 1, 1, L] additive (0 / -inf). Returns [B, 1, Hq * D].
        Query head h reads KV head h // (Hq / Hkv), as HF's ``repeat_kv``.
        """
        b = q.shape[0]
        qg = q.reshape(b, self._n_kv, -1, self._head_dim)  # [B, Hkv, G, D]
        scores = torch.matmul(qg, k.transpose(-1, -2)) * scale + bias  # [B, Hkv, G, L]
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        return torch.matmul(probs, v).reshape(b, 1, -1)  # [B, 1, Hq * D]

    def _attention_block(
        self,
        i: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        start: int,
        attn_mask: torch.Tensor,
        valid: torch.Tensor | None,
    ) -> torch.Tensor:
        """One decoder layer over ``x`` [B, T, H] written at cache slots ``start:start+T``.

        ``attn_mask``: prefill (T > 1) a bool [B, 1, T, T] mask for SDPA; decode (T == 1) an additive
        float bias [B, 1, 1, start + 1].
        """
        layer = self._layers[i]
        attn = layer.self_attn
        fused = self._fused[i]
        b, t, _ = x.shape
        nq, nkv, d = self._n_heads, self._n_kv, self._head_dim
        h = self._rms_norm(layer.input_layernorm, x)  # [B, T, H]
        if fused is not None:
            qkv = F.linear(h, fused[0], fused[1])  # [B, T, (Hq + 2 Hkv) D]
            q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
        else:
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        q = q.view(b, t, nq, d)  # [B, T, Hq, D]
        k = k.view(b, t, nkv, d)  # [B, T, Hkv, D]
        v = v.view(b, t, nkv, d).transpose(1, 2)  # [B, Hkv, T, D]
        if hasattr(attn, "q_norm"):
            q = self._rms_norm(attn.q_norm, q)
            k = self._rms_norm(attn.k_norm, k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, Hq, T, D]
        k = apply_rope(k.transpose(1, 2), cos, sin)  # [B, Hkv, T, D]
        k, v = self._kv_store(i, k, v, valid)
        end = start + t
        k_cache[:b, :, start:end] = k
        v_cache[:b, :, start:end] = v
        if t == 1:
            out = self._decode_attention(
                q, k_cache[:b, :, :end], v_cache[:b, :, :end], attn_mask, self._scaling[i]
            )
        else:
            out = F.scaled_dot_product_attention(
                q,
                k_cache[:b, :, :end],
                v_cache[:b, :, :end],
                attn_mask=attn_mask,
                scale=self._scaling[i],
                enable_gqa=nq != nkv,
            )  # [B, Hq, T, D]
            out = out.transpose(1, 2).reshape(b, t, -1)  # [B, T, Hq * D]
        x = x + attn.o_proj(out)
        h = self._rms_norm(layer.post_attention_layernorm, x)
        if fused is not None:
            gate, up = F.linear(h, fused[2]).chunk(2, dim=-1)  # [B, T, I] each
            return x + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
        return x + layer.mlp(h)

    # --------------------------------------------------------------- generate
    def _check_prompts(self, prompts: list[list[int]]) -> None:
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        for i, p in enumerate(prompts):
            if not isinstance(p, (list, tuple)) or not p:
                raise ValueError(f"prompts[{i}] must be a non-empty list of token ids")
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise ValueError(f"prompts[{i}] has token ids outside [0, {self.vocab_size})")

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> RolloutBatch:
        """Sample ``sampling.n`` responses per prompt (rows of one prompt are contiguous)."""
        self._check_prompts(prompts)
        with self.forward_context():
            return self._generate(prompts, sampling)

    def _generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> RolloutBatch:
        dev, dtype, n = self.device, self.dtype, sampling.n
        gen = make_generator(sampling.seed, dev)
        prompt_ids, prompt_mask = left_pad([list(p) for p in prompts], self.pad_token_id)  # [Bp, P]
        prompt_ids, prompt_mask = prompt_ids.to(dev), prompt_mask.to(dev)
        bp, plen = prompt_ids.shape
        batch, new = bp * n, sampling.max_new_tokens
        total = plen + new
        lengths = prompt_mask.sum(-1)  # [Bp]

        # Positions of every slot: prompt per the convention, response token t at L + t.
        pos = torch.cat(
            [
                (prompt_mask.long().cumsum(-1) - 1).clamp(min=0),
                lengths[:, None] + torch.arange(new, device=dev),
            ],
            dim=1,
        )  # [Bp, P + N]
        cos, sin = self._rotary(self._embed.weight[:1], pos)  # [Bp, P + N, D]
        cos, sin = cos.to(dtype), sin.to(dtype)
        key_valid = torch.cat(
            [prompt_mask, torch.ones(bp, new, dtype=torch.bool, device=dev)], dim=1
        )  # [Bp, P+N]

        # Prefill once per distinct prompt; causal, valid keys only (a pad query sees itself, no NaN).
        causal = torch.ones(plen, plen, dtype=torch.bool, device=dev).tril()  # [P, P]
        eye = torch.eye(plen, dtype=torch.bool, device=dev)
        pre_mask = (causal & prompt_mask[:, None, :]) | eye  # [Bp, P, P]
        pre_mask = pre_mask[:, None]  # [Bp, 1, P, P]
        cache_shape = (batch, self._n_kv, total, self._head_dim)
        k_caches = [torch.empty(cache_shape, dtype=dtype, device=dev) for _ in self._layers]
        v_caches = [torch.empty(cache_shape, dtype=dtype, device=dev) for _ in self._layers]
        x = self._embed(prompt_ids)  # [Bp, P, H]
        for i in range(len(self._layers)):
            x = self._attention_block(
                i, x, cos[:, :plen], sin[:, :plen], k_caches[i], v_caches[i], 0, pre_mask, prompt_mask
            )
            if n > 1:  # fan the prompt's K/V out to its n sample rows (rows [0, Bp) were scratch)
                k_caches[i][:, :, :plen] = k_caches[i][:bp, :, :plen].repeat_interleave(n, dim=0)
                v_caches[i][:, :, :plen] = v_caches[i][:bp, :, :plen].repeat_interleave(n, dim=0)
        logits = self._lm_head(self._rms_norm(self._norm, x[:, -1]))  # [Bp, V]

        if n > 1:
            logits = logits.repeat_interleave(n, dim=0)  # [B, V]
            cos, sin = cos.repeat_interleave(n, dim=0), sin.repeat_interleave(n, dim=0)
            key_valid = key_valid.repeat_interleave(n, dim=0)
        key_bias = torch.zeros(key_valid.shape, dtype=dtype, device=dev).masked_fill_(
            ~key_valid, float("-inf")
        )
        out_ids = torch.full((batch, new), self.pad_token_id, dtype=torch.long, device=dev)
        out_lp = torch.zeros((batch, new), dtype=torch.float32, device=dev)
        out_mask = torch.zeros((batch, new), dtype=torch.bool, device=dev)
        stopped = torch.zeros(batch, dtype=torch.bool, device=dev)
        stop_ids = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=dev)
        rows = torch.arange(batch, device=dev)  # original row of each running row
        alive = torch.ones(batch, dtype=torch.bool, device=dev)  # [R]
        steps = 0
        for t in range(new):
            tok, lp = sample_next(logits, sampling.temperature, sampling.top_k, sampling.top_p, gen)  # [R]
            out_ids[rows, t] = torch.where(alive, tok, self.pad_token_id)
            out_lp[rows, t] = torch.where(alive, lp, 0.0)
            out_mask[rows, t] = alive
            steps = t + 1
            if stop_ids.numel():
                hit = alive & torch.isin(tok, stop_ids)
                stopped[rows[hit]] = True
                alive = alive & ~hit
            if t + 1 == new:
                break
            n_alive = int(alive.sum())
            if n_alive == 0:
                break
            if n_alive <= self.compact_below * rows.numel():
                keep = alive.nonzero().squeeze(-1)  # [R']
                k_caches = [c[keep] for c in k_caches]
                v_caches = [c[keep] for c in v_caches]
                cos, sin, key_bias = cos[keep], sin[keep], key_bias[keep]
                rows, alive, tok = rows[keep], alive[keep], tok[keep]
            slot = plen + t
            x = self._embed(tok[:, None])  # [R, 1, H]
            step_bias = key_bias[:, None, None, : slot + 1]  # [R, 1, 1, slot + 1]
            for i in range(len(self._layers)):
                x = self._attention_block(
                    i,
                    x,
                    cos[:, slot : slot + 1],
                    sin[:, slot : slot + 1],
                    k_caches[i],
                    v_caches[i],
                    slot,
                    step_bias,
                    None,
                )
            logits = self._lm_head(self._rms_norm(self._norm, x[:, 0]))  # [R, V]

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
        )
