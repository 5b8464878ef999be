"""The forward state of one ``TorchRolloutEngine.generate`` call: prefill, one decode step, drop rows.

The engine's sampling loop (:meth:`ais_lightning.rollout.TorchRolloutEngine.generate`) is the same for
every model; how the next-token logits are computed is not. Two implementations of one protocol:

- :class:`LeanDecoder`: the lean Llama-family forward (:class:`ais_lightning.rollout.torch_model.LeanLlama`)
  over a KV cache the engine keeps between calls, with an optional FP8 KV cache; fast, for the
  architectures it implements (``model_impl="lean"``).
- :class:`TransformersDecoder`: the model's own Hugging Face ``forward`` with its own cache; any causal
  LM (sliding windows, mixtures of experts, logit soft caps, GPT-2's learned positions, ...), at the
  cost of Hugging Face's per-step overhead (``model_impl="transformers"``, the name vLLM gives its
  Transformers backend).

Protocol, for ``Bp`` prompts with ``n`` samples each (``B = Bp * n`` rows, rows of a prompt contiguous):
``prefill(prompt_ids, prompt_mask, n, new)`` -> logits ``[B, V]`` of the first response token;
``step(tokens, t)`` feeds each running row's token ``t`` (``[R]``) and returns the logits of token ``t + 1``
``[R, V]``; ``select(keep)`` keeps only rows ``keep`` (``[R']``, indices into the running rows).
Positions follow :mod:`ais_lightning.rollout.prompts`: prompts are left-padded and response token ``t``
of a prompt of length ``L`` sits at position ``L + t``.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from ais_lightning.rollout.kv_cache import FP8KVScales, KVWorkspace
from ais_lightning.rollout.torch_model import LeanLlama, sign_sin

__all__ = ["LeanDecoder", "TransformersDecoder"]


class LeanDecoder:
    """:class:`LeanLlama`'s packed prefill and single-token decode over the engine's KV workspace."""

    def __init__(self, lean: LeanLlama, workspace: KVWorkspace, kv_scales: FP8KVScales | None) -> None:
        self.lean = lean
        self.workspace = workspace
        self.kv_scales = kv_scales

    def prefill(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int, new: int) -> torch.Tensor:
        """Prompts ``[Bp, P]`` (left-padded) -> logits ``[Bp * n, V]``; K/V of every row cached."""
        lean, kv_scales = self.lean, self.kv_scales
        dev, dtype = lean.device, lean.dtype
        bp, plen = prompt_ids.shape
        batch, total = bp * n, plen + new
        lengths = prompt_mask.sum(-1)  # [Bp]
        self.plen = plen
        self.qk_ws = lean.qk_norm_weights()

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
        k_caches, v_caches = self.workspace.caches(cache_shape, dtype, dev)
        x = lean.embed(prompt_ids[tokens])  # [N, H]
        pre_cos, pre_sin = cos[tokens][:, None], sin_signed[tokens][:, None]  # [N, 1, D]
        for i in range(len(lean.layers)):
            # Pad slots are masked, but must hold finite values (0 * NaN is NaN in the attention GEMMs).
            k_caches[i][:bp, :, :plen].zero_()
            v_caches[i][:bp, :, :plen].zero_()
            x = lean.prefill_layer(
                i, x, pre_cos, pre_sin, k_caches[i], v_caches[i], tokens, pre_mask, self.qk_ws[i], kv_scales
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
        self.k_caches, self.v_caches = k_caches, v_caches
        self.cos, self.sin_signed, self.key_bias = cos, sin_signed, key_bias
        return logits

    def step(self, tokens: torch.Tensor, t: int) -> torch.Tensor:
        """Response token ``t`` of every running row ``[R]`` -> logits of token ``t + 1`` ``[R, V]``."""
        lean, slot = self.lean, self.plen + t
        x = lean.embed(tokens)  # [R, H]
        key_bias = self.key_bias
        step_bias = key_bias[..., : slot + 1] if key_bias is not None else None  # [R, Hkv, 1, slot + 1]
        step_cos, step_sin = self.cos[:, slot], self.sin_signed[:, slot]  # [R, 1, D]
        for i in range(len(lean.layers)):
            x = lean.decode_layer(
                i,
                x,
                step_cos,
                step_sin,
                self.k_caches[i],
                self.v_caches[i],
                slot,
                step_bias,
                self.qk_ws[i],
                self.kv_scales,
            )
        return lean.logits(x)  # [R, V]

    def select(self, keep: torch.Tensor) -> None:
        """Keep running rows ``keep`` ``[R']`` (one gather of the KV cache)."""
        self.k_caches = [c[keep] for c in self.k_caches]
        self.v_caches = [c[keep] for c in self.v_caches]
        self.cos, self.sin_signed = self.cos[keep], self.sin_signed[keep]
        self.key_bias = self.key_bias[keep] if self.key_bias is not None else None


_CACHE_NAMES = ("cache", "past_key_values", "cache_params")
"""Names of a Hugging Face forward's cache, argument and output, across versions and model families."""


class TransformersDecoder:
    """The model's own ``forward`` with the cache it creates (``use_cache=True``), one token per step.

    Works for any Hugging Face causal LM whose forward takes ``input_ids``, ``attention_mask``,
    ``position_ids`` and a cache (:data:`_CACHE_NAMES`) and whose cached decoding equals its full forward
    (:func:`cached_decode_mismatch` checks that); its logits are exactly the model's (logit scaling and soft
    caps included). The prefill runs once per distinct prompt and its cache is fanned out to the ``n``
    sample rows with the cache's own ``reorder_cache``, which also drops finished rows.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.prefill_kwargs, self.cache_kwarg, self.pass_cache_position = _forward_arguments(type(model))

    def prefill(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int, new: int) -> torch.Tensor:
        """Prompts ``[Bp, P]`` (left-padded) -> logits ``[Bp * n, V]``; the cache holds every row."""
        mask = prompt_mask.long()  # [Bp, P]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [Bp, P]
        self.slot = prompt_ids.shape[1]  # cache slots 0..P-1 hold the (left-padded) prompts
        out = self.model(
            input_ids=prompt_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **self.prefill_kwargs,
            **self._cache_position(0, self.slot, prompt_ids.device),
        )
        self.cache = _returned_cache(out)
        rows = torch.arange(prompt_ids.shape[0], device=prompt_ids.device).repeat_interleave(n)  # [B]
        if n > 1:
            self.cache.reorder_cache(rows)
        self.mask = mask[rows]  # [B, P], grows by one column per step
        self.lengths = mask.sum(-1)[rows]  # [B]
        return out.logits[:, -1][rows]  # [B, V]

    def step(self, tokens: torch.Tensor, t: int) -> torch.Tensor:
        """Response token ``t`` of every running row ``[R]`` -> logits of token ``t + 1`` ``[R, V]``."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)  # [R, P + t + 1]
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=self.mask,
            position_ids=(self.lengths + t)[:, None],
            use_cache=True,
            **{self.cache_kwarg: self.cache},
            **self._cache_position(self.slot, self.slot + 1, tokens.device),
        )
        self.slot += 1
        self.cache = _returned_cache(out)
        return out.logits[:, -1]  # [R, V]

    def _cache_position(self, start: int, stop: int, device: torch.device) -> dict[str, torch.Tensor]:
        if not self.pass_cache_position:
            return {}
        return {"cache_position": torch.arange(start, stop, device=device)}

    def select(self, keep: torch.Tensor) -> None:
        """Keep running rows ``keep`` ``[R']``."""
        self.cache.reorder_cache(keep)
        self.mask, self.lengths = self.mask[keep], self.lengths[keep]


