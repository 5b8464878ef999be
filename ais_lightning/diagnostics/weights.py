"""Importance-weight statistics that verl and TRL log and the core diagnostics did not cover.

- ``ClippedRatioMoment``: verl's ``rollout_is_std`` and ``rollout_is_eff_sample_size``, computed on the
  token ratios clamped to [1/C, C] (``verl/trainer/ppo/rollout_corr_helper.py``, ``compute_is_metrics``).
- ``SequenceRatioStatistic``: verl's ``rollout_is_seq_*``, statistics of each response's mean token ratio.
- ``AbsLogRatio``: TRL's ``sampling/sampling_logp_difference/{mean,max}``, |log pi_old - log mu| per
  token (``trl/trainer/grpo_trainer.py``, ``_generate_and_score_completions``).

All share ``update(train_logprobs, rollout_logprobs, mask, log_ratio=None)`` and use the clamped
delta of ``ais_lightning.ops.log_ratio``; their states are sums (or max / min), so a DDP/FSDP sync
is exact (verl and TRL average per-rank values instead). Before any valid item each returns a
documented finite value.
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
from ais_lightning.ops import masked_mean, masked_sum

CLIPPED_MOMENTS = ("std", "ess")
SEQUENCE_RATIO_STATS = ("mean", "std", "max", "min", "max_deviation", "frac_above", "frac_below")
ABS_LOG_RATIO_STATS = ("mean", "max")


class ClippedRatioMoment(Metric):
    """Std or normalised ESS of the token ratios clamped to [c_low, c] (verl ``rollout_is_std`` / ``_eff_sample_size``).

    With w_c = clamp(w, c_low, c) over the N valid tokens (``c_low`` None: 1/c, verl's):

    - ``std``: sqrt(max(mean(w_c^2) - mean(w_c)^2, 0)) (population std, as verl); 0.0 when empty.
    - ``ess``: (sum w_c)^2 / (N sum w_c^2) in (0, 1] (verl: 1 / mean((w_c / mean w_c)^2), the same up to
      its 1e-8 guard); 1.0 when empty. ``EffectiveSampleSize`` is the unclamped version.

    verl clamps with its ``rollout_is_threshold`` C (default 2.0); ``c`` here. A ``c_low`` of 0 is allowed for
    ``std``; ``ess`` needs ``c_low`` > 0 (w_c > 0).
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better: bool | None = None

    def __init__(self, stat: str = "std", c: float = 2.0, c_low: float | None = None, **kwargs: Any) -> None:
        if stat not in CLIPPED_MOMENTS:
            raise ValueError(f"stat must be one of {CLIPPED_MOMENTS}, got {stat!r}")
        low = ratio_band(c, c_low)
        super().__init__(**kwargs)
        self.stat = stat
        self.c = float(c)
        self.c_low = low
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
        delta = checked_log_ratio(train_logprobs, rollout_logprobs, mask, log_ratio)  # [B, T]
        w_c = torch.exp(delta).clamp(self.c_low, self.c)  # [B, T]
        self.sum_w += masked_sum(w_c, mask)
        self.sum_w2 += masked_sum(w_c * w_c, mask)
        self.count += mask.sum()

    def compute(self) -> torch.Tensor:
        n = self.count.to(STATE_DTYPE).clamp(min=1.0)
        if self.stat == "std":
            var = (self.sum_w2 / n - (self.sum_w / n) ** 2).clamp(min=0.0)
            return torch.where(self.count > 0, var.sqrt(), torch.zeros_like(var))
        # w_c >= c_low; with c_low = 0 every clamped ratio may be 0, hence the guard.
        ess = self.sum_w**2 / (n * self.sum_w2).clamp(min=torch.finfo(STATE_DTYPE).tiny)
        return torch.where(self.count > 0, ess, torch.ones_like(ess))


class SequenceRatioStatistic(Metric):
    """Statistic of s_i = mean_t w over each response's valid tokens (verl ``rollout_is_seq_*``, token level).

    ``stat``: ``mean``, ``std`` (Bessel-corrected, as torch's ``std`` in verl; 0 for < 2 responses),
    ``max``, ``min``, ``max_deviation`` (max_i |s_i - 1|), ``frac_above`` (s_i > c), ``frac_below``
    (s_i < c_low, default 1/c). Over responses with at least one valid token (verl: all B rows). Empty: 1.0 for
    mean / max / min, 0.0 otherwise. Raw (untruncated) token ratios, as verl computes these before
    truncation.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(self, stat: str = "mean", c: float = 2.0, c_low: float | None = None, **kwargs: Any) -> None:
        if stat not in SEQUENCE_RATIO_STATS:
            raise ValueError(f"stat must be one of {SEQUENCE_RATIO_STATS}, got {stat!r}")
        low = ratio_band(c, c_low)
        super().__init__(**kwargs)
        self.stat = stat
        self.c = float(c)
        self.c_low = low
        self.add_state("total", default=torch.tensor(0.0, dtype=STATE_DTYPE), dist_reduce_fx="sum")
        self.add_state("total_sq", default=torch.tensor(0.0, dtype=STATE_DTYPE), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        reduce = "min" if stat == "min" else "max"
        init = math.inf if stat == "min" else -math.inf
        self.add_state("extreme", default=torch.tensor(init, dtype=STATE_DTYPE), dist_reduce_fx=reduce)

    def update(
        self,
        train_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        mask: torch.Tensor,
        log_ratio: torch.Tensor | None = None,
    ) -> None:
        """``log_ratio``: optional precomputed ``ops.log_ratio(train_logprobs, rollout_logprobs, mask)``."""
        delta = checked_log_ratio(train_logprobs, rollout_logprobs, mask, log_ratio)  # [B, T]
        s = masked_mean(torch.exp(delta), mask, dim=-1)  # [B]
        valid = sequence_mask(mask)  # [B]
        if self.stat == "frac_above":
            value = (s > self.c).to(STATE_DTYPE)
        elif self.stat == "frac_below":
            value = (s < self.c_low).to(STATE_DTYPE)
        elif self.stat == "max_deviation":
            value = (s - 1.0).abs()
        else:
            value = s
        self.total += masked_sum(value, valid)
        self.total_sq += masked_sum(value * value, valid)
        self.count += valid.sum()
        if self.stat in ("max", "min", "max_deviation"):
            fill = math.inf if self.stat == "min" else -math.inf
            candidates = torch.cat([self.extreme.view(1), torch.where(valid, value, fill).flatten()])
            self.extreme = candidates.amin() if self.stat == "min" else candidates.amax()

    def compute(self) -> torch.Tensor:
        n = self.count.to(STATE_DTYPE)
        if self.stat in ("max", "min", "max_deviation"):
            value = self.extreme
        elif self.stat == "std":
            var = (self.total_sq - self.total**2 / n.clamp(min=1.0)) / (n - 1.0).clamp(min=1.0)
            value = torch.where(n > 1, var.clamp(min=0.0).sqrt(), torch.zeros_like(var))
        else:
            value = self.total / n.clamp(min=1.0)
        empty = 1.0 if self.stat in ("mean", "max", "min") else 0.0
        return torch.where(self.count > 0, value, torch.full_like(value, empty))


class AbsLogRatio(LogRatioMeanMetric):
    """|log pi_old - log mu| over valid tokens: ``mean`` or ``max`` (TRL ``sampling/sampling_logp_difference``).

    0.0 when no valid token was seen. TRL takes the per-rank mean and then averages the ranks; here
    the mean is over all tokens of all ranks (exact).
    """

    higher_is_better = False

    def __init__(self, stat: str = "mean", **kwargs: Any) -> None:
        if stat not in ABS_LOG_RATIO_STATS:
            raise ValueError(f"stat must be one of {ABS_LOG_RATIO_STATS}, got {stat!r}")
        super().__init__(**kwargs)
        self.stat = stat
        if stat == "max":
            self.add_state("extreme", default=torch.tensor(0.0, dtype=STATE_DTYPE), dist_reduce_fx="max")

    def _values(self, delta: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return delta.abs(), mask  # [B, T]

    def _accumulate(self, values: torch.Tensor, valid: torch.Tensor) -> None:
        super()._accumulate(values, valid)
        if self.stat == "max":
            candidates = torch.cat([self.extreme.view(1), torch.where(valid, values, 0.0).flatten()])
            self.extreme = candidates.amax()

    def _finalize(self, mean: torch.Tensor) -> torch.Tensor:
        return self.extreme if self.stat == "max" else mean
