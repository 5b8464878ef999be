"""Tiny randomly initialised Hugging Face causal LMs of many families, built from configs (no download).

Each family is here for something the policy or the torch engine must get right: logit transforms
(Granite's scaling, Cohere's logit scale, Gemma 2's soft cap), sliding windows (Mistral, Gemma 2),
layer layouts outside the Llama family (GPT-2's Conv1D and learned positions, Phi-3's fused q/k/v,
OLMo-2's post-norms, GPT-NeoX's parallel block, SmolLM3's layers without RoPE), mixtures of experts.
Every parameter is redrawn (norm weights around 1, everything else around 0), so a layout mistake
shows in the numbers instead of hiding behind zero-initialised biases or unit norms.
"""

from __future__ import annotations

import torch
import transformers as T

VOCAB = 64
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
    tie_word_embeddings=False,
)
_GPT = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=2, eos_token_id=1)

ARCHITECTURES: dict[str, tuple[type, dict]] = {
    "llama": (T.LlamaConfig, dict(_COMMON, attention_bias=True, mlp_bias=True)),
    "mistral": (T.MistralConfig, dict(_COMMON, sliding_window=None)),
    "qwen2": (T.Qwen2Config, _COMMON),
    "qwen3": (T.Qwen3Config, dict(_COMMON, head_dim=16)),
    "gemma": (T.GemmaConfig, dict(_COMMON, head_dim=16)),
    "mistral_sliding": (T.MistralConfig, dict(_COMMON, sliding_window=3)),
    "gemma2": (T.Gemma2Config, dict(_COMMON, head_dim=16, sliding_window=3, final_logit_softcapping=2.0)),
    "granite": (
        T.GraniteConfig,
        dict(
            _COMMON,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            logits_scaling=2.0,
            attention_multiplier=0.1,
        ),
    ),
    "cohere": (T.CohereConfig, dict(_COMMON, logit_scale=0.5)),
    "phi3": (T.Phi3Config, _COMMON),
    "olmo2": (T.Olmo2Config, _COMMON),
    "smollm3": (T.SmolLM3Config, _COMMON),
    "qwen3_moe": (
        T.Qwen3MoeConfig,
        dict(_COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    ),
    "gpt2": (T.GPT2Config, dict(_GPT, n_embd=64, n_layer=4, n_head=4, n_positions=128)),
    "gpt_neox": (
        T.GPTNeoXConfig,
        dict(_GPT, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4),
    ),
}
"""name -> (config class, config arguments)."""

LEAN = ("llama", "mistral", "qwen2", "qwen3", "gemma")
"""The families the torch engine's lean forward runs (``model_impl="auto"`` resolves to ``"lean"``)."""
TRANSFORMED_LOGITS = ("gemma2", "granite", "cohere")
"""Families whose forward transforms ``lm_head``'s logits."""


def build(name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """The tiny ``name`` model in fp32 and eval mode, every parameter redrawn from ``seed``; ``overrides``
    change its config (e.g. ``vocab_size`` and token ids for a real tokenizer)."""
    config_class, kwargs = ARCHITECTURES[name]
    config = config_class(**{**kwargs, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = T.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                is_norm = param.dim() == 1 and any(k in param_name for k in ("norm", "ln_", "layernorm"))
                if is_norm and param_name.endswith("weight"):
                    param.copy_(1 + 0.1 * torch.randn_like(param))
                else:
                    param.copy_(0.1 * torch.randn_like(param))
    return model
