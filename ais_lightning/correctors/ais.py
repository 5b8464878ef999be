"""Adaptive importance sampling (AIS): one per-batch coefficient lambda mixes "none" and token TIS.

AIS (arXiv 2605.13907) names three diagnostics (weight reliability, divergence severity, variance
amplification) and one mixing coefficient. Its equations are not at hand; this is the formulation
of design.md section 4, built from that description:

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

import torch
import torch.distributed as dist

from ais_lightning import ops
from ais_lightning.correctors.base import Corrector, RawCorrection

AIS_STATISTICS = (
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
"""Names of the entries of the vector returned by ``ais_sufficient_statistics``, in order."""

NUM_AIS_STATISTICS = len(AIS_STATISTICS)


def check_ais_args(
    c: float = 2.0,
    kappa: float = 1.0,
    alpha: float = 1.0,
    beta: float = 1.0,
    lambda_min: float = 0.0,
    lambda_max: float = 1.0,
    eps: float = 1e-6,
) -> None:
    """Raise ValueError naming the first invalid AIS hyper-parameter."""
    if not c >= 1.0:
        raise ValueError(f"c must be >= 1 (the truncation C of w_C = min(w, C)), got {c}")
    if not kappa > 0.0:
        raise ValueError(f"kappa must be > 0, got {kappa}")
    if not alpha >= 0.0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    if not beta >= 0.0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if not 0.0 <= lambda_min <= 1.0:
        raise ValueError(f"lambda_min must be in [0, 1], got {lambda_min}")
    if not 0.0 <= lambda_max <= 1.0:
        raise ValueError(f"lambda_max must be in [0, 1], got {lambda_max}")
    if lambda_min > lambda_max:
        raise ValueError(f"lambda_min ({lambda_min}) must be <= lambda_max ({lambda_max})")
    if not eps > 0.0:
        raise ValueError(f"eps must be > 0, got {eps}")


def ais_coefficient_kwargs(
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
) -> dict[str, float | bool]:
    """Validated keyword arguments of ``ais_coefficient`` (shared by ``AIS`` and ``AISCoefficient``)."""
    check_ais_args(
        c=c, kappa=kappa, alpha=alpha, beta=beta, lambda_min=lambda_min, lambda_max=lambda_max, eps=eps
    )
    return dict(
        kappa=float(kappa),
        alpha=float(alpha),
        beta=float(beta),
        eps=float(eps),
        lambda_min=float(lambda_min),
        lambda_max=float(lambda_max),
        use_reliability=bool(use_reliability),
        use_severity=bool(use_severity),
        use_variance=bool(use_variance),
    )


def ais_sufficient_statistics(
    delta: torch.Tensor,
    mask: torch.Tensor,
    c: float,
    advantages: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sums over valid tokens from which ``ais_coefficient`` computes lambda.  # [K] float64

    Args:
        delta: ``[B, T]`` clamped log-ratio log pi - log mu (``ops.log_ratio``).
        mask: ``[B, T]`` bool, True on valid tokens.
        c: truncation C >= 1 of w_C = min(w, C).
        advantages: optional ``[B]`` (broadcast to tokens) or ``[B, T]`` advantages.
        entropy: optional ``[B, T]`` trainer token entropy.

    Returns the float64 vector named by ``AIS_STATISTICS``. Sums of vectors from disjoint batches
    (or from ranks) are the statistics of the union, so lambda is exact under data parallelism.
    k3 uses ``expm1(delta) - delta`` in float64: for the small log-ratios of FP8 rollouts
    (KL ~ 1e-3) ``w - 1 - delta`` in float32 loses most of its digits.
    """
    ops.check_mask(mask)
    if delta.shape != mask.shape:
        raise ValueError(f"delta has shape {tuple(delta.shape)} but mask has shape {tuple(mask.shape)}")
    if not c >= 1.0:
        raise ValueError(f"c must be >= 1, got {c}")
    d = delta.detach().double()  # [B, T]
    w_c = torch.exp(d).clamp(max=c)  # [B, T]
    n = mask.sum().double()
    zero = torch.zeros_like(n)
    parts = [
        n,
        ops.masked_sum(w_c, mask),
        ops.masked_sum(w_c.square(), mask),
        ops.masked_sum(torch.expm1(d) - d, mask),
    ]
    if entropy is not None:
        parts += [ops.masked_sum(entropy.detach().double(), mask), n]
    else:
        parts += [zero, zero]
    if advantages is not None:
        a = advantages.detach().double()
        if a.dim() == 1:
            a = a.unsqueeze(-1).expand_as(d)  # [B] -> [B, T]
        if a.shape != d.shape:
            raise ValueError(
                f"advantages has shape {tuple(advantages.shape)}; expected [B] or {tuple(d.shape)}"
            )
        parts += [ops.masked_sum((w_c * a).square(), mask), ops.masked_sum(a.square(), mask), n]
    else:
        parts += [zero, zero, zero]
    return torch.stack(parts)


