"""The AIS mixing coefficient lambda (or one of its components) as a torchmetrics Metric.

``AISCoefficient`` computes AIS v2 (``ais_lightning.correctors.AIS``), ``AISv1Coefficient`` the first
formulation (``AISv1``). The state is the vector of the corrector's sufficient statistics,
sum-reduced, so the value over several batches (and across DDP/FSDP ranks) equals the corrector's
lambda on their concatenation (without the corrector's EMA or ``fixed_lambda``). Derivation:
``docs/ais.md``; AIS itself: arXiv 2605.13907.
"""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics import Metric

from ais_lightning import ops
from ais_lightning.correctors.ais import (
    AIS_COMPONENTS,
    NUM_AIS_STATISTICS,
    AISParams,
    ais_base_weights,
    ais_coefficient,
    ais_params,
    ais_sufficient_statistics,
)
from ais_lightning.correctors.ais_v1 import (
    AIS_V1_COMPONENTS,
    NUM_AIS_V1_STATISTICS,
    AISv1Params,
    ais_v1_coefficient,
    ais_v1_params,
    ais_v1_sufficient_statistics,
)

V1_COMPONENTS = ("lambda", "reliability", "severity", "variance_factor")
"""Values ``AISv1Coefficient(component=...)`` can compute."""


class _SummedStatisticMetric(Metric):
    """One sum-reduced float64 vector of sufficient statistics; ``compute`` returns one component."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    stats: torch.Tensor
    components: tuple[str, ...] = ()

    def __init__(self, component: str, size: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if component not in self.components:
            raise ValueError(f"component must be one of {self.components}, got {component!r}")
        self.component = component
        self.add_state("stats", default=torch.zeros(size, dtype=torch.float64), dist_reduce_fx="sum")

    def _batch_statistics(
        self,
        delta: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor | None,
        entropy: torch.Tensor | None,
        impurity: torch.Tensor | None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def update(
        self,
        train_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
        log_ratio: torch.Tensor | None = None,
        impurity: torch.Tensor | None = None,
        stale_log_ratio: torch.Tensor | None = None,
    ) -> None:
        """Accumulate the sufficient statistics of one batch (same arguments as a corrector call).

        ``log_ratio``: optional precomputed ``ops.log_ratio(train_logprobs, rollout_logprobs, mask)``;
        the caller has then validated the inputs (nothing is re-validated). ``stale_log_ratio``: the part of it
        that staleness made (an asynchronous run), read by AIS v2's coefficient as AIS reads it.
        """
        if log_ratio is None:
            ops.check_logprob_inputs(
                train_logprobs,
                rollout_logprobs,
                mask,
                advantages=advantages,
                entropy=entropy,
                impurity=impurity,
            )
            log_ratio = ops.log_ratio(train_logprobs, rollout_logprobs, mask)
        stale = {} if stale_log_ratio is None else {"stale_log_ratio": stale_log_ratio.float()}
        batch = self._batch_statistics(log_ratio.float(), mask, advantages, entropy, impurity, **stale)  # [K]
        self.stats += batch.to(self.stats.dtype)


class AISCoefficient(_SummedStatisticMetric):
    """AIS v2's lambda = R beta^2 / (R beta^2 + phi chi2_A) (or a component) over everything seen.

    Args:
        component: one of ``AIS_COMPONENTS``: ``"lambda"`` (clamped, no EMA), ``"lambda_raw"``,
            ``"severity"`` beta, ``"reliability"`` R, ``"variance_amplification"`` V,
            ``"bias_sq"``, ``"variance_excess"``, ``"kl_k3"``, ``"kl_k3_se"``, ``"spread"`` G.
        params: the coefficient's parameters, e.g. ``ais_params(c=1.5)`` or ``AIS(...).params``;
            None = ``AIS()``'s defaults.
        kwargs: torchmetrics ``Metric`` options (e.g. ``sync_on_compute``).
    """

    components = AIS_COMPONENTS

    def __init__(self, component: str = "lambda", params: AISParams | None = None, **kwargs: Any) -> None:
        super().__init__(component, NUM_AIS_STATISTICS, **kwargs)
        if params is not None and not isinstance(params, AISParams):
            raise ValueError(
                f"params must be an AISParams (ais_params(...)) or None, got {type(params).__name__}"
            )
        self.params = ais_params() if params is None else params

    def _batch_statistics(
        self, delta, mask, advantages, entropy, impurity, stale_log_ratio=None
    ) -> torch.Tensor:
        base, _ = ais_base_weights(delta, mask, self.params)  # [B, T]
        impurity = self.params.spread_impurity(impurity, entropy)
        return ais_sufficient_statistics(delta, mask, base, advantages, entropy, impurity, stale_log_ratio)

    def compute(self) -> torch.Tensor:
        """The chosen component from the accumulated sums (0-dim float64)."""
        return ais_coefficient(self.stats, self.params)[self.component]


class AISv1Coefficient(_SummedStatisticMetric):
    """AIS v1's lambda = clamp(s R^alpha v^beta, lambda_min, lambda_max) (or a component) over everything seen.

    Args:
        component: ``"lambda"`` (clamped, no EMA), ``"reliability"`` R, ``"severity"`` s or
            ``"variance_factor"`` v.
        params: e.g. ``ais_v1_params(c=1.5, kappa=0.1)``; None = ``AISv1()``'s defaults.
        kwargs: torchmetrics ``Metric`` options.
    """

    components = V1_COMPONENTS

    def __init__(self, component: str = "lambda", params: AISv1Params | None = None, **kwargs: Any) -> None:
        super().__init__(component, NUM_AIS_V1_STATISTICS, **kwargs)
        if params is not None and not isinstance(params, AISv1Params):
            raise ValueError(
                f"params must be an AISv1Params (ais_v1_params(...)) or None, got {type(params).__name__}"
            )
        self.params = ais_v1_params() if params is None else params

    def _batch_statistics(self, delta, mask, advantages, entropy, impurity) -> torch.Tensor:
        return ais_v1_sufficient_statistics(
            delta, mask, self.params.c, advantages=advantages, entropy=entropy
        )

    def compute(self) -> torch.Tensor:
        """The chosen component from the accumulated sums (0-dim float64)."""
        return ais_v1_coefficient(self.stats, self.params)[self.component]


__all__ = ["AISCoefficient", "AISv1Coefficient", "AIS_COMPONENTS", "AIS_V1_COMPONENTS", "V1_COMPONENTS"]
