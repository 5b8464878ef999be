"""The built-in tiny Qwen3-MoE (mixture of experts) used by tests and CPU experiments on routing.

Architecture: Hugging Face's ``Qwen3MoeForCausalLM`` (Qwen Team, "Qwen3 Technical Report", arXiv 2505.09388)
at toy scale, the attention of the dense tiny Qwen3 (:mod:`ais_lightning.models.tiny`: hidden 128, 4 layers,
4 query / 2 key-value heads of head_dim 32, RoPE, QK-RMSNorm, tied embeddings, the 99-token character
vocabulary) with every MLP a sparse block of 8 experts (SwiGLU, intermediate 96 each), 2 routed per token
(softmax router, top-k weights renormalized: ``norm_topk_prob``). Active MLP width per token: 2 x 96 = 192.

transformers (5.24) keeps the experts fused: ``mlp.experts.gate_up_proj [E, 2 I, H]`` (gate rows first, then
up) and ``mlp.experts.down_proj [E, H, I]``; the router ``mlp.gate`` (``Qwen3MoeTopKRouter``, weight ``[E, H]``)
returns ``(router_logits, routing_weights, selected_experts)``. The experts run the per-expert loop
(``experts_implementation="eager"``), the same code path in the trainer and the rollout engine; the other
implementations (``grouped_mm``) gather the same rows in another order.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from ais_lightning.models.tiny import tiny_qwen3_fields
from ais_lightning.models.tokenizer import CHAR_VOCAB_SIZE

DEFAULT_EXPERTS_IMPLEMENTATION = "eager"
"""Hugging Face's per-expert loop: exactly the routed tokens of each expert through its weights."""


def tiny_qwen3_moe_config(vocab_size: int = CHAR_VOCAB_SIZE, **overrides: Any) -> Qwen3MoeConfig:
    """Config of the tiny Qwen3-MoE; any ``Qwen3MoeConfig`` field can be overridden by keyword
    (``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``, ``mlp_only_layers``, ...)."""
    kwargs, attn_implementation = tiny_qwen3_fields(vocab_size, overrides)
    experts_implementation = overrides.pop("experts_implementation", DEFAULT_EXPERTS_IMPLEMENTATION)
    kwargs.update(
        moe_intermediate_size=96,  # intermediate_size: the dense MLP width of any layer in mlp_only_layers
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,
        router_aux_loss_coef=0.0,
    )
    kwargs.update(overrides)
    if not 1 <= int(kwargs["num_experts_per_tok"]) <= int(kwargs["num_experts"]):
        raise ValueError(
            f"num_experts_per_tok must be in [1, num_experts={kwargs['num_experts']}], "
            f"got {kwargs['num_experts_per_tok']}"
        )
    config = Qwen3MoeConfig(**kwargs)
    config._attn_implementation = attn_implementation
    config._experts_implementation = experts_implementation
    return config


def build_tiny_qwen3_moe(seed: int = 0, **overrides: Any) -> Qwen3MoeForCausalLM:
    """A randomly initialized fp32 tiny Qwen3-MoE, deterministic in ``seed`` (the global RNG is untouched).

    ``overrides`` go to :func:`tiny_qwen3_moe_config`. No dropout: train and eval mode compute the same function.
    """
    config = tiny_qwen3_moe_config(**overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(config)
    return model.float()
