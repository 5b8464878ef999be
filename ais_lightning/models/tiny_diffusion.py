"""The built-in tiny masked-diffusion LM (LLaDA-style, ~0.8M parameters) and its tokenizer with a mask token.

LLaDA (Nie et al. 2025, "Large Language Diffusion Models", arXiv 2502.09992; ``GUIDELINES.md`` of
GitHub ML-GSAI/LLaDA) is a *mask predictor*: the Llama-style decoder of an autoregressive LM with the
causal mask removed, fed a sequence in which some tokens are replaced by a reserved ``[MASK]`` token,
and trained to predict every masked token at once. This module builds the same thing at toy scale with
the layout of the tiny Qwen3 (:mod:`ais_lightning.models.tiny`): hidden 128, 4 blocks, 4 query heads /
2 key-value heads (GQA) of head_dim 32, SwiGLU 384, RoPE, QK-RMSNorm, tied embeddings. Only the
attention differs: every query sees every non-padding key (bidirectional).

Module names follow Hugging Face's Qwen3 (``model.layers.N.self_attn.q_proj`` ...,
``model.embed_tokens``, ``model.norm``, ``lm_head``), so :func:`ais_lightning.quant.quantize_model`
quantizes the same linears (embeddings, norms and ``lm_head`` stay in high precision) and FSDP2 shards
``model.layers`` one block at a time. It is a plain ``nn.Module``, built locally: nothing is downloaded.

Vocabulary: the 99 characters/specials of :mod:`ais_lightning.models.tokenizer` (pad 0, bos 1, eos 2,
unchanged) plus ``"<mask>"`` = 99 (:func:`build_diffusion_tokenizer`): 100 tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedTokenizerFast

from ais_lightning.checks import check_int
from ais_lightning.models.tokenizer import (
    BOS_TOKEN_ID,
    CHAR_VOCAB_SIZE,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    build_char_tokenizer,
)

MASK_TOKEN = "<mask>"
"""The mask token's text (a special token: never produced by encoding ordinary characters)."""
MASK_TOKEN_ID = CHAR_VOCAB_SIZE
"""99: the first id after the character vocabulary, so every existing id keeps its meaning."""
DIFFUSION_VOCAB_SIZE = CHAR_VOCAB_SIZE + 1
"""100 = the 99 character-tokenizer ids + ``<mask>``."""


def build_diffusion_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer (:func:`ais_lightning.models.build_char_tokenizer`) plus ``<mask>`` = 99.

    ``tokenizer.mask_token_id == 99``; pad/bos/eos keep ids 0/1/2 and every character its id.
    """
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
    if tokenizer.mask_token_id != MASK_TOKEN_ID or len(tokenizer) != DIFFUSION_VOCAB_SIZE:
        raise RuntimeError(  # pragma: no cover - guards a change of the character tokenizer
            f"expected <mask> = {MASK_TOKEN_ID} in a {DIFFUSION_VOCAB_SIZE}-token vocabulary, got "
            f"{tokenizer.mask_token_id} in {len(tokenizer)}"
        )
    return tokenizer


@dataclass
class TinyDiffusionConfig:
    """Hyper-parameters of :class:`TinyDiffusionLM` (Qwen3 field names)."""

    vocab_size: int = DIFFUSION_VOCAB_SIZE
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True
    pad_token_id: int = PAD_TOKEN_ID
    bos_token_id: int = BOS_TOKEN_ID
    eos_token_id: int = EOS_TOKEN_ID
    mask_token_id: int = MASK_TOKEN_ID
    model_type: str = "tiny_llada"
    """Identifies the family (e.g. in the warm-start cache key)."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            check_int(getattr(self, name), f"TinyDiffusionConfig.{name}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"TinyDiffusionConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"TinyDiffusionConfig.head_dim must be even (RoPE), got {self.head_dim}")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "mask_token_id"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.vocab_size:
                raise ValueError(
                    f"TinyDiffusionConfig.{name} must be an int in [0, vocab_size={self.vocab_size}), got {value!r}"
                )
        if self.mask_token_id in (self.pad_token_id, self.eos_token_id):
            raise ValueError(
                "TinyDiffusionConfig.mask_token_id must differ from pad_token_id and eos_token_id"
            )

    def to_dict(self) -> dict[str, Any]:
        """Every field (what the warm-start cache key hashes)."""
        return dataclasses.asdict(self)


