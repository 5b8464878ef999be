"""AIS v1: lambda = s R^alpha v^beta, the first formulation, kept for comparison (registry name ``ais_v1``).

Built from AIS's description (arXiv 2605.13907: three diagnostics, one mixing coefficient) before
the derivation of v2 (``ais_lightning.correctors.ais``; ``docs/ais.md`` says why v1 under-corrects:
a product of three factors below 1, and a severity of 0.43 at a ruinous mismatch):

- delta = clamp(log pi - log mu, -20, 20), w = exp(delta), w_C = min(w, C)
- reliability R = (sum w_C)^2 / (N sum w_C^2)                    (normalized ESS, in (0, 1])
- severity s = 1 - exp(-D / (kappa (H + eps))), D = mean(w - 1 - delta) (k3 estimate of KL(mu||pi)),
  H = the trainer's mean token entropy (1 when not given)
- variance amplification V = E[(w_C A)^2] / E[A^2] (E[w_C^2] without advantages), v = min(1, 1/V)
- lambda = clamp(s R^alpha v^beta, lambda_min, lambda_max), optional EMA over steps
- token weight = (1 - lambda) + lambda w_C: lambda = 0 is "none", lambda = 1 is token TIS at C.

Everything is computed from sufficient statistics (sums over valid tokens), so summing them
across ranks gives exactly the lambda of the global batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ais_lightning import ops
from ais_lightning.correctors.ais import (
    AISParams,
    MixingCorrector,
    ais_params,
    check_flag,
    check_lambda_bounds,
    check_truncation,
    k3_per_token,
    safe_ratio,
    token_advantages,
)

AIS_V1_STATISTICS = (
    "num_tokens",  # N
    "sum_w_c",  # sum w_C
    "sum_w_c_sq",  # sum w_C^2
    "sum_k3",  # sum (w - 1 - delta)
    "sum_entropy",  # sum H_t (0 without entropy)
    "num_entropy",  # N with entropy, else 0
    "sum_w_c_adv_sq",  # sum (w_C A)^2 (0 without advantages)
    "sum_adv_sq",  # sum A^2 (0 without advantages)
    "num_adv",  # N with advantages, else 0
)
"""Names of the entries of the vector returned by ``ais_v1_sufficient_statistics``, in order."""

NUM_AIS_V1_STATISTICS = len(AIS_V1_STATISTICS)

AIS_V1_COMPONENTS = (
    "lambda",
    "lambda_raw",
    "reliability",
    "severity",
    "variance_factor",
    "variance_amplification",
    "kl_k3",
    "entropy",
)
"""Keys of ``ais_v1_coefficient``'s result."""


