"""Adaptive importance sampling (AIS) v2: one lambda per batch, the minimiser of an estimated MSE.

AIS (Zhou, Shao, Zheng, Fan & Wong, arXiv 2605.13907) interpolates between the uncorrected and the
importance-weighted policy gradient with one coefficient per batch built from three diagnostics,
weight reliability, divergence severity and variance amplification; its equations are not public.
This is our formulation; the derivation, its assumptions and the expected values are in
``docs/ais.md``. Per valid token t of response s, with delta_t = clamp(log pi - log mu, +-20),
w_t = exp(delta_t), advantage A_t and trainer entropy H_t:

- base weight b_t = min(w_t, C) (``base="tis"``; ``max(., c_low)`` too when ``c_low`` is set) or
  b_t = w_t 1[c_low <= w_t <= C] (``base="mis"``, c_low = 1/C by default); token weight
  (1 - lambda) + lambda b_t: lambda = 0 is "none", lambda = 1 the base corrector.
- divergence severity  beta = 2 D / G  with D = sum_t k3_t / N (k3_t = w_t - 1 - delta_t, the k3
  estimate of KL(mu || pi) per token) and G = sum_t g_t / N, g_t the trainer's collision impurity
  1 - sum_a pi(a)^2 at token t (``spread="impurity"``, the default, when the caller passes it; else
  its upper bound 1 - exp(-H_t) from the entropy, ``spread="entropy_bound"``; 1 without either).
  If the rollout's error acts like independent noise of variance sigma^2 on the logits,
  D = sigma^2 G / 2 to second order, so beta estimates sigma^2: the relative systematic bias of
  the uncorrected gradient. The same D
  is a larger beta when the policy is concentrated (small G): "exploration early, bias later".
- weight reliability  R = max(0, 1 - se^2 / D^2), se the response-clustered standard error of D:
  the share of the plug-in beta^2 that is not sampling noise, R beta^2 being the unbiased estimate
  of the squared bias (0 with D = 0 or fewer than 2 responses: no evidence).
- variance amplification  V = 1 + chi2_A, chi2_A = sum (b_t - 1)^2 A_t^2 / sum A_t^2
  (sum (b_t - 1)^2 / N without advantages or when all are 0): the variance of the weighted
  gradient in units of the uncorrected one's, counting only the correction's own noise.
- the optimizer's averaging: Adam's first moment m_k = b1 m_{k-1} + (1 - b1) g_k (b1 = ``momentum``)
  averages the noise of independent batches by a = (1 - b1) / (1 + b1) (1/19 at b1 = 0.9) and keeps
  the rollout's bias, which is the same in every batch; with several optimizer steps per rollout batch
  (``ppo_epochs``, ``mini_batches``) a is ``averaged_noise_factor(b1, ppo_epochs, mini_batches)``.
- MSE(lambda) / |g|^2 of the update the optimizer applies
  = (1 - lambda)^2 R beta^2 + a phi (1 + lambda^2 chi2_A), phi = ``noise_to_signal`` =
  Var(batch gradient) / |g|^2, minimised by
  lambda* = R beta^2 / (R beta^2 + a phi chi2_A)   (0 when both terms are 0),
  clamped to [lambda_min, lambda_max], optionally smoothed by an EMA over steps. ``momentum=0``
  scores one batch's gradient alone (a = 1; ``corrector=ais_one_step``).

Everything is computed from sums over valid tokens and responses (``ais_sufficient_statistics``),
so summing them across ranks gives exactly the lambda of the global batch.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import torch

from ais_lightning import ops
from ais_lightning.checks import check_int
from ais_lightning.correctors.base import Corrector, RawCorrection
from ais_lightning.correctors.distributed import all_reduce_sum

BASES = ("tis", "mis")
"""The importance-weighted end of the mix: token-level truncated IS or token-level masked IS."""

SPREADS = ("impurity", "entropy_bound")
"""The policy's spread G per token: its collision impurity 1 - sum_a pi(a)^2 (exact, needs the trainer's
full next-token distribution) or the upper bound 1 - exp(-H) of it from the entropy H."""

SPREAD_FLOOR = 1e-6
"""Lower bound of the spread G (an entropy below ~1e-6 nats is a deterministic policy)."""

AIS_STATISTICS = (
    "num_tokens",  # N
    "num_responses",  # S, responses with >= 1 valid token
    "sum_k3",  # sum_t k3_t
    "sum_response_k3_sq",  # sum_s (sum_{t in s} k3_t)^2
    "sum_response_k3_len",  # sum_s (sum_{t in s} k3_t) n_s
    "sum_response_len_sq",  # sum_s n_s^2
    "sum_spread",  # sum_t g_t, g_t = 1 - sum_a pi(a)^2, else 1 - exp(-H_t)  (0 without either)
    "num_entropy",  # N with impurity or entropy, else 0
    "sum_adv_sq",  # sum_t A_t^2  (0 without advantages)
    "sum_dev_sq_adv_sq",  # sum_t (b_t - 1)^2 A_t^2
    "num_adv",  # N with advantages, else 0
    "sum_dev_sq",  # sum_t (b_t - 1)^2
    "sum_k3_stale",  # sum_t k3(s_t), s_t = log pi_prox - log pi_v (0 without staleness)
    "sum_response_k3_stale_sq",  # sum_s (sum_{t in s} k3(s_t))^2
    "sum_response_k3_stale_len",  # sum_s (sum_{t in s} k3(s_t)) n_s
)
"""Names of the entries of the vector returned by ``ais_sufficient_statistics``, in order."""

NUM_AIS_STATISTICS = len(AIS_STATISTICS)

AIS_COMPONENTS = (
    "lambda",
    "lambda_raw",
    "severity",
    "reliability",
    "variance_amplification",
    "bias_sq",
    "variance_excess",
    "kl_k3",
    "kl_k3_se",
    "spread",
    "kl_k3_staleness",
    "severity_staleness",
)
"""Keys of ``ais_coefficient``'s result (each logged by ``AIS`` as ``ais/<key>``)."""


