"""An adaptive staleness bound: let rollouts age while the trainer's drift is small, wait for fresh ones when not.

Rule (derivation in docs/async.md, "The adaptive bound"): a row ``k`` versions old carries the staleness ratio
``pi_prox / pi_v``; importance weighting by it multiplies the variance of the gradient by ``1 + chi2_k``
(chi^2 of the staleness part), i.e. a stale batch is worth ``ESS_k = 1 / (1 + chi2_k)`` fresh ones. Over ``k``
versions the logits move by the sum of ``k`` optimizer steps, which Adam's momentum keeps aligned over ~10 steps,
so the drift grows linearly in ``k`` and ``chi2_k ~ k^2 c`` with ``c`` the chi^2 of one version. The bound is the
largest ``k <= max_staleness`` with ``k^2 c <= chi2_target``; ``c`` is estimated from each step's stale rows
(``chi2_stale / E[k^2]``) and averaged over steps.
"""

from __future__ import annotations

import math
from typing import Any


class AdaptiveStalenessBound:
    """The staleness bound of the next step, from the measured chi^2 of the staleness part.

    Args:
        max_staleness: the largest bound (versions), also the first one.
        chi2_target: the staleness part's chi^2 the bound keeps the rows within (> 0).
        decay: the weight of the previous estimate of the per-version chi^2 ``c`` in its running average.

    Example:
        >>> from ais_lightning.staleness import AdaptiveStalenessBound
        >>> bound = AdaptiveStalenessBound(max_staleness=4, chi2_target=0.01, decay=0.0)
        >>> bound()  # nothing measured yet: the largest bound
        4
        >>> bound.observe(chi2=0.004, mean_sq_staleness=4.0)  # rows 2 versions old: c = 0.001 per version^2
        >>> bound()  # k^2 * 0.001 <= 0.01 for k <= 3
        3
    """

    def __init__(self, max_staleness: int, chi2_target: float, decay: float = 0.9) -> None:
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 1:
            raise ValueError(
                f"max_staleness must be an int >= 1 for an adaptive bound, got {max_staleness!r}"
            )
        if not (isinstance(chi2_target, (int, float)) and math.isfinite(chi2_target) and chi2_target > 0):
            raise ValueError(f"chi2_target must be a finite number > 0, got {chi2_target!r}")
        if not (isinstance(decay, (int, float)) and 0.0 <= decay < 1.0):
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        self.max_staleness, self.chi2_target, self.decay = max_staleness, float(chi2_target), float(decay)
        self.per_version_chi2: float | None = None
        """The running estimate of ``c``, the staleness chi^2 of one version (None until a stale row is seen)."""

    def __call__(self) -> int:
        c = self.per_version_chi2
        if c is None or c <= 0.0:
            return self.max_staleness
        return max(0, min(self.max_staleness, math.floor(math.sqrt(self.chi2_target / c))))

    def observe(self, chi2: float, mean_sq_staleness: float) -> None:
        """One step's staleness chi^2 over rows whose squared staleness averages ``mean_sq_staleness`` (token
        weighted); a step without stale rows (``mean_sq_staleness`` 0) tells nothing and is skipped."""
        if not (mean_sq_staleness > 0.0 and math.isfinite(chi2)):
            return
        c = max(chi2, 0.0) / mean_sq_staleness
        previous = self.per_version_chi2
        self.per_version_chi2 = c if previous is None else self.decay * previous + (1.0 - self.decay) * c

    def state_dict(self) -> dict[str, Any]:
        return {"per_version_chi2": self.per_version_chi2}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.per_version_chi2 = state.get("per_version_chi2")
