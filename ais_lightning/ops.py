"""Small pure-tensor helpers shared by correctors, losses and diagnostics.

Conventions (docs/design.md section 2): log-prob tensors are ``[B, T]`` floats, ``mask`` is a
``[B, T]`` bool tensor with True on valid response tokens. Nothing here imports Lightning.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

LOG_RATIO_CLAMP = 20.0
"""Log-ratios log(pi) - log(mu) are clamped to +-20 before ``exp`` (docs/design.md section 3)."""


def pad_sequences(seqs: list[list[int]], pad_id: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token-id lists to ``(ids [B, L] long, mask [B, L] bool)`` on the ``left`` or ``right``."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    length = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)  # [B, L]
    mask = torch.zeros((len(seqs), length), dtype=torch.bool)  # [B, L]
    for i, s in enumerate(seqs):
        if not s:
            continue
        cols = slice(length - len(s), length) if side == "left" else slice(0, len(s))
        ids[i, cols] = torch.as_tensor(s, dtype=torch.long)
        mask[i, cols] = True
    return ids, mask


def _map_fields(value: Any, on_tensor: Any, on_list: Any) -> Any:
    """Apply ``on_tensor`` to every tensor and ``on_list`` to every list of a tensor / list / dict / dataclass."""
    if isinstance(value, torch.Tensor):
        return on_tensor(value)
    if isinstance(value, list):
        return on_list(value)
    if isinstance(value, dict):
        return {k: _map_fields(v, on_tensor, on_list) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: _map_fields(getattr(value, f.name), on_tensor, on_list)
            for f in dataclasses.fields(value)
            if f.init
        }
        return dataclasses.replace(value, **changes)
    return value


def take_rows(value: Any, index: torch.Tensor) -> Any:
    """The rows ``index`` (``[R]`` long) of ``value``: a tensor (first dim), a list, or a dict or dataclass
    of those (recursively, so one call slices a whole rollout step); anything else is returned as is.
    """
    rows = index.tolist()
    return _map_fields(value, lambda t: t[index.to(t.device)], lambda items: [items[i] for i in rows])


def autograd_usable(t: Any) -> Any:
    """A normal copy of an inference-mode tensor (engines build batches under ``torch.inference_mode``,
    and autograd may not save such tensors for backward); anything else unchanged."""
    return t.clone() if isinstance(t, torch.Tensor) and t.is_inference() else t


def to_device(value: Any, device: torch.device | str) -> Any:
    """``value`` (a tensor, or a dict / dataclass of tensors, recursively) with every tensor on ``device``."""
    return _map_fields(value, lambda t: t.to(device), lambda items: items)


def check_mask(mask: torch.Tensor, name: str = "mask") -> None:
    """Raise ValueError unless ``mask`` is a 2-D bool tensor."""
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise ValueError(
            f"{name} must be a bool tensor (True = valid response token), got dtype {mask.dtype}"
        )
    if mask.dim() != 2:
        raise ValueError(f"{name} must have shape [B, T], got {tuple(mask.shape)}")


def check_token_tensor(x: torch.Tensor, name: str, mask: torch.Tensor) -> None:
    """Raise ValueError unless ``x`` is a floating tensor shaped like ``mask``, finite on valid tokens."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.shape != mask.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)} but mask has shape {tuple(mask.shape)}")
    if not bool((torch.isfinite(x) | ~mask).all()):  # no boolean indexing: one fused pass
        raise ValueError(f"{name} has non-finite values on valid (mask=True) tokens")


def check_logprob_inputs(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    **optional: torch.Tensor | None,
) -> None:
    """Validate the shared ``(train_logprobs, rollout_logprobs, mask)`` signature.

    Extra keyword tensors (e.g. ``entropy=...``) are checked the same way when not None.
    An ``advantages`` tensor may also be ``[B]`` (one advantage per sequence).
    """
    check_mask(mask)
    check_token_tensor(train_logprobs, "train_logprobs", mask)
    check_token_tensor(rollout_logprobs, "rollout_logprobs", mask)
    for name, value in optional.items():
        if value is None:
            continue
        if name == "advantages" and isinstance(value, torch.Tensor) and value.dim() == 1:
            if value.shape[0] != mask.shape[0]:
                raise ValueError(
                    f"advantages has shape {tuple(value.shape)}; expected [B]={mask.shape[0]} or [B, T]"
                )
            if not bool(torch.isfinite(value).all()):
                raise ValueError("advantages has non-finite values")
            continue
        check_token_tensor(value, name, mask)