def ais_coefficient(
    stats: torch.Tensor,
    *,
    kappa: float = 1.0,
    alpha: float = 1.0,
    beta: float = 1.0,
    eps: float = 1e-6,
    lambda_min: float = 0.0,
    lambda_max: float = 1.0,
    use_reliability: bool = True,
    use_severity: bool = True,
    use_variance: bool = True,
) -> dict[str, torch.Tensor]:
    """lambda and its components from summed sufficient statistics (design.md section 4).

    Returns 0-dim float64 tensors: ``lambda`` (clamped to [lambda_min, lambda_max], no EMA),
    ``lambda_raw`` (s R^alpha v^beta with switched-off components counted as 1), ``reliability``
    R, ``severity`` s, ``variance_factor`` v, ``variance_amplification`` V, ``kl_k3`` D and
    ``entropy`` H. The components are always reported as measured, switched off or not.
    With no valid tokens: R = v = V = 1, D = 0, s = 0, so lambda = lambda_min, and no NaN.
    If every advantage is 0 (a GRPO batch with equal rewards) V falls back to E[w_C^2].
    """
    check_ais_args(kappa=kappa, alpha=alpha, beta=beta, lambda_min=lambda_min, lambda_max=lambda_max, eps=eps)
    if stats.shape != (NUM_AIS_STATISTICS,):
        raise ValueError(
            f"stats must have shape [{NUM_AIS_STATISTICS}] (AIS_STATISTICS), got {tuple(stats.shape)}"
        )
    n, sum_w_c, sum_w_c_sq, sum_k3, sum_ent, n_ent, sum_w_c_adv_sq, sum_adv_sq, n_adv = (
        stats.double().unbind()
    )
    one = torch.ones_like(n)

    def ratio(num: torch.Tensor, den: torch.Tensor, default: torch.Tensor) -> torch.Tensor:
        """num / den where den > 0, else ``default`` (no 0/0 in either branch)."""
        return torch.where(den > 0, num / torch.where(den > 0, den, one), default)

    reliability = ratio(sum_w_c.square(), n * sum_w_c_sq, one).clamp(0.0, 1.0)
    kl_k3 = ratio(sum_k3, n, torch.zeros_like(n)).clamp(min=0.0)
    entropy = ratio(sum_ent, n_ent, one).clamp(min=0.0)
    severity = -torch.expm1(-kl_k3 / (kappa * (entropy + eps)))
    second_moment = ratio(sum_w_c_sq, n, one)  # E[w_C^2]
    use_adv = (n_adv > 0) & (sum_adv_sq > 0)
    variance_amplification = torch.where(use_adv, ratio(sum_w_c_adv_sq, sum_adv_sq, one), second_moment)
    variance_factor = ratio(one, variance_amplification, one).clamp(max=1.0)
    lambda_raw = one.clone()
    if use_severity:
        lambda_raw = lambda_raw * severity
    if use_reliability:
        lambda_raw = lambda_raw * reliability.pow(alpha)
    if use_variance:
        lambda_raw = lambda_raw * variance_factor.pow(beta)
    return {
        "lambda": lambda_raw.clamp(lambda_min, lambda_max),
        "lambda_raw": lambda_raw,
        "reliability": reliability,
        "severity": severity,
        "variance_factor": variance_factor,
        "variance_amplification": variance_amplification,
        "kl_k3": kl_k3,
        "entropy": entropy,
    }


