"""TBPO: Trust-Band Policy Optimization, a sequence-level clipped objective for quantized rollouts.

QaRL (Gu et al. 2026, "QaRL: Rollout-Aligned Quantization-Aware RL for Fast and Stable Training under
Training-Inference Mismatch", arXiv 2604.07853) introduces TBPO as "a sequence-level objective with dual
clipping for negative samples, aimed to keep updates within the trust region". The paper's equations
were not at hand, so this module implements the following formulation, built from that description
(AS IMPLEMENTED; a stranger should be able to re-derive every number from it). For each sequence i
with valid tokens t (``mask``), n_i of them:

    r_i = exp(mean_t(log pi_theta - log pi_old))           # geometric-mean policy ratio, grad via pi_theta
    m_i = exp(mean_t(log pi_old  - log mu))                # geometric-mean mismatch weight, detached
    L_i = -min(r_i A_i, clip(r_i, 1 - eps_low, 1 + eps_high) A_i)      # PPO clip, sequence level
    L_i = min(L_i, -dual_clip * A_i)                        if A_i < 0 (dual clip)
    keep_i = n_i > 0 and band_low <= m_i <= band_high       # the trust band on the rollout mismatch
    loss = sum_{i kept} m_i L_i / #kept                     (m_i -> 1 with weight_by_mismatch=False)

* r_i is GSPO's sequence ratio (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv
  2507.18071): the length-normalised ratio keeps the clip range meaningful for long responses, where a
  product of token ratios would explode (docs/design.md section 7).
* Dual clip (Ye et al. 2020, arXiv 1912.09729; verl's ``clip_ratio_c``): for A_i < 0 the loss
  |A_i| * max(r_i, clip(r_i)) is capped at dual_clip * |A_i|, so one negative sample whose ratio has
  exploded cannot dominate the update.
* Trust band: sequences whose rollout mismatch m_i = pi_old / mu (geometric mean) leaves
  [band_low, band_high] are DROPPED from the loss and from its denominator (rejected samples left in
  the denominator would shrink the loss: slime #657, verl #4852). Kept sequences are weighted by the
  detached m_i (importance correction of the off-policy sample, applied after clipping, as in the
  decoupled mode of :class:`~ais_lightning.losses.grpo.GRPOLoss`). Log-ratios are clamped to +-20
  per token and per sequence before ``exp`` (``ais_lightning.ops``).
* Without ``rollout_logprobs`` every non-empty sequence is kept with m_i = 1 (GSPO + dual clip); use
  this when the caller already passes mu as ``old_logprobs`` (bypass) or when the trainer's forward is
  the rollout's quantized forward (QaRL's rollout alignment, where pi_old = mu).

``advantages`` may be ``[B]`` or ``[B, T]``; a ``[B, T]`` tensor is reduced to A_i = mean over the
sequence's valid tokens (the value itself for GRPO's per-sequence advantages broadcast along T).
"""

from __future__ import annotations

import math

import torch

from ais_lightning.losses.base import LossOutput, PolicyLoss
from ais_lightning.losses.grpo import (
    aggregate,
    check_identity_weights,
    check_policy_loss_inputs,
    clipped_surrogate,
    masked_as,
)
from ais_lightning.ops import check_token_tensor, log_ratio, masked_mean, sequence_log_ratio


