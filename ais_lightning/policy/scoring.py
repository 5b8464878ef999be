"""Scoring: the log-prob, entropy and impurity of each response token under a causal LM, chunked.

The decoder body runs once; the head and the temperature log-softmax run on a bounded number of response
positions at a time, so the full ``[B, T, V]`` logits never exist (:func:`chunked_response_logprobs`).

Sequence layout (shared with every rollout engine): the prompt is left-padded, the response
right-padded, the two are concatenated, and positions count real tokens only
(``position_ids = cumsum(attention_mask) - 1``), so a padded row reproduces the unpadded row
(:func:`build_sequences`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ais_lightning.models.head import LogitTransform, decoder_hidden_states, head_logits
from ais_lightning.ops import (
    entropy_from_logprobs,
    impurity_from_logprobs,
    logprobs_from_logits,
    tempered_log_softmax,
)
from ais_lightning.rollout.support import FlatSupport, kept_mask, replayed_log_softmax

__all__ = [
    "LogprobTensors",
    "ResponseLogprobs",
    "build_sequences",
    "chunked_response_logprobs",
    "decoder_logprobs",
]


@dataclass
class ResponseLogprobs:
    """Per-token outputs of :meth:`Policy.response_logprobs`."""

    logprobs: torch.Tensor
    """``[B, T]`` float32 log-prob of each response token under ``softmax(logits / temperature)``; 0 where masked."""
    entropy: torch.Tensor | None
    """``[B, T]`` float32 entropy (nats) of the temperature-processed next-token distribution; 0 where masked.
    None unless ``compute_entropy=True``."""
    impurity: torch.Tensor | None = None
    """``[B, T]`` float32 collision impurity ``1 - sum_a pi(a)^2`` of the same distribution
    (``ops.impurity_from_logprobs``); 0 where masked. None unless ``compute_entropy=True``. Values only (no
    gradient): correctors and metrics read it."""


LogprobTensors = tuple[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]
"""``(logprobs, entropy, impurity)`` ``[B, T]`` each, as a policy's forward returns them (FSDP and DDP hooks
see plain tensors): :class:`ResponseLogprobs`'s fields in order."""


def _check_ids_and_mask(ids: torch.Tensor, mask: torch.Tensor, name: str) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.long:
        raise ValueError(f"{name}_ids must be a [B, L] long tensor, got {getattr(ids, 'dtype', type(ids))}")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise ValueError(f"{name}_mask must be a bool tensor (True = real token)")
    if mask.shape != ids.shape:
        raise ValueError(
            f"{name}_mask has shape {tuple(mask.shape)} but {name}_ids has shape {tuple(ids.shape)}"
        )


def build_sequences(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenate left-padded prompts and right-padded responses into model inputs.

    prompt_ids/prompt_mask: ``[B, P]`` (True on real tokens, padding on the left, at least one real token);
    response_ids/response_mask: ``[B, T]`` (True on valid response tokens).
    Returns ``input_ids`` ``[B, P+T]`` long, ``attention_mask`` ``[B, P+T]`` long (1 = attend, the Hugging Face
    convention) and ``position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)`` ``[B, P+T]``.
    """
    _check_ids_and_mask(prompt_ids, prompt_mask, "prompt")
    _check_ids_and_mask(response_ids, response_mask, "response")
    if prompt_ids.shape[0] != response_ids.shape[0]:
        raise ValueError(
            f"prompt_ids has batch size {prompt_ids.shape[0]} but response_ids has {response_ids.shape[0]}"
        )
    if prompt_ids.shape[1] == 0 or not bool(prompt_mask[:, -1].all()):
        raise ValueError(
            "prompt_mask must be left-padded with a real last token in every row (prompt_mask[:, -1])"
        )
    if not bool((prompt_mask[:, 1:] >= prompt_mask[:, :-1]).all()):
        raise ValueError("prompt_mask must be left-padded: False* then True+ in every row")
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)  # [B, P+T]
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()  # [B, P+T]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, P+T]
    return input_ids, attention_mask, position_ids


def _head_logprobs(
    lm_head: nn.Module,
    transform: LogitTransform,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    compute_entropy: bool,
    entropy_grad: bool = True,
    head_float32: bool = False,
    support: FlatSupport | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's head + temperature log-softmax on one chunk: ``hidden`` [n, H], ``tokens`` [n] ->
    log-probs, entropies and impurities, each [n] (zeros unless ``compute_entropy``). ``head_float32``: the
    head's projection in fp32 (:func:`ais_lightning.models.head.head_logits`). ``support``: the kept sets of the
    chunk's n positions; the distribution is then renormalized over them (log-probs, entropies and impurities
    alike: :mod:`ais_lightning.rollout.support`).

    The impurities are values only, and so are the entropies without ``entropy_grad``: autograd records
    only what a loss differentiates. A checkpointed chunk recomputes in backward every tensor its forward
    recorded, and the ones no backward consumes (the entropy's, ~5 ``[n, V]`` when the loss has no entropy
    term) stay alive until the whole backward ends, chunk after chunk: the head's memory would grow with the
    batch instead of being bounded by the chunk.
    """
    logits = transform(head_logits(lm_head, hidden, head_float32))  # [n, V]
    if support is not None:
        keep = kept_mask(support, logits.shape[-1])  # [n, V]
        if not bool(keep.gather(-1, tokens.unsqueeze(-1)).all()):
            raise ValueError("support: a response token is not in the kept set recorded for its position")
        logp = replayed_log_softmax(logits, keep, temperature)  # [n, V], over the kept set only
        logprobs = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [n]
        if not compute_entropy:
            return logprobs, torch.zeros_like(logprobs), torch.zeros_like(logprobs)
        spread = logp if entropy_grad and torch.is_grad_enabled() else logp.detach()
        entropy = entropy_from_logprobs(spread)
        with torch.no_grad():
            impurity = impurity_from_logprobs(logp)
        return logprobs, entropy, impurity
    logprobs = logprobs_from_logits(logits, tokens, temperature)  # [n]
    if not compute_entropy:
        return logprobs, torch.zeros_like(logprobs), torch.zeros_like(logprobs)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        logp = tempered_log_softmax(logits, temperature)  # [n, V], once for both
        entropy = entropy_from_logprobs(logp)
    with torch.no_grad():
        impurity = impurity_from_logprobs(logp)
    return logprobs, entropy, impurity


