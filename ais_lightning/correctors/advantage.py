"""Advantages for the correctors that look at their sign (OPSM, prime-rl's DPPO mask, VESPO)."""

from __future__ import annotations

import torch


def token_advantages(advantages: torch.Tensor | None, mask: torch.Tensor, owner: str) -> torch.Tensor:
    """``advantages`` (``[B]`` or ``[B, T]``) broadcast to ``[B, T]``; ValueError if it is None.  # [B, T]

    ``owner`` names the corrector in the error message. Shapes are validated by
    ``ops.check_logprob_inputs`` on the ``forward`` path; ``from_log_ratio`` callers are trusted, but a
    wrong shape still raises here rather than broadcasting silently.
    """
    if advantages is None:
        raise ValueError(f"advantages is required by {owner} (pass advantages=[B] or [B, T])")
    if advantages.dim() == 1:
        if advantages.shape[0] != mask.shape[0]:
            raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected [B]={mask.shape[0]}")
        return advantages.detach().unsqueeze(-1).expand(mask.shape)
    if advantages.shape != mask.shape:
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}; expected [B] or {tuple(mask.shape)}"
        )
    return advantages.detach()
