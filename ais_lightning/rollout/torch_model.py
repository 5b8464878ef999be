"""The lean forward of a Llama-family causal LM: architecture binding, fused q/k/v, per-layer math.

:class:`LeanLlama` finds the submodules of a Hugging Face causal LM that the torch engine calls
(``model.model.{embed_tokens, layers, norm, rotary_emb}``, ``model.lm_head``; attention with
``q_proj/k_proj/v_proj/o_proj`` and optional per-head ``q_norm/k_norm``: Llama, Mistral, Qwen2, Qwen3,
Gemma; full attention only, :func:`lean_unsupported` says what else it refuses) and runs one decoder
layer at a time over a caller-owned KV cache: a packed prefill
layer (projections and MLP on the real prompt tokens only) and a single-token decode layer. It calls
the model's own submodules (norms, projections, MLP, lm_head: quantized ``QuantLinear`` layers are
used as they are) but not HF's generic forward/cache machinery, which costs more per step than the
math on small models. q/k/v run as one GEMM where that is exact (plain and integer-GEMM int8 linears).

The layer math follows HF's ``transformers/models/qwen3/modeling_qwen3.py`` (RMSNorm, half-rotation
RoPE, grouped-query attention via ``repeat_kv``, gated SiLU MLP), rearranged into fewer kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ais_lightning.quant.cpu_int8 import INTEGER_BACKENDS
from ais_lightning.rollout.kv_cache import FP8KVScales


def sign_sin(sin: torch.Tensor) -> torch.Tensor:
    """``[-sin_1, sin_2]`` (halves of the last dim): the sign of ``rotate_half`` folded into sin."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (Su et al. 2021, RoFormer) in HF's half-rotation layout.  x: [..., D]

    HF computes ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x_2, x_1]``. With the sign
    folded into ``sin_signed = [-sin_1, sin_2]`` (:func:`sign_sin`), rotate_half becomes a plain swap
    of the halves, ``[x_2, x_1] * [-sin_1, sin_2] == [-x_2, x_1] * [sin_1, sin_2]`` exactly, and the
    whole rotation is 3 kernels (mul, flip, addcmul) instead of 5 (mul, neg, cat, mul, add). addcmul's
    fused multiply-add rounds once where HF rounds twice: results may differ from HF's in the last bit.
    cos, sin_signed broadcast against x.
    """
    half = x.shape[-1] // 2
    swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)  # [..., D] = [x_2, x_1]
    return (x * cos).addcmul_(swapped, sin_signed)


def linear_residual(x: torch.Tensor, h: torch.Tensor, linear: nn.Module) -> torch.Tensor:
    """``x + linear(h)``; a bias-free plain ``nn.Linear`` runs as one ``addmm`` (the residual add fused).

    Other ``nn.Linear`` subclasses (``QuantLinear``) return a fresh output, which takes the residual in
    place (``y + x == x + y`` exactly): one ``[M, H]`` allocation less per call.
    """
    if type(linear) is nn.Linear and linear.bias is None:
        out = torch.addmm(x.reshape(-1, x.shape[-1]), h.reshape(-1, h.shape[-1]), linear.weight.t())
        return out.view(x.shape)
    y = linear(h)
    if isinstance(linear, nn.Linear) and y.shape == x.shape and y.dtype == x.dtype:
        return y.add_(x)
    return x + y


def act_in_place(act: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``act(x)``, written into ``x`` when ``act`` is SiLU (torch's or HF's ``SiLUActivation``), else a new tensor.

    The MLP's gate output is a fresh tensor nobody else reads, so overwriting it is safe and saves an
    ``[M, I]`` allocation per layer: at prefill (M = 1024, I = 3072) that is 12.6 MB of first-touch page
    faults each, which cost more than the SiLU itself on this VM. Same kernel, so bit-identical.
    """
    if type(act).__name__ in ("SiLU", "SiLUActivation"):
        return F.silu(x, inplace=True)
    return act(x)


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF RMSNorm modules through the fused ``F.rms_norm`` kernel in fp32, else the module."""
    eps = getattr(norm, "variance_epsilon", None)
    if eps is not None and x.dtype == torch.float32 and type(norm).__name__.endswith("RMSNorm"):
        return F.rms_norm(x, (x.shape[-1],), norm.weight, eps)
    return norm(x)


def fused_linear(mods: list[nn.Linear]) -> nn.Linear:
    """An ``nn.Linear`` whose weight (and bias) concatenate ``mods``' along the output dim.

    ``mods``' weights and biases are replaced by views into the fused tensors (same values), so a
    weight sync that copies into them updates the fused weight with no extra memory.
    """
    fused = nn.Linear(mods[0].in_features, sum(m.out_features for m in mods), bias=False, device="meta")
    for attr in ("weight", "bias"):
        params = [getattr(m, attr) for m in mods]
        if any(p is None for p in params):
            continue
        whole = torch.cat([p.detach() for p in params], dim=0)  # [sum N, K] or [sum N]
        start = 0
        for m, p in zip(mods, params):
            view = whole[start : start + p.shape[0]]
            setattr(m, attr, nn.Parameter(view, requires_grad=False))
            start += p.shape[0]
        setattr(fused, attr, nn.Parameter(whole, requires_grad=False))
    return fused


LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma")
"""``config.model_type`` of the families whose Hugging Face forward :class:`LeanLlama` reproduces (each is
checked against the model's own forward in the tests): pre-norm decoder layers, full causal attention with
q/k/v/o projections (optional biases and per-head q/k norms), RoPE from the model's ``rotary_emb``, a gated
or plain MLP module, ``lm_head`` logits used as they are."""
_SEQUENCE_DEPENDENT_ROPE = ("dynamic", "longrope")
"""RoPE types whose frequencies depend on the length of the sequence being run (the lean forward computes
the angles of all positions at once, Hugging Face's decode one position at a time)."""


def _rope_types(config: object) -> set[str]:
    """Every ``rope_type`` named in ``config.rope_parameters`` / ``rope_scaling`` (nested per layer type too)."""
    found: set[str] = set()
    stack = [getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if key in ("rope_type", "type") and isinstance(value, str):
                    found.add(value)
                elif isinstance(value, dict):
                    stack.append(value)
    return found


def _sliding_window(config: object) -> str | None:
    """How ``config`` asks for sliding-window attention (the mask, not the attention module, applies it in
    Hugging Face's Mistral / Qwen2 / Qwen3), or None for full attention in every layer."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        sliding = [i for i, kind in enumerate(layer_types) if "sliding" in str(kind)]
        return f"layer_types {layer_types[sliding[0]]!r} in layer {sliding[0]}" if sliding else None
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        return f"sliding_window={window}"
    return None


def lean_unsupported(model: nn.Module) -> str | None:
    """Why :class:`LeanLlama` cannot run ``model`` exactly, or None when it can.

    The model must be one of :data:`LEAN_MODEL_TYPES` with their layout (``model.model.{embed_tokens, layers,
    norm, rotary_emb}``, ``model.lm_head``, ``self_attn.{q,k,v,o}_proj``), no sliding-window layer, no logit
    transform and no sequence-length-dependent RoPE. Anything else runs the model's own forward
    (``TorchRolloutEngine(model_impl="transformers")``).
    """
    from ais_lightning.models.head import logit_transform

    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in LEAN_MODEL_TYPES:
        return f"model_type {model_type!r} is not one it implements {LEAN_MODEL_TYPES}"
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, a) for a in needed) or not hasattr(model, "lm_head"):
        return f"it needs model.model.{{{', '.join(needed)}}} and model.lm_head"
    for i, layer in enumerate(inner.layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, f"{p}_proj") for p in "qkvo"):
            return f"layer {i} has no self_attn.{{q,k,v,o}}_proj"
        if getattr(attn, "sliding_window", None):
            return f"layer {i} uses sliding-window attention"
    window = _sliding_window(config)
    if window is not None:
        return f"it uses sliding-window attention ({window})"
    transform = logit_transform(config)
    if not transform.is_identity:
        return f"its forward transforms the logits ({transform})"
    dependent = sorted(_rope_types(config) & set(_SEQUENCE_DEPENDENT_ROPE))
    if dependent:
        return f"its RoPE type {dependent[0]!r} depends on the sequence length"
    return None


class LeanLlama:
    """The submodules of a Llama-family causal LM bound for the lean forward, with fused q/k/v.

    Binds ``model`` in place (its q/k/v weights become views into fused weights); raises ValueError
    on a model it does not reproduce exactly (:func:`lean_unsupported` says why).

    Attributes: ``embed``, ``layers``, ``norm``, ``rotary``, ``lm_head`` (the model's modules);
    ``n_heads``, ``n_kv``, ``head_dim``, ``vocab_size``; ``scaling`` (per layer attention scale);
    ``gated`` (per layer: a ``down(act(gate(x)) * up(x))`` MLP the lean path unrolls); ``qkv`` (per
    layer: the fused q/k/v module or None); ``quantized`` (every ``QuantLinear`` the lean forward
    calls, once: what a weight sync re-quantizes); ``gate_up`` (per layer: the fused gate/up module of
    integer-GEMM int8 linears, or None).
    """

    def __init__(self, model: nn.Module) -> None:
        reason = lean_unsupported(model)
        if reason is not None:
            raise ValueError(f"the lean forward cannot run {type(model).__name__}: {reason}")
        inner = model.model
        cfg = model.config
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scaling = [
            float(getattr(layer.self_attn, "scaling", self.head_dim**-0.5)) for layer in self.layers
        ]
        self.vocab_size = cfg.vocab_size
        self.gated = [
            all(hasattr(layer.mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn"))
            for layer in self.layers
        ]
        self._fuse_projections(model)

    def _fuse_projections(self, model: nn.Module) -> None:
        """Give q/k/v one weight, so the attention projections run as 1 GEMM where they ran 3.

        Per layer, ``self.qkv[i]`` becomes one linear module computing ``[q | k | v]``, or None (the three
        modules are called and concatenated). The q/k/v weights become views into the fused weight
        (:func:`fused_linear`).

        - plain ``nn.Linear`` (fp32/bf16): an ``nn.Linear`` over the concatenated weight.
        - int8 ``QuantLinear`` on an integer GEMM (``backend`` ``"int8"`` or ``"fbgemm"``): one such
          ``QuantLinear`` over the concatenated weight. This is exact: weights are quantized per output channel (concatenation keeps
          every row's scale) and the activation per token, the same ``h`` for q, k and v, so one activation
          quantization serves all three; their outlier channels, picked from the ranges of that same ``h``,
          are one set too. A weight sync re-quantizes it (not the three).
        - emulated recipes keep three modules (per-tensor weight scales would change under fusion).

        gate/up are fused only for the integer-GEMM int8 linears (``self.gate_up[i]``, else None): one
        activation quantization and one outlier-channel product serve both, which saves more than the GEMM
        loses. Plain linears keep two GEMMs: at the decode shape (M = batch) one ``[M, H] x [H, 2 I]`` GEMM
        was slower than two ``[M, H] x [H, I]`` ones on CPU (MKL, e.g. 16.3 vs 2 x 5.8 ms for H = 1024,
        I = 3072, M = 64 on 2 threads), presumably because the ``[M, 2 I]`` output tile no longer fits the
        per-core L2.
        """
        from ais_lightning.quant import QuantLinear

        def integer(mods: list[nn.Module]) -> bool:
            backend = getattr(mods[0], "backend", None)
            return backend in INTEGER_BACKENDS and all(
                type(m) is QuantLinear and m.backend == backend for m in mods
            )

        self.qkv: list[nn.Module | None] = []
        self.gate_up: list[nn.Module | None] = []
        covered: set[int] = set()
        for layer, gated in zip(self.layers, self.gated):
            attn = layer.self_attn
            mods = [attn.q_proj, attn.k_proj, attn.v_proj]
            if all(type(m) is nn.Linear for m in mods):
                self.qkv.append(fused_linear(mods))
            elif integer(mods):
                self.qkv.append(QuantLinear.from_linear(fused_linear(mods), mods[0].recipe, mods[0].backend))
                covered.update(id(m) for m in mods)
            else:
                self.qkv.append(None)
            mlp = [layer.mlp.gate_proj, layer.mlp.up_proj] if gated else []
            if mlp and integer(mlp):
                self.gate_up.append(QuantLinear.from_linear(fused_linear(mlp), mlp[0].recipe, mlp[0].backend))
                covered.update(id(m) for m in mlp)
            else:
                self.gate_up.append(None)
        # q/k/v modules a fused int8 layer replaces are not re-packed per sync (their QuantLinear stamp check
        # re-packs them if they are ever called directly, e.g. through engine.model).
        self.quantized: list[nn.Module] = [
            m for m in model.modules() if isinstance(m, QuantLinear) and id(m) not in covered
        ]
        self.quantized += [f for f in (*self.qkv, *self.gate_up) if isinstance(f, QuantLinear)]

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def qk_norm_weights(self) -> list[torch.Tensor | None]:
        """Per layer, the q_norm/k_norm weights stacked per head, ``[Hq + Hkv, D]``, or None.

        Built once per ``generate`` (weights cannot change inside it), so q and k are normalized by
        one ``F.rms_norm`` over ``[..., Hq + Hkv, D]`` and one multiply. None where the layer has no
        q/k norm or the fast path does not apply (non-fp32 or non-RMSNorm: the modules are called).
        """
        weights = []
        for layer in self.layers:
            attn = layer.self_attn
            qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            fast = (
                qn is not None
                and self.dtype == torch.float32
                and all(type(m).__name__.endswith("RMSNorm") for m in (qn, kn))
                and getattr(qn, "variance_epsilon", None) == getattr(kn, "variance_epsilon", -1)
            )
            if not fast:
                weights.append(None)
                continue
            d = self.head_dim
            w = torch.cat([qn.weight.expand(self.n_heads, d), kn.weight.expand(self.n_kv, d)])
            weights.append(w)  # [Hq + Hkv, D]
        return weights

    def project_qkv(
        self, i: int, h: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, qk_w: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q/k/v of normed hidden states ``h [..., H]``, with q/k-norm and RoPE applied to q and k together.

        cos, sin_signed broadcast against ``[..., Hq + Hkv, D]``. Returns q ``[..., Hq, D]``,
        k ``[..., Hkv, D]``, v ``[..., Hkv, D]``.
        """
        attn = self.layers[i].self_attn
        nq, nkv, d = self.n_heads, self.n_kv, self.head_dim
        if self.qkv[i] is not None:
            qkv = self.qkv[i](h)  # [..., (Hq + 2 Hkv) D]
        else:  # emulated quantization / other linears: one module each, concatenated so RoPE runs once
            qkv = torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], dim=-1)
        qk = qkv[..., : (nq + nkv) * d].unflatten(-1, (nq + nkv, d))  # [..., Hq + Hkv, D]
        v = qkv[..., (nq + nkv) * d :].unflatten(-1, (nkv, d))  # [..., Hkv, D]
        if qk_w is not None:
            qk = F.rms_norm(qk, (d,), None, attn.q_norm.variance_epsilon).mul_(qk_w)
        elif hasattr(attn, "q_norm"):
            qk = torch.cat([attn.q_norm(qk[..., :nq, :]), attn.k_norm(qk[..., nq:, :])], dim=-2)
        qk = rope(qk, cos, sin_signed)
        return qk[..., :nq, :], qk[..., nq:, :], v

    def mlp_residual(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """``x + MLP(post_attention_layernorm(x))`` for ``x [..., H]``."""
        layer = self.layers[i]
        mlp = layer.mlp
        h = rms_norm(layer.post_attention_layernorm, x)
        if not self.gated[i]:
            return x + mlp(h)
        if self.gate_up[i] is not None:  # integer int8: one GEMM (_fuse_projections)
            gate, up = self.gate_up[i](h).chunk(2, dim=-1)  # [..., I] views of [..., 2 I]
        else:
            gate = mlp.gate_proj(h)  # [..., I]; two GEMMs, not one fused (_fuse_projections)
            up = mlp.up_proj(h)  # [..., I]
        return linear_residual(x, act_in_place(mlp.act_fn, gate).mul_(up), mlp.down_proj)

    def prefill_layer(
        self,
        i: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tokens: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        qk_w: torch.Tensor | None,
        kv_scales: FP8KVScales | None,
    ) -> torch.Tensor:
        """One decoder layer over the packed prompt tokens ``x [N, H]`` (no pad tokens).

        ``tokens = (row, slot)``, each ``[N]``: where packed token j sits in the padded ``[B, P]`` batch.
        Projections and the MLP run on the N real tokens only; the attention runs padded (SDPA, bool
        ``mask [B, 1, P, P]``) with K/V written to cache slots ``0:P`` (pad slots must already be 0).
        cos, sin_signed: ``[N, 1, D]``. ``kv_scales``: an FP8 KV cache's scales (calibrated here when
        stale), or None for a cache in the model dtype.
        """
        layer = self.layers[i]
        row, slot = tokens
        b, _, p = mask.shape[:3]
        h = rms_norm(layer.input_layernorm, x)  # [N, H]
        q, k, v = self.project_qkv(i, h, cos, sin_signed, qk_w)  # [N, heads, D]
        if kv_scales is not None:  # store() takes [B, Hkv, T, D]: pass the N tokens as one row
            all_valid = torch.ones((1, k.shape[0]), dtype=torch.bool, device=k.device)
            k4, v4 = kv_scales.store(i, k.transpose(0, 1)[None], v.transpose(0, 1)[None], all_valid)
            k, v = k4[0].transpose(0, 1), v4[0].transpose(0, 1)  # [N, Hkv, D]
        k_cache[row, :, slot] = k  # cache [B, Hkv, T, D] at (row, :, slot) <- [N, Hkv, D]
        v_cache[row, :, slot] = v
        q_pad = q.new_zeros(b, p, *q.shape[1:])  # [B, P, Hq, D]
        q_pad[row, slot] = q
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2),
            k_cache[:b, :, :p],
            v_cache[:b, :, :p],
            attn_mask=mask,
            scale=self.scaling[i],
            enable_gqa=self.n_heads != self.n_kv,
        )  # [B, Hq, P, D]
        out = out.transpose(1, 2)[row, slot].flatten(1)  # [N, Hq D]
        x = linear_residual(x, out, layer.self_attn.o_proj)
        return self.mlp_residual(i, x)

    def decode_layer(
        self,
        i: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot: int,
        bias: torch.Tensor | None,
        qk_w: torch.Tensor | None,
        kv_scales: FP8KVScales | None,
    ) -> torch.Tensor:
        """One decoder layer for one new token per row: ``x [B, H]`` -> ``[B, H]``, K/V written at ``slot``.

        cos, sin_signed: ``[B, 1, D]``; bias: additive (0 / -inf) ``[B, Hkv, 1, slot + 1]`` over the
        keys, or None when no key is masked. ``kv_scales``: as in :meth:`prefill_layer` (already calibrated).
        """
        layer = self.layers[i]
        b = x.shape[0]
        nkv, d = self.n_kv, self.head_dim
        h = rms_norm(layer.input_layernorm, x)  # [B, H]
        q, k, v = self.project_qkv(i, h, cos, sin_signed, qk_w)  # [B, heads, D]
        if kv_scales is not None:
            k, v = (t.squeeze(2) for t in kv_scales.store(i, k.unsqueeze(2), v.unsqueeze(2), None))
        k_cache[:, :, slot] = k
        v_cache[:, :, slot] = v
        # Single-query attention with grouped KV heads as two batched GEMMs over B * Hkv: query
        # head h reads KV head h // G (HF's repeat_kv), so q reshapes to [B * Hkv, G, D].
        qg = q.reshape(b * nkv, -1, d)  # [B Hkv, G, D]
        keys = k_cache[:, :, : slot + 1].flatten(0, 1)  # [B Hkv, L, D] (a view: B, Hkv strides merge)
        values = v_cache[:, :, : slot + 1].flatten(0, 1)  # [B Hkv, L, D]
        scale = self.scaling[i]
        if bias is None:
            scores = torch.bmm(qg, keys.transpose(1, 2)).mul_(scale)  # [B Hkv, G, L]
        else:  # bias + scale * q k^T in one kernel
            scores = torch.baddbmm(bias.flatten(0, 1), qg, keys.transpose(1, 2), alpha=scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
        out = torch.bmm(probs, values).view(b, -1)  # [B, Hq D]
        x = linear_residual(x, out, layer.self_attn.o_proj)
        return self.mlp_residual(i, x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Next-token logits of the last hidden states ``x [M, H]``: ``lm_head(norm(x))``.  # [M, V]"""
        return self.lm_head(rms_norm(self.norm, x))
