"""Loss penalties on the trainer/rollout log-ratio (pure functions, differentiable in ``logprobs``).

prime-rl's default loss (``src/prime_rl/trainer/rl/loss.py``, ``default_loss_fn``; the Kimi-K2.5 KL
term, arXiv 2602.02276) adds to every token of the loss mask, masked by the DPPO trust region or not,

    kl_tau * (trainer_logprobs - inference_logprobs)^2 = kl_tau * (log pi_theta - log mu)^2

with ``kl_tau = 1e-3`` (``DefaultLossConfig.kl_tau``, also the ``IPOLossConfig`` default), summed over
the tokens and divided, like the policy term, by the global number of loss-mask tokens
(``compute_loss``: ``rl_loss / rl_scale``). ``pi_theta`` is the policy being optimised (with grad) and
``mu`` the inference engine's log-probs, so the penalty pulls pi_theta back towards the policy that
generated the rollout, mismatch included.
"""

from __future__ import annotations

import torch

from ais_lightning.ops import check_mask, check_token_tensor, masked_sum

PRIME_RL_KL_TAU = 1e-3
"""prime-rl's default coefficient of the squared log-ratio penalty (``DefaultLossConfig.kl_tau``)."""


def squared_log_ratio_penalty(
    logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per-token (log pi_theta - log mu)^2, 0 on masked tokens.  # [B, T]

    Args:
        logprobs: ``[B, T]`` log pi_theta of the sampled tokens, with grad (the gradient flows here).
        rollout_logprobs: ``[B, T]`` log mu from the rollout engine (detached here).
        mask: ``[B, T]`` bool, the tokens that carry the penalty (prime-rl: the whole loss mask).

    Masked positions are zeroed before the arithmetic, so padding (-inf, NaN) cannot reach the
    gradient. Computed in at least float32.
    """
    check_mask(mask)
    check_token_tensor(logprobs, "logprobs", mask)
    check_token_tensor(rollout_logprobs, "rollout_logprobs", mask)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    logp = torch.where(mask, logprobs.to(dtype), zero)  # [B, T], grad
    log_mu = torch.where(mask, rollout_logprobs.detach().to(dtype), zero)  # [B, T]
    return (logp - log_mu).square()  # [B, T], 0 where masked


def squared_log_ratio_penalty_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float = PRIME_RL_KL_TAU,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """prime-rl's penalty term: coef * sum_mask (log pi_theta - log mu)^2 / denominator.  # scalar

    ``denominator`` defaults to the number of valid tokens (token-mean); pass the same denominator as
    the policy term (e.g. the mini-batch token count when micro-batching) so that the two add up like
    prime-rl's ``(pg + kl) / rl_scale``. No valid token gives 0, still connected to the graph.
    """
    if not coef >= 0.0:
        raise ValueError(f"coef must be >= 0, got {coef}")
    per_token = squared_log_ratio_penalty(logprobs, rollout_logprobs, mask)  # [B, T]
    total = masked_sum(per_token, mask)
    if denominator is None:
        count = mask.sum().clamp(min=1).to(total.dtype)
    else:
        count = torch.as_tensor(denominator, device=total.device).to(total.dtype)
        if not bool(count > 0):
            raise ValueError(f"denominator must be > 0, got {denominator}")
    return coef * total / count