def chunked_response_logprobs(
    lm_head: nn.Module,
    hidden: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    chunk_size: int = 1024,
    transform: LogitTransform | None = None,
    entropy_grad: bool = True,
    head_float32: bool = False,
    support: FlatSupport | None = None,
) -> ResponseLogprobs:
    """Log-probs (and entropies) of response tokens from the decoder's final hidden states.

    ``hidden`` ``[B, T, H]`` is the hidden state that *predicts* each response token (position ``P-1+t``).
    ``transform``: what the model's forward does to ``lm_head``'s logits
    (:func:`ais_lightning.models.head.logit_transform`; None = nothing). ``head_float32``: ``lm_head``'s
    projection computed in fp32 from the model-dtype hidden states and weights (``Policy(head_dtype="float32")``).
    Only valid tokens are projected, ``chunk_size`` of them at a time; under autograd each chunk is
    activation-checkpointed, so only one chunk's ``[chunk_size, V]`` logits and what is computed from them
    are alive at a time, in forward *and* backward (the memory bound of chunked cross-entropy, e.g.
    Liger-Kernel's fused linear CE). The impurities never carry a gradient, the entropies only with
    ``entropy_grad`` (False: values for metrics and correctors), so backward recomputes only what it
    differentiates: with entropy gradients that no loss consumes, every chunk's entropy tensors would stay
    alive to the end of backward (2.8 GB for 2048 tokens of a 49k vocabulary, instead of 1.0 GB).
    ``support``: the kept sets of the valid tokens in row-major order (``SamplingSupport.flat(response_mask)``):
    every distribution is then renormalized over its position's set (truncated sampling replayed,
    :mod:`ais_lightning.rollout.support`).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    flat_hidden = hidden[response_mask]  # [N, H]
    flat_tokens = response_ids[response_mask]  # [N]
    use_checkpoint = torch.is_grad_enabled() and flat_hidden.requires_grad
    transform = transform if transform is not None else LogitTransform()
    chunks: list[
        tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ] = []  # (log-prob, entropy, impurity) [n] each
    if support is not None and support.counts.numel() != flat_tokens.numel():
        raise ValueError(
            f"support has {support.counts.numel()} positions but the response mask has {flat_tokens.numel()}"
        )
    pieces = support.split(chunk_size) if support is not None else [None] * len(flat_tokens.split(chunk_size))
    for h, tok, kept in zip(flat_hidden.split(chunk_size), flat_tokens.split(chunk_size), pieces):
        if use_checkpoint:
            chunks.append(
                checkpoint(
                    _head_logprobs,
                    lm_head,
                    transform,
                    h,
                    tok,
                    temperature,
                    compute_entropy,
                    entropy_grad,
                    head_float32,
                    kept,
                    use_reentrant=False,
                )
            )
        else:
            chunks.append(
                _head_logprobs(
                    lm_head, transform, h, tok, temperature, compute_entropy, entropy_grad, head_float32, kept
                )
            )
    zeros = torch.zeros(response_ids.shape, dtype=torch.float32, device=hidden.device)  # [B, T]
    columns = list(zip(*chunks)) if compute_entropy else [[c[0] for c in chunks]]  # the ones computed
    per_token = [zeros.masked_scatter(response_mask, torch.cat(parts)) for parts in columns]  # [B, T] each
    return ResponseLogprobs(*per_token) if compute_entropy else ResponseLogprobs(per_token[0], entropy=None)


def decoder_logprobs(
    model: nn.Module,
    transform: LogitTransform,
    head_float32: bool,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float,
    compute_entropy: bool,
    chunk_size: int,
    entropy_grad: bool = True,
    support: FlatSupport | None = None,
) -> LogprobTensors:
    """Run the decoder body of ``model`` once, then the chunked head on the response positions (renormalized over
    ``support``'s kept sets when given)."""
    P = input_ids.shape[1] - response_ids.shape[1]
    hidden = decoder_hidden_states(model, input_ids, attention_mask, position_ids)  # [B, P+T, H]
    result = chunked_response_logprobs(
        model.get_output_embeddings(), hidden[:, P - 1 : -1], response_ids, response_mask,
        temperature, compute_entropy, chunk_size, transform, entropy_grad, head_float32, support,
    )  # fmt: skip
    return result.logprobs, result.entropy, result.impurity
