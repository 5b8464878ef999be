"""Off-policy sequence masking (OPSM) of DeepSeek-V3.2, as TRL's ``off_policy_mask_threshold``.

DeepSeek-V3.2 (arXiv 2512.02556, Eq. 9) drops a response i from the policy loss when its advantage is
negative AND the policy has drifted from the one that sampled it:

    M_i = 0  if  A_i < 0  and  (1/|o_i|) sum_t log( mu(o_t) / pi(o_t) ) > delta,     else 1.

TRL implements it in ``trl/trainer/grpo_trainer.py`` (``GRPOTrainer.get_off_policy_mask``): the
divergence is the **k1 estimator** of KL(mu || pi), ``sampling_per_token_logps - per_token_logps``
(log mu - log pi, no exp, can be negative), averaged over the response's valid tokens; a response
is kept iff ``advantages >= 0`` or that mean ``<= off_policy_mask_threshold`` (docs suggest 0.5).
Here pi is pi_old and the k1 mean is ``mean_t(-delta)``; TRL evaluates it with the current pi_theta
at every micro-step (equal to pi_old at the first one) and with vLLM's log-probs as mu.

TRL multiplies the per-token loss by the mask and leaves ``completion_mask`` (the denominator)
alone, as the paper's 1/G does: a dropped response still counts in the normaliser. That is our
default (weight 0, ``out.mask`` True); ``drop_from_denominator=True`` removes it from the
denominator instead. OPSM only masks: kept tokens weigh 1 (TRL applies its vLLM IS ratio
separately, ``vllm_importance_sampling_mode``). With ``[B, T]`` advantages the sign test is per
token, as in TRL.
"""

from __future__ import annotations

import math

import torch

from ais_lightning import ops
from ais_lightning.correctors.advantage import token_advantages
from ais_lightning.correctors.base import Corrector, RawCorrection


class OffPolicySequenceMask(Corrector):
    """Drop a response if its advantage is < 0 and its mean k1 KL(mu || pi_old) exceeds ``threshold``.

    Args:
        threshold: delta > 0, nats per token (TRL ``off_policy_mask_threshold``, e.g. 0.5).
        drop_from_denominator: False (TRL, the paper): dropped tokens get weight 0 but stay in
            ``out.mask``; True: they leave ``out.mask`` (the loss's denominator) too.

    Needs ``advantages``. Dropped tokens count in ``corrector/clipped_frac`` (weight zeroed, default)
    or ``corrector/masked_frac`` (``drop_from_denominator``). Extra stats: ``opsm/dropped_frac`` (valid tokens dropped),
    ``opsm/seq_dropped_frac`` (responses with a dropped token, over responses with a valid token),
    ``opsm/seq_kl_mean`` (mean over responses of the per-response k1 mean).
    """

    def __init__(self, threshold: float = 0.5, drop_from_denominator: bool = False) -> None:
        super().__init__()
        ok = isinstance(threshold, (int, float)) and not isinstance(threshold, bool)
        if not (ok and math.isfinite(threshold) and threshold > 0):
            raise ValueError(f"threshold must be a finite number > 0 (nats per token), got {threshold!r}")
        self.threshold = float(threshold)
        self.drop_from_denominator = bool(drop_from_denominator)

    def correct(
        self,
        delta: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor | None,
        entropy: torch.Tensor | None,
    ) -> RawCorrection:
        adv = token_advantages(advantages, mask, "OffPolicySequenceMask")  # [B, T]
        seq_kl = ops.masked_mean(-delta.double(), mask, dim=-1)  # [B], k1 mean of log mu - log pi
        drifted = (seq_kl > self.threshold).unsqueeze(-1)  # [B, 1]
        dropped = mask & (adv < 0) & drifted  # [B, T]
        has_tokens = mask.any(dim=-1)  # [B]
        n_seqs = has_tokens.sum().clamp(min=1).double()
        extra = {
            "opsm/dropped_frac": dropped.sum().double() / mask.sum().clamp(min=1).double(),
            "opsm/seq_dropped_frac": dropped.any(dim=-1).sum().double() / n_seqs,
            "opsm/seq_kl_mean": ops.masked_sum(seq_kl, has_tokens) / n_seqs,
        }
        weights = (mask & ~dropped).to(delta.dtype)  # [B, T]
        if self.drop_from_denominator:  # counted in corrector/masked_frac
            return RawCorrection(weights, mask & ~dropped, torch.zeros_like(mask), extra)
        return RawCorrection(weights, mask, dropped, extra)  # zeroed in place: corrector/clipped_frac

    def extra_repr(self) -> str:
        return f"threshold={self.threshold}, drop_from_denominator={self.drop_from_denominator}"