# ----------------------------------------------------------------------------- shared with v1


def check_unit_interval(value: Any, name: str) -> float:
    """``value`` as a float in [0, 1], else ValueError starting with ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return float(value)


def check_lambda_bounds(lambda_min: Any, lambda_max: Any) -> tuple[float, float]:
    """``(lambda_min, lambda_max)`` as floats with 0 <= lambda_min <= lambda_max <= 1."""
    lo = check_unit_interval(lambda_min, "lambda_min")
    hi = check_unit_interval(lambda_max, "lambda_max")
    if lo > hi:
        raise ValueError(f"lambda_min ({lo}) must be <= lambda_max ({hi})")
    return lo, hi


def check_truncation(c: Any) -> float:
    """The truncation C as a float >= 1 (inf: none; the ratio 1 of an on-policy token is never cut)."""
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not c >= 1.0:
        raise ValueError(f"c must be >= 1 (the upper bound C of the importance weight), got {c!r}")
    return float(c)


def check_flag(value: Any, name: str) -> bool:
    """``value`` if it is a bool, else ValueError starting with ``name``."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def averaged_noise_factor(beta1: float, ppo_epochs: int = 1, mini_batches: int = 1) -> float:
    """The variance of Adam's first moment ``m_k = β1 m_{k-1} + (1 - β1) g_k`` due to the noise of the
    rollout batches, in units of one whole batch's gradient variance, averaged over the optimizer steps.

    Each rollout batch of ``n`` rows takes ``K = ppo_epochs * mini_batches`` optimizer steps: every epoch
    shuffles the rows into ``mini_batches`` mini-batches (``GRPOModule.update_policy``), and a step's
    gradient is its mini-batch's mean. With independent zero-mean row noise of variance ``v`` (one
    batch's mean then has variance ``v / n``), a row of the batch ``r`` batches back contributes
    ``(1 - β1) (m / n) c`` to ``m_k``, ``c = Σ_epochs β1^lag`` over the steps that used it, so

        a = m² (1 - β1)² · mean over the K steps q of a batch · Σ_{r >= 0} E[c_r(q)²]

    with the row's mini-batch uniform and independent across epochs (``m = mini_batches``). Closed
    forms: ``(1 - β1) / (1 + β1)`` with one step per batch (1/19 for Adam's β1 = 0.9), ``m (1 - β1) /
    (1 + β1)`` with ``m`` mini-batches and one epoch (each step sees a fresh ``1/m`` of the data), ``m``
    at β1 = 0 (one mini-batch's noise). Reused epochs correlate the averaged noise and raise ``a``.

    A bias shared by every batch passes through the average unchanged, so ``a`` is the factor by which
    the optimizer lowers the share of the batches' noise in the error against a persistent bias. The
    dependence of rows within a prompt group is left out.
    """
    if isinstance(beta1, bool) or not isinstance(beta1, (int, float)) or not 0.0 <= beta1 < 1.0:
        raise ValueError(f"momentum (beta1) must be in [0, 1), got {beta1!r}")
    check_int(ppo_epochs, "ppo_epochs")
    check_int(mini_batches, "mini_batches")
    b, epochs, m = float(beta1), ppo_epochs, mini_batches
    k_steps = epochs * m
    if k_steps == 1:
        return (1.0 - b) / (1.0 + b)

    def second_moment(lags: list[list[int]]) -> float:
        # E[c^2] for c = sum over epochs of x_e, x_e = beta1^lag (0 if the step is still to come), the
        # epochs independent and each lag uniform over the row's m possible steps: lags[epoch][minibatch]
        means = [sum(b**lag for lag in row if lag >= 0) / m for row in lags]
        squares = [sum(b ** (2 * lag) for lag in row if lag >= 0) / m for row in lags]
        return sum(squares) + sum(means) ** 2 - sum(x * x for x in means)

    total = 0.0
    for q in range(k_steps):  # the step of the current batch at which m_k is read
        lags_now = [[q - (e * m + i) for i in range(m)] for e in range(epochs)]  # the current batch, r = 0
        lags_last = [[lag + k_steps for lag in row] for row in lags_now]  # r = 1; r > 1 scales by b^(rK)
        total += second_moment(lags_now) + second_moment(lags_last) / (1.0 - b ** (2 * k_steps))
    return m * m * (1.0 - b) ** 2 * total / k_steps