def _check_number(value: Any, name: str, ok: bool, expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok:
        raise ValueError(f"{name} must be {expected}, got {value}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class AISv1Params:
    """The parameters of the v1 coefficient, validated; built by ``AISv1`` (whose signature holds the
    defaults; ``ais_v1_params(**overrides)`` gives them) and shared with ``AISv1Coefficient``."""

    c: float
    kappa: float
    alpha: float
    beta: float
    lambda_min: float
    lambda_max: float
    eps: float
    use_reliability: bool
    use_severity: bool
    use_variance: bool

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "c", check_truncation(self.c))
        for name, test, expected in (
            ("kappa", lambda x: x > 0.0, "> 0"),
            ("alpha", lambda x: x >= 0.0, ">= 0"),
            ("beta", lambda x: x >= 0.0, ">= 0"),
        ):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and test(value)  # NaN fails every comparison
            set_(self, name, _check_number(value, name, ok, expected))
        lo, hi = check_lambda_bounds(self.lambda_min, self.lambda_max)
        set_(self, "lambda_min", lo)
        set_(self, "lambda_max", hi)
        eps_ok = isinstance(self.eps, (int, float)) and self.eps > 0.0
        set_(self, "eps", _check_number(self.eps, "eps", eps_ok, "> 0"))
        for name in ("use_reliability", "use_severity", "use_variance"):
            check_flag(getattr(self, name), name)


def ais_v1_base_weights(
    delta: torch.Tensor, mask: torch.Tensor, c: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min(w, C), w > C)`` in float32, 0 / False on masked tokens.  # [B, T], [B, T]"""
    w = torch.where(mask, torch.exp(delta.float()), torch.zeros_like(delta, dtype=torch.float32))  # [B, T]
    return w.clamp(max=c), (w > c) & mask


def ais_v1_sufficient_statistics(
    delta: torch.Tensor,
    mask: torch.Tensor,
    c: float,
    advantages: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sums over valid tokens from which ``ais_v1_coefficient`` computes lambda.  # [K] float64

    Args:
        delta: ``[B, T]`` clamped log-ratio log pi - log mu (``ops.log_ratio``).
        mask: ``[B, T]`` bool, True on valid tokens.
        c: truncation C >= 1 of w_C = min(w, C).
        advantages: optional ``[B]`` (broadcast to tokens) or ``[B, T]`` advantages.
        entropy: optional ``[B, T]`` trainer token entropy.

    Returns the float64 vector named by ``AIS_V1_STATISTICS``. Sums of vectors from disjoint batches
    (or from ranks) are the statistics of the union, so lambda is exact under data parallelism.
    """
    ops.check_mask(mask)
    if delta.shape != mask.shape:
        raise ValueError(f"delta has shape {tuple(delta.shape)} but mask has shape {tuple(mask.shape)}")
    c = check_truncation(c)
    w_c = torch.exp(delta.detach().double()).clamp(max=c)  # [B, T]
    n = mask.sum().double()
    zero = torch.zeros_like(n)
    parts = [
        n,
        ops.masked_sum(w_c, mask),
        ops.masked_sum(w_c.square(), mask),
        ops.masked_sum(k3_per_token(delta), mask),
    ]
    if entropy is not None:
        parts += [ops.masked_sum(entropy.detach().double(), mask), n]
    else:
        parts += [zero, zero]
    if advantages is not None:
        a = token_advantages(advantages, mask.shape)  # [B, T]
        parts += [ops.masked_sum((w_c * a).square(), mask), ops.masked_sum(a.square(), mask), n]
    else:
        parts += [zero, zero, zero]
    return torch.stack(parts)


def ais_v1_coefficient(stats: torch.Tensor, params: AISv1Params) -> dict[str, torch.Tensor]:
    """lambda and its components from summed sufficient statistics (the module docstring's formulas).

    Returns 0-dim float64 tensors keyed by ``AIS_V1_COMPONENTS``: ``lambda`` (clamped to
    [lambda_min, lambda_max], no EMA), ``lambda_raw`` (s R^alpha v^beta with switched-off components
    counted as 1), ``reliability`` R, ``severity`` s, ``variance_factor`` v, ``variance_amplification``
    V, ``kl_k3`` D and ``entropy`` H. The components are always reported as measured, switched off or
    not. With no valid tokens: R = v = V = 1, D = 0, s = 0, so lambda = lambda_min, and no NaN.
    If every advantage is 0 (a GRPO batch with equal rewards) V falls back to E[w_C^2].
    """
    if stats.shape != (NUM_AIS_V1_STATISTICS,):
        raise ValueError(
            f"stats must have shape [{NUM_AIS_V1_STATISTICS}] (AIS_V1_STATISTICS), got {tuple(stats.shape)}"
        )
    n, sum_w_c, sum_w_c_sq, sum_k3, sum_ent, n_ent, sum_w_c_adv_sq, sum_adv_sq, n_adv = (
        stats.double().unbind()
    )
    one = torch.ones_like(n)
    reliability = safe_ratio(sum_w_c.square(), n * sum_w_c_sq, one).clamp(0.0, 1.0)
    kl_k3 = safe_ratio(sum_k3, n, torch.zeros_like(n)).clamp(min=0.0)
    entropy = safe_ratio(sum_ent, n_ent, one).clamp(min=0.0)
    severity = -torch.expm1(-kl_k3 / (params.kappa * (entropy + params.eps)))
    second_moment = safe_ratio(sum_w_c_sq, n, one)  # E[w_C^2]
    use_adv = (n_adv > 0) & (sum_adv_sq > 0)
    variance_amplification = torch.where(use_adv, safe_ratio(sum_w_c_adv_sq, sum_adv_sq, one), second_moment)
    variance_factor = safe_ratio(one, variance_amplification, one).clamp(max=1.0)
    lambda_raw = one.clone()
    if params.use_severity:
        lambda_raw = lambda_raw * severity
    if params.use_reliability:
        lambda_raw = lambda_raw * reliability.pow(params.alpha)
    if params.use_variance:
        lambda_raw = lambda_raw * variance_factor.pow(params.beta)
    return {
        "lambda": lambda_raw.clamp(params.lambda_min, params.lambda_max),
        "lambda_raw": lambda_raw,
        "reliability": reliability,
        "severity": severity,
        "variance_factor": variance_factor,
        "variance_amplification": variance_amplification,
        "kl_k3": kl_k3,
        "entropy": entropy,
    }


class AISv1(MixingCorrector):
    """AIS v1: weight = (1 - lambda) + lambda min(w, C) on valid tokens, lambda = s R^alpha v^beta.

    See the module docstring for the formulation. If ``torch.distributed`` is initialized the
    sufficient statistics are all-reduced (SUM) before lambda is computed, so every rank uses the
    same lambda; every rank must then call the corrector (a collective, torchmetrics #3199).

    Args:
        c: truncation C >= 1 of w_C = min(w, C).
        kappa: severity temperature (> 0): s = 1 - exp(-D / (kappa (H + eps))).
        alpha: exponent (>= 0) of the reliability R.
        beta: exponent (>= 0) of the variance factor v.
        lambda_min: lower clamp of lambda, in [0, 1].
        lambda_max: upper clamp of lambda, in [lambda_min, 1].
        eps: added to the mean entropy H in the severity (> 0), avoids division by zero.
        use_reliability: include R in lambda (False: counts as 1).
        use_severity: include s in lambda (False: counts as 1).
        use_variance: include v in lambda (False: counts as 1).
        ema_decay: None, or a float in [0, 1): EMA of lambda_raw over steps (``MixingCorrector``).
        fixed_lambda: None, or a float in [0, 1] that forces lambda (ablations, tests); the
            diagnostics are still computed and logged, the EMA state is left untouched.

    Extra stats: ``ais/lambda``, ``ais/lambda_raw``, ``ais/reliability``, ``ais/severity``,
    ``ais/variance_factor``, ``ais/kl_k3``, ``ais/entropy``.
    """

    logged = ("lambda_raw", "reliability", "severity", "variance_factor", "kl_k3", "entropy")

    def __init__(
        self,
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
        ema_decay: float | None = None,
        fixed_lambda: float | None = None,
    ) -> None:
        super().__init__(ema_decay, fixed_lambda)
        self.params = AISv1Params(
            c=c,
            kappa=kappa,
            alpha=alpha,
            beta=beta,
            lambda_min=lambda_min,
            lambda_max=lambda_max,
            eps=eps,
            use_reliability=use_reliability,
            use_severity=use_severity,
            use_variance=use_variance,
        )

    @property
    def c(self) -> float:
        """The truncation C."""
        return self.params.c

    def diagnostic_params(self) -> AISParams:
        """C = its truncation ``c`` (:meth:`Corrector.diagnostic_params`; ``mismatch/ais_lambda`` stays AIS v2's)."""
        return ais_params(c=self.params.c)

    @property
    def coefficient_kwargs(self) -> dict[str, Any]:
        """The coefficient's parameters other than ``c``, as a dict (read-only view of ``params``)."""
        return {k: v for k, v in dataclasses.asdict(self.params).items() if k != "c"}

    def base_weights(self, delta: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ais_v1_base_weights(delta, mask, self.params.c)

    def statistics(
        self,
        delta: torch.Tensor,
        mask: torch.Tensor,
        base: torch.Tensor,
        advantages: torch.Tensor | None,
        entropy: torch.Tensor | None,
        impurity: torch.Tensor | None = None,  # v1 measures its severity against the mean entropy
    ) -> torch.Tensor:
        return ais_v1_sufficient_statistics(
            delta, mask, self.params.c, advantages=advantages, entropy=entropy
        )

    def coefficient(self, stats: torch.Tensor) -> dict[str, torch.Tensor]:
        return ais_v1_coefficient(stats, self.params)


def ais_v1_params(**overrides: Any) -> AISv1Params:
    """The ``AISv1Params`` that ``AISv1(**overrides)`` uses (its defaults for everything not given)."""
    return AISv1(**overrides).params