def log_ratio(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """delta = clamp(log pi - log mu, -20, 20), zero on masked tokens, detached.  # [B, T]"""
    delta = (train_logprobs.detach().float() - rollout_logprobs.detach().float()).clamp(
        -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
    )
    return torch.where(mask, delta, torch.zeros_like(delta))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over valid tokens (all of them, or along ``dim``)."""
    x = torch.where(mask, x, torch.zeros_like(x))
    return x.sum() if dim is None else x.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over valid tokens; 0 (not NaN) where there are none."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def sequence_log_ratio(delta: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Per-sequence log-ratio broadcast to tokens.  # [B, T]

    ``sequence``: sum of token log-ratios (log of the product of ratios);
    ``geometric``: mean of token log-ratios (log of the geometric mean).
    Clamped to +-20 so that exp stays finite.
    """
    if level == "sequence":
        seq = masked_sum(delta, mask, dim=-1)  # [B]
    elif level == "geometric":
        seq = masked_mean(delta, mask, dim=-1)  # [B]
    else:
        raise ValueError(f"level must be 'sequence' or 'geometric' here, got {level!r}")
    seq = seq.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return seq.unsqueeze(-1).expand_as(delta)


def logprobs_from_logits(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-prob of ``tokens`` under ``softmax(logits / temperature)``, computed in fp32.

    logits: ``[..., V]``; tokens: ``[...]`` (long). Returns ``[...]`` float32.
    The same temperature processing is used by the trainer and every rollout engine, so that
    pi and mu are comparable (trl #4159).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    scaled = logits.float() / temperature  # [..., V]
    picked = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [...]
    return picked - torch.logsumexp(scaled, dim=-1)


def tempered_log_softmax(logits: torch.Tensor, temperature: float, what: str = "log-probs") -> torch.Tensor:
    """``log_softmax(logits / temperature)`` in fp32 (``what`` names the caller in the error).  # [..., V]"""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for {what}, got {temperature}")
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of the distribution with log-probabilities ``logp`` ``[..., V]``.  # [...]"""
    return -(logp.exp() * logp).sum(-1)


def impurity_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """Collision (Gini) impurity ``1 - sum_a pi(a)^2`` of the distribution with log-probabilities ``logp``.  # [...]

    The chance that two independent draws from pi differ: 0 for a deterministic policy, 1 - 1/V for a
    uniform one. Computed as ``sum_a pi(a) (1 - pi(a))`` with ``1 - pi = -expm1(log pi)``, which keeps
    its digits when one token holds almost all the mass (``1 - sum pi^2`` in fp32 would round to 0
    below ~1e-7). AIS v2 measures the rollout's mismatch against it (docs/ais.md section 3).
    """
    return (logp.exp() * -torch.expm1(logp)).sum(-1).clamp(0.0, 1.0)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` in nats, computed in fp32.  # [...]"""
    return entropy_from_logprobs(tempered_log_softmax(logits, temperature, "entropy"))


def impurity_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``impurity_from_logprobs`` of ``softmax(logits / temperature)``, computed in fp32.  # [...]"""
    return impurity_from_logprobs(tempered_log_softmax(logits, temperature, "impurity"))


def topk_sets_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Whether two top-k routings pick different expert *sets* (order ignored): ``[..., k]`` each -> ``[...]`` bool."""
    if a.shape != b.shape:
        raise ValueError(
            f"routings to compare must have one shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    return (a.long().sort(dim=-1).values != b.long().sort(dim=-1).values).any(dim=-1)
