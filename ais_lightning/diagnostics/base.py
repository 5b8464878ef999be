"""Shared machinery of the diagnostics: a running masked mean with sum-reduced states.

Every diagnostic here reduces to sums over valid items (tokens or sequences), so its states are
sum-reduced (``dist_reduce_fx="sum"``) and a DDP/FSDP sync is exact: ``compute()`` after the sync
equals the single-process value over the union of all ranks' data. Nothing here imports Lightning.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torchmetrics import Metric

from ais_lightning.ops import check_logprob_inputs, log_ratio, masked_sum

STATE_DTYPE = torch.float64
"""Floating states accumulate in float64 so long runs do not lose precision (not MPS-compatible)."""


def checked_log_ratio(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    log_ratio_: torch.Tensor | None = None,
) -> torch.Tensor:
    """Validate the shared signature and return delta = clamp(log pi - log mu, +-20) in float64.

    Zero on masked tokens, detached (``ais_lightning.ops.log_ratio``).  # [B, T]
    ``log_ratio_``: that delta, already computed (and the inputs validated) by the caller, e.g. a
    training loop that feeds one batch to a corrector and to every metric; then nothing is
    re-validated or recomputed.
    """
    if log_ratio_ is not None:
        return log_ratio_.detach().to(STATE_DTYPE)
    check_logprob_inputs(train_logprobs, rollout_logprobs, mask)
    return log_ratio(train_logprobs, rollout_logprobs, mask).to(STATE_DTYPE)


def check_threshold(value: float, name: str, minimum: float, inclusive: bool = True) -> None:
    """Raise ValueError unless ``value`` is a finite number >= ``minimum`` (> when not inclusive)."""
    ok = isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (value >= minimum if inclusive else value > minimum)
    if not ok:
        raise ValueError(
            f"{name} must be a finite number {'>=' if inclusive else '>'} {minimum}, got {value!r}"
        )


def ratio_band(c: float, c_low: float | None = None) -> float:
    """The lower edge of the ratio band ``[c_low, c]`` (``c_low`` None: ``1 / c``, verl's convention), after checking
    ``c >= 1`` and ``c_low`` in [0, 1]: ValueError naming the argument."""
    check_threshold(c, "c", 1.0)
    if c_low is None:
        return 1.0 / float(c)
    check_threshold(c_low, "c_low", 0.0)
    if c_low > 1.0:
        raise ValueError(f"c_low must be in [0, 1] (the ratio 1 stays in the band), got {c_low!r}")
    return float(c_low)


def sequence_mask(mask: torch.Tensor) -> torch.Tensor:
    """True for sequences with at least one valid token.  # [B]"""
    return mask.any(dim=-1)


class MaskedMeanMetric(Metric):
    """Running mean of per-item values over every valid item seen by ``update``.

    States: ``total`` (float64 sum of values) and ``count`` (int64 number of valid items), both
    sum-reduced. ``compute()`` returns ``finalize(total / count)``, or ``empty_value`` (finite) while
    ``count == 0``. Subclasses define ``update`` (calling ``_accumulate``), and optionally
    ``empty_value`` and ``_finalize``.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better: bool | None = None
    empty_value: float = 0.0
    """Value of ``compute()`` before any valid item was seen (never NaN)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0, dtype=STATE_DTYPE), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def _accumulate(self, values: torch.Tensor, valid: torch.Tensor) -> None:
        """Add ``values`` at ``valid`` positions (same shape, any rank) to the running sums."""
        self.total += masked_sum(values.to(STATE_DTYPE), valid)
        self.count += valid.sum()

    def _finalize(self, mean: torch.Tensor) -> torch.Tensor:
        """Map the running mean to the reported value (identity by default)."""
        return mean

    def _mean(self) -> torch.Tensor:
        """``total / count``, with the empty case mapped to 0 (no NaN)."""
        return self.total / self.count.clamp(min=1).to(STATE_DTYPE)

    def compute(self) -> torch.Tensor:
        value = self._finalize(self._mean())
        return torch.where(self.count > 0, value, torch.full_like(value, self.empty_value))


class LogRatioMeanMetric(MaskedMeanMetric):
    """Mean of a function of the log-ratio delta over valid tokens (or sequences).

    ``update(train_logprobs, rollout_logprobs, mask, log_ratio=None)`` validates with
    ``ais_lightning.ops.check_logprob_inputs`` (unless the caller passes the precomputed ``log_ratio``)
    and accumulates ``_values(delta, mask)``.
    """

    def update(
        self,
        train_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        mask: torch.Tensor,
        log_ratio: torch.Tensor | None = None,
    ) -> None:
        """``log_ratio``: optional precomputed ``ops.log_ratio(train_logprobs, rollout_logprobs, mask)``."""
        delta = checked_log_ratio(train_logprobs, rollout_logprobs, mask, log_ratio)  # [B, T]
        values, valid = self._values(delta, mask)
        self._accumulate(values, valid)

    def _values(self, delta: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-item values and the mask of valid items; token level by default."""
        raise NotImplementedError