def geometric_log_ratio(delta: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean of token log-ratios over valid tokens, clamped to +-20.  # [B]

    ``delta`` ``[B, T]`` (zero or anything on masked tokens: they are excluded); 0 for a sequence with
    no valid token. Keeps the gradient of ``delta`` (``ais_lightning.ops.sequence_log_ratio``).
    """
    if delta.shape[-1] == 0:
        return delta.new_zeros(delta.shape[0])
    return sequence_log_ratio(delta, mask, "geometric")[:, 0]  # [B]


class TBPOLoss(PolicyLoss):
    """Sequence-level trust-band PPO-clip loss of QaRL (arXiv 2604.07853), as formulated in the module doc.

    Args:
        epsilon_low: lower clip of the sequence ratio, r_i >= 1 - epsilon_low; in [0, 1].
        epsilon_high: upper clip, r_i <= 1 + epsilon_high; finite, >= 0. The defaults (3e-4, 4e-4)
            are GSPO's (arXiv 2507.18071): a length-normalised ratio moves far less than a token ratio,
            so token-level ranges such as 0.2 would never clip.
        dual_clip: dual-clip constant c > 1 for negative advantages, or None to disable. Default 3.0,
            verl's ``clip_ratio_c`` default.
        band_low: lower edge of the trust band on m_i; in [0, 1]. 0 disables the lower edge.
        band_high: upper edge of the trust band on m_i; >= 1, ``math.inf`` disables it. The defaults
            (0.5, 2.0) are the MIS rejection bounds of this library (docs/design.md section 3), so TBPO and
            MIS reject on the same scale. They only catch pathological samples: a mean per-token
            |log(pi_old / mu)| of ln 2 = 0.69, whereas the measured token mismatch KL of FP8/FP4/int8
            rollouts here is 6e-4 .. 2e-2 (docs/design.md section 5), i.e. m_i within a few percent of 1;
            garbled "error token" responses, where the trainer disagrees with the rollout on many
            tokens at once, are what leaves the band.
        weight_by_mismatch: multiply each kept sequence's loss by its detached m_i (True), or keep the
            band as a pure filter (False).

    Stats (floats, detached): ``loss/pg_loss`` and ``loss/total`` (equal; with ``denominator`` they are
    this call's share), ``tbpo/kept_frac`` (kept / sequences with a valid token), ``tbpo/drop_low_frac``
    and ``tbpo/drop_high_frac`` (dropped below / above the band, same denominator),
    ``tbpo/mismatch_mean`` (mean m_i over sequences with a valid token, before the band),
    ``tbpo/ratio_mean``, ``tbpo/clipfrac`` (the clipped branch of the min is taken) and
    ``tbpo/dual_clipfrac`` (the dual clip is active) over kept sequences. Every stat is 0.0 when its
    denominator is empty, never NaN.
    """

    def __init__(
        self,
        epsilon_low: float = 3e-4,
        epsilon_high: float = 4e-4,
        dual_clip: float | None = 3.0,
        band_low: float = 0.5,
        band_high: float = 2.0,
        weight_by_mismatch: bool = True,
    ) -> None:
        super().__init__()
        if not (0.0 <= epsilon_low <= 1.0):
            raise ValueError(f"epsilon_low must be in [0, 1], got {epsilon_low}")
        if not (0.0 <= epsilon_high < math.inf):
            raise ValueError(f"epsilon_high must be a finite value >= 0, got {epsilon_high}")
        if dual_clip is not None and not (1.0 < dual_clip < math.inf):
            raise ValueError(f"dual_clip must be a finite value > 1 (or None), got {dual_clip}")
        if not (0.0 <= band_low <= 1.0):
            raise ValueError(
                f"band_low must be in [0, 1] (a band excluding m=1 drops matched samples), got {band_low}"
            )
        if not (band_high >= 1.0):
            raise ValueError(f"band_high must be >= 1 (math.inf disables it), got {band_high}")
        if not isinstance(weight_by_mismatch, bool):
            raise ValueError(f"weight_by_mismatch must be a bool, got {weight_by_mismatch!r}")
        self.epsilon_low = float(epsilon_low)
        self.epsilon_high = float(epsilon_high)
        self.dual_clip = None if dual_clip is None else float(dual_clip)
        self.band_low = float(band_low)
        self.band_high = float(band_high)
        self.weight_by_mismatch = weight_by_mismatch

    def extra_repr(self) -> str:
        return (
            f"epsilon_low={self.epsilon_low}, epsilon_high={self.epsilon_high}, dual_clip={self.dual_clip}, "
            f"band_low={self.band_low}, band_high={self.band_high}, weight_by_mismatch={self.weight_by_mismatch}"
        )

    needs_entropy = False
    """TBPO has no entropy bonus."""
    needs_reference = False
    """TBPO has no KL penalty."""

    @property
    def own_correction(self) -> str | None:
        """TBPO corrects the rollout mismatch itself (so the run's corrector must be ``none``)."""
        return "loss=tbpo (TBPOLoss) drops sequences outside its trust band and weights the rest by pi_old/mu"

    def forward(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        weights: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
        denominator: float | torch.Tensor | None = None,
        rollout_logprobs: torch.Tensor | None = None,
    ) -> LossOutput:
        """Loss and stats for one (micro-)batch (the call signature of every policy loss here).

        Args:
            logprobs: ``[B, T]`` log pi_theta of the sampled tokens, with grad.
            old_logprobs: ``[B, T]`` log pi_old from the trainer before the update; detached here.
            advantages: ``[B]`` (one per sequence) or ``[B, T]``; detached here.
            mask: ``[B, T]`` bool, valid response tokens.
            weights: None or identity weights (1 on every valid token, ``NoCorrection``'s output): TBPO
                corrects the mismatch itself (trust band, m_i weights), so real IS weights are refused.
            ref_logprobs, entropy: must be None (TBPO has no KL penalty and no entropy bonus).
            rollout_logprobs: ``[B, T]`` log mu from the rollout engine, or None (m_i = 1, nothing dropped).
            denominator: positive count replacing the number of kept sequences (micro-batches of one
                mini-batch, each divided by the mini-batch's kept count, then sum to its loss).
        """
        advantages = self._checked_inputs(
            logprobs,
            old_logprobs,
            advantages,
            mask,
            weights,
            ref_logprobs,
            entropy,
            denominator,
            rollout_logprobs,
        )  # [B, T]
        dtype = torch.promote_types(logprobs.dtype, torch.float32)
        logp = masked_as(logprobs, mask, dtype)  # [B, T], grad
        old = masked_as(old_logprobs.detach(), mask, dtype)  # [B, T]
        adv_tok = masked_as(advantages.detach(), mask, dtype)  # [B, T]

        has_valid = mask.any(dim=-1)  # [B]
        adv = masked_mean(adv_tok, mask, dim=-1)  # [B]
        ratio = torch.exp(geometric_log_ratio(logp - old, mask))  # [B], grad
        pg, clipped, dual_active = clipped_surrogate(
            ratio, adv, has_valid, self.epsilon_low, self.epsilon_high, self.dual_clip
        )  # [B] each: one "token" per sequence
        mismatch, below, above, kept = self._band(old_logprobs, rollout_logprobs, mask, dtype)  # [B] each
        if self.weight_by_mismatch:
            pg = pg * mismatch  # [B], detached weight after clipping

        # One "token" per sequence: aggregate's token-mean is the mean over kept sequences, 0 in the
        # graph when none is kept.
        pg_loss = aggregate(pg.unsqueeze(-1), kept.unsqueeze(-1), "token-mean", denominator=denominator)
        loss = pg_loss
        with torch.no_grad():
            n_seq = has_valid.sum().clamp(min=1)
            n_kept = kept.sum().clamp(min=1)
            stats = {
                "loss/pg_loss": pg_loss.item(),
                "loss/total": loss.item(),
                "tbpo/kept_frac": (kept.sum() / n_seq).item(),
                "tbpo/drop_low_frac": (below.sum() / n_seq).item(),
                "tbpo/drop_high_frac": (above.sum() / n_seq).item(),
                "tbpo/mismatch_mean": masked_mean(mismatch, has_valid).item(),
                "tbpo/ratio_mean": masked_mean(ratio, kept).item(),
                "tbpo/clipfrac": ((clipped & kept).sum() / n_kept).item(),
                "tbpo/dual_clipfrac": ((dual_active & kept).sum() / n_kept).item(),
            }
        return LossOutput(loss=loss, stats=stats, shares=frozenset(("loss/pg_loss", "loss/total")))

    @staticmethod
    def _checked_inputs(
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        weights: torch.Tensor | None,
        ref_logprobs: torch.Tensor | None,
        entropy: torch.Tensor | None,
        denominator: float | torch.Tensor | None,
        rollout_logprobs: torch.Tensor | None,
    ) -> torch.Tensor:
        """Check :meth:`forward`'s inputs (ValueError naming the tensor: TBPO takes no IS weights, no reference and
        no entropy); returns the advantages broadcast to ``[B, T]``."""
        advantages = check_policy_loss_inputs(logprobs, old_logprobs, advantages, mask)  # [B, T]
        if weights is not None:
            check_token_tensor(weights, "weights", mask)
            check_identity_weights(weights, mask, "TBPOLoss")
        for name, value in (("ref_logprobs", ref_logprobs), ("entropy", entropy)):
            if value is not None:
                raise ValueError(f"{name} must be None: TBPOLoss has no KL penalty and no entropy bonus")
        if rollout_logprobs is not None:
            check_token_tensor(rollout_logprobs, "rollout_logprobs", mask)
        if denominator is not None and not bool(torch.as_tensor(denominator) > 0):
            raise ValueError(f"denominator must be > 0, got {denominator}")
        return advantages

    def _band(
        self,
        old_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor | None,
        mask: torch.Tensor,
        dtype: torch.dtype = torch.float32,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each sequence's mismatch m_i and whether it falls below, above or inside the band.  # [B] each"""
        has_valid = mask.any(dim=-1)  # [B]
        if rollout_logprobs is None:
            mismatch = torch.ones(mask.shape[0], dtype=dtype, device=mask.device)  # [B]
        else:
            delta = log_ratio(old_logprobs, rollout_logprobs, mask).to(dtype)  # [B, T], detached, clamped
            mismatch = torch.exp(geometric_log_ratio(delta, mask))  # [B]
        below = has_valid & (mismatch < self.band_low)  # [B]
        above = has_valid & (mismatch > self.band_high)  # [B]
        return mismatch, below, above, has_valid & ~below & ~above

    def denominator(
        self,
        mask: torch.Tensor,
        old_logprobs: torch.Tensor | None = None,
        rollout_logprobs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The kept sequences of a batch (at least 1): what the loss divides by. Micro-batches of the batch
        that each pass it as ``denominator`` have losses that add up to the batch's loss."""
        if old_logprobs is None:
            raise ValueError("TBPOLoss.denominator needs old_logprobs (the band is on pi_old / mu)")
        return self._band(old_logprobs, rollout_logprobs, mask)[3].sum().clamp(min=1)