class AIS(Corrector):
    """Adaptive IS: weight = (1 - lambda) + lambda min(w, C) on valid tokens, one lambda per batch.

    See the module docstring for the formulation. If ``torch.distributed`` is initialized the
    sufficient statistics are all-reduced (SUM) before lambda is computed, so every rank uses the
    same lambda; every rank must then call the corrector (a collective, torchmetrics #3199).

    Args:
        c: truncation C >= 1 of w_C = min(w, C); also the threshold of the raw-ratio stats (1/C below).
        kappa: severity temperature (> 0): s = 1 - exp(-D / (kappa (H + eps))).
        alpha: exponent (>= 0) of the reliability R.
        beta: exponent (>= 0) of the variance factor v.
        lambda_min: lower clamp of lambda, in [0, 1].
        lambda_max: upper clamp of lambda, in [lambda_min, 1].
        eps: added to the mean entropy H in the severity (> 0), avoids division by zero.
        use_reliability: include R in lambda (False: counts as 1).
        use_severity: include s in lambda (False: counts as 1).
        use_variance: include v in lambda (False: counts as 1).
        ema_decay: None, or a float in [0, 1): lambda_t = decay lambda_{t-1} + (1 - decay) lambda_raw,
            the first step uses lambda_raw; the state is kept in buffers (state_dict, checkpoints)
            and only advanced in training mode. lambda_min/max clamp the EMA.
        fixed_lambda: None, or a float in [0, 1] that forces lambda (ablations, tests); the
            diagnostics are still computed and logged, the EMA state is left untouched.
    """

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
        super().__init__()
        self.coefficient_kwargs = ais_coefficient_kwargs(
            c, kappa, alpha, beta, lambda_min, lambda_max, eps, use_reliability, use_severity, use_variance
        )
        if ema_decay is not None and not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must be None or in [0, 1), got {ema_decay}")
        if fixed_lambda is not None and not 0.0 <= fixed_lambda <= 1.0:
            raise ValueError(f"fixed_lambda must be None or in [0, 1], got {fixed_lambda}")
        self.c = float(c)
        self.ema_decay = None if ema_decay is None else float(ema_decay)
        self.fixed_lambda = None if fixed_lambda is None else float(fixed_lambda)
        self.stat_c_high = self.c
        self.stat_c_low = 1.0 / self.c
        # EMA state: registered even without EMA so that state_dict keys do not depend on options.
        self.register_buffer("ema_lambda", torch.zeros((), dtype=torch.float32))
        self.register_buffer("ema_steps", torch.zeros((), dtype=torch.long))

    def _smoothed_lambda(self, coef: dict[str, torch.Tensor]) -> torch.Tensor:
        """lambda after the optional EMA over lambda_raw and the [lambda_min, lambda_max] clamp."""
        raw = coef["lambda_raw"]
        if self.ema_decay is None:
            return coef["lambda"]
        previous = self.ema_lambda.to(raw.dtype)
        ema = torch.where(self.ema_steps > 0, self.ema_decay * previous + (1.0 - self.ema_decay) * raw, raw)
        if self.training:
            self.ema_lambda.copy_(ema)
            self.ema_steps.add_(1)
        return ema.clamp(self.coefficient_kwargs["lambda_min"], self.coefficient_kwargs["lambda_max"])

    def correct(
        self,
        delta: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor | None,
        entropy: torch.Tensor | None,
    ) -> RawCorrection:
        stats = ais_sufficient_statistics(delta, mask, self.c, advantages=advantages, entropy=entropy)  # [K]
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        coef = ais_coefficient(stats, **self.coefficient_kwargs)
        if self.fixed_lambda is not None:
            lam = torch.full_like(coef["lambda"], self.fixed_lambda)
        else:
            lam = self._smoothed_lambda(coef)
        lam32 = lam.float()
        w = torch.exp(delta)  # [B, T]
        w_c = w.clamp(max=self.c)  # [B, T]
        weights = (1.0 - lam32) + lam32 * w_c  # [B, T]
        clipped = mask & (w > self.c) & (lam32 > 0)
        extra = {
            "ais/lambda": lam,
            "ais/lambda_raw": coef["lambda_raw"],
            "ais/reliability": coef["reliability"],
            "ais/severity": coef["severity"],
            "ais/variance_factor": coef["variance_factor"],
            "ais/kl_k3": coef["kl_k3"],
            "ais/entropy": coef["entropy"],
        }
        return RawCorrection(weights, mask, clipped, extra)

    def extra_repr(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.coefficient_kwargs.items())
        return f"c={self.c}, {opts}, ema_decay={self.ema_decay}, fixed_lambda={self.fixed_lambda}"
