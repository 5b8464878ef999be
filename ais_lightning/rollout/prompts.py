"""Prompt helpers every rollout engine shares: input checks and left padding.

Position convention (shared with ``ais_lightning.policy``): prompts are LEFT-padded and
``position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)``, so response token ``t`` of a
prompt of length ``L`` sits at position ``L + t``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ais_lightning.ops import pad_sequences


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int | None = None) -> None:
    """Raise ValueError unless ``prompts`` is a non-empty list of non-empty token-id lists.

    With ``vocab_size``, every id must lie in ``[0, vocab_size)``; without it, only ``>= 0`` is checked.
    """
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or not p:
            raise ValueError(f"prompts[{i}] must be a non-empty list of token ids")
        if min(p) < 0 or (vocab_size is not None and max(p) >= vocab_size):
            raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab_size})")


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token-id lists into ``(ids [B, P] long, mask [B, P] bool)``."""
    return pad_sequences([list(p) for p in prompts], pad_token_id, "left")
