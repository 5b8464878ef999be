"""Next-token sampling as pure functions: temperature, min-p, top-k, top-p, greedy.

Every rollout engine samples with these, so mu is defined in one place. The log-prob returned
for a sampled token is that of the distribution it was drawn from:

- no truncation: ``ops.logprobs_from_logits(logits, token, T)``, the same temperature processing
  the trainer uses (trl #4159);
- min-p / top-k / top-p on: the log-prob under the *renormalized truncated* distribution, so
  log mu = log softmax(logits / T)[token] - log(kept mass) (trl #6789). :func:`draw_next` also returns the
  kept set, which the engines record (``RolloutBatch.support``, :mod:`ais_lightning.rollout.support`) so that the
  trainer renormalizes pi over the same tokens and the importance ratio pi / mu is exact;
- T == 0 (greedy): the token is the argmax and its log-prob is under the T = 1 distribution.

Coupled noise: by default each decode step draws one uniform per running row from one generator, so
a row's noise depends on the rest of the batch. Passing ``uniforms`` (one value per row, e.g. column
``t`` of a ``[B, T]`` table from :func:`uniform_table`) makes the draw a function of the row alone:
two engines given the same uniforms pick the same token wherever their CDFs put u in the same token
(``ais_lightning.rollout.coupled``; Sol-RL, arXiv 2604.06916, regenerates chosen samples that way).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ais_lightning.checks import check_int
from ais_lightning.ops import logprobs_from_logits


def _check_logits(logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a floating [B, V] tensor, got {shape}")


def check_truncation(top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> None:
    """Raise ValueError naming the argument unless ``top_k >= 0``, ``top_p`` in (0, 1] and ``min_p`` in [0, 1]."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0, got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not 0 <= min_p <= 1:  # also rejects NaN
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")