def safe_ratio(num: torch.Tensor, den: torch.Tensor, default: torch.Tensor | float) -> torch.Tensor:
    """num / den where den > 0, else ``default`` (no 0/0 in either branch of the ``where``)."""
    ok = den > 0
    default = torch.as_tensor(default, dtype=num.dtype, device=num.device)
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), default)


def k3_per_token(delta: torch.Tensor) -> torch.Tensor:
    """k3 = w - 1 - delta = expm1(delta) - delta in float64, >= 0.  # [B, T]

    float64 and ``expm1``: for the log-ratios of FP8 rollouts (KL ~ 1e-3) ``w - 1 - delta`` in
    float32 loses most of its digits.
    """
    d = delta.detach().double()
    return (torch.expm1(d) - d).clamp(min=0.0)


def token_advantages(advantages: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``[B]`` (one per response, broadcast) or ``[B, T]`` advantages as float64 ``[B, T]``."""
    a = advantages.detach().double()
    if a.dim() == 1 and a.shape[0] == shape[0]:
        a = a.unsqueeze(-1).expand(shape)  # [B] -> [B, T]
    if a.shape != shape:
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected [B] or {tuple(shape)}")
    return a


class MixingCorrector(Corrector):
    """Token weight (1 - lambda) + lambda b_t with one lambda per batch (shared by ``AIS`` and ``AISv1``).

    A subclass holds ``self.params`` (with ``lambda_min``/``lambda_max``) and defines ``base_weights``
    (b_t and which tokens it clips), ``statistics`` (sums over valid tokens) and ``coefficient``
    (lambda from the summed statistics, a dict with ``lambda`` and ``lambda_raw``). ``correct``
    all-reduces the statistics when ``torch.distributed`` is initialized (every rank then uses the
    lambda of the global batch, and every rank must call the corrector: a collective, torchmetrics
    #3199), applies ``fixed_lambda`` or the EMA, and mixes.

    Args:
        ema_decay: None, or a float in [0, 1): lambda_t = decay lambda_{t-1} + (1 - decay) lambda_raw,
            the first step uses lambda_raw; the state is kept in buffers (state_dict, checkpoints)
            and only advanced in training mode. lambda_min/max clamp the EMA.
        fixed_lambda: None, or a float in [0, 1] that forces lambda (ablations, tests); the
            diagnostics are still computed and logged, the EMA state is left untouched.
    """

    params: Any
    logged: tuple[str, ...] = ()
    """Coefficient keys logged as ``ais/<key>`` besides ``ais/lambda`` (the applied value)."""

    def __init__(self, ema_decay: float | None, fixed_lambda: float | None) -> None:
        super().__init__()
        if ema_decay is not None and (
            isinstance(ema_decay, bool)
            or not isinstance(ema_decay, (int, float))
            or not 0.0 <= ema_decay < 1.0
        ):
            raise ValueError(f"ema_decay must be None or in [0, 1), got {ema_decay!r}")
        if fixed_lambda is not None:
            fixed_lambda = check_unit_interval(fixed_lambda, "fixed_lambda")
        self.ema_decay = None if ema_decay is None else float(ema_decay)
        self.fixed_lambda = fixed_lambda
        # EMA state: registered even without EMA so that state_dict keys do not depend on options.
        self.register_buffer("ema_lambda", torch.zeros((), dtype=torch.float32))
        self.register_buffer("ema_steps", torch.zeros((), dtype=torch.long))

    def base_weights(self, delta: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(b, clipped)``: the weighted end's float32 token weights and the tokens it clips.  # [B, T]"""
        raise NotImplementedError

    def statistics(
        self,
        delta: torch.Tensor,
        mask: torch.Tensor,
        base: torch.Tensor,
        advantages: torch.Tensor | None,
        entropy: torch.Tensor | None,
        impurity: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The float64 vector of sums over this rank's valid tokens.  # [K]"""
        raise NotImplementedError

    def coefficient(self, stats: torch.Tensor) -> dict[str, torch.Tensor]:
        """lambda (clamped, no EMA), lambda_raw and the diagnostics from summed statistics."""
        raise NotImplementedError

    def applied_lambda(self, coef: dict[str, torch.Tensor]) -> torch.Tensor:
        """``fixed_lambda``, else the EMA of lambda_raw clamped to [lambda_min, lambda_max], else lambda."""
        if self.fixed_lambda is not None:
            return torch.full_like(coef["lambda"], self.fixed_lambda)
        if self.ema_decay is None:
            return coef["lambda"]
        raw = coef["lambda_raw"]
        previous = self.ema_lambda.to(raw.dtype)
        ema = torch.where(self.ema_steps > 0, self.ema_decay * previous + (1.0 - self.ema_decay) * raw, raw)
        if self.training:
            self.ema_lambda.copy_(ema)
            self.ema_steps.add_(1)
        return ema.clamp(self.params.lambda_min, self.params.lambda_max)

    def correct(
        self,
        delta: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor | None,
        entropy: torch.Tensor | None,
        impurity: torch.Tensor | None = None,
        stale_log_ratio: torch.Tensor | None = None,
    ) -> RawCorrection:
        base, clipped = self.base_weights(delta, mask)  # [B, T] float32, [B, T] bool
        stale = {} if stale_log_ratio is None else {"stale_log_ratio": stale_log_ratio}  # AIS v2's only
        stats = all_reduce_sum(
            self.statistics(delta, mask, base, advantages, entropy, impurity, **stale)
        )  # [K]
        coef = self.coefficient(stats)
        lam = self.applied_lambda(coef)
        lam32 = lam.float()
        weights = (1.0 - lam32) + lam32 * base  # [B, T]
        extra = {"ais/lambda": lam, **{f"ais/{k}": coef[k] for k in self.logged}}
        return RawCorrection(weights, mask, clipped & mask & (lam32 > 0), extra)

    def extra_repr(self) -> str:
        opts = ", ".join(
            f"{f.name}={getattr(self.params, f.name)!r}" for f in dataclasses.fields(self.params)
        )
        return f"{opts}, ema_decay={self.ema_decay}, fixed_lambda={self.fixed_lambda}"


# ----------------------------------------------------------------------------- v2


MISSING_SPREAD = (
    "AIS got neither impurity= nor entropy=, so it measures the divergence severity against a spread "
    "G = 1, the least severe reading: for a concentrated policy lambda comes out far too small (AIS then "
    "under-corrects, docs/ais.md section 3). Pass impurity=ais_lightning.ops.impurity_from_logits(logits) "
    "with the trainer's logits at the response tokens ([B, T, V]) (impurity_from_logprobs if you already "
    "took their log-softmax), or at least entropy= in nats; "
    "use_entropy=False asks for G = 1 explicitly."
)
"""The warning ``AISParams.spread_impurity`` gives when the policy's spread is missing."""


@dataclasses.dataclass(frozen=True)
class AISParams:
    """The parameters of the v2 coefficient, validated. Built by ``AIS`` (whose signature holds the
    defaults; ``ais_params(**overrides)`` gives them without a corrector) and shared with
    ``ais_lightning.diagnostics.AISCoefficient``. See ``AIS`` for the meaning of each field."""

    c: float
    base: str
    c_low: float | None
    noise_to_signal: float
    momentum: float
    ppo_epochs: int
    mini_batches: int
    spread: str
    use_entropy: bool
    use_reliability: bool
    lambda_min: float
    lambda_max: float

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise the validated values once
        set_(self, "c", check_truncation(self.c))
        if self.base not in BASES:
            raise ValueError(f"base must be one of {BASES}, got {self.base!r}")
        if self.c_low is not None:
            low = self.c_low
            if isinstance(low, bool) or not isinstance(low, (int, float)) or not 0.0 <= low <= 1.0:
                raise ValueError(f"c_low must be None or in [0, 1] (the ratio 1 stays in range), got {low!r}")
            set_(self, "c_low", float(low))
        phi = self.noise_to_signal
        if (
            isinstance(phi, bool)
            or not isinstance(phi, (int, float))
            or not (math.isfinite(phi) and phi >= 0)
        ):
            raise ValueError(f"noise_to_signal must be a finite number >= 0, got {phi!r}")
        set_(self, "noise_to_signal", float(phi))
        averaged_noise_factor(self.momentum, self.ppo_epochs, self.mini_batches)  # validates all three
        if self.spread not in SPREADS:
            raise ValueError(f"spread must be one of {SPREADS}, got {self.spread!r}")
        set_(self, "momentum", float(self.momentum))
        check_flag(self.use_entropy, "use_entropy")
        check_flag(self.use_reliability, "use_reliability")
        lo, hi = check_lambda_bounds(self.lambda_min, self.lambda_max)
        set_(self, "lambda_min", lo)
        set_(self, "lambda_max", hi)

    @property
    def update_noise_to_signal(self) -> float:
        """phi of the update the optimizer applies: ``noise_to_signal * averaged_noise_factor(...)``
        (``(1 - momentum) / (1 + momentum)`` with one optimizer step per rollout batch)."""
        return self.noise_to_signal * averaged_noise_factor(self.momentum, self.ppo_epochs, self.mini_batches)

    def spread_impurity(
        self, impurity: torch.Tensor | None, entropy: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The impurity the spread is measured with: ``impurity`` under ``spread="impurity"``, else None
        (``ais_sufficient_statistics`` then takes the entropy bound).

        Warns (``MISSING_SPREAD``, once per process) when the severity is measured against the spread
        (``use_entropy``) but neither ``impurity`` nor ``entropy`` was given: G is then 1.
        """
        if self.use_entropy and impurity is None and entropy is None:
            warnings.warn(MISSING_SPREAD, UserWarning, stacklevel=2)
        return impurity if self.spread == "impurity" else None

    @property
    def lower(self) -> float | None:
        """The lower bound of the base weight: ``c_low`` (TIS: None = none; MIS: None = 1/C)."""
        if self.c_low is None and self.base == "mis":
            return 1.0 / self.c
        return self.c_low


def ais_base_weights(
    delta: torch.Tensor, mask: torch.Tensor, params: AISParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(b, clipped)``: the base weights b_t (float32, 0 on masked tokens) and where they differ from w.

    ``tis``: b = clamp(w, c_low, C) (as ``TIS(level="token")``); ``mis``: b = w inside
    [c_low, C] and 0 outside (as ``MIS(level="token")``'s weights, the rejected tokens staying in
    the mask with weight 1 - lambda).  # [B, T], [B, T]
    """
    w = torch.where(mask, torch.exp(delta.float()), torch.zeros_like(delta, dtype=torch.float32))  # [B, T]
    lower = params.lower
    if params.base == "tis":
        base = w.clamp(min=lower, max=params.c)
        clipped = w > params.c if lower is None else (w > params.c) | (w < lower)
    else:
        clipped = (w > params.c) | (w < lower)
        base = torch.where(clipped, torch.zeros_like(w), w)
    return base, clipped & mask


def ais_sufficient_statistics(
    delta: torch.Tensor,
    mask: torch.Tensor,
    base: torch.Tensor,
    advantages: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    impurity: torch.Tensor | None = None,
    stale_log_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sums over valid tokens and responses from which ``ais_coefficient`` computes lambda.  # [K] float64

    Args:
        delta: ``[B, T]`` clamped log-ratio log pi - log mu (``ops.log_ratio``).
        mask: ``[B, T]`` bool, True on valid tokens.
        base: ``[B, T]`` base weights b_t (``ais_base_weights``).
        advantages: optional ``[B]`` (broadcast to tokens) or ``[B, T]`` advantages.
        entropy: optional ``[B, T]`` trainer token entropy in nats.
        impurity: optional ``[B, T]`` trainer collision impurity 1 - sum_a pi(a)^2: the spread G
            when given; else the bound 1 - exp(-H) from ``entropy``; else no spread (G = 1).
        stale_log_ratio: optional ``[B, T]`` part of ``delta`` that staleness made (log pi_prox - log pi_v of an
            asynchronous run, ``ais_lightning.staleness.split_log_ratio``): the precision statistics are then those
            of ``delta - stale_log_ratio`` and the staleness ones of ``stale_log_ratio``; None: all precision.

    Returns the float64 vector named by ``AIS_STATISTICS``. The sum of the vectors of disjoint
    batches (or ranks) is the vector of their union (responses are never split across ranks).
    """
    ops.check_mask(mask)
    for name, x in (("delta", delta), ("base", base)):
        if x.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)} but mask has shape {tuple(mask.shape)}")
    precision = delta if stale_log_ratio is None else delta - stale_log_ratio  # [B, T]
    k3 = k3_per_token(precision)  # [B, T]
    n_tok = mask.sum().double()
    resp_k3 = ops.masked_sum(k3, mask, dim=-1)  # [B]
    resp_len = mask.sum(dim=-1).double()  # [B]
    dev_sq = (base.detach().double() - 1.0).square()  # [B, T]
    zero = torch.zeros_like(n_tok)
    parts = [
        n_tok,
        (resp_len > 0).sum().double(),
        ops.masked_sum(k3, mask),
        resp_k3.square().sum(),
        (resp_k3 * resp_len).sum(),
        resp_len.square().sum(),
    ]
    spread = None
    if impurity is not None:
        spread = impurity.detach().double().clamp(0.0, 1.0)  # [B, T], 1 - sum_a pi(a)^2
    elif entropy is not None:
        spread = -torch.expm1(-entropy.detach().double().clamp(min=0.0))  # [B, T], 1 - exp(-H)
    parts += [zero, zero] if spread is None else [ops.masked_sum(spread, mask), n_tok]
    if advantages is not None:
        a_sq = token_advantages(advantages, mask.shape).square()  # [B, T]
        parts += [ops.masked_sum(a_sq, mask), ops.masked_sum(dev_sq * a_sq, mask), n_tok]
    else:
        parts += [zero, zero, zero]
    parts.append(ops.masked_sum(dev_sq, mask))
    if stale_log_ratio is None:
        parts += [zero, zero, zero]
    else:
        resp_stale = ops.masked_sum(k3_per_token(stale_log_ratio), mask, dim=-1)  # [B]
        parts += [resp_stale.sum(), resp_stale.square().sum(), (resp_stale * resp_len).sum()]
    return torch.stack(parts)


def ais_coefficient(stats: torch.Tensor, params: AISParams) -> dict[str, torch.Tensor]:
    """lambda and its components from summed sufficient statistics (see the module docstring).

    Returns 0-dim float64 tensors keyed by ``AIS_COMPONENTS``: ``lambda`` (clamped, no EMA),
    ``lambda_raw`` (the MSE minimiser in [0, 1]), ``severity`` beta (as used: 2 D without entropy or
    with ``use_entropy=False``), ``reliability`` R (as measured, also when switched off),
    ``variance_amplification`` V = 1 + chi2_A, ``bias_sq`` = R beta^2 (beta^2 when R is switched
    off), ``variance_excess`` = a phi chi2_A (a phi = ``params.update_noise_to_signal``), ``kl_k3`` D,
    ``kl_k3_se`` se(D) and ``spread`` G (as measured, 1 without impurity and entropy). Nothing valid: lambda = lambda_min and every value finite.
    """
    if stats.shape != (NUM_AIS_STATISTICS,):
        raise ValueError(
            f"stats must have shape [{NUM_AIS_STATISTICS}] (AIS_STATISTICS), got {tuple(stats.shape)}"
        )
    (
        n,
        n_resp,
        sum_k3,
        resp_k3_sq,
        resp_k3_len,
        resp_len_sq,
        sum_spread,
        n_ent,
        sum_a2,
        sum_dev_a2,
        n_adv,
        sum_dev,
        sum_k3_stale,
        resp_k3_stale_sq,
        resp_k3_stale_len,
    ) = stats.double().unbind()
    zero, one = torch.zeros_like(n), torch.ones_like(n)

    kl, kl_var, reliability = _clustered_kl(sum_k3, resp_k3_sq, resp_k3_len, resp_len_sq, n, n_resp)  # D
    spread = safe_ratio(sum_spread, n_ent, one).clamp(min=SPREAD_FLOOR, max=1.0)  # G
    per_spread = spread if params.use_entropy else one
    severity = 2.0 * kl / per_spread  # beta: the logit-noise variance, a second-order bias (docs/ais.md 3)
    use_r = params.use_reliability
    bias_sq = severity.square() * (reliability if use_r else one)
    # Staleness (docs/async.md): the trainer's own updates moved the logits along the gradient, a drift whose bias
    # is first order in it, beta_s = sqrt(2 D_s / G); the two biases point unrelated ways, so their squares add.
    kl_stale, _, reliability_stale = _clustered_kl(
        sum_k3_stale, resp_k3_stale_sq, resp_k3_stale_len, resp_len_sq, n, n_resp
    )
    severity_stale_sq = 2.0 * kl_stale / per_spread  # beta_s^2
    bias_sq = bias_sq + severity_stale_sq * (reliability_stale if use_r else one)
    use_adv = (n_adv > 0) & (sum_a2 > 0)
    chi2 = torch.where(use_adv, safe_ratio(sum_dev_a2, sum_a2, zero), safe_ratio(sum_dev, n, zero))
    variance_excess = params.update_noise_to_signal * chi2
    lambda_raw = safe_ratio(bias_sq, bias_sq + variance_excess, zero).clamp(0.0, 1.0)
    return {
        "lambda": lambda_raw.clamp(params.lambda_min, params.lambda_max),
        "lambda_raw": lambda_raw,
        "severity": severity,
        "reliability": reliability,
        "variance_amplification": 1.0 + chi2,
        "bias_sq": bias_sq,
        "variance_excess": variance_excess,
        "kl_k3": kl,
        "kl_k3_se": kl_var.sqrt(),
        "spread": spread,
        "kl_k3_staleness": kl_stale,
        "severity_staleness": severity_stale_sq.sqrt(),
    }


def _clustered_kl(
    sum_k3: torch.Tensor,
    resp_k3_sq: torch.Tensor,
    resp_k3_len: torch.Tensor,
    resp_len_sq: torch.Tensor,
    n: torch.Tensor,
    n_resp: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(D, Var(D), R)``: the per-token KL ``D = sum k3 / N``, the response-clustered variance of that ratio
    estimator (responses are the independent units, tokens of one response are not; the S / (S - 1) small-sample
    factor) and the weight reliability ``R = max(0, 1 - Var(D) / D^2)`` (0 with D = 0 or fewer than 2 responses)."""
    zero, one = torch.zeros_like(n), torch.ones_like(n)
    kl = safe_ratio(sum_k3, n, zero).clamp(min=0.0)
    resid = (resp_k3_sq - 2.0 * kl * resp_k3_len + kl.square() * resp_len_sq).clamp(min=0.0)
    kl_var = safe_ratio(n_resp * resid, (n_resp - 1.0).clamp(min=0.0) * n.square(), zero)
    reliability = torch.where(
        (n_resp >= 2) & (kl > 0), (1.0 - safe_ratio(kl_var, kl.square(), one)).clamp(0.0, 1.0), zero
    )
    return kl, kl_var, reliability


class AIS(MixingCorrector):
    """Adaptive IS v2: weight (1 - lambda) + lambda b_t, lambda = R beta^2 / (R beta^2 + a phi chi2_A).

    One lambda per batch minimises the estimated mean squared error of the update the optimizer
    applies: the squared bias of the uncorrected gradient (divergence severity beta, measured against
    the policy's own spread, times the weight reliability R), which persists from step to step,
    against the extra variance of the weighted one (variance amplification V = 1 + chi2_A), which
    the optimizer's first moment averages over steps (a = (1 - momentum) / (1 + momentum) with one
    optimizer step per rollout batch; ``averaged_noise_factor`` in general). Formulas
    in the module docstring, derivation and assumptions in ``docs/ais.md``. If ``torch.distributed`` is initialized the sufficient statistics
    are all-reduced (SUM) first, so every rank uses the lambda of the global batch; every rank must
    then call the corrector. Pass ``advantages`` and ``impurity`` (or at least ``entropy``, in nats;
    both the trainer's): the spread G is the mean impurity, else its upper bound 1 - exp(-H) (a
    larger G, a smaller severity), else 1 (the least severe reading); without advantages the
    variance is unweighted.

    Args:
        c: upper bound C >= 1 of the base weight (TIS truncation, MIS acceptance).
        base: the weighted end, ``"tis"`` (b = min(w, C); the default: every token keeps the same
            place in the loss for every lambda, so the mix is linear in lambda as the MSE argument
            assumes) or ``"mis"`` (b = w inside [c_low, C], else 0; rejected tokens keep weight
            1 - lambda and stay in the loss's denominator).
        c_low: lower bound of the base weight in [0, 1]: TIS clamps below it (None: no bound), MIS
            rejects below it (None: 1/C).
        noise_to_signal: phi >= 0, the batch gradient's variance over its squared norm,
            tr(Sigma) / (B |g|^2) = B_noise / B (McCandlish et al. 2018, arXiv 1812.06162). 1 = the
            batch is at its critical size; 0 ignores the variance (lambda = 1 whenever beta > 0).
        momentum: beta1 in [0, 1) of the optimizer's first moment (Adam/AdamW: 0.9, torch's default;
            ``ais-train`` passes ``algorithm.betas[0]``). Its average of the step gradients keeps the
            rollout's bias and divides the noise of independent batches by (1 + beta1) / (1 - beta1),
            so the variance term is scaled by (1 - beta1) / (1 + beta1). 0 scores one batch's gradient
            alone (plain SGD, or ``corrector=ais_one_step``).
        ppo_epochs: passes over each rollout batch (``ais-train``: ``algorithm.ppo_epochs``); reused
            data correlates the averaged noise and raises the variance term.
        mini_batches: optimizer steps per pass (``ais-train``: ``algorithm.mini_batches``); each step
            sees 1/mini_batches of the batch, so its noise is that many times one batch's.
            ``averaged_noise_factor(momentum, ppo_epochs, mini_batches)`` is the factor a (1/19 at the
            defaults).
        spread: ``"impurity"`` (the default): G is the trainer's mean collision impurity
            1 - sum_a pi(a)^2, the quantity the severity's derivation calls for (docs/ais.md section
            3), when ``impurity`` is passed, else the entropy bound; ``"entropy_bound"``: always the
            bound 1 - exp(-H) (AIS v2 as first released; 1.5x to 2.3x the impurity on our tasks).
        use_entropy: measure the severity against the policy's spread G (False: G = 1).
        use_reliability: multiply beta^2 by the reliability R (False: R = 1).
        lambda_min: lower clamp of lambda, in [0, 1].
        lambda_max: upper clamp of lambda, in [lambda_min, 1].
        ema_decay: None, or a float in [0, 1): EMA of lambda_raw over steps (``MixingCorrector``).
        fixed_lambda: None, or a float in [0, 1] that forces lambda (ablations, tests).

    Extra stats ``ais/<key>`` for every key of ``AIS_COMPONENTS`` (``ais/lambda`` is the applied
    value, after ``fixed_lambda`` or the EMA).

    Example:
        >>> import torch
        >>> from ais_lightning.correctors import AIS
        >>> _ = torch.manual_seed(0)
        >>> train = -1.0 + 0.1 * torch.randn(8, 16)  # log pi_old of 8 responses x 16 tokens [B, T]
        >>> rollout = train + 0.3 * torch.randn(8, 16)  # log mu: a noisy low-precision engine
        >>> out = AIS()(train, rollout, torch.ones(8, 16, dtype=torch.bool),
        ...             advantages=torch.randn(8), entropy=torch.full((8, 16), 0.5))
        >>> round(out.stats["ais/lambda"], 2)  # most of the way from "none" (0) to TIS (1)
        0.9
        >>> out.weights.shape
        torch.Size([8, 16])
    """

    logged = AIS_COMPONENTS[1:]
    uses_impurity = True
    uses_staleness = True

    def __init__(
        self,
        *,
        c: float = 2.0,
        base: str = "tis",
        c_low: float | None = None,
        noise_to_signal: float = 1.0,
        momentum: float = 0.9,
        ppo_epochs: int = 1,
        mini_batches: int = 1,
        spread: str = "impurity",
        use_entropy: bool = True,
        use_reliability: bool = True,
        lambda_min: float = 0.0,
        lambda_max: float = 1.0,
        ema_decay: float | None = None,
        fixed_lambda: float | None = None,
    ) -> None:
        super().__init__(ema_decay, fixed_lambda)
        self.params = AISParams(
            c=c,
            base=base,
            c_low=c_low,
            noise_to_signal=noise_to_signal,
            momentum=momentum,
            ppo_epochs=ppo_epochs,
            mini_batches=mini_batches,
            spread=spread,
            use_entropy=use_entropy,
            use_reliability=use_reliability,
            lambda_min=lambda_min,
            lambda_max=lambda_max,
        )

    def base_weights(self, delta: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ais_base_weights(delta, mask, self.params)

    def statistics(
        self,
        delta: torch.Tensor,
        mask: torch.Tensor,
        base: torch.Tensor,
        advantages: torch.Tensor | None,
        entropy: torch.Tensor | None,
        impurity: torch.Tensor | None = None,
        stale_log_ratio: torch.Tensor | None = None,
    ) -> torch.Tensor:
        impurity = self.params.spread_impurity(impurity, entropy)
        return ais_sufficient_statistics(delta, mask, base, advantages, entropy, impurity, stale_log_ratio)

    def coefficient(self, stats: torch.Tensor) -> dict[str, torch.Tensor]:
        return ais_coefficient(stats, self.params)

    def diagnostic_params(self) -> AISParams:
        """Its own parameters: ``mismatch/ais_lambda`` is then the lambda this corrector computes (before any EMA or
        ``fixed_lambda``), on the diagnostics' tokens (:meth:`Corrector.diagnostic_params`)."""
        return self.params


def ais_params(**overrides: Any) -> AISParams:
    """The ``AISParams`` that ``AIS(**overrides)`` uses (its defaults for everything not given)."""
    return AIS(**overrides).params