@functools.cache
def _forward_arguments(model_class: type) -> tuple[dict[str, int], str, bool]:
    """What a causal LM class's ``forward`` takes, read once per class (a decoder is made per ``generate``):

    - ``{"logits_to_keep": 1}`` where it can return the last position's logits only, else ``{}``;
    - its cache argument: ``cache`` since transformers 5.24, ``past_key_values`` before (``cache_params``
      in state-space models);
    - whether it takes ``cache_position``, the cache slots being written (state-space models such as Mamba
      tell prefill from decode by them; attention models derive them from the cache's length).
    """
    params = inspect.signature(model_class.forward).parameters
    prefill = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    cache = next((k for k in _CACHE_NAMES if k in params), "past_key_values")
    return prefill, cache, "cache_position" in params


def _returned_cache(out: object) -> object:
    """The cache a Hugging Face forward returned (``out.cache`` since transformers 5.24, ``past_key_values``
    before, ``cache_params`` in state-space models); ValueError when it returned none."""
    for name in _CACHE_NAMES:
        cache = getattr(out, name, None)
        if cache is not None:
            return cache
    raise ValueError(f"the forward returned no cache ({type(out).__name__} has none of {list(_CACHE_NAMES)})")


CACHED_DECODE_TOLERANCE: dict[torch.dtype | None, float] = {
    torch.float32: 1e-3,
    torch.float64: 1e-3,
    None: 5e-2,
}
"""Largest log-prob difference (nats) accepted between cached decoding and a full forward, by the model's
dtype (None: any other): about 1e-6 in fp32 for an attention model, 0.1 or more where the cache does not
carry what the forward needs (state-space models driven by an attention mask)."""


@torch.no_grad()
def cached_decode_mismatch(model: nn.Module, steps: int = 3) -> float:
    """Largest log-prob difference between :class:`TransformersDecoder`'s cached decoding and one full forward.

    Two prompts (one left-padded) decode ``steps`` fixed tokens with the cache; the same sequences then run
    through the model's forward at once, with the positions of the shared convention. In eval mode; the
    model's mode is restored.
    """
    vocab = model.get_output_embeddings().weight.shape[0]
    device = next(model.parameters()).device
    ids = lambda *xs: [x % vocab for x in xs]  # noqa: E731
    prompt_ids = torch.tensor([ids(3, 4, 5, 6), ids(0, 0, 7, 8)], device=device)  # [2, 4], row 1 left-padded
    prompt_mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool, device=device)
    tokens = torch.tensor([ids(9, 10, 11), ids(12, 13, 14)], device=device)[:, :steps]  # [2, steps]
    was_training = model.training
    model.eval()
    try:
        decoder = TransformersDecoder(model)
        cached = [decoder.prefill(prompt_ids, prompt_mask, 1, steps)]
        for t in range(steps - 1):
            cached.append(decoder.step(tokens[:, t], t))
        cached_lp = torch.stack(cached, dim=1).float().log_softmax(-1)  # [2, steps, V]
        full_ids = torch.cat([prompt_ids, tokens[:, : steps - 1]], dim=1)  # [2, 4 + steps - 1]
        mask = torch.cat([prompt_mask, torch.ones_like(tokens[:, : steps - 1], dtype=torch.bool)], 1).long()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(
            input_ids=full_ids, attention_mask=mask, position_ids=positions, use_cache=False
        ).logits
        full_lp = logits[:, prompt_ids.shape[1] - 1 :].float().log_softmax(-1)  # [2, steps, V]
    finally:
        model.train(was_training)
    return float((cached_lp - full_lp).abs().max())
