"""The asynchronous mode's work on the trainer's side of one GRPO step: snapshots, staleness, pi_v and the bound.

``GRPOModule`` keeps one :class:`StalenessStep` when ``max_staleness > 0`` (or with rollout workers): it keeps the
weights of every published version the run may still meet (:class:`~ais_lightning.staleness.WeightSnapshots`),
logs each batch's staleness, scores the stale rows at their generating version (pi_v,
:class:`~ais_lightning.modules.version_scorer.VersionScorer`) for the split of the mismatch, and feeds the adaptive bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ais_lightning import ops
from ais_lightning.modules.version_scorer import VersionScorer
from ais_lightning.rollout.base import RolloutBatch
from ais_lightning.staleness import AdaptiveStalenessBound, WeightSnapshots, staleness_stats


@dataclass
class StaleMeasure:
    """What one step's staleness gave."""

    stats: dict[str, float]
    """``staleness/*`` and ``time/version_logprob_s`` to log."""
    version_logprobs: torch.Tensor | None = None
    """``[B, T]`` log pi_v (pi_prox on rows of the current version); None without the split."""
    log_ratio: torch.Tensor | None = None
    """``[B, T]`` log pi_prox - log pi_v, the staleness part (0 on fresh rows); None without the split."""


class StalenessStep:
    """Snapshots, staleness statistics, pi_v and the staleness bound of an asynchronous GRPO run.

    Args:
        policy: the trainer's policy (copied once for the scorer, before any sharding).
        settings: ``GRPOSettings`` (``max_staleness``, ``measure_staleness``, ``adaptive_staleness``,
            ``staleness_chi2_target``, ``temperature``).
        trust_region: the loss's (``PolicyLoss.trust_region``): its square is the adaptive bound's target when
            ``staleness_chi2_target`` is None.
    """

    HISTORY_STATS: ClassVar[dict[str, str]] = {
        "staleness": "staleness/mean",
        "staleness_max": "staleness/max",
        "staleness_bound": "staleness/bound",
        "dropped": "staleness/dropped",
        "kl_k3_precision": "mismatch/precision/kl_k3",
        "kl_k3_staleness": "mismatch/staleness/kl_k3",
    }
    """What each history entry records of an asynchronous step (when measured)."""

    def __init__(self, policy: Any, settings: Any, trust_region: float | None = None) -> None:
        self.max_staleness, self.temperature = settings.max_staleness, settings.temperature
        self.snapshots = WeightSnapshots(keep=settings.max_staleness + 1)
        self.scorer = VersionScorer(policy) if settings.measure_staleness and settings.max_staleness else None
        self.adaptive = None
        if settings.adaptive_staleness:
            target = settings.staleness_chi2_target
            if target is None and not trust_region:
                raise ValueError(
                    "algorithm.adaptive_staleness with staleness_chi2_target=null takes the loss's trust region "
                    "squared, and this loss declares none (PolicyLoss.trust_region): set "
                    "algorithm.staleness_chi2_target"
                )
            target = target if target is not None else trust_region**2
            self.adaptive = AdaptiveStalenessBound(settings.max_staleness, target)

    def bound(self) -> int:
        """The staleness bound of the next generation: the adaptive one, else ``max_staleness``."""
        return self.adaptive() if self.adaptive is not None else self.max_staleness

    def keep(self, version: int, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Keep ``version``'s weights when they are newer than every kept version (a validation outside ``fit``, which
        does not know the step a resumed checkpoint reached, keeps nothing)."""
        versions = self.snapshots.versions()
        if not versions or version > versions[-1]:
            self.snapshots.put(version, named_tensors)

    def measure(
        self,
        batch: RolloutBatch,
        versions: torch.Tensor,
        current: int,
        train_logprobs: torch.Tensor,
        dropped: int,
        trainer: Any,
    ) -> StaleMeasure:
        """Staleness statistics of a batch trained at version ``current`` (rows of ``versions`` ``[B]``), and with the
        split on pi_v and the staleness log-ratio; feeds the adaptive bound (its statistics summed over ranks with
        ``trainer.strategy.reduce``, so every rank keeps the same bound)."""
        staleness = current - versions.cpu()  # [B]
        stats = staleness_stats(staleness, self.max_staleness, dropped)
        stats["staleness/bound"] = float(self.bound())
        if self.scorer is None:
            return StaleMeasure(stats)
        t0 = time.perf_counter()
        mask = batch.response_mask  # [B, T]
        versions = versions.to(train_logprobs.device)
        if self.adaptive is not None and not bool((staleness > 0).any()) and current - 1 in self.snapshots:
            # no stale row to learn the drift from: probe one version back on this batch
            probe = self.scorer.logprobs(
                batch,
                torch.full_like(versions, current - 1),
                current,
                train_logprobs,
                self.snapshots,
                self.temperature,
            )
            self._observe(ops.log_ratio(train_logprobs, probe, mask), mask.double(), trainer)
        version_lp = self.scorer.logprobs(
            batch, versions, current, train_logprobs, self.snapshots, self.temperature
        )
        log_ratio = ops.log_ratio(train_logprobs, version_lp, mask)  # [B, T]
        if self.adaptive is not None and bool((staleness > 0).any()):
            k_sq = (current - versions).double().square()[:, None] * mask  # [B, T]
            self._observe(log_ratio, k_sq, trainer)
        stats["time/version_logprob_s"] = time.perf_counter() - t0
        return StaleMeasure(stats, version_lp, log_ratio)

    def _observe(self, log_ratio: torch.Tensor, k_sq: torch.Tensor, trainer: Any) -> None:
        """Feed the adaptive bound chi^2 / E[k^2] of the staleness part over every rank's valid tokens."""
        assert self.adaptive is not None
        mask = k_sq > 0  # [B, T]
        excess = torch.expm1(2.0 * log_ratio.double())  # [B, T], w^2 - 1
        sums = torch.stack([ops.masked_sum(excess, mask), k_sq.sum()])  # [2]
        total = trainer.strategy.reduce(sums, reduce_op="sum")
        self.adaptive.observe(chi2=float(total[0]), mean_sq_staleness=float(total[1]))

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"snapshots": self.snapshots.state_dict()}
        if self.adaptive is not None:
            state["adaptive"] = self.adaptive.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.snapshots.load_state_dict(state["snapshots"])
        if self.adaptive is not None and "adaptive" in state:
            self.adaptive.load_state_dict(state["adaptive"])
