"""What every corrector shares: the output type, input validation, the level ratio and the stats.

A corrector maps ``(train_logprobs, rollout_logprobs, mask)`` to per-token weights and a mask of
the tokens that stay in the loss (docs/design.md section 3). The importance ratio is always
``w = pi_old / mu = exp(delta)`` with ``delta = clamp(log pi_old - log mu, -20, 20)``
(see ``ais_lightning.ops.log_ratio``). Pure torch, no Lightning import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from ais_lightning import ops

LEVELS = ("token", "sequence", "geometric")
"""Aggregation levels of the importance ratio: per token, product over the response, geometric mean."""


@dataclass
class CorrectionOutput:
    """The result of a corrector call (docs/design.md section 3)."""

    weights: torch.Tensor
    """``[B, T]`` float32, detached; multiplies the per-token policy-gradient loss; 0 where not ``mask``."""
    mask: torch.Tensor
    """``[B, T]`` bool: tokens that stay in the loss AND in its denominator (a subset of the input mask)."""
    stats: dict[str, float] = field(default_factory=dict)
    """What was clipped / masked, the mean kept weight, and corrector-specific diagnostics, as Python floats."""


class RawCorrection(NamedTuple):
    """What a subclass's ``correct`` returns; ``Corrector.forward`` turns it into a ``CorrectionOutput``."""

    weights: torch.Tensor
    """``[B, T]`` float weights (values where ``keep`` is False are ignored and zeroed)."""
    keep: torch.Tensor
    """``[B, T]`` bool, tokens kept in the loss; must be a subset of the input mask."""
    clipped: torch.Tensor
    """``[B, T]`` bool, valid tokens whose weight was clipped."""
    extra_stats: dict[str, torch.Tensor]
    """Corrector-specific scalar stats (0-dim tensors)."""


def check_level(level: str) -> None:
    """Raise ValueError unless ``level`` is one of ``LEVELS``."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")


def check_bounds(c_low: float | None, c_high: float) -> None:
    """Validate a ratio interval ``[c_low, c_high]`` (``c_low=None``: no lower bound).

    The interval must contain 1 (on-policy tokens, w = 1, are never clipped or rejected).
    """
    if c_low is not None and c_low > c_high:
        raise ValueError(f"c_low ({c_low}) must be <= c_high ({c_high})")
    if not c_high >= 1.0:
        raise ValueError(f"c_high must be >= 1 (ratio 1 = on-policy must stay in range), got {c_high}")
    if c_low is not None and not 0.0 <= c_low <= 1.0:
        raise ValueError(f"c_low must be in [0, 1] (ratio 1 = on-policy must stay in range), got {c_low}")


def level_ratio(delta: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Importance ratio at ``level``, broadcast to tokens, 0 on masked tokens.  # [B, T]

    ``token``: ``exp(delta)``; ``sequence``: ``exp(sum_t delta)`` (product of token ratios);
    ``geometric``: ``exp(mean_t delta)``. Sequence-level log-ratios are clamped to +-20 by
    ``ops.sequence_log_ratio`` so that the product cannot overflow (docs/design.md section 7).
    """
    check_level(level)
    log_w = delta if level == "token" else ops.sequence_log_ratio(delta, mask, level)  # [B, T]
    return torch.where(mask, torch.exp(log_w), torch.zeros_like(log_w))


