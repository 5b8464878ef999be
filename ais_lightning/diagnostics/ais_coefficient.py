"""AISCoefficient: the AIS mixing coefficient lambda (or one of its components) as a torchmetrics Metric.

The state is the vector of AIS sufficient statistics (``ais_sufficient_statistics``), sum-reduced,
so the value over several batches (and across DDP/FSDP ranks) equals AIS on their concatenation.
Formulation: design.md section 4, after AIS (arXiv 2605.13907).
"""

from __future__ import annotations

import torch
from torchmetrics import Metric

from ais_lightning import ops
from ais_lightning.correctors.ais import (
    NUM_AIS_STATISTICS,
    ais_coefficient,
    ais_coefficient_kwargs,
    ais_sufficient_statistics,
)

AIS_COMPONENTS = ("lambda", "reliability", "severity", "variance_factor")
"""Values ``AISCoefficient(component=...)`` can compute."""


class AISCoefficient(Metric):
    """lambda = clamp(s R^alpha v^beta, lambda_min, lambda_max) over everything it was updated with.

    Args:
        component: ``"lambda"`` (clamped, no EMA), ``"reliability"`` R, ``"severity"`` s or
            ``"variance_factor"`` v.
        c, kappa, alpha, beta, lambda_min, lambda_max, eps, use_reliability, use_severity,
            use_variance: as in ``ais_lightning.correctors.AIS``.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    stats: torch.Tensor

    def __init__(
        self,
        component: str = "lambda",
        c: float = 2.0,
        kappa: float = 1.0,
        alpha: float = 1.0,
        beta: float = 1.0,
        lambda_min: float = 0.0,
        lambda_max: float = 1.0,
        eps: float = 1e-6,
        use_reliability: bool = True,
        use_severity: bool = True,
        use_variance: bool = True,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if component not in AIS_COMPONENTS:
            raise ValueError(f"component must be one of {AIS_COMPONENTS}, got {component!r}")
        self.component = component
        self.c = float(c)
        self.coefficient_kwargs = ais_coefficient_kwargs(
            c, kappa, alpha, beta, lambda_min, lambda_max, eps, use_reliability, use_severity, use_variance
        )
        self.add_state(
            "stats", default=torch.zeros(NUM_AIS_STATISTICS, dtype=torch.float64), dist_reduce_fx="sum"
        )

    def update(
        self,
        train_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
    ) -> None:
        """Accumulate the sufficient statistics of one batch (same arguments as a corrector call)."""
        ops.check_logprob_inputs(
            train_logprobs, rollout_logprobs, mask, advantages=advantages, entropy=entropy
        )
        delta = ops.log_ratio(train_logprobs, rollout_logprobs, mask)  # [B, T]
        batch = ais_sufficient_statistics(delta, mask, self.c, advantages=advantages, entropy=entropy)  # [K]
        self.stats += batch.to(self.stats.dtype)

    def compute(self) -> torch.Tensor:
        """The chosen component from the accumulated sums (0-dim float64)."""
        return ais_coefficient(self.stats, **self.coefficient_kwargs)[self.component]
