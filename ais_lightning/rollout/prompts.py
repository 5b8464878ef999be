"""Prompt helpers every rollout engine shares: argument checks and left padding.

:func:`check_generate_args` is what every engine's ``generate`` checks first: ``prompts`` is a list of
lists of integer token ids in the vocabulary (a float id is refused, never truncated), ``sampling`` is a
``SamplingConfig``, and the longest prompt plus ``max_new_tokens`` fits the model's context
(:func:`context_length`); each error names the argument and the lengths.

Position convention (shared with ``ais_lightning.policy``): prompts are LEFT-padded and
``position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)``, so response token ``t`` of a
prompt of length ``L`` sits at position ``L + t``.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Sequence
from typing import Any

import torch

from ais_lightning.ops import pad_sequences

log = logging.getLogger(__name__)

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
"""Model config attributes that give the context length, in the order they are read."""


def _is_token_id(value: Any) -> bool:
    if type(value) is int:  # the common case, fast
        return True
    if isinstance(value, torch.Tensor):
        return (
            value.ndim == 0
            and not value.is_floating_point()
            and not value.is_complex()
            and value.dtype != torch.bool
        )
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int | None = None) -> None:
    """Raise ValueError unless ``prompts`` is a non-empty list of non-empty lists of integer token ids.

    A float (``3.0``), a bool or a string in place of an id is refused naming it (``prompts[0][2]``), never
    cast. With ``vocab_size``, every id must lie in ``[0, vocab_size)``; without it, only ``>= 0`` is checked.
    """
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of token-id lists, got {_describe(prompts)}")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or not p:
            raise ValueError(f"prompts[{i}] must be a non-empty list of token ids, got {_describe(p)}")
        if not all(type(t) is int for t in p):
            for j, t in enumerate(p):
                if not _is_token_id(t):
                    raise ValueError(f"prompts[{i}][{j}] must be an integer token id, got {_describe(t)}")
        if min(p) < 0 or (vocab_size is not None and max(p) >= vocab_size):
            raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab_size})")


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def context_length(model: Any) -> int | None:
    """The context length (positions) of a Hugging Face model, from its config (:data:`CONTEXT_KEYS`); None
    when the config states none."""
    config = getattr(model, "config", None)
    for key in CONTEXT_KEYS:
        value = getattr(config, key, None)
        if type(value) is int and value > 0:
            return value
    return None


def check_context(prompts: Sequence[Sequence[int]], max_new_tokens: int, context: int | None) -> None:
    """ValueError naming the prompt and the lengths when a prompt plus ``max_new_tokens`` passes ``context``
    positions (None: not known, not checked): past it a model extrapolates its positions, silently and slowly."""
    if context is None:
        return
    lengths = [len(p) for p in prompts]
    i = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[i] + max_new_tokens > context:
        raise ValueError(
            f"prompts[{i}] has {lengths[i]} tokens; with max_new_tokens={max_new_tokens} that is "
            f"{lengths[i] + max_new_tokens} positions, past the model's context of {context}: shorten the prompts "
            f"(at most {max(context - max_new_tokens, 0)} tokens) or truncate them (ais-train: "
            "algorithm.truncate_prompts=true)"
        )


def fit_context(
    prompts: list[list[int]], max_new_tokens: int, context: int | None, truncate: bool = False
) -> tuple[list[list[int]], int]:
    """``(prompts, how many were cut)``: the prompts checked against ``context`` (:func:`check_context`), or with
    ``truncate`` each cut to its last ``context - max_new_tokens`` tokens (the end of a prompt holds the question
    and, in a chat template, the generation prompt). Nothing is cut without ``truncate``."""
    if context is None:
        return prompts, 0
    if not truncate:
        check_context(prompts, max_new_tokens, context)
        return prompts, 0
    keep = context - max_new_tokens
    if keep < 1:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's context of {context}"
        )
    cut = sum(len(p) > keep for p in prompts)
    return ([p[-keep:] if len(p) > keep else p for p in prompts], cut) if cut else (prompts, 0)


class PromptEncoder:
    """A policy's token ids of text prompts, fitted to its model's context with ``max_new_tokens``
    (:func:`fit_context`: refused naming the lengths, or cut with ``truncate``, one WARNING the first time)."""

    def __init__(self, policy: Any, max_new_tokens: int, truncate: bool = False) -> None:
        self.policy, self.max_new_tokens, self.truncate = policy, max_new_tokens, truncate
        self.warned = False

    def __call__(self, prompts: list[str]) -> list[list[int]]:
        context = context_length(self.policy.model)
        ids, cut = fit_context(
            self.policy.encode_prompts(prompts), self.max_new_tokens, context, self.truncate
        )
        if cut and not self.warned:
            self.warned = True
            log.warning(
                "algorithm.truncate_prompts: %d of %d prompts were longer than the model's context (%s) less "
                "max_new_tokens=%d and were cut to their last tokens (this warning is logged once)",
                cut,
                len(ids),
                context,
                self.max_new_tokens,
            )
        return ids


def check_generate_args(
    prompts: Sequence[Sequence[int]],
    sampling: Any,
    vocab_size: int | None = None,
    context: int | None = None,
) -> None:
    """The checks at the top of every engine's ``generate``: :func:`check_prompts`, ``sampling`` is a
    ``SamplingConfig``, and :func:`check_context` with ``sampling.max_new_tokens``."""
    from ais_lightning.rollout.base import SamplingConfig

    if not isinstance(sampling, SamplingConfig):
        raise ValueError(f"sampling must be a SamplingConfig, got {_describe(sampling)}")
    check_prompts(prompts, vocab_size)
    check_context(prompts, sampling.max_new_tokens, context)


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token-id lists into ``(ids [B, P] long, mask [B, P] bool)``."""
    return pad_sequences([list(p) for p in prompts], pad_token_id, "left")