class Corrector(nn.Module):
    """Base class: validates inputs, computes ``delta``, calls ``correct`` and assembles the stats.

    Subclasses implement ``correct``; one whose rule needs the absolute log-probs (not only their
    ratio) sets ``needs_logprobs = True`` and gets them as ``correct(..., logprobs=(train, rollout))``.
    Everything runs without grad; weights come back detached
    (verl #4105). ``stats`` say what the corrector did (``corrector/clipped_frac``,
    ``corrector/masked_frac``, ``corrector/weight_mean``) plus its own diagnostics; the raw ratio
    statistics (mean, min, max, fractions beyond a bound) are the diagnostics' job
    (``ais_lightning.diagnostics.MismatchDiagnostics``), computed from the same ``delta``.
    """

    needs_logprobs: bool = False
    """Whether ``correct`` needs ``logprobs=(train_logprobs, rollout_logprobs)`` besides ``delta``."""
    uses_impurity: bool = False
    """Whether ``correct`` takes ``impurity=`` (the trainer's ``[B, T]`` collision impurity, or None)."""
    uses_staleness: bool = False
    """Whether ``correct`` takes ``stale_log_ratio=`` (``[B, T]`` log pi_prox - log pi_v, the part of ``delta`` that
    staleness made in an asynchronous run, ``ais_lightning.staleness.split_log_ratio``; None when not measured)."""

    def diagnostic_params(self) -> Any:
        """The hyper-parameters the mismatch diagnostics share with this corrector, so that one run has one clip
        bound: ``c`` (the upper bound the corrector clips or rejects token ratios at; the ratio fractions and
        clamps of ``MismatchDiagnostics(params=...)`` use it), ``c_low`` (its lower bound, None: 1/c) and AIS v2's
        lambda parameters (``mismatch/ais_lambda`` is the lambda AIS would apply with them; for ``AIS`` itself,
        its own): an ``ais_lightning.correctors.ais.AISParams``. Default None: the diagnostics' defaults, AIS's (C = 2); a corrector with a bound overrides it."""
        return None

    def correct(
        self,
        delta: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor | None,
        entropy: torch.Tensor | None,
        *,
        impurity: torch.Tensor | None = None,
        logprobs: tuple[torch.Tensor, torch.Tensor] | None = None,
        stale_log_ratio: torch.Tensor | None = None,
    ) -> RawCorrection:
        """Weights and kept tokens from the clamped log-ratio ``delta`` (0 on masked tokens).  # [B, T]

        Everything a corrector may receive: ``delta`` and ``mask`` ``[B, T]``, ``advantages`` (``[B]`` or
        ``[B, T]``) and ``entropy`` ``[B, T]`` or None, always passed; ``impurity`` (``[B, T]`` or None) only to a
        corrector that sets ``uses_impurity``, ``logprobs=(train, rollout)`` (``[B, T]`` each) only to one that
        sets ``needs_logprobs``, and ``stale_log_ratio`` (``[B, T]`` or None) only to one that sets
        ``uses_staleness``, so a subclass that uses none of them may leave them out of its signature.
        """
        raise NotImplementedError

    def forward(
        self,
        train_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
        impurity: torch.Tensor | None = None,
    ) -> CorrectionOutput:
        """Correct one batch.

        Args:
            train_logprobs: ``[B, T]`` log pi_old of the sampled tokens (high-precision trainer).
            rollout_logprobs: ``[B, T]`` log mu of the same tokens (rollout engine, same temperature).
            mask: ``[B, T]`` bool, True on valid response tokens.
            advantages: optional ``[B]`` or ``[B, T]`` advantages (for correctors that use them).
            entropy: optional ``[B, T]`` trainer token entropy in nats (for correctors that use it).
            impurity: optional ``[B, T]`` trainer collision impurity ``1 - sum_a pi(a)^2`` of each
                position's next-token distribution (``ops.impurity_from_logits``; the policy's
                ``batch_logprobs(..., compute_entropy=True).impurity``), for correctors that use it.
        """
        ops.check_logprob_inputs(
            train_logprobs, rollout_logprobs, mask, advantages=advantages, entropy=entropy, impurity=impurity
        )
        delta = ops.log_ratio(train_logprobs, rollout_logprobs, mask)  # [B, T] float32
        return self.from_log_ratio(
            delta,
            mask,
            advantages=advantages,
            entropy=entropy,
            train_logprobs=train_logprobs,
            rollout_logprobs=rollout_logprobs,
            impurity=impurity,
        )

    def from_log_ratio(
        self,
        delta: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
        train_logprobs: torch.Tensor | None = None,
        rollout_logprobs: torch.Tensor | None = None,
        impurity: torch.Tensor | None = None,
        stale_log_ratio: torch.Tensor | None = None,
    ) -> CorrectionOutput:
        """Correct one batch from an already validated log-ratio (no input checks).

        ``delta`` is ``ops.log_ratio(train_logprobs, rollout_logprobs, mask)`` (``[B, T]``, clamped,
        0 on masked tokens): a caller that feeds the same batch to the diagnostics computes it once.
        ``train_logprobs``/``rollout_logprobs`` are needed only by correctors with ``needs_logprobs``
        (a rule on probabilities, not their ratio); pass them whenever you have them, and ``impurity``
        and ``stale_log_ratio`` likewise (read by correctors with ``uses_impurity`` / ``uses_staleness``).
        An asynchronous run's ``delta`` is log pi_prox - log mu, precision and staleness together: every corrector
        corrects it as it is; ``stale_log_ratio`` only tells one that models the two apart (AIS) which part is
        which.
        """
        extra: dict[str, object] = {}
        if self.uses_impurity:
            extra["impurity"] = None if impurity is None else impurity.detach()
        if self.uses_staleness:
            extra["stale_log_ratio"] = None if stale_log_ratio is None else stale_log_ratio.detach()
        if self.needs_logprobs:
            if train_logprobs is None or rollout_logprobs is None:
                raise ValueError(
                    f"train_logprobs and rollout_logprobs are required by {type(self).__name__} "
                    "(its rule is on the probabilities, not only their ratio)"
                )
            extra["logprobs"] = (train_logprobs.detach(), rollout_logprobs.detach())
        with torch.no_grad():
            raw = self.correct(delta, mask, advantages, entropy, **extra)
            keep = raw.keep & mask  # [B, T]
            weights = torch.where(keep, raw.weights.float(), torch.zeros_like(delta))  # [B, T]
            n = mask.sum().clamp(min=1).float()
            stats = {
                "corrector/clipped_frac": (raw.clipped & mask).sum().float() / n,
                "corrector/masked_frac": (mask & ~keep).sum().float() / n,
                "corrector/weight_mean": ops.masked_mean(weights, keep),
                **raw.extra_stats,
            }
            # One device->host transfer for all stats.
            values = torch.stack([v.detach().double().reshape(()) for v in stats.values()]).tolist()
        return CorrectionOutput(
            weights=weights.detach(),
            mask=keep,
            stats=dict(zip(stats.keys(), values)),
        )
