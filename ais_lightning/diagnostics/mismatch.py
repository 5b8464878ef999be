"""Mismatch diagnostics between the trainer policy pi and the rollout policy mu.

All metrics here share ``update(train_logprobs, rollout_logprobs, mask)`` with ``[B, T]`` float
log-probs of the tokens sampled by mu (``train_logprobs`` = log pi, ``rollout_logprobs`` = log mu)
and a ``[B, T]`` bool mask (True = valid response token). They use
delta = clamp(log pi - log mu, -20, 20) and w = exp(delta) (``ais_lightning.ops.log_ratio``), average
over every valid token (or sequence) they were updated with, and compute one scalar each. States
are sum-reduced (min/max for extremes), so a DDP/FSDP sync is exact. Before any valid token is
seen each metric returns a documented finite value, never NaN.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torchmetrics import Metric

from ais_lightning.diagnostics.base import (
    STATE_DTYPE,
    LogRatioMeanMetric,
    checked_log_ratio,
    ratio_band,
    sequence_mask,
)
from ais_lightning.ops import masked_sum, sequence_log_ratio

KL_ESTIMATORS = ("k1", "k3")
CHI2_LEVELS = ("token", "sequence")
RATIO_STATS = ("mean", "min", "max", "frac_above", "frac_below")


class MismatchKL(LogRatioMeanMetric):
    """KL(mu || pi) estimated from tokens sampled by the rollout policy mu.

    With delta = log pi - log mu and w = e^delta (J. Schulman, "Approximating KL divergence", 2020):

    - ``k1`` = mean(-delta): unbiased, high variance, can be negative on a finite sample;
    - ``k3`` = mean(w - 1 - delta): unbiased and >= 0 per token (e^x >= 1 + x), low variance.

    0.0 when no valid token was seen (and whenever pi = mu).

    Example:
        >>> import torch
        >>> from ais_lightning.diagnostics import MismatchKL
        >>> train = torch.log(torch.tensor([[0.5, 0.25]]))  # log pi of two sampled tokens [B=1, T=2]
        >>> rollout = torch.log(torch.tensor([[0.25, 0.25]]))  # log mu: w = 2 and 1
        >>> kl = MismatchKL("k3")
        >>> kl.update(train, rollout, torch.ones(1, 2, dtype=torch.bool))
        >>> round(kl.compute().item(), 4)  # ((2 - 1 - ln 2) + 0) / 2
        0.1534
    """

    higher_is_better = False

    def __init__(self, estimator: str = "k3", **kwargs: Any) -> None:
        if estimator not in KL_ESTIMATORS:
            raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
        super().__init__(**kwargs)
        self.estimator = estimator

    def _values(self, delta: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.estimator == "k1":
            return -delta, mask  # [B, T]
        # expm1 keeps w - 1 accurate for tiny delta; clamp guards the >= 0 bound against rounding.
        return (torch.expm1(delta) - delta).clamp(min=0.0), mask  # [B, T]


class ChiSquare(LogRatioMeanMetric):
    """Chi-square divergence chi2(pi || mu) = E_mu[w^2] - 1, estimated from tokens sampled by mu.

    ``level="token"``: w is the per-token ratio, averaged over valid tokens.
    ``level="sequence"``: w is the product of the ratios over each response (its log clamped to
    +-20, ``ais_lightning.ops.sequence_log_ratio``), averaged over sequences with at least one
    valid token. It controls the variance of importance weighting (e.g. Metelli et al. 2018).
    0.0 when nothing valid was seen.
    """

    higher_is_better = False

    def __init__(self, level: str = "token", **kwargs: Any) -> None:
        if level not in CHI2_LEVELS:
            raise ValueError(f"level must be one of {CHI2_LEVELS}, got {level!r}")
        super().__init__(**kwargs)
        self.level = level

    def _values(self, delta: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.level == "token":
            return torch.exp(2.0 * delta), mask  # [B, T]
        seq_delta = sequence_log_ratio(delta, mask, "sequence")  # [B, T], constant along T
        seq_delta = seq_delta[:, 0] if seq_delta.shape[-1] else seq_delta.new_zeros(seq_delta.shape[0])  # [B]
        return torch.exp(2.0 * seq_delta), sequence_mask(mask)  # [B]

    def _finalize(self, mean: torch.Tensor) -> torch.Tensor:
        return mean - 1.0


class PerplexityRatio(LogRatioMeanMetric):
    """ppl_mu / ppl_pi = exp(mean(log pi - log mu)) over valid tokens.

    With ppl_p = exp(-mean log p) on the rollout's tokens, ppl_mu / ppl_pi = exp(mean(delta)).
    > 1 means the trainer pi finds the rollout's tokens MORE likely than the rollout engine did,
    < 1 less likely. Equal to exp(-k1) of ``MismatchKL``. 1.0 when no valid token was seen.
    """

    empty_value = 1.0

    def _values(self, delta: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return delta, mask  # [B, T]

    def _finalize(self, mean: torch.Tensor) -> torch.Tensor:
        return torch.exp(mean)


class RatioStatistic(LogRatioMeanMetric):
    """Raw (pre-correction) token-level statistic of w = pi / mu over valid tokens.

    ``stat``: ``mean`` (1.0 when empty), ``min`` / ``max`` (extremes, 1.0 when empty),
    ``frac_above`` = fraction of tokens with w > c, ``frac_below`` = fraction with w < c_low (default 1/c;
    0.0 when empty). ``c`` >= 1 is the clip bound C of the run's corrector (``Corrector.diagnostic_params``),
    ``c_low`` its lower bound when it has one.
    """

    def __init__(self, stat: str = "mean", c: float = 2.0, c_low: float | None = None, **kwargs: Any) -> None:
        if stat not in RATIO_STATS:
            raise ValueError(f"stat must be one of {RATIO_STATS}, got {stat!r}")
        low = ratio_band(c, c_low)
        super().__init__(**kwargs)
        self.stat = stat
        self.c = float(c)
        self.c_low = low
        self.empty_value = 0.0 if stat.startswith("frac") else 1.0
        if stat in ("min", "max"):
            init = math.inf if stat == "min" else -math.inf
            self.add_state("extreme", default=torch.tensor(init, dtype=STATE_DTYPE), dist_reduce_fx=stat)

    def _values(self, delta: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.exp(delta)  # [B, T]
        if self.stat == "frac_above":
            return (w > self.c).to(delta.dtype), mask
        if self.stat == "frac_below":
            return (w < self.c_low).to(delta.dtype), mask
        return w, mask

    def _accumulate(self, values: torch.Tensor, valid: torch.Tensor) -> None:
        super()._accumulate(values, valid)
        if self.stat in ("min", "max"):
            fill = math.inf if self.stat == "min" else -math.inf
            candidates = torch.cat([self.extreme.view(1), torch.where(valid, values, fill).flatten()])
            self.extreme = candidates.amin() if self.stat == "min" else candidates.amax()

    def _finalize(self, mean: torch.Tensor) -> torch.Tensor:
        return self.extreme if self.stat in ("min", "max") else mean


class EffectiveSampleSize(Metric):
    """Normalized effective sample size of the token ratios: (sum w)^2 / (N * sum w^2) in (0, 1].

    Kong (1992) / Kong, Liu & Wong (1994): ESS = (sum w)^2 / sum w^2; divided by the number N of
    valid tokens so that 1 means uniform weights (pi = mu up to a constant) and ~1/N means one token
    dominates. 1.0 when no valid token was seen (no evidence of degeneracy). States ``sum_w``,
    ``sum_w2``, ``count`` are sum-reduced, so the synced value is exact.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("sum_w", default=torch.tensor(0.0, dtype=STATE_DTYPE), dist_reduce_fx="sum")
        self.add_state("sum_w2", default=torch.tensor(0.0, dtype=STATE_DTYPE), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(
        self,
        train_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        mask: torch.Tensor,
        log_ratio: torch.Tensor | None = None,
    ) -> None:
        """``log_ratio``: optional precomputed ``ops.log_ratio(train_logprobs, rollout_logprobs, mask)``."""
        w = torch.exp(checked_log_ratio(train_logprobs, rollout_logprobs, mask, log_ratio))  # [B, T]
        self.sum_w += masked_sum(w, mask)
        self.sum_w2 += masked_sum(w * w, mask)
        self.count += mask.sum()

    def compute(self) -> torch.Tensor:
        # w >= e^-20 > 0, so sum_w2 > 0 whenever count > 0.
        denom = (self.count.to(STATE_DTYPE) * self.sum_w2).clamp(min=torch.finfo(STATE_DTYPE).tiny)
        ess = self.sum_w**2 / denom
        return torch.where(self.count > 0, ess, torch.ones_like(ess))