class RMSNorm(nn.Module):
    """Root-mean-square norm in fp32 (Zhang & Sennrich 2019), as Qwen3's ``Qwen3RMSNorm``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """RoPE (Su et al. 2021, arXiv 2104.09864), the rotate-half convention of Llama/Qwen3."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # [D/2]
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of ``position_ids`` ``[B, L]``, each ``[B, 1, L, D]`` in ``dtype``."""
        freqs = position_ids[..., None].float() * self.inv_freq  # [B, L, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [B, L, D]
        return emb.cos()[:, None].to(dtype), emb.sin()[:, None].to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class BidirectionalAttention(nn.Module):
    """Grouped-query self-attention with QK-RMSNorm and RoPE, no causal mask (LLaDA's mask predictor)."""

    def __init__(self, config: TinyDiffusionConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_mask: torch.Tensor
    ) -> torch.Tensor:
        """``x`` ``[B, L, H]``; ``cos``/``sin`` ``[B, 1, L, D]``; ``key_mask`` ``[B, 1, 1, L]`` bool (True = attend)."""
        b, length, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, length, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, length, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, length, self.n_kv, self.head_dim).transpose(1, 2)  # [B, Hkv, L, D]
        q = q * cos + _rotate_half(q) * sin  # [B, Hq, L, D]
        k = k * cos + _rotate_half(k) * sin  # [B, Hkv, L, D]
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [B, Hq, L, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)  # [B, Hq, L, D], no is_causal
        return self.o_proj(out.transpose(1, 2).reshape(b, length, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` (Shazeer 2020, arXiv 2002.05202)."""

    def __init__(self, config: TinyDiffusionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DiffusionBlock(nn.Module):
    """Pre-norm transformer block (Qwen3 layout, bidirectional attention)."""

    def __init__(self, config: TinyDiffusionConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = BidirectionalAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_mask: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, key_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def _check_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, vocab_size: int) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(
            f"input_ids must be a [B, L] long tensor, got {getattr(input_ids, 'shape', input_ids)}"
        )
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has {tuple(input_ids.shape)}"
        )


class TinyDiffusionBody(nn.Module):
    """Embeddings, the blocks and the final norm: ``input_ids`` -> final hidden states."""

    def __init__(self, config: TinyDiffusionConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DiffusionBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states ``[B, L, H]``.

        ``attention_mask`` ``[B, L]`` (bool or 0/1; None = all real): keys with 0 are never attended (left
        padding of the prompt); every query attends every real key. ``position_ids`` ``[B, L]``; None =
        ``cumsum(attention_mask) - 1`` (the repository's convention: positions count real tokens only).
        """
        _check_inputs(input_ids, attention_mask, self.config.vocab_size)
        real = (
            torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        )
        if position_ids is None:
            position_ids = (real.long().cumsum(-1) - 1).clamp(min=0)  # [B, L]
        x = self.embed_tokens(input_ids)  # [B, L, H]
        cos, sin = self.rotary_emb(position_ids, x.dtype)  # [B, 1, L, D]
        key_mask = real[:, None, None, :]  # [B, 1, 1, L]
        for layer in self.layers:
            x = layer(x, cos, sin, key_mask)
        return self.norm(x)


SUPPRESSED_LOGIT = -1.0e4
"""Logit the head gives the mask token: ``exp`` of it is exactly 0 in fp32/bf16 at any temperature >= 0.01, so
the mask token is never sampled and has probability 0, while log-softmax and entropy stay finite (``-inf``
would turn ``p * log p`` into NaN)."""


class MaskSuppressingHead(nn.Linear):
    """``lm_head`` whose logit of ``suppressed_token_id`` (the mask token) is :data:`SUPPRESSED_LOGIT`.

    A mask predictor must output a real token at every position; keeping ``<mask>`` out of its
    distribution in the head means the sampler, the engine's mu and the policy's pi all use the same
    distribution over the 99 real tokens. It stays an ``nn.Linear`` named ``lm_head``, so
    :func:`ais_lightning.quant.quantize_model` keeps it in high precision and state-dict names are unchanged.
    """

    def __init__(self, in_features: int, out_features: int, suppressed_token_id: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.suppressed_token_id = suppressed_token_id

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)  # [..., V]
        return logits.index_fill(
            -1, logits.new_tensor([self.suppressed_token_id], dtype=torch.long), SUPPRESSED_LOGIT
        )


class TinyDiffusionLM(nn.Module):
    """Mask predictor: ``logits = lm_head(body(input_ids))``, every position predicted at once.

    The Hugging Face accessors the policy and engines use are provided: :meth:`get_decoder` (the
    body, whose ``layers`` FSDP2 shards) and :meth:`get_output_embeddings` (``lm_head``).
    """

    def __init__(self, config: TinyDiffusionConfig) -> None:
        super().__init__()
        if not isinstance(config, TinyDiffusionConfig):
            raise ValueError(f"config must be a TinyDiffusionConfig, got {type(config).__name__}")
        self.config = config
        self.model = TinyDiffusionBody(config)
        self.lm_head = MaskSuppressingHead(config.hidden_size, config.vocab_size, config.mask_token_id)
        self._init_weights()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def _init_weights(self) -> None:
        """Normal(0, initializer_range) for linears and embeddings, ones for norms (Hugging Face's init)."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)

    def get_decoder(self) -> TinyDiffusionBody:
        return self.model

    def get_output_embeddings(self) -> MaskSuppressingHead:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, L, V]`` at every position (see :meth:`TinyDiffusionBody.forward`); the mask token's
        logit is :data:`SUPPRESSED_LOGIT`."""
        return self.lm_head(self.model(input_ids, attention_mask, position_ids))

    def num_parameters(self) -> int:
        """Distinct parameters (a tied ``lm_head`` counted once)."""
        return sum(p.numel() for p in self.parameters())


def tiny_diffusion_config(**overrides: Any) -> TinyDiffusionConfig:
    """Config of the tiny diffusion LM; any :class:`TinyDiffusionConfig` field can be overridden."""
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(TinyDiffusionConfig)})
    if unknown:
        raise ValueError(f"unknown TinyDiffusionConfig field(s) {unknown}")
    config = TinyDiffusionConfig(**overrides)
    if config.vocab_size < DIFFUSION_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be >= {DIFFUSION_VOCAB_SIZE} (the diffusion tokenizer's size), got {config.vocab_size}"
        )
    return config


def build_tiny_diffusion(seed: int = 0, **overrides: Any) -> TinyDiffusionLM:
    """A randomly initialized fp32 tiny masked-diffusion LM, deterministic in ``seed``.

    ``overrides`` go to :func:`tiny_diffusion_config`. The global RNG state is left untouched; there is
    no dropout, so train and eval mode compute the same function.
    """
    config = tiny_diffusion_config(**overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyDiffusionLM(config)
    return model.float()
