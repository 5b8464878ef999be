"""Advantage-sign-aware token masking on the probability difference pi - mu (prime-rl's default loss).

prime-rl ``src/prime_rl/trainer/rl/loss.py``, ``default_loss_fn`` ("DPPO-Binary TV", arXiv 2602.04879,
plus Kimi-K2.5's KL term), with ``DefaultLossConfig`` defaults ``dppo_mask_low = dppo_mask_high = 0.2``
(``packages/prime-rl-configs/src/prime_rl/configs/trainer.py``):

    probs_diff = exp(trainer_logprobs) - exp(inference_logprobs)          # pi - mu, in probability
    masked     = probs_diff >  dppo_mask_high   where A > 0                # pushed up too far already
                 probs_diff < -dppo_mask_low    elsewhere (A <= 0)         # pushed down too far already
    pg_loss    = keep * A * pi / mu ;  per_token_loss = -pg_loss + kl_tau * (log pi - log mu)^2

(``torch.where(advantages > 0, high, low)``: a zero advantage takes the low branch.) The masked
tokens lose their policy-gradient term but keep the (log ratio)^2 penalty and stay in the
normaliser (the global count of loss-mask tokens, ``rl_scale``); so by default they stay in
``out.mask`` with weight 0 here, and ``drop_from_denominator=True`` removes them instead. A kept
token weighs w = pi_old / mu, so that with GRPO's decoupled ratio pi_theta / pi_old the product is
prime-rl's pi_theta / mu. The penalty is a loss term, not a corrector:
``ais_lightning.losses.penalties.squared_log_ratio_penalty``.

prime-rl evaluates the mask with the current trainer log-probs pi_theta (equal to pi_old at the first
micro-step); here it is computed once from pi_old. The probability difference needs the absolute
log-probs, not only their difference (``needs_logprobs``: ``from_log_ratio`` must get
``train_logprobs`` and ``rollout_logprobs``; a direct call passes them).
"""

from __future__ import annotations

import math

import torch

from ais_lightning import ops
from ais_lightning.correctors.advantage import token_advantages
from ais_lightning.correctors.base import Corrector, RawCorrection


def _check_prob_threshold(name: str, value: float) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not (ok and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be a probability difference in [0, 1], got {value!r}")
    return float(value)


class DPPOMask(Corrector):
    """Mask tokens whose probability moved past ``mask_high`` (A > 0) or ``-mask_low`` (A <= 0) (prime-rl).

    Args:
        mask_low: threshold on mu - pi for tokens with A <= 0 (prime-rl ``dppo_mask_low``).
        mask_high: threshold on pi - mu for tokens with A > 0 (prime-rl ``dppo_mask_high``).
        drop_from_denominator: False (prime-rl): masked tokens get weight 0 but stay in ``out.mask``
            (and keep the squared-log-ratio penalty); True: they leave ``out.mask`` too.

    Needs ``advantages``. Extra stats, prime-rl's metric names under ``dppo/`` (means over valid
    tokens): ``dppo/is_masked``, ``dppo/is_masked_high`` (A > 0 and masked), ``dppo/is_masked_low``
    (A < 0 and masked), ``dppo/masked_mismatch_kl`` / ``dppo/unmasked_mismatch_kl`` (mean k3 =
    w - 1 - log w over the masked / kept tokens), ``dppo/masked_advantage_positive`` /
    ``dppo/masked_advantage_negative`` (sign shares among the masked tokens).
    """

    def __init__(
        self, mask_low: float = 0.2, mask_high: float = 0.2, drop_from_denominator: bool = False
    ) -> None:
        super().__init__()
        self.mask_low = _check_prob_threshold("mask_low", mask_low)
        self.mask_high = _check_prob_threshold("mask_high", mask_high)
        self.drop_from_denominator = bool(drop_from_denominator)

    needs_logprobs = True

    def correct(
        self,
        delta: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor | None,
        entropy: torch.Tensor | None,
        logprobs: tuple[torch.Tensor, torch.Tensor],
    ) -> RawCorrection:
        zero = torch.zeros_like(delta, dtype=torch.float64)
        log_pi, log_mu = (torch.where(mask, lp.double(), zero) for lp in logprobs)  # [B, T] each, 0 if masked
        adv = token_advantages(advantages, mask, "DPPOMask")  # [B, T]
        probs_diff = torch.exp(log_pi) - torch.exp(log_mu)  # [B, T], pi - mu
        invalid_high = probs_diff > self.mask_high  # [B, T]
        invalid_low = probs_diff < -self.mask_low  # [B, T]
        positive, negative = adv > 0, adv < 0  # [B, T]
        masked = mask & torch.where(positive, invalid_high, invalid_low)  # [B, T]
        kept = mask & ~masked  # [B, T]
        k3 = torch.expm1(delta.double()) - delta.double()  # [B, T], w - 1 - log w
        n = mask.sum().clamp(min=1).double()
        extra = {
            "dppo/is_masked": masked.sum().double() / n,
            "dppo/is_masked_high": (masked & positive).sum().double() / n,
            "dppo/is_masked_low": (masked & negative).sum().double() / n,
            "dppo/masked_mismatch_kl": ops.masked_mean(k3, masked),
            "dppo/unmasked_mismatch_kl": ops.masked_mean(k3, kept),
            "dppo/masked_advantage_positive": ops.masked_mean(positive.double(), masked),
            "dppo/masked_advantage_negative": ops.masked_mean(negative.double(), masked),
        }
        weights = torch.where(kept, torch.exp(delta), torch.zeros_like(delta))  # [B, T]
        if self.drop_from_denominator:  # counted in corrector/masked_frac
            return RawCorrection(weights, kept, torch.zeros_like(mask), extra)
        return RawCorrection(weights, mask, masked, extra)  # zeroed in place: corrector/clipped_frac

    def extra_repr(self) -> str:
        return (
            f"mask_low={self.mask_low}, mask_high={self.mask_high}, "
            f"drop_from_denominator={self.drop_from_denominator}"
        )
