"""Per-sequence perplexity diagnostics as verl logs them (``rollout_corr/*ppl*``, ``log_ppl_diff*``).

verl ``verl/trainer/ppo/rollout_corr_helper.py``, ``compute_offpolicy_metrics``: per response i with
valid tokens t, mean log-probs lp_pi(i) = mean_t log pi and lp_mu(i) = mean_t log mu, then

- ``training_ppl`` = mean_i exp(-lp_pi(i)),   ``training_log_ppl`` = mean_i (-lp_pi(i))
- ``rollout_ppl``  = mean_i exp(-lp_mu(i)),   ``rollout_log_ppl``  = mean_i (-lp_mu(i))
- ``log_ppl_diff`` = mean_i d_i with d_i = lp_mu(i) - lp_pi(i) = -mean_t delta   (= log(ppl_pi / ppl_mu)_i)
- ``log_ppl_abs_diff`` = mean_i |d_i|, ``log_ppl_diff_max`` / ``_min`` = max_i / min_i d_i
- ``ppl_ratio`` = mean_i exp(d_i) (per-response ppl_pi / ppl_mu, the inverse of the geometric IS ratio)

Means here run over the responses with at least one valid token (verl averages over all B rows, a
row without tokens contributing exp(0) = 1 or 0); d_i uses the clamped delta of
``ais_lightning.ops.log_ratio`` (differs from verl only where |delta| > 20). States are sums
(extremes: max/min), so a DDP/FSDP sync is exact. Note verl's ``ppl_ratio`` is per-response and
pi/mu; our ``PerplexityRatio`` (``mismatch/ppl_ratio``) pools tokens and is mu/pi.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ais_lightning.diagnostics.base import (
    STATE_DTYPE,
    LogRatioMeanMetric,
    MaskedMeanMetric,
    sequence_mask,
)
from ais_lightning.ops import check_logprob_inputs, masked_mean

POLICIES = ("train", "rollout")
LOG_PPL_DIFF_STATS = ("mean", "abs_mean", "max", "min", "exp_mean")


class SequencePerplexity(MaskedMeanMetric):
    """Mean over responses of the perplexity exp(-mean_t log p) (or its log) of ``train`` pi or ``rollout`` mu.

    Args:
        policy: ``"train"`` (log pi, verl ``training_ppl``) or ``"rollout"`` (log mu, ``rollout_ppl``).
        log: report mean_i (-mean_t log p) (verl ``*_log_ppl``) instead of mean_i exp(...).

    Needs the absolute log-probs: ``update(train_logprobs, rollout_logprobs, mask, log_ratio=None)``
    (``log_ratio`` is accepted for the shared signature and means "already validated"). Empty: 1.0
    (perplexity) or 0.0 (log perplexity).
    """

    higher_is_better = None

    def __init__(self, policy: str = "train", log: bool = False, **kwargs: Any) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        super().__init__(**kwargs)
        self.policy = policy
        self.log = bool(log)
        self.empty_value = 0.0 if self.log else 1.0

    def update(
        self,
        train_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        mask: torch.Tensor,
        log_ratio: torch.Tensor | None = None,
    ) -> None:
        """``log_ratio``: optional precomputed delta; when given the inputs count as validated."""
        if log_ratio is None:
            check_logprob_inputs(train_logprobs, rollout_logprobs, mask)
        logp = (train_logprobs if self.policy == "train" else rollout_logprobs).detach().to(STATE_DTYPE)
        logp = torch.where(mask, logp, torch.zeros_like(logp))  # [B, T], no padding garbage
        nll = -masked_mean(logp, mask, dim=-1)  # [B]
        self._accumulate(nll if self.log else torch.exp(nll), sequence_mask(mask))


class LogPerplexityDiff(LogRatioMeanMetric):
    """verl's ``log_ppl_diff`` family: d_i = mean_t(log mu - log pi) = -mean_t delta per response.

    ``stat``: ``"mean"`` (mean_i d_i, verl ``log_ppl_diff``), ``"abs_mean"`` (``log_ppl_abs_diff``),
    ``"max"`` / ``"min"`` (``log_ppl_diff_max`` / ``_min``), ``"exp_mean"`` (mean_i exp(d_i), verl
    ``ppl_ratio``). Over responses with a valid token; empty: 0.0 (``exp_mean``: 1.0).
    """

    def __init__(self, stat: str = "mean", **kwargs: Any) -> None:
        if stat not in LOG_PPL_DIFF_STATS:
            raise ValueError(f"stat must be one of {LOG_PPL_DIFF_STATS}, got {stat!r}")
        super().__init__(**kwargs)
        self.stat = stat
        self.empty_value = 1.0 if stat == "exp_mean" else 0.0
        if stat in ("max", "min"):
            init = -math.inf if stat == "max" else math.inf
            self.add_state("extreme", default=torch.tensor(init, dtype=STATE_DTYPE), dist_reduce_fx=stat)

    def _values(self, delta: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = -masked_mean(delta, mask, dim=-1)  # [B]
        if self.stat == "abs_mean":
            return d.abs(), sequence_mask(mask)
        if self.stat == "exp_mean":
            return torch.exp(d), sequence_mask(mask)
        return d, sequence_mask(mask)

    def _accumulate(self, values: torch.Tensor, valid: torch.Tensor) -> None:
        super()._accumulate(values, valid)
        if self.stat in ("max", "min"):
            fill = -math.inf if self.stat == "max" else math.inf
            candidates = torch.cat([self.extreme.view(1), torch.where(valid, values, fill).flatten()])
            self.extreme = candidates.amax() if self.stat == "max" else candidates.amin()

    def _finalize(self, mean: torch.Tensor) -> torch.Tensor:
        return self.extreme if self.stat in ("max", "min") else mean