def truncates(vocab_size: int, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> bool:
    """Whether min-p, top-k or top-p can drop a token of a ``vocab_size``-token distribution."""
    return (0 < top_k < vocab_size) or top_p < 1.0 or min_p > 0.0


def truncation_mask(
    scaled_logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor | None:
    """Which tokens min-p, top-k then top-p keep (vLLM's order); None when all are off.  # [B, V] bool

    ``scaled_logits`` are the logits after temperature. min-p (vLLM's ``min_p``; Nguyen et al. 2024, "Turning Up
    the Heat: Min-p Sampling", arXiv 2407.01082) keeps the tokens whose probability is at least ``min_p`` times
    the most likely token's; top-k keeps exactly the ``k`` largest logits among those (ties broken by
    ``torch.topk``); top-p (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration") then keeps
    the smallest prefix of the distribution renormalized over what is left, sorted, whose mass reaches
    ``top_p``: a token is kept when the mass of the tokens ranked strictly above it is < ``top_p`` (so the
    most likely token is always kept).
    """
    _check_logits(scaled_logits)
    check_truncation(top_k, top_p, min_p)
    vocab = scaled_logits.shape[-1]
    if not truncates(vocab, top_k, top_p, min_p):
        return None
    keep = torch.ones_like(scaled_logits, dtype=torch.bool)  # [B, V]
    if min_p > 0:
        probs = scaled_logits.float().softmax(-1)  # [B, V]
        keep = probs >= min_p * probs.amax(-1, keepdim=True)
    if 0 < top_k < vocab:
        ranked = scaled_logits.float().masked_fill(~keep, float("-inf"))  # [B, V]
        idx = ranked.topk(top_k, dim=-1).indices  # [B, k]
        keep = keep & torch.zeros_like(keep).scatter_(-1, idx, True)
    if top_p < 1.0:
        masked = scaled_logits.float().masked_fill(~keep, float("-inf"))  # [B, V]
        probs_sorted, order = masked.softmax(-1).sort(dim=-1, descending=True)  # [B, V]
        mass_before = probs_sorted.cumsum(-1) - probs_sorted  # [B, V]
        keep_sorted = mass_before < top_p
        keep_sorted[:, 0] = True
        keep = keep & torch.zeros_like(keep).scatter_(-1, order, keep_sorted)
    return keep


def _truncated_logprobs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log-probs [B, V] fp32, kept [B, V] bool or None)`` of the distribution tokens are drawn from."""
    _check_logits(logits)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)  # [B, V]
    keep = truncation_mask(scaled, top_k, top_p, min_p)
    if keep is not None:
        scaled = scaled.masked_fill(~keep, float("-inf"))
    return torch.log_softmax(scaled, dim=-1), keep


def sampling_logprobs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """Log-probs of the distribution tokens are drawn from, in fp32.  # [B, V]

    ``log_softmax(logits / T)`` restricted to the min-p / top-k / top-p set and renormalized over it
    (``-inf`` outside). T == 0 uses T = 1 (greedy has no distribution of its own).
    """
    return _truncated_logprobs(logits, temperature, top_k, top_p, min_p)[0]


def check_uniforms(uniforms: torch.Tensor, shape: tuple[int, ...], name: str = "uniforms") -> None:
    """Raise ValueError unless ``uniforms`` is a floating tensor of ``shape`` with values in [0, 1).

    A trailing dimension of ``shape`` given as -1 accepts any size >= 1 (a table at least that long is
    checked by the caller).
    """
    if not isinstance(uniforms, torch.Tensor) or not uniforms.is_floating_point():
        kind = uniforms.dtype if isinstance(uniforms, torch.Tensor) else type(uniforms).__name__
        raise ValueError(f"{name} must be a floating-point tensor, got {kind}")
    if uniforms.dim() != len(shape) or any(want not in (-1, got) for want, got in zip(shape, uniforms.shape)):
        raise ValueError(f"{name} must have shape {shape}, got {tuple(uniforms.shape)}")
    if uniforms.numel() and not bool(((uniforms >= 0) & (uniforms < 1)).all()):  # also rejects NaN
        raise ValueError(f"{name} must lie in [0, 1)")


def uniform_table(rows: int, steps: int, seed: int | None = None) -> torch.Tensor:
    """One uniform in [0, 1) per row and decode step, float32.  # [rows, steps]

    Row ``i``'s noise is ``table[i]`` whatever else is generated with it, so any subset of rows can be
    generated again with the same noise (``ais_lightning.rollout.coupled.regenerate``).
    """
    check_int(rows, "rows")
    check_int(steps, "steps")
    return torch.rand((rows, steps), generator=make_generator(seed), dtype=torch.float32)


def sample_from_logprobs(
    logprobs: torch.Tensor,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw one token per row from ``exp(logprobs)``.  # [B] long

    Inverse-CDF sampling: one uniform u per row, the token is the first index whose cumulative
    probability exceeds u times the row's total mass. Tokens with probability 0 (``-inf``: top-k /
    top-p cut) are never drawn. One random number per row instead of one per vocabulary entry: the
    exponential race (argmax p_i / E_i) costs ~7 ms per decode step at [64, 4096] on this CPU.
    The fp32 running sum shifts each token's probability by at most ~V * 2^-24 of the row mass.
    ``uniforms`` (``[B]`` in [0, 1)) replaces the draw from ``generator`` (coupled sampling).
    """
    _check_logits(logprobs)
    cdf = logprobs.float().exp().cumsum(dim=-1)  # [B, V], non-decreasing, last = total mass
    total = cdf[:, -1:]  # [B, 1]
    if uniforms is None:
        u = torch.rand(total.shape, generator=generator, device=cdf.device, dtype=cdf.dtype)  # [B, 1]
    else:
        check_uniforms(uniforms, (logprobs.shape[0],))
        u = uniforms.to(device=cdf.device, dtype=cdf.dtype)[:, None]  # [B, 1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # [B, 1], < total
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [B]


class Draw(NamedTuple):
    """One decode step's draw (:func:`draw_next`)."""

    tokens: torch.Tensor
    """``[B]`` long, the sampled tokens."""
    logprobs: torch.Tensor
    """``[B]`` float32, their log-probs under the distribution they were drawn from (module docstring)."""
    kept: torch.Tensor | None
    """``[B, V]`` bool, the tokens the truncation kept; None when nothing was truncated or the step was greedy."""


def draw_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    min_p: float = 0.0,
) -> Draw:
    """Sample the next token of every row: tokens, their log-probs and the kept set (:class:`Draw`).

    ``logits`` is ``[B, V]`` in any float dtype. See the module docstring for which log-prob is
    returned in each mode. ``uniforms`` (``[B]`` in [0, 1)) replaces the draw from ``generator``;
    greedy decoding uses neither.
    """
    _check_logits(logits)
    if temperature == 0:
        tokens = logits.argmax(dim=-1)  # [B]
        return Draw(tokens, logprobs_from_logits(logits, tokens, 1.0), None)
    logp, keep = _truncated_logprobs(logits, temperature, top_k, top_p, min_p)  # [B, V]
    tokens = sample_from_logprobs(logp, generator, uniforms)  # [B]
    if keep is not None:
        return Draw(tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), keep)
    return Draw(tokens, logprobs_from_logits(logits, tokens, temperature), None)


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    min_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample the next token of every row and return ``(tokens [B] long, logprobs [B] fp32)``
    (:func:`draw_next` without the kept set)."""
    draw = draw_next(logits, temperature, top_k, top_p, generator, uniforms, min_p)
    return draw.tokens, draw.logprobs


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A seeded ``torch.Generator`` on ``device``, or None (global RNG) when ``seed`` is None."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    return gen
